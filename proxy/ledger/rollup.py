"""Rollups: the ledger's rows summed per UTC hour and per the dimensions reports group by, kept
in the same transaction as the rows they sum, so `tokenmeter usage` and `reconcile` read a few
thousand rollup rows instead of millions of ledger rows.

Why UTC hours (and days). A report's days, weeks and months are those of its time zone, so
rollups keyed by UTC day could serve only UTC reports; an hour serves every zone whose offset
is a whole number of hours (all but a few; those still get exact answers: an hour a local
midnight cuts is read from the rows, see `proxy.ledger.report_plan`). A year is 8,760 hours times
the groups active in each, which for a busy team is millions of rollup rows again: so the same
sums are kept per UTC day too. A report over whole days can read the day rollup in any zone: a
local day is the UTC day holding most of it, corrected by the hour rollup's rows of the hours
between the two midnights (one or two a day for Berlin, four or five for New York;
`proxy.ledger.report_plan._timed`); the hours serve the period's partial days, the rows what is
left of a partial hour.

Why local days too. Those corrections are 2-5 times the day rollup's rows a day: a year of a
busy team's `--by user,day` in Berlin read 3.4 times UTC's rows, seconds at 20M ledger rows.
The configured zone (`timezone`) is the one reports are usually asked in, so its days are kept
too: `USAGE_LOCAL`, keyed by zone and the UTC instant its local day starts at, for the zones
`ZONES` lists. A report in such a zone reads its whole days from it with no correction (a
day, week or month of the zone never cuts one of its days). The zone is a column, not a table
per zone, so every statement stays one text for any zone (the changed rows joined with the
zones table) and a zone added (the shipper's backfill, `proxy.ledger.migrate`) is kept by the
very next batch. SQLite has no time zones: `tm_local_day`, a function of ours (zoneinfo,
cached per 15-minute slice), which every connection writing the ledger registers.

Exact and idempotent. Each rollup is maintained from the rows a batch actually inserted (a
row shipped twice is inserted once: `ON CONFLICT (request_id) DO NOTHING`), in the batch's own
transaction, so a rollup always equals its rows' sums: a rolled-back batch changes neither.
Retention subtracts what it deletes, in the same transaction: the rollup follows the rows.

Extending. A new measure or dimension is one more entry in `USAGE` (or `WINDOWS`), a column
in `Totals` for a report to show it, and a migration with `rollups=True` (which rebuilds every
rollup from the rows after the migration's own statements: an upgraded database is exact).
Every statement here is generated from these lists.

Statements are built for one dialect each. SQL common to both is used wherever it exists; the
hour is `date_trunc('hour', t, 'UTC')` in PostgreSQL (a timestamptz, like the rows') and the
epoch second the hour starts at in SQLite (an integer: `CAST` truncates a positive REAL, and an
integer hour compares exactly with the REAL `started_at`). A local day's start is the first
instant of the local date in both (`midnight`: what the reports' day boundaries are).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date, datetime
from zoneinfo import ZoneInfo

from proxy.errors import ErrorClass
from proxy.protocol.translators import MessagesTranslator
from proxy.record import CacheResult

HOUR_S = 3600
DAY_S = 86400


@dataclass(frozen=True, slots=True)
class Dim:
    """A column a rollup groups by: `expr` over a ledger row (SQL of both dialects)."""

    name: str
    expr: str
    nullable: bool


@dataclass(frozen=True, slots=True)
class RollupSum:
    """A sum a rollup keeps: `expr` is the row's part of it (SQL of both dialects)."""

    name: str
    expr: str


@dataclass(frozen=True, slots=True)
class Rollup:
    table: str
    # Time columns of the ledger row, each kept as the start of its UTC hour (or day: `grain`)
    # under the same name.
    times: tuple[str, ...]
    dims: tuple[Dim, ...]
    measures: tuple[RollupSum, ...]
    grain: int = HOUR_S
    # Kept per zone of `ZONES` (a `zone` column first in the key), each time as the start of
    # its local day in that zone (the grain is then DAY_S).
    zoned: bool = False

    @property
    def key(self) -> tuple[str, ...]:
        return (*(("zone",) if self.zoned else ()), *self.times, *(d.name for d in self.dims))


_REFUSED = ErrorClass.BUDGET_EXCEEDED.value

# `tokenmeter usage`: in `proxy.ledger.report_plan.Totals`' order (a report reads them as its
# aggregates, from the rows or from the rollup alike).
USAGE = Rollup(
    table="tokenmeter_rollup_hour",
    times=("started_at",),
    dims=(
        Dim("user_name", "user_name", nullable=False),
        Dim("key_name", "key_name", nullable=True),
        Dim("team", "team", nullable=True),
        # The model sent upstream; the one asked for when none was.
        Dim("model", "COALESCE(model, requested_model)", nullable=False),
        Dim("upstream", "upstream", nullable=True),
        # The rows' tags as they are (a JSON object's text, keys sorted: one text per set of
        # tags), so `--by tag:KEY` reads a key from the rollup as from the rows. A tag with
        # free values (`proxy.config.tags`) makes as many rollup rows as values per hour.
        Dim("tags", "tags", nullable=False),
    ),
    measures=(
        RollupSum("requests", "1"),
        # The error classes are a closed set of identifiers (proxy.errors), safe inline.
        RollupSum("refused", f"CASE WHEN error_class = '{_REFUSED}' THEN 1 ELSE 0 END"),
        RollupSum("failed", f"CASE WHEN error_class NOT IN ('{ErrorClass.NONE.value}', "
                          f"'{_REFUSED}') THEN 1 ELSE 0 END"),
        RollupSum("input_tokens", "input_tokens"),
        RollupSum("cached_input_tokens", "cached_input_tokens"),
        RollupSum("output_tokens", "output_tokens"),
        RollupSum("reasoning_tokens", "reasoning_tokens"),
        RollupSum("cost_nanousd", "COALESCE(cost_nanousd, 0)"),
        RollupSum("unpriced", "CASE WHEN cost_nanousd IS NULL THEN 1 ELSE 0 END"),
        # An operation name of ours (a closed set), safe inline: the Messages API's cached
        # input is Anthropic's cache reads (tokenmeter_tokens_total's cache_read_input).
        RollupSum("cache_read_input_tokens",
                f"CASE WHEN operation = '{MessagesTranslator.operation}' "
                "THEN cached_input_tokens ELSE 0 END"),
        RollupSum("cache_creation_input_tokens", "cache_creation_input_tokens"),
        # The response cache: hits (a value of ours, a closed set, safe inline) and what they
        # saved; a NULL saved cost (no price) adds nothing.
        RollupSum("hits", f"CASE WHEN cache = '{CacheResult.HIT.value}' THEN 1 ELSE 0 END"),
        RollupSum("saved_input_tokens", "saved_input_tokens"),
        RollupSum("saved_output_tokens", "saved_output_tokens"),
        RollupSum("saved_cost_nanousd", "COALESCE(saved_cost_nanousd, 0)"),
    ),
)

# The same per UTC day: 24 times fewer rows for a report over months or years that groups by
# no time or by UTC days (the hours, then the rows, serve the edges and other zones).
USAGE_DAILY = Rollup(table="tokenmeter_rollup_day", times=USAGE.times, dims=USAGE.dims,
                     measures=USAGE.measures, grain=DAY_S)

# `reconcile`: the budget windows each row charged, by the hour it ended and the hour it
# started (a window takes the rows that started before its end and ended after its start).
WINDOWS = Rollup(
    table="tokenmeter_rollup_windows",
    times=("ended_at", "started_at"),
    dims=(
        Dim("user_name", "user_name", nullable=False),
        Dim("team", "team", nullable=True),
        Dim("windows", "windows", nullable=False),
    ),
    # What the windows were charged: a response-cache hit charged in full (`cache.charge_hits:
    # full`; one charged nothing names no window) used no tokens of its own and was charged
    # what it saved (its `saved_*` columns); every other row saved nothing (0, NULL).
    measures=(
        RollupSum("requests", "1"),
        RollupSum("input_tokens", "input_tokens + saved_input_tokens"),
        RollupSum("output_tokens", "output_tokens + saved_output_tokens"),
        RollupSum("cost_nanousd", "COALESCE(cost_nanousd, 0) + COALESCE(saved_cost_nanousd, 0)"),
    ),
)

# The same per LOCAL day of each zone listed in `ZONES` (the configured `timezone`, added by
# the shipper: `proxy.ledger.migrate.add_zone`): a report by that zone's days, weeks or months
# reads one row per group and day, with no hour corrections (`proxy.ledger.report_plan`).
USAGE_LOCAL = Rollup(table="tokenmeter_rollup_localday", times=USAGE.times, dims=USAGE.dims,
                     measures=USAGE.measures, grain=DAY_S, zoned=True)
# The zones USAGE_LOCAL holds, each exactly (every row of the ledger summed in it): one column,
# `zone`, an IANA name. Every statement keeping USAGE_LOCAL joins the changed rows with this
# table, so its text names no zone and a zone added takes effect at the next batch.
ZONES = "tokenmeter_rollup_zones"

ROLLUPS = (USAGE, USAGE_DAILY, WINDOWS, USAGE_LOCAL)


def needs_zone(zone: str) -> bool:
    """Whether `zone`'s reports want local-day sums of their own (UTC's days are the UTC day
    rollup's)."""
    return zone not in ("UTC", "Etc/UTC")

# SQLite's local day: `tm_local_day(started_at, zone)`, the epoch second its local day starts
# at (registered on every connection that writes: `register`).
LOCAL_DAY_FN = "tm_local_day"
SLICE_S = 900  # every offset in use is a multiple of 15 minutes (see `local_day`)


def truncated(column: str, grain: int, *, postgresql: bool, zoned: bool = False) -> str:
    """The start of the UTC hour or day `column` is in; `zoned`: of its local day in the zone
    `z.zone` (the zones table joined as `z`)."""
    if zoned and postgresql:
        # Local midnight as Python's zoneinfo has it (the reports' day boundaries: the first
        # instant of the local date). Not `date_trunc('day', t, zone)`: where midnight happens
        # twice (Havana's clocks go back from 01:00 to 00:00) PostgreSQL takes the later one,
        # after rows of that date. The microsecond before midnight exists once wherever a
        # midnight does not (Santiago's clocks skip 00:00): it agrees in both cases.
        local = f"date_trunc('day', {column} AT TIME ZONE z.zone)"
        return (f"(({local} - interval '1 microsecond') AT TIME ZONE z.zone "
                "+ interval '1 microsecond')")
    if zoned:
        return f"{LOCAL_DAY_FN}({column}, z.zone)"
    if postgresql:
        return f"date_trunc('{'day' if grain == DAY_S else 'hour'}', {column}, 'UTC')"
    return f"(CAST({column} AS INTEGER) / {grain}) * {grain}"


def midnight(day: date, tz: ZoneInfo) -> float:
    """The instant `day` starts in `tz`: its first midnight (fold 0); where the clocks skip
    midnight, the instant they jump from."""
    return datetime(day.year, day.month, day.day, tzinfo=tz).timestamp()


def local_day() -> Callable[[float, str], int]:
    """SQLite's `tm_local_day(started_at, zone)`: the start of the local day of `started_at`
    in `zone`, as `midnight` has it. Deterministic, and cached per zone and 15-minute UTC
    slice where no local midnight falls inside the slice (true of every offset in use today;
    a slice a midnight does cut, such as one of Monrovia's -0:44:30 of old, is worked out
    row by row): a batch's rows cost a dict look-up each."""
    zones: dict[str, ZoneInfo] = {}
    slices: dict[tuple[str, int], int | None] = {}

    def start(moment: float, tz: ZoneInfo) -> int:
        return int(midnight(datetime.fromtimestamp(moment, tz).date(), tz))

    def fn(moment: float, zone: str) -> int:
        index = int(moment // SLICE_S)
        found = slices.get((zone, index), -1)
        tz = zones.get(zone) or zones.setdefault(zone, ZoneInfo(zone))
        if found == -1:
            if len(slices) > 1_000_000:  # years of slices: a long-lived shipper's bound
                slices.clear()
            lo = index * SLICE_S
            # Offsets are whole seconds: a midnight inside the slice shows at its last second.
            first = start(lo, tz)
            found = first if first == start(lo + SLICE_S - 1, tz) else None
            slices[(zone, index)] = found
        return found if found is not None else start(moment, tz)

    return fn


def register(conn: sqlite3.Connection) -> None:
    """`tm_local_day` on an SQLite connection that keeps or builds USAGE_LOCAL."""
    conn.create_function(LOCAL_DAY_FN, 2, local_day(), deterministic=True)


def _conflict_target(r: Rollup, postgresql: bool) -> str:
    if postgresql:  # the unique constraint takes NULLs as equal (NULLS NOT DISTINCT)
        return ", ".join(r.key)
    # SQLite's unique indexes take NULLs as distinct: a NULL is indexed as an empty blob,
    # which no text value equals (the ledger's text columns hold text only).
    return ", ".join([*r.key[:len(r.key) - len(r.dims)],
                      *(f"ifnull({d.name}, x'')" if d.nullable else d.name for d in r.dims)])


def create(r: Rollup, *, postgresql: bool) -> tuple[str, ...]:
    ts = "timestamptz" if postgresql else "INTEGER"
    text = "text" if postgresql else "TEXT"
    num = "bigint" if postgresql else "INTEGER"
    cols = [*([f"zone {text} NOT NULL"] if r.zoned else []),
            *(f"{t} {ts} NOT NULL" for t in r.times),
            *(f"{d.name} {text}{'' if d.nullable else ' NOT NULL'}" for d in r.dims),
            *(f"{m.name} {num} NOT NULL" for m in r.measures)]
    if postgresql:
        cols.append(f"UNIQUE NULLS NOT DISTINCT ({', '.join(r.key)})")
    out = [f"CREATE TABLE {r.table} ({', '.join(cols)})"]
    if not postgresql:
        out.append(f"CREATE UNIQUE INDEX {r.table}_key ON {r.table} "
                   f"({_conflict_target(r, postgresql)})")
    return tuple(out)


def aggregate(r: Rollup, source: str, where: str, *, postgresql: bool, sign: int = 1) -> str:
    """The rows of `source` matching `where`, summed as `r` keeps them (times sign: -1 takes
    them back out). Ordered by the key, so concurrent writers lock rollup rows in one order
    (two replicas' batches never deadlock on them). A zoned rollup sums them in every zone
    listed (`ZONES`, joined as `z`; `where` may name `z.zone`)."""
    neg = "-" if sign < 0 else ""
    cols = [*(["z.zone"] if r.zoned else []),
            *(truncated(t, r.grain, postgresql=postgresql, zoned=r.zoned) for t in r.times),
            *(d.expr for d in r.dims),
            *(f"{neg}sum({m.expr})" for m in r.measures)]
    n = ", ".join(str(i + 1) for i in range(len(r.key)))
    # (SQLite keeps a CROSS JOIN's order: the changed rows outside, the few zones inside.)
    joined = f"{source} CROSS JOIN {ZONES} z" if r.zoned else source
    return f"SELECT {', '.join(cols)} FROM {joined} WHERE {where} GROUP BY {n} ORDER BY {n}"


def upsert(r: Rollup, select: str, *, postgresql: bool) -> str:
    """Add `select`'s sums (rows of `aggregate`) into the rollup."""
    cols = ", ".join([*r.key, *(m.name for m in r.measures)])
    sets = ", ".join(f"{m.name} = {r.table}.{m.name} + excluded.{m.name}" for m in r.measures)
    return (f"INSERT INTO {r.table} ({cols}) {select} "
            f"ON CONFLICT ({_conflict_target(r, postgresql)}) DO UPDATE SET {sets}")


def create_zones(*, postgresql: bool) -> str:
    # (SQLite: WITHOUT ROWID, so `rowid` in a statement joining it is the ledger's alone.)
    return (f"CREATE TABLE IF NOT EXISTS {ZONES} (zone text PRIMARY KEY)" if postgresql else
            f"CREATE TABLE IF NOT EXISTS {ZONES} (zone TEXT PRIMARY KEY) WITHOUT ROWID")


def rebuild(table: str, *, postgresql: bool) -> tuple[str, ...]:
    """Every rollup made again from the rows of `table` (a migration's backfill; the zoned one
    in the zones already listed)."""
    out: list[str] = []
    for r in ROLLUPS:
        out.append(f"DROP TABLE IF EXISTS {r.table}")
        out.extend(create(r, postgresql=postgresql))
        out.append(upsert(r, aggregate(r, table, "true", postgresql=postgresql),
                          postgresql=postgresql))
    return tuple(out)


def drop_empty(r: Rollup) -> str:
    """Rollup rows retention emptied (every measure back to 0)."""
    return f"DELETE FROM {r.table} WHERE requests = 0"
