"""Budgets enforced by real proxies over loopback, on the in-process store and on real Redis."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any, cast
from zoneinfo import ZoneInfo

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestServer

from proxy.budget import limits as lim
from proxy.pipeline import services as st
from proxy.server.app import create_app
from proxy.testing.mock_upstream import MockSettings
from tests.helpers import (
    ALICE_KEY,
    BOB_KEY,
    CI_KEY,
    MESSAGES,
    FakeClock,
    ServerFactory,
    budget_config,
    make_config,
    sample,
    scrape,
    sdk,
    settled,
)


@pytest.fixture
def mock_settings() -> MockSettings:
    return MockSettings(tokens_per_second=0, ttft_ms=5, output_tokens=16)


Factory = Callable[..., Awaitable[TestServer]]


@pytest.fixture
def make_proxy(
    aiohttp_server: ServerFactory, upstream: TestServer, store_url: str
) -> Factory:
    async def make(
        users: dict[str, dict[str, Any]] | str, clock: FakeClock | None = None, **extra: Any
    ) -> TestServer:
        url = str(upstream.make_url("/v1"))
        # YAML text where the test is about what YAML carries (`${ENV}` keys).
        config = (budget_config(url, store_url, users) if isinstance(users, str)
                  else make_config(url, store=store_url, users=users, extra=extra))
        kwargs: dict[str, Any] = {} if clock is None else {"clock": clock}
        return await aiohttp_server(create_app(config, **kwargs))

    return make


async def _stream_usage(client: openai.AsyncOpenAI) -> int:
    stream = await client.chat.completions.create(
        model="mock-gpt", messages=MESSAGES, stream=True,
        stream_options={"include_usage": True},
    )
    usage = None
    async for chunk in stream:
        usage = chunk.usage or usage
    assert usage is not None
    return usage.total_tokens


async def test_concurrent_streams_never_exceed_quota(
    make_proxy: Factory, store_url: str, upstream: TestServer
) -> None:
    users = {"alice": {"keys": [ALICE_KEY], "daily_tokens": 1500, "max_output_tokens": 20}}
    # Two replicas share one budget through Redis; the in-process store is one replica's own.
    proxies = [await make_proxy(users)]
    if store_url != "memory":
        proxies.append(await make_proxy(users))
    clients = [sdk(p, ALICE_KEY) for p in proxies]
    n = 240
    results = await asyncio.gather(
        *(_stream_usage(clients[i % len(clients)]) for i in range(n)), return_exceptions=True
    )
    used = [r for r in results if isinstance(r, int)]
    refused = [r for r in results if not isinstance(r, int)]
    assert used and refused, (len(used), len(refused))
    assert sum(used) <= 1500
    for p in proxies:
        assert sample(await scrape(p), "tokenmeter_store_errors_total") == 0
    for exc in refused:
        assert isinstance(exc, openai.RateLimitError), repr(exc)
        assert exc.status_code == 429
        assert exc.code == "daily_quota_exceeded"
        assert exc.response.headers["x-should-retry"] == "false"
        assert int(exc.response.headers["retry-after"]) >= 1
        body = exc.body
        assert isinstance(body, dict) and body["type"] == "insufficient_quota"
    # Every response has ended, and settling precedes the end of a response, so the store now
    # holds exactly what the upstream reported.
    budget = proxies[0].app[st.SERVICES].budget
    runtime = proxies[0].app[st.SERVICES].runtime.current
    key = lim.daily_key(
        runtime.config.store.prefix, "alice", "daily_tokens",
        datetime.fromtimestamp(budget.clock(), ZoneInfo("UTC")).strftime("%Y%m%d"),
    )
    (counted,) = await budget.store.read([key])
    assert counted == sum(used)
    for c in clients:
        await c.close()


async def test_rate_limits_and_minute_reset(make_proxy: Factory) -> None:
    clock = FakeClock(datetime(2026, 12, 2, 10, 0, 5, tzinfo=ZoneInfo("UTC")))
    proxy = await make_proxy({"alice": {"keys": [ALICE_KEY], "requests_per_minute": 2}},
                             clock=clock)
    client = sdk(proxy, ALICE_KEY)
    for _ in range(2):
        resp = await client.chat.completions.with_raw_response.create(
            model="mock-gpt", messages=MESSAGES
        )
    assert resp.headers["x-ratelimit-limit-requests"] == "2"
    assert resp.headers["x-ratelimit-remaining-requests"] == "0"
    assert resp.headers["x-ratelimit-reset-requests"] == "55s"
    with pytest.raises(openai.RateLimitError) as err:
        await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
    assert err.value.code == "rate_limit_exceeded"
    assert err.value.response.headers["retry-after"] == "55"
    assert "x-should-retry" not in err.value.response.headers  # a short wait, SDKs may retry
    assert isinstance(err.value.body, dict) and err.value.body["type"] == "requests"
    clock.now += 60
    await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
    m = await scrape(proxy)
    assert sample(m, "tokenmeter_budget_refusals_total", user="alice",
                  limit="requests_per_minute") == 1
    assert sample(m, "tokenmeter_requests_total", status="429",
                  error_class="budget_exceeded") == 1
    await client.close()


async def test_daily_reset_at_midnight_in_configured_zone(make_proxy: Factory) -> None:
    berlin = ZoneInfo("Europe/Berlin")
    clock = FakeClock(datetime(2026, 12, 2, 23, 59, 30, tzinfo=berlin))
    proxy = await make_proxy(
        {"alice": {"keys": [ALICE_KEY], "daily_tokens": 40, "max_output_tokens": 16}},
        timezone="Europe/Berlin", clock=clock,
    )
    client = sdk(proxy, ALICE_KEY)
    await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
    with pytest.raises(openai.RateLimitError) as err:
        await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
    headers = err.value.response.headers
    assert headers["retry-after"] == "30"  # local midnight, not UTC midnight
    assert "2026-12-03T00:00:00+01:00" in err.value.message
    assert headers["x-ratelimit-reset-tokens-day"] == "30s"
    clock.now += 31  # 00:00:01 in Berlin: a new day
    await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
    await client.close()


async def test_concurrency_limit(make_proxy: Factory, upstream: TestServer) -> None:
    proxy = await make_proxy({"alice": {"keys": [ALICE_KEY], "max_concurrent_requests": 1}})
    async with aiohttp.ClientSession() as s:
        url = proxy.make_url("/v1/chat/completions")
        auth = {"Authorization": f"Bearer {ALICE_KEY}"}
        body = {"model": "mock-gpt", "messages": MESSAGES, "stream": True}
        first = await s.post(url, json=body, headers={**auth, "x-mock-stall-after": "2"})
        await first.content.readany()  # the first stream is running
        async with s.post(url, json=body, headers=auth) as second:
            assert second.status == 429
            err = (await second.json())["error"]
            assert err["code"] == "concurrency_limit_exceeded"
        first.close()
        await settled(proxy.app, 2)
        async with s.post(url, json=body, headers=auth) as third:
            assert third.status == 200
            await third.read()


async def test_output_cap_is_set_or_clamped(make_proxy: Factory, upstream: TestServer) -> None:
    from proxy.testing.mock_upstream import MOCK_STATE

    proxy = await make_proxy({"alice": {"keys": [ALICE_KEY], "max_output_tokens": 10}})
    client = sdk(proxy, ALICE_KEY)
    seen = upstream.app[MOCK_STATE].requests
    r = await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
    assert seen[-1].body is not None and seen[-1].body["max_completion_tokens"] == 10
    assert r.usage is not None and r.usage.completion_tokens == 10
    await client.chat.completions.create(
        model="mock-gpt", messages=MESSAGES, max_tokens=500
    )
    assert seen[-1].body is not None and seen[-1].body["max_tokens"] == 10
    await client.chat.completions.create(
        model="mock-gpt", messages=MESSAGES, max_tokens=3
    )
    assert seen[-1].body is not None and seen[-1].body["max_tokens"] == 3
    resp = await client.responses.create(model="mock-gpt", input="hi")
    assert seen[-1].body is not None and seen[-1].body["max_output_tokens"] == 10
    assert resp.usage is not None and resp.usage.output_tokens == 10
    await client.close()


async def test_keys_hashes_env_and_per_key_limits(
    make_proxy: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TM_BOB_KEY", BOB_KEY)
    alice_hash = "sha256:" + hashlib.sha256(ALICE_KEY.encode()).hexdigest()
    users = f"""
  alice:
    keys:
      - "{alice_hash}"
      - {{key: "{CI_KEY}", name: ci, daily_tokens: 20}}
    daily_tokens: 100000
  bob:
    keys: ["${{TM_BOB_KEY}}"]
"""
    proxy = await make_proxy(users)
    await sdk(proxy, ALICE_KEY).chat.completions.create(model="mock-gpt", messages=MESSAGES)
    await sdk(proxy, BOB_KEY).chat.completions.create(model="mock-gpt", messages=MESSAGES)
    with pytest.raises(openai.AuthenticationError) as err:
        await sdk(proxy, "sk-wrong-0123456789").chat.completions.create(
            model="mock-gpt", messages=MESSAGES
        )
    assert err.value.code == "invalid_api_key"
    async with aiohttp.ClientSession() as s, s.post(
        proxy.make_url("/v1/chat/completions"), json={"model": "mock-gpt", "messages": MESSAGES}
    ) as r:
        assert r.status == 401
        assert (await r.json())["error"]["code"] == "invalid_api_key"
    ci = sdk(proxy, CI_KEY)
    await ci.chat.completions.create(model="mock-gpt", messages=MESSAGES, max_tokens=5)
    with pytest.raises(openai.RateLimitError) as limited:
        await ci.chat.completions.create(model="mock-gpt", messages=MESSAGES, max_tokens=5)
    assert "(key 'ci')" in limited.value.message
    m = await scrape(proxy)
    assert sample(m, "tokenmeter_requests_total", user="alice", status="200") == 2
    assert sample(m, "tokenmeter_requests_total", user="bob", status="200") == 1
    assert sample(m, "tokenmeter_requests_total", status="401") == 2


async def test_per_model_limits(make_proxy: Factory) -> None:
    users = {"alice": {
        "keys": [ALICE_KEY],
        "model_limits": {"mock-expensive*": {"daily_tokens": 30, "max_output_tokens": 8}},
    }}
    proxy = await make_proxy(users)
    client = sdk(proxy, ALICE_KEY)
    r = await client.chat.completions.create(model="mock-expensive-1", messages=MESSAGES)
    assert r.usage is not None and r.usage.completion_tokens == 8
    with pytest.raises(openai.RateLimitError) as err:
        await client.chat.completions.create(model="mock-expensive-1", messages=MESSAGES)
    assert "models 'mock-expensive*'" in err.value.message
    await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)


async def test_passthrough_meters_by_key_hash(
    aiohttp_server: ServerFactory, upstream: TestServer
) -> None:
    from proxy.testing.mock_upstream import MOCK_STATE

    config = make_config(str(upstream.make_url("/v1")), store="memory", extra={"mode": "passthrough"})
    proxy = await aiohttp_server(create_app(config))
    client = sdk(proxy, "sk-team-own-upstream-key")
    await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
    seen = upstream.app[MOCK_STATE].requests[-1]
    assert seen.headers["authorization"] == "Bearer sk-team-own-upstream-key"
    label = "key-" + hashlib.sha256(b"sk-team-own-upstream-key").hexdigest()[:12]
    m = await scrape(proxy)
    assert sample(m, "tokenmeter_requests_total", user=label, status="200") == 1
    assert "sk-team-own" not in repr(m)


async def test_models_listing_needs_a_key(make_proxy: Factory) -> None:
    proxy = await make_proxy({"alice": {"keys": [ALICE_KEY]}})
    models = await sdk(proxy, ALICE_KEY).models.list()
    assert [m.id for m in models.data] == ["mock-gpt"]
    with pytest.raises(openai.AuthenticationError):
        await sdk(proxy, "sk-not-a-key-0000").models.list()


async def test_redis_keys_share_a_cluster_slot_and_expire(
    aiohttp_server: ServerFactory, upstream: TestServer, redis_url: str
) -> None:
    import redis.asyncio as aioredis
    from redis.crc import key_slot

    users = {"alice": {"keys": [ALICE_KEY], "daily_tokens": 100000,
                       "tokens_per_minute": 100000, "max_concurrent_requests": 5}}
    proxy = await aiohttp_server(create_app(
        make_config(str(upstream.make_url("/v1")), store=redis_url, users=users)))
    await _stream_usage(sdk(proxy, ALICE_KEY))
    r = aioredis.Redis.from_url(redis_url)
    try:
        # A client without decode_responses answers bytes; the stub says bytes | str.
        keys = cast("list[bytes]", await r.keys("tokenmeter:*"))
        assert keys
        # One slot per user: Redis Cluster can run every script of a request on one node.
        assert len({key_slot(k) for k in keys}) == 1
        for k in keys:
            assert k.startswith(b"tokenmeter:{alice}:")
            assert await r.ttl(k) > 0  # nothing lives forever
    finally:
        await r.aclose()


@pytest.mark.parametrize("mode", ["open", "passthrough"])
async def test_metered_only_modes_leave_the_budget_store_alone(
    aiohttp_server: ServerFactory, upstream: TestServer, redis_url: str, mode: str
) -> None:
    """Open and pass-through modes meter without limits: the books and the metrics count every
    token, and the budget store is never asked (no reservation, no counter, no budget gauge)."""
    import redis.asyncio as aioredis


    extra = {"mode": "passthrough"} if mode == "passthrough" else {}
    proxy = await aiohttp_server(create_app(
        make_config(str(upstream.make_url("/v1")), store=redis_url, extra=extra)))
    client = sdk(proxy, "sk-team-own-upstream-key")
    answer = await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
    streamed = await _stream_usage(client)
    assert answer.usage is not None
    await settled(proxy.app, 2)
    m = await scrape(proxy)
    user = ("key-" + hashlib.sha256(b"sk-team-own-upstream-key").hexdigest()[:12]
            if mode == "passthrough" else "default")
    assert sample(m, "tokenmeter_requests_total", user=user, status="200") == 2
    assert sample(m, "tokenmeter_tokens_total", user=user) == (
        answer.usage.total_tokens + streamed)
    assert not any(name.startswith("tokenmeter_budget_used_tokens") for name, _ in m)
    assert sample(m, "tokenmeter_budget_reserved_tokens_total") == 0
    r = aioredis.Redis.from_url(redis_url)
    try:
        assert await r.keys("tokenmeter:*") == []
    finally:
        await r.aclose()
