"""What the proxy writes to its state directory is its user's alone (issue 31, item 13): the
SQLite ledger (with captures in it) and its -wal/-shm, the ledger's spool, the budget's
settlement spool and the shipper's `shipper.json` were 0644 (only the ledger's spool was 0600).
Every file it creates is 0600, every directory it creates 0700; one that was there keeps its
mode.

A real `tokenmeter serve` (its ledger shipper a process of its own), the openai SDK as its
client, the simulated upstream over loopback; the store is a Redis nobody listens on, so every
settlement goes to the budget's spool (fail_open)."""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import stat
from pathlib import Path

import openai
import pytest
from aiohttp.test_utils import TestServer

from tests.helpers import MESSAGES, until
from tests.servers import ServedProxy, free_port

pytestmark = pytest.mark.timeout(120)

KEY = "sk-alice-file-modes-test-key"


def _modes(root: Path) -> dict[str, int]:
    """Every file and directory under `root` (itself included), by path relative to it."""
    found = {".": stat.S_IMODE(root.stat().st_mode)}
    for path in root.rglob("*"):
        found[str(path.relative_to(root))] = stat.S_IMODE(path.lstat().st_mode)
    return found


def _assert_private(top: Path, state: Path) -> dict[str, int]:
    modes = _modes(top)
    dirs = {p for p in modes if (top / p).is_dir()}
    assert {p: oct(m) for p, m in modes.items() if p in dirs and m != 0o700} == {}
    assert {p: oct(m) for p, m in modes.items() if p not in dirs and m != 0o600} == {}
    return _modes(state)


async def test_every_file_and_directory_the_proxy_creates_is_private(
    upstream: TestServer, tmp_path: Path,
) -> None:
    before = stat.S_IMODE(tmp_path.stat().st_mode)
    top = tmp_path / "fresh"  # neither it nor the state directory in it exists yet
    state = top / "tokenmeter"
    config = tmp_path / "tm.yaml"
    config.write_text(
        f"upstreams:\n  mock:\n    base_url: {upstream.make_url('/v1')}\n"
        "metrics:\n  discover_models: false\n"
        f"store:\n  url: redis://127.0.0.1:{free_port()}/0\n  on_error: fail_open\n"
        "  timeout_ms: 200\n"
        f"users:\n  alice:\n    keys: [{KEY}]\n    daily_tokens: 1000000\n"
        "capture:\n  enabled: true\n  sample: 1.0\n"
    )
    proxy = ServedProxy(config, tmp_path / "proxy.log", env={"TOKENMETER_STATE_DIR": str(state)})
    try:
        umask = os.umask(0o022)  # the usual one, inherited by the proxy, whatever the runner's
        try:
            await proxy.started()
        finally:
            os.umask(umask)
        client = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key=KEY, max_retries=0)
        async with client:
            await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
            stream = await client.chat.completions.create(model="mock-gpt", messages=MESSAGES,
                                                          stream=True)
            async for _ in stream:
                pass

        def written() -> bool:
            names = {p.name for p in state.iterdir()}
            owed = [p for p in state.glob("spool-*.jsonl") if p.stat().st_size > 0]
            return {"ledger.sqlite3", "ledger.sqlite3-wal", "ledger.sqlite3-shm",
                    "shipper.json"} <= names and bool(owed)

        # State in other processes (the shipper, the capture writer's thread): polled.
        await until(written, deadline=30)
        running = _assert_private(top, state)
        assert any(p.startswith("ledger-") and p.endswith(".jsonl") for p in running), running
        assert any(p.startswith("spool-") and p.endswith(".lock") for p in running), running

        assert await proxy.stopped(signal.SIGTERM) == 0
        # At stop the settlement spool is rewritten whole (a new file renamed over it): kept,
        # since the store still has not taken what it owes.
        stopped = _assert_private(top, state)
        assert any(p.startswith("spool-") and p.endswith(".jsonl") for p in stopped), stopped
    finally:
        proxy.kill()
    # What was there before the proxy keeps its mode.
    assert stat.S_IMODE(tmp_path.stat().st_mode) == before
    # The file whose modes were checked is the one holding the books and the captures.
    with contextlib.closing(sqlite3.connect(state / "ledger.sqlite3")) as db:
        assert db.execute("SELECT count(*) FROM tokenmeter_requests").fetchone() == (2,)
        assert db.execute("SELECT count(*) FROM tokenmeter_captures").fetchone() == (2,)
