"""`tokenmeter usage`'s plan: which rollups and rows answer a report, the SQL that reads them,
and the grouped totals it returns (`Report`, plain data). How a report is printed (a table,
CSV or JSON) is `proxy.ledger.report_render`'s.

A request belongs to the time it started (`started_at`), and to the group of its user, team, key
name, model (the one sent upstream; the one asked for when none was) and upstream. Days, weeks
(ISO: Monday to Sunday) and months are those of the configured time zone, DST and offsets of
any size included. The buckets are named in one place, `labels` (Python's zoneinfo):
- in a zone the local-day rollup holds (the configured `timezone`: the shipper adds it,
  `proxy.ledger.rollup.USAGE_LOCAL`), whole local days come from it, each in the bucket of its
  start: a day, week or month of the zone never cuts one, so a report over whole days is one
  read of it with nothing to correct, like UTC's of the day rollup. Its partial days at the
  period's ends come from the hour rollup, and the minutes between a local midnight and its
  hour's start (Kathmandu's) from the rows. Why not in every zone: the rollup is kept per zone,
  at one more sum per batch each, so it holds the zones a shipper was configured with;
- in any other zone, the rollups' rows (whole UTC days and hours, `proxy.ledger.rollup`) get
  theirs from a table of instants and bucket names the report's plan makes (`_timed`): a whole
  UTC day goes to the bucket holding most of it, and the hours of it another bucket holds
  (those between the UTC and the local midnight: one or two a day in Berlin, none in UTC) are
  taken out of that bucket and put into theirs, from the hour rollup. So a report over whole
  local days reads about one day-rollup row per group and day, not 24 hour-rollup rows (but
  2-5 times the rows of a report the local-day rollup serves);
- an hour a local midnight cuts (offsets of 30 or 45 minutes: India, Nepal, Newfoundland, where
  UTC days are read) and the minutes at the period's ends are read from the rows, each row
  bucketed by itself: PostgreSQL in SQL (`_PG_BUCKET`: `AT TIME ZONE`, `date_trunc('week',
  ...)` starts on Monday); SQLite, which has no time zones, by a function of ours (`tm_bucket`,
  `labels` worked out once per 15-minute UTC slice, exact when no local midnight falls inside
  the slice: true of every offset in use today; per row in a slice a midnight does cut, such
  as Monrovia's -0:44:30).
The database groups and sums (each branch its own rows, then their sums): Python sees one row
per group of the report. Both dialects give the same report from the same rows (the tests
check it).
"""

from __future__ import annotations

import enum
import itertools
import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from operator import itemgetter
from typing import Any
from zoneinfo import ZoneInfo

from proxy.config.load import collector_paused
from proxy.config.tags import valid_key
from proxy.ledger.query import LedgerReader, as_int, rollups_ready, zone_rolled
from proxy.ledger.rollup import (
    DAY_S,
    HOUR_S,
    USAGE,
    USAGE_DAILY,
    USAGE_LOCAL,
    Rollup,
    midnight,
    needs_zone,
)
from proxy.ledger.schema import TABLE
from proxy.storage.sql import Sql
from proxy.storage.urls import Dialect

SLICE_S = 900  # SQLite's UTC slice: every offset in use is a multiple of 15 minutes


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


@dataclass(slots=True)  # (not frozen: a frozen dataclass is made 8x slower, once per group)
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




@dataclass(frozen=True, slots=True)
class ReportPeriod:
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


def checked_period(period: ReportPeriod, start: str | None, end: str | None) -> ReportPeriod:
    """`period`, or ValueError when it holds no time (`--to` at or before `--from`): an
    empty report would read as "nothing was spent"."""
    if period.start is not None and period.end is not None and period.end <= period.start:
        raise ValueError(f"--to {end} is before --from {start} (--to D includes day D): "
                         "the period holds no time")
    return period


def check_tags(by: Sequence[Group], declared: Iterable[str]) -> None:
    """ValueError for a `--by tag:KEY` whose key the configuration's `tags:` does not declare:
    no request can carry it, so its report would be one group of everything."""
    known = sorted(declared)
    for key in by:
        if isinstance(key, TagGroup) and key.key not in known:
            listed = ", ".join(known) if known else "none"
            raise ValueError(f"--by {key}: the configuration declares no tag key {key.key!r} "
                             f"(tags: declares {listed})")


def default_period(tz: ZoneInfo, now: float) -> ReportPeriod:
    """The month so far."""
    today = datetime.fromtimestamp(now, tz).date()
    return ReportPeriod(tz, datetime(today.year, today.month, 1, tzinfo=tz), None)


Keys = tuple[str | None, ...]


@dataclass(frozen=True, slots=True)
class Report:
    by: tuple[Group, ...]
    period: ReportPeriod
    # Sorted by the group keys. Left out of the repr: Python 3.11's asyncio.run, restoring the
    # SIGINT handler at its end, builds a repr of the main task, result included (signal.
    # getsignal's failed enum lookup formats it): 60,000 groups were 0.65 s of every command.
    rows: tuple[tuple[Keys, Totals], ...] = field(repr=False)
    totals: Totals  # the rows' sums


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


async def build_report(reader: LedgerReader, by: Sequence[Group], period: ReportPeriod) -> Report:
    """One statement (one snapshot), grouped and summed by the database: the rollups' whole
    days (local or UTC) and hours, each put in its bucket by a table of instants and buckets
    the plan made, and the rows of what is left, bucketed row by row."""
    plain = [k for k in by if not k.is_time]
    timed = [k for k in by if isinstance(k, GroupKey) and k.is_time]
    plan = await _plan(reader, period, timed)
    q = reader.sql()
    pg = reader.dialect is Dialect.POSTGRESQL

    def keys(rows: bool) -> list[str]:
        """The group keys but time's, over a rollup (or the rows: `rows`)."""
        return [k.column(reader.dialect) if isinstance(k, TagGroup)
                else _DIM_EXPR[_DIM[k]] if rows else _DIM[k] for k in plain]

    row_bucket = None
    if timed and pg:  # the zone a parameter of the rows' branches: there when they are
        def row_bucket(q: Sql) -> str:
            tz = q.p(period.tz.key)
            return " || '|' || ".join(_PG_BUCKET[k].format(tz=tz) for k in timed)
    elif timed:
        reader.define(_BUCKET_FN, _bucket_namer(period.tz, timed))

        def row_bucket(q: Sql) -> str:
            return f"{_BUCKET_FN}(started_at)"
    ctes, branches, by_instant = _branches(q, plan, keys, row_bucket)
    n = len(plain) + bool(timed)
    text = ctes + branches[0]
    # A lone rollup read, all added: its rows come summed by instant (`_branches`), named here.
    named: dict[int, tuple[str, ...]] | None = None
    if by_instant:
        named = {int(t): tuple(b.split("|")) for t, b, _ in plan.reads[0].at}
    if len(branches) > 1:  # each branch summed its own rows: the sums of their sums
        cols = [*(f"k{i}" for i in range(n)),
                *(f"sum(s{j}){_cast(q)}" for j in range(len(USAGE.measures)))]
        text = (f"{ctes}SELECT {', '.join(cols)} FROM ({' UNION ALL '.join(branches)}) u"
                + _group_by(n))
    with collector_paused():  # tens of thousands of groups, none in a cycle
        found = await reader.fetch(text, q.params)
        grouped, values = _grouped(found, plain, timed, named)
    # Back in the order --by named them; no key (None) sorts after every text.
    order = [(plain + timed).index(k) for k in by]
    if order != sorted(order):
        grouped = {tuple(key[i] for i in order): t for key, t in grouped.items()}
    if any(None in key for key in grouped):
        rows = sorted(grouped.items(), key=lambda kv: tuple((v is None, v or "") for v in kv[0]))
    else:  # (the keys are unique: the Totals are never compared)
        rows = sorted(grouped.items(), key=itemgetter(0))
    return Report(tuple(by), period, tuple(rows), Totals(*map(sum, zip(*values, strict=True))))


def _grouped(found: Sequence[tuple[Any, ...]], plain: Sequence[Group],
             timed: Sequence[GroupKey], named: dict[int, tuple[str, ...]] | None
             ) -> tuple[dict[Keys, Totals], list[tuple[int, ...]]]:
    """The statement's rows (the keys but time's, the bucket or the instant `named` names, then
    the sums) by group, and their sums' values (for the totals)."""
    grouped: dict[Keys, Totals] = {}
    values: list[tuple[int, ...]] = []
    m = len(plain)
    n = m + bool(timed)
    # A tag's value may be a JSON number: shown as its text, like every other key.
    tags = [i for i, k in enumerate(plain) if isinstance(k, TagGroup)]
    for r in found:
        if not r[n]:  # no requests: a group the corrections emptied, or none at all
            continue
        key: Keys = (r[:m] if not timed else (*r[:m], *r[m].split("|")) if named is None
                     else (*r[:m], *named[r[m]]))
        if tags and any(not isinstance(key[i], str | None) for i in tags):
            key = tuple(None if v is None else str(v) for v in key)
        values.append(r[n:])
        t = Totals(*r[n:])
        grouped[key] = grouped[key] + t if key in grouped else t
    return grouped, values


def _cast(q: Sql) -> str:
    """PostgreSQL's sum of bigints is numeric: back to bigint, so both drivers give ints."""
    return "::bigint" if q.dialect is Dialect.POSTGRESQL else ""


def _group_by(n: int) -> str:
    return f" GROUP BY {', '.join(str(i + 1) for i in range(n))}" if n else ""


Span = tuple[float | None, float | None]  # [start, end) in epoch seconds; None: open
# A rollup row's start (a UTC day or hour), the bucket its sums go to, and +1 or -1.
Entry = tuple[float, str, int]


@dataclass(frozen=True, slots=True)
class _Read:
    """A rollup's rows: over `spans` (a report grouped by no time), or those starting at the
    instants of `at`, each added to (or, -1, taken from) the bucket named beside it."""

    rollup: Rollup
    spans: tuple[Span, ...] = ()
    at: tuple[Entry, ...] = ()
    zone: str | None = None  # the local-day rollup's: the zone read


@dataclass(frozen=True, slots=True)
class _Plan:
    """What a report reads: rollups (`reads`), the rows of the hours in `cut` (a bucket's
    boundary falls inside them) and the rows over the spans in `raw` (the edges of the period
    that are not whole hours). Together, signs counted: the period, each row once."""

    reads: tuple[_Read, ...]
    cut: tuple[float, ...]
    raw: tuple[Span, ...]


def _ceil(t: float, grain: int) -> float:
    return float(-(-t // grain) * grain)


def _floor(t: float, grain: int) -> float:
    return float(t // grain * grain)


@dataclass(frozen=True, slots=True)
class _Days:
    """The days a report reads whole from a day rollup: UTC's (`USAGE_DAILY`, for any zone:
    `tz` None), or the report's zone's own (`USAGE_LOCAL`, when it holds the zone: `tz`)."""

    rollup: Rollup
    tz: ZoneInfo | None = None

    @property
    def zone(self) -> str | None:
        return None if self.tz is None else self.tz.key

    def floor(self, t: float) -> float:
        """The start of the day `t` is in."""
        if self.tz is None:
            return _floor(t, DAY_S)
        return midnight(datetime.fromtimestamp(t, self.tz).date(), self.tz)

    def ceil(self, t: float) -> float:
        """The start of the first day starting at or after `t`."""
        start = self.floor(t)
        if start == t:
            return start
        if self.tz is None:
            return start + DAY_S
        return midnight(datetime.fromtimestamp(t, self.tz).date() + timedelta(days=1), self.tz)

    def starts(self, lo: float, hi: float) -> list[float]:
        """The days' starts in [lo, hi]."""
        out: list[float] = []
        t = self.ceil(lo)
        while t <= hi:
            out.append(t)
            t = self.ceil(t + 1)  # (a day is 23 hours at least)
        return out


async def _plan(reader: LedgerReader, period: ReportPeriod, timed: Sequence[GroupKey]) -> _Plan:
    """The period's whole days from a day rollup (the zone's own local days when the local-day
    rollup holds the zone, else UTC's), its other whole hours from the hour rollup, the rest
    (the minutes at each end; the minutes between a local midnight and its hour's start where
    a midnight is not on the hour) from the rows. Grouped by day, week or month over UTC days,
    each UTC day goes to the bucket holding most of it, corrected by the hour rollup's rows
    of its hours another bucket holds (`_timed`); a local day lies in one bucket whole."""
    start = None if period.start is None else period.start.timestamp()
    end = None if period.end is None else period.end.timestamp()
    if not await rollups_ready(reader):
        return _Plan((), (), ((start, end),))
    # The zones table read once: whether this zone's days are summed (a zone the shipper was
    # never configured with is not, nor is UTC, whose days are the UTC day rollup's).
    days = (_Days(USAGE_LOCAL, period.tz)
            if needs_zone(period.tz.key) and await zone_rolled(reader, period.tz.key)
            else _Days(USAGE_DAILY))
    # Whole hours, or the start of a day (a local midnight need not be on the hour).
    lo = None if start is None else start if days.floor(start) == start else _ceil(start,
                                                                                   HOUR_S)
    hi = None if end is None else end if days.floor(end) == end else _floor(end, HOUR_S)
    if lo is not None and hi is not None and lo >= hi:
        return _Plan((), (), ((start, end),))  # within an hour or two: the rows
    raw: list[Span] = []
    if start is not None and lo != start:
        raw.append((start, lo))
    if end is not None and hi != end:
        raw.append((hi, end))
    if not timed:
        reads, edges = _untimed(lo, hi, days)
        return _Plan(reads, (), (*raw, *edges))
    # The buckets' table lists the instants where the rollup has rows (the statement itself
    # reads the rollup at those instants only). An open end reaches past now, for the rows
    # landing meanwhile. (Two subqueries: SQLite finds a lone min or max in the index, not
    # both at once.)
    ((low, high),) = await reader.fetch(
        f"SELECT (SELECT min(started_at) FROM {USAGE.table}), "
        f"(SELECT max(started_at) FROM {USAGE.table})")
    if low is None:  # no rows (but those landing now): read them
        return _Plan((), (), ((start, end),))
    # Out to the starts of the days holding the first and the last rows (no rows lie between
    # those and the rows'): the edges of the rows' span are then whole days, read from the
    # day rollup like the others, not hour by hour.
    first = days.floor(_epoch(low)) if lo is None else max(lo, days.floor(_epoch(low)))
    after = (_floor(max(_epoch(high), time.time()), HOUR_S) + HOUR_S if hi is None
             else _epoch(high) + HOUR_S)
    last = days.ceil(after) if hi is None else min(hi, days.ceil(after))
    if first >= last:
        return _Plan((), (), tuple(raw))
    reads, cut, edges = _timed(period.tz, timed, first, last, days)
    return _Plan(reads, cut, (*raw, *edges))


_Whole = tuple[float, float]


def _split(a: float, b: float) -> tuple[_Whole, tuple[_Whole, ...]]:
    """[a, b): the whole hours in it, and the minutes around them (or all of it: no hour)."""
    h0, h1 = _ceil(a, HOUR_S), _floor(b, HOUR_S)
    if h0 >= h1:
        return (a, a), (((a, b),) if a < b else ())
    return (h0, h1), tuple(s for s in ((a, h0), (h1, b)) if s[0] < s[1])


def _untimed(lo: float | None, hi: float | None, days: _Days
             ) -> tuple[tuple[_Read, ...], tuple[Span, ...]]:
    """[lo, hi) (whole hours or starts of `days`, or open): its whole days from the day rollup
    of `days`, the whole hours at each end from the hour rollup, and (a day starting inside an
    hour) the minutes left between them, from the rows."""
    day_lo = None if lo is None else days.ceil(lo)
    day_hi = None if hi is None else days.floor(hi)
    reads: list[_Read] = []
    edges: list[_Whole] = []
    if lo is not None and hi is not None and days.ceil(lo) >= days.floor(hi):
        edges.append((lo, hi))
    else:
        reads.append(_Read(days.rollup, ((day_lo, day_hi),), zone=days.zone))
        if lo is not None:
            edges.append((lo, days.ceil(lo)))
        if hi is not None:
            edges.append((days.floor(hi), hi))
    hours: list[Span] = []
    rows: list[Span] = []
    for a, b in edges:
        whole, rest = _split(a, b)
        hours += [whole] if whole[0] != whole[1] else []
        rows += rest
    return (*reads, *((_Read(USAGE, tuple(hours)),) if hours else ())), tuple(rows)


def _timed(tz: ZoneInfo, timed: Sequence[GroupKey], first: float, last: float, days: _Days
           ) -> tuple[tuple[_Read, ...], tuple[float, ...], tuple[Span, ...]]:
    """The rollups' rows over [first, last) (whole hours, or starts of `days`), each with its
    bucket; the hours a bucket's boundary cuts (read from the rows); and the minutes between
    the first day's start and its hour's (and after the last day's end), where a day starts
    inside an hour (read from the rows too).

    A whole day goes to the bucket of its middle. A local day (`USAGE_LOCAL`) lies in that
    bucket whole: buckets change only at local midnights. A UTC day may not: its hours in
    another bucket (those between the UTC and the local midnight: one or two a day for Berlin,
    none in UTC) are taken out of that one and put into theirs. An hour (a day) whose first
    and last seconds are in one bucket lies in it whole, and the hours in the noon's bucket
    are one run around noon."""
    def name(t: float) -> str:
        return "|".join(labels(t, tz, timed))

    whole: list[Entry] = []
    hours: list[Entry] = []
    cut: list[float] = []

    def hour(h: float, day: str | None) -> bool:
        """Hour h, whose day is in bucket `day` (None: not read from a day rollup); whether it
        lies in that bucket."""
        at = name(h)
        if at != name(h + HOUR_S - 1):
            cut.append(h)  # a 30 or 45 minute offset's midnight: its rows
        elif at == day:
            return True
        else:
            hours.append((h, at, 1))
        if day is not None:
            hours.append((h, day, -1))
        return False

    bounds = days.starts(first, last)
    if len(bounds) < 2:
        bounds = []
    # The whole hours before the first whole day, and after the last, from the hour rollup; a
    # day starting inside an hour (Kathmandu's) leaves that hour's minutes to the rows.
    head, tail = ((first, bounds[0]), (bounds[-1], last)) if bounds else ((first, last), None)
    (h0, h1), rows = _split(*head)
    for h in _range(h0, h1, HOUR_S):
        hour(h, None)
    for d, e in itertools.pairwise(bounds):
        mid = d + (e - d) // 2
        noon = name(mid)
        whole.append((d, noon, 1))
        if name(d) != noon or name(e - 1) != noon:  # (a UTC day: its hours from both ends)
            for h in _range(d, mid, HOUR_S):  # from midnight UTC up to the run
                if hour(h, noon):
                    break
            for h in reversed(_range(mid, e, HOUR_S)):  # down to it
                if hour(h, noon):
                    break
    if tail is not None:
        (h0, h1), more = _split(*tail)
        rows += more
        for h in _range(h0, h1, HOUR_S):
            hour(h, None)
    reads = [_Read(r, at=tuple(e), zone=z) for r, e, z in
             ((days.rollup, whole, days.zone), (USAGE, hours, None)) if e]
    return tuple(reads), tuple(cut), tuple(rows)


def _range(lo: float, hi: float, step: int) -> list[float]:
    return [float(t) for t in range(int(lo), int(hi), step)]


def _epoch(value: object) -> float:
    return value.timestamp() if isinstance(value, datetime) else float(as_int(value))


def _branches(q: Sql, plan: _Plan, keys: Callable[[bool], list[str]],
              row_bucket: Callable[[Sql], str] | None) -> tuple[str, list[str], bool]:
    """The rollups' rows and the ledger's, each summed by the group keys (`keys`, then the
    bucket when grouped by time; columns k0.., then the measures' sums s0..); the tables of
    instants and buckets they read (`WITH`); and whether the one branch gives the instant in
    place of the bucket. Written in the text's order, as SQLite's placeholders are
    positional."""
    out = []
    pg = q.dialect is Dialect.POSTGRESQL
    # Each list of instants made a table once (SQLite would otherwise unpack its JSON for each
    # column of each rollup row it joins).
    ctes = [f"m{i} (t, label, sign) AS MATERIALIZED ({_entries(q, read.at)})"
            for i, read in enumerate(plan.reads) if read.at]
    with_ = "WITH " + ", ".join(ctes) + " " if ctes else ""
    lone = plan.reads[0] if len(plan.reads) == 1 and not plan.raw and not plan.cut else None
    if lone is not None and lone.at and all(s == 1 for _, _, s in lone.at):
        # One rollup, no corrections (UTC days, or buckets no midnight inside a UTC day cuts):
        # summed by the instant, which the caller names (cheaper than a join per rollup row).
        instant = "extract(epoch FROM r.started_at)::bigint" if pg else "r.started_at"
        return with_, [_summed(q, [*keys(False), instant],
                                 [f"r.{m.name}" for m in lone.rollup.measures],
                                 f"{lone.rollup.table} r WHERE {_zone(q, lone, 'r.')}"
                                 "r.started_at IN (SELECT t FROM m0)")], True
    for i, read in enumerate(plan.reads):
        table = read.rollup.table
        if read.at:  # one index range per instant
            sign = "" if all(s == 1 for _, _, s in read.at) else "m.sign * "
            # The list outside, the rollup's index inside: SQLite keeps a CROSS JOIN's order;
            # PostgreSQL, guessing the list's length, would rather scan the whole rollup (a
            # LATERAL subquery fenced by OFFSET 0 is a nested loop).
            zone = _zone(q, read, "")
            source = (f"LATERAL (SELECT * FROM {table} WHERE {zone}started_at = m.t OFFSET 0) r"
                      if pg else f"{table} r WHERE {zone}r.started_at = m.t")
            out.append(_summed(q, [*keys(False), "m.label"],
                               [f"{sign}r.{m.name}" for m in read.rollup.measures],
                               f"m{i} AS m CROSS JOIN {source}"))
        else:
            out.append(_summed(q, keys(False), [m.name for m in read.rollup.measures],
                               f"{table}{_where(q, read.spans, read.zone)}"))
    def rows() -> list[str]:  # (the zone a parameter in PostgreSQL: made where it is used)
        return [*keys(True), *([row_bucket(q)] if row_bucket else [])]

    measures = [m.expr for m in USAGE.measures]
    if plan.raw:
        out.append(_summed(q, rows(), measures,
                           f"{TABLE}{_where(q, plan.raw)}"))
    if plan.cut:
        # One index range per hour (a join with the list: an OR of hundreds of ranges is
        # deeper than SQLite's expression limit).
        within = f"started_at >= c.column1 AND started_at < c.column1 + {_step(HOUR_S, pg)}"
        # (PostgreSQL, grouping, would rather sort the whole ledger: the fenced LATERAL again.)
        source = (f"LATERAL (SELECT * FROM {TABLE} WHERE {within} OFFSET 0) r" if pg
                  else f"{TABLE} WHERE {within}")
        out.append(_summed(q, rows(), measures, f"{_instants(q, plan.cut)} CROSS JOIN {source}"))
    if not out:  # nothing to read (the period holds no rollup rows, and is whole hours)
        out.append(_summed(q, rows(), measures, f"{TABLE} WHERE 1 = 0"))
    return with_, out, False


def _summed(q: Sql, keys: Sequence[str], measures: Sequence[str], source: str) -> str:
    cols = [*(f"{k} AS k{i}" for i, k in enumerate(keys)),
            *(f"sum({m}){_cast(q)} AS s{j}" for j, m in enumerate(measures))]
    return f"SELECT {', '.join(cols)} FROM {source}{_group_by(len(keys))}"


def _where(q: Sql, spans: Sequence[Span], zone: str | None = None) -> str:
    first = f"zone = {q.p(zone)}" if zone is not None else ""
    conds = [" AND ".join(c) for c in (_span_cond(q, s) for s in spans)]
    within = " OR ".join(f"({c})" for c in conds) if all(conds) else ""
    both = [c for c in (first, within and f"({within})") if c]
    return f" WHERE {' AND '.join(both)}" if both else ""


def _zone(q: Sql, read: _Read, prefix: str) -> str:
    """The local-day rollup's rows of the report's zone, ANDed before a condition."""
    return "" if read.zone is None else f"{prefix}zone = {q.p(read.zone)} AND "


def _entries(q: Sql, entries: Sequence[Entry]) -> str:
    """A query of `entries` (t, label, sign) as one parameter (or three): no limit on their
    number."""
    if q.dialect is Dialect.POSTGRESQL:
        return (f"SELECT * FROM unnest("
                f"{q.p([datetime.fromtimestamp(t, UTC) for t, _, _ in entries])}::timestamptz[], "
                f"{q.p([b for _, b, _ in entries])}::text[], "
                f"{q.p([s for _, _, s in entries])}::int[])")
    doc = json.dumps([[int(t), b, s] for t, b, s in entries], separators=(",", ":"))
    return (f"SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]'), "
            f"json_extract(value, '$[2]') FROM json_each({q.p(doc)})")


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
    """SQLite's `tm_bucket(started_at)` for the rows a report reads: the row's local buckets,
    `|`-joined."""
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
