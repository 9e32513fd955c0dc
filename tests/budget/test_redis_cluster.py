"""The Redis store on a real Redis Cluster: three `redis-server --cluster-enabled yes` on
loopback ports joined by `redis-cli --cluster create`. Every reservation (a team's counters,
the user's and a key's together) is one script call on one node, with no CROSSSLOT error, and
proxies sharing the cluster keep a team's quota under a race."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
import redis
from aiohttp.test_utils import TestServer
from redis.crc import key_slot

from proxy.budget import limits as lim
from proxy.budget.store import InFlightLimit, ReserveRequest, ScopeKind, StoreError, WindowAmount
from proxy.budget.store_redis import RedisStore
from proxy.budget.usage_report import read_usage, today
from proxy.config.policy import KeyConfig, Policy, Price
from proxy.pipeline import services as st
from proxy.server.app import create_app
from proxy.testing.mock_upstream import MockSettings
from tests.helpers import (
    ALICE_KEY,
    BOB_KEY,
    CI_KEY,
    MESSAGES,
    ServerFactory,
    make_config,
    sample,
    scrape,
    sdk,
    until,
)
from tests.servers import Cluster


@pytest.fixture
def cluster(redis_cluster: Cluster) -> Cluster:
    return redis_cluster


@pytest.fixture
async def store(cluster: Cluster) -> AsyncIterator[RedisStore]:
    cluster.flush()
    s = RedisStore(cluster.url, 5000)
    yield s
    await s.close()


POLICY = Policy.model_validate({
    "teams": {"platform": {"daily_tokens": 100, "monthly_usd": 0.001,
                           "max_concurrent_requests": 4}},
    "users": {
        "alice": {"team": "platform", "daily_tokens": 70,
                  "keys": [{"key": CI_KEY, "name": "ci", "weekly_tokens": 30,
                            "max_concurrent_requests": 1}]},
        "bob": {"team": "platform"},
        "dave": {"daily_tokens": 50},
    },
})
PRICE = Price(input=1.0, output=2.0)
CI = KeyConfig(key=CI_KEY, name="ci", weekly_tokens=30, max_concurrent_requests=1)


def _plan(user: str, key: KeyConfig | None = None) -> lim.Plan:
    limits = lim.limits_for(POLICY, user, key, key.name if key is not None else None)
    return lim.plan(POLICY, user, limits, "mock-gpt", time.time())


def _entries(p: lim.Plan, tokens: int) -> tuple[WindowAmount, ...]:
    cost = lim.reserve_cost(PRICE, tokens, 0)
    return tuple(WindowAmount(w.key, w.limit, lim.amount(w, tokens, 0, cost), w.ttl_s)
                 for w in p.windows)


def _request(p: lim.Plan, tokens: int) -> ReserveRequest:
    """`tokens` in every window of the plan, and the request in its in-flight sets."""
    return ReserveRequest(_entries(p, tokens), p.in_flight)


def _refused_by(p: lim.Plan, result: Any) -> tuple[ScopeKind, str]:
    assert not result.ok
    if result.refused_in_flight is not None:
        held: InFlightLimit = p.in_flight[result.refused_in_flight]
        return held.scope.kind, "max_concurrent_requests"
    w = p.windows[result.refused_entry]
    return w.scope.kind, w.name.value


def _value(p: lim.Plan, used: tuple[int, ...], kind: ScopeKind, name: str) -> int:
    return next(u for w, u in zip(p.windows, used, strict=True)
                if w.scope.kind is kind and w.name == name)


async def test_reservations_of_users_with_and_without_teams_on_a_cluster(
    store: RedisStore, cluster: Cluster
) -> None:
    alice_ci, alice, bob, dave = _plan("alice", CI), _plan("alice"), _plan("bob"), _plan("dave")
    # The team's slot and dave's are served by different nodes: this is a sharded store.
    with redis.RedisCluster(host="127.0.0.1", port=cluster.ports[0]) as rc:
        owners = {rc.get_node_from_key(p.slot).name for p in (alice, dave)}
    assert len(owners) == 2, owners
    await store.ping()  # the readiness probe: a script, on whichever node

    # Team + user + key windows, and the key's, user's and team's in-flight sets: one call.
    first = await store.reserve(alice_ci.slot, "a1", _request(alice_ci, 25), 30)
    assert first.ok
    assert _value(alice_ci, first.used, ScopeKind.TEAM, "daily_tokens") == 25
    assert _value(alice_ci, first.used, ScopeKind.TEAM, "monthly_usd") == 25_000
    again = await store.reserve(alice_ci.slot, "a2", _request(alice_ci, 1), 30)
    assert _refused_by(alice_ci, again) == (ScopeKind.KEY, "max_concurrent_requests")
    settled = await store.settle(alice_ci.slot, "a1", _entries(alice_ci, 20))
    assert _value(alice_ci, settled, ScopeKind.KEY, "weekly_tokens") == 20
    assert _value(alice_ci, settled, ScopeKind.USER, "daily_tokens") == 20
    assert _value(alice_ci, settled, ScopeKind.TEAM, "daily_tokens") == 20
    over_key = await store.reserve(alice_ci.slot, "a3", _request(alice_ci, 15), 30)
    assert _refused_by(alice_ci, over_key) == (ScopeKind.KEY, "weekly_tokens")

    # bob takes most of what the team has left; alice, well within her own 70, is refused
    # by the team's day, and nothing of her refused request is counted anywhere.
    assert (await store.reserve(bob.slot, "b1", _request(bob, 75), 30)).ok
    assert set(await store.leases(bob.slot)) == {"b1"}
    over_team = await store.reserve(alice.slot, "a4", _request(alice, 10), 30)
    assert _refused_by(alice, over_team) == (ScopeKind.TEAM, "daily_tokens")
    await store.renew(bob.slot, ["b1"], 60)
    deadline = (await store.leases(bob.slot))["b1"]
    assert time.time() + 50 < deadline <= time.time() + 61
    await store.settle(bob.slot, "b1", _entries(bob, 60))
    assert await store.leases(bob.slot) == {}

    # A user without a team, in a slot of their own.
    assert (await store.reserve(dave.slot, "d1", _request(dave, 50), 30)).ok
    over_user = await store.reserve(dave.slot, "d2", _request(dave, 1), 30)
    assert _refused_by(dave, over_user) == (ScopeKind.USER, "daily_tokens")

    # One read across the slots of every user: split per slot by the client.
    team_day = next(w.key for w in bob.windows
                    if w.scope.kind is ScopeKind.TEAM and w.name == "daily_tokens")
    day = lim.windows_at(POLICY, "dave", time.time())[0].label.rpartition(":")[2]
    keys = [team_day, *(lim.daily_key("tokenmeter", u, "daily_tokens", day,
                                      lim.team_of(POLICY, u)) for u in ("alice", "bob", "dave"))]
    assert len({key_slot(k.encode()) for k in keys}) == 2
    assert await store.read(keys) == (80, 20, 60, 50)


async def test_a_dead_reservation_is_reaped_off_the_teams_counters_on_a_cluster(
    store: RedisStore,
) -> None:
    """The reap step reads counters named in reservation records, not in KEYS: on a cluster
    that works only because they share the slot's hash tag."""
    alice, bob = _plan("alice"), _plan("bob")
    assert (await store.reserve(alice.slot, "dead", _request(alice, 60), 0.05)).ok
    await until(lambda: _lapsed(store, alice.slot))
    # bob's request reaps alice's dead reservation off the team's counters.
    result = await store.reserve(bob.slot, "b1", _request(bob, 90), 30)
    assert result.ok
    assert _value(bob, result.used, ScopeKind.TEAM, "daily_tokens") == 90
    assert set(await store.leases(alice.slot)) == {"b1"}
    alice_day = next(w.key for w in alice.windows
                     if w.scope.kind is ScopeKind.USER and w.name == "daily_tokens")
    assert await store.read([alice_day]) == (0,)


async def _lapsed(store: RedisStore, slot: str) -> bool:
    return all(deadline < time.time() for deadline in (await store.leases(slot)).values())


async def test_keys_of_two_slots_in_one_call_are_refused_not_half_applied(
    store: RedisStore,
) -> None:
    """What the layout prevents: a reservation spanning two slots fails as a store error."""
    alice, dave = _plan("alice"), _plan("dave")
    mixed = (*_entries(dave, 1), *_entries(alice, 1))
    with pytest.raises(StoreError, match=r"(?i)slot"):
        await store.reserve(dave.slot, "x", ReserveRequest(mixed, dave.in_flight), 30)
    dave_day = next(w.key for w in dave.windows if w.name == "daily_tokens")
    assert await store.read([dave_day]) == (0,)


# --- proxies sharing the cluster --------------------------------------------------------------
@pytest.fixture
def mock_settings() -> MockSettings:
    return MockSettings(tokens_per_second=0, ttft_ms=5, output_tokens=16)


async def _tokens(client: openai.AsyncOpenAI) -> int:
    stream = await client.chat.completions.create(
        model="mock-gpt", messages=MESSAGES, stream=True, stream_options={"include_usage": True},
    )
    usage = None
    async for chunk in stream:
        usage = chunk.usage or usage
    assert usage is not None
    return usage.total_tokens


async def test_two_proxies_on_a_cluster_keep_a_teams_quota_under_a_race(
    aiohttp_server: ServerFactory, upstream: TestServer, cluster: Cluster
) -> None:
    cluster.flush()
    users = {
        "alice": {"team": "platform", "daily_tokens": 900, "max_output_tokens": 20,
                  "keys": [ALICE_KEY, {"key": CI_KEY, "name": "ci", "weekly_tokens": 300}]},
        "bob": {"team": "platform", "keys": [BOB_KEY], "max_output_tokens": 20},
        "dave": {"keys": ["sk-dave-0123456789"], "daily_tokens": 400, "max_output_tokens": 20},
    }
    config = make_config(str(upstream.make_url("/v1")), store=cluster.url, users=users,
                         extra={"teams": {"platform": {"daily_tokens": 1500}}})
    proxies = [await aiohttp_server(create_app(config)) for _ in range(2)]
    keys = [ALICE_KEY, CI_KEY, BOB_KEY, "sk-dave-0123456789"]
    clients = [(k, sdk(p, k)) for p in proxies for k in keys]
    results = await asyncio.gather(*(_tokens(clients[i % len(clients)][1]) for i in range(160)),
                                   return_exceptions=True)
    served: dict[str, int] = dict.fromkeys(keys, 0)
    refused = 0
    for i, r in enumerate(results):
        if isinstance(r, int):
            served[clients[i % len(clients)][0]] += r
        else:
            assert isinstance(r, openai.RateLimitError), repr(r)
            refused += 1
    assert refused and all(served.values()), served
    team = served[ALICE_KEY] + served[CI_KEY] + served[BOB_KEY]
    assert team <= 1500 and served[ALICE_KEY] + served[CI_KEY] <= 900
    assert served[CI_KEY] <= 300 and served["sk-dave-0123456789"] <= 400
    for p in proxies:
        m = await scrape(p)
        assert sample(m, "tokenmeter_store_errors_total") == 0  # no CROSSSLOT, no timeout
        assert p.app[st.SERVICES].budget.health.up
    budget = proxies[0].app[st.SERVICES].budget

    async def settled() -> bool:
        rows = await read_usage(config, budget.store, today(config, budget.clock()))
        by_user = {r.user: r.tokens for r in rows}
        return by_user == {"alice": served[ALICE_KEY] + served[CI_KEY],
                           "bob": served[BOB_KEY], "dave": served["sk-dave-0123456789"]}

    await until(settled)
    for _, c in clients:
        await c.close()
