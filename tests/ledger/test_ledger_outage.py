"""The ledger while its PostgreSQL is down: rows wait in the spool, health says so, and when
the database is back every row lands exactly once. A PostgreSQL cluster of this module's own,
on a free port (the machine's is never stopped)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from aiohttp.test_utils import TestServer

from proxy.budget import limits as lim
from proxy.budget.store import USER, WindowAmount
from proxy.capture.record import Capture
from proxy.capture.store import CaptureFilter, CaptureStore
from proxy.capture.writer import CaptureWriter
from proxy.config.ledger import LedgerConfig
from proxy.ledger.ledger import Ledger
from proxy.ledger.row import LedgerRow
from proxy.ledger.schema import TABLE
from proxy.ledger.sink_postgres import PostgresSink
from proxy.pipeline import services as st
from proxy.reconcile.audit import Auditor
from proxy.telemetry.metrics import Metrics
from tests.capture.captures import capture
from tests.helpers import ALICE_KEY, MESSAGES, StackFactory, exported, make_config, until
from tests.servers import PostgresServer

NOW = 1_796_000_000.0


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    server = PostgresServer()
    server.start()
    yield server
    server.destroy()


@pytest.fixture
async def db(postgres: PostgresServer) -> AsyncIterator[str]:
    """A database of this test's own in the module's cluster (started if a test stopped it)."""
    if not await _accepts(postgres.url):
        await asyncio.to_thread(postgres.start)
    name = f"tm_outage_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(postgres.url)
    try:
        await admin.execute(f"CREATE DATABASE {name}")
    finally:
        await admin.close()
    yield postgres.url.rsplit("/", 1)[0] + f"/{name}"


async def _accepts(url: str) -> bool:
    try:
        conn = await asyncpg.connect(url, timeout=2)
    except (OSError, asyncpg.PostgresError):
        return False
    await conn.close()
    return True


def make_row(i: int) -> LedgerRow:
    return LedgerRow(
        request_id=f"out-{i:06d}", started_at=NOW + i, ended_at=time.time(), replica="r1",
        user_name=f"user{i % 5}", key_name=None, team="t", operation="chat",
        requested_model="m", model="m", response_model="m", upstream="u", fallback_from=None,
        attempts=1, status=200, error_class="none", stream=True, input_tokens=10 + i,
        output_tokens=5, cached_input_tokens=0, reasoning_tokens=0, token_source="reported",
        ttft_ms=1.0, upstream_ttft_ms=1.0, overhead_ms=0.1, duration_ms=3.0,
        output_tokens_per_s=100.0, cost_nanousd=1000 + i, price_version="p", windows="",
    )


async def stored_ids(url: str) -> list[str]:
    conn = await asyncpg.connect(url)
    try:
        return [r[0] for r in await conn.fetch(f"SELECT request_id FROM {TABLE}")]
    finally:
        await conn.close()


async def poll(condition: Callable[[], bool], step: Callable[[], Any] | None = None) -> None:
    """Until `condition()` holds (calling `step` between looks), or fail after 20 s."""
    deadline = time.monotonic() + 20
    while not condition():
        assert time.monotonic() < deadline, "condition not reached before the deadline"
        if step is not None:
            step()
        await asyncio.sleep(0.02)


def sample(metrics: Metrics, name: str, labels: dict[str, str] | None = None) -> float:
    return exported(metrics, name, labels)


async def test_rows_wait_while_postgres_is_down_and_land_once(
        postgres: PostgresServer, db: str, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "tokenmeter.ledger")
    metrics = Metrics()
    ledger = Ledger(LedgerConfig(url=db, batch_rows=100), metrics, state_dir=tmp_path)
    await ledger.start()
    assert ledger.health().ok
    n = 0

    def record(count: int) -> None:
        nonlocal n
        for _ in range(count):
            ledger.record(make_row(n))
            n += 1

    record(300)
    assert await ledger.flush(20)

    # As good as a kill -9, on a cluster running with synchronous_commit=off: the ledger's
    # commits must be durable anyway (the spool forgets what was committed).
    await asyncio.to_thread(postgres.stop, "immediate")
    # Requests keep settling; the shipper fails (or sees its connection closed), health says so.
    await poll(lambda: not ledger.health().ok, step=lambda: record(10))
    record(10)
    down = ledger.health()
    assert "failing" in down.detail and down.pending_rows > 0
    record(500)  # more while it stays down

    def failures() -> float:
        return sum(sample(metrics, "tokenmeter_ledger_errors_total", {"stage": stage})
                   for stage in ("ship", "connect"))

    # Down for several retries (each counted), with requests settling all along.
    await poll(lambda: failures() >= 4, step=lambda: record(5))
    assert not await ledger.flush(0.2)
    await until(lambda: not ledger.health().ok and ledger.health().pending_rows >= 500)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, "loud once per outage, not once per retry"
    assert sample(metrics, "tokenmeter_ledger_up") == 0
    assert sample(metrics, "tokenmeter_ledger_spool_rows") > 0  # the gauges are kept current

    await asyncio.to_thread(postgres.start)
    record(200)
    assert await ledger.flush(30)
    ids = await stored_ids(db)
    assert len(ids) == len(set(ids)) == n
    assert sorted(ids) == [make_row(i).request_id for i in range(n)]
    # The shipper process's word, written after each batch: looked at until it is there.
    await until(lambda: ledger.health().ok and ledger.health().pending_rows == 0)
    assert sample(metrics, "tokenmeter_ledger_up") == 1
    await ledger.stop(5)


async def test_rows_left_at_stop_ship_at_the_next_start(
        postgres: PostgresServer, db: str, tmp_path: Path) -> None:
    first = Ledger(LedgerConfig(url=db), Metrics(), state_dir=tmp_path)
    await first.start()
    for i in range(50):
        first.record(make_row(i))
    assert await first.flush(20)
    await asyncio.to_thread(postgres.stop, "fast")
    for i in range(50, 400):
        first.record(make_row(i))
    started = time.monotonic()
    await first.stop(0.5)  # SIGTERM while the database is down: the drain gives up in time
    assert time.monotonic() - started < 10
    assert any(p.name.endswith(".jsonl") for p in tmp_path.iterdir())

    await asyncio.to_thread(postgres.start)
    second = Ledger(LedgerConfig(url=db), Metrics(), state_dir=tmp_path)
    await second.start()
    assert second.health().pending_rows <= 350  # (maybe a batch already went)
    assert await second.flush(20)
    ids = await stored_ids(db)
    assert len(ids) == len(set(ids)) == 400
    await second.stop(5)
    assert not any(p.name.startswith("ledger-") for p in tmp_path.iterdir())


async def test_a_database_down_at_start_does_not_block_it(
        postgres: PostgresServer, db: str, tmp_path: Path) -> None:
    await asyncio.to_thread(postgres.stop, "fast")
    ledger = Ledger(LedgerConfig(url=db), Metrics(), state_dir=tmp_path)
    started = time.monotonic()
    await ledger.start()
    assert time.monotonic() - started < 5
    assert not ledger.health().ok
    rows = [make_row(i)._replace(request_id=f"early-{i}") for i in range(20)]
    for row in rows:
        ledger.record(row)
    await asyncio.to_thread(postgres.start)
    assert await ledger.flush(30)  # connects, migrates, ships
    assert sorted(await stored_ids(db)) == sorted(r.request_id for r in rows)
    await until(lambda: ledger.health().ok)
    await ledger.stop(5)


# --- every wing with a PostgreSQL connection comes back after a restart -------------------------

async def _restart(postgres: PostgresServer) -> None:
    """A clean restart: every connection to it is closed under its holder."""
    await asyncio.to_thread(postgres.stop)
    await asyncio.to_thread(postgres.start)


async def test_the_in_process_reconcile_comes_back_after_postgres_restarts(
        postgres: PostgresServer, db: str, redis_url: str, make_stack: StackFactory,
        upstream: TestServer) -> None:
    """On main the audit's reader kept its closed connection: `connection is closed` at every
    round until the proxy restarted, the drift gauge frozen. Now a reading that cannot read
    the ledger is counted (`tokenmeter_reconcile_failures_total{reason="ledger"}`, which
    TokenmeterReconcileFailing watches), the reader is opened again, and drift made after the
    restart is reported."""
    config = make_config(str(upstream.make_url("/v1")), store=redis_url,
                         users={"alice": {"keys": [ALICE_KEY], "daily_tokens": 100_000}},
                         extra={"ledger": {"url": db, "reconcile_every_s": 0}})
    stack = await make_stack(config)
    client = stack.client(ALICE_KEY)
    for _ in range(2):
        await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
    await stack.settled(2)
    svc = stack.app[st.SERVICES]
    assert svc.ledger is not None and await svc.ledger.flush(30)
    metrics = svc.metrics
    auditor = Auditor(svc.budget.store, metrics)

    def failures() -> float:
        return exported(metrics, "tokenmeter_reconcile_failures_total", {"reason": "ledger"})

    try:
        for _ in range(2):
            judged = await auditor.once(config)
            assert judged is not None and judged.agrees
        assert failures() == 0
        # Down: the reading fails, counted.
        await asyncio.to_thread(postgres.stop)
        assert await auditor.once(config) is None
        assert failures() == 1
        # Back (a restart; the shipper reconnects on its own): the audit reads again, and sees
        # drift made since.
        await asyncio.to_thread(postgres.start)
        daily = next(w for w in lim.windows_at(config, "alice", time.time())
                     if w.name is lim.WindowName.DAILY_TOKENS and w.scope == USER)
        plan = lim.plan(config, "alice", lim.limits_for(config, "alice"), "mock-gpt",
                        time.time())
        await svc.budget.store.add_once(plan.slot, "phantom",
                                        [WindowAmount(daily.key, None, 500, daily.ttl_s)])
        assert await auditor.once(config) is not None
        judged = await auditor.once(config)
        assert judged is not None and not judged.agrees
        assert exported(metrics, "tokenmeter_reconcile_drift_tokens",
                        {"window": "daily_tokens"}) == -500
        # A restart under an open reader: the next reading reconnects by itself.
        await _restart(postgres)
        judged = await auditor.once(config)
        assert judged is not None and not judged.agrees
        assert failures() == 1
    finally:
        await auditor.close()


async def test_captures_come_back_after_postgres_restarts(postgres: PostgresServer,
                                                          db: str) -> None:
    """On main the capture store kept its first connection: after a restart every batch failed
    with `the capture store is not connected` until the replica restarted. Now the batch that
    finds the connection closed reconnects (at worst it is the one batch lost)."""
    metrics = Metrics()
    writer = CaptureWriter(lambda: CaptureStore.open(db), metrics, 100,
                           lambda: (True, 30))
    writer.start()

    def stored() -> float:
        return exported(metrics, "tokenmeter_captures_total")

    def dropped() -> float:
        return exported(metrics, "tokenmeter_captures_dropped_total", {"reason": "store"})

    try:
        writer.offer(_Made(capture("before", time.time())))
        await until(lambda: stored() == 1, deadline=20)
        await _restart(postgres)
        for i in range(3):  # one batch at a time: each is written (or lost) before the next
            writer.offer(_Made(capture(f"after-{i}", time.time())))
            await until(lambda i=i: stored() + dropped() == 2 + i, deadline=20)  # type: ignore[misc]
        assert dropped() <= 1 and stored() >= 3
    finally:
        await writer.stop(5)
    store = await CaptureStore.open(db)
    try:
        ids = {r.request_id for r in await store.list(CaptureFilter())}
    finally:
        await store.close()
    assert {"before", "after-1", "after-2"} <= ids


@dataclass(frozen=True)
class _Made:
    made: Capture

    def capture(self) -> Capture:
        return self.made


async def test_the_shipper_sink_reconnects_after_postgres_restarts(postgres: PostgresServer,
                                                                   db: str) -> None:
    """The ledger's sink holds its connection the same way (`PgConnection`): closed under it by
    a restart, it says it is not connected, and the shipper opens it again."""
    sink = PostgresSink(db)
    await sink.open()
    try:
        assert await sink.write([sink.prepare(list(make_row(1)))]) == 1
        await _restart(postgres)
        with contextlib.suppress(Exception):
            await sink.ping()  # the first statement may be the one that finds it closed
        assert not sink.connected
        await sink.open()
        assert await sink.write([sink.prepare(list(make_row(2)))]) == 1
    finally:
        await sink.close()
    assert sorted(await stored_ids(db)) == ["out-000001", "out-000002"]
