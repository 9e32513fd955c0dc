"""`tokenmeter check-config` on configurations that load but would hurt (issue 20, item 21): an
upstream `base_url` carrying credentials is refused, naming the field and never the password;
a file every user can read that holds secrets in clear gets a warning naming the fields, never
their values. The real CLI in a subprocess, on real files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.config.load import ConfigError, load_config

pytestmark = pytest.mark.timeout(60)

SECRET = "s3cr3t-Pa55word"
RAW_KEY = "sk-alice-raw-key-0123456789"
HASHED = "sha256:" + "ab" * 32


def _check(path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ALICE_API_KEY": "sk-alice-from-the-environment"}
    return subprocess.run([sys.executable, "-m", "proxy.cli", "check-config", str(path)],
                          capture_output=True, text=True, timeout=30, check=False, env=env)


def _write(tmp_path: Path, text: str, mode: int) -> Path:
    path = tmp_path / "tm.yaml"
    path.write_text(text, encoding="utf-8")
    path.chmod(mode)
    return path


def _config(base_url: str = "http://127.0.0.1:9/v1", keys: str = f'["{HASHED}"]',
            api_key: str = "${UPSTREAM_KEY:-}") -> str:
    return f"""
upstreams:
  up:
    base_url: {base_url}
    api_key: "{api_key}"
models:
  - match: "*"
    upstream: up
users:
  alice:
    keys: {keys}
"""


@pytest.mark.parametrize("base_url", [
    f"http://user:{SECRET}@127.0.0.1:9/v1",
    f"https://{SECRET}@api.example.com/v1",
    f"http://:{SECRET}@[::1]:9/v1",
])
def test_an_upstream_url_with_credentials_is_refused(tmp_path: Path, base_url: str) -> None:
    path = _write(tmp_path, _config(base_url), 0o600)
    done = _check(path)
    assert done.returncode == 1, done.stdout
    assert "upstreams.up.base_url" in done.stderr and "credentials" in done.stderr
    assert SECRET not in done.stderr + done.stdout
    with pytest.raises(ConfigError):  # serve loads the same way: it refuses to start too
        load_config(path)


def test_an_upstream_url_without_credentials_passes(tmp_path: Path) -> None:
    done = _check(_write(tmp_path, _config("http://127.0.0.1:9/v1?x=a@b"), 0o600))
    assert done.returncode == 0, done.stderr
    assert "warning" not in done.stderr


def test_a_world_readable_file_with_raw_keys_is_warned_about(tmp_path: Path) -> None:
    keys = f'["{RAW_KEY}", "{HASHED}", {{key: "{RAW_KEY}x"}}, "${{A_KEY:-{RAW_KEY}y}}"]'
    path = _write(tmp_path, _config(keys=keys, api_key="sk-upstream-in-clear"), 0o644)
    done = _check(path)
    assert done.returncode == 0, done.stderr  # a warning, not a refusal
    warning = done.stderr
    assert "readable by every user" in warning and "0644" in warning
    assert "users.alice.keys[0]" in warning and "users.alice.keys[2]" in warning
    assert "users.alice.keys[3]" in warning  # a ${VAR:-default}'s default is in the file
    assert "users.alice.keys[1]" not in warning  # hashed: nothing to hide
    assert "upstreams.up.api_key" in warning and "sha256:<hex>" in warning
    assert RAW_KEY not in warning and "sk-upstream-in-clear" not in warning


@pytest.mark.parametrize(("mode", "keys", "api_key"), [
    (0o600, f'["{RAW_KEY}"]', "sk-upstream-in-clear"),  # only its owner can read it
    (0o640, f'["{RAW_KEY}"]', "sk-upstream-in-clear"),  # and its group
    (0o644, f'["{HASHED}"]', "${UPSTREAM_KEY:-}"),  # readable, but nothing in clear
    (0o644, '["${ALICE_API_KEY}"]', ""),  # from the environment
])
def test_no_warning_without_exposure(tmp_path: Path, mode: int, keys: str, api_key: str) -> None:
    done = _check(_write(tmp_path, _config(keys=keys, api_key=api_key), mode))
    assert done.returncode == 0, done.stderr
    assert "warning" not in done.stderr, done.stderr
