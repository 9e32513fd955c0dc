"""Ledger rows and ledgers written as the proxy's sinks write them, for the books' tests
(`usage`, reports, reconcile): one row builder and one writer per database."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from contextlib import closing
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg

from proxy.ledger.row import COLUMNS, LedgerRow
from proxy.ledger.schema import MIGRATIONS, TABLE

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
    """A SQLite ledger at `path`: the schema's migrations, then `rows`."""
    with closing(sqlite3.connect(path)) as db:
        db.execute("PRAGMA journal_mode = WAL")
        for migration in MIGRATIONS:
            for statement in migration.sqlite:
                db.execute(statement)
        marks = ", ".join("?" * len(COLUMNS))
        db.executemany(f"INSERT INTO {TABLE} ({', '.join(COLUMNS)}) VALUES ({marks})",
                       [tuple(getattr(r, c) for c in COLUMNS) for r in rows])
        db.commit()


def _pg_values(row: LedgerRow) -> tuple[object, ...]:
    return tuple(datetime.fromtimestamp(getattr(row, c), UTC)
                 if c in ("started_at", "ended_at") else getattr(row, c) for c in COLUMNS)


async def write_postgres(url: str, rows: Sequence[LedgerRow], *, fresh: bool = False) -> None:
    """The PostgreSQL ledger at `url`: (after dropping its table, when `fresh`) the schema's
    migrations, then `rows`."""
    conn = await asyncpg.connect(url)
    try:
        if fresh:
            await conn.execute(f"DROP TABLE IF EXISTS {TABLE}")
        for migration in MIGRATIONS:
            for statement in migration.postgresql:
                await conn.execute(statement)
        if rows:
            await conn.copy_records_to_table(TABLE, records=[_pg_values(r) for r in rows],
                                             columns=list(COLUMNS))
    finally:
        await conn.close()


PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"  # the machine's own PostgreSQL


async def pg_admin(statement: str) -> None:
    """`statement` (CREATE or DROP DATABASE) on the machine's PostgreSQL."""
    conn = await asyncpg.connect(PG_ADMIN)
    try:
        await conn.execute(statement)
    finally:
        await conn.close()
