"""`tokenmeter usage`: usage and cost from the ledger, grouped and totalled: a table, CSV or JSON.

A request belongs to the time it started (`started_at`), and to the group of its user, team, key
name, model (the one sent upstream; the one asked for when none was) and upstream. Days, weeks
(ISO: Monday to Sunday) and months are those of the configured time zone, DST and offsets of
any size included:
- PostgreSQL buckets in SQL (`AT TIME ZONE`, `date_trunc('week', ...)` starts on Monday);
- SQLite has no time zones: a function of ours (`tm_bucket`, Python's zoneinfo) names each
  row's local buckets, worked out once per 15-minute UTC slice, which is exact when no local
  midnight falls inside the slice: true of every offset in use today (all are multiples of 15
  minutes); in a slice a midnight does cut (historic offsets such as Monrovia's -0:44:30), per
  row. SQLite then groups by the names, as PostgreSQL does.
Both dialects give the same report from the same rows (the tests check it).

Tokens: `total` is input + output; cached input is part of input, reasoning part of output, as
the upstreams count them. The Anthropic Messages API's prompt cache adds two types, both part of
input, as `tokenmeter_tokens_total` counts them: `cache_read` (the cached input of Messages
requests: what Anthropic reports as cache reads) and `cache_write` (prompt tokens written to the
cache). Their columns appear only in a report whose period has some, so a report of OpenAI-style
traffic alone is what it always was.

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
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from decimal import Decimal
from typing import Any
from zoneinfo import ZoneInfo

from proxy.config.tags import valid_key
from proxy.ledger.query import Dialect, LedgerReader, Sql, as_int, rollups_ready
from proxy.ledger.rollup import DAY_S, HOUR_S, USAGE, USAGE_DAILY, Rollup
from proxy.ledger.schema import TABLE
from proxy.telemetry.shown_text import csv_cell, for_terminal

SLICE_S = 900
# A report's UTC days and hours its buckets' boundaries cut are each one statement parameter:
# past this many (ten years of days, and an hour in each) it reads all its rows instead.
MAX_CUT = 7320  # SQLite's UTC slice: every offset in use is a multiple of 15 minutes


class GroupKey(enum.StrEnum):
    USER = "user"
    TEAM = "team"
    KEY = "key"
    MODEL = "model"
    UPSTREAM = "upstream"
    DAY = "day"  # YYYY-MM-DD
    WEEK = "week"  # the Monday it starts on, YYYY-MM-DD
    MONTH = "month"  # YYYY-MM

    @property
    def is_time(self) -> bool:
        return self in _TIME_KEYS


_TIME_KEYS = frozenset({GroupKey.DAY, GroupKey.WEEK, GroupKey.MONTH})


@dataclass(frozen=True, slots=True)
class TagGroup:
    """`--by tag:feature`: the rows by one tag's value; rows without the tag in one group
    whose key is None (`-` in the table, an empty CSV cell, JSON null). Read from the `tags`
    column, of the rows or of the rollup alike (the rollup keeps the rows' tags text as they
    are: `proxy.ledger.rollup.USAGE`)."""

    key: str  # a tag key (proxy.config.tags.KEY): safe to write into the SQL as it is

    is_time = False

    def __str__(self) -> str:
        return f"tag:{self.key}"

    def column(self, dialect: Dialect) -> str:
        if dialect is Dialect.SQLITE:
            return f"json_extract({_TAGS}, '$.{self.key}')"
        return f"({_TAGS}::jsonb ->> '{self.key}')"


Group = GroupKey | TagGroup

# The rollup's column of each group (`proxy.ledger.rollup.USAGE`; the rows' expression is there).
_DIM = {
    GroupKey.USER: "user_name",
    GroupKey.TEAM: "team",
    GroupKey.KEY: "key_name",
    GroupKey.MODEL: "model",
    GroupKey.UPSTREAM: "upstream",
}
_DIM_EXPR = {d.name: d.expr for d in USAGE.dims}
_TAGS = "tags"  # the rollup's column of the rows' tags (one, whichever keys a report names)

_PG_BUCKET = {
    GroupKey.DAY: "to_char(started_at AT TIME ZONE {tz}, 'YYYY-MM-DD')",
    GroupKey.WEEK: "to_char(date_trunc('week', started_at AT TIME ZONE {tz}), 'YYYY-MM-DD')",
    GroupKey.MONTH: "to_char(started_at AT TIME ZONE {tz}, 'YYYY-MM')",
}

def parse_by(text: str) -> tuple[Group, ...]:
    """`user,model,day,tag:feature` -> the group keys, in that order; ValueError names what
    is wrong."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError("--by needs at least one of " + ",".join(GroupKey))
    keys: list[Group] = []
    for name in names:
        if name.startswith("tag:"):
            if not valid_key(name[4:]):
                raise ValueError(f"--by: {name!r}: a tag key is a lower-case word "
                                 "([a-z][a-z0-9_]*)")
            keys.append(TagGroup(name[4:]))
            continue
        try:
            keys.append(GroupKey(name))
        except ValueError:
            raise ValueError(
                f"--by: unknown group {name!r} (choose from {','.join(GroupKey)},tag:KEY)"
            ) from None
    if len(set(keys)) != len(keys):
        raise ValueError("--by names a group twice")
    return tuple(keys)


@dataclass(frozen=True, slots=True)
class Totals:
    requests: int = 0
    refused: int = 0
    failed: int = 0
    input_tokens: int = 0
    cached_input_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0
    cost_nanousd: int = 0
    unpriced: int = 0
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0
    # Answered by the response cache, and what those answers used when they were first made
    # (not in the token and cost columns above: a hit spends nothing upstream).
    hits: int = 0
    saved_input_tokens: int = 0
    saved_output_tokens: int = 0
    saved_cost_nanousd: int = 0

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    @property
    def saved_tokens(self) -> int:
        return self.saved_input_tokens + self.saved_output_tokens

    @property
    def saved_cost_usd(self) -> Decimal:
        return Decimal(self.saved_cost_nanousd).scaleb(-9)

    @property
    def cost_usd(self) -> Decimal:
        return Decimal(self.cost_nanousd).scaleb(-9)

    def __add__(self, other: Totals) -> Totals:
        return Totals(
            self.requests + other.requests, self.refused + other.refused,
            self.failed + other.failed, self.input_tokens + other.input_tokens,
            self.cached_input_tokens + other.cached_input_tokens,
            self.output_tokens + other.output_tokens,
            self.reasoning_tokens + other.reasoning_tokens,
            self.cost_nanousd + other.cost_nanousd, self.unpriced + other.unpriced,
            self.cache_read_input_tokens + other.cache_read_input_tokens,
            self.cache_creation_input_tokens + other.cache_creation_input_tokens,
            self.hits + other.hits, self.saved_input_tokens + other.saved_input_tokens,
            self.saved_output_tokens + other.saved_output_tokens,
            self.saved_cost_nanousd + other.saved_cost_nanousd,
        )

    @staticmethod
    def of(values: Sequence[object]) -> Totals:
        return Totals(*(as_int(v) for v in values))


_ZERO = Totals()


@dataclass(frozen=True, slots=True)
class Period:
    """[start, end) in a time zone; a missing bound is open."""

    tz: ZoneInfo
    start: datetime | None = None  # aware
    end: datetime | None = None  # aware, exclusive


def parse_bound(text: str, tz: ZoneInfo, *, end: bool) -> datetime:
    """`YYYY-MM-DD` (a whole day: as an end, the day is included) or `YYYY-MM-DDTHH:MM[:SS]`
    (that instant), in `tz` unless it carries its own offset."""
    text = text.strip()
    if "T" in text or " " in text:
        moment = datetime.fromisoformat(text)
        return moment if moment.tzinfo is not None else moment.replace(tzinfo=tz)
    day = date.fromisoformat(text)
    if end:
        day += timedelta(days=1)
    # Midnight, first occurrence (fold=0); where the clocks skip midnight, the instant the
    # day really starts.
    return datetime(day.year, day.month, day.day, tzinfo=tz)


def default_period(tz: ZoneInfo, now: float) -> Period:
    """The month so far."""
    today = datetime.fromtimestamp(now, tz).date()
    return Period(tz, datetime(today.year, today.month, 1, tzinfo=tz), None)


Keys = tuple[str | None, ...]


@dataclass(frozen=True, slots=True)
class Report:
    by: tuple[Group, ...]
    period: Period
    rows: tuple[tuple[Keys, Totals], ...]  # sorted by the group keys

    @property
    def totals(self) -> Totals:
        out = Totals()
        for _, t in self.rows:
            out += t
        return out


def labels(moment: float, tz: ZoneInfo, keys: Iterable[GroupKey]) -> tuple[str, ...]:
    """The local day, week and month buckets of an instant."""
    local = datetime.fromtimestamp(moment, tz).date()
    out = []
    for key in keys:
        if key is GroupKey.DAY:
            out.append(local.isoformat())
        elif key is GroupKey.WEEK:
            out.append((local - timedelta(days=local.weekday())).isoformat())
        else:
            out.append(f"{local.year:04d}-{local.month:02d}")
    return tuple(out)


async def build_report(reader: LedgerReader, by: Sequence[Group], period: Period) -> Report:
    """One statement (one snapshot): the rollup's whole hours and the rows of the rest."""
    plain = [k for k in by if not k.is_time]
    timed = [k for k in by if isinstance(k, GroupKey) and k.is_time]
    plan = await _plan(reader, period, timed)
    q = reader.sql()
    select = [_DIM[k] if isinstance(k, GroupKey) else k.column(reader.dialect) for k in plain]
    if timed and reader.dialect is Dialect.POSTGRESQL:
        tz = q.p(period.tz.key)
        select += [_PG_BUCKET[k].format(tz=tz) for k in timed]
    elif timed:
        reader.define(_BUCKET_FN, _bucket_namer(period.tz, timed))
        select.append(f"{_BUCKET_FN}(started_at)")
    groups = ", ".join(str(i + 1) for i in range(len(select)))
    sums = [f"sum({m.name})" for m in USAGE.measures]
    dims = [_DIM[k] for k in plain if isinstance(k, GroupKey)]
    dims += [_TAGS] if any(isinstance(k, TagGroup) for k in plain) else []
    dims += ["started_at"] if timed else []
    text = (f"SELECT {', '.join([*select, *sums])} FROM ({_branches(q, plan, dims)}) u"
            + (f" GROUP BY {groups}" if groups else ""))
    n = len(select)
    sqlite_timed = bool(timed) and reader.dialect is Dialect.SQLITE
    grouped: dict[Keys, Totals] = {}
    for r in await reader.fetch(text, q.params):
        keys: tuple[Any, ...] = tuple(r[:n])
        if sqlite_timed:
            keys = (*keys[:-1], *str(keys[-1]).split("|"))
        key = tuple(None if v is None else str(v) for v in keys)
        grouped[key] = grouped.get(key, _ZERO) + Totals.of(r[n:])
    # Back in the order --by named them.
    order = [(plain + timed).index(k) for k in by]
    rows = sorted(
        ((tuple(keys[i] for i in order), t) for keys, t in grouped.items() if t.requests),
        key=lambda item: tuple((v is None, v or "") for v in item[0]),
    )
    return Report(tuple(by), period, tuple(rows))


Span = tuple[float | None, float | None]  # [start, end) in epoch seconds; None: open


@dataclass(frozen=True, slots=True)
class _Read:
    """A rollup's rows over `span` (or, when `days` are given, over those UTC days) but for
    those starting at `skip`."""

    rollup: Rollup
    span: Span
    skip: tuple[float, ...] = ()
    days: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class _Plan:
    """What a report reads: rollups (`reads`, disjoint), the rows of the hours in `cut` (a
    bucket's boundary falls inside them), and the rows over the spans in `raw` (the edges of
    the period that are not whole hours). Together: the period, each row once."""

    reads: tuple[_Read, ...]
    cut: tuple[float, ...]
    raw: tuple[Span, ...]


def _ceil(t: float, grain: int) -> float:
    return float(-(-t // grain) * grain)


def _floor(t: float, grain: int) -> float:
    return float(t // grain * grain)


async def _plan(reader: LedgerReader, period: Period, timed: Sequence[GroupKey]) -> _Plan:
    """Whole UTC days from the day rollup, unless a bucket's boundary (a local midnight, for a
    report grouped by day, week or month) falls inside one; the hours of those days and of the
    period's partial days from the hour rollup, unless a boundary falls inside the hour
    (offsets that are not whole hours); what is left from the rows."""
    start = None if period.start is None else period.start.timestamp()
    end = None if period.end is None else period.end.timestamp()
    if not await rollups_ready(reader):
        return _Plan((), (), ((start, end),))
    lo = None if start is None else _ceil(start, HOUR_S)
    hi = None if end is None else _floor(end, HOUR_S)
    if lo is not None and hi is not None and lo >= hi:
        return _Plan((), (), ((start, end),))  # within an hour or two: the rows
    raw: list[Span] = []
    if start is not None and lo != start:
        raw.append((start, lo))
    if end is not None and hi != end:
        raw.append((hi, end))
    # Where the rollup has rows, for the zone's arithmetic (the statement itself keeps the
    # period's open ends; an open end reaches past now, for the rows landing meanwhile).
    # (Two subqueries: SQLite finds a lone min or max in the index, not both at once.)
    ((low, high),) = await reader.fetch(
        f"SELECT (SELECT min(started_at) FROM {USAGE.table}), "
        f"(SELECT max(started_at) FROM {USAGE.table})")
    if low is None:
        return _Plan((_Read(USAGE, (lo, hi)),), (), tuple(raw))
    first = _epoch(low) if lo is None else max(lo, _epoch(low))
    last = (max(_epoch(high), time.time()) + HOUR_S if hi is None
            else min(hi, _epoch(high) + HOUR_S))
    cut_days, cut = _cuts(period.tz, timed, first, last) if timed else ((), ())
    if len(cut_days) + len(cut) > MAX_CUT:
        return _Plan((), (), ((start, end),))
    day_lo = None if lo is None else _ceil(lo, DAY_S)
    day_hi = None if hi is None else _floor(hi, DAY_S)
    if day_lo is not None and day_hi is not None and day_lo >= day_hi:
        return _Plan((_Read(USAGE, (lo, hi), cut),), cut, tuple(raw))
    inside = tuple(d for d in cut_days if (day_lo is None or d >= day_lo)
                   and (day_hi is None or d < day_hi))
    reads = [_Read(USAGE_DAILY, (day_lo, day_hi), inside)]
    if inside:
        reads.append(_Read(USAGE, (None, None), cut, inside))
    if lo is not None and lo != day_lo:
        reads.append(_Read(USAGE, (lo, day_lo), cut))
    if hi is not None and hi != day_hi:
        reads.append(_Read(USAGE, (day_hi, hi), cut))
    return _Plan(tuple(reads), cut, tuple(raw))


def _epoch(value: object) -> float:
    return value.timestamp() if isinstance(value, datetime) else float(as_int(value))


def _cuts(tz: ZoneInfo, timed: Sequence[GroupKey], first: float, last: float
          ) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Over [first, last): the UTC days a bucket's boundary falls inside (not at their start),
    and within those the hours it does. Buckets change only at local midnights, so a day (an
    hour) whose first and last seconds are in one bucket lies in it whole."""
    days: list[float] = []
    hours: list[float] = []
    day = first - first % DAY_S
    while day < last:
        if labels(day, tz, timed) != labels(day + DAY_S - 1, tz, timed):
            days.append(day)
            for h in range(int(max(day, first)), int(min(day + DAY_S, last)), HOUR_S):
                if labels(h, tz, timed) != labels(h + HOUR_S - 1, tz, timed):
                    hours.append(float(h))
        day += DAY_S
    return tuple(days), tuple(hours)


def _raw_cols(dims: Sequence[str]) -> str:
    return ", ".join([*(f"{_DIM_EXPR.get(d, d)} AS {d}" for d in dims),
                      *(f"{m.expr} AS {m.name}" for m in USAGE.measures)])


def _branches(q: Sql, plan: _Plan, dims: Sequence[str]) -> str:
    """The rollups' rows and the ledger's, one shape (`dims`, then the measures): UNION ALL.
    Written in the text's order, as SQLite's placeholders are positional."""
    out = []
    pg = q.dialect is Dialect.POSTGRESQL
    for read in plan.reads:
        cols = ", ".join([*dims, *(m.name for m in read.rollup.measures)])
        source = read.rollup.table
        if read.days:  # one index range per day
            source = (f"{_instants(q, read.days)} JOIN {source} ON started_at >= c.column1 "
                      f"AND started_at < c.column1 + {_step(DAY_S, pg)}")
        cond = _span_cond(q, read.span)
        if read.skip:
            cond.append(f"started_at NOT IN ({', '.join(q.ts(h) for h in read.skip)})")
        where = " WHERE " + " AND ".join(cond) if cond else ""
        out.append(f"SELECT {cols} FROM {source}{where}")
    if plan.raw:
        spans = [" AND ".join(c) for c in (_span_cond(q, s) for s in plan.raw)]
        where = (" WHERE " + " OR ".join(f"({c})" for c in spans)) if all(spans) else ""
        out.append(f"SELECT {_raw_cols(dims)} FROM {TABLE}{where}")
    if plan.cut:
        # One index range per hour (a join with the list: an OR of hundreds of ranges is
        # deeper than SQLite's expression limit).
        out.append(f"SELECT {_raw_cols(dims)} FROM {_instants(q, plan.cut)} JOIN {TABLE} "
                   f"ON started_at >= c.column1 AND started_at < c.column1 + "
                   f"{_step(HOUR_S, pg)}")
    return " UNION ALL ".join(out)


def _instants(q: Sql, moments: Sequence[float]) -> str:
    """A one-column table `c` of instants (`c.column1`, in both dialects)."""
    cast = "::timestamptz" if q.dialect is Dialect.POSTGRESQL else ""
    return f"(VALUES {', '.join(f'({q.ts(m)}{cast})' for m in moments)}) AS c"


def _step(seconds: int, pg: bool) -> str:
    return f"interval '{seconds} seconds'" if pg else str(seconds)


def _span_cond(q: Sql, span: Span) -> list[str]:
    cond = []
    if span[0] is not None:
        cond.append(f"started_at >= {q.ts(span[0])}")
    if span[1] is not None:
        cond.append(f"started_at < {q.ts(span[1])}")
    return cond


_BUCKET_FN = "tm_bucket"


def _bucket_namer(tz: ZoneInfo, timed: Sequence[GroupKey]) -> Callable[[float], str]:
    """SQLite's `tm_bucket(started_at)`: the row's local buckets, `|`-joined."""
    slices: dict[int, str | None] = {}

    def name(moment: float) -> str:
        index = int(moment // SLICE_S)
        found = slices.get(index, "")
        if found == "":
            lo = index * SLICE_S
            first = labels(lo, tz, timed)
            # Offsets are whole seconds: a midnight inside the slice shows at its last second.
            found = "|".join(first) if first == labels(lo + SLICE_S - 1, tz, timed) else None
            slices[index] = found
        return found if found is not None else "|".join(labels(moment, tz, timed))

    return name


# --- output ---------------------------------------------------------------------------------

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


def _usd(t: Totals) -> str:
    return f"{t.cost_usd:f}"  # always nine decimals, exact


def _values(t: Totals, cache: bool = False, hits: bool = False) -> tuple[int | str, ...]:
    out: tuple[int | str, ...] = (
        t.requests, t.refused, t.failed, t.input_tokens, t.cached_input_tokens,
        t.output_tokens, t.reasoning_tokens, t.total_tokens, _usd(t), t.unpriced)
    if cache:
        out = (*out[:_CACHE_AT], t.cache_read_input_tokens, t.cache_creation_input_tokens,
               *out[_CACHE_AT:])
    if hits:
        out = (*out, t.hits, t.saved_input_tokens, t.saved_output_tokens, t.saved_tokens,
               f"{t.saved_cost_usd:f}")
    return out


def render_csv(report: Report) -> str:
    """One line per group, then `total` in the first group column with the sums. The group
    keys are the clients' text (a model name): each is made a safe cell (`csv_cell`)."""
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    cache, hits = _with_cache(report), _with_hits(report)
    w.writerow([*map(str, report.by), *_columns(report, COLUMNS, CACHE_COLUMNS, HIT_COLUMNS)])
    for keys, t in report.rows:
        w.writerow([*("" if k is None else csv_cell(k) for k in keys),
                    *_values(t, cache, hits)])
    w.writerow(["total", *[""] * (len(report.by) - 1), *_values(report.totals, cache, hits)])
    return out.getvalue()


def _json_totals(t: Totals, report: Report) -> dict[str, object]:
    columns = _columns(report, COLUMNS, CACHE_COLUMNS, HIT_COLUMNS)
    hits = _with_hits(report)
    values = _values(t, _with_cache(report), hits)
    out: dict[str, object] = {**dict(zip(columns, values, strict=True)),
                              "cost_nanousd": t.cost_nanousd}
    if hits:
        out["saved_cost_nanousd"] = t.saved_cost_nanousd
    return out


def render_json(report: Report) -> str:
    """`{"timezone", "from", "to", "by", "rows": [...], "totals": {...}}`; `cost_usd` is a
    decimal string (exact), `cost_nanousd` the same as an integer."""
    p = report.period
    doc = {
        "timezone": p.tz.key,
        "from": None if p.start is None else p.start.isoformat(),
        "to": None if p.end is None else p.end.isoformat(),
        "by": list(map(str, report.by)),
        "rows": [{**dict(zip(map(str, report.by), keys, strict=True)), **_json_totals(t, report)}
                 for keys, t in report.rows],
        "totals": _json_totals(report.totals, report),
    }
    return json.dumps(doc, indent=2)


def render_table(report: Report, caption: str | None = None) -> str:
    cache, hits = _with_cache(report), _with_hits(report)

    def cells(t: Totals) -> list[str]:
        return [v if isinstance(v, str) else f"{v:,}" for v in _values(t, cache, hits)]

    header = [*map(str, report.by), *_columns(report, _HEADINGS, _CACHE_HEADINGS, _HIT_HEADINGS)]
    # Group keys are the clients' text (a model name): shown escaped, never acted on.
    body = [[*("-" if k is None else for_terminal(k) for k in keys), *cells(t)]
            for keys, t in report.rows]
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


def describe_period(p: Period) -> str:
    def moment(d: datetime | None, open_word: str) -> str:
        return open_word if d is None else d.strftime("%Y-%m-%d %H:%M")

    return f"{moment(p.start, 'the first row')} to {moment(p.end, 'now')} ({p.tz.key})"
