"""`tokenmeter check-config` catches what a new user gets wrong (issue 32, item 3): a user's team
missing from `teams:` and misspelt field names are load errors with their line and the closest
name; `serve` refuses them too. The real CLI on real files: `check-config` in-process
(tests.helpers.tokenmeter), `serve` as a process of its own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import tokenmeter
from tests.servers import free_port

pytestmark = pytest.mark.timeout(120)

UPSTREAM = "upstreams:\n  up:\n    base_url: http://127.0.0.1:9/v1\n"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return tokenmeter(*args)


def _process(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "proxy.cli", *args],
                          capture_output=True, text=True, timeout=60, check=False)


def _write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "tm.yaml"
    path.write_text(UPSTREAM + body, encoding="utf-8")
    return path


TEAMS = (
    "teams:\n"                                   # 4
    "  platform: {daily_tokens: 100000}\n"       # 5
    "  research: {}\n"                           # 6
    "users:\n"                                   # 7
    "  alice:\n"                                 # 8
    "    keys: [sk-alice-0123456789]\n"          # 9
    "    team: platfrom\n"                       # 10
    "  bob:\n"                                   # 11
    "    keys: [sk-bob-0123456789]\n"            # 12
    "    team: marketing\n"                      # 13
    "  carol:\n"                                 # 14
    "    keys: [sk-carol-0123456789]\n"          # 15
    "    team: research\n"                       # 16
)


def test_a_team_missing_from_teams_is_an_error_with_a_suggestion(tmp_path: Path) -> None:
    path = _write(tmp_path, TEAMS)
    done = _cli("check-config", str(path))
    assert done.returncode == 1, done.stdout
    assert f"{path}:10: users.alice.team: no team 'platfrom' in `teams:`; did you mean " \
           "'platform'?" in done.stderr
    # Nothing close: no guess, but how to declare a team without limits.
    assert f"{path}:13: users.bob.team: no team 'marketing' in `teams:` (a team without " \
           "limits is `marketing: {}`)" in done.stderr
    assert "carol" not in done.stderr and "OK" not in done.stdout


def test_serve_refuses_a_team_missing_from_teams(tmp_path: Path) -> None:
    path = _write(tmp_path, TEAMS)
    done = _process("serve", "--config", str(path), "--port", "0")
    assert done.returncode == 2
    assert f"{path}:10: users.alice.team: no team 'platfrom'" in done.stderr


def test_without_a_teams_section_a_team_is_a_label_for_the_books(tmp_path: Path) -> None:
    path = _write(tmp_path, "users:\n  alice:\n    keys: [sk-alice-0123456789]\n"
                            "    team: research\n")
    done = _cli("check-config", str(path))
    assert done.returncode == 0, done.stderr


def test_misspelt_fields_get_the_closest_valid_name(tmp_path: Path) -> None:
    path = tmp_path / "tm.yaml"
    path.write_text(
        "upstreams:\n"                                         # 1
        "  up:\n"                                              # 2
        "    base_url: http://127.0.0.1:9/v1\n"                # 3
        "    retry: {max_atempts: 2}\n"                        # 4
        "cache:\n"                                             # 5
        "  enabeld: true\n"                                    # 6
        "users:\n"                                             # 7
        "  alice:\n"                                           # 8
        "    daily_tokns: 5000\n"                              # 9
        "    keys: [{key: sk-alice-0123456789, nmae: ci}]\n"   # 10
        "    model_limits: {'o1*': {montly_usd: 1}}\n"         # 11
        "    zzzzzz: 1\n",                                     # 12
        encoding="utf-8")
    done = _cli("check-config", str(path))
    assert done.returncode == 1
    for line, field, near in [
        (4, "upstreams.up.retry.max_atempts", "max_attempts"),
        (6, "cache.enabeld", "enabled"),
        (9, "users.alice.daily_tokns", "daily_tokens"),
        (10, "users.alice.keys.0.nmae", "name"),
        (11, "users.alice.model_limits.o1*.montly_usd", "monthly_usd"),
    ]:
        assert f"{path}:{line}: {field}: Extra inputs are not permitted (did you mean " \
               f"`{near}`?)" in done.stderr, done.stderr
    # Nothing close: the plain message.
    assert f"{path}:12: users.alice.zzzzzz: Extra inputs are not permitted\n" in done.stderr


# --- warnings: loads, but cannot work as meant (exit 0) -------------------------------------------
HURTS = """\
models:
  - {match: "gpt-4o*", upstream: up}
  - {match: "claude-*", upstream: up}
prices:
  "gpt-4o*": {input: 2.5, output: 10}
cache: {enabled: true}
capture: {enabled: true, sample: 0.1}
tags:
  feature: {values: [faq]}
  customer: {free: true}
teams:
  platform: {daily_tokens: 2000, monthly_usd: 50}
  research: {}
users:
  alice:
    team: platform
    daily_tokens: 1000
    keys: [{key: "sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", name: ci, tokens_per_minute: 100}]
  bob:
    keys: ["sha256:bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb", "sha256:cccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc"]
    max_output_tokens: 512
    daily_tokens: 1000
  carol:
    keys: ["sha256:dddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddd"]
    daily_tokens: 1000
    admission: {policy: clamp}
  dave:
    team: research
    keys: ["sha256:eeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeee"]
    daily_tokens: 100
    admission: {policy: clamp}
"""


def test_warnings_for_settings_that_cannot_work(tmp_path: Path) -> None:
    done = _cli("check-config", str(_write(tmp_path, HURTS)))
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning: ")]
    expected = [
        # A cost budget, and a routed model no price covers: its requests would be refused.
        "models[1] routes `claude-*`: no model it routes has a price in `prices`, while cost "
        "budgets are set (teams.platform.monthly_usd)",
        # Quotas below what one request reserves: the output cap under worst_case...
        "users.alice.daily_tokens (1000) is below the output cap every request reserves "
        "(4096, `max_output_tokens`) under `admission: worst_case`",
        "teams.platform.daily_tokens (2000) is below the output cap every request reserves (4096",
        "users.alice.keys[0].tokens_per_minute (100) is below the output cap every request "
        "reserves (4096",
        # ... the floor of a clamped request under clamp.
        "users.dave.daily_tokens (100) is below the fewest output tokens a clamped request is "
        "sent with (256, `admission.min_output_tokens`)",
        # Requests without temperature sample, and sampled requests bypass the cache.
        "cache: `cache_sampled: false` bypasses every request that samples",
    ]
    assert len(warnings) == len(expected), warnings
    for want, got in zip(expected, warnings, strict=True):
        assert want in got, (want, got)
    # bob's cap (512) fits his quota; carol is clamped with room for 256 tokens.
    assert "bob" not in done.stderr and "carol" not in done.stderr
    assert "OK with 6 warnings" in done.stdout


def test_a_sound_config_has_no_warnings(tmp_path: Path) -> None:
    body = HURTS.replace('"gpt-4o*": {input', '"*": {input').replace(
        "cache: {enabled: true}", "cache: {enabled: true, cache_sampled: true}").replace(
        "daily_tokens: 1000", "daily_tokens: 100000").replace(
        "daily_tokens: 2000", "daily_tokens: 200000").replace(
        "daily_tokens: 100\n", "daily_tokens: 100000\n").replace(
        "tokens_per_minute: 100", "tokens_per_minute: 10000")
    done = _cli("check-config", str(_write(tmp_path, body)))
    assert done.returncode == 0 and done.stderr == "", done.stderr


def test_a_cache_for_no_model_never_hits(tmp_path: Path) -> None:
    done = _cli("check-config", str(_write(tmp_path, "cache: {enabled: true, models: []}\n")))
    assert done.returncode == 0
    assert "warning: cache: `models: []` makes no model cacheable: the cache never hits" \
        in done.stderr


def test_the_summary_says_what_was_read(tmp_path: Path) -> None:
    done = _cli("check-config", str(_write(tmp_path, HURTS)))
    lines = done.stdout.splitlines()
    # Limits: the defaults' output cap, platform's 2, alice's and her key's, bob's 2, carol's,
    # dave's.
    assert lines[1:] == [
        "  mode: keys; 4 users, 2 teams, 5 keys, 9 limits set",
        "  1 upstreams, 2 model routes, 1 prices",
        "  capture: on (sample 0.1, errors always)",
        "  cache: on; tags: customer, feature",
    ]
    bare = _cli("check-config", str(_write(tmp_path, "")))
    assert bare.stdout.splitlines()[1:] == [
        "  mode: open; 0 users, 0 teams, 0 keys, 1 limits set",
        "  1 upstreams, 1 model routes, 0 prices",
        "  capture: off",
        "  cache: off; tags: none declared",
    ]


# --- --connect: the servers it names, tried -------------------------------------------------------
def _servers(store: str, ledger: str, capture: str) -> str:
    return (f"store: {{url: '{store}'}}\nledger: {{url: '{ledger}'}}\n"
            f"capture: {{enabled: true, url: '{capture}'}}\n")


def test_connect_reaches_redis_and_postgresql(tmp_path: Path, redis_url: str,
                                              pg_url: str) -> None:
    path = _write(tmp_path, _servers(redis_url, pg_url, pg_url))
    done = _cli("check-config", "--connect", str(path))
    assert done.returncode == 0, done.stdout + done.stderr
    for field in ("store.url", "ledger.url", "capture.url"):
        assert f"  {field} (" in done.stdout and "): reachable" in done.stdout
    assert "UNREACHABLE" not in done.stdout
    # Without --connect nothing is tried.
    assert "reachable" not in _cli("check-config", str(path)).stdout


def test_connect_reports_closed_ports(tmp_path: Path, redis_url: str) -> None:
    closed = free_port()  # nothing listens there
    ledger = f"postgresql://tm:s3cr3t-pw@127.0.0.1:{closed}/books"
    path = _write(tmp_path, _servers(f"redis://127.0.0.1:{closed}/0", ledger, ledger))
    done = _cli("check-config", "--connect", str(path))
    assert done.returncode == 1
    assert f"  store.url (redis://127.0.0.1:{closed}/0): UNREACHABLE: " in done.stdout
    for field in ("ledger.url", "capture.url"):
        assert f"  {field} (postgresql://tm:***@127.0.0.1:{closed}/books): UNREACHABLE: " \
            in done.stdout, done.stdout
    assert "s3cr3t" not in done.stdout + done.stderr
    # One reachable, one not: still a failure, and the reachable one said so.
    path = _write(tmp_path, _servers(redis_url, ledger, ledger))
    done = _cli("check-config", "--connect", str(path))
    assert done.returncode == 1
    assert f"  store.url ({redis_url}): reachable" in done.stdout


def test_a_glob_route_only_partly_priced_is_said_so(tmp_path: Path) -> None:
    body = ('models: [{match: "gpt-*", upstream: up}]\nprices: {"gpt-4o*": {input: 1, output: 1}}\n'
            f'users: {{ci: {{keys: ["sha256:{"f" * 64}"], monthly_usd: 5}}}}\n')
    done = _cli("check-config", str(_write(tmp_path, body)))
    assert done.returncode == 0
    assert "warning: models[0] routes `gpt-*`: not every model it routes has a price in " \
           "`prices`, while cost budgets are set (users.ci.monthly_usd)" in done.stderr
