"""The "Usage and chargeback" dashboard (grafana/dashboards/chargeback.json) against a real
PostgreSQL holding ledger rows.

Every SQL query of the dashboard, panels and template variables, is run the way Grafana runs it
for its PostgreSQL data source: the template variables interpolated first (multi-value, *All*
expanding to every option of the variable's own query, values quoted as SQL literals), then the
data source's macros (`$__timeFilter`, `$__timeGroupAlias`, ...) expanded as Grafana's
grafana-postgresql-datasource does. The queries run as the read-only role that
deploy/compose/ledger-reader.sql creates (the role the provisioned datasource uses), on the
schema the proxy's own migration creates, and their answers are compared with the same sums
computed here in Python from the rows inserted, and from rows the real proxy booked through its
spool and shipper. No query of the dashboard goes unrun.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import anthropic
import asyncpg
import openai
import pytest
import yaml
from aiohttp.test_utils import TestServer
from anthropic.types import MessageParam

from proxy.config.policy import Price
from proxy.cost import CostLines
from proxy.errors import ErrorClass
from proxy.ledger.migrate import migrate_postgres
from proxy.ledger.row import COLUMNS, LedgerRow
from proxy.ledger.schema import TABLE
from proxy.pipeline import services as st
from proxy.protocol.usage import Usage
from proxy.server.app import create_app
from tests.helpers import (
    ALICE_KEY,
    BOB_KEY,
    MESSAGES,
    ROOT,
    ServerFactory,
    make_config,
    sdk,
    settled,
)

DASHBOARD = ROOT / "grafana" / "dashboards" / "chargeback.json"
DATASOURCES = ROOT / "grafana" / "provisioning" / "datasources"
READER_SQL = ROOT / "deploy" / "compose" / "ledger-reader.sql"
ADMIN = "postgresql://postgres@127.0.0.1:5432"

# Grafana's "This month" in November 2026 (now/M to now/M), as the macros receive it.
MONTH = (datetime(2026, 11, 1, tzinfo=UTC), datetime(2026, 11, 30, 23, 59, 59, 999000, tzinfo=UTC))
# What Grafana computes for $__interval over a month, raised to the panels' minimum (1h).
INTERVAL = "1h"
NONE = "(none)"  # the dashboard's name for a NULL team or key

PRICES = {
    "gpt-4o": Price(input=2.5, cached_input=1.25, output=10.0),
    "gpt-4o-mini": Price(input=0.15, cached_input=0.075, output=0.6),
    "gpt-4.1": Price(input=2.0, cached_input=0.5, output=8.0),
    # Anthropic's: cache writes above input (5-minute; the ledger has no 1-hour column).
    "claude-sonnet-4": Price(input=3.0, output=15.0, cached_input=0.30, cache_write_5m=3.75,
                             cache_write_1h=6.0),
}
MESSAGES_OPERATION = "messages"  # the Anthropic Messages API's rows
REFUSED_CLASSES = {ErrorClass.BUDGET_EXCEEDED, ErrorClass.SERVICE_UNAVAILABLE,
                   ErrorClass.RATE_LIMIT}


# ------------------------------------------------------------------------------ the rows


def at(day: int, hour: int, minute: int = 0, second: float = 0.0, month: int = 11) -> datetime:
    return datetime(2026, month, day, hour, minute, tzinfo=UTC) + timedelta(seconds=second)


def ledger_row(
    when: datetime, user: str, team: str | None, key: str | None, model: str | None,
    requested: str | None = None, *, status: int = 200, error: ErrorClass = ErrorClass.NONE,
    tokens: tuple[int, int, int, int] = (0, 0, 0, 0), ttft_ms: float | None = None,
    tokens_per_s: float | None = None, cache_write: int | None = None,
    tags: dict[str, str] | None = None,
) -> LedgerRow:
    """`tokens`: input, cached input, output, reasoning. The cost from the price table, as
    settle computes it (None for a model without a price). `cache_write`: an Anthropic
    Messages API row, with that many prompt tokens written to the cache (its cached input is
    its cache reads)."""
    input_tokens, cached, output, reasoning = tokens
    price = PRICES.get(model or "")
    usage = Usage(input_tokens=input_tokens, output_tokens=output, cached_input_tokens=cached,
                  cache_creation_input_tokens=cache_write or 0)
    cost = None if price is None else CostLines.of(price, usage).nanousd
    return LedgerRow(
        request_id=uuid.uuid4().hex, started_at=when.timestamp(),
        ended_at=when.timestamp() + 1.5, replica="test-replica", user_name=user, key_name=key,
        team=team, operation="chat" if cache_write is None else MESSAGES_OPERATION,
        requested_model=requested or model or "", model=model, response_model=model,
        upstream=None if model is None else "openai" if cache_write is None else "anthropic",
        fallback_from=None, attempts=1, status=status, error_class=error.value,
        stream=ttft_ms is not None, input_tokens=input_tokens, output_tokens=output,
        cached_input_tokens=cached, reasoning_tokens=reasoning, token_source="reported",
        ttft_ms=ttft_ms, upstream_ttft_ms=None if ttft_ms is None else ttft_ms - 2,
        overhead_ms=None if ttft_ms is None else 2.0, duration_ms=1500.0,
        output_tokens_per_s=tokens_per_s, cost_nanousd=cost, price_version="v1",
        windows="user:alice:daily_tokens:20261102", cache_creation_input_tokens=cache_write or 0,
        tags=json.dumps(tags or {}, sort_keys=True, separators=(",", ":")),
    )


ROWS: tuple[LedgerRow, ...] = (
    # research: alice with two keys and two models, carol on gpt-4.1.
    ledger_row(at(2, 9), "alice", "research", "alice-laptop", "gpt-4o",
               tokens=(1000, 200, 500, 0), ttft_ms=120.0, tokens_per_s=50.0,
               tags={"feature": "faq", "env": "prod"}),
    ledger_row(at(2, 9, 30), "alice", "research", "alice-ci", "gpt-4o-mini",
               tokens=(4000, 0, 1000, 0), tags={"feature": "search", "customer": "it's"}),
    ledger_row(at(3, 14), "alice", "research", "alice-laptop", "gpt-4o",
               tokens=(2000, 1000, 800, 300), ttft_ms=300.0, tokens_per_s=40.0,
               tags={"feature": "faq"}),
    ledger_row(at(3, 14, 10), "alice", "research", "alice-laptop", "gpt-4o",
               status=429, error=ErrorClass.RATE_LIMIT),  # the upstream's own 429
    ledger_row(at(2, 10), "carol", "research", "carol-main", "gpt-4.1",
               tokens=(500, 0, 100, 0), ttft_ms=80.0, tokens_per_s=90.0),
    ledger_row(at(4, 8), "carol", "research", "carol-main", None, "gpt-4.1",
               status=503, error=ErrorClass.SERVICE_UNAVAILABLE),  # store down, fail_closed
    # apps: bob, refused three times for his quota; erin went away mid-stream.
    ledger_row(at(2, 11), "bob", "apps", "bob-main", "gpt-4o-mini", tokens=(300, 0, 50, 0),
               ttft_ms=200.0, tokens_per_s=70.0, tags={"env": "prod"}),
    ledger_row(at(3, 9), "bob", "apps", "bob-main", "gpt-4o-mini", tokens=(700, 100, 150, 0)),
    ledger_row(at(3, 9, 5), "bob", "apps", "bob-main", None, "gpt-4o-mini", status=429,
               error=ErrorClass.BUDGET_EXCEEDED),
    ledger_row(at(3, 9, 40), "bob", "apps", "bob-main", None, "gpt-4o-mini", status=429,
               error=ErrorClass.BUDGET_EXCEEDED),
    ledger_row(at(4, 9), "bob", "apps", "bob-main", None, "gpt-4o-mini", status=429,
               error=ErrorClass.BUDGET_EXCEEDED),
    ledger_row(at(4, 10), "erin", "apps", "erin-main", "gpt-4o", status=499,
               error=ErrorClass.CLIENT_DISCONNECT, tokens=(50, 0, 20, 0), ttft_ms=500.0),
    # dave: no team, no key name; a model without a price; a failure (not a refusal).
    ledger_row(at(4, 12), "dave", None, None, "llama-local", tokens=(100, 0, 10, 0)),
    ledger_row(at(4, 13), "dave", None, None, "gpt-4o", status=502,
               error=ErrorClass.UPSTREAM_5XX),
    # agents: frank's coding agent on the Anthropic API, its prompt cache read and written.
    ledger_row(at(3, 10), "frank", "agents", "frank-agent", "claude-sonnet-4",
               tokens=(13_000, 10_000, 700, 0), cache_write=2_000, ttft_ms=900.0,
               tokens_per_s=60.0),
    ledger_row(at(4, 11), "frank", "agents", "frank-agent", "claude-sonnet-4",
               tokens=(5_000, 0, 300, 0), cache_write=5_000),
    # Names that need SQL quoting (the config's names cannot, but the SQL must not rely on it).
    ledger_row(at(5, 16), "o'hara", "r'n'd", "o'hara-key", "gpt-4o-mini",
               tokens=(10_000, 5000, 2000, 1000)),
    # The edges of the month: the last instant is in, the next month and the one before out.
    ledger_row(at(30, 23, 59, 59.5), "bob", "apps", "bob-main", "gpt-4o-mini",
               tokens=(1, 0, 1, 0)),
    ledger_row(at(1, 0, month=12), "bob", "apps", "bob-main", "gpt-4o", tokens=(9999, 0, 9999, 0)),
    ledger_row(at(31, 23, 59, 59, month=10), "alice", "research", "alice-laptop", "gpt-4o",
               tokens=(8888, 0, 8888, 0)),
)


def team_of(r: LedgerRow) -> str:
    return r.team if r.team is not None else NONE


def model_of(r: LedgerRow) -> str:
    return r.model if r.model is not None else r.requested_model


def usd(nanos: Iterable[int | None]) -> Decimal:
    return sum((Decimal(n).scaleb(-9) for n in nanos if n is not None), Decimal(0))


@dataclass(frozen=True)
class Selection:
    """The dashboard's state: a time range and, per variable, the values chosen (None: All)."""

    start: datetime
    end: datetime
    chosen: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    source: tuple[LedgerRow, ...] = ROWS  # what the database holds

    def rows(self) -> list[LedgerRow]:
        """What the dashboard should see: the rows in the range matching every filter (Python's
        own reading, to compare the SQL with)."""
        lo, hi = self.start.timestamp(), self.end.timestamp()
        out = []
        for r in self.source:
            if not lo <= r.started_at <= hi:
                continue
            for name, value in (("team", team_of(r)), ("user", r.user_name),
                                ("model", model_of(r))):
                if name in self.chosen and value not in self.chosen[name]:
                    break
            else:
                out.append(r)
        return out


# ------------------------------------------------------------------ Grafana's interpolation

# grafana-postgresql-datasource's macro syntax: $name(args), args without a ")".
_MACRO = re.compile(r"\$([_a-zA-Z0-9]+)\(([^\)]*)\)")
# Template variable references: $name and ${name}. ([[name]] and ${name:format} are not used.)
_VARIABLE = re.compile(r"\$(\w+)|\$\{(\w+)\}")
_INTERVAL = re.compile(r"(\d+)(s|m|h|d|w)")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def rfc3339nano(t: datetime) -> str:
    """Go's time.RFC3339Nano of t in UTC (fraction without trailing zeros)."""
    t = t.astimezone(UTC)
    fraction = f".{t.microsecond:06d}".rstrip("0") if t.microsecond else ""
    return t.strftime("%Y-%m-%dT%H:%M:%S") + fraction + "Z"


def interval_seconds(text: str) -> int:
    m = _INTERVAL.fullmatch(text.strip().strip("'"))
    assert m, f"not an interval Grafana parses: {text}"
    return int(m[1]) * _SECONDS[m[2]]


def sql_literal(value: str) -> str:
    """The PostgreSQL data source's quoteLiteral."""
    return "'" + value.replace("'", "''") + "'"


def interpolate_variables(sql: str, values: Mapping[str, list[str]], interval: str) -> str:
    """What Grafana's frontend sends: $__interval from the panel, each multi-value variable as
    its values quoted and joined with commas (All: every option of the variable)."""
    scoped = {"__interval": interval, "__interval_ms": str(interval_seconds(interval) * 1000)}

    def sub(m: re.Match[str]) -> str:
        name = m[1] or m[2]
        if name in scoped:
            return scoped[name]
        if name in values:
            return ",".join(sql_literal(v) for v in values[name])
        assert name.startswith("__"), f"unknown variable ${name} in {sql}"
        return m[0]  # a macro: the data source's business

    return _VARIABLE.sub(sub, sql)


def expand_macros(sql: str, start: datetime, end: datetime) -> str:
    """grafana-postgresql-datasource's macro engine (pkg/tsdb/grafana-postgresql-datasource/
    macros.go), for a column of type timestamptz, without TimescaleDB."""
    sql = sql.replace("$__unixEpochFrom()", str(int(start.timestamp())))
    sql = sql.replace("$__unixEpochTo()", str(int(end.timestamp())))
    original = sql

    def group(column: str, interval: str) -> str:
        secs = interval_seconds(interval)
        return f"floor(extract(epoch from {column})/{secs})*{secs}"

    def sub(m: re.Match[str]) -> str:
        name = m[1]
        args = [a.strip() for a in m[2].split(",")]
        # Grafana's pre-5.3 compatibility: $__timeGroup(...) followed by "," means the alias.
        if name == "__timeGroup":
            index = original.find(m[0]) + len(m[0])
            if original[index:index + 1] == ",":
                name = "__timeGroupAlias"
        match name:
            case "__time":
                return f'{args[0]} AS "time"'
            case "__timeEpoch":
                return f'extract(epoch from {args[0]}) as "time"'
            case "__timeFilter":
                return f"{args[0]} BETWEEN '{rfc3339nano(start)}' AND '{rfc3339nano(end)}'"
            case "__timeFrom":
                return f"'{rfc3339nano(start)}'"
            case "__timeTo":
                return f"'{rfc3339nano(end)}'"
            case "__timeGroup":
                assert len(args) == 2, "a fill mode is Grafana-side only: not tested here"
                return group(args[0], args[1])
            case "__timeGroupAlias":
                assert len(args) == 2, "a fill mode is Grafana-side only: not tested here"
                return group(args[0], args[1]) + ' AS "time"'
            case "__unixEpochFilter":
                lo, hi = int(start.timestamp()), int(end.timestamp())
                return f"{args[0]} >= {lo} AND {args[0]} <= {hi}"
        raise AssertionError(f"Grafana has no macro ${name} (unknown macro)")

    return _MACRO.sub(sub, sql)


def render(sql: str, values: Mapping[str, list[str]], sel: Selection) -> str:
    out = expand_macros(interpolate_variables(sql, values, INTERVAL), sel.start, sel.end)
    assert "$" not in out, f"left uninterpolated: {out}"
    return out


# --------------------------------------------------------------------------- the dashboard


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return data


def panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dash["panels"]:
        yield panel
        yield from panel.get("panels", [])  # collapsed rows keep theirs inside


def variables(dash: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = dash["templating"]["list"]
    return out


def variable_sql(var: dict[str, Any]) -> str:
    q = var["query"]
    return str(q["rawSql"] if isinstance(q, dict) else q)


@dataclass(frozen=True)
class Target:
    panel: str
    ref: str
    sql: str
    format: str


def targets(dash: dict[str, Any]) -> list[Target]:
    return [Target(p["title"], t["refId"], t["rawSql"], t["format"])
            for p in panels(dash) for t in p.get("targets", [])]


def every_query(dash: dict[str, Any]) -> set[str]:
    return {f"{t.panel} / {t.ref}" for t in targets(dash)} | {
        f"variable {v['name']}" for v in variables(dash)}


def ledger_datasource() -> dict[str, Any]:
    doc = yaml.safe_load((DATASOURCES / "ledger.yml").read_text(encoding="utf-8"))
    (ds,) = doc["datasources"]
    assert isinstance(ds, dict)
    return ds


# ---------------------------------------------------------------------- the database


@pytest.fixture
async def reader_url(pg_url: str) -> AsyncIterator[str]:
    """A ledger database: the read-only role from deploy/compose/ledger-reader.sql (created
    first, as in the compose stack), the schema the proxy's migration creates, ROWS in it. The
    URL connects as the read-only role."""
    db = pg_url.rsplit("/", 1)[1]
    reader = f"tm_reader_{uuid.uuid4().hex[:12]}"
    run = await asyncio.to_thread(
        subprocess.run,
        ["psql", "-X", "-q", "-h", "127.0.0.1", "-U", "postgres", "-d", db,
         "-v", "owner=postgres", "-v", f"reader={reader}", "-v", "reader_password=it's-a-test",
         "-f", str(READER_SQL)],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    try:
        owner = await asyncpg.connect(pg_url)
        try:
            await migrate_postgres(owner)
            await owner.executemany(
                f"INSERT INTO {TABLE} ({', '.join(COLUMNS)}) "
                f"VALUES ({', '.join(f'${i + 1}' for i in range(len(COLUMNS)))})",
                [db_values(r) for r in ROWS],
            )
        finally:
            await owner.close()
        yield f"postgresql://{reader}@127.0.0.1:5432/{db}"
    finally:
        conn = await asyncpg.connect(pg_url)
        try:
            await conn.execute(f'DROP OWNED BY "{reader}"')
            await conn.execute(f'DROP ROLE "{reader}"')
        finally:
            await conn.close()


def db_values(r: LedgerRow) -> tuple[Any, ...]:
    values = {name: getattr(r, name) for name in COLUMNS}
    for name in ("started_at", "ended_at"):
        values[name] = datetime.fromtimestamp(values[name], UTC)
    return tuple(values[name] for name in COLUMNS)


@dataclass
class Run:
    """One rendering of the whole dashboard: each query's SQL and rows, by query name."""

    options: dict[str, list[str]] = field(default_factory=dict)
    results: dict[str, list[asyncpg.Record]] = field(default_factory=dict)

    def __getitem__(self, panel: str) -> list[asyncpg.Record]:
        return self.results[f"{panel} / A"]


async def run_dashboard(conn: asyncpg.Connection, sel: Selection) -> Run:
    """Grafana's order: each variable's query (with the variables before it), then every
    panel's, with All expanded to the variable's options."""
    dash = dashboard()
    out = Run()
    values: dict[str, list[str]] = {}
    for var in variables(dash):
        name = var["name"]
        rows = await conn.fetch(render(variable_sql(var), values, sel))
        assert all(len(r) == 1 for r in rows), f"variable {name}: one column"
        options = [str(r[0]) for r in rows]
        out.options[name] = options
        out.results[f"variable {name}"] = rows
        values[name] = list(sel.chosen.get(name, options))
    for t in targets(dash):
        sql = render(t.sql, values, sel)
        try:
            rows = await conn.fetch(sql)
        except asyncpg.PostgresError as exc:
            raise AssertionError(f"{t.panel} / {t.ref}: {exc}\n{sql}") from exc
        out.results[f"{t.panel} / {t.ref}"] = rows
        if t.format == "time_series":
            check_time_series(t, rows)
    return out


def check_time_series(t: Target, rows: list[asyncpg.Record]) -> None:
    """What Grafana needs of a time_series frame: a `time` column first, ascending; a long frame
    (time, metric, value) names its series by `metric`; the other columns are numbers."""
    if not rows:
        return
    columns = list(rows[0].keys())
    assert columns[0] == "time", f"{t.panel}: {columns}"
    times = [r["time"] for r in rows]
    assert times == sorted(times), f"{t.panel}: not sorted by time"
    text = [c for c in columns[1:] if isinstance(rows[0][c], str)]
    assert text in ([], ["metric"]), f"{t.panel}: {columns}"
    assert not text or len(columns) == 3, f"{t.panel}: a long frame is time, metric, value"
    for r in rows:
        for c in columns[1:]:
            assert c in text or isinstance(r[c], (int, float, Decimal)), (t.panel, c, r[c])


# --------------------------------------------------------------------------- expectations


def by(rows: Iterable[LedgerRow], key: Callable[[LedgerRow], Any]) -> dict[Any, list[LedgerRow]]:
    out: dict[Any, list[LedgerRow]] = defaultdict(list)
    for r in rows:
        out[key(r)].append(r)
    return dict(out)


def by_tag(tagged: Iterable[tuple[str, str, LedgerRow]]
           ) -> dict[tuple[str, str], list[tuple[str, str, LedgerRow]]]:
    out: dict[tuple[str, str], list[tuple[str, str, LedgerRow]]] = defaultdict(list)
    for item in tagged:
        out[item[0], item[1]].append(item)
    return dict(out)


def bucket(r: LedgerRow, interval: str) -> int:
    secs = interval_seconds(interval)
    return int(r.started_at // secs * secs)


def cache_read(r: LedgerRow) -> int:
    """Anthropic's cache reads: the cached input of a Messages API row (what
    tokenmeter_tokens_total{type="cache_read_input"} counts)."""
    return r.cached_input_tokens if r.operation == MESSAGES_OPERATION else 0


def refused(r: LedgerRow) -> bool:
    return r.status == 429 or r.error_class in REFUSED_CLASSES


def percentile_cont(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def ranked(got: list[tuple[Any, ...]], want: list[tuple[Any, ...]], rank: int, what: str) -> None:
    """The same rows, ordered by column `rank` descending (ties in any order: their names'
    order is the database's collation's business)."""
    ranks = [g[rank] for g in got]
    assert ranks == sorted(ranks, reverse=True), f"{what}: not largest first"
    assert sorted(got, key=_order) == sorted(want, key=_order), what


def _order(row: tuple[Any, ...]) -> tuple[str, ...]:
    """A total order for rows of names and numbers: Decimal("0.019000000") and
    Decimal("0.019") are equal, and must sort alike."""
    return tuple(f"{x.normalize():f}" if isinstance(x, Decimal) else repr(x) for x in row)


def check_panels(run: Run, sel: Selection) -> None:
    """Every panel's answer against the same figures computed from the rows."""
    rows = sel.rows()

    # Stats.
    assert run["Spend (time range)"][0]["spend"] == usd(r.cost_nanousd for r in rows)
    assert run["Requests (time range)"][0]["requests"] == len(rows)
    assert run["Tokens (time range)"][0]["tokens"] == sum(
        r.input_tokens + r.output_tokens for r in rows)
    assert run["Refused requests (time range)"][0]["refused"] == sum(map(refused, rows))

    # Spend by team / model / user over the range, largest first.
    for panel, column, key in (("Spend by team (time range)", "team", team_of),
                               ("Spend by model (time range)", "model", model_of),
                               ("Spend by user (time range)", "user",
                                lambda r: r.user_name)):
        want = [(k, usd(r.cost_nanousd for r in g)) for k, g in by(rows, key).items()]
        ranked([(r[column], r["spend"]) for r in run[panel]], want, 1, panel)

    # Cost per UTC day by team and by model.
    for panel, key in (("Cost per day by team", team_of), ("Cost per day by model", model_of)):
        def day_and(r: LedgerRow, key: Callable[[LedgerRow], str] = key) -> tuple[int, str]:
            return bucket(r, "1d"), key(r)

        want_days = sorted(
            (day, k, usd(r.cost_nanousd for r in g)) for (day, k), g in by(rows, day_and).items()
        )
        got_days = [(int(r["time"]), r["metric"], r["spend"]) for r in run[panel]]
        assert sorted(got_days) == want_days, panel

    # The chargeback table: per team and user, tokens by type and cost.
    want_users = [
        (team, user, len(g), sum(r.input_tokens for r in g),
         sum(r.cached_input_tokens for r in g), sum(map(cache_read, g)),
         sum(r.cache_creation_input_tokens for r in g), sum(r.output_tokens for r in g),
         sum(r.reasoning_tokens for r in g), usd(r.cost_nanousd for r in g))
        for (team, user), g in by(rows, lambda r: (team_of(r), r.user_name)).items()
    ]
    ranked([tuple(r.values()) for r in run["Spend by user and team"]], want_users, 9,
           "Spend by user and team")

    # Top keys.
    want_keys = [
        (key, user, team, len(g), sum(r.input_tokens for r in g),
         sum(r.output_tokens for r in g), usd(r.cost_nanousd for r in g))
        for (key, user, team), g in by(
            rows, lambda r: (r.key_name or NONE, r.user_name, team_of(r))).items()
    ]
    assert len(want_keys) <= 25, "fewer keys than the table's limit: all are shown"
    ranked([tuple(r.values()) for r in run["Top keys"]], want_keys, 6, "Top keys")

    # Spend by tag: each (key, value) of the rows' tags; a row counts under each of its tags.
    tagged = [(k, v, r) for r in rows for k, v in json.loads(r.tags).items()]
    want_tags = [
        (k, v, len(g), sum(r.input_tokens for _, _, r in g), sum(r.output_tokens for _, _, r in g),
         usd(r.cost_nanousd for _, _, r in g))
        for (k, v), g in by_tag(tagged).items()
    ]
    ranked([tuple(r.values()) for r in run["Spend by tag (time range)"]], want_tags, 5,
           "Spend by tag (time range)")

    # Tokens by type per interval.
    want_tokens = sorted(
        (b, sum(r.input_tokens for r in g), sum(r.cached_input_tokens for r in g),
         sum(map(cache_read, g)), sum(r.cache_creation_input_tokens for r in g),
         sum(r.output_tokens for r in g), sum(r.reasoning_tokens for r in g))
        for b, g in by(rows, lambda r: bucket(r, INTERVAL)).items()
    )
    got_tokens = [(int(r["time"]), r["input"], r["cached input"], r["cache read"],
                   r["cache write"], r["output"], r["reasoning"])
                  for r in run["Tokens by type"]]
    assert got_tokens == want_tokens

    # Refused requests per interval and class, and per user.
    want_refused = sorted(
        (b, cls, len(g))
        for (b, cls), g in by([r for r in rows if refused(r)],
                              lambda r: (bucket(r, INTERVAL), r.error_class)).items()
    )
    assert sorted((int(r["time"]), r["metric"], r["refused"])
                  for r in run["Refused requests by class"]) == want_refused
    want_refusers = list(Counter(r.user_name for r in rows if refused(r)).items())
    ranked([(r["user"], r["refused"]) for r in run["Refused requests by user (time range)"]],
           want_refusers, 1, "Refused requests by user")

    # Latency and failures by model, from the rows' own figures.
    want_latency = []
    for model, g in by(rows, model_of).items():
        ttft = [r.ttft_ms for r in g if r.ttft_ms is not None]
        tps = [r.output_tokens_per_s for r in g if r.output_tokens_per_s is not None]
        want_latency.append((model, len(g), sum(r.error_class != "none" for r in g),
                             percentile_cont(ttft, 0.5), percentile_cont(ttft, 0.95),
                             percentile_cont(tps, 0.5)))
    got_latency = [tuple(r.values()) for r in run["Latency and failures by model"]]
    requests = [g[1] for g in got_latency]
    assert requests == sorted(requests, reverse=True)
    got_latency.sort(key=lambda t: t[0])
    want_latency.sort(key=lambda t: t[0])
    assert len(got_latency) == len(want_latency)
    for got_row, want_row in zip(got_latency, want_latency, strict=True):
        assert got_row[:3] == want_row[:3]
        for g, w in zip(got_row[3:], want_row[3:], strict=True):
            assert g == w or (g is not None and w is not None and abs(g - w) < 1e-9), (
                got_row, want_row)


# ------------------------------------------------------------------------------------ tests


async def test_every_query_answers_the_rows_exactly(reader_url: str) -> None:
    dash = dashboard()
    conn = await asyncpg.connect(reader_url)
    try:
        sel = Selection(*MONTH)
        run = await run_dashboard(conn, sel)
    finally:
        await conn.close()
    assert set(run.results) == every_query(dash), "every query of the dashboard is run"

    in_month = sel.rows()
    assert len(in_month) == len(ROWS) - 2  # the next month's and the previous one's are out
    assert {name: sorted(o) for name, o in run.options.items()} == {
        "team": sorted({team_of(r) for r in in_month}),
        "user": sorted({r.user_name for r in in_month}),
        "model": sorted({model_of(r) for r in in_month}),
    }
    check_panels(run, sel)

    # The figures themselves, not only their agreement with the Python sums.
    spend = {r["team"]: r["spend"] for r in run["Spend by team (time range)"]}
    assert set(spend) == {"research", "apps", "r'n'd", "agents", NONE}
    # frank: 1,000 fresh x $3 + 10,000 read x $0.30 + 2,000 written x $3.75 + 700 out x $15,
    # then 5,000 written x $3.75 + 300 out x $15 (per million): every prompt token once.
    assert spend["agents"] == Decimal("0.024") + Decimal("0.02325")
    assert spend[NONE] == Decimal(0)  # dave: an unpriced model and a failure
    # alice-laptop: 1000 in (200 cached), 500 out; then 2000 in (1000 cached), 800 out, gpt-4o.
    laptop = next(r for r in run["Top keys"] if r["key"] == "alice-laptop")
    assert laptop["requests"] == 3
    # At $2.50 / $1.25 (cached) / $10 per million: 0.00725 + 0.01175, and the refused one 0.
    assert laptop["spend"] == Decimal("0.019")
    assert run["Refused requests (time range)"][0]["refused"] == 5  # 3 quota, 1 store, 1 upstream
    by_class: Counter[str] = Counter()
    for r in run["Refused requests by class"]:
        by_class[r["metric"]] += r["refused"]
    assert by_class == {"budget_exceeded": 3, "service_unavailable": 1, "rate_limit": 1}
    tokens = run["Tokens by type"]
    assert sum(r["reasoning"] for r in tokens) == 1300
    assert sum(r["cached input"] for r in tokens) == 16_300
    assert sum(r["cache read"] for r in tokens) == 10_000
    assert sum(r["cache write"] for r in tokens) == 7_000


async def test_variables_filter_every_panel(reader_url: str) -> None:
    conn = await asyncpg.connect(reader_url)
    try:
        # One team: the user list follows it, and every panel sees only its rows.
        research = Selection(*MONTH, chosen={"team": ("research",)})
        run = await run_dashboard(conn, research)
        assert sorted(run.options["user"]) == ["alice", "carol"]
        check_panels(run, research)
        assert {r["team"] for r in run["Spend by user and team"]} == {"research"}

        # Values with quotes, and several variables at once.
        quoted = Selection(*MONTH, chosen={"team": ("r'n'd", "apps"),
                                           "user": ("o'hara", "bob"),
                                           "model": ("gpt-4o-mini",)})
        run = await run_dashboard(conn, quoted)
        assert sorted(run.options["user"]) == ["bob", "erin", "o'hara"]
        check_panels(run, quoted)
        assert {r["user"] for r in run["Top keys"]} == {"bob", "o'hara"}
        assert [r["model"] for r in run["Spend by model (time range)"]] == ["gpt-4o-mini"]

        # No team: the (none) option selects rows whose team is NULL.
        nobody = Selection(*MONTH, chosen={"team": (NONE,)})
        run = await run_dashboard(conn, nobody)
        assert run.options["user"] == ["dave"]
        check_panels(run, nobody)
    finally:
        await conn.close()


async def test_an_empty_range_runs_every_query(reader_url: str) -> None:
    """Before the first request (or a range with no rows) the variables have no options and
    All expands to nothing: every query must still run, and the stats say 0."""
    dash = dashboard()
    conn = await asyncpg.connect(reader_url)
    try:
        empty = Selection(datetime(2020, 1, 1, tzinfo=UTC), datetime(2020, 2, 1, tzinfo=UTC))
        run = await run_dashboard(conn, empty)
    finally:
        await conn.close()
    assert set(run.results) == every_query(dash)
    assert run.options == {"team": [], "user": [], "model": []}
    check_panels(run, empty)
    assert run["Spend (time range)"][0]["spend"] == 0
    assert run["Requests (time range)"][0]["requests"] == 0


async def test_the_datasource_role_reads_and_cannot_write(reader_url: str) -> None:
    conn = await asyncpg.connect(reader_url)
    try:
        assert await conn.fetchval(f"SELECT count(*) FROM {TABLE}") == len(ROWS)
        assert await conn.fetchval("SHOW default_transaction_read_only") == "on"
        assert await conn.fetchval("SHOW statement_timeout") == "1min"
        with pytest.raises(asyncpg.ReadOnlySQLTransactionError):
            await conn.execute(f"DELETE FROM {TABLE}")
        # Read-only by its grants too, not only by that setting (which a session may change).
        await conn.execute("SET default_transaction_read_only = off")
        for statement in (f"DELETE FROM {TABLE}", f"UPDATE {TABLE} SET team = 'x'",
                          f"CREATE TABLE {TABLE}_copy (x int)"):
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute(statement)
    finally:
        await conn.close()


async def test_rows_the_proxy_wrote(
    aiohttp_server: ServerFactory, upstream: TestServer, reader_url: str, pg_url: str
) -> None:
    """The same, on rows the real proxy books through its spool and shipper: teams, a refused
    request, costs from its price table."""
    config = make_config(
        str(upstream.make_url("/v1")), store="memory",
        users={
            "alice": {"keys": [ALICE_KEY], "team": "research"},
            # Room for two requests of ~26 tokens (16 out at most), then refused.
            "bob": {"keys": [BOB_KEY], "team": "apps", "daily_tokens": 60,
                    "max_output_tokens": 16},
        },
        extra={"ledger": {"url": pg_url},
               "prices": {"mock-gpt": {"input": 2.5, "cached_input": 1.25, "output": 10.0}}},
    )
    proxy = await aiohttp_server(create_app(config))
    started = datetime.now(UTC)
    price = PRICES["gpt-4o"]  # the same figures as the config's
    expected_nanos = 0
    refusals = 0
    for key, count in ((ALICE_KEY, 3), (BOB_KEY, 4)):
        client = sdk(proxy, key)
        for _ in range(count):
            try:
                r = await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
            except openai.RateLimitError:
                refusals += 1
                continue
            assert r.usage is not None
            used = Usage(input_tokens=r.usage.prompt_tokens,
                         output_tokens=r.usage.completion_tokens)
            expected_nanos += CostLines.of(price, used).nanousd
        await client.close()
    assert refusals >= 1, "bob ran out of his quota"
    await settled(proxy.app, 7, deadline=30)
    services = proxy.app[st.SERVICES]
    assert services.ledger is not None
    assert await services.ledger.flush(30), services.ledger.health()

    owner = await asyncpg.connect(pg_url)
    try:
        mine = await owner.fetch(
            f"SELECT {', '.join(COLUMNS)} FROM {TABLE} WHERE started_at >= $1", started)
    finally:
        await owner.close()
    assert len(mine) == 7
    written = tuple(from_db(r) for r in mine)
    sel = Selection(started - timedelta(minutes=5), datetime.now(UTC) + timedelta(minutes=5),
                    source=ROWS + written)
    conn = await asyncpg.connect(reader_url)
    try:
        run = await run_dashboard(conn, sel)
    finally:
        await conn.close()
    check_panels(run, sel)
    assert sorted(run.options["team"]) == ["apps", "research"]
    assert run["Spend (time range)"][0]["spend"] == usd([expected_nanos])
    assert run["Refused requests (time range)"][0]["refused"] == refusals
    assert {(r["metric"], r["refused"]) for r in run["Refused requests by class"]} == {
        ("budget_exceeded", refusals)}


async def test_anthropic_rows_the_proxy_wrote(
    aiohttp_server: ServerFactory, upstream: TestServer, reader_url: str, pg_url: str
) -> None:
    """Rows the real proxy books for the Anthropic SDK, prompt cache read and written: the
    cache panels show them, and the spend is every prompt token at its own price."""
    config = make_config(
        str(upstream.make_url("/v1")), store="memory", api="anthropic",
        users={"frank": {"keys": [ALICE_KEY], "team": "agents"}},
        extra={"ledger": {"url": pg_url},
               "prices": {"mock-gpt": PRICES["claude-sonnet-4"].model_dump(exclude_none=True)}},
    )
    proxy = await aiohttp_server(create_app(config))
    started = datetime.now(UTC)
    cache = {"x-mock-cache-read-tokens": "4", "x-mock-cache-creation-tokens": "3"}
    prompt: list[MessageParam] = [{"role": "user", "content": " ".join(["tokens"] * 20)}]
    expected_nanos = 0
    async with anthropic.AsyncAnthropic(base_url=str(proxy.make_url("")).rstrip("/"),
                                        api_key=ALICE_KEY, max_retries=0) as client:
        message = await client.messages.create(model="mock-gpt", max_tokens=8, messages=prompt,
                                               extra_headers=cache)
        async with client.messages.stream(model="mock-gpt", max_tokens=6, messages=prompt,
                                          extra_headers=cache) as stream:
            final = await stream.get_final_message()
    for u in (message.usage, final.usage):
        assert u.input_tokens > 0
        # USD per million x 1,000 per token: fresh input, 4 reads, 3 (5-minute) writes, output.
        expected_nanos += u.input_tokens * 3_000 + 4 * 300 + 3 * 3_750 + u.output_tokens * 15_000
    await settled(proxy.app, 2, deadline=30)
    services = proxy.app[st.SERVICES]
    assert services.ledger is not None
    assert await services.ledger.flush(30), services.ledger.health()
    owner = await asyncpg.connect(pg_url)
    try:
        mine = await owner.fetch(
            f"SELECT {', '.join(COLUMNS)} FROM {TABLE} WHERE started_at >= $1", started)
    finally:
        await owner.close()
    written = tuple(from_db(r) for r in mine)
    assert [(r.operation, r.cached_input_tokens, r.cache_creation_input_tokens)
            for r in written] == [(MESSAGES_OPERATION, 4, 3)] * 2
    sel = Selection(started - timedelta(minutes=5), datetime.now(UTC) + timedelta(minutes=5),
                    source=ROWS + written)
    conn = await asyncpg.connect(reader_url)
    try:
        run = await run_dashboard(conn, sel)
    finally:
        await conn.close()
    check_panels(run, sel)
    assert run["Spend (time range)"][0]["spend"] == usd([expected_nanos])
    (frank,) = run["Spend by user and team"]
    assert (frank["team"], frank["cache read"], frank["cache write"]) == ("agents", 8, 6)
    tokens = run["Tokens by type"]
    assert (sum(r["cache read"] for r in tokens), sum(r["cache write"] for r in tokens)) == (8, 6)


def from_db(record: asyncpg.Record) -> LedgerRow:
    values = dict(record)
    for name in ("started_at", "ended_at"):
        values[name] = values[name].timestamp()
    return LedgerRow(**values)


# ---------------------------------------------------------------------- static checks


def test_dashboard_shape_and_datasource() -> None:
    dash = dashboard()
    ds = ledger_datasource()
    assert ds["type"] == "grafana-postgresql-datasource" and ds["uid"] == "tokenmeter-ledger"
    # Beside the Prometheus one, which stays the default.
    prom = yaml.safe_load((DATASOURCES / "prometheus.yml").read_text(encoding="utf-8"))
    assert [d.get("isDefault") for d in prom["datasources"]] == [True]
    assert not ds.get("isDefault")
    wanted = {"type": ds["type"], "uid": ds["uid"]}

    assert DASHBOARD.name == dash["uid"] + ".json"
    assert dash["title"].endswith("Usage and chargeback")
    assert dash["schemaVersion"] == 39 and "tokenmeter" in dash["tags"]
    names = [v["name"] for v in variables(dash)]
    assert names == ["team", "user", "model"]
    for var in variables(dash):
        assert var["type"] == "query" and var["datasource"] == wanted
        assert var["includeAll"] is True and var["multi"] is True
        assert "allValue" not in var, "All must expand to the options (NULL-safe, quoted)"
        assert var["refresh"] == 2, "options follow the time range"
    ids: set[int] = set()
    titles: set[str] = set()
    for panel in panels(dash):
        assert panel["id"] not in ids
        ids.add(panel["id"])
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"])
        if panel["type"] == "row":
            continue
        assert panel["title"] not in titles
        titles.add(panel["title"])
        assert panel["datasource"] == wanted, panel["title"]
        assert len(panel["targets"]) == 1
        for t in panel["targets"]:
            assert t["datasource"] == wanted and t["rawQuery"] is True
            assert t["editorMode"] == "code"
            assert t["format"] == ("time_series" if panel["type"] == "timeseries" else "table")
    assert {"Spend by team (time range)", "Spend by user (time range)",
            "Spend by model (time range)", "Top keys", "Tokens by type", "Cost per day by team",
            "Refused requests by class"} <= titles


def test_every_query_filters_on_time_and_every_variable() -> None:
    """A panel that forgot a filter would show the wrong figures as soon as one is set."""
    for t in targets(dashboard()):
        assert "$__timeFilter(started_at)" in t.sql, t.panel
        for name in ("team", "user", "model"):
            # ANY(ARRAY[...]): an empty option list (All over no rows) is still valid SQL.
            assert f"= ANY(ARRAY[${name}]::text[])" in t.sql, (t.panel, name)
        assert f"FROM {TABLE}" in t.sql


def test_error_classes_in_the_sql_are_error_class_values() -> None:
    members = {e.value for e in ErrorClass}
    literals: set[str] = set()
    for t in targets(dashboard()):
        for m in re.finditer(r"error_class\s*(?:=|<>|!=)\s*'([^']*)'", t.sql):
            literals.add(m[1])
        for m in re.finditer(r"error_class\s+(?:NOT\s+)?IN\s*\(([^)]*)\)", t.sql):
            literals.update(re.findall(r"'([^']*)'", m[1]))
    assert literals, "the refusal panels match on error_class"
    assert literals <= members, literals - members
    assert {c.value for c in REFUSED_CLASSES} <= literals
