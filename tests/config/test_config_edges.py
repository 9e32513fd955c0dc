"""Configuration mistakes YAML and pydantic would let through silently: refused, with their line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from proxy.config.load import ConfigError, load_config, parse_config

UPSTREAM = "upstreams:\n  a:\n    base_url: http://127.0.0.1:1/v1\n"
BOOL_MSG = "must be a number, not a boolean"


def _error(text: str) -> str:
    with pytest.raises(ConfigError) as err:
        parse_config(text, "tm.yaml")
    return str(err.value)


def test_user_written_twice_is_refused_at_its_second_line() -> None:
    text = UPSTREAM + (
        "users:\n"                                  # 4
        "  alice:\n"                                # 5
        '    keys: ["sk-alice-first-0123"]\n'       # 6
        "  bob:\n"                                  # 7
        '    keys: ["sk-bob-0123456789"]\n'         # 8
        "  alice:\n"                                # 9
        '    keys: ["sk-alice-second-0123"]\n'      # 10
    )
    assert _error(text) == (
        "tm.yaml:9: users.alice: duplicate key, also given at line 5 "
        "(YAML would keep only the last)"
    )


@pytest.mark.parametrize(
    ("text", "where"),
    [
        # top level
        (UPSTREAM + "timezone: UTC\n" + UPSTREAM, "tm.yaml:5: upstreams:"),
        # a field of a mapping two levels down
        ("upstreams:\n  a:\n    base_url: http://x\n    api_key: k\n    base_url: http://y\n",
         "tm.yaml:5: upstreams.a.base_url:"),
        # inside a list item
        (UPSTREAM + "models:\n  - match: '*'\n    upstream: a\n    match: 'gpt*'\n",
         "tm.yaml:7: models.0.match:"),
        # a limit of a user's key, in flow style on one line
        (UPSTREAM + "users:\n  alice:\n    keys:\n"
         "      - {key: sk-alice-0123456789, daily_tokens: 5, daily_tokens: 500}\n",
         "tm.yaml:7: users.alice.keys.0.daily_tokens:"),
        # a model glob of a user's model_limits
        (UPSTREAM + "users:\n  alice:\n    model_limits:\n      'o1*': {daily_tokens: 1}\n"
         "      'o1*': {daily_tokens: 2}\n", "tm.yaml:8: users.alice.model_limits.o1*:"),
    ],
)
def test_duplicate_keys_at_any_depth_name_the_second_line(text: str, where: str) -> None:
    message = _error(text)
    assert message.startswith(where), message
    assert "duplicate key" in message


def test_merge_key_override_is_not_a_duplicate() -> None:
    # `<<: *anchor` then an explicit key is YAML's way to override: it must stay allowed.
    cfg = parse_config(
        "upstreams:\n"
        "  a: &base {base_url: http://127.0.0.1:1/v1, connect_timeout_s: 3}\n"
        "  b:\n    <<: *base\n    base_url: http://127.0.0.1:2/v1\n"
        "models:\n  - {match: 'a*', upstream: a}\n  - {match: '*', upstream: b}\n"
    )
    assert cfg.upstreams["b"].base_url == "http://127.0.0.1:2/v1"
    assert cfg.upstreams["b"].connect_timeout_s == 3


def test_two_keys_of_one_user_with_one_name_are_refused() -> None:
    users = (
        "users:\n  alice:\n    keys:\n"
        "      - {key: sk-alice-laptop-0123, name: ci, daily_tokens: 100}\n"
        "      - sk-alice-plain-0123\n"
        "      - {key: sk-alice-server-0123, name: ci, daily_tokens: 100}\n"
    )
    assert _error(UPSTREAM + users) == (
        "tm.yaml:6: users.alice.keys: keys[0] and keys[2] are both named 'ci': "
        "each key of a user needs its own name"
    )
    # The same name under two users is two counters (each user has its own): allowed.
    ok = parse_config(
        UPSTREAM + "users:\n"
        "  alice:\n    keys: [{key: sk-alice-0123456789, name: ci, daily_tokens: 1}]\n"
        "  bob:\n    keys: [{key: sk-bob-0123456789, name: ci, daily_tokens: 1}]\n"
    )
    assert set(ok.users) == {"alice", "bob"}


@pytest.mark.parametrize(
    ("yaml_text", "where"),
    [
        ("users:\n  alice:\n    daily_tokens: yes\n", "tm.yaml:6: users.alice.daily_tokens:"),
        ("defaults:\n  max_output_tokens: no\n", "tm.yaml:5: defaults.max_output_tokens:"),
        ("users:\n  alice:\n    keys: [{key: sk-alice-0123456789, tokens_per_minute: on}]\n",
         "tm.yaml:6: users.alice.keys.0.tokens_per_minute:"),
        ("users:\n  alice:\n    model_limits: {'o1*': {daily_tokens: off}}\n",
         "tm.yaml:6: users.alice.model_limits.o1*.daily_tokens:"),
        ("server:\n  port: true\n", "tm.yaml:5: server.port:"),
        ("server:\n  drain_seconds: false\n", "tm.yaml:5: server.drain_seconds:"),
        ("store:\n  lease_seconds: true\n", "tm.yaml:5: store.lease_seconds:"),
        ("metrics:\n  port: yes\n", "tm.yaml:5: metrics.port:"),
        ("prices:\n  gpt-4o: {input: 2.5, output: true}\n", "tm.yaml:5: prices.gpt-4o.output:"),
        ("alerts:\n  thresholds: [0.5, yes]\n", "tm.yaml:5: alerts.thresholds:"),
    ],
)
def test_booleans_are_refused_for_numbers(yaml_text: str, where: str) -> None:
    message = _error(UPSTREAM + yaml_text)
    assert message.startswith(where), message
    assert BOOL_MSG in message


@pytest.mark.parametrize(
    ("field", "value"),
    [("connect_timeout_s", "yes"), ("idle_timeout_s", "true"), ("total_timeout_s", "on"),
     ("first_byte_timeout_s", "no")],
)
def test_booleans_are_refused_for_upstream_timeouts(field: str, value: str) -> None:
    message = _error(f"{UPSTREAM}    {field}: {value}\n")
    assert message.startswith(f"tm.yaml:4: upstreams.a.{field}: {BOOL_MSG}"), message


def test_booleans_are_refused_inside_lists_of_numbers() -> None:
    message = _error(UPSTREAM + "    retry:\n      on_status: [429, true]\n")
    assert message.startswith(f"tm.yaml:5: upstreams.a.retry.on_status: {BOOL_MSG}"), message


def test_numbers_ints_for_floats_env_strings_and_real_booleans_still_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TM_TEST_PORT", "9090")
    monkeypatch.setenv("TM_TEST_QUOTA", "5000")
    cfg = parse_config(
        "server:\n  port: ${TM_TEST_PORT}\n  drain_seconds: 5\n"
        "upstreams:\n  a:\n    base_url: http://127.0.0.1:1/v1\n    connect_timeout_s: 3\n"
        "    stream_usage: no\n"
        "metrics:\n  discover_models: off\n"
        "users:\n  alice:\n    keys: ['sk-alice-0123456789']\n    daily_tokens: ${TM_TEST_QUOTA}\n"
        "prices:\n  m: {input: 1, output: 2}\n"
    )
    assert cfg.server.port == 9090 and cfg.server.drain_seconds == 5.0
    assert cfg.upstreams["a"].connect_timeout_s == 3.0
    assert cfg.upstreams["a"].stream_usage is False and cfg.metrics.discover_models is False
    assert cfg.users["alice"].daily_tokens == 5000
    assert cfg.prices["m"].output == 2.0


def _check_config(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy.cli", "check-config", str(path)],
        capture_output=True, text=True, timeout=60, check=False,
    )


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("users:\n  alice:\n    keys: ['sk-alice-0123456789']\n"
         "  alice:\n    keys: ['sk-alice-9876543210']\n",
         ":7: users.alice: duplicate key, also given at line 5"),
        ("users:\n  alice:\n    keys:\n      - {key: sk-alice-0123456789, name: ci}\n"
         "      - {key: sk-alice-9876543210, name: ci}\n",
         ":6: users.alice.keys: keys[0] and keys[1] are both named 'ci'"),
        ("users:\n  alice:\n    keys: ['sk-alice-0123456789']\n    daily_tokens: yes\n",
         f":7: users.alice.daily_tokens: {BOOL_MSG}"),
    ],
)
def test_check_config_refuses_them(tmp_path: Path, body: str, expected: str) -> None:
    path = tmp_path / "tm.yaml"
    path.write_text(UPSTREAM + body)
    with pytest.raises(ConfigError) as err:  # what `serve` would load
        load_config(path)
    assert f"{path}{expected}" in str(err.value)
    proc = _check_config(path)
    assert proc.returncode == 1, proc.stdout
    assert f"{path}{expected}" in proc.stderr
    assert "OK" not in proc.stdout


def test_a_file_that_is_not_utf8_is_refused_not_a_traceback(tmp_path: Path) -> None:
    path = tmp_path / "tm.yaml"
    path.write_bytes(UPSTREAM.encode() + b"timezone: \xff\n")
    proc = _check_config(path)
    assert proc.returncode == 1
    assert f"{path}: not UTF-8" in proc.stderr and "Traceback" not in proc.stderr
