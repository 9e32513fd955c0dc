"""What a settled request leaves in Redis: nothing. Memory is bounded by the requests in flight,
the reservations reaped (their tombstones) and the batches owed during outages, not by requests
served (issue 14: a settle marker per request for ten minutes was 780,000 keys at 1,300 req/s).
"""

from __future__ import annotations

import asyncio
import time
from typing import cast

import redis.asyncio as aioredis
from aiohttp.test_utils import TestServer

from proxy.budget.store import USER, Entry, InFlightLimit, Scope, ScopeKind
from proxy.budget.store_redis import RedisStore
from proxy.server.app import create_app
from tests.helpers import ServerFactory, make_config, sdk

USERS = 50
REQUESTS = 30_000
ALICE_KEY = "sk-alice-keys-test-0001"


async def _keys(r: aioredis.Redis) -> list[str]:
    return sorted(k.decode() for k in cast("list[bytes]", await r.keys("*")))


async def test_keys_left_after_30000_settled_requests_are_the_counters_alone(
    redis_url: str,
) -> None:
    store = RedisStore(redis_url, timeout_ms=5_000)
    r = aioredis.Redis.from_url(redis_url)
    key_scope = Scope(ScopeKind.KEY, "ci")
    day = int(time.time() // 86400)
    try:
        async def one(i: int) -> None:
            slot = f"tm:{{u{i % USERS}}}"
            entries = [Entry(f"{slot}:u:daily:{day}", 10**12, 300, 86400),
                       Entry(f"{slot}:k.ci:weekly:{day // 7}", 10**12, 300, 86400)]
            held = [InFlightLimit(USER, 1_000), InFlightLimit(key_scope, 1_000)]
            assert (await store.reserve(slot, f"r{i}", entries, held, 60)).ok
            used = [Entry(e.key, e.limit, 120, e.ttl_s) for e in entries]
            await store.settle(slot, f"r{i}", used)
            if i % 1_000 == 0:  # a retry whose first reply was lost: recognised, not counted
                await store.settle(slot, f"r{i}", used)

        # Sustained: 64 requests in flight at every moment, 30,000 in all.
        queue = iter(range(REQUESTS))

        async def worker() -> None:
            for i in queue:
                await one(i)

        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(64))), 240)
        keys = await _keys(r)
        # Two counters per user and nothing else: no marker, no reservation, no set.
        assert len(keys) == 2 * USERS, keys[:20]
        assert all(":daily:" in k or ":weekly:" in k for k in keys), keys[:20]
        values = await r.mget(keys)
        assert sum(int(v) for v in cast("list[bytes]", values)) == 2 * 120 * REQUESTS  # each counted once
    finally:
        await r.aclose()
        await store.close()


async def test_a_reaped_reservation_leaves_one_tombstone_until_its_late_settle(
    redis_url: str,
) -> None:
    store = RedisStore(redis_url, timeout_ms=5_000)
    r = aioredis.Redis.from_url(redis_url)
    slot, day = "tm:{slow}", "tm:{slow}:u:daily:1"
    held = [InFlightLimit(USER, None)]
    try:
        assert (await store.reserve(slot, "slow", [Entry(day, None, 80, 600)], held, 0.001)).ok
        # The lease of one millisecond has run out by the next call: that reserve reaps it.
        deadline = time.monotonic() + 10
        while await store.leases(slot) and time.monotonic() < deadline:
            await store.reserve(slot, "next", [Entry(day, None, 10, 600)], held, 60)
            await store.settle(slot, "next", [Entry(day, None, 0, 600)])
        assert await store.leases(slot) == {}
        assert await r.zcard(f"{slot}:reaped") == 1
        assert int(await r.get(day) or 0) == 0  # the 80 was given back
        # Its late settle counts what it used, outright, once, and takes the tombstone away.
        assert await store.settle(slot, "slow", [Entry(day, None, 50, 600)]) == (50,)
        assert await store.settle(slot, "slow", [Entry(day, None, 50, 600)]) == (50,)
        assert await r.exists(f"{slot}:reaped") == 0
    finally:
        await r.aclose()
        await store.close()


async def test_streams_through_the_proxy_leave_only_counters_in_redis(
    aiohttp_server: ServerFactory, upstream: TestServer, redis_url: str
) -> None:
    users = {"alice": {"keys": [ALICE_KEY], "daily_tokens": 10**9,
                       "tokens_per_minute": 10**9, "max_concurrent_requests": 500}}
    proxy = await aiohttp_server(create_app(
        make_config(str(upstream.make_url("/v1")), store=redis_url, users=users)))
    client = sdk(proxy, ALICE_KEY)
    r = aioredis.Redis.from_url(redis_url)
    try:
        async def one(stream: bool) -> int:
            if stream:
                chunks = await client.chat.completions.create(
                    model="mock-gpt", messages=[{"role": "user", "content": "hi"}],
                    stream=True, stream_options={"include_usage": True}, max_tokens=8)
                total = 0
                async for chunk in chunks:
                    total = chunk.usage.total_tokens if chunk.usage else total
                return total
            done = await client.chat.completions.create(
                model="mock-gpt", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
            assert done.usage is not None
            return done.usage.total_tokens

        used = await asyncio.gather(*(one(i % 2 == 0) for i in range(200)))
        keys = await _keys(r)
        left = [k for k in keys if not k.startswith("tokenmeter:{alice}:u:")]
        # The `estimate` history and the like are per user, not per request; nothing else.
        assert all(":done:" not in k and ":reserved" not in k and ":inflight" not in k
                   for k in keys), keys
        assert len(keys) <= 4, (keys, left)
        day = next(k for k in keys if ":daily_tokens:" in k)
        assert int(await r.get(day) or 0) == sum(used)
    finally:
        await r.aclose()
        await client.close()
