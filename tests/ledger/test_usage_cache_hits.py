"""`tokenmeter usage` with response-cache hits (issue 23): `hits`, saved tokens and saved cost
columns, exact to the token and the nano-dollar, from SQLite and from a real PostgreSQL with
the same output; a hit's own tokens and cost are 0, so the other columns do not count it twice;
a report without hits is unchanged."""

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
from proxy.ledger.row import LedgerRow
from tests.books import ledger_row, pg_admin, write_postgres, write_sqlite


def row(rid: str, user: str, day: int, **kw: Any) -> LedgerRow:
    """A chat request at noon on November `day`, 2026 (BASE_ROW: 10 in, 5 out, 1000 nUSD)."""
    return ledger_row(rid, datetime(2026, 11, day, 12, tzinfo=UTC).timestamp(), user_name=user,
                      **kw)


def hit(rid: str, user: str, day: int, saved_in: int, saved_out: int,
        saved_cost: int | None) -> LedgerRow:
    return row(rid, user, day, input_tokens=0, output_tokens=0, cost_nanousd=0,
               upstream=None, model=None, cache="hit", saved_input_tokens=saved_in,
               saved_output_tokens=saved_out, saved_cost_nanousd=saved_cost)


ROWS = [
    row("a1", "alice", 2, cache="miss"),  # the answer alice's hits replay
    hit("a2", "alice", 2, 10, 5, 1_000),
    hit("a3", "alice", 3, 10, 5, 1_001),  # the price went up a nano-dollar
    row("b1", "bob", 3, cache="bypass"),
    hit("b2", "bob", 4, 777, 333, None),  # no price for the model: no saved cost
    row("c1", "carol", 4),  # the cache not consulted
    # Another month, no hits: its report has no hit columns.
    row("o1", "carol", 1)._replace(started_at=datetime(2026, 10, 1, tzinfo=UTC).timestamp()),
]


@pytest.fixture
def ledgers(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """The same rows in a SQLite ledger and in a PostgreSQL one of this test's own."""
    lite = tmp_path / "books.sqlite3"
    write_sqlite(lite, ROWS)
    name = f"tm_hits_{uuid.uuid4().hex[:12]}"
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


def test_hits_and_what_they_saved_by_user(ledgers: tuple[str, str],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    for url in ledgers:
        lines = usage(capsys, "--ledger", url, *NOVEMBER).splitlines()
        assert lines[1].split() == ["user", "requests", "refused", "failed", "input", "cached",
                                    "output", "reasoning", "total", "cost_usd", "unpriced",
                                    "hits", "saved_input", "saved_output", "saved_total",
                                    "saved_usd"]
        # alice: 3 requests, one upstream (10 + 5 tokens), two hits that saved 10 + 5 each.
        assert lines[2].split() == ["alice", "3", "0", "0", "10", "0", "5", "0", "15",
                                    "0.000001000", "0", "2", "20", "10", "30", "0.000002001"]
        assert lines[3].split() == ["bob", "2", "0", "0", "10", "0", "5", "0", "15",
                                    "0.000001000", "0", "1", "777", "333", "1,110",
                                    "0.000000000"]
        assert lines[4].split() == ["carol", "1", "0", "0", "10", "0", "5", "0", "15",
                                    "0.000001000", "0", "0", "0", "0", "0", "0.000000000"]
        assert lines[5].split() == ["total", "6", "0", "0", "30", "0", "15", "0", "45",
                                    "0.000003000", "0", "3", "797", "343", "1,140",
                                    "0.000002001"]
        doc = json.loads(usage(capsys, "--ledger", url, *NOVEMBER, "--format", "json",
                               "--by", "user,day"))
        alice = [r for r in doc["rows"] if r["user"] == "alice"]
        assert [(r["day"], r["hits"], r["saved_tokens"], r["saved_cost_nanousd"],
                 r["saved_cost_usd"]) for r in alice] == [
            ("2026-11-02", 1, 15, 1_000, "0.000001000"),
            ("2026-11-03", 1, 15, 1_001, "0.000001001")]
        assert doc["totals"]["hits"] == 3
        assert doc["totals"]["saved_cost_nanousd"] == 2_001
        out = usage(capsys, "--ledger", url, *NOVEMBER, "--format", "csv", "--by", "user")
        got = {r["user"]: (r["hits"], r["saved_input_tokens"], r["saved_output_tokens"],
                           r["saved_tokens"], r["saved_cost_usd"])
               for r in csv.DictReader(io.StringIO(out))}
        assert got == {"alice": ("2", "20", "10", "30", "0.000002001"),
                       "bob": ("1", "777", "333", "1110", "0.000000000"),
                       "carol": ("0", "0", "0", "0", "0.000000000"),
                       "total": ("3", "797", "343", "1140", "0.000002001")}


def test_without_hits_the_report_is_unchanged(ledgers: tuple[str, str],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    october = ("--timezone", "UTC", "--from", "2026-10-01", "--to", "2026-10-31")
    for url in ledgers:
        lines = usage(capsys, "--ledger", url, *october).splitlines()
        assert lines[1].split() == ["user", "requests", "refused", "failed", "input", "cached",
                                    "output", "reasoning", "total", "cost_usd", "unpriced"]
        doc = json.loads(usage(capsys, "--ledger", url, *october, "--format", "json"))
        assert "hits" not in doc["totals"] and "saved_cost_nanousd" not in doc["totals"]


def test_both_dialects_print_the_same(ledgers: tuple[str, str],
                                      capsys: pytest.CaptureFixture[str]) -> None:
    lite, pg = ledgers
    for by in ("user", "model,day"):
        for fmt in ("table", "csv", "json"):
            args = (*NOVEMBER, "--by", by, "--format", fmt)
            a, b = usage(capsys, "--ledger", lite, *args), usage(capsys, "--ledger", pg, *args)
            if fmt == "table":  # the caption names the ledger
                a, b = a.split("\n", 1)[1], b.split("\n", 1)[1]
            assert a == b, (by, fmt)
