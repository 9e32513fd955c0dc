"""Redis going away and coming back, in both policies, and a proxy dying mid-request."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import aiohttp
import openai
import pytest
import redis.asyncio as aioredis
from aiohttp.test_utils import TestServer

from proxy.budget.limits import daily_key
from proxy.budget.usage_report import read_usage, today
from proxy.config.load import parse_config
from proxy.pipeline import services as st
from proxy.server.app import create_app
from tests.helpers import (
    ALICE_KEY,
    MESSAGES,
    ServerFactory,
    budget_yaml,
    redis_int,
    sample,
    scrape,
    sdk,
)
from tests.servers import RedisServer, ServedProxy


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    server = RedisServer(persistent=True)
    server.start()
    yield server
    server.stop()


def _config_text(
    upstream: TestServer, redis_url: str, policy: str, users: str = "", **store_opts: Any
) -> str:
    store_opts["on_error"] = policy
    users = users or f'  alice:\n    keys: ["{ALICE_KEY}"]\n    daily_tokens: 100000\n'
    return budget_yaml(str(upstream.make_url("/v1")), redis_url, users, **store_opts)


async def _daily(app_server: TestServer) -> int:
    app = app_server.app
    config = app[st.SERVICES].runtime.current.config
    budget = app[st.SERVICES].budget
    (row,) = await read_usage(config, budget.store, today(config, budget.clock()))
    return row.tokens


async def test_fail_open_serves_through_an_outage_and_catches_up(
    aiohttp_server: ServerFactory, upstream: TestServer, own_redis: RedisServer
) -> None:
    proxy = await aiohttp_server(
        create_app(parse_config(_config_text(upstream, own_redis.url, "fail_open")))
    )
    client = sdk(proxy, ALICE_KEY)
    first = await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
    own_redis.stop()
    during = await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
    assert during.choices[0].message.content  # served although the store is down
    m = await scrape(proxy)
    assert sample(m, "tokenmeter_store_errors_total", op="reserve") >= 1
    # Known down: the settlement went to the spool without trying (and waiting on) the store.
    assert sample(m, "tokenmeter_store_errors_total", op="settle") == 0
    # Two: the request's usage, and a release of the reservation whose reply never came.
    assert sample(m, "tokenmeter_settle_backlog") == 2
    assert during.usage is not None
    assert sample(m, "tokenmeter_settle_backlog_tokens") == during.usage.total_tokens
    assert sample(m, "tokenmeter_store_up") == 0
    async with aiohttp.ClientSession() as s, s.get(proxy.make_url("/readyz")) as r:
        assert r.status == 200 and (await r.json())["status"] == "degraded"

    own_redis.start()
    budget = proxy.app[st.SERVICES].budget
    # What the background loop does every second:
    assert await budget.probe()
    assert await budget.replay() == 0
    assert first.usage is not None and during.usage is not None
    assert await _daily(proxy) == first.usage.total_tokens + during.usage.total_tokens
    after = await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
    assert after.usage is not None
    assert await _daily(proxy) == (
        first.usage.total_tokens + during.usage.total_tokens + after.usage.total_tokens
    )
    assert sample(await scrape(proxy), "tokenmeter_store_up") == 1
    await client.close()


async def test_fail_closed_refuses_then_recovers(
    aiohttp_server: ServerFactory, upstream: TestServer, own_redis: RedisServer
) -> None:
    proxy = await aiohttp_server(
        create_app(parse_config(_config_text(upstream, own_redis.url, "fail_closed")))
    )
    client = sdk(proxy, ALICE_KEY)
    await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
    own_redis.stop()
    with pytest.raises(openai.InternalServerError) as err:
        await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
    assert err.value.status_code == 503
    assert err.value.code == "service_unavailable"
    async with aiohttp.ClientSession() as s, s.get(proxy.make_url("/readyz")) as r:
        assert r.status == 503
    own_redis.start()
    assert await proxy.app[st.SERVICES].budget.probe()  # what the background loop does every second
    resp = await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
    assert resp.choices[0].message.content
    m = await scrape(proxy)
    assert sample(m, "tokenmeter_requests_total", status="503") == 1
    assert sample(m, "tokenmeter_store_up") == 1
    await client.close()


async def test_killed_proxy_reservation_is_released(
    aiohttp_server: ServerFactory, upstream: TestServer, own_redis: RedisServer, tmp_path: Path
) -> None:
    users = (f'  alice:\n    keys: ["{ALICE_KEY}"]\n    daily_tokens: 100000\n'
             "    max_concurrent_requests: 1\n    max_output_tokens: 50\n")
    # A lease long enough that the replica below starts, and is refused, well before it
    # runs out, even on a loaded machine (1.5 s was not, now and then).
    text = _config_text(upstream, own_redis.url, "fail_open", users, lease_seconds=4)
    cfg = tmp_path / "tm.yaml"
    cfg.write_text(text)
    served = ServedProxy(cfg, tmp_path / "proxy.log")
    r = aioredis.Redis.from_url(own_redis.url)
    try:
        await served.started()
        async with aiohttp.ClientSession() as s:
            resp = await s.post(
                f"{served.url}/v1/chat/completions",
                json={"model": "mock-gpt", "messages": MESSAGES, "stream": True},
                headers={"Authorization": f"Bearer {ALICE_KEY}", "x-mock-stall-after": "3"},
            )
            assert resp.status == 200
            await resp.content.readany()  # streaming: its reservation is held
            served.kill()
            resp.close()

        inflight = "tokenmeter:{alice}:inflight"
        scored = await r.zrange(inflight, 0, -1, withscores=True)
        # withscores=True answers (member, score) pairs; the stub's return type is a union.
        ((_res_id, deadline_ms),) = cast("list[tuple[bytes, float]]", scored)
        config = parse_config(text)
        key = daily_key("tokenmeter", "alice", "daily_tokens",
                        today(config, time.time()).strftime("%Y%m%d"))
        assert await redis_int(r, key) > 50  # the dead request's worst case is still reserved

        proxy = await aiohttp_server(create_app(config))
        client = sdk(proxy, ALICE_KEY)
        with pytest.raises(openai.RateLimitError) as err:  # the lease has not run out yet
            await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
        assert err.value.code == "concurrency_limit_exceeded"
        sec, usec = await r.time()
        wait = (deadline_ms - (sec * 1000 + usec / 1000)) / 1000 + 0.05
        await asyncio.sleep(max(0.0, wait))  # until the lease deadline Redis holds, no guessing
        ok = await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
        assert ok.usage is not None
        # The dead reservation was released: only the new request's usage is counted.
        assert await redis_int(r, key) == ok.usage.total_tokens
        assert await r.zcard(inflight) == 0
        await client.close()
    finally:
        served.kill()
        await r.aclose()


async def test_after_a_redis_restart_no_stale_connection_fails_again(
    aiohttp_server: ServerFactory, upstream: TestServer, own_redis: RedisServer
) -> None:
    proxy = await aiohttp_server(
        create_app(parse_config(_config_text(upstream, own_redis.url, "fail_open")))
    )
    client = sdk(proxy, ALICE_KEY)
    # Many requests at once: the store's pool opens many connections.
    await asyncio.gather(*(client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
                           for _ in range(16)))
    own_redis.stop()
    await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
    own_redis.start()
    budget = proxy.app[st.SERVICES].budget
    assert await budget.probe()
    before = sample(await scrape(proxy), "tokenmeter_store_errors_total")
    await asyncio.gather(*(client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
                           for _ in range(16)))
    # Each connection opened before the restart would have failed once more (and marked the
    # store down again) had the first failure not dropped them all.
    assert sample(await scrape(proxy), "tokenmeter_store_errors_total") == before
    assert budget.health.up
    await client.close()
