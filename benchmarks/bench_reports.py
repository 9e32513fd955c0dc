#!/usr/bin/env python3
"""Benchmark: `tokenmeter usage` and `reconcile` over large ledgers, on SQLite and PostgreSQL.

    .venv/bin/python benchmarks/bench_reports.py [--rows 2000000 20000000]
        [--dialect sqlite postgresql] [--postgres postgresql://postgres@127.0.0.1:5432]
        [--keep DIR [--reuse]] [--build-only] [--raw-up-to N] [--out FILE]

The ledger: a team sending 66,667 requests a day (46 a minute), so 2,000,000 rows are its
month (30 days) and 20,000,000 ten months: 200 users with two keys each in 10 teams, three
models on two upstreams, every 97th request unpriced, every 50th refused by its budget, each
row naming its daily and monthly windows, every 20th a response-cache hit (its saved columns
filled), each user's rows tagged with one of four `feature` values (so tags add no groups).
Rows are synthesised in the database (a recursive CTE in SQLite, generate_series in
PostgreSQL: minutes, not the hours shipping them would take), the secondary indexes built
after them, then the rollups built by the very statements the migration's backfill runs
(`proxy.ledger.rollup.rebuild`; the property tests check that rollups kept by shipping equal
them), and Europe/Berlin's local days summed by the backfill a shipper configured with that
zone runs when it starts (`proxy.ledger.migrate.add_zone_*`; on a kept ledger, through the
sink's own `open`). A fresh SQLite file, a fresh PostgreSQL database (dropped afterwards
unless --keep; with --keep DIR --reuse a later run reads the ledgers kept, skipping minutes of
synthesis).

Timed in this process (open the ledger, build the report, render it as CSV; the median of 3
runs, wall clock and this process's CPU), and `usage --by user,day` and `reconcile` also as the
command a user runs (a new `tokenmeter` process, its start included):
- `usage --by user,day` over every whole day of the ledger, UTC (the day rollup), and in
  Europe/Berlin (the local-day rollup; the 20M ledger's ten months include both DST changes);
  and the Berlin cases again read as a zone the local-day rollup does not hold is (the UTC
  day rollup, each UTC day corrected by the one or two hours between its midnight and
  Berlin's: `utc_days_*`);
- `--by model,day` the same two ways; `--by user` UTC, `--by key,model` and `--by team,week` in
  Berlin over the same days;
- `usage --by tag:feature,day` over the same days, UTC (the day rollup's tags column);
- `usage --by user` from 10:17 on the first day to 15:42 on the last (both rollups, and the
  rows of the two partial hours);
- `reconcile --recheck 0` of a day in the middle, against a Redis of its own (empty: every
  window is "drift"; what is timed is reading the books).
Writes benchmarks/results/reports-latest.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import asyncpg

from proxy.budget.store_redis import RedisStore
from proxy.config.ledger import LedgerConfig
from proxy.config.load import load_config
from proxy.ledger import query, report_plan, report_render, rollup
from proxy.ledger.migrate import add_zone_postgres, add_zone_sqlite
from proxy.ledger.schema import MIGRATIONS, TABLE
from proxy.ledger.sink_postgres import PostgresSink
from proxy.ledger.sink_sqlite import SqliteSink
from proxy.reconcile import plan as reconcile_plan

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from procs import free_port  # noqa: E402

TOKENMETER = str(Path(sys.executable).with_name("tokenmeter"))
PER_DAY = 66_667
T0 = datetime(2026, 1, 1, tzinfo=UTC)
USERS = 200
# The configured zone of the bench's proxy: its local days summed by the shipper's own backfill
# (`proxy.ledger.migrate.add_zone_*`), as a shipper configured with it does when it starts.
ZONE = "Europe/Berlin"
BACKFILL: dict[str, float] = {}  # per ledger URL, the seconds its backfill took
_INDEXES = ("started", "user", "team")  # schema v1's secondary indexes, built after the rows

# One row per i: the same expressions in both dialects but for text and time.
_COLS = ("request_id, started_at, ended_at, replica, user_name, key_name, team, operation, "
         "requested_model, model, response_model, upstream, fallback_from, attempts, status, "
         "error_class, stream, input_tokens, output_tokens, cached_input_tokens, "
         "reasoning_tokens, token_source, ttft_ms, upstream_ttft_ms, overhead_ms, duration_ms, "
         "output_tokens_per_s, cost_nanousd, price_version, windows, "
         "cache_creation_input_tokens, cache, saved_input_tokens, saved_output_tokens, "
         "saved_cost_nanousd, tags")


def _values(started: str, ended: str, day: str, month: str, *, pg: bool) -> str:
    """The SELECT list of row `i` (`day`, `month`: its window stamps)."""
    i = "i"
    user = f"'user' || ({i} % {USERS})"
    model = (f"(CASE ({i} / {USERS}) % 3 WHEN 0 THEN 'gpt-4o' WHEN 1 THEN 'gpt-4o-mini' "
             "ELSE 'claude-sonnet' END)")
    return ", ".join([
        f"'r' || {i}", started, ended, "'bench-1'", user,
        f"{user} || '-k' || (({i} / {USERS * 3}) % 2)", f"'team' || ({i} % 10)", "'chat'",
        model, model, model,
        f"(CASE ({i} / {USERS}) % 3 WHEN 2 THEN 'anthropic' ELSE 'openai' END)", "NULL", "1",
        f"(CASE WHEN {i} % 50 = 0 THEN 429 ELSE 200 END)",
        f"(CASE WHEN {i} % 50 = 0 THEN 'budget_exceeded' ELSE 'none' END)",
        "true" if pg else "1",
        f"(100 + {i} % 1000)", f"(20 + {i} % 300)", f"({i} % 64)", "0", "'reported'",
        "12.5", "11.0", "0.4", "1500.0", "13.3",
        f"(CASE WHEN {i} % 97 = 0 THEN NULL ELSE 1000 + {i} % 5000 END)", "'p1'",
        f"'u:daily_tokens:' || {day} || ' u:monthly_tokens:M' || {month}", "0",
        f"(CASE WHEN {i} % 20 = 0 THEN 'hit' ELSE 'none' END)",
        f"(CASE WHEN {i} % 20 = 0 THEN 500 ELSE 0 END)",
        f"(CASE WHEN {i} % 20 = 0 THEN 50 ELSE 0 END)",
        f"(CASE WHEN {i} % 20 = 0 THEN 2000 ELSE NULL END)",
        f"'{{\"feature\":\"f' || ({i} % {USERS} % 4) || '\"}}'",
    ])


def _sqlite_fill(path: Path, rows: int, step: float) -> None:
    with sqlite3.connect(path, isolation_level=None) as db:
        db.execute("PRAGMA synchronous = OFF")
        for name in _INDEXES:
            db.execute(f"DROP INDEX IF EXISTS {TABLE}_{name}")
        started = f"({T0.timestamp()} + i * {step})"
        chunk = 1_000_000
        for lo in range(0, rows, chunk):
            hi = min(rows, lo + chunk)
            values = _values(started, f"{started} + 1.5",
                             f"strftime('%Y%m%d', {started}, 'unixepoch')",
                             f"strftime('%Y%m', {started}, 'unixepoch')", pg=False)
            db.execute(f"WITH RECURSIVE s(i) AS (SELECT {lo} UNION ALL SELECT i + 1 FROM s "
                       f"WHERE i < {hi - 1}) INSERT INTO {TABLE} ({_COLS}) "
                       f"SELECT {values} FROM s")
            print(f"  sqlite: {hi:,} rows", flush=True)
        _finish_sqlite(db, f"sqlite://{path}")


def _finish_sqlite(db: sqlite3.Connection, url: str) -> None:
    for statement in MIGRATIONS[0].sqlite[1:]:  # the indexes
        db.execute(statement)
    rollup.register(db)  # tm_local_day, as the sink's connection has it
    db.execute("BEGIN")
    for statement in rollup.rebuild(TABLE, postgresql=False):
        db.execute(statement)
    db.execute("COMMIT")
    t = time.perf_counter()
    assert add_zone_sqlite(db, ZONE)
    BACKFILL[url] = time.perf_counter() - t
    db.execute("ANALYZE")


async def _pg_fill(url: str, rows: int, step: float) -> None:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("SET synchronous_commit = off")
        for name in _INDEXES:
            await conn.execute(f"DROP INDEX IF EXISTS {TABLE}_{name}")
        started = f"to_timestamp({T0.timestamp()} + i * {step})"
        values = _values(started, f"{started} + interval '1.5 seconds'",
                         f"to_char({started} AT TIME ZONE 'UTC', 'YYYYMMDD')",
                         f"to_char({started} AT TIME ZONE 'UTC', 'YYYYMM')", pg=True)
        chunk = 500_000
        for lo in range(0, rows, chunk):
            hi = min(rows, lo + chunk)
            await _retrying(conn, (f"INSERT INTO {TABLE} ({_COLS}) SELECT {values} "
                                   f"FROM generate_series({lo}::bigint, {hi - 1}) AS i",))
            print(f"  postgresql: {hi:,} rows", flush=True)
        await _retrying(conn, MIGRATIONS[0].postgresql[1:])
        await _retrying(conn, rollup.rebuild(TABLE, postgresql=True))
        t = time.perf_counter()
        assert await add_zone_postgres(conn, ZONE)
        BACKFILL[url] = time.perf_counter() - t
        await _retrying(conn, ("VACUUM ANALYZE",))
    finally:
        await conn.close()


async def _retrying(conn: asyncpg.Connection, statements: Sequence[str]) -> None:
    """`statements` in one transaction, again if a statement is cancelled (on a machine
    shared with other test suites, something cancels long statements now and then)."""
    for attempt in range(5):
        try:
            if len(statements) == 1:  # VACUUM cannot run in a transaction
                await conn.execute(statements[0])
                return
            async with conn.transaction():
                for statement in statements:
                    await conn.execute(statement)
            return
        except asyncpg.QueryCanceledError:
            print(f"  cancelled; again ({attempt + 1})", flush=True)
    raise RuntimeError("cancelled five times")


def _timed(args: list[str]) -> tuple[float, int]:
    """Median wall seconds of 3 runs of the command, and its exit status."""
    times = []
    code = 0
    for _ in range(3):
        t = time.perf_counter()
        done = subprocess.run([TOKENMETER, *args], capture_output=True, text=True, check=False)
        times.append(time.perf_counter() - t)
        code = done.returncode
        if code not in (0, 1):
            raise RuntimeError(f"{args}: {done.stderr}")
    return statistics.median(times), code


def _in_process(make: Callable[[], Awaitable[object]], runs: int = 3) -> tuple[float, float]:
    """Median wall and CPU seconds (this process's, its SQLite thread included; not the
    PostgreSQL server's) of `make()` run here: what the command does once started (its Python
    start, ~1 s of imports on a loaded machine, is not the report's)."""
    walls, cpus = [], []
    for _ in range(runs):
        t, c = time.perf_counter(), time.process_time()
        asyncio.run(make())  # type: ignore[arg-type]
        walls.append(time.perf_counter() - t)
        cpus.append(time.process_time() - c)
    return statistics.median(walls), statistics.median(cpus)


async def _usage(url: str, by: str, start: str, end: str, zone: str) -> object:
    tz = ZoneInfo(zone)
    period = report_plan.ReportPeriod(tz, report_plan.parse_bound(start, tz, end=False),
                                report_plan.parse_bound(end, tz, end=True))
    async with await query.open_reader(query.locate(LedgerConfig(), url)) as reader:
        return report_render.render_csv(
            await report_plan.build_report(reader, report_plan.parse_by(by), period))


async def _reconcile(config: Path, url: str, day: date) -> object:
    cfg = load_config(str(config))
    store = RedisStore(cfg.store.url, 5000)
    try:
        async with await query.open_reader(query.locate(cfg.ledger, url)) as reader:
            return await reconcile_plan.reconcile(cfg, store, reader, day)
    finally:
        await store.close()


def _config(path: Path, redis_url: str, ledger_url: str) -> Path:
    users = {f"user{u}": {"team": f"team{u % 10}", "keys": [f"sk-bench-{u:04d}-xxxxxxxx"],
                          "daily_tokens": 10_000_000, "monthly_tokens": 100_000_000}
             for u in range(USERS)}
    doc = {"timezone": "UTC", "upstreams": {"openai": {"base_url": "http://127.0.0.1:9/v1"}},
           "models": [{"match": "*", "upstream": "openai"}],
           "store": {"url": redis_url}, "ledger": {"url": ledger_url},
           "teams": {f"team{t}": {} for t in range(10)}, "users": users}
    path.write_text(json.dumps(doc))  # JSON is YAML
    return path


def _measure(url: str, days: int, config: Path, raw: bool) -> dict[str, Any]:
    first = T0.date()
    last = first + timedelta(days=days - 1)
    middle = first + timedelta(days=days // 2)
    def whole_days(by: str, zone: str) -> Callable[[], Awaitable[object]]:
        return lambda: _usage(url, by, str(first), str(last), zone)

    cases: dict[str, Callable[[], Awaitable[object]]] = {
        "usage_user_day_utc": whole_days("user,day", "UTC"),
        "usage_user_day_berlin": whole_days("user,day", "Europe/Berlin"),
        "usage_model_day_utc": whole_days("model,day", "UTC"),
        "usage_model_day_berlin": whole_days("model,day", "Europe/Berlin"),
        "usage_user_utc": whole_days("user", "UTC"),
        "usage_key_model_berlin": whole_days("key,model", "Europe/Berlin"),
        "usage_team_week_berlin": whole_days("team,week", "Europe/Berlin"),
        "usage_tag_day_utc": whole_days("tag:feature,day", "UTC"),
        "usage_user_mid_day_edges": lambda: _usage(url, "user", f"{first}T10:17",
                                                   f"{last}T15:42", "UTC"),
        "reconcile": lambda: _reconcile(config, url, middle),
    }
    out: dict[str, Any] = {}
    for k, make in cases.items():
        out[f"{k}_s"], out[f"{k}_cpu_s"] = _in_process(make)
    for zone, name in (("UTC", "utc"), ("Europe/Berlin", "berlin")):
        out[f"cli_usage_user_day_{name}_s"], _ = _timed(
            ["usage", "--ledger", url, "--by", "user,day", "--from", str(first), "--to",
             str(last), "--timezone", zone, "--format", "csv"])
    out["cli_reconcile_s"], _ = _timed(
        ["reconcile", "--config", str(config), "--ledger", url, "--date", str(middle),
         "--recheck", "0", "--json"])
    # Before: Berlin read through the UTC day rollup (as a ledger whose local-day rollup does
    # not hold the zone is read).
    rolled = query.zone_rolled

    async def not_rolled(reader: query.LedgerReader, zone: str) -> bool:
        return False

    berlin = ("usage_user_day_berlin", "usage_model_day_berlin")
    local: dict[str, object] = {k: asyncio.run(cases[k]()) for k in berlin}  # type: ignore[arg-type]
    setattr(report_plan, "zone_rolled", not_rolled)  # noqa: B010
    try:
        for k in berlin:
            out[f"utc_days_{k}_s"], out[f"utc_days_{k}_cpu_s"] = _in_process(cases[k])
            # The same report both ways, to the token and the nano-dollar.
            assert asyncio.run(cases[k]()) == local[k], k  # type: ignore[arg-type]
    finally:
        setattr(report_plan, "zone_rolled", rolled)  # noqa: B010
    if raw:  # before: the same, from the rows alone (as a ledger without rollups is read)
        ready, name, modules = query.rollups_ready, "rollups_ready", (report_plan, reconcile_plan)

        async def never(reader: query.LedgerReader) -> bool:
            return False

        for module in modules:
            setattr(module, name, never)
        try:
            for k in ("usage_user_day_utc", "reconcile"):
                out[f"raw_{k}_s"], out[f"raw_{k}_cpu_s"] = _in_process(cases[k], runs=1)
        finally:
            for module in modules:
                setattr(module, name, ready)
    return out


async def _rollup_rows(url: str, tables: Sequence[str]) -> int:
    if url.startswith("sqlite"):
        with sqlite3.connect(url.removeprefix("sqlite://")) as db:
            return sum(int(db.execute(f"SELECT count(*) FROM {t}").fetchone()[0])
                       for t in tables)
    conn = await asyncpg.connect(url)
    try:
        return sum([int(await conn.fetchval(f"SELECT count(*) FROM {t}")) for t in tables])
    finally:
        await conn.close()


_UTC_ROLLUPS = (rollup.USAGE.table, rollup.USAGE_DAILY.table)


async def _zone_on_reuse(url: str) -> None:
    """A ledger kept by an earlier run, opened as the shipper opens it (configured in ZONE):
    migrated to this code's schema, ZONE's local days summed if they are not yet."""
    sink: SqliteSink | PostgresSink = (SqliteSink(Path(url.removeprefix("sqlite://")), ZONE)
                                       if url.startswith("sqlite") else PostgresSink(url, ZONE))
    t = time.perf_counter()
    await sink.open()
    await sink.close()
    sink.shutdown()
    BACKFILL[url] = time.perf_counter() - t


def _build(dialect: str, rows: int, args: argparse.Namespace, tmp: Path
           ) -> tuple[str, str | None]:
    """A ledger of `rows` rows: its URL, and the PostgreSQL database to drop afterwards (None
    when kept). With --reuse, a ledger kept by an earlier run (--keep) is read as it is."""
    keep, reuse, postgres = args.keep is not None, args.reuse, args.postgres
    where: Path = args.keep or tmp
    days = round(rows / PER_DAY)
    step = days * 86400 / rows
    if dialect == "sqlite":
        path = where / f"ledger-{rows}.sqlite3"
        if reuse and path.is_file():
            asyncio.run(_zone_on_reuse(f"sqlite://{path}"))
            return f"sqlite://{path}", None
        path.unlink(missing_ok=True)
        sink = SqliteSink(path)  # the schema, as the proxy makes it
        asyncio.run(sink.open())
        asyncio.run(sink.close())
        sink.shutdown()
        _sqlite_fill(path, rows, step)
        return f"sqlite://{path}", None
    name = f"tm_bench_reports_{rows}" if keep else f"tm_bench_reports_{uuid.uuid4().hex[:8]}"
    url = f"{postgres}/{name}"
    if reuse and asyncio.run(_exists(postgres, name)):
        asyncio.run(_zone_on_reuse(url))
        return url, None
    if keep:
        asyncio.run(_admin(postgres, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
    asyncio.run(_admin(postgres, f"CREATE DATABASE {name}"))

    async def migrate() -> None:
        s = PostgresSink(url)
        await s.open()
        await s.close()

    try:
        asyncio.run(migrate())
        asyncio.run(_pg_fill(url, rows, step))
    except BaseException:
        asyncio.run(_admin(postgres, f"DROP DATABASE {name} WITH (FORCE)"))
        raise
    return url, None if keep else name


async def _exists(base: str, name: str) -> bool:
    conn = await asyncpg.connect(f"{base}/postgres")
    try:
        return bool(await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name))
    finally:
        await conn.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[2_000_000, 20_000_000])
    ap.add_argument("--dialect", nargs="+", default=["sqlite", "postgresql"])
    ap.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432")
    ap.add_argument("--raw-up-to", type=int, default=2_000_000,
                    help="also time reading the rows alone (before) up to this many rows")
    ap.add_argument("--out", type=Path,
                    default=ROOT / "benchmarks" / "results" / "reports-latest.json")
    ap.add_argument("--keep", type=Path,
                    help="keep the ledgers: the SQLite files in this directory, the PostgreSQL "
                         "databases as tm_bench_reports_<rows> (not dropped)")
    ap.add_argument("--reuse", action="store_true",
                    help="with --keep: read the ledgers an earlier run kept instead of "
                         "synthesising them again (minutes of CPU at 20M rows)")
    ap.add_argument("--build-only", action="store_true",
                    help="synthesise (and keep) the ledgers, time nothing")
    args = ap.parse_args()
    redis_exe = shutil.which("redis-server")
    if redis_exe is None:
        print("redis-server is needed for reconcile", file=sys.stderr)
        return 2
    port = free_port()
    redis = subprocess.Popen([redis_exe, "--port", str(port), "--save", "", "--appendonly",
                              "no"], stdout=subprocess.DEVNULL)
    tmp = Path(tempfile.mkdtemp(prefix="tm-bench-reports-"))
    results: list[dict[str, Any]] = []
    try:
        for rows in args.rows:
            for dialect in args.dialect:
                t = time.perf_counter()
                url, dropdb = _build(dialect, rows, args, tmp)
                built = time.perf_counter() - t
                if args.build_only:
                    print(f"{dialect} {rows:,}: {url} ({built:.0f} s)", flush=True)
                    continue
                try:
                    config = _config(tmp / "bench.yaml", f"redis://127.0.0.1:{port}/0", url)
                    figures = _measure(url, round(rows / PER_DAY), config,
                                       rows <= args.raw_up_to)
                    entry = {"dialect": dialect, "rows": rows, "days": round(rows / PER_DAY),
                             "usage_rollup_rows": asyncio.run(_rollup_rows(url, _UTC_ROLLUPS)),
                             "localday_rollup_rows": asyncio.run(_rollup_rows(
                                 url, (rollup.USAGE_LOCAL.table,))),
                             "berlin_backfill_s": round(BACKFILL.get(url, 0.0), 1),
                             "synthesis_s": round(built, 1),
                             **{k: round(v, 3) if isinstance(v, float) else v
                                for k, v in figures.items()}}
                    print(json.dumps(entry), flush=True)
                    results.append(entry)
                finally:
                    if dropdb is not None:
                        asyncio.run(_admin(args.postgres, f"DROP DATABASE {dropdb} WITH (FORCE)"))
                    elif args.keep is None:
                        Path(url.removeprefix("sqlite://")).unlink(missing_ok=True)
    finally:
        redis.terminate()
        redis.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)
    if args.build_only:
        return 0
    out: Path = args.out
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


async def _admin(base: str, statement: str) -> None:
    conn = await asyncpg.connect(f"{base}/postgres")
    try:
        await conn.execute(statement)
    finally:
        await conn.close()


if __name__ == "__main__":
    sys.exit(main())
