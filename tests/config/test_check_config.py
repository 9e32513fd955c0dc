"""`tokenmeter check-config` catches what a new user gets wrong (issue 32, item 3): a user's team
missing from `teams:` and misspelt field names are load errors with their line and the closest
name; `serve` refuses them too. The real CLI in a subprocess, on real files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

UPSTREAM = "upstreams:\n  up:\n    base_url: http://127.0.0.1:9/v1\n"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
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
    done = _cli("serve", "--config", str(path), "--port", "0")
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
