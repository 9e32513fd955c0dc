"""`tokenmeter reconcile`: the ledger's totals against the budget store's counters, with requests
charged through the real Budget on a real redis-server, rows in SQLite or a real PostgreSQL.

Each test's time zone puts the local time near noon (an `Etc/GMT` zone picked at run time), so
the day's windows cannot change under a test running at midnight."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import asyncpg
import pytest
from aiohttp.test_utils import TestServer
from prometheus_client import generate_latest

from proxy.budget import limits as lim
from proxy.budget.accounting import Budget, Reservation
from proxy.budget.admission import Ask
from proxy.budget.notify import Notifier
from proxy.budget.principal import Principal
from proxy.budget.store import MemoryStore, ScopeKind, Store, WindowAmount
from proxy.budget.store_redis import RedisStore
from proxy.cli import main
from proxy.config.ledger import LedgerConfig
from proxy.config.load import Config
from proxy.cost import CostLines, price_for
from proxy.ledger.query import LedgerReader, LedgerUnavailable, Location, locate, open_reader
from proxy.ledger.row import LedgerRow
from proxy.ledger.schema import TABLE
from proxy.pipeline import services as st
from proxy.protocol.usage import Usage
from proxy.reconcile.audit import Auditor
from proxy.reconcile.plan import Reconciliation, Verdict, reconcile
from proxy.server.app import create_app
from proxy.telemetry.metrics import Metrics
from tests.books import write_postgres, write_sqlite
from tests.helpers import (
    ALICE_KEY,
    BOB_KEY,
    MESSAGES,
    FakeClock,
    ServerFactory,
    make_config,
    sdk,
    settled,
    until,
)

ALICE = "sk-alice-reconcile-0001"
ALICE_CI = "sk-alice-ci-reconcile-0002"
BOB = "sk-bob-reconcile-0003"
CAROL = "sk-carol-reconcile-0004"
DAVE = "sk-dave-reconcile-0005"


def noon_zone() -> str:
    """A fixed-offset zone where it is now between 12:00 and 13:00."""
    offset = 12 - datetime.now(UTC).hour  # -11 .. 12
    if offset == 0:
        return "Etc/GMT"
    return f"Etc/GMT{-offset:+d}"  # POSIX sign: Etc/GMT-3 is UTC+3


def config_data(store: str, ledger_url: str, zone: str, **store_opts: Any) -> dict[str, Any]:
    return {
        "timezone": zone,
        "upstreams": {"mock": {"base_url": "http://127.0.0.1:9/v1"}},
        "models": [{"match": "*", "upstream": "mock"}],
        "store": {"url": store, "lease_seconds": 30, "timeout_ms": 5000, **store_opts},
        "ledger": {"url": ledger_url},
        "prices": {"gpt-4o": {"input": 2.5, "output": 10.0, "cached_input": 1.25}},
        "teams": {"platform": {"weekly_tokens": 1_000_000}},
        "users": {
            "alice": {"team": "platform", "keys": [
                ALICE, {"key": ALICE_CI, "name": "ci", "daily_tokens": 100_000}]},
            "bob": {"team": "platform", "keys": [BOB]},
            "carol": {"keys": [CAROL], "model_limits": {"o1*": {"daily_tokens": 100_000}}},
            "dave": {"keys": [DAVE], "daily_usd": 5.0, "monthly_tokens": 10_000_000},
        },
    }


# --- the ledger, written as the sinks do ---------------------------------------------------------

@dataclass
class Books:
    url: str

    async def write(self, rows: Sequence[LedgerRow]) -> None:
        if self.url.startswith("sqlite"):
            await asyncio.to_thread(write_sqlite, Path(self.url.removeprefix("sqlite://")),
                                    rows)
            return
        await write_postgres(self.url, rows)


@pytest.fixture(params=["sqlite", "postgresql"])
async def books(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Books]:
    if request.param == "sqlite":
        b = Books(f"sqlite://{tmp_path / 'books.sqlite3'}")
        await b.write([])
        yield b
        return
    name = f"tm_reconcile_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect("postgresql://postgres@127.0.0.1:5432/postgres")
    try:
        await admin.execute(f"CREATE DATABASE {name}")
    finally:
        await admin.close()
    b = Books(f"postgresql://postgres@127.0.0.1:5432/{name}")
    await b.write([])
    yield b
    admin = await asyncpg.connect("postgresql://postgres@127.0.0.1:5432/postgres")
    try:
        await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    finally:
        await admin.close()


@pytest.fixture
async def sqlite_books(tmp_path: Path) -> Books:
    b = Books(f"sqlite://{tmp_path / 'books.sqlite3'}")
    await b.write([])
    return b


# --- requests, charged as the proxy charges them ------------------------------------------------

@dataclass
class World:
    config: Config
    budget: Budget
    books: Books
    path: Path  # the config as a file, for the command

    def principal(self, user: str, key: str | None = None) -> Principal:
        cfg = self.config.users[user]
        key_cfg = next((k for k in cfg.key_configs() if k.name == key), None) if key else None
        return Principal(user, lim.limits_for(self.config, user, key_cfg, key), team=cfg.team,
                         key_name=key)

    async def request(self, user: str, *, key: str | None = None, model: str = "gpt-4o",
                      prompt: int = 20, usage: Usage | None = None, settle: bool = True,
                      book: bool = True) -> Reservation:
        """Reserve, settle and write the row, as admission, settle and the ledger do."""
        usage = usage or Usage(input_tokens=prompt, output_tokens=7, cached_input_tokens=4)
        principal = self.principal(user, key)
        plan = self.budget.plan(principal, model, self.config)
        ask = Ask(principal=principal, model=model, plan=plan, prompt_tokens=prompt,
                  asked_output=64, choices=1, stream=False, hidden_output=False)
        reservation = await self.budget.reserve(ask, self.config)
        if settle:
            cost = None if plan.price is None else CostLines.of(plan.price, usage)
            await self.budget.settle(reservation, usage, cost)
        if book:
            await self.book(user, plan, usage, key=key, model=model)
        return reservation

    async def book(self, user: str, plan: lim.Plan, usage: Usage, *, key: str | None = None,
                   model: str = "gpt-4o", at: float | None = None) -> None:
        """The request's ledger row: its windows are the labels of the plan's counters."""
        price = price_for(self.config.prices, model)
        end = time.time() if at is None else at
        await self.books.write([LedgerRow(
            request_id=uuid.uuid4().hex, started_at=end - 0.2, ended_at=end, replica="r1",
            user_name=user, key_name=key, team=self.config.users[user].team,
            operation="chat", requested_model=model, model=model,
            response_model=model, upstream="mock", fallback_from=None, attempts=1,
            status=200, error_class="none", stream=True, input_tokens=usage.input_tokens,
            output_tokens=usage.output_tokens, cached_input_tokens=usage.cached_input_tokens,
            reasoning_tokens=0, token_source="reported", ttft_ms=1.0, upstream_ttft_ms=1.0,
            overhead_ms=0.1, duration_ms=200.0, output_tokens_per_s=35.0,
            cost_nanousd=None if price is None else CostLines.of(price, usage).nanousd,
            price_version="p1" if price is not None else None,
            windows=" ".join(w.label for w in plan.windows),
        )])

    async def reconcile(self, day: date | None = None,
                        earlier: Reconciliation | None = None) -> Reconciliation:
        async with await open_reader(self.location) as reader:
            return await reconcile(self.config, self.budget.store, reader,
                                   day or self.today, earlier)

    @property
    def location(self) -> Location:
        return locate(self.config.ledger)

    @property
    def today(self) -> date:
        return datetime.now(ZoneInfo(self.config.timezone)).date()


def make_world(store: Store, books: Books, tmp_path: Path, **store_opts: Any) -> World:
    url = "memory" if isinstance(store, MemoryStore) else store_opts.pop("url")
    data = config_data(url, books.url, noon_zone(), **store_opts)
    path = tmp_path / "tm.json"
    path.write_text(json.dumps(data))  # JSON is YAML
    config = Config.model_validate(data)
    metrics = Metrics()
    budget = Budget(store, metrics, Notifier(metrics, lambda: [], lambda: None, lambda: None))
    return World(config, budget, books, path)


@pytest.fixture
async def world(redis_url: str, books: Books, tmp_path: Path) -> AsyncIterator[World]:
    store = RedisStore(redis_url, 5000)
    yield make_world(store, books, tmp_path, url=redis_url)
    await store.close()


def by_label(r: Reconciliation, user: str | None, label_start: str) -> list[Any]:
    return [c for c in r.checks if c.user == user and c.label.startswith(label_start)]


async def run_command(world: World, capsys: pytest.CaptureFixture[str],
                      *args: str) -> tuple[int, str]:
    code = await asyncio.to_thread(main, ["reconcile", "--config", str(world.path),
                                          "--recheck", "0", *args])
    return code, capsys.readouterr().out


# --- the tests -----------------------------------------------------------------------------------

async def test_ledger_and_store_agree(world: World, capsys: pytest.CaptureFixture[str]) -> None:
    await world.request("alice")
    await world.request("alice", key="ci", usage=Usage(input_tokens=100, output_tokens=50))
    await world.request("bob", usage=Usage(input_tokens=3, output_tokens=1000))
    await world.request("carol", model="o1-mini")  # no price: its cost is not counted
    await world.request("carol", model="gpt-4o")
    await world.request("dave", usage=Usage(input_tokens=1000, output_tokens=2000,
                                            cached_input_tokens=500))
    r = await world.reconcile()
    assert r.agrees and not r.orphans, [c for c in r.checks if c.verdict is not Verdict.AGREES]
    assert {c.verdict for c in r.checks} == {Verdict.AGREES}
    day = world.today.strftime("%Y%m%d")
    (alice,) = by_label(r, "alice", f"u:daily_tokens:{day}")
    assert alice.ledger == alice.store == 27 + 150 and alice.team == "platform"
    (ci,) = by_label(r, "alice", "k.ci:daily_tokens")
    assert ci.ledger == ci.store == 150
    (team,) = by_label(r, None, "t.platform:weekly_tokens")
    assert team.ledger == team.store == 27 + 150 + 1003 and team.team == "platform"
    (group,) = by_label(r, "carol", "m.o1*:daily_tokens")
    assert group.ledger == group.store == 27
    (cost,) = by_label(r, "dave", "u:daily_usd")
    price = world.config.prices["gpt-4o"]
    assert cost.measure == "cost"
    assert cost.ledger == cost.store == CostLines.of(price, Usage(
        input_tokens=1000, output_tokens=2000, cached_input_tokens=500)).nanousd > 0
    (monthly,) = by_label(r, "dave", "u:monthly_tokens")
    assert monthly.ledger == monthly.store == 3000
    assert set(r.drift_by_window().values()) == {0}
    code, out = await run_command(world, capsys)
    assert code == 0, out
    assert "t.platform" in out and "agree:" in out and "DRIFT" not in out
    # Cost windows speak USD (the store's nano-dollars are not what people read).
    dollars = f"${Decimal(cost.ledger).scaleb(-9):.9f}"
    (line,) = [ln for ln in out.splitlines() if ln.startswith("dave ") and "daily_usd" in ln]
    assert "cost (USD)" in line and line.count(dollars) == 2, out
    assert f"{cost.ledger:,}" not in out
    code, out = await run_command(world, capsys, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["agrees"] is True and doc["orphans"] == []
    (usd,) = [w for w in doc["windows"] if w["user"] == "dave" and w["scope"] == "u"
              and w["window"] == "daily_usd"]
    assert usd["unit"] == "usd" and usd["ledger"] == cost.ledger
    assert usd["ledger_usd"] == usd["store_usd"] == dollars[1:]
    assert {w["verdict"] for w in doc["windows"]} == {"agrees"}
    assert doc["date"] == world.today.isoformat() and doc["ledger_newest"] is not None


async def test_requests_in_flight_explain_the_difference(
    world: World, capsys: pytest.CaptureFixture[str]
) -> None:
    await world.request("alice")
    held = await world.request("alice", prompt=30, settle=False, book=False)
    r = await world.reconcile()
    (alice,) = by_label(r, "alice", "u:daily_tokens")
    assert (alice.ledger, alice.store, alice.in_flight) == (27, 27 + 94, 94)
    assert alice.verdict is Verdict.IN_FLIGHT and alice.unexplained == 0
    assert r.agrees and not r.orphans  # its lease runs
    assert (await run_command(world, capsys))[0] == 0
    # Settled, its row never written: in one reading, a row that may be on its way; still
    # missing a reading later, drift.
    await world.budget.settle(held, Usage(input_tokens=30, output_tokens=9), None)
    first = await world.reconcile()
    (alice,) = by_label(first, "alice", "u:daily_tokens")
    assert alice.store == 27 + 39 and alice.verdict is Verdict.BEHIND and first.agrees
    r = await world.reconcile(earlier=first)
    (alice,) = by_label(r, "alice", "u:daily_tokens")
    assert alice.verdict is Verdict.DRIFT and alice.unexplained == -39
    assert r.drift_by_window()["daily_tokens"] == -39 * 2  # alice's and her team's


async def test_drift_either_way_fails_the_command(
    world: World, capsys: pytest.CaptureFixture[str]
) -> None:
    await world.request("bob")
    await world.request("bob", book=False)  # charged, its row lost
    r = await world.reconcile()
    (bob,) = by_label(r, "bob", "u:daily_tokens")
    assert (bob.ledger, bob.store, bob.verdict) == (27, 54, Verdict.BEHIND)
    r = await world.reconcile(earlier=r)
    (bob,) = by_label(r, "bob", "u:daily_tokens")
    assert bob.verdict is Verdict.DRIFT
    (team,) = by_label(r, None, "t.platform:daily_tokens")
    assert team.unexplained == -27
    assert r.drift_by_window()["daily_tokens"] == -27 * 2  # bob's and the team's
    code, out = await run_command(world, capsys)
    assert code == 1 and "DRIFT: 7 of" in out  # 3 of bob's, 3 daily + 1 weekly of the team
    # The other way on carol: a row whose reservation was given back whole, so the books hold
    # tokens the store did not charge. Per window name the larger side is reported: opposite
    # drifts never cancel to 0.
    await world.budget.release(await world.request("carol", settle=False))
    code, out = await run_command(world, capsys, "--json")
    doc = json.loads(out)
    assert code == 1 and doc["agrees"] is False
    drifts = {(w["user"], w["scope"], w["window"]): w["unexplained"] for w in doc["windows"]
              if w["verdict"] == "drift"}
    assert drifts[("bob", "u", "daily_tokens")] == -27
    assert drifts[(None, "t.platform", "daily_tokens")] == -27
    assert drifts[("carol", "u", "daily_tokens")] == 27
    assert drifts[("carol", "u", "daily_output_tokens")] == 7
    assert doc["drift_by_window"]["daily_tokens"] == -54
    assert doc["drift_by_window"]["daily_output_tokens"] == -14  # -7 -7 against +7
    # An in-flight request explains a store above the books by what it holds, never books
    # above what the store settled: the 27 tokens the store lost stay drift (on main they
    # passed as "in flight").
    await world.request("carol", settle=False, book=False)
    (carol,) = by_label(await world.reconcile(), "carol", "u:daily_tokens")
    assert (carol.ledger, carol.store, carol.in_flight) == (27, 84, 84)
    assert carol.verdict is Verdict.DRIFT and carol.unexplained == 27


async def test_orphans_are_listed_and_explained(
    redis_url: str, sqlite_books: Books, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = RedisStore(redis_url, 5000)
    w = make_world(store, sqlite_books, tmp_path, url=redis_url, lease_seconds=0.001)
    try:
        await w.request("alice")
        dead = await w.request("alice", settle=False, book=False)  # its proxy "died"

        async def orphaned() -> bool:
            return bool((await w.reconcile()).orphans)

        await until(orphaned)
        r = await w.reconcile()
        (orphan,) = r.orphans
        assert orphan.res_id == dead.res_id and orphan.slot.endswith("{t:platform}")
        held = dict(orphan.held)
        assert held[f"alice:u:daily_tokens:{w.today.strftime('%Y%m%d')}"] == 84
        assert r.agrees  # what it holds explains the store's excess
        (alice,) = by_label(r, "alice", "u:daily_tokens")
        assert alice.verdict is Verdict.IN_FLIGHT and alice.in_flight == 84
        code, out = await run_command(w, capsys)
        assert code == 0 and "orphans (reservations held past their lease): 1" in out
        assert dead.res_id in out
        code, out = await run_command(w, capsys, "--json")
        assert json.loads(out)["orphans"][0]["reservation"] == dead.res_id
        metrics = Metrics()
        metrics.reconciled(r.drift_by_window(), len(r.orphans))
        text = generate_latest(metrics.registry).decode()
        assert "tokenmeter_reconcile_orphans 1.0" in text
        assert 'tokenmeter_reconcile_drift_tokens{window="daily_tokens"} 0.0' in text
        # The team's next reservation reaps it: agreement without anything in flight.
        await w.request("bob")
        r = await w.reconcile()
        assert not r.orphans and r.agrees
        assert {c.verdict for c in r.checks} == {Verdict.AGREES}
    finally:
        await store.close()


async def test_a_second_reading_confirms_drift(world: World) -> None:
    await world.request("alice", book=False)
    first = await world.reconcile()
    assert first.agrees and first.behind  # one reading cannot tell a row on its way from loss
    assert not first.single().agrees  # judged alone (--recheck 0), it is drift
    # The row lands between the readings (it was on its way): no drift.
    plan = world.budget.plan(world.principal("alice"), "gpt-4o", world.config)
    await world.book("alice", plan, Usage(input_tokens=20, output_tokens=7,
                                          cached_input_tokens=4))
    second = await world.reconcile(earlier=first)
    assert second.agrees and not second.behind
    # A row missing in the second reading only is on its way; still missing, drift.
    await world.request("bob", book=False)
    third = await world.reconcile(earlier=second)
    assert third.agrees
    assert {c.verdict for c in third.checks if c.user == "bob"} >= {Verdict.BEHIND}
    fourth = await world.reconcile(earlier=third)
    assert not fourth.agrees
    # Books over the store: pending in the first reading that shows it, drift in both.
    await world.budget.release(await world.request("carol", settle=False))
    fifth = await world.reconcile(earlier=fourth)
    assert {c.verdict for c in fifth.checks if c.user == "carol"} >= {Verdict.PENDING}
    sixth = await world.reconcile(earlier=fifth)
    assert {c.verdict for c in sixth.checks if c.user == "carol"} >= {Verdict.DRIFT}


async def test_the_in_process_audit_reports_a_persisting_drift_at_every_reading(
    world: World
) -> None:
    """A counter edited up by 700 and left so: every reading the audit exports says -700, the
    difference, never the whole counter (on main the third and later readings said the day's
    total, 700 + the rows', as if no row had reached the ledger)."""
    for _ in range(3):
        await world.request("bob")
    plan = world.budget.plan(world.principal("bob"), "gpt-4o", world.config)
    daily = next(w for w in plan.windows
                 if w.name is lim.WindowName.DAILY_TOKENS and w.scope.kind is ScopeKind.USER)
    await world.budget.store.add_once(plan.slot, "hand-edit", [WindowAmount(daily.key, None, 700,
                                                                     daily.ttl_s)])
    metrics = Metrics()
    auditor = Auditor(world.budget.store, metrics)
    gauge: list[float | None] = []
    try:
        for _ in range(5):
            judged = await auditor.once(world.config)
            assert judged is not None
            gauge.append(metrics.registry.get_sample_value(
                "tokenmeter_reconcile_drift_tokens", {"window": "daily_tokens"}))
            (bob,) = by_label(judged, "bob", "u:daily_tokens")
            assert bob.store == 3 * 27 + 700
    finally:
        await auditor.close()
    # The first reading exports nothing (one reading cannot tell lag from loss).
    assert gauge == [None, -700, -700, -700, -700]


async def test_a_row_deleted_by_hand_is_drift_to_the_deep_reconcile(
    world: World, capsys: pytest.CaptureFixture[str]
) -> None:
    """The rollup keeps a row deleted by hand (the sinks keep it, not the database), so the
    usual reading still agrees; `--deep` sums the rows and reports the missing one."""
    for _ in range(2):
        await world.request("bob")
    gone = f"DELETE FROM {TABLE} WHERE request_id = (SELECT min(request_id) FROM {TABLE})"
    if world.books.url.startswith("sqlite"):
        def delete() -> None:
            with sqlite3.connect(world.books.url.removeprefix("sqlite://")) as conn:
                assert conn.execute(gone).rowcount == 1

        await asyncio.to_thread(delete)
    else:
        conn = await asyncpg.connect(world.books.url)
        try:
            assert await conn.execute(gone) == "DELETE 1"
        finally:
            await conn.close()
    code, out = await run_command(world, capsys)
    assert code == 0, out  # the rollup still counts it
    code, out = await run_command(world, capsys, "--deep", "--json")
    doc = json.loads(out)
    assert code == 1 and doc["agrees"] is False
    drifts = {(w["user"], w["scope"], w["window"]): w["unexplained"] for w in doc["windows"]
              if w["verdict"] == "drift"}
    assert drifts[("bob", "u", "daily_tokens")] == -27
    assert drifts[(None, "t.platform", "daily_tokens")] == -27
    # Judged with a second reading too (the command's default): still drift, by the row.
    code, out = await asyncio.to_thread(main, ["reconcile", "--config", str(world.path),
                                               "--recheck", "0.01", "--deep"]), \
        capsys.readouterr().out
    assert code == 1 and "(its rows: --deep)" in out and "DRIFT" in out


async def test_windows_past_retention_are_not_judged(
    world: World, capsys: pytest.CaptureFixture[str]
) -> None:
    old = world.today - timedelta(days=20)
    tz = ZoneInfo(world.config.timezone)
    noon = datetime(old.year, old.month, old.day, 12, tzinfo=tz).timestamp()
    plan = lim.plan(world.config, "carol", world.principal("carol").limits, "gpt-4o", noon)
    await world.book("carol", plan, Usage(input_tokens=20, output_tokens=7), at=noon)
    r = await world.reconcile(old)
    (carol,) = by_label(r, "carol", "u:daily_tokens")
    assert carol.ledger == 27 and carol.store == 0 and carol.verdict is Verdict.EXPIRED
    assert r.agrees
    code, out = await run_command(world, capsys, "--date", old.isoformat())
    assert code == 0 and "expired" in out


async def test_the_in_process_store(sqlite_books: Books, tmp_path: Path) -> None:
    clock = FakeClock(time.time())
    store = MemoryStore(clock)
    w = make_world(store, sqlite_books, tmp_path, lease_seconds=60)
    w.budget.clock = clock
    await w.request("dave")
    await w.request("alice", key="ci")
    dead = await w.request("alice", settle=False, book=False)
    r = await w.reconcile()
    assert r.agrees and not r.orphans
    clock.now += 61
    r = await w.reconcile()
    assert [o.res_id for o in r.orphans] == [dead.res_id] and r.agrees


async def test_cannot_reconcile_exits_2(
    redis_url: str, sqlite_books: Books, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    zone = noon_zone()
    cases = {
        "memory": config_data("memory", sqlite_books.url, zone),
        "no redis": config_data("redis://127.0.0.1:1/0", sqlite_books.url, zone),
        "no ledger": config_data(redis_url, f"sqlite://{tmp_path / 'none.sqlite3'}", zone),
        "ledger off": {**config_data(redis_url, sqlite_books.url, zone),
                       "ledger": {"enabled": False}},
    }
    for name, data in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(data))
        code = await asyncio.to_thread(main, ["reconcile", "--config", str(path)])
        assert code == 2, name
        assert capsys.readouterr().err, name
    path = tmp_path / "ledger off.json"
    code = await asyncio.to_thread(main, ["reconcile", "--config", str(path), "--ledger",
                                          sqlite_books.url, "--date", "2026-13-01"])
    assert code == 2


@pytest.mark.parametrize("statement", [f"DELETE FROM {TABLE}", "CREATE TABLE t (x int)"])
async def test_the_ledger_is_opened_read_only(books: Books, statement: str) -> None:
    reader: LedgerReader
    async with await open_reader(locate(LedgerConfig(url=books.url))) as reader:
        with pytest.raises(LedgerUnavailable, match=r"readonly|read-only"):
            await reader.fetch(statement)
        assert await reader.fetch(f"SELECT count(*) FROM {TABLE}") == [(0,)]


async def test_the_real_proxy_books_agree_with_its_store(
    aiohttp_server: ServerFactory, upstream: TestServer, redis_url: str, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Rows the proxy itself booked (its settle's window labels, its spool and shipper)."""
    books = f"sqlite://{tmp_path / 'proxy-books.sqlite3'}"
    users = {"alice": {"keys": [ALICE_KEY], "team": "blue", "daily_tokens": 1_000_000},
             "bob": {"keys": [BOB_KEY], "monthly_tokens": 1_000_000}}
    config = make_config(str(upstream.make_url("/v1")), store=redis_url, users=users,
                         extra={"ledger": {"url": books}, "timezone": noon_zone(),
                                "teams": {"blue": {"weekly_tokens": 1_000_000}}})
    proxy = await aiohttp_server(create_app(config))
    for key in (ALICE_KEY, BOB_KEY, ALICE_KEY):
        await sdk(proxy, key).chat.completions.create(model="mock-gpt", messages=MESSAGES)
    stream = await sdk(proxy, BOB_KEY).chat.completions.create(
        model="mock-gpt", messages=MESSAGES, stream=True)
    async for _ in stream:
        pass
    await settled(proxy.app, 4, deadline=30)
    svc = proxy.app[st.SERVICES]
    assert svc.ledger is not None and await svc.ledger.flush(30)
    path = tmp_path / "tm.json"
    path.write_text(config.model_dump_json(exclude_none=True))
    code = await asyncio.to_thread(main, ["reconcile", "--config", str(path), "--recheck", "0",
                                          "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0, [w for w in doc["windows"] if w["verdict"] != "agrees"]
    windows = {(w["user"], w["scope"], w["window"]): w for w in doc["windows"]}
    assert windows[("alice", "u", "daily_tokens")]["ledger"] > 0
    assert windows[(None, "t.blue", "weekly_tokens")]["ledger"] == (
        windows[("alice", "u", "daily_tokens")]["ledger"])
    assert windows[("bob", "u", "monthly_tokens")]["store"] > 0
    assert {w["verdict"] for w in doc["windows"]} == {"agrees"}
