"""`tokenmeter captures` names the store it read (a PostgreSQL password masked), and `list`
shows times in the configuration's time zone (issue 32, item 9)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from tests.capture.captures import capture
from tests.capture.test_cli import T0, captures, write


def test_every_captures_command_names_its_store(store_url: str) -> None:
    write(store_url, [capture("r1", T0)])
    url = store_url.replace("postgresql://postgres@", "postgresql://postgres:hunter2@")
    shown = url.replace(":hunter2@", ":***@")
    for args in (["list"], ["list", "--format", "json"], ["show", "r1"], ["export"]):
        done = captures(*args, "--url", url)
        assert done.returncode == 0, done.stderr
        assert done.stderr.splitlines()[0] == f"store: {shown}", args
        assert "hunter2" not in done.stderr + done.stdout
    done = captures("show", "nothing", "--url", url)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [f"store: {shown}",
                                        "no capture of request 'nothing' in the store"]


def test_the_default_store_is_named_too(tmp_path: Path) -> None:
    write(f"sqlite://{tmp_path / 'ledger.sqlite3'}", [capture("r1", T0)])
    done = captures("list", env={"TOKENMETER_STATE_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert done.stderr == f"store: sqlite://{tmp_path / 'ledger.sqlite3'}\n"


def test_list_shows_times_in_the_configured_zone(tmp_path: Path) -> None:
    url = f"sqlite://{tmp_path / 'captures.sqlite3'}"
    write(url, [capture("summer", T0 - 120 * 86_400), capture("winter", T0)])
    config = tmp_path / "tm.yaml"
    config.write_text(yaml.safe_dump({
        "upstreams": {"u": {"base_url": "http://127.0.0.1:9/v1"}},
        "models": [{"match": "*", "upstream": "u"}],
        "timezone": "Europe/Paris",
    }))
    done = captures("list", "--config", str(config), "--url", url)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split()[:3] == ["started", "(Europe/Paris)", "request_id"]
    # T0 is 2025-11-24T16:00:00Z: 17:00 in Paris in winter; 120 days before, summer time.
    assert lines[1].split()[:2] == ["2025-11-24T17:00:00.000+01:00", "winter"]
    assert lines[2].split()[:2] == ["2025-07-27T18:00:00.000+02:00", "summer"]
    # JSON keeps the epoch seconds it always had.
    done = captures("list", "--config", str(config), "--url", url, "--format", "json")
    assert [r["started_at"] for r in json.loads(done.stdout)] == [T0, T0 - 120 * 86_400]
