"""The ledger while its PostgreSQL is down: rows wait in the spool, health says so, and when
the database is back every row lands exactly once. A PostgreSQL cluster of this module's own,
on a free port (the machine's is never stopped)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from proxy.config.ledger import LedgerConfig
from proxy.ledger.ledger import Ledger
from proxy.ledger.row import LedgerRow
from proxy.ledger.schema import TABLE
from proxy.telemetry.metrics import Metrics
from tests.helpers import exported, until
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
