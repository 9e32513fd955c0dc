"""`tokenmeter usage` on the ledger: groups, time zones, formats, totals and exact cost, read from
SQLite and from a real PostgreSQL (a database of this module's own), with the same output."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import sqlite3
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from proxy.cli import main
from proxy.ledger.query import ledger_path
from proxy.ledger.row import LedgerRow
from tests.books import ledger_row, pg_admin, write_postgres, write_sqlite


def at(text: str) -> float:
    """An instant written in UTC, `2025-03-10T23:30`."""
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


def row(rid: str, user: str, started: str, **kw: Any) -> LedgerRow:
    return ledger_row(rid, at(started), user_name=user, **kw)


@pytest.fixture(scope="module")
def module_pg() -> Iterator[str]:
    name = f"tm_usage_{uuid.uuid4().hex[:12]}"
    asyncio.run(pg_admin(f'CREATE DATABASE "{name}"'))
    yield f"postgresql://postgres@127.0.0.1:5432/{name}"
    asyncio.run(pg_admin(f'DROP DATABASE "{name}" WITH (FORCE)'))


@dataclass
class Books:
    url: str

    def write(self, rows: Sequence[LedgerRow]) -> None:
        if self.url.startswith("sqlite"):
            write_sqlite(ledger_path(self.url), rows)
        else:
            asyncio.run(write_postgres(self.url, rows))


def _sqlite_books(tmp_path: Path) -> Books:
    return Books(f"sqlite://{tmp_path / 'books.sqlite3'}")


def _pg_books(module_pg: str) -> Books:
    asyncio.run(write_postgres(module_pg, [], fresh=True))  # each test its own empty table
    return Books(module_pg)


@pytest.fixture(params=["sqlite", "postgresql"])
def books(request: pytest.FixtureRequest, tmp_path: Path) -> Books:
    if request.param == "sqlite":
        return _sqlite_books(tmp_path)
    return _pg_books(request.getfixturevalue("module_pg"))


def usage(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["usage", *args])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return code, captured.out


def csv_rows(text: str) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(text)))


# --- the tests -----------------------------------------------------------------------------------

TEAMS = [
    row("a1", "alice", "2025-01-06T10:00", team="eng", key_name="laptop", input_tokens=100,
        output_tokens=20, cached_input_tokens=40, reasoning_tokens=5, cost_nanousd=1_500),
    row("a2", "alice", "2025-01-07T10:00", team="eng", key_name="ci", model="gpt-4o",
        requested_model="gpt-4o", input_tokens=7, output_tokens=3, cost_nanousd=333_333_333),
    row("a3", "alice", "2025-01-07T11:00", team="eng", key_name="ci", status=429,
        error_class="budget_exceeded", input_tokens=0, output_tokens=0, cost_nanousd=0,
        model=None, upstream=None),
    row("b1", "bob", "2025-01-07T12:00", team="ops", input_tokens=50, output_tokens=50,
        upstream="other", cost_nanousd=None, price_version=None),
    row("b2", "bob", "2025-01-08T12:00", team="ops", status=502, error_class="upstream_5xx",
        input_tokens=9, output_tokens=0, cost_nanousd=9),
    row("c1", "carol", "2025-01-08T13:00", input_tokens=1, output_tokens=1, cost_nanousd=2),
]


def test_per_user_table_with_totals(books: Books, capsys: pytest.CaptureFixture[str]) -> None:
    books.write(TEAMS)
    _, out = usage(capsys, "--ledger", books.url, "--from", "2025-01-01", "--to", "2025-01-31")
    lines = out.splitlines()
    assert "2025-01-01 00:00 to 2025-02-01 00:00 (UTC)" in lines[0]
    assert lines[1].split() == ["user", "requests", "refused", "failed", "input", "cached",
                                "output", "reasoning", "total", "cost_usd", "unpriced"]
    assert lines[2].split() == ["alice", "3", "1", "0", "107", "40", "23", "5", "130",
                                "0.333334833", "0"]
    assert lines[3].split() == ["bob", "2", "0", "1", "59", "0", "50", "0", "109",
                                "0.000000009", "1"]
    assert lines[4].split() == ["carol", "1", "0", "0", "1", "0", "1", "0", "2",
                                "0.000000002", "0"]
    assert lines[5].split() == ["total", "6", "1", "1", "167", "40", "74", "5", "241",
                                "0.333334844", "1"]


def test_group_combinations_csv(books: Books, capsys: pytest.CaptureFixture[str]) -> None:
    books.write(TEAMS)
    span = ("--ledger", books.url, "--from", "2025-01-01", "--to", "2025-01-31")
    _, out = usage(capsys, *span, "--by", "team,model", "--format", "csv")
    got = [(r["team"], r["model"], r["requests"], r["total_tokens"], r["cost_usd"])
           for r in csv_rows(out)]
    assert got == [
        ("eng", "gpt-4o", "1", "10", "0.333333333"),
        ("eng", "mock-gpt", "2", "120", "0.000001500"),  # the refused one: its requested model
        ("ops", "mock-gpt", "2", "109", "0.000000009"),
        ("", "mock-gpt", "1", "2", "0.000000002"),  # no team sorts last
        ("total", "", "6", "241", "0.333334844"),
    ]
    _, out = usage(capsys, *span, "--by", "key,upstream,user", "--format", "csv")
    assert [(r["key"], r["upstream"], r["user"], r["requests"]) for r in csv_rows(out)] == [
        ("ci", "mock", "alice", "1"), ("ci", "", "alice", "1"), ("laptop", "mock", "alice", "1"),
        ("", "mock", "bob", "1"), ("", "mock", "carol", "1"), ("", "other", "bob", "1"),
        ("total", "", "", "6"),
    ]
    _, out = usage(capsys, *span, "--by", "day,user", "--format", "csv")
    assert [(r["day"], r["user"], r["requests"]) for r in csv_rows(out)] == [
        ("2025-01-06", "alice", "1"), ("2025-01-07", "alice", "2"), ("2025-01-07", "bob", "1"),
        ("2025-01-08", "bob", "1"), ("2025-01-08", "carol", "1"), ("total", "", "6"),
    ]
    # 2025-01-06 is a Monday: one week, one month.
    _, out = usage(capsys, *span, "--by", "month,week,team", "--format", "csv")
    assert [(r["month"], r["week"], r["team"], r["requests"]) for r in csv_rows(out)] == [
        ("2025-01", "2025-01-06", "eng", "3"), ("2025-01", "2025-01-06", "ops", "2"),
        ("2025-01", "2025-01-06", "", "1"), ("total", "", "", "6"),
    ]


def test_json_shape_and_exact_cost(books: Books, capsys: pytest.CaptureFixture[str]) -> None:
    # Sums past a double's 53 bits of precision stay exact to the nano-dollar.
    books.write([
        row("x1", "alice", "2025-02-03T09:00", cost_nanousd=10**17),
        row("x2", "alice", "2025-02-03T09:01", cost_nanousd=1),
        row("x3", "alice", "2025-02-03T09:02", cost_nanousd=333_333_333),
        row("x4", "bob", "2025-02-03T09:03", cost_nanousd=None),
    ])
    _, out = usage(capsys, "--ledger", books.url, "--from", "2025-02-01T00:00",
                   "--to", "2025-02-04", "--format", "json", "--by", "user,day")
    doc = json.loads(out)
    assert doc["timezone"] == "UTC" and doc["by"] == ["user", "day"]
    assert doc["from"] == "2025-02-01T00:00:00+00:00" and doc["to"] == "2025-02-05T00:00:00+00:00"
    alice, bob = doc["rows"]
    assert alice == {
        "user": "alice", "day": "2025-02-03", "requests": 3, "refused": 0, "failed": 0,
        "input_tokens": 30, "cached_input_tokens": 0, "output_tokens": 15,
        "reasoning_tokens": 0, "total_tokens": 45, "cost_usd": "100000000.333333334",
        "unpriced": 0, "cost_nanousd": 10**17 + 333_333_334, "total": False,
    }
    assert bob["cost_usd"] == "0.000000000" and bob["unpriced"] == 1
    assert doc["totals"]["requests"] == 4 and doc["totals"]["cost_usd"] == "100000000.333333334"
    assert "user" not in doc["totals"]


def test_buckets_follow_the_time_zone(books: Books, capsys: pytest.CaptureFixture[str]) -> None:
    books.write([
        row("t1", "alice", "2025-03-10T22:59"),  # 23:59 in Berlin: the 10th
        row("t2", "alice", "2025-03-10T23:30"),  # 00:30 on the 11th in Berlin
        row("t3", "alice", "2025-03-29T23:30"),  # 00:30 CET on Sunday the 30th (DST starts)
        row("t4", "alice", "2025-03-30T22:30"),  # 00:30 CEST on Monday the 31st
        row("t5", "alice", "2025-03-31T22:30"),  # 00:30 on April 1st
    ])
    _, out = usage(capsys, "--ledger", books.url, "--timezone", "Europe/Berlin",
                   "--from", "2025-03-01", "--to", "2025-04-30", "--by", "day,week,month",
                   "--format", "csv")
    assert [(r["day"], r["week"], r["month"]) for r in csv_rows(out)][:-1] == [
        ("2025-03-10", "2025-03-10", "2025-03"),
        ("2025-03-11", "2025-03-10", "2025-03"),
        ("2025-03-30", "2025-03-24", "2025-03"),
        ("2025-03-31", "2025-03-31", "2025-03"),
        ("2025-04-01", "2025-03-31", "2025-04"),
    ]
    # --to a date includes that local day, and only it.
    _, out = usage(capsys, "--ledger", books.url, "--timezone", "Europe/Berlin",
                   "--from", "2025-03-11", "--to", "2025-03-11", "--format", "csv")
    assert csv_rows(out)[-1]["requests"] == "1"
    # A datetime bound is an instant: t1 is before 2025-03-11T00:00 Berlin, t2 after.
    _, out = usage(capsys, "--ledger", books.url, "--timezone", "Europe/Berlin",
                   "--from", "2025-03-10T23:59", "--to", "2025-03-11T00:31", "--format", "csv")
    assert csv_rows(out)[-1]["requests"] == "2"
    _, out = usage(capsys, "--ledger", books.url, "--timezone", "UTC", "--from", "2025-03-10",
                   "--to", "2025-03-10", "--format", "csv")
    assert csv_rows(out)[-1]["requests"] == "2"


@pytest.mark.parametrize(("zone", "rows", "days"), [
    # +05:45: midnight is at 18:15 UTC.
    ("Asia/Kathmandu", [("2025-01-01T18:14", "k1"), ("2025-01-01T18:15", "k2")],
     ["2025-01-01", "2025-01-02"]),
    # Half-hour DST (+11 to +10:30 on 2025-04-06 02:00 local).
    ("Australia/Lord_Howe", [("2025-04-05T12:59", "l1"), ("2025-04-05T13:00", "l2"),
                             ("2025-04-06T13:29", "l3"), ("2025-04-06T13:30", "l4")],
     ["2025-04-05", "2025-04-06", "2025-04-06", "2025-04-07"]),
    # -0:44:30 (until 1972): midnight inside a 15-minute UTC slice.
    ("Africa/Monrovia", [("1971-06-01T00:40", "m1"), ("1971-06-01T00:44:45", "m2")],
     ["1971-05-31", "1971-06-01"]),
])
def test_offsets_of_any_size(books: Books, capsys: pytest.CaptureFixture[str], zone: str,
                             rows: list[tuple[str, str]], days: list[str]) -> None:
    books.write([row(rid, f"u-{rid}", when) for when, rid in rows])
    _, out = usage(capsys, "--ledger", books.url, "--timezone", zone, "--from", "1970-01-02",
                   "--to", "2030-01-01", "--by", "user,day", "--format", "csv")
    assert [r["day"] for r in csv_rows(out)][:-1] == days


def test_both_dialects_print_the_same(tmp_path: Path, module_pg: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    rows = [*TEAMS, *(row(f"z{i}", ("alice", "bob", "dan")[i % 3],
                          f"2025-01-{1 + i % 28:02d}T{i % 24:02d}:{(i * 7) % 60:02d}",
                          team=("eng", None)[i % 2], input_tokens=i, output_tokens=2 * i,
                          cost_nanousd=i * 1_000_003)
                      for i in range(200))]
    lite, pg = _sqlite_books(tmp_path), _pg_books(module_pg)
    lite.write(rows)
    pg.write(rows)
    for by in ("user", "team,model,day", "week,key", "month,upstream,user,day"):
        for fmt in ("table", "csv", "json"):
            args = ("--timezone", "America/New_York", "--from", "2025-01-01", "--to",
                    "2025-01-31", "--by", by, "--format", fmt)
            _, a = usage(capsys, "--ledger", lite.url, *args)
            _, b = usage(capsys, "--ledger", pg.url, *args)
            if fmt == "table":  # the caption names the ledger
                a, b = a.split("\n", 1)[1], b.split("\n", 1)[1]
            assert a == b, (by, fmt)


def test_default_ledger_is_the_state_dirs_file(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    now = datetime.now(UTC)
    assert main(["usage"]) == 1  # nothing written yet
    assert "no ledger at" in capsys.readouterr().err
    # With the default ledger, rows land in the state directory's ledger.sqlite3.
    write_sqlite(ledger_path(None), [row("d1", "alice", now.strftime("%Y-%m-%dT%H:%M"))])
    _, out = usage(capsys, "--format", "csv")
    assert [(r["user"], r["requests"]) for r in csv_rows(out)] == [("alice", "1"), ("total", "1")]
    config = tmp_path / "tm.yaml"
    config.write_text("timezone: Asia/Tokyo\nupstreams:\n  u:\n    base_url: http://127.0.0.1:9/v1\n")
    _, out = usage(capsys, "--config", str(config), "--format", "json")
    assert json.loads(out)["timezone"] == "Asia/Tokyo"
    config.write_text(config.read_text() + "ledger:\n  enabled: false\n")
    assert main(["usage", "--config", str(config)]) == 2
    assert "ledger is off" in capsys.readouterr().err


@pytest.mark.parametrize("args", [
    ["--date", "2025-01-01", "--by", "team"],  # --date selects the store view
    ["--source", "ledger", "--json"],
    ["--source", "store", "--format", "csv"],
    ["--by", "user,nation"],
    ["--by", "user,user"],
    ["--from", "2025-13-01"],
    ["--timezone", "Mars/Olympus"],
    ["--ledger", "mysql://x"],
])
def test_bad_arguments_exit_2(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["usage", *args]) == 2
    assert capsys.readouterr().err


def test_an_empty_table_or_no_database(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "empty.sqlite3"
    sqlite3.connect(path).close()
    assert main(["usage", "--ledger", f"sqlite://{path}"]) == 1
    assert "no ledger table" in capsys.readouterr().err
    assert main(["usage", "--ledger", "postgresql://postgres@127.0.0.1:1/none"]) == 1
    assert "cannot read the ledger" in capsys.readouterr().err


def test_the_store_view_of_a_config_without_users_points_to_the_ledger(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Open and pass-through modes have no budgets: the store keeps no counters to show.
    config = tmp_path / "open.yaml"
    config.write_text("upstreams:\n  u:\n    base_url: http://127.0.0.1:9/v1\n"
                      "store:\n  url: redis://127.0.0.1:1/0\n")
    assert main(["usage", "--config", str(config), "--source", "store"]) == 2
    assert "tokenmeter usage --config" in capsys.readouterr().err
