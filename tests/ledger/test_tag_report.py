"""`tokenmeter usage --by tag:KEY`: the ledger's rows by a tag's value, from SQLite and from a
real PostgreSQL with the same output; rows without the tag in a group of their own; a bad tag
key is refused before any query; a spool line from before tags still loads."""

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
from proxy.ledger.row import COLUMNS, LedgerRow
from tests.books import ledger_row, pg_admin, write_postgres, write_sqlite


def row(rid: str, tags: dict[str, str], **kw: Any) -> LedgerRow:
    return ledger_row(rid, datetime(2026, 11, 2, 12, tzinfo=UTC).timestamp(),
                      tags=json.dumps(tags, sort_keys=True, separators=(",", ":")), **kw)


ROWS = [
    row("a", {"feature": "faq", "env": "prod"}, input_tokens=10, output_tokens=1,
        cost_nanousd=101),
    row("b", {"feature": "faq"}, input_tokens=20, output_tokens=2, cost_nanousd=202),
    row("c", {"feature": "search", "env": "prod"}, input_tokens=30, output_tokens=3,
        cost_nanousd=303),
    row("d", {}, input_tokens=40, output_tokens=4, cost_nanousd=404),
    row("e", {"customer": "it's \"quoted\""}, input_tokens=50, output_tokens=5,
        cost_nanousd=505),
]
NOVEMBER = ("--timezone", "UTC", "--from", "2026-11-01", "--to", "2026-11-30")


@pytest.fixture
def ledgers(tmp_path: Path) -> Iterator[tuple[str, str]]:
    lite = tmp_path / "books.sqlite3"
    write_sqlite(lite, ROWS)
    name = f"tm_tags_{uuid.uuid4().hex[:12]}"
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


def test_by_tag_in_both_dialects(ledgers: tuple[str, str],
                                 capsys: pytest.CaptureFixture[str]) -> None:
    outputs = []
    for url in ledgers:
        doc = json.loads(usage(capsys, "--ledger", url, *NOVEMBER, "--by", "tag:feature",
                               "--format", "json"))
        got = {r["tag:feature"]: (r["requests"], r["input_tokens"], r["output_tokens"],
                                  r["cost_nanousd"], r["cost_usd"]) for r in doc["rows"]}
        assert got == {"faq": (2, 30, 3, 303, "0.000000303"),
                       "search": (1, 30, 3, 303, "0.000000303"),
                       None: (2, 90, 9, 909, "0.000000909")}
        assert doc["totals"]["cost_nanousd"] == 1515
        out = usage(capsys, "--ledger", url, *NOVEMBER, "--by", "tag:env,tag:customer",
                    "--format", "csv")
        cells = [(r["tag:env"], r["tag:customer"], r["requests"])
                 for r in csv.DictReader(io.StringIO(out))]
        assert cells == [("prod", "", "2"), ("", "it's \"quoted\"", "1"), ("", "", "2"),
                         ("total", "", "5")]
        table = usage(capsys, "--ledger", url, *NOVEMBER, "--by", "user,tag:feature")
        outputs.append((out, table.split("\n", 1)[1]))
        assert table.splitlines()[1].split()[:2] == ["user", "tag:feature"]
    assert outputs[0] == outputs[1]


def test_a_bad_tag_key_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    for by in ("tag:", "tag:Feature", "tag:a'b", "tag:a.b"):
        assert main(["usage", "--ledger", f"sqlite://{tmp_path}/none.sqlite3",
                     "--by", by]) == 2
        assert "tag key" in capsys.readouterr().err


def test_an_old_spool_line_loads_without_tags() -> None:
    old = ROWS[0].to_json().decode()
    values = json.loads(old)[:COLUMNS.index("tags")]  # written before the tags column
    assert LedgerRow.from_json(json.dumps(values)).tags == "{}"
