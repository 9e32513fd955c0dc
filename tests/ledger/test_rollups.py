"""The rollups (proxy.ledger.rollup) against the rows they sum, on an SQLite file and on the
machine's PostgreSQL: after random loads shipped through the proxy's own sinks (duplicates in a
batch, whole batches replayed, batches rolled back by a row the database refuses, retention
slices, a database migrated from the schema before rollups with rows in it), every rollup
equals the sums of the stored rows, and `usage` over random periods (starting and ending
mid-day, in zones whose midnights are and are not whole UTC hours) equals the sums a plain
Python loop makes of the rows that should be stored: response-cache hits' saved columns and
tags (`--by tag:KEY`) included."""

from __future__ import annotations

import asyncio
import itertools
import json
import sqlite3
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import asyncpg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.config.ledger import LedgerConfig
from proxy.ledger import migrate, rollup, sink_postgres
from proxy.ledger.migrate import add_zone_postgres, add_zone_sqlite
from proxy.ledger.query import locate, open_reader
from proxy.ledger.report_plan import (
    Group,
    GroupKey,
    ReportPeriod,
    TagGroup,
    Totals,
    _plan,
    build_report,
    labels,
    parse_bound,
)
from proxy.ledger.row import COLUMNS, LedgerRow
from proxy.ledger.schema import MIGRATIONS, SCHEMA_TABLE, TABLE
from proxy.ledger.shipper_process import ShipperSpec, make_sink
from proxy.ledger.sink_postgres import PostgresSink
from proxy.ledger.sink_sqlite import SqliteSink
from tests.books import ledger_row, pg_admin

T0 = datetime(2026, 3, 27, tzinfo=UTC).timestamp()  # Berlin's clocks change on the 29th
SPAN_S = 4 * 86400
ZONES = ("UTC", "Europe/Berlin", "Asia/Kathmandu", "America/New_York", "Asia/Kolkata")
# The zones the local-day rollup holds in these tests (Kolkata's reports read UTC days).
LOCAL_ZONES = ("Europe/Berlin", "America/New_York", "Asia/Kathmandu")
GROUPINGS: tuple[tuple[Group, ...], ...] = (
    (GroupKey.USER,), (GroupKey.MODEL, GroupKey.DAY),
    (GroupKey.TEAM, GroupKey.KEY, GroupKey.UPSTREAM), (GroupKey.WEEK,), (),
    (TagGroup("feature"),), (GroupKey.USER, TagGroup("env"), GroupKey.DAY, TagGroup("feature")))
# The tags column as the proxy writes it (keys sorted; '{}' for none).
_TAGS = ("{}", '{"feature":"faq"}', '{"env":"prod","feature":"chat"}', '{"env":"dev"}')


@pytest.fixture(scope="module")
def module_pg() -> Iterator[str]:
    name = f"tm_rollups_{uuid.uuid4().hex[:12]}"
    asyncio.run(pg_admin(f'CREATE DATABASE "{name}"'))
    yield f"postgresql://postgres@127.0.0.1:5432/{name}"
    asyncio.run(pg_admin(f'DROP DATABASE "{name}" WITH (FORCE)'))


# --- the load -------------------------------------------------------------------------------

_names = st.sampled_from(["alice", "bob", "carol"])
_opt = st.one_of(st.none(), st.sampled_from(["a", "b"]))
_moment = st.one_of(
    st.floats(0, SPAN_S, allow_nan=False),
    st.integers(0, SPAN_S // 1800).map(lambda k: k * 1800.0),  # exactly on hours, half hours
    # Around local midnights: Berlin's (22:00, 23:00 UTC) and Kathmandu's (18:15 UTC).
    st.builds(lambda d, h, s: d * 86400.0 + h * 3600 + s, st.integers(0, 3),
              st.sampled_from([17, 18, 21, 22, 23]), st.floats(0, 3600, allow_nan=False)),
)


@st.composite
def _rows(draw: st.DrawFn) -> LedgerRow:
    n = draw(st.integers(0, 10**9))
    cache = draw(st.sampled_from(["none", "hit", "miss", "bypass"]))
    # A hit spent nothing upstream and saved what the stored answer used; other rows saved
    # nothing (the schema's defaults).
    saved: dict[str, Any] = {} if cache != "hit" else {
        "input_tokens": 0, "output_tokens": 0, "cached_input_tokens": 0,
        "reasoning_tokens": 0, "cost_nanousd": 0,
        "saved_input_tokens": draw(st.integers(0, 10**6)),
        "saved_output_tokens": draw(st.integers(0, 10**6)),
        "saved_cost_nanousd": draw(st.one_of(st.none(), st.integers(0, 10**12)))}
    row = ledger_row(
        f"r{n}", T0 + draw(_moment), user_name=draw(_names), key_name=draw(_opt),
        team=draw(_opt), model=draw(st.one_of(st.none(), st.just("m1"))),
        requested_model=draw(st.sampled_from(["m1", "m2"])), upstream=draw(_opt),
        error_class=draw(st.sampled_from(["none", "budget_exceeded", "upstream_5xx"])),
        operation=draw(st.sampled_from(["chat", "messages"])),
        input_tokens=draw(st.integers(0, 10**6)), output_tokens=draw(st.integers(0, 10**6)),
        cached_input_tokens=draw(st.integers(0, 1000)),
        reasoning_tokens=draw(st.integers(0, 1000)),
        cost_nanousd=draw(st.one_of(st.none(), st.integers(0, 10**12))),
        cache_creation_input_tokens=draw(st.integers(0, 1000)),
        windows=draw(st.sampled_from(["", "u:daily_tokens:20260327"])),
        cache=cache, tags=draw(st.sampled_from(_TAGS)),
    )
    return row._replace(**saved)


@st.composite
def _loads(draw: st.DrawFn) -> dict[str, Any]:
    rows = draw(st.lists(_rows(), min_size=5, max_size=40, unique_by=lambda r: r.request_id))
    # A batch: rows by index (a row twice in a batch, again in later batches); some batches
    # carry a row the database refuses, and roll back whole; some are followed by retention.
    batches = draw(st.lists(st.tuples(
        st.lists(st.integers(0, len(rows) - 1), min_size=1, max_size=15),
        st.booleans(), st.one_of(st.none(), st.floats(0, SPAN_S))), max_size=6))
    return {"rows": rows, "batches": batches, "before": draw(st.integers(0, len(rows))),
            "periods": draw(st.lists(st.tuples(st.one_of(st.none(), _moment),
                                               st.one_of(st.none(), _moment)),
                                     min_size=1, max_size=2))}


# --- the databases ----------------------------------------------------------------------------

async def _old_database(url: str, rows: Sequence[LedgerRow]) -> None:
    """A ledger at schema v2 (before rollups) holding `rows`, as an older proxy left it."""
    older = [m for m in MIGRATIONS if not m.rollups and m.version < min(
        m.version for m in MIGRATIONS if m.rollups)]
    # The columns of that schema: those of later versions (v7's upstream id) come after.
    columns = COLUMNS[:COLUMNS.index("upstream_request_id")]
    if url.startswith("sqlite"):
        with sqlite3.connect(url.removeprefix("sqlite://")) as db:
            db.execute(f"CREATE TABLE {SCHEMA_TABLE} (version INTEGER PRIMARY KEY, "
                       "applied_at REAL NOT NULL)")
            for m in older:
                for statement in m.sqlite:
                    db.execute(statement)
                db.execute(f"INSERT INTO {SCHEMA_TABLE} VALUES (?, 0)", (m.version,))
            db.executemany(f"INSERT INTO {TABLE} ({', '.join(columns)}) VALUES "
                           f"({', '.join('?' * len(columns))})",
                           [tuple(r)[:len(columns)] for r in rows])
        return
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(f"CREATE TABLE {SCHEMA_TABLE} (version integer PRIMARY KEY, "
                           "applied_at timestamptz NOT NULL DEFAULT now())")
        for m in older:
            for statement in m.postgresql:
                await conn.execute(statement)
            await conn.execute(f"INSERT INTO {SCHEMA_TABLE} (version) VALUES ($1)", m.version)
        await conn.copy_records_to_table(
            TABLE, records=[PostgresSink.prepare(list(r))[:len(columns)] for r in rows],
            columns=list(columns))
    finally:
        await conn.close()


async def _fresh_pg(url: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        for table in (TABLE, SCHEMA_TABLE, rollup.ZONES, *(r.table for r in rollup.ROLLUPS)):
            await conn.execute(f"DROP TABLE IF EXISTS {table}")
    finally:
        await conn.close()


async def _add_zones(url: str, zones: Sequence[str]) -> list[bool]:
    """`zones` in the local-day rollup of the ledger at `url` (as a shipper adds its own)."""
    if url.startswith("sqlite"):
        db = sqlite3.connect(url.removeprefix("sqlite://"), isolation_level=None)
        try:
            rollup.register(db)
            return [add_zone_sqlite(db, z) for z in zones]
        finally:
            db.close()
    conn = await asyncpg.connect(url)
    try:
        return [await add_zone_postgres(conn, z) for z in zones]
    finally:
        await conn.close()


async def _fetch(url: str, text: str) -> list[tuple[Any, ...]]:
    if url.startswith("sqlite"):
        with sqlite3.connect(url.removeprefix("sqlite://")) as db:
            rollup.register(db)
            return [tuple(r) for r in db.execute(text).fetchall()]
    conn = await asyncpg.connect(url)
    try:
        return [tuple(r) for r in await conn.fetch(text)]
    finally:
        await conn.close()


def _plain(values: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(v.timestamp() if isinstance(v, datetime) else
                 int(v) if isinstance(v, (Decimal, int)) and not isinstance(v, bool) else v
                 for v in values)


async def _rollups_match_rows(url: str) -> None:
    """Every rollup is the sums of the stored rows (no more rollup rows, none missing); the
    local-day rollup's in each zone its table lists."""
    pg = not url.startswith("sqlite")
    for r in rollup.ROLLUPS:
        cols = ", ".join([*r.key, *(m.name for m in r.measures)])
        kept = sorted(map(_plain, await _fetch(url, f"SELECT {cols} FROM {r.table}")), key=repr)
        summed = sorted(map(_plain, await _fetch(url, rollup.aggregate(
            r, TABLE, "true", postgresql=pg))), key=repr)
        assert kept == summed, r.table


# --- the oracle -------------------------------------------------------------------------------

def _totals(row: LedgerRow) -> Totals:
    return Totals(
        requests=1, refused=int(row.error_class == "budget_exceeded"),
        failed=int(row.error_class not in ("none", "budget_exceeded")),
        input_tokens=row.input_tokens, cached_input_tokens=row.cached_input_tokens,
        output_tokens=row.output_tokens, reasoning_tokens=row.reasoning_tokens,
        cost_nanousd=row.cost_nanousd or 0, unpriced=int(row.cost_nanousd is None),
        cache_read_input_tokens=row.cached_input_tokens if row.operation == "messages" else 0,
        cache_creation_input_tokens=row.cache_creation_input_tokens,
        hits=int(row.cache == "hit"), saved_input_tokens=row.saved_input_tokens,
        saved_output_tokens=row.saved_output_tokens,
        saved_cost_nanousd=row.saved_cost_nanousd or 0)


def _expected(rows: Sequence[LedgerRow], by: Sequence[Group], period: ReportPeriod
              ) -> dict[tuple[str | None, ...], Totals]:
    out: dict[tuple[str | None, ...], Totals] = {}
    start = None if period.start is None else period.start.timestamp()
    end = None if period.end is None else period.end.timestamp()
    for row in rows:
        if (start is not None and row.started_at < start) or (
                end is not None and row.started_at >= end):
            continue
        values = {GroupKey.USER: row.user_name, GroupKey.TEAM: row.team,
                  GroupKey.KEY: row.key_name, GroupKey.MODEL: row.model or row.requested_model,
                  GroupKey.UPSTREAM: row.upstream}
        tags: dict[str, str] = json.loads(row.tags)
        key = tuple(tags.get(k.key) if isinstance(k, TagGroup) else
                    labels(row.started_at, period.tz, [k])[0] if k.is_time else values[k]
                    for k in by)
        out[key] = out.get(key, Totals()) + _totals(row)
    return out


# --- the property -----------------------------------------------------------------------------

async def _ship(url: str, load: dict[str, Any]) -> list[LedgerRow]:
    """`load` through the sink (configured in Berlin; New York and Kathmandu added to the
    local-day rollup too); the rows that should be stored, in the order they landed."""
    rows: list[LedgerRow] = load["rows"]
    zones: Sequence[str] = load.get("zones", LOCAL_ZONES)
    stored: dict[str, LedgerRow] = {}
    before = rows[:load["before"]]
    await _old_database(url, before)
    stored.update((r.request_id, r) for r in before)
    zone = zones[0] if zones else "UTC"
    sink: SqliteSink | PostgresSink = (SqliteSink(Path(url.removeprefix("sqlite://")), zone)
                                       if url.startswith("sqlite") else PostgresSink(url, zone))
    # Migrates (the rollups built from the rows already there), then sums them in Berlin.
    await sink.open()
    try:
        assert await _add_zones(url, zones) == [False, *[True] * (len(zones) - 1)][:len(zones)]
        await _rollups_match_rows(url)
        for picks, refused, cutoff in load["batches"]:
            batch = [rows[i] for i in picks]
            records = [sink.prepare(list(r)) for r in batch]
            if refused:  # user_name NULL: the database refuses the row, the batch rolls back
                records.insert(len(records) // 2, sink.prepare(list(
                    batch[0]._replace(request_id="refused", user_name=None))))
                with pytest.raises(Exception) as caught:
                    await sink.write(records)
                assert sink.is_poison(caught.value)
            else:
                inserted = await sink.write(records)
                new = {r.request_id: r for r in batch if r.request_id not in stored}
                assert inserted == len(new)
                stored.update(new)
            if cutoff is not None:
                await sink.prune(T0 + cutoff, 10_000)
                stored = {k: r for k, r in stored.items() if r.started_at >= T0 + cutoff}
            await _rollups_match_rows(url)
    finally:
        await sink.close()
        sink.shutdown()
    return list(stored.values())


async def _check(url: str, load: dict[str, Any]) -> None:
    stored = await _ship(url, load)
    async with await open_reader(locate(LedgerConfig(), url)) as reader:
        for (a, b), zone, by in itertools.product(load["periods"], ZONES, GROUPINGS):
            tz = ZoneInfo(zone)
            lo, hi = (a, b) if a is None or b is None or a <= b else (b, a)
            period = ReportPeriod(tz, None if lo is None else datetime.fromtimestamp(T0 + lo, tz),
                            None if hi is None else datetime.fromtimestamp(T0 + hi, tz))
            got = await build_report(reader, by, period)
            want = _expected(stored, by, period)
            assert dict(got.rows) == {k: t for k, t in want.items() if t.requests}, (zone, lo,
                                                                                    hi, by)


_SETTINGS = settings(max_examples=30, deadline=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture,
                                            HealthCheck.too_slow])


@_SETTINGS
@given(load=_loads())
def test_rollups_equal_the_rows_sqlite(load: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(_check(f"sqlite://{tmp}/books.sqlite3", load))


@_SETTINGS
@given(load=_loads())
def test_rollups_equal_the_rows_postgresql(module_pg: str, load: dict[str, Any]) -> None:
    async def go() -> None:
        await _fresh_pg(module_pg)
        await _check(module_pg, load)

    asyncio.run(go())


def _ledger_url(dialect: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    """A ledger of `dialect` for one test (PostgreSQL's: the module's database, emptied by
    `_books_of`). Resolved outside the test's event loop: the fixture runs one of its own."""
    return (f"sqlite://{tmp_path}/books.sqlite3" if dialect == "sqlite"
            else request.getfixturevalue("module_pg"))


async def _books_of(url: str, rows: list[LedgerRow], zones: Sequence[str] = LOCAL_ZONES
                    ) -> list[LedgerRow]:
    """The ledger at `url`, fresh, holding `rows` shipped in one batch, its local-day rollup
    holding `zones`: the rows stored."""
    if not url.startswith("sqlite"):
        await _fresh_pg(url)
    return await _ship(url, {"rows": rows, "before": 0, "periods": [], "zones": zones,
                             "batches": [(list(range(len(rows))), False, None)]})


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_a_period_starting_and_ending_mid_day_is_exact(dialect: str, tmp_path: Path,
                                                       request: pytest.FixtureRequest) -> None:
    """From 10:17 on one day to 15:42 two days later: the rows of the partial hours and of the
    partial days at both ends counted, the row just outside each end not."""
    def at(day: int, hour: int, minute: int, second: float = 0.0) -> float:
        return T0 + day * 86400 + hour * 3600 + minute * 60 + second

    moments = [at(0, 10, 16, 59.999), at(0, 10, 17), at(0, 10, 59), at(0, 11, 0), at(0, 23, 59),
               at(1, 12, 0), at(2, 15, 0), at(2, 15, 41, 59.9), at(2, 15, 42), at(2, 16, 0)]
    rows = [ledger_row(f"m{i}", t, input_tokens=10**i, cost_nanousd=i) for i, t in
            enumerate(moments)]
    url = _ledger_url(dialect, tmp_path, request)

    async def go() -> None:
        await _books_of(url, rows)
        tz = ZoneInfo("UTC")
        period = ReportPeriod(tz, datetime.fromtimestamp(at(0, 10, 17), tz),
                        datetime.fromtimestamp(at(2, 15, 42), tz))
        async with await open_reader(locate(LedgerConfig(), url)) as reader:
            report = await build_report(reader, (GroupKey.DAY,), period)
        assert [(k, t.input_tokens, t.cost_nanousd) for k, t in report.rows] == [
            (("2026-03-27",), 10 + 100 + 1000 + 10_000, 1 + 2 + 3 + 4),
            (("2026-03-28",), 10**5, 5),
            (("2026-03-29",), 10**6 + 10**7, 6 + 7),
        ]

    asyncio.run(go())


@pytest.mark.parametrize("local", [False, True], ids=["utc-days", "local-days"])
@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_local_days_over_a_dst_change_read_the_day_rollup_exactly(
        dialect: str, local: bool, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """Whole local days in Berlin over its spring change (+1 to +2 on the 29th), in New York
    (west of UTC) and in Kathmandu (+5:45): a row every 20 minutes, and one on each side of
    every local midnight. The report equals the rows' sums. Without the local-day rollup
    holding the zones, Berlin's and New York's days read the UTC day rollup corrected by one
    or two hours a day (not 24), Kathmandu's the rows of the hour its midnight cuts; with it,
    every zone's days are one read of the local-day rollup alone."""
    moments = [T0 + k * 1200.0 for k in range(SPAN_S // 1200)]
    for day in range(5):
        for zone in ("Europe/Berlin", "America/New_York", "Asia/Kathmandu"):
            tz = ZoneInfo(zone)
            midnight = datetime.fromtimestamp(T0 + day * 86400, tz).replace(
                hour=0, minute=0, second=0).timestamp()
            moments += [midnight - 0.001, midnight]
    rows = [ledger_row(f"d{i}", t, user_name=("alice", "bob")[i % 2], input_tokens=i + 1,
                       cost_nanousd=7 * i) for i, t in enumerate(moments) if T0 <= t < T0 + SPAN_S]
    url = _ledger_url(dialect, tmp_path, request)

    async def go() -> None:
        stored = await _books_of(url, rows, LOCAL_ZONES if local else ())
        async with await open_reader(locate(LedgerConfig(), url)) as reader:
            for zone, first, last in (("Europe/Berlin", "2026-03-28", "2026-03-30"),
                                      ("America/New_York", "2026-03-27", "2026-03-29"),
                                      ("Asia/Kathmandu", "2026-03-28", "2026-03-29"),
                                      ("UTC", "2026-03-27", "2026-03-30")):
                tz = ZoneInfo(zone)
                period = ReportPeriod(tz, parse_bound(first, tz, end=False),
                                parse_bound(last, tz, end=True))
                for by in ((GroupKey.DAY,), (GroupKey.USER, GroupKey.DAY), (GroupKey.WEEK,),
                           (GroupKey.USER,)):
                    got = await build_report(reader, by, period)
                    want = _expected(stored, by, period)
                    assert dict(got.rows) == want, (zone, by)
                    assert got.totals == sum(want.values(), Totals()), (zone, by)
                plan = await _plan(reader, period, (GroupKey.DAY,))
                if local and zone != "UTC":  # whole local days, each once, nothing else
                    (read,) = plan.reads
                    assert read.rollup is rollup.USAGE_LOCAL and read.zone == zone
                    assert len(read.at) == (date.fromisoformat(last)
                                            - date.fromisoformat(first)).days + 1
                    assert not plan.cut and not plan.raw
                    continue
                days = [e for r in plan.reads if r.rollup is rollup.USAGE_DAILY for e in r.at]
                hours = [e for r in plan.reads if r.rollup is rollup.USAGE for e in r.at]
                assert days, zone
                if zone == "Asia/Kathmandu":  # 18:15 UTC: that hour from the rows
                    assert plan.cut and len(plan.cut) <= len(days) + 1
                else:  # one or two hours a day moved (each once out, once in), and the edges
                    assert not plan.cut
                    assert len(hours) <= 4 * len(days) + 2 * 24, (zone, hours)

    asyncio.run(go())


# --- the local-day rollup -----------------------------------------------------------------------

def _around_midnights(zones: Sequence[str], days: int) -> list[float]:
    """A moment every 20 minutes over `days` days from T0, and one each side of every local
    midnight of `zones`."""
    moments = [T0 + k * 1200.0 for k in range(days * 86400 // 1200)]
    for day in range(days + 1):
        for zone in zones:
            tz = ZoneInfo(zone)
            start = rollup.midnight((datetime.fromtimestamp(T0, tz) + timedelta(days=day)).date(),
                                    tz)
            moments += [start - 0.001, start]
    return [t for t in moments if T0 <= t < T0 + days * 86400]


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_a_report_in_the_configured_zone_reads_the_local_day_rollup(
        dialect: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """Berlin over its DST change and Kathmandu (+5:45): whole local days and periods starting
    and ending mid-day equal the rows' sums, to the token and the nano-dollar; and the report
    read the local-day rollup: a change made to one of its rows shows in the report (and in
    no report of a zone it does not hold)."""
    rows = [ledger_row(f"z{i}", t, user_name=("alice", "bob")[i % 3 % 2], input_tokens=i + 1,
                       cost_nanousd=7 * i + 1, output_tokens=i % 13)
            for i, t in enumerate(_around_midnights(LOCAL_ZONES, 4))]
    url = _ledger_url(dialect, tmp_path, request)
    pg = dialect == "postgresql"

    async def go() -> None:
        stored = await _books_of(url, rows)
        async with await open_reader(locate(LedgerConfig(), url)) as reader:
            for zone, first, last in (("Europe/Berlin", "2026-03-28", "2026-03-30"),
                                      ("Europe/Berlin", "2026-03-27T10:17", "2026-03-30T15:42"),
                                      ("Asia/Kathmandu", "2026-03-28", "2026-03-29"),
                                      ("Asia/Kathmandu", "2026-03-27T18:40",
                                       "2026-03-30T18:05:30"),
                                      ("America/New_York", "2026-03-27T03:59:59.999",
                                       "2026-03-29T23:00")):
                tz = ZoneInfo(zone)
                period = ReportPeriod(tz, parse_bound(first, tz, end=False),
                                parse_bound(last, tz, end=True))
                for by in ((GroupKey.DAY,), (GroupKey.USER, GroupKey.DAY), (GroupKey.WEEK,),
                           (GroupKey.USER,), ()):
                    got = await build_report(reader, by, period)
                    want = _expected(stored, by, period)
                    assert dict(got.rows) == want, (zone, first, by)
                    assert got.totals == sum(want.values(), Totals()), (zone, first, by)
                plan = await _plan(reader, period, (GroupKey.DAY,))
                assert plan.reads[0].rollup is rollup.USAGE_LOCAL, (zone, first)

        # Proof of the path: Berlin's 29 March, and only in the local-day rollup, grows.
        berlin = ZoneInfo("Europe/Berlin")
        day = rollup.midnight(date(2026, 3, 29), berlin)
        at = f"to_timestamp({day})" if pg else str(int(day))
        await _execute(url, f"UPDATE {rollup.USAGE_LOCAL.table} SET input_tokens = input_tokens "
                            f"+ 1000000 WHERE zone = 'Europe/Berlin' AND started_at = {at} "
                            "AND user_name = 'alice'")
        async with await open_reader(locate(LedgerConfig(), url)) as reader:
            for zone, grown in (("Europe/Berlin", 10**6), ("Asia/Kolkata", 0)):
                tz = ZoneInfo(zone)
                period = ReportPeriod(tz, parse_bound("2026-03-28", tz, end=False),
                                parse_bound("2026-03-30", tz, end=True))
                seen = dict((await build_report(reader, (GroupKey.USER, GroupKey.DAY),
                                                period)).rows)
                want = _expected(stored, (GroupKey.USER, GroupKey.DAY), period)
                assert (seen[("alice", "2026-03-29")].input_tokens
                        == want[("alice", "2026-03-29")].input_tokens + grown), zone
                assert seen[("bob", "2026-03-29")] == want[("bob", "2026-03-29")], zone

    asyncio.run(go())


async def _execute(url: str, text: str) -> None:
    if url.startswith("sqlite"):
        with sqlite3.connect(url.removeprefix("sqlite://")) as db:
            assert db.execute(text).rowcount == 1
        return
    conn = await asyncpg.connect(url)
    try:
        assert await conn.execute(text) == "UPDATE 1"
    finally:
        await conn.close()


async def _zones_of(url: str) -> list[str]:
    return sorted(z for (z,) in await _fetch(url, f"SELECT zone FROM {rollup.ZONES}"))


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_the_shipper_adds_its_zone_once_and_a_new_zone_on_a_change(
        dialect: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """The shipper's sink (`make_sink`, given the zone `serve` hands the shipper process)
    configured in Berlin sums the rows already stored once, at its first start; started again
    it adds nothing (the rollup is not counted twice); configured in New York it adds New
    York's days, Berlin's still kept; the report in New York is exact; a retention slice
    leaves every zone's local-day rollup equal to the rows."""
    url = _ledger_url(dialect, tmp_path, request)
    moments = _around_midnights(LOCAL_ZONES, 4)
    rows = [ledger_row(f"s{i}", t, user_name=("alice", "bob", "carol")[i % 3],
                       input_tokens=i + 1, cost_nanousd=None if i % 11 == 0 else 3 * i)
            for i, t in enumerate(moments)]
    config = LedgerConfig(url=url)

    async def start(zone: str, batch: Sequence[LedgerRow] = (), cutoff: float | None = None
                    ) -> None:
        spec = ShipperSpec(**json.loads(json.dumps(asdict(ShipperSpec.of(
            config, tmp_path, 1.0, zone)))))  # as the process is told (SHIPPER_ENV)
        sink = make_sink(spec.config, Path(spec.state_dir), spec.zone)
        await sink.open()
        try:
            if batch:
                assert await sink.write([sink.prepare(list(r)) for r in batch]) == len(batch)
            if cutoff is not None:
                assert await sink.prune(cutoff, 10_000) > 0
        finally:
            await sink.close()
            sink.shutdown()

    async def go() -> None:
        await _books_of(url, rows[: len(rows) // 2], zones=())  # an older shipper's rows: UTC
        assert await _zones_of(url) == []
        await start("Europe/Berlin")
        assert await _zones_of(url) == ["Europe/Berlin"]
        await _rollups_match_rows(url)
        await start("Europe/Berlin", rows[len(rows) // 2:])  # again: nothing added twice
        await _rollups_match_rows(url)
        await start("America/New_York")
        assert await _zones_of(url) == ["America/New_York", "Europe/Berlin"]
        await _rollups_match_rows(url)
        async with await open_reader(locate(LedgerConfig(), url)) as reader:
            tz = ZoneInfo("America/New_York")
            for first, last in (("2026-03-27", "2026-03-29"),
                                ("2026-03-26T22:10", "2026-03-30T11:30")):
                period = ReportPeriod(tz, parse_bound(first, tz, end=False),
                                parse_bound(last, tz, end=True))
                plan = await _plan(reader, period, (GroupKey.DAY,))
                assert plan.reads[0].rollup is rollup.USAGE_LOCAL
                assert plan.reads[0].zone == "America/New_York"
                for by in ((GroupKey.USER, GroupKey.DAY), (GroupKey.MONTH,), ()):
                    got = await build_report(reader, by, period)
                    assert dict(got.rows) == _expected(rows, by, period), (first, by)
        # Retention: a slice ending mid-day in every zone.
        await start("America/New_York", cutoff=T0 + 86400 + 13 * 3600 + 0.5)
        await _rollups_match_rows(url)
        kept = await _fetch(url, f"SELECT count(*) FROM {rollup.USAGE_LOCAL.table} "
                                 "WHERE requests = 0")
        assert kept == [(0,)]  # emptied rollup rows dropped

    asyncio.run(go())


@pytest.mark.timeout(60)
def test_a_zone_added_while_another_replica_ships_misses_no_row(module_pg: str) -> None:
    """Another replica's batch, its rows inserted (and its rollups kept, in the zones listed
    then: none) but not committed, while a shipper adds Berlin: the backfill waits for that
    batch to commit and sums its rows too (without its SHARE lock it would sum neither); and a
    batch arriving while a backfill holds that lock waits for it, then keeps the new zone."""
    rows = [ledger_row(f"c{i}", T0 + i * 900.0, input_tokens=i + 1) for i in range(200)]

    async def go() -> None:
        await _books_of(module_pg, rows[:100], zones=())
        other, adder, watcher = [await asyncpg.connect(module_pg) for _ in range(3)]
        try:
            tx = other.transaction()
            await tx.start()
            await other.execute(sink_postgres._CREATE_STAGE)
            await other.copy_records_to_table(
                sink_postgres._STAGE, records=[PostgresSink.prepare(list(r)) for r in rows[100:]],
                columns=list(COLUMNS))
            assert await other.fetchval(sink_postgres._MOVE) == 100
            adding = asyncio.create_task(add_zone_postgres(adder, "Europe/Berlin"))
            pid = adder.get_server_pid()
            # The backfill is waiting for the batch's lock (a state the server shows).
            while not await watcher.fetchval(
                    "SELECT count(*) FROM pg_locks WHERE pid = $1 AND NOT granted", pid):
                assert not adding.done()
                await asyncio.sleep(0.01)
            await tx.commit()
            assert await adding
        finally:
            for conn in (other, adder, watcher):
                await conn.close()
        assert await _zones_of(module_pg) == ["Europe/Berlin"]
        await _rollups_match_rows(module_pg)
        (count,) = await _fetch(module_pg, f"SELECT sum(requests) FROM "
                                           f"{rollup.USAGE_LOCAL.table}")
        assert int(count[0]) == 200

        # The other way round: a batch arriving while New York's backfill holds its lock
        # waits, then sees New York listed and keeps it.
        adder, watcher = [await asyncpg.connect(module_pg) for _ in range(2)]
        sink = PostgresSink(module_pg)
        await sink.open()
        try:
            tx = adder.transaction()
            await tx.start()
            await adder.execute(f"LOCK TABLE {TABLE} IN SHARE MODE")
            await adder.execute(f"INSERT INTO {rollup.ZONES} VALUES ('America/New_York')")
            for statement in migrate._backfill(postgresql=True):
                await adder.execute(statement, "America/New_York")
            more = [ledger_row(f"c{i}", T0 + i * 900.0, input_tokens=i + 1)
                    for i in range(200, 260)]
            writing = asyncio.create_task(sink.write([sink.prepare(list(r)) for r in more]))
            while not await watcher.fetchval(
                    "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
                    "WHERE NOT l.granted AND a.application_name = 'tokenmeter-ledger'"):
                assert not writing.done()
                await asyncio.sleep(0.01)
            await tx.commit()
            assert await writing == 60
        finally:
            await sink.close()
            for conn in (adder, watcher):
                await conn.close()
        await _rollups_match_rows(module_pg)
        summed = await _fetch(module_pg, f"SELECT zone, sum(requests) FROM "
                                         f"{rollup.USAGE_LOCAL.table} GROUP BY zone")
        assert sorted((z, int(n)) for z, n in summed) == [("America/New_York", 260),
                                                            ("Europe/Berlin", 260)]

    asyncio.run(go())


_ODD_ZONES = ("Europe/Berlin", "America/New_York", "Asia/Kathmandu", "Asia/Kolkata",
              "Australia/Lord_Howe", "Pacific/Chatham", "America/St_Johns",
              # Midnight twice (Havana's clocks go back from 01:00 to 00:00), midnight skipped
              # (Santiago's jump from 00:00 to 01:00), -0:44:30 until 1972 (Monrovia).
              "America/Havana", "America/Santiago", "Africa/Monrovia")


@pytest.mark.timeout(120)
def test_a_local_day_starts_where_the_reports_say_in_both_dialects(module_pg: str) -> None:
    """`tm_local_day` (SQLite, cached per 15-minute slice) and PostgreSQL's expression give
    every instant the start of its local day as the reports' day boundaries have it
    (`rollup.midnight` of its local date, worked out here per instant), in zones with DST,
    offsets of 30 and 45 minutes, a midnight that happens twice or not at all, and seconds."""
    moments = [*(datetime(1971, 6, 1, tzinfo=UTC).timestamp() + k * 29 * 60.0
                 for k in range(365 * 24 * 2)),
               *(datetime(2025, 3, 1, tzinfo=UTC).timestamp() + k * 13 * 60.0 + 0.25
                 for k in range(400 * 24 * 60 // 13))]
    fn = rollup.local_day()
    expr = rollup.truncated("t", rollup.DAY_S, postgresql=True, zoned=True)

    async def pg(zone: str) -> list[float]:
        conn = await asyncpg.connect(module_pg)
        try:
            got = await conn.fetch(
                f"SELECT extract(epoch FROM {expr}) FROM unnest($1::timestamptz[], "
                "$2::text[]) AS z(t, zone)",
                [datetime.fromtimestamp(t, UTC) for t in moments], [zone] * len(moments))
            return [float(r[0]) for r in got]
        finally:
            await conn.close()

    for zone in _ODD_ZONES:
        tz = ZoneInfo(zone)
        want = [rollup.midnight(datetime.fromtimestamp(t, tz).date(), tz) for t in moments]
        assert all(w <= t for w, t in zip(want, moments, strict=True)), zone
        assert [fn(t, zone) for t in moments] == want, zone
        assert asyncio.run(pg(zone)) == want, zone
