"""`tokenmeter usage` shows client-chosen text safely (issue 20, item 19): a model name with an
ESC sequence, CR/LF or a bidi override is shown escaped in the table, CSV cells that would run
as spreadsheet formulas are neutralised, and JSON carries every name exactly.

The rows are written to a real SQLite ledger and read back by the real CLI in a subprocess, so
what is checked is the bytes an operator's terminal or spreadsheet would get."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from proxy.telemetry.shown_text import csv_cell, for_terminal
from tests.books import ledger_row, write_sqlite

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

# Noon on 2 November 2026, inside the report's range.
START = datetime(2026, 11, 2, 12, tzinfo=UTC).timestamp()


@pytest.fixture
def ledger(tmp_path: Path) -> str:
    path = tmp_path / "books.sqlite3"
    write_sqlite(path, [ledger_row(name, START, requested_model=model, model=model,
                                   response_model=model, stream=False)
                        for name, model in HOSTILE.items()])
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
