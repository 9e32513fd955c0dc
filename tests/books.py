"""Ledger rows and ledgers written by the proxy's sinks, for the books' tests
(`usage`, reports, reconcile): one row builder and one writer per database."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import asyncpg

from proxy.ledger.rollup import ROLLUPS, ZONES
from proxy.ledger.row import LedgerRow
from proxy.ledger.schema import SCHEMA_TABLE, TABLE
from proxy.ledger.sink_postgres import PostgresSink
from proxy.ledger.sink_sqlite import SqliteSink

# A plain answered chat request: what every row of a test has unless it says otherwise.
BASE_ROW = LedgerRow(
    request_id="-", started_at=0.0, ended_at=0.5, replica="r1", user_name="alice",
    key_name=None, team=None, operation="chat", requested_model="mock-gpt", model="mock-gpt",
    response_model="mock-gpt", upstream="mock", fallback_from=None, attempts=1, status=200,
    error_class="none", stream=True, input_tokens=10, output_tokens=5, cached_input_tokens=0,
    reasoning_tokens=0, token_source="reported", ttft_ms=12.0, upstream_ttft_ms=10.0,
    overhead_ms=0.4, duration_ms=500.0, output_tokens_per_s=10.0, cost_nanousd=1000,
    price_version="p1", windows="",
)


def ledger_row(request_id: str, started_at: float, **fields: Any) -> LedgerRow:
    """BASE_ROW as request `request_id`, started at `started_at` and ended half a second
    later, with `fields` changed."""
    return BASE_ROW._replace(request_id=request_id, started_at=started_at,
                             ended_at=started_at + 0.5, **fields)


def write_sqlite(path: Path, rows: Sequence[LedgerRow]) -> None:
    """A SQLite ledger at `path` written by the proxy's own sink: its migrations, then `rows`
    (and their rollups). Callable from a test with or without an event loop running."""
    async def go() -> None:
        sink = SqliteSink(path)
        await sink.open()
        try:
            if rows:
                await sink.write([sink.prepare(list(r)) for r in rows])
        finally:
            await sink.close()
            sink.shutdown()

    with ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, go()).result()


async def write_postgres(url: str, rows: Sequence[LedgerRow], *, fresh: bool = False) -> None:
    """The PostgreSQL ledger at `url` written by the proxy's own sink: (after dropping its
    tables, when `fresh`) its migrations, then `rows` (and their rollups)."""
    if fresh:
        conn = await asyncpg.connect(url)
        try:
            for table in (TABLE, SCHEMA_TABLE, ZONES, *(r.table for r in ROLLUPS)):
                await conn.execute(f"DROP TABLE IF EXISTS {table}")
        finally:
            await conn.close()
    sink = PostgresSink(url)
    await sink.open()
    try:
        if rows:
            await sink.write([sink.prepare(list(r)) for r in rows])
    finally:
        await sink.close()


PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"  # the machine's own PostgreSQL


async def pg_admin(statement: str) -> None:
    """`statement` (CREATE or DROP DATABASE) on the machine's PostgreSQL."""
    conn = await asyncpg.connect(PG_ADMIN)
    try:
        await conn.execute(statement)
    finally:
        await conn.close()
