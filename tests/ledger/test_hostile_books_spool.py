"""The settlement spool under hostile conditions (issue 20, items 11 and 12): a malformed line
never stops a process from starting and is never skipped silently; a full disk with the store
down reports a settlement lost only when it is lost for good."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis
from aiohttp.test_utils import TestServer

from proxy.budget.limits import daily_key
from proxy.budget.spool import Debit, SettleSpool
from proxy.budget.store import SettleKind, WindowAmount
from proxy.budget.usage_report import today
from proxy.pipeline import services as st
from tests.helpers import (
    ALICE_KEY,
    MESSAGES,
    StackFactory,
    make_config,
    redis_int,
    sample,
    scrape,
    until,
)
from tests.servers import RedisServer

SLOT = "tokenmeter:{alice}"
KEY = f"{SLOT}:u:daily_tokens:20261203"


def _entries(amount: int) -> tuple[WindowAmount, ...]:
    return (WindowAmount(KEY, None, amount, 3600),)


@pytest.mark.timeout(60)
async def test_malformed_spool_lines_are_skipped_counted_and_named_not_fatal(
    make_stack: StackFactory, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    state = Path(os.environ["TOKENMETER_STATE_DIR"])
    # What a previous run left owed: one settlement under its id, one sum of the outage.
    dead = SettleSpool(state)
    dead.open()
    dead.owe(Debit(slot=SLOT, res_id="res-good", entries=_entries(40), tokens=40,
                    kind=SettleKind.ADDITION), now=10**10)
    dead.add(Debit(slot=SLOT, res_id="", entries=_entries(7), tokens=7,
                    kind=SettleKind.ADDITION), now=10**10)
    dead.close()  # a graceful stop: the file stays for the next start to adopt
    (path,) = state.glob("spool-*.jsonl")
    good_lines = path.read_text().count("\n")
    bad = [
        "5",  # valid JSON, not a record: on main, `"o" in 5` raised and every start failed
        json.dumps({"o": SLOT, "i": "res-x", "t": 3}),  # a record missing its entries
        json.dumps({"a": SLOT, "e": [[KEY, "lots", 1e10]], "t": 9}),  # a field of the wrong type
        '{"o":"tokenmeter:{alice}","i":"res-y","t":1030,"e":[["tokenm',  # garbled on disk
        json.dumps({"a": SLOT, "e": [[KEY, 11, 1e10]], "t": 11}),  # a good one after them
    ]
    with path.open("a") as f:
        f.write("\n".join(bad) + "\n")

    caplog.set_level(logging.INFO, logger="tokenmeter")
    config = make_config("http://127.0.0.1:9/v1", store=redis_url)
    stack = await make_stack(config)  # on main: the start raised (TypeError) and never served

    r = aioredis.Redis.from_url(redis_url)
    try:
        assert await redis_int(r, KEY) == 40 + 7 + 11  # every readable settlement replayed
    finally:
        await r.aclose()
    metrics = await scrape(stack.proxy)
    assert sample(metrics, "tokenmeter_settle_spool_bad_lines_total") == 4
    errors = [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.ERROR]
    numbers = ", ".join(str(good_lines + i) for i in (1, 2, 3, 4))
    assert any(str(path) in m and f"line {numbers}" in m for m in errors), errors
    assert (path.parent / (path.name + ".bad")).exists()  # kept for an operator to look at


@pytest.fixture
def full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The state directory on a 64 KiB tmpfs, which the test fills (`_fill`) once the proxy
    has opened its files."""
    where = tmp_path / "tiny"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)], check=True)
    monkeypatch.setenv("TOKENMETER_STATE_DIR", str(where))
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


def _fill(where: Path) -> None:
    fd = os.open(where / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with contextlib.suppress(OSError):
            while os.write(fd, b"\0" * 4096):
                pass
    finally:
        os.close(fd)
    with pytest.raises(OSError):  # not one more page
        (where / "probe").write_bytes(b"x")


async def _ask(s: aiohttp.ClientSession, url: str) -> int:
    async with s.post(url, json={"model": "mock-gpt", "messages": MESSAGES},
                      headers={"Authorization": f"Bearer {ALICE_KEY}"}) as resp:
        assert resp.status == 200
        total: int = (await resp.json())["usage"]["total_tokens"]
        return total


@pytest.mark.timeout(90)
async def test_a_full_disk_and_a_store_outage_report_a_loss_only_when_it_is_final(
    make_stack: StackFactory, upstream: TestServer, full_disk: Path,
    caplog: pytest.LogCaptureFixture
) -> None:
    server = RedisServer(persistent=True)  # its counters survive the restart, like production
    server.start()
    r = aioredis.Redis.from_url(server.url)
    config = make_config(
        str(upstream.make_url("/v1")),
        store={"url": server.url, "on_error": "fail_open", "timeout_ms": 500},
        users={"alice": {"keys": [ALICE_KEY], "daily_tokens": 10_000_000}},
        extra={"ledger": {"enabled": False}},
    )
    key = daily_key("tokenmeter", "alice", "daily_tokens",
                    today(config, time.time()).strftime("%Y%m%d"))
    try:
        stack = await make_stack(config)
        url = str(stack.proxy.make_url("/v1/chat/completions"))
        metrics = stack.app[st.SERVICES].metrics.registry
        _fill(full_disk)
        async with aiohttp.ClientSession() as s:
            total = await _ask(s, url)
            server.stop()  # the store goes away while the disk is full
            for _ in range(20):
                total += await _ask(s, url)
            server.start()
            await r.aclose()
            r = aioredis.Redis.from_url(server.url)

            async def delivered() -> bool:
                return int(await r.get(key) or 0) == total

            await until(delivered, deadline=30)  # from memory: nothing reached the disk
            # On main: 20 "LOST a settlement" lines and their tokens counted as lost, for usage
            # that reached the store a second later.
            assert metrics.get_sample_value("tokenmeter_settlement_tokens_lost_total") == 0
            assert not [m for m in caplog.messages if "LOST" in m]

            # Lost for good: the store is down again, the disk still full, and the proxy stops.
            server.stop()
            owed = 0
            for _ in range(5):
                owed += await _ask(s, url)
        await stack.proxy.close()
        assert metrics.get_sample_value("tokenmeter_settlement_tokens_lost_total") == owed
        assert [m for m in caplog.messages if "LOST" in m and f"({owed} tokens)" in m]
    finally:
        await r.aclose()
        server.stop()


@pytest.mark.timeout(90)
async def test_sums_on_disk_wait_for_the_disk_and_are_applied_once(
    make_stack: StackFactory, upstream: TestServer, full_disk: Path,
    caplog: pytest.LogCaptureFixture
) -> None:
    """Usage summed during an outage: what reached the file waits for the disk (sealed under an
    id the file does not know, an adopter would apply it again); what only memory holds is
    replayed at once. Every token reaches the store exactly once, none is reported lost."""
    server = RedisServer(persistent=True)
    server.start()
    r = aioredis.Redis.from_url(server.url)
    config = make_config(
        str(upstream.make_url("/v1")),
        store={"url": server.url, "on_error": "fail_open", "timeout_ms": 500},
        users={"alice": {"keys": [ALICE_KEY], "daily_tokens": 10_000_000}},
        extra={"ledger": {"enabled": False}},
    )
    key = daily_key("tokenmeter", "alice", "daily_tokens",
                    today(config, time.time()).strftime("%Y%m%d"))
    try:
        stack = await make_stack(config)
        url = str(stack.proxy.make_url("/v1/chat/completions"))
        metrics = stack.app[st.SERVICES].metrics.registry
        async with aiohttp.ClientSession() as s:
            total = await _ask(s, url)
            server.stop()
            on_disk = 0
            for _ in range(5):  # spooled to the file
                on_disk += await _ask(s, url)
            _fill(full_disk)
            in_memory = 0
            for _ in range(5):  # the disk is full: memory only
                in_memory += await _ask(s, url)
            server.start()
            await r.aclose()
            r = aioredis.Redis.from_url(server.url)

            owed = on_disk + in_memory

            async def split() -> bool:
                # Memory's share replayed; the file's waits, owed (a record or two may still
                # have fit in the file's last page after the disk filled).
                applied = int(await r.get(key) or 0) - total
                waiting = metrics.get_sample_value("tokenmeter_settle_backlog_tokens") or 0
                return applied > 0 and waiting > 0 and applied + waiting == owed

            await until(split, deadline=30)
            (full_disk / "filler").unlink()  # the disk has room again

            async def replayed() -> bool:
                return int(await r.get(key) or 0) == total + owed

            await until(replayed, deadline=30)
        await stack.proxy.close()
        assert int(await r.get(key) or 0) == total + owed  # once each
        assert metrics.get_sample_value("tokenmeter_settlement_tokens_lost_total") == 0
        assert not list(full_disk.glob("spool-*.jsonl"))  # nothing owed any more
    finally:
        await r.aclose()
        server.stop()
