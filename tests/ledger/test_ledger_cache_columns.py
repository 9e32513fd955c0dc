"""Schema v3, the response cache's columns (issue 23): a v2 ledger upgrades in place, its rows
say no cache and nothing saved; spool lines an older tokenmeter wrote (v1 and v2 widths) still
land, with the later columns' defaults; a hit's row lands with what it saved. On SQLite and on
a real PostgreSQL."""

from __future__ import annotations

import json
import sqlite3
from contextlib import closing
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from proxy.config.ledger import LedgerConfig
from proxy.ledger.ledger import Ledger
from proxy.ledger.row import COLUMNS, LedgerRow, complete
from proxy.ledger.schema import MIGRATIONS, SCHEMA_TABLE, TABLE
from proxy.telemetry.metrics import Metrics

NOW = 1_796_000_000.0
V3 = ("cache", "saved_input_tokens", "saved_output_tokens", "saved_cached_input_tokens",
      "saved_reasoning_tokens", "saved_cache_creation_input_tokens", "saved_cost_nanousd")
V2_COLUMNS = COLUMNS[: COLUMNS.index("cache")]
V1_COLUMNS = V2_COLUMNS[:-1]  # without cache_creation_input_tokens


def row(request_id: str, **changes: Any) -> LedgerRow:
    return LedgerRow(
        request_id=request_id, started_at=NOW, ended_at=NOW + 0.5, replica="r1",
        user_name="alice", key_name=None, team=None, operation="chat",
        requested_model="gpt-4o", model="gpt-4o", response_model="gpt-4o", upstream="openai",
        fallback_from=None, attempts=1, status=200, error_class="none", stream=False,
        input_tokens=100, output_tokens=20, cached_input_tokens=0, reasoning_tokens=0,
        token_source="reported", ttft_ms=None, upstream_ttft_ms=None, overhead_ms=1.0,
        duration_ms=500.0, output_tokens_per_s=None, cost_nanousd=450_000,
        price_version="p1", windows="u:daily_tokens:20261203",
    )._replace(**changes)


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An SQLite file, and a PostgreSQL database of the test's own."""
    if request.param == "sqlite":
        return f"sqlite://{tmp_path}/books.sqlite3"
    url: str = request.getfixturevalue("pg_url")
    return url


async def at_v2(url: str, old: LedgerRow) -> None:
    """A ledger database as tokenmeter left it at schema v2, holding `old`."""
    cols = ", ".join(V2_COLUMNS)
    values = [getattr(old, c) for c in V2_COLUMNS]
    if url.startswith("sqlite://"):
        with closing(sqlite3.connect(url.removeprefix("sqlite://"))) as db:
            db.execute(f"CREATE TABLE {SCHEMA_TABLE} (version INTEGER PRIMARY KEY, "
                       "applied_at REAL NOT NULL)")
            for m in MIGRATIONS[:2]:
                for statement in m.sqlite:
                    db.execute(statement)
                db.execute(f"INSERT INTO {SCHEMA_TABLE} VALUES (?, 0)", (m.version,))
            db.execute(f"INSERT INTO {TABLE} ({cols}) VALUES ({', '.join('?' * len(values))})",
                       values)
            db.commit()
        return
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(f"CREATE TABLE {SCHEMA_TABLE} (version integer PRIMARY KEY, "
                           "applied_at timestamptz NOT NULL DEFAULT now())")
        for m in MIGRATIONS[:2]:
            for statement in m.postgresql:
                await conn.execute(statement)
            await conn.execute(f"INSERT INTO {SCHEMA_TABLE} (version) VALUES ($1)", m.version)
        pg = [datetime.fromtimestamp(v, UTC) if c in ("started_at", "ended_at") else v
              for c, v in zip(V2_COLUMNS, values, strict=True)]
        marks = ", ".join(f"${i + 1}" for i in range(len(pg)))
        await conn.execute(f"INSERT INTO {TABLE} ({cols}) VALUES ({marks})", *pg)
    finally:
        await conn.close()


async def fetch(url: str, sql: str) -> list[tuple[Any, ...]]:
    if url.startswith("sqlite://"):
        with closing(sqlite3.connect(url.removeprefix("sqlite://"))) as db:
            return [tuple(r) for r in db.execute(sql).fetchall()]
    conn = await asyncpg.connect(url)
    try:
        return [tuple(r) for r in await conn.fetch(sql)]
    finally:
        await conn.close()


async def test_a_v2_ledger_upgrades_and_older_spool_lines_land(db_url: str,
                                                               tmp_path: Path) -> None:
    await at_v2(db_url, row("old-row", input_tokens=7))
    # Lines a previous (gone) process spooled before it was upgraded: a v1 line and a v2 line.
    state = tmp_path / "state"
    state.mkdir()
    v1 = [getattr(row("v1-line"), c) for c in V1_COLUMNS]
    v2 = [getattr(row("v2-line", cache_creation_input_tokens=30), c) for c in V2_COLUMNS]
    (state / "ledger-1-0123456789ab-000001.jsonl").write_text(
        json.dumps(v1) + "\n" + json.dumps(v2) + "\n")
    hit = row("hit-row", input_tokens=0, output_tokens=0, cost_nanousd=0, cache="hit",
              saved_input_tokens=1234, saved_output_tokens=567, saved_cached_input_tokens=200,
              saved_reasoning_tokens=64, saved_cache_creation_input_tokens=11,
              saved_cost_nanousd=8_505_000, windows="")
    miss = row("miss-row", cache="miss")
    ledger = Ledger(LedgerConfig(url=db_url), Metrics(), state_dir=state)
    await ledger.start()
    try:
        assert ledger.health().ok, ledger.health()
        ledger.record(hit)
        ledger.record(miss)
        assert await ledger.flush(20), ledger.health()
    finally:
        await ledger.stop(5)

    versions = await fetch(db_url, f"SELECT version FROM {SCHEMA_TABLE} ORDER BY version")
    assert versions == [(m.version,) for m in MIGRATIONS]
    stored = {r[0]: dict(zip(("cache_creation_input_tokens", *V3), r[1:], strict=True))
              for r in await fetch(db_url, f"SELECT request_id, cache_creation_input_tokens, "
                                           f"{', '.join(V3)} FROM {TABLE}")}
    nothing = {"cache": "none", "saved_input_tokens": 0, "saved_output_tokens": 0,
               "saved_cached_input_tokens": 0, "saved_reasoning_tokens": 0,
               "saved_cache_creation_input_tokens": 0, "saved_cost_nanousd": None}
    assert stored["old-row"] == {"cache_creation_input_tokens": 0, **nothing}
    assert stored["v1-line"] == {"cache_creation_input_tokens": 0, **nothing}
    assert stored["v2-line"] == {"cache_creation_input_tokens": 30, **nothing}
    assert stored["miss-row"] == {"cache_creation_input_tokens": 0, **nothing, "cache": "miss"}
    assert stored["hit-row"] == {"cache_creation_input_tokens": 0, "cache": "hit",
                                 "saved_input_tokens": 1234, "saved_output_tokens": 567,
                                 "saved_cached_input_tokens": 200, "saved_reasoning_tokens": 64,
                                 "saved_cache_creation_input_tokens": 11,
                                 "saved_cost_nanousd": 8_505_000}


def test_older_lines_are_completed_and_other_widths_refused() -> None:
    whole = list(row("x"))
    assert complete(whole) and whole == list(row("x"))
    v1 = list(row("x"))[: len(V1_COLUMNS)]
    assert complete(v1)
    assert v1 == list(row("x"))  # every later column at its default
    assert LedgerRow.from_json(json.dumps(list(row("x"))[: len(V1_COLUMNS)])) == row("x")
    assert not complete(list(row("x"))[: len(V1_COLUMNS) - 1])  # not a row of any version
    assert not complete([*row("x"), "extra"])
