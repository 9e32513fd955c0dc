"""`tokenmeter usage` shows client-chosen text safely (issue 20, item 19): a model name with an
ESC sequence, CR/LF or a bidi override is shown escaped in the table, CSV cells that would run
as spreadsheet formulas are neutralised, and JSON carries every name exactly.

The rows are written to a real SQLite ledger and read back by the real CLI in a subprocess, so
what is checked is the bytes an operator's terminal or spreadsheet would get."""

from __future__ import annotations

import csv
import io
import json
import sqlite3
import subprocess
import sys
from collections.abc import Sequence
from contextlib import closing
from datetime import UTC, datetime
from pathlib import Path

import pytest

from proxy.ledger.row import COLUMNS, LedgerRow
from proxy.ledger.schema import MIGRATIONS, TABLE
from proxy.telemetry.shown_text import csv_cell, for_terminal

pytestmark = pytest.mark.timeout(60)

CLEAR = "\x1b[2J\x1b[H\x1b]0;pwned\x07"  # clear screen, home, set the window title
HOSTILE = {
    "esc": f"gpt{CLEAR}x",
    "forged": "m\r\nalice  999  0  0",  # a forged report line
    "formula": "=HYPERLINK(\"http://evil\",\"x\")",
    "plus": "+1+cmd|' /C calc'!A0",
    "minus": "-2+3",
    "at": "@SUM(1+1)",
    "tab": "\t=1+1",
    "spaced": "  =1+1",
    "bidi": "abc\u202edcba",
    "c1": "m\x9bq",
    "slash": "a\\x1bb",  # a backslash in a name cannot pass for an escaped ESC
}


def _row(rid: str, model: str) -> LedgerRow:
    start = datetime(2026, 11, 2, 12, tzinfo=UTC).timestamp()
    return LedgerRow(
        request_id=rid, started_at=start, ended_at=start + 0.5, replica="r1", user_name="alice",
        key_name=None, team=None, operation="chat", requested_model=model, model=model,
        response_model=model, upstream="mock", fallback_from=None, attempts=1, status=200,
        error_class="none", stream=False, input_tokens=10, output_tokens=5,
        cached_input_tokens=0, reasoning_tokens=0, token_source="reported", ttft_ms=1.0,
        upstream_ttft_ms=1.0, overhead_ms=0.1, duration_ms=2.0, output_tokens_per_s=1.0,
        cost_nanousd=1, price_version="p1", windows="",
    )


def _write(path: Path, rows: Sequence[LedgerRow]) -> None:
    with closing(sqlite3.connect(path)) as db:
        for migration in MIGRATIONS:
            for statement in migration.sqlite:
                db.execute(statement)
        marks = ", ".join("?" * len(COLUMNS))
        db.executemany(f"INSERT INTO {TABLE} ({', '.join(COLUMNS)}) VALUES ({marks})",
                       [tuple(getattr(r, c) for c in COLUMNS) for r in rows])
        db.commit()


@pytest.fixture
def ledger(tmp_path: Path) -> str:
    path = tmp_path / "books.sqlite3"
    _write(path, [_row(name, model) for name, model in HOSTILE.items()])
    return f"sqlite://{path}"


def _usage(ledger: str, *args: str) -> bytes:
    done = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "usage", "--ledger", ledger, "--timezone", "UTC",
         "--from", "2026-11-01", "--to", "2026-11-30", "--by", "model", *args],
        capture_output=True, timeout=30, check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _controls(data: bytes) -> set[int]:
    """Bytes a terminal acts on, newline aside; and C1 controls, UTF-8 encoded."""
    text = data.decode()
    return {ord(c) for c in text if (ord(c) < 0x20 and c != "\n") or 0x7F <= ord(c) <= 0x9F
            or c == "\u202e"}


def test_the_table_shows_names_escaped_one_line_each(ledger: str) -> None:
    out = _usage(ledger)
    assert _controls(out) == set()
    lines = out.decode().splitlines()
    # caption, header, one line per model, total: nothing forged
    assert len(lines) == 2 + len(HOSTILE) + 1
    text = out.decode()
    assert "gpt\\x1b[2J\\x1b[H\\x1b]0;pwned\\x07x" in text
    assert "m\\r\\nalice  999  0  0" in text
    assert "abc\\u202edcba" in text and "m\\x9bq" in text
    assert "a\\\\x1bb" in text


def test_csv_cells_never_start_a_formula(ledger: str) -> None:
    out = _usage(ledger, "--format", "csv")
    assert _controls(out) == set()
    assert len(out.decode().splitlines()) == 1 + len(HOSTILE) + 1  # one physical line each
    rows = list(csv.DictReader(io.StringIO(out.decode())))
    models = {r["model"] for r in rows if r["model"] != "total"}
    for cell in models:
        assert not cell.lstrip(" ").startswith(("=", "+", "-", "@", "\t", "\r")), cell
    assert "'=HYPERLINK(\"http://evil\",\"x\")" in models
    assert "'+1+cmd|' /C calc'!A0" in models and "'-2+3" in models and "'@SUM(1+1)" in models
    assert "\\t=1+1" in models and "'  =1+1" in models
    assert all(r["requests"] == "1" for r in rows if r["model"] != "total")  # numbers untouched


def test_json_carries_the_names_exactly(ledger: str) -> None:
    out = _usage(ledger, "--format", "json")
    assert _controls(out) == set()  # the encoder escapes them
    assert {r["model"] for r in json.loads(out)["rows"]} == set(HOSTILE.values())


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("gpt-4o", "gpt-4o"),
        ("modèle-é", "modèle-é"),
        ("\x00\x1b\x7f", "\\x00\\x1b\\x7f"),
        ("a\u2028b\u200bc", "a\\u2028b\\u200bc"),
        ("\U000e0041", "\\U000e0041"),  # a tag character (Cf)
        ("back\\slash", "back\\\\slash"),
    ],
)
def test_for_terminal(text: str, shown: str) -> None:
    assert for_terminal(text) == shown


def test_csv_cell_keeps_plain_names_and_negative_looking_ones_quoted() -> None:
    assert csv_cell("gpt-4o") == "gpt-4o"
    assert csv_cell("-1") == "'-1"
    assert csv_cell("\r=1") == "\\r=1"
