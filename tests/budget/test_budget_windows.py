"""Weekly, monthly, cost and team windows enforced by real proxies over loopback, raced by the
real openai SDK: on the in-process store, and on a real redis-server shared by two replicas."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo

import openai
import pytest
from aiohttp.test_utils import TestServer

from proxy.budget import limits as lim
from proxy.budget.store import ScopeKind
from proxy.budget.usage_report import read_usage, today
from proxy.config.policy import Price
from proxy.cost import NANOS_PER_USD, CostLines
from proxy.pipeline import services as st
from proxy.protocol.usage import Usage
from proxy.server.app import create_app
from proxy.testing.mock_upstream import MOCK_STATE, MockSettings
from tests.helpers import (
    ALICE_KEY,
    BOB_KEY,
    CI_KEY,
    MESSAGES,
    FakeClock,
    ServerFactory,
    ask_usage,
    make_config,
    sample,
    scrape,
    sdk,
    until,
)

# Cached input at its own price, so a settled cost differs from the reserved worst case.
CACHED = 4
PRICES = {"mock-gpt": {"input": 1.0, "output": 2.0, "cached_input": 0.5}}
PRICE = Price(input=1.0, output=2.0, cached_input=0.5)


@pytest.fixture
def mock_settings() -> MockSettings:
    return MockSettings(tokens_per_second=0, ttft_ms=5, output_tokens=16, cached_tokens=CACHED)


Factory = Callable[..., Awaitable[list[TestServer]]]


@pytest.fixture
def make_proxies(aiohttp_server: ServerFactory, upstream: TestServer, store_url: str) -> Factory:
    """Two replicas sharing one budget through Redis; the in-process store is one replica's
    own, so on it there is one."""

    async def make(users: dict[str, Any], clock: FakeClock | None = None,
                   **extra: Any) -> list[TestServer]:
        config = make_config(str(upstream.make_url("/v1")), store=store_url, users=users,
                             extra={"prices": PRICES, **extra})
        kwargs: dict[str, Any] = {} if clock is None else {"clock": clock}
        replicas = 1 if store_url == "memory" else 2
        return [await aiohttp_server(create_app(config, **kwargs)) for _ in range(replicas)]

    return make


@dataclass(frozen=True)
class Served:
    key: str
    input: int
    cached: int
    output: int

    @property
    def tokens(self) -> int:
        return self.input + self.output

    @property
    def cost(self) -> int:
        usage = Usage(input_tokens=self.input, output_tokens=self.output,
                      cached_input_tokens=self.cached)
        return CostLines.of(PRICE, usage).nanousd


async def _ask(client: openai.AsyncOpenAI, key: str, stream: bool) -> Served:
    prompt, cached, completion = await ask_usage(client, stream)
    return Served(key, prompt, cached, completion)


async def _race(proxies: list[TestServer], keys: list[str], n: int
                ) -> tuple[list[Served], list[openai.RateLimitError]]:
    """`n` requests at once, spread over the replicas and keys, streamed and not."""
    clients = {(i, k): sdk(p, k) for i, p in enumerate(proxies) for k in keys}
    calls = []
    for j in range(n):
        key = keys[j % len(keys)]
        client = clients[((j // len(keys)) % len(proxies), key)]
        calls.append(_ask(client, key, stream=j % 3 != 0))
    results = await asyncio.gather(*calls, return_exceptions=True)
    for c in clients.values():
        await c.close()
    served = [r for r in results if isinstance(r, Served)]
    refused = [r for r in results if not isinstance(r, Served)]
    for exc in refused:
        assert isinstance(exc, openai.RateLimitError), repr(exc)
    for p in proxies:
        assert sample(await scrape(p), "tokenmeter_store_errors_total") == 0
    return served, [r for r in refused if isinstance(r, openai.RateLimitError)]


async def _counters(proxy: TestServer, user: str) -> dict[str, int]:
    """The store's calendar counters of `user` (and team) by label, as reconcile reads them."""
    budget = proxy.app[st.SERVICES].budget
    config = proxy.app[st.SERVICES].runtime.current.config
    windows = lim.windows_at(config, user, budget.clock())
    values = await budget.store.read([w.key for w in windows])
    return {w.label: v for w, v in zip(windows, values, strict=True)}


def _label(proxy: TestServer, user: str, name: str, kind: ScopeKind = ScopeKind.USER) -> str:
    budget = proxy.app[st.SERVICES].budget
    config = proxy.app[st.SERVICES].runtime.current.config
    return next(w.label for w in lim.windows_at(config, user, budget.clock())
                if w.name == name and w.scope.kind is kind)


async def _settled_to(proxy: TestServer, user: str, expected: dict[str, int]) -> None:
    """Responses end after their settlement; poll anyway, with a deadline, rather than trust
    the order of two servers' writes."""

    async def matches() -> bool:
        counters = await _counters(proxy, user)
        return all(counters[label] == value for label, value in expected.items())

    try:
        await until(matches, deadline=10)
    except TimeoutError:
        assert await _counters(proxy, user) == expected  # shows the difference


def _assert_quota_refusal(exc: openai.RateLimitError, code: str) -> None:
    assert exc.status_code == 429 and exc.code == code
    assert exc.response.headers["x-should-retry"] == "false"
    assert int(exc.response.headers["retry-after"]) >= 1
    assert isinstance(exc.body, dict) and exc.body["type"] == "insufficient_quota"


# --- tokens over a week and a month --------------------------------------------------------------
@pytest.mark.parametrize(("window", "code"), [("weekly_tokens", "weekly_quota_exceeded"),
                                              ("monthly_tokens", "monthly_quota_exceeded")])
async def test_weekly_and_monthly_quotas_hold_under_a_race(
    make_proxies: Factory, window: str, code: str
) -> None:
    limit = 1200
    proxies = await make_proxies(
        {"alice": {"keys": [ALICE_KEY], window: limit, "max_output_tokens": 20}},
        timezone="Europe/Berlin",
    )
    served, refused = await _race(proxies, [ALICE_KEY], 120)
    assert served and refused, (len(served), len(refused))
    used = sum(s.tokens for s in served)
    assert used <= limit  # zero tokens over
    for exc in refused:
        _assert_quota_refusal(exc, code)
        assert f"{window.partition('_')[0].capitalize()} tokens limit reached" in exc.message
    await _settled_to(proxies[0], "alice", {_label(proxies[0], "alice", window): used})


# --- cost ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("window", "code"), [("daily_usd", "daily_budget_exceeded"),
                                              ("monthly_usd", "monthly_budget_exceeded")])
async def test_cost_budgets_hold_to_the_nanodollar_under_a_race(
    make_proxies: Factory, window: str, code: str
) -> None:
    # 40,000 nano-dollars a request (10 input tokens, 4 of them cached, 16 output), 50,000
    # reserved (20 output tokens, no input cached): room for 40 to 50 of 120.
    budget_usd = 0.002
    proxies = await make_proxies(
        {"alice": {"keys": [ALICE_KEY], window: budget_usd, "max_output_tokens": 20}},
    )
    served, refused = await _race(proxies, [ALICE_KEY], 120)
    assert served and refused, (len(served), len(refused))
    assert all(s.cached == CACHED for s in served)
    spent = sum(s.cost for s in served)
    assert spent <= 2_000_000  # zero nano-dollars over
    for exc in refused:
        _assert_quota_refusal(exc, code)
        assert "cost budget reached for user 'alice'" in exc.message
        assert "of $0.002 left" in exc.message
    # Settled at the real cost (cached input at its price), not the reserved worst case.
    await _settled_to(proxies[0], "alice", {_label(proxies[0], "alice", window): spent})
    headers = refused[0].response.headers
    assert headers[f"x-ratelimit-limit-usd-{'day' if window == 'daily_usd' else 'month'}"] == (
        "0.002")


async def test_a_model_without_a_price_is_refused_while_a_cost_budget_applies(
    make_proxies: Factory, upstream: TestServer
) -> None:
    users = {"alice": {"keys": [ALICE_KEY], "daily_usd": 1},
             "bob": {"keys": [BOB_KEY], "daily_tokens": 10_000}}
    proxies = await make_proxies(users)
    alice, bob = sdk(proxies[0], ALICE_KEY), sdk(proxies[0], BOB_KEY)
    with pytest.raises(openai.RateLimitError) as err:
        await alice.chat.completions.create(model="free-model", messages=MESSAGES)
    assert err.value.code == "model_not_priced"
    assert err.value.response.headers["x-should-retry"] == "false"
    assert "`free-model` has no price" in err.value.message
    assert upstream.app[MOCK_STATE].requests == []  # it never went upstream
    # A priced model is served; an unpriced one is, for a user without a cost budget.
    await alice.chat.completions.create(model="mock-gpt", messages=MESSAGES)
    await bob.chat.completions.create(model="free-model", messages=MESSAGES)
    m = await scrape(proxies[0])
    assert sample(m, "tokenmeter_budget_refusals_total", user="alice", limit="daily_usd") == 1
    for c in (alice, bob):
        await c.close()


# --- teams --------------------------------------------------------------------------------------
async def test_a_teams_users_together_never_exceed_the_teams_quota(make_proxies: Factory) -> None:
    """alice (with a key of her own limits) and bob share a team; carol is in no team. The
    team's, each user's and the key's windows are reserved together, all or nothing."""
    team_tokens, alice_tokens, ci_week = 2400, 1600, 500
    users = {
        "alice": {"team": "platform", "daily_tokens": alice_tokens, "max_output_tokens": 20,
                  "keys": [ALICE_KEY, {"key": CI_KEY, "name": "ci", "weekly_tokens": ci_week}]},
        "bob": {"team": "platform", "keys": [BOB_KEY], "max_output_tokens": 20},
    }
    teams = {"platform": {"daily_tokens": team_tokens, "monthly_usd": 0.5}}
    proxies = await make_proxies(users, teams=teams)
    served, refused = await _race(proxies, [ALICE_KEY, CI_KEY, BOB_KEY], 210)
    by_key = {k: sum(s.tokens for s in served if s.key == k) for k in (ALICE_KEY, CI_KEY,
                                                                        BOB_KEY)}
    assert all(by_key.values()), by_key
    alice = by_key[ALICE_KEY] + by_key[CI_KEY]
    team = alice + by_key[BOB_KEY]
    assert team <= team_tokens and alice <= alice_tokens and by_key[CI_KEY] <= ci_week
    codes = {exc.code for exc in refused}
    assert codes <= {"daily_quota_exceeded", "weekly_quota_exceeded"}
    assert any("team 'platform'" in exc.message for exc in refused)
    p = proxies[0]
    await _settled_to(p, "alice", {
        _label(p, "alice", "daily_tokens", ScopeKind.TEAM): team,
        _label(p, "alice", "monthly_usd", ScopeKind.TEAM): sum(s.cost for s in served),
        _label(p, "alice", "daily_tokens"): alice,
        _label(p, "alice", "weekly_tokens", ScopeKind.KEY): by_key[CI_KEY],
    })
    bob = await _counters(p, "bob")
    assert bob[_label(p, "bob", "daily_tokens")] == by_key[BOB_KEY]
    # `tokenmeter usage --date` reads a team's users in the team's slot.
    budget = p.app[st.SERVICES].budget
    config = p.app[st.SERVICES].runtime.current.config
    rows = {r.user: r for r in await read_usage(config, budget.store,
                                                today(config, budget.clock()))}
    assert (rows["alice"].tokens, rows["bob"].tokens) == (alice, by_key[BOB_KEY])
    assert rows["alice"].input_tokens == sum(s.input for s in served if s.key != BOB_KEY)


async def test_team_and_cost_windows_have_gauges_as_the_users_token_windows_do(
    make_proxies: Factory,
) -> None:
    """Issue 32: the alert rules read a team's windows and the cost windows from gauges
    (`tokenmeter_team_budget_*`, `tokenmeter_budget_*_usd`), which hold what the store holds
    after each settlement, USD for the cost windows; a key's windows have none."""
    users = {"alice": {"team": "platform", "daily_usd": 1, "daily_tokens": 100_000,
                       "keys": [ALICE_KEY, {"key": CI_KEY, "name": "ci", "weekly_tokens": 9000}]}}
    teams = {"platform": {"daily_tokens": 50_000, "monthly_usd": 0.5}}
    proxies = await make_proxies(users, teams=teams)
    p = proxies[0]
    served = []
    for key, stream in ((ALICE_KEY, False), (ALICE_KEY, True), (CI_KEY, True)):
        client = sdk(p, key)
        served.append(await _ask(client, key, stream))
        await client.close()
    tokens = sum(s.tokens for s in served)
    usd = sum(s.cost for s in served) / NANOS_PER_USD
    await _settled_to(p, "alice", {_label(p, "alice", "daily_tokens", ScopeKind.TEAM): tokens})
    expected = {
        ("tokenmeter_team_budget_used_tokens", "platform", "daily_tokens"): tokens,
        ("tokenmeter_team_budget_limit_tokens", "platform", "daily_tokens"): 50_000,
        ("tokenmeter_team_budget_used_usd", "platform", "monthly_usd"): usd,
        ("tokenmeter_team_budget_limit_usd", "platform", "monthly_usd"): 0.5,
        ("tokenmeter_budget_used_usd", "alice", "daily_usd"): usd,
        ("tokenmeter_budget_limit_usd", "alice", "daily_usd"): 1,
        ("tokenmeter_budget_used_tokens", "alice", "daily_tokens"): tokens,
    }

    def owner(name: str) -> str:
        return "team" if "_team_" in name else "user"

    async def gauges() -> dict[tuple[str, str, str], float]:
        m = await scrape(p)
        return {k: sample(m, k[0], **{owner(k[0]): k[1], "window": k[2]}) for k in expected}

    async def match() -> bool:
        got = await gauges()
        return all(got[k] == pytest.approx(v, abs=1e-12) for k, v in expected.items())

    try:
        await until(match, deadline=10)
    except TimeoutError:
        assert await gauges() == expected  # shows the difference
    m = await scrape(p)
    assert not sample(m, "tokenmeter_budget_used_tokens", window="weekly_tokens")  # the key's


async def test_a_teams_concurrency_limit_counts_all_its_users(make_proxies: Factory) -> None:
    users = {"alice": {"team": "platform", "keys": [ALICE_KEY]},
             "bob": {"team": "platform", "keys": [BOB_KEY]}}
    proxies = await make_proxies(users, teams={"platform": {"max_concurrent_requests": 3}})
    served, refused = await _race(proxies, [ALICE_KEY, BOB_KEY], 40)
    assert served and refused
    for exc in refused:
        assert exc.code == "concurrency_limit_exceeded"
        assert "team 'platform'" in exc.message
    p = proxies[0]
    budget = p.app[st.SERVICES].budget
    config = p.app[st.SERVICES].runtime.current.config
    slot = lim.plan(config, "bob", lim.limits_for(config, "bob"), "mock-gpt", budget.clock()).slot
    await until(lambda: _no_leases(budget.store, slot))


async def _no_leases(store: Any, slot: str) -> bool:
    return not await store.leases(slot)


# --- calendar boundaries through a proxy --------------------------------------------------------
async def test_a_spent_week_comes_back_on_monday_in_the_zone(make_proxies: Factory) -> None:
    berlin = ZoneInfo("Europe/Berlin")
    clock = FakeClock(datetime(2026, 12, 6, 23, 59, 30, tzinfo=berlin))  # a Sunday
    proxies = await make_proxies(
        {"alice": {"keys": [ALICE_KEY], "weekly_tokens": 40, "max_output_tokens": 16}},
        clock=clock, timezone="Europe/Berlin",
    )
    client = sdk(proxies[-1], ALICE_KEY)
    await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
    with pytest.raises(openai.RateLimitError) as err:
        await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
    _assert_quota_refusal(err.value, "weekly_quota_exceeded")
    assert err.value.response.headers["retry-after"] == "30"
    assert "2026-12-07T00:00:00+01:00" in err.value.message
    clock.now += 30  # Monday 00:00 in Berlin (Sunday 23:00 in UTC)
    await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
    await client.close()
