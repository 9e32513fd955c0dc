"""`tokenmeter usage --request-id ID`: one request's ledger row, found by either of its ids.

A developer's ticket quotes the id they saw: tokenmeter's (`x-tokenmeter-request-id`, in the
message of every error the proxy writes) or the upstream's (`x-request-id` / `request-id`, what
the OpenAI and Anthropic SDKs show as `request_id`, kept in the row's `upstream_request_id`
since schema v7). Both find the row; a ledger not yet migrated to v7 is searched by
tokenmeter's id alone.
"""

from __future__ import annotations

import csv
import io
import json
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any
from zoneinfo import ZoneInfo

from proxy.ledger.query import LedgerReader, schema_version
from proxy.ledger.row import COLUMNS
from proxy.ledger.schema import TABLE, UPSTREAM_ID_VERSION
from proxy.telemetry.shown_text import csv_cell, for_terminal

_UPSTREAM_ID = "upstream_request_id"
_TIMES = ("started_at", "ended_at")


async def find_request(reader: LedgerReader, request_id: str,
                       tz: ZoneInfo) -> list[dict[str, Any]]:
    """The rows whose tokenmeter id or upstream id is `request_id` (one, unless an upstream
    reused an id), oldest first: every column, times in `tz` (ISO 8601), cost in USD."""
    q = reader.sql()
    if await schema_version(reader) >= UPSTREAM_ID_VERSION:
        columns = COLUMNS
        where = f"request_id = {q.p(request_id)} OR {_UPSTREAM_ID} = {q.p(request_id)}"
    else:
        columns = tuple(c for c in COLUMNS if c != _UPSTREAM_ID)
        where = f"request_id = {q.p(request_id)}"
    found = await reader.fetch(f"SELECT {', '.join(columns)} FROM {TABLE} WHERE {where} "
                               "ORDER BY started_at, request_id", q.params)
    return [_shown(dict(zip(columns, row, strict=True)), tz) for row in found]


def _shown(row: dict[str, Any], tz: ZoneInfo) -> dict[str, Any]:
    for name in _TIMES:
        value = row[name]
        moment = (value if isinstance(value, datetime)
                  else datetime.fromtimestamp(float(value), UTC))
        row[name] = moment.astimezone(tz).isoformat()
    row["stream"] = bool(row["stream"])
    row.setdefault(_UPSTREAM_ID, None)
    # Exact dollars as the ledger holds them (nano-dollars), never a binary float.
    for nano, usd in (("cost_nanousd", "cost_usd"), ("saved_cost_nanousd", "saved_cost_usd")):
        value = row[nano]
        row[usd] = None if value is None else format(Decimal(int(value)).scaleb(-9), "f")
    return row


def render_rows(rows: list[dict[str, Any]], fmt: str) -> str:
    """`table` (one `column  value` block a row), `csv` or `json`."""
    if fmt == "json":
        return json.dumps(rows, indent=2, ensure_ascii=False)
    if fmt == "csv":
        out = io.StringIO()
        names = list(rows[0]) if rows else [*COLUMNS, "cost_usd", "saved_cost_usd"]
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(names)
        writer.writerows([[csv_cell("" if r[n] is None else str(r[n])) for n in names]
                          for r in rows])
        return out.getvalue().rstrip("\n")
    width = max(len(n) for n in COLUMNS)
    blocks = ["\n".join(f"{name.ljust(width)}  {for_terminal('-' if v is None else str(v))}"
                        for name, v in row.items()) for row in rows]
    return "\n\n".join(blocks)
