"""`tokenmeter usage` with the Anthropic Messages API's prompt-cache token types: cache reads
and writes as their own columns, from SQLite and from a real PostgreSQL, with the same output;
a report without them is unchanged."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from proxy.cli import main
from proxy.ledger.query import ledger_path
from proxy.ledger.row import LedgerRow
from tests.books import ledger_row, pg_admin, write_postgres, write_sqlite


def row(rid: str, user: str, day: int, **kw: Any) -> LedgerRow:
    """A Messages request to `claude-x` at noon on November `day`, 2026."""
    fields: dict[str, Any] = {"operation": "messages", "requested_model": "claude-x",
                              "model": "claude-x", "response_model": "claude-x",
                              "upstream": "anthropic", "user_name": user, **kw}
    return ledger_row(rid, datetime(2026, 11, day, 12, tzinfo=UTC).timestamp(), **fields)


ROWS = [
    # alice: a cached Messages request (40 read, 30 written), and a chat request whose cached
    # input (OpenAI's cached_tokens) is cached input, not an Anthropic cache read.
    row("a1", "alice", 2, input_tokens=130, cached_input_tokens=40,
        cache_creation_input_tokens=30, output_tokens=9, cost_nanousd=445_500),
    row("a2", "alice", 2, operation="chat", model="gpt-4o", requested_model="gpt-4o",
        upstream="openai", input_tokens=100, cached_input_tokens=20, output_tokens=5,
        cost_nanousd=7),
    # bob: a prompt written whole to the cache, then read whole from it.
    row("b1", "bob", 3, input_tokens=50, cache_creation_input_tokens=50, output_tokens=1,
        cost_nanousd=202_500),
    row("b2", "bob", 4, input_tokens=50, cached_input_tokens=50, output_tokens=1,
        cost_nanousd=30_000),
    # Another month, OpenAI only: its report has no cache columns.
    row("o1", "carol", 1, operation="chat", input_tokens=10, cached_input_tokens=4)._replace(
        started_at=datetime(2026, 10, 1, tzinfo=UTC).timestamp()),
]


@pytest.fixture
def ledgers(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """The same rows in a SQLite ledger and in a PostgreSQL one of this test's own."""
    lite = tmp_path / "books.sqlite3"
    write_sqlite(lite, ROWS)
    name = f"tm_anth_{uuid.uuid4().hex[:12]}"
    asyncio.run(pg_admin(f'CREATE DATABASE "{name}"'))
    url = f"postgresql://postgres@127.0.0.1:5432/{name}"
    try:
        asyncio.run(write_postgres(url, ROWS))
        yield f"sqlite://{lite}", url
    finally:
        asyncio.run(pg_admin(f'DROP DATABASE "{name}" WITH (FORCE)'))


def usage(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    code = main(["usage", *args])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


NOVEMBER = ("--timezone", "UTC", "--from", "2026-11-01", "--to", "2026-11-30")


def test_cache_reads_and_writes_by_user(ledgers: tuple[str, str],
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert ledger_path(ledgers[0]).exists()
    for url in ledgers:
        lines = usage(capsys, "--ledger", url, *NOVEMBER).splitlines()
        assert lines[1].split() == ["user", "requests", "refused", "failed", "input", "cached",
                                    "cache_read", "cache_write", "output", "reasoning", "total",
                                    "cost_usd", "unpriced"]
        # alice: cached 60 (40 Anthropic reads + 20 OpenAI cached), 40 read, 30 written.
        assert lines[2].split() == ["alice", "2", "0", "0", "230", "60", "40", "30", "14", "0",
                                    "244", "0.000445507", "0"]
        assert lines[3].split() == ["bob", "2", "0", "0", "100", "50", "50", "50", "2", "0",
                                    "102", "0.000232500", "0"]
        assert lines[4].split() == ["total", "4", "0", "0", "330", "110", "90", "80", "16",
                                    "0", "346", "0.000678007", "0"]
        doc = json.loads(usage(capsys, "--ledger", url, *NOVEMBER, "--format", "json",
                               "--by", "user,day"))
        bob = [r for r in doc["rows"] if r["user"] == "bob"]
        assert [(r["day"], r["cache_read_input_tokens"], r["cache_creation_input_tokens"])
                for r in bob] == [("2026-11-03", 0, 50), ("2026-11-04", 50, 0)]
        assert doc["totals"]["cache_read_input_tokens"] == 90
        assert doc["totals"]["cache_creation_input_tokens"] == 80
        out = usage(capsys, "--ledger", url, *NOVEMBER, "--format", "csv", "--by", "model")
        got = {r["model"]: (r["cached_input_tokens"], r["cache_read_input_tokens"],
                            r["cache_creation_input_tokens"])
               for r in csv.DictReader(io.StringIO(out))}
        assert got == {"claude-x": ("90", "90", "80"), "gpt-4o": ("20", "0", "0"),
                       "total": ("110", "90", "80")}


def test_without_cache_tokens_the_report_is_unchanged(
    ledgers: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    october = ("--timezone", "UTC", "--from", "2026-10-01", "--to", "2026-10-31")
    for url in ledgers:
        lines = usage(capsys, "--ledger", url, *october).splitlines()
        assert lines[1].split() == ["user", "requests", "refused", "failed", "input", "cached",
                                    "output", "reasoning", "total", "cost_usd", "unpriced"]
        doc = json.loads(usage(capsys, "--ledger", url, *october, "--format", "json"))
        assert "cache_read_input_tokens" not in doc["totals"]
        assert doc["totals"]["cached_input_tokens"] == 4


def test_both_dialects_print_the_same(ledgers: tuple[str, str],
                                      capsys: pytest.CaptureFixture[str]) -> None:
    lite, pg = ledgers
    for by in ("user", "model,day", "upstream"):
        for fmt in ("table", "csv", "json"):
            args = (*NOVEMBER, "--by", by, "--format", fmt)
            a, b = usage(capsys, "--ledger", lite, *args), usage(capsys, "--ledger", pg, *args)
            if fmt == "table":  # the caption names the ledger
                a, b = a.split("\n", 1)[1], b.split("\n", 1)[1]
            assert a == b, (by, fmt)
