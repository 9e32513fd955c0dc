#!/usr/bin/env python3
"""Benchmark: the ledger's write path. What `record` costs a request, and how many rows a
second one replica's shipper stores in PostgreSQL and in SQLite.

    .venv/bin/python benchmarks/bench_ledger_ship.py [--rows 200000] [--quick]
        [--postgres postgresql://postgres@127.0.0.1:5432] [--batch-rows 2000] [--zone ZONE]

1. `record`: a started ledger (SQLite), rows built beforehand (building the row is settle's
   work, not the ledger's); the time and CPU of `record` alone, per row, over a tight loop (the
   shipper does not run during it: the loop never yields).
2. Shipping: `--rows` rows recorded into a spool by a ledger that is then stopped without a
   database (they stay in the spool, as after an outage); a new ledger on that spool starts,
   adopts them and ships them into a fresh database (a new PostgreSQL database, dropped
   afterwards; a new SQLite file). The clock runs from `start` until `flush` returns: adopting
   the files, connecting, migrating and every batch. Rows/s and the process's CPU per row.
   Target: at least 5,000 rows/s into PostgreSQL from one replica.

`--quick` (20,000 rows) runs in well under 30 s. Exits 1 if PostgreSQL's rows/s misses the
target or a row is missing.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import resource
import shutil
import sqlite3
import sys
import tempfile
import time
import uuid
from pathlib import Path

import asyncpg

from proxy.config.ledger import LedgerConfig
from proxy.ledger.ledger import Ledger, Shipping
from proxy.ledger.row import LedgerRow
from proxy.ledger.schema import TABLE
from proxy.telemetry.metrics import Metrics

TARGET_ROWS_S = 5000.0
_TEMPLATE = LedgerRow(
    request_id="", started_at=1_796_000_000.0, ended_at=1_796_000_001.25, replica="bench-1",
    user_name="alice", key_name="ci", team="platform", operation="chat",
    requested_model="gpt-4o-mini", model="gpt-4o-mini", response_model="gpt-4o-mini-2024-07-18",
    upstream="openai", fallback_from=None, attempts=1, status=200, error_class="none",
    stream=True, input_tokens=1234, output_tokens=256, cached_input_tokens=1024,
    reasoning_tokens=0, token_source="reported", ttft_ms=212.5, upstream_ttft_ms=209.9,
    overhead_ms=0.61, duration_ms=2875.3, output_tokens_per_s=96.4, cost_nanousd=339_150,
    price_version="3f9a1c2b", windows="u:daily:20261203 k:daily:20261203 u:tpm:29933333",
)


def rows(n: int, prefix: str) -> list[LedgerRow]:
    return [_TEMPLATE._replace(request_id=f"{prefix}-{i:08d}",
                                started_at=_TEMPLATE.started_at + i * 0.01,
                                ended_at=_TEMPLATE.ended_at + i * 0.01, user_name=f"user{i % 97}")
            for i in range(n)]


async def record_cost(n: int, work: Path) -> tuple[float, float]:
    """(wall us, CPU us) per `record`, one row per turn of the loop (each its own `write`, the
    most a row can cost; rows settled in one turn share one), a turn's own cost included."""
    ledger = Ledger(LedgerConfig(url=f"sqlite://{work}/record.sqlite3"), Metrics(),
                    state_dir=work / "record")
    await ledger.start()
    batch = rows(n, "rec")
    for row in batch[:1000]:  # warm-up
        ledger.record(row)
        await asyncio.sleep(0)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for row in batch[1000:]:
        ledger.record(row)
        await asyncio.sleep(0)  # the loop turn: its write
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    await ledger.stop(60)
    count = n - 1000
    return wall / count * 1e6, cpu / count * 1e6


async def ship(url: str, n: int, state: Path, batch_rows: int, zone: str = "UTC"
               ) -> tuple[float, float]:
    """(rows/s, CPU us per row) shipping `n` spooled rows into `url`; `zone`: the configured
    time zone, whose local days the shipper sums too (none for UTC)."""
    config = LedgerConfig(url=url, batch_rows=batch_rows)
    spooler = Ledger(config, Metrics(), state_dir=state)
    for row in rows(n, "ship"):
        spooler.record(row)  # never started: the rows wait in the spool
    await spooler.stop(0)
    ledger = Ledger(config, Metrics(), state_dir=state, shipping=Shipping(zone=zone))
    # The shipping runs in the ledger's shipper process: its CPU is counted once it has
    # exited (RUSAGE_CHILDREN), with a start-up of an interpreter in it.
    children0 = _children_cpu()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    await ledger.start()
    stored = await ledger.flush(600)
    wall = time.perf_counter() - wall0
    await ledger.stop(10)
    cpu = time.process_time() - cpu0 + _children_cpu() - children0
    if not stored:
        raise SystemExit(f"not every row reached {ledger.location}: {ledger.health().detail}")
    return n / wall, cpu / n * 1e6


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


async def count_pg(url: str) -> int:
    conn = await asyncpg.connect(url)
    try:
        return int(await conn.fetchval(f"SELECT count(*) FROM {TABLE}"))
    finally:
        await conn.close()


async def run(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="tm-bench-ledger-"))
    name = f"tm_bench_{uuid.uuid4().hex[:12]}"
    server = args.postgres.rstrip("/")
    admin = await asyncpg.connect(f"{server}/postgres")
    await admin.execute(f"CREATE DATABASE {name}")
    ok = True
    try:
        wall_us, cpu_us = await record_cost(args.record_rows, work)
        print(f"record(): {wall_us:.2f} us wall, {cpu_us:.2f} us CPU per row "
              f"({args.record_rows - 1000:,} rows, one os.write each)")

        pg_url = f"{server}/{name}"
        pg_rate, pg_cpu = await ship(pg_url, args.rows, work / "pg", args.batch_rows,
                                     args.zone)
        stored = await count_pg(pg_url)
        verdict = "PASS" if pg_rate >= TARGET_ROWS_S and stored == args.rows else "MISS"
        ok = verdict == "PASS"
        print(f"ship -> PostgreSQL: {pg_rate:,.0f} rows/s, {pg_cpu:.1f} us CPU per row "
              f"({stored:,} of {args.rows:,} rows stored, batches of {args.batch_rows})   "
              f"(target >= {TARGET_ROWS_S:,.0f} rows/s)   {verdict}")

        db = work / "ship.sqlite3"
        lite_rate, lite_cpu = await ship(f"sqlite://{db}", args.rows, work / "lite",
                                         args.batch_rows, args.zone)
        with sqlite3.connect(db) as conn:
            lite_stored = int(conn.execute(f"SELECT count(*) FROM {TABLE}").fetchone()[0])
        ok = ok and lite_stored == args.rows
        print(f"ship -> SQLite:     {lite_rate:,.0f} rows/s, {lite_cpu:.1f} us CPU per row "
              f"({lite_stored:,} of {args.rows:,} rows stored)")
    finally:
        await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        await admin.close()
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--record-rows", type=int, default=100_000)
    parser.add_argument("--batch-rows", type=int, default=2000)
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432",
                        help="a server where a database may be created (and is dropped)")
    parser.add_argument("--zone", default="UTC",
                        help="the config's timezone: another than UTC adds its local-day rollup")
    parser.add_argument("--quick", action="store_true", help="20,000 rows: well under 30 s")
    args = parser.parse_args()
    if args.quick:
        args.rows = min(args.rows, 20_000)
        args.record_rows = min(args.record_rows, 20_000)
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    return asyncio.run(run(args))


if __name__ == "__main__":
    raise SystemExit(main())
