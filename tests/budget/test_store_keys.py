"""What requests through the proxy leave in Redis: their counters. Memory is bounded by the
requests in flight, the reservations reaped (their tombstones) and the batches owed during
outages, not by requests served (issue 14: a settle marker per request for ten minutes was
780,000 keys at 1,300 req/s). The store's own bounds, operation by operation and alike in every
store: tests/budget/test_store_conformance.py.
"""

from __future__ import annotations

import asyncio
from typing import cast

import redis.asyncio as aioredis
from aiohttp.test_utils import TestServer

from proxy.server.app import create_app
from tests.helpers import ServerFactory, make_config, sdk

USERS = 50
REQUESTS = 30_000
ALICE_KEY = "sk-alice-keys-test-0001"


async def _keys(r: aioredis.Redis) -> list[str]:
    return sorted(k.decode() for k in cast("list[bytes]", await r.keys("*")))


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
