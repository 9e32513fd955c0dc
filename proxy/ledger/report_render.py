"""`tokenmeter usage`'s output: a report (`proxy.ledger.report_plan.Report`) as a table, CSV or
JSON.

Tokens: `total` is input + output; cached input is part of input, reasoning part of output, as
the upstreams count them. The Anthropic Messages API's prompt cache adds two types, both part of
input, as `tokenmeter_tokens_total` counts them: `cache_read` (the cached input of Messages
requests: what Anthropic reports as cache reads) and `cache_write` (prompt tokens written to the
cache). Their columns appear only in a report whose period has some, so a report of OpenAI-style
traffic alone has none.

Cost is the sum of the rows' `cost_nanousd`, printed as an exact decimal (never through a
float); `unpriced` counts requests whose model had no price, whose cost is therefore not in
`cost_usd`. `refused` counts requests the budget refused (429), `failed` those that ended in any
other error (the client's, the proxy's or the upstream's).

Group keys such as the model are the clients' text: the table shows them escaped for the
terminal and CSV cells are neutralised against formulas (`proxy.telemetry.shown_text`); JSON
carries them exactly, as its encoder escapes every control character.
"""

from __future__ import annotations

import csv
import enum
import io
import json
from dataclasses import dataclass
from datetime import datetime
from decimal import ROUND_HALF_UP, Decimal

from proxy.config.load import collector_paused
from proxy.ledger.report_plan import Report, ReportPeriod, Totals
from proxy.telemetry.shown_text import csv_cell, for_terminal

COLUMNS = ("requests", "refused", "failed", "input_tokens", "cached_input_tokens",
           "output_tokens", "reasoning_tokens", "total_tokens", "cost_usd", "unpriced")
_HEADINGS = ("requests", "refused", "failed", "input", "cached", "output", "reasoning",
             "total", "cost_usd", "unpriced")
# The prompt cache's columns, after `cached`, in a report that has any.
CACHE_COLUMNS = ("cache_read_input_tokens", "cache_creation_input_tokens")
_CACHE_HEADINGS = ("cache_read", "cache_write")
_CACHE_AT = COLUMNS.index("cached_input_tokens") + 1


# The response cache's columns, last, in a report that has any hit.
HIT_COLUMNS = ("hits", "saved_input_tokens", "saved_output_tokens", "saved_tokens",
               "saved_cost_usd")
_HIT_HEADINGS = ("hits", "saved_input", "saved_output", "saved_total", "saved_usd")


def _with_cache(report: Report) -> bool:
    t = report.totals
    return bool(t.cache_read_input_tokens or t.cache_creation_input_tokens)


def _with_hits(report: Report) -> bool:
    return report.totals.hits > 0


def _columns(report: Report, names: tuple[str, ...], cache: tuple[str, ...],
             hits: tuple[str, ...]) -> tuple[str, ...]:
    if _with_cache(report):
        names = (*names[:_CACHE_AT], *cache, *names[_CACHE_AT:])
    return (*names, *hits) if _with_hits(report) else names


class Rounding(enum.StrEnum):
    """How the USD columns are printed (`--round`)."""

    EXACT = "exact"  # nine decimals: the ledger's nano-dollars as they are
    CENTS = "cents"  # two decimals, half up (0.005 -> 0.01), as a spreadsheet's ROUND()

    def describe(self) -> str:
        """The rounding in words, for the export's header."""
        # Each line from its own exact sum: the lines' rounded costs may not add up to the
        # total's, which is the exact total rounded once.
        if self is Rounding.CENTS:
            return "cents, half up, each line from its exact sum"
        return "exact, nine decimals"


_CENT = Decimal("0.01")


@dataclass(frozen=True, slots=True)
class Export:
    """What an export says about itself beside the figures (`tokenmeter usage`'s options)."""

    # The fingerprint of the configuration's price table (`proxy.cost.price_version`, what
    # the proxy records in each ledger row's `price_version`), None without a configuration.
    # The rows were priced when written: a table changed since shows as another version here,
    # not as other costs.
    price_version: str | None = None
    rounding: Rounding = Rounding.EXACT
    total: bool = True  # the total line (`--no-total`: none)


def usd(nanousd: int, rounding: Rounding = Rounding.EXACT) -> str:
    """Dollars, exact with nine decimals (as `Decimal(nanousd).scaleb(-9)` prints them), or
    rounded to cents."""
    if rounding is Rounding.CENTS:
        return str(Decimal(nanousd).scaleb(-9).quantize(_CENT, rounding=ROUND_HALF_UP))
    whole, nano = divmod(abs(nanousd), 1_000_000_000)
    return f"{'-' if nanousd < 0 else ''}{whole}.{nano:09d}"


def _values(t: Totals, cache: bool = False, hits: bool = False,
            rounding: Rounding = Rounding.EXACT) -> tuple[int | str, ...]:
    out: tuple[int | str, ...] = (
        t.requests, t.refused, t.failed, t.input_tokens, t.cached_input_tokens,
        t.output_tokens, t.reasoning_tokens, t.total_tokens, usd(t.cost_nanousd, rounding),
        t.unpriced)
    if cache:
        out = (*out[:_CACHE_AT], t.cache_read_input_tokens, t.cache_creation_input_tokens,
               *out[_CACHE_AT:])
    if hits:
        out = (*out, t.hits, t.saved_input_tokens, t.saved_output_tokens, t.saved_tokens,
               usd(t.saved_cost_nanousd, rounding))
    return out


def _bound(moment: datetime | None) -> str | None:
    return None if moment is None else moment.isoformat()


# The export's own columns, after the figures (CSV; JSON has them as top-level fields).
META_COLUMNS = ("total", "period_from", "period_to", "timezone", "price_version",
                "cost_rounding")


def _meta(report: Report, export: Export, total: bool) -> list[str]:
    p = report.period
    return ["true" if total else "false", _bound(p.start) or "", _bound(p.end) or "",
            p.tz.key, export.price_version or "", export.rounding.describe()]


def render_csv(report: Report, export: Export = Export()) -> str:
    """One line per group, then `total` in the first group column with the sums. The group
    keys are the clients' text (a model name): each is made a safe cell (`csv_cell`).

    The export's facts are columns of every line (`META_COLUMNS`), not comment lines: a
    spreadsheet, pandas or a CSV reader takes them as they are (a `#` line is a data row to
    them), and a filter on `total` keeps the total line apart (its first column could also be
    a user named `total`)."""
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    cache, hits = _with_cache(report), _with_hits(report)
    r = export.rounding
    w.writerow([*map(str, report.by), *_columns(report, COLUMNS, CACHE_COLUMNS, HIT_COLUMNS),
                *META_COLUMNS])
    cells: dict[str | None, str] = {None: ""}  # a key (a user, a day) shows on many lines

    def cell(k: str | None) -> str:
        found = cells.get(k)
        if found is None:
            assert k is not None
            found = cells[k] = csv_cell(k)
        return found

    meta = _meta(report, export, False)
    with collector_paused():  # tens of thousands of groups, none in a cycle
        for keys, t in report.rows:
            w.writerow([*map(cell, keys), *_values(t, cache, hits, r), *meta])
    if export.total:
        w.writerow(["total", *[""] * (len(report.by) - 1),
                    *_values(report.totals, cache, hits, r), *_meta(report, export, True)])
    return out.getvalue()


def _json_totals(t: Totals, report: Report, export: Export, total: bool) -> dict[str, object]:
    columns = _columns(report, COLUMNS, CACHE_COLUMNS, HIT_COLUMNS)
    hits = _with_hits(report)
    values = _values(t, _with_cache(report), hits, export.rounding)
    out: dict[str, object] = {**dict(zip(columns, values, strict=True)),
                              "cost_nanousd": t.cost_nanousd}
    if hits:
        out["saved_cost_nanousd"] = t.saved_cost_nanousd
    out["total"] = total
    return out


def render_json(report: Report, export: Export = Export()) -> str:
    """`{"timezone", "from", "to", "price_version", "cost_rounding", "by", "rows": [...],
    "totals": {...}}` (no `totals` with `--no-total`); each row and the totals carry `total`
    (false, true). `cost_usd` is a decimal string (exact, or cents), `cost_nanousd` the exact
    cost as an integer whatever the rounding."""
    p = report.period
    doc: dict[str, object] = {
        "timezone": p.tz.key,
        "from": _bound(p.start),
        "to": _bound(p.end),
        "price_version": export.price_version,
        "cost_rounding": export.rounding.describe(),
        "by": list(map(str, report.by)),
        "rows": [{**dict(zip(map(str, report.by), keys, strict=True)),
                  **_json_totals(t, report, export, False)} for keys, t in report.rows],
    }
    if export.total:
        doc["totals"] = _json_totals(report.totals, report, export, True)
    return json.dumps(doc, indent=2)


def render_table(report: Report, caption: str | None = None,
                 export: Export = Export()) -> str:
    cache, hits = _with_cache(report), _with_hits(report)

    def cells(t: Totals) -> list[str]:
        return [v if isinstance(v, str) else f"{v:,}"
                for v in _values(t, cache, hits, export.rounding)]

    header = [*map(str, report.by), *_columns(report, _HEADINGS, _CACHE_HEADINGS, _HIT_HEADINGS)]
    # Group keys are the clients' text (a model name): shown escaped, never acted on.
    body = [[*("-" if k is None else for_terminal(k) for k in keys), *cells(t)]
            for keys, t in report.rows]
    if export.total:
        body.append(["total", *[""] * (len(report.by) - 1), *cells(report.totals)])
    table = [header, *body]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    n = len(report.by)
    lines = [
        "  ".join(c.ljust(w) if i < n else c.rjust(w)
                  for i, (c, w) in enumerate(zip(row, widths, strict=True))).rstrip()
        for row in table
    ]
    return "\n".join([caption, *lines] if caption else lines)


def describe_period(p: ReportPeriod) -> str:
    def moment(d: datetime | None, open_word: str) -> str:
        return open_word if d is None else d.strftime("%Y-%m-%d %H:%M")

    return f"{moment(p.start, 'the first row')} to {moment(p.end, 'now')} ({p.tz.key})"
