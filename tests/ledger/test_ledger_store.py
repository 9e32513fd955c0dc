"""The ledger's write path against real databases: an SQLite file and the machine's PostgreSQL
(a database of each test's own). Rows land once, a re-shipped row is stored once, a SIGKILLed
process's rows are adopted and shipped, the spool is bounded, retention deletes old rows only,
migrations are idempotent and safe when replicas start together."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from prometheus_client import CollectorRegistry

from proxy.config.ledger import LedgerConfig
from proxy.ledger import shipper as shipper_mod
from proxy.ledger.ledger import Ledger, Shipping, make_ledger
from proxy.ledger.migrate import migrate_postgres, migrate_sqlite
from proxy.ledger.row import COLUMNS, LedgerRow
from proxy.ledger.schema import MIGRATIONS, SCHEMA_TABLE, TABLE, VERSION
from proxy.ledger.shipper_process import make_sink
from proxy.ledger.spool import RowSpool, SpoolWriter, encode_row
from proxy.storage.urls import mask_url
from proxy.telemetry.metrics import Metrics
from proxy.telemetry.verbs import LedgerMetrics
from tests.helpers import ROOT, FakeClock, exported, until
from tests.servers import free_port

REPO = ROOT
NOW = 1_796_000_000.0

# Every migration applied, each once, in order.
APPLIED = [(m.version,) for m in MIGRATIONS]


def make_row(i: int, *, prefix: str = "req", started_at: float = NOW, **changes: Any) -> LedgerRow:
    row = LedgerRow(
        request_id=f"{prefix}-{i:06d}", started_at=started_at + i * 0.001,
        ended_at=started_at + i * 0.001 + 1.25, replica="test-1", user_name=f"user{i % 7}",
        key_name="ci" if i % 2 else None, team="platform" if i % 3 else None,
        operation="chat", requested_model="gpt-4o-mini", model="gpt-4o-mini",
        response_model="gpt-4o-mini-2024-07-18", upstream="openai", fallback_from=None,
        attempts=1, status=200 if i % 5 else 429, error_class="none" if i % 5 else "quota",
        stream=bool(i % 2), input_tokens=100 + i, output_tokens=20 + i, cached_input_tokens=i % 4,
        reasoning_tokens=0, token_source="reported", ttft_ms=12.5, upstream_ttft_ms=11.0,
        overhead_ms=0.4, duration_ms=1250.0, output_tokens_per_s=16.0,
        cost_nanousd=1_234_567 + i, price_version="p1", windows="u:daily:20261203",
    )
    return row._replace(**changes) if changes else row


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Each test runs on an SQLite file and on a PostgreSQL database of its own."""
    if request.param == "sqlite":
        return f"sqlite://{tmp_path}/books.sqlite3"
    url: str = request.getfixturevalue("pg_url")
    return url


@pytest.fixture
def state(tmp_path: Path) -> Path:
    path = tmp_path / "state"
    path.mkdir()
    return path


def ledger_for(url: str | None, state: Path, metrics: Metrics | None = None,
               **config: Any) -> Ledger:
    return Ledger(LedgerConfig(url=url, **config), metrics or Metrics(), state_dir=state)


async def fetch(url: str, sql: str) -> list[tuple[Any, ...]]:
    if url.startswith("sqlite://"):
        with sqlite3.connect(url.removeprefix("sqlite://")) as db:
            return [tuple(r) for r in db.execute(sql).fetchall()]
    conn = await asyncpg.connect(url)
    try:
        return [tuple(r) for r in await conn.fetch(sql)]
    finally:
        await conn.close()


async def stored_ids(url: str) -> list[str]:
    return [str(r[0]) for r in await fetch(url, f"SELECT request_id FROM {TABLE}")]


def sample(metrics: Metrics, name: str, labels: dict[str, str] | None = None) -> float:
    return exported(metrics, name, labels)


def spool_files(state: Path) -> list[str]:
    return sorted(p.name for p in state.iterdir() if p.name.startswith("ledger-"))


# --- rows land once ---------------------------------------------------------------------------

async def test_rows_land_once_with_their_values(db_url: str, state: Path) -> None:
    metrics = Metrics()
    ledger = ledger_for(db_url, state, metrics, batch_rows=100)
    rows = [make_row(i) for i in range(1000)]
    for row in rows[:400]:
        ledger.record(row)  # before start: they wait in the spool
    await ledger.start()
    assert ledger.health().ok, ledger.health()
    for row in rows[400:]:
        ledger.record(row)
    assert await ledger.flush(20)
    await until(lambda: ledger.health().pending_rows == 0)  # the shipper process's word
    ids = await stored_ids(db_url)
    assert sorted(ids) == [r.request_id for r in rows]
    dialect = "sqlite" if db_url.startswith("sqlite") else "postgresql"
    assert sample(metrics, "tokenmeter_ledger_rows_written_total", {"sink": dialect}) == 1000

    # The values come back as they went in, cost_usd generated from nano-dollars.
    got = await fetch(db_url, f"SELECT {', '.join(COLUMNS)}, cost_usd FROM {TABLE} "
                              "WHERE request_id = 'req-000007'")
    values = list(got[0])
    for i in (1, 2):  # timestamps: timestamptz in PostgreSQL, epoch seconds in SQLite
        if not isinstance(values[i], float):
            values[i] = values[i].timestamp()
    assert bool(values[COLUMNS.index("stream")]) is True
    values[COLUMNS.index("stream")] = bool(values[COLUMNS.index("stream")])
    expected = tuple(rows[7])
    assert values[1] == pytest.approx(expected[1], abs=1e-6)
    assert values[2] == pytest.approx(expected[2], abs=1e-6)
    assert tuple(values[3:len(COLUMNS)]) == expected[3:]
    assert float(values[-1]) == pytest.approx((1_234_567 + 7) / 1e9)

    await ledger.stop(5)
    assert spool_files(state) == []  # all stored: nothing left behind, not even the lock


async def test_a_row_shipped_twice_is_stored_once(db_url: str, state: Path,
                                                  tmp_path: Path) -> None:
    """A crash between the database's commit and the spool's cursor write: the next process
    ships the same rows again, and the primary key keeps one of each."""
    first = ledger_for(db_url, state, batch_rows=64)
    for i in range(500):
        first.record(make_row(i))
    before = tmp_path / "before"
    shutil.copytree(state, before)  # the spool as it was when the batches were committed
    await first.start()
    assert await first.flush(20)
    await first.stop(5)
    assert len(await stored_ids(db_url)) == 500

    for name in spool_files(before):  # the cursor never moved: back to that state
        shutil.copy(before / name, state / name)
    metrics = Metrics()
    second = ledger_for(db_url, state, metrics, batch_rows=64)
    await second.start()
    assert await second.flush(20)
    ids = await stored_ids(db_url)
    assert len(ids) == len(set(ids)) == 500
    dialect = "sqlite" if db_url.startswith("sqlite") else "postgresql"
    assert sample(metrics, "tokenmeter_ledger_rows_written_total", {"sink": dialect}) == 0
    await second.stop(5)
    assert spool_files(state) == []


def test_encode_row_is_to_json() -> None:
    for i in range(20):
        row = make_row(i, key_name=None, ttft_ms=None, windows="a b", user_name="é\"\\x")
        assert encode_row(row) == row.to_json()
        assert LedgerRow.from_json(encode_row(row)) == row


async def test_rows_recorded_after_stop_wait_for_the_next_start(db_url: str,
                                                                 state: Path) -> None:
    ledger = ledger_for(db_url, state)
    await ledger.start()
    ledger.record(make_row(1))
    await ledger.stop(5)
    ledger.record(make_row(2))  # a straggler settling after the drain: spooled, not lost
    await ledger.start()  # the same object again (a restart of the app in one process)
    assert await ledger.flush(20)
    assert sorted(await stored_ids(db_url)) == [make_row(1).request_id, make_row(2).request_id]
    await ledger.stop(5)
    assert spool_files(state) == []


# --- SIGKILL ----------------------------------------------------------------------------------

CHILD = textwrap.dedent("""
    import asyncio, dataclasses, sys, time
    from pathlib import Path
    from proxy.config.ledger import LedgerConfig
    from proxy.ledger.ledger import Ledger
    from proxy.ledger.row import LedgerRow
    from proxy.telemetry.metrics import Metrics

    async def main() -> None:
        url = sys.argv[2] if sys.argv[2] != "-" else None
        ledger = Ledger(LedgerConfig(url=url, batch_rows=50), Metrics(),
                        state_dir=Path(sys.argv[1]))
        await ledger.start()
        template = LedgerRow.from_json(sys.stdin.readline())
        i = 0
        while True:
            ids = [f"kill-{i + j:07d}" for j in range(25)]
            for rid in ids:
                ledger.record(template._replace(request_id=rid, ended_at=time.time()))
            i += 25
            # The rows of one loop turn are written in one write, before anything that
            # follows the turn: printed only then, these rows must survive.
            await asyncio.sleep(0)
            print("\\n".join(ids), flush=True)

    asyncio.run(main())
""")


async def test_sigkill_loses_no_recorded_row(db_url: str, state: Path, tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    child = subprocess.Popen(
        [sys.executable, str(script), str(state), db_url],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True,
    )
    assert child.stdin is not None and child.stdout is not None
    child.stdin.write(make_row(0).to_json())
    child.stdin.flush()
    printed: list[str] = []
    stored_before: list[str] = []
    deadline = time.monotonic() + 20
    # Killed in full swing: some rows already stored, others waiting, one maybe mid-write.
    while len(printed) < 3000 or not stored_before:
        assert time.monotonic() < deadline, f"the child printed {len(printed)} ids"
        line = await asyncio.to_thread(child.stdout.readline)
        assert line, "the child ended by itself"
        printed.append(line.decode().strip())
        if len(printed) % 500 == 0:
            stored_before = await stored_ids(db_url)
    # The process and its shipper process at once (an OOM kill of the container, say).
    os.killpg(child.pid, signal.SIGKILL)
    rest, _ = await asyncio.to_thread(child.communicate)
    printed += [line for line in rest.decode().split("\n") if line.startswith("kill-")]
    # A torn last print is not an id the child confirmed.
    printed = [p for p in printed if len(p) == len("kill-0000000")]
    assert child.returncode == -signal.SIGKILL
    assert any(name.endswith(".jsonl") for name in spool_files(state))
    assert len(await stored_ids(db_url)) < len(printed)  # rows were waiting in the spool

    metrics = Metrics()
    ledger = ledger_for(db_url, state, metrics)
    await ledger.start()
    assert await ledger.flush(20)
    ids = await stored_ids(db_url)
    assert len(ids) == len(set(ids))  # never twice
    missing = set(printed) - set(ids)
    assert not missing, f"{len(missing)} recorded rows lost, e.g. {sorted(missing)[:3]}"
    await ledger.stop(5)
    assert spool_files(state) == []


async def test_a_torn_last_line_is_skipped_and_counted(db_url: str, state: Path) -> None:
    """A process killed inside the write of a row leaves its segment without the last
    newline: the complete rows before it are stored, the fragment is dropped, loudly."""
    dead = state / "ledger-999999-0123456789ab-000001.jsonl"
    lines = b"".join(make_row(i).to_json() for i in range(5))
    dead.write_bytes(lines + make_row(5).to_json()[:40])
    (state / "ledger-999999-0123456789ab-000002.jsonl").write_bytes(make_row(6).to_json())
    metrics = Metrics()
    ledger = ledger_for(db_url, state, metrics)
    await ledger.start()
    assert await ledger.flush(20)
    assert sorted(await stored_ids(db_url)) == [make_row(i).request_id for i in (0, 1, 2, 3, 4, 6)]
    assert sample(metrics, "tokenmeter_ledger_rows_dropped_total") == 1
    assert spool_files(state) == []  # adopted, stored, deleted (their lock too)
    await ledger.stop(5)


async def test_replicas_sharing_a_spool_adopt_only_the_dead(state: Path, tmp_path: Path) -> None:
    """Two live processes on one spool directory: one shipper process (the first started; the
    other's waits for its lock) ships the rows of both as they are written, and the files of
    a process that died are adopted."""
    url = f"sqlite://{tmp_path}/books.sqlite3"
    a, b = ledger_for(url, state), ledger_for(url, state)
    for i in range(30):
        a.record(make_row(i, prefix="a"))
    await asyncio.sleep(0)  # written
    await b.start()
    assert await b.flush(20)  # a is alive and its lock held: followed, its rows shipped
    assert sorted(await stored_ids(url)) == [make_row(i, prefix="a").request_id
                                             for i in range(30)]
    await a.start()  # its own shipper waits: one per directory
    assert await a.flush(20)

    dead = state / "ledger-4242-00000000dead-000001.jsonl"
    dead.write_bytes(b"".join(make_row(i, prefix="dead").to_json() for i in range(20)))
    deadline = time.monotonic() + 20
    # Stored first, the file deleted after the commit: both, polled (no order between them and
    # this test's reads).
    while len(await stored_ids(url)) < 50 or dead.exists():
        assert time.monotonic() < deadline, "the dead process's rows were not adopted"
        await asyncio.sleep(0.02)
    ids = await stored_ids(url)
    assert len(ids) == len(set(ids)) == 50
    await a.stop(5)
    await b.stop(5)
    assert spool_files(state) == []


# --- the bound, bad rows, health ------------------------------------------------------------

async def test_a_full_spool_drops_rows_loudly(state: Path, tmp_path: Path) -> None:
    metrics = Metrics()
    url = f"sqlite://{tmp_path}/books.sqlite3"
    ledger = ledger_for(url, state, metrics, spool_max_mb=0.01)  # 10 KiB: a few dozen rows
    for i in range(200):  # not started: nothing ships, the spool fills
        ledger.record(make_row(i))
        await asyncio.sleep(0)  # a turn of the loop: its rows' one write
    kept = 200 - int(sample(metrics, "tokenmeter_ledger_rows_dropped_total"))
    assert 0 < kept < 200
    health = ledger.health()
    assert not health.ok and "full" in health.detail
    assert sum(p.stat().st_size for p in state.glob("ledger-*.jsonl")) <= 0.01 * 1024 * 1024

    await ledger.start()
    assert await ledger.flush(20)
    assert len(await stored_ids(url)) == kept  # what the spool took, it delivered
    ledger.record(make_row(1000))  # room again (the shipper deleted what it stored): spooled
    assert await ledger.flush(20)
    await until(lambda: ledger.health().ok)
    assert len(await stored_ids(url)) == kept + 1
    await ledger.stop(5)


async def test_a_row_the_database_refuses_is_dropped_alone(db_url: str, state: Path) -> None:
    metrics = Metrics()
    ledger = ledger_for(db_url, state, metrics, batch_rows=50)
    for i in range(40):
        # 2**63 fits neither PostgreSQL's bigint nor SQLite's INTEGER.
        ledger.record(make_row(i, input_tokens=2**63) if i == 17 else make_row(i))
    await ledger.start()
    assert await ledger.flush(20)
    ids = await stored_ids(db_url)
    assert sorted(ids) == [make_row(i).request_id for i in range(40) if i != 17]
    assert sample(metrics, "tokenmeter_ledger_rows_dropped_total") == 1
    assert ledger.health().ok
    await ledger.stop(5)


async def test_password_never_shown(state: Path) -> None:
    assert mask_url("postgresql://tm:s3cret@db:5432/books?sslmode=require") == \
        "postgresql://tm:***@db:5432/books?sslmode=require"
    assert "s3cret" not in mask_url("postgresql://tm@db/books?password=s3cret")
    port = free_port()  # nothing listens there
    ledger = ledger_for(f"postgresql://tm:s3cret@127.0.0.1:{port}/books", state)
    assert "s3cret" not in ledger.location
    ledger.record(make_row(1))
    await ledger.start()  # does not raise, does not wait long
    health = ledger.health()
    assert not health.ok and "s3cret" not in health.detail and health.pending_rows == 1
    await ledger.stop(0.2)
    assert any(n.endswith(".jsonl") for n in spool_files(state))  # the row waits on disk


async def test_the_shipper_process_sums_its_configured_zone_once(db_url: str,
                                                                  state: Path) -> None:
    """The shipper process is handed the config's `timezone`: at its first start it adds the
    zone to the local-day rollup, with the rows already stored; started again (and with
    another zone after a config change) it adds no row twice and keeps every zone listed."""
    for i, zone in enumerate(("Europe/Berlin", "Europe/Berlin", "America/New_York")):
        ledger = Ledger(LedgerConfig(url=db_url), Metrics(), state_dir=state,
                        shipping=Shipping(5.0, zone))
        ledger.record(make_row(i, started_at=NOW + i * 3600))
        await ledger.start()
        assert await ledger.flush(20)
        await until(lambda ledger=ledger: ledger.health().pending_rows == 0)  # type: ignore[misc]
        await ledger.stop(5.0)
    assert sorted(await fetch(db_url, "SELECT zone FROM tokenmeter_rollup_zones")) == [
        ("America/New_York",), ("Europe/Berlin",)]
    summed = await fetch(db_url, "SELECT zone, sum(requests), sum(input_tokens) FROM "
                                 "tokenmeter_rollup_localday GROUP BY zone ORDER BY zone")
    stored = await fetch(db_url, f"SELECT count(*), sum(input_tokens) FROM {TABLE}")
    assert [tuple(int(v) for v in r[1:]) for r in summed] == [
        tuple(int(v) for v in stored[0])] * 2


def test_disabled_is_none(state: Path) -> None:
    assert make_ledger(LedgerConfig(enabled=False), Metrics(), state_dir=state) is None
    ledger = make_ledger(LedgerConfig(), Metrics(), state_dir=state)
    assert ledger is not None and ledger.location.endswith("/state/ledger.sqlite3")


# --- retention --------------------------------------------------------------------------------

async def test_retention_deletes_old_rows_only(db_url: str, state: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The shipper's retention (here in this process, on a clock of the test's)."""
    monkeypatch.setattr(shipper_mod, "PRUNE_SLICE", 7)  # several slices
    clock = FakeClock(NOW)
    config = LedgerConfig(url=db_url, retention_days=30)
    old = [make_row(i, prefix="old", started_at=NOW - 31 * 86400) for i in range(30)]
    new = [make_row(i, prefix="new", started_at=NOW - 29 * 86400) for i in range(30)]
    writer = SpoolWriter(state, 1 << 20)
    assert writer.append(b"".join(encode_row(row) for row in old + new))
    writer.close()
    sink = make_sink(config, state)
    shipper = shipper_mod.Shipper(RowSpool(state), sink, LedgerMetrics(CollectorRegistry()),
                                  config, clock=clock)
    task = asyncio.create_task(shipper.run())
    try:
        # Shipped, then pruned at start, slice by slice.
        want = sorted(r.request_id for r in new)

        async def pruned() -> bool:
            if not sink.connected:  # the table is made as it connects
                return False
            return sorted(await stored_ids(db_url)) == want

        await until(pruned, deadline=20)
        clock.now += 2 * 86400  # now the others are past it too
        deleted = 0
        while (n := await shipper.prune_slice()) > 0:
            deleted += n
        assert deleted == 30
        assert await stored_ids(db_url) == []
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await sink.close()
        sink.shutdown()


# --- migrations -------------------------------------------------------------------------------

async def test_migration_from_empty_and_again(db_url: str, state: Path) -> None:
    for _ in range(2):
        ledger = ledger_for(db_url, state)
        await ledger.start()
        assert ledger.health().ok
        await ledger.stop(5)
    assert await fetch(db_url, f"SELECT version FROM {SCHEMA_TABLE} ORDER BY version") == APPLIED
    if db_url.startswith("sqlite://"):
        with sqlite3.connect(db_url.removeprefix("sqlite://")) as conn:
            assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


async def test_two_replicas_migrate_together_postgres(pg_url: str, tmp_path: Path) -> None:
    conns = [await asyncpg.connect(pg_url) for _ in range(4)]
    try:
        assert await asyncio.gather(*(migrate_postgres(c) for c in conns)) == [VERSION] * 4
    finally:
        for c in conns:
            await c.close()
    ledgers = [ledger_for(pg_url, tmp_path / f"s{i}") for i in range(3)]
    await asyncio.gather(*(lg.start() for lg in ledgers))
    for i, lg in enumerate(ledgers):
        await until(lambda lg=lg: lg.health().ok, deadline=30)  # type: ignore[misc]
        lg.record(make_row(i))
    assert all(await asyncio.gather(*(lg.flush(20) for lg in ledgers)))
    assert len(await stored_ids(pg_url)) == 3
    assert await fetch(pg_url, f"SELECT version FROM {SCHEMA_TABLE} ORDER BY version") == APPLIED
    for lg in ledgers:
        await lg.stop(5)


def test_two_processes_migrate_together_sqlite(tmp_path: Path) -> None:
    path = tmp_path / "books.sqlite3"
    barrier = threading.Barrier(4)
    results: list[int] = []

    def migrate() -> None:
        conn = sqlite3.connect(path, isolation_level=None, timeout=10)
        try:
            barrier.wait()
            results.append(migrate_sqlite(conn))
        finally:
            conn.close()

    threads = [threading.Thread(target=migrate) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert results == [VERSION] * 4
    with sqlite3.connect(path) as conn:
        assert conn.execute(f"SELECT version FROM {SCHEMA_TABLE} ORDER BY version").fetchall() == APPLIED


async def test_a_newer_schema_is_refused_and_rows_wait(db_url: str, state: Path) -> None:
    ledger = ledger_for(db_url, state)
    await ledger.start()
    await ledger.stop(5)
    newer = f"INSERT INTO {SCHEMA_TABLE} (version, applied_at) VALUES ({VERSION + 1}, " + \
        ("0)" if db_url.startswith("sqlite") else "now())")
    await execute(db_url, newer)

    ledger = ledger_for(db_url, state)
    for i in range(10):
        ledger.record(make_row(i))
    await ledger.start()
    health = ledger.health()
    assert not health.ok and "newer" in health.detail and health.pending_rows == 10
    assert not await ledger.flush(0.3)
    # The operator upgrades (here: the newer version goes away): the rows land.
    await execute(db_url, f"DELETE FROM {SCHEMA_TABLE} WHERE version > {VERSION}")
    assert await ledger.flush(20)
    assert len(await stored_ids(db_url)) == 10
    # The shipper writes its status file after the batch whose cursors `flush` saw move (a
    # file of another process: nothing to await but the file itself), within STATUS_EVERY_S.
    async with asyncio.timeout(20):
        while True:
            if ledger.health().ok:
                break
            await asyncio.sleep(0.05)
    await ledger.stop(5)


async def execute(url: str, sql: str) -> None:
    if url.startswith("sqlite://"):
        with sqlite3.connect(url.removeprefix("sqlite://")) as db:
            db.execute(sql)
        return
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()
