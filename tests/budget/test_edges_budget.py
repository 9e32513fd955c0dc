"""Budgets at the edges: every choice and every cap field bounded, a key within its user, no
reservation left behind by a reply that never came, and a store outage that costs no request a
wait and no usage. Real proxies, real redis-server, the openai SDK.

The choices upstream below stands in for providers the mock does not imitate: it bills every
choice it generates (`n`, `best_of`), and it honours only the cap fields it is told to (like
llama-cpp-python, which ignores `max_completion_tokens`). It counts tokens its own way: one word
is one token.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import openai
import pytest
import redis.asyncio as aioredis
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.config.load import parse_config
from proxy.pipeline import services as st
from proxy.server.app import create_app
from tests.helpers import (
    ALICE_KEY,
    CI_KEY,
    MESSAGES,
    ServerFactory,
    budget_yaml,
    make_config,
    redis_int,
    sample,
    scrape,
    sdk,
    settled,
)

OTHER_KEY = "sk-alice-other-0123456789"


@dataclass
class ChoicesUpstream:
    honours: tuple[str, ...]
    default_tokens: int = 500  # what it generates per choice when no honoured cap is sent
    bodies: list[dict[str, Any]] = field(default_factory=list)
    billed: int = 0  # completion tokens billed, all requests

    def _limit(self, body: dict[str, Any]) -> int:
        limit = self.default_tokens
        for name in self.honours:
            value = body.get(name)
            if isinstance(value, int):
                limit = min(limit, value)
        return limit

    def app(self) -> web.Application:
        async def chat(request: web.Request) -> web.Response:
            body = await request.json()
            self.bodies.append(body)
            n, limit = int(body.get("n") or 1), self._limit(body)
            prompt = sum(len(str(m.get("content", "")).split()) for m in body["messages"])
            self.billed += n * limit
            text = " ".join(["word"] * limit)
            return web.json_response({
                "id": "c", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [{"index": i, "finish_reason": "length",
                             "message": {"role": "assistant", "content": text}}
                            for i in range(n)],
                "usage": {"prompt_tokens": prompt, "completion_tokens": n * limit,
                          "total_tokens": prompt + n * limit},
            })

        async def completions(request: web.Request) -> web.Response:
            body = await request.json()
            self.bodies.append(body)
            n, limit = int(body.get("n") or 1), self._limit(body)
            generated = max(n, int(body.get("best_of") or 1))  # best_of: all generated, n sent
            prompt = len(str(body["prompt"]).split())
            self.billed += generated * limit
            text = " ".join(["word"] * limit)
            return web.json_response({
                "id": "t", "object": "text_completion", "created": 0, "model": body["model"],
                "choices": [{"index": i, "text": text, "finish_reason": "length",
                             "logprobs": None} for i in range(n)],
                "usage": {"prompt_tokens": prompt, "completion_tokens": generated * limit,
                          "total_tokens": prompt + generated * limit},
            })

        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_post("/v1/completions", completions)
        return app


async def _proxy(aiohttp_server: ServerFactory, upstream_url: str, store_url: str, users: str,
                 extra: str = "", **kw: Any) -> TestServer:
    text = budget_yaml(upstream_url, store_url, users, extra)
    return await aiohttp_server(create_app(parse_config(text)), **kw)


async def _choices(aiohttp_server: ServerFactory, honours: tuple[str, ...]
                   ) -> tuple[ChoicesUpstream, str]:
    double = ChoicesUpstream(honours)
    server = await aiohttp_server(double.app())
    return double, str(server.make_url("/v1"))


# --- 1. n > 1 --------------------------------------------------------------------------------
async def test_every_choice_is_reserved_and_capped(
    aiohttp_server: ServerFactory, store_url: str
) -> None:
    double, url = await _choices(aiohttp_server, ("max_tokens", "max_completion_tokens"))
    users = f'  alice:\n    keys: ["{ALICE_KEY}"]\n    daily_tokens: 3000\n' \
            "    max_output_tokens: 200\n"
    # Two replicas share one budget through Redis; the in-process store is one replica's own.
    proxies = [await _proxy(aiohttp_server, url, store_url, users)]
    if store_url != "memory":
        proxies.append(await _proxy(aiohttp_server, url, store_url, users))
    clients = [sdk(p, ALICE_KEY) for p in proxies]

    async def ask(i: int) -> int | None:
        try:
            r = await clients[i % len(clients)].chat.completions.create(
                model="gpt", messages=MESSAGES, n=8, max_tokens=100,
            )
        except openai.RateLimitError:
            return None
        assert r.usage is not None and len(r.choices) == 8
        assert r.usage.completion_tokens <= 200  # the cap covers all choices together
        return r.usage.total_tokens

    served = [t for t in await asyncio.gather(*(ask(i) for i in range(10))) if t is not None]
    assert served
    assert sum(served) <= 3000  # on main: 8,100 tokens served against a quota of 3,000
    assert double.billed <= 3000
    for body in double.bodies:  # each choice got its share of the cap
        assert body["max_tokens"] == 25 and body["max_completion_tokens"] == 25
    for c in clients:
        await c.close()


async def test_best_of_is_reserved_and_too_many_choices_refused(
    aiohttp_server: ServerFactory,
) -> None:
    double, url = await _choices(aiohttp_server, ("max_tokens",))
    users = f'  alice:\n    keys: ["{ALICE_KEY}"]\n    max_output_tokens: 200\n'
    proxy = await _proxy(aiohttp_server, url, "memory", users)
    client = sdk(proxy, ALICE_KEY)
    r = await client.completions.create(model="gpt", prompt="say it", n=2, best_of=4,
                                        max_tokens=100)
    assert r.usage is not None and r.usage.completion_tokens <= 200
    assert double.bodies[-1]["max_tokens"] == 50
    m = await scrape(proxy)
    reserved = sample(m, "tokenmeter_budget_reserved_tokens_total", user="alice")
    assert reserved == 4 * 50 == r.usage.completion_tokens  # all four generations, not n=2
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(model="gpt", messages=MESSAGES, n=201)
    assert err.value.status_code == 400
    assert err.value.param == "n"
    assert len(double.bodies) == 1  # the refused request never went upstream
    await client.close()


# --- 2. cap fields ---------------------------------------------------------------------------
async def test_cap_holds_on_an_upstream_that_ignores_max_completion_tokens(
    aiohttp_server: ServerFactory, store_url: str
) -> None:
    double, url = await _choices(aiohttp_server, ("max_tokens",))  # llama-cpp-python's way
    users = f'  alice:\n    keys: ["{ALICE_KEY}"]\n    daily_tokens: 1000\n' \
            "    max_output_tokens: 32\n"
    proxy = await _proxy(aiohttp_server, url, store_url, users)
    client = sdk(proxy, ALICE_KEY)
    r = await client.chat.completions.create(model="gpt", messages=MESSAGES)
    assert r.usage is not None and r.usage.completion_tokens == 32  # on main: 500

    r = await client.chat.completions.create(
        model="gpt", messages=MESSAGES, max_completion_tokens=1000,
    )
    assert r.usage is not None and r.usage.completion_tokens == 32

    # Both sent, the upstream honours the larger: the reservation is the larger one too.
    r = await client.chat.completions.create(
        model="gpt", messages=MESSAGES, max_completion_tokens=1, max_tokens=30,
    )
    assert r.usage is not None and r.usage.completion_tokens == 30

    async def ask() -> int:
        try:
            resp = await client.chat.completions.create(model="gpt", messages=MESSAGES)
        except openai.RateLimitError:
            return 0
        assert resp.usage is not None
        return resp.usage.total_tokens

    await asyncio.gather(*(ask() for _ in range(40)))
    m = await scrape(proxy)
    # Everything the upstream billed was reserved first: zero overspend.
    assert double.billed + 4 * len(double.bodies) <= 1000
    assert sample(m, "tokenmeter_tokens_total", user="alice") <= 1000
    await client.close()


@pytest.mark.parametrize(("params", "param"), [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": "300"}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_completion_tokens": 1.5}, "max_completion_tokens"),
    ({"n": 0}, "n"),
    ({"n": "2"}, "n"),
])
async def test_bad_cap_values_get_a_400_naming_the_parameter(
    aiohttp_server: ServerFactory, params: dict[str, Any], param: str
) -> None:
    double, url = await _choices(aiohttp_server, ("max_tokens",))
    users = f'  alice:\n    keys: ["{ALICE_KEY}"]\n    daily_tokens: 1000\n'
    proxy = await _proxy(aiohttp_server, url, "memory", users)
    client = sdk(proxy, ALICE_KEY)
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(model="gpt", messages=MESSAGES, extra_body=params)
    assert err.value.status_code == 400
    assert err.value.param == param
    assert isinstance(err.value.body, dict) and param in str(err.value.body.get("message"))
    assert double.bodies == []
    await client.close()


async def test_preferred_cap_field_never_sends_both(aiohttp_server: ServerFactory) -> None:
    """OpenAI refuses max_tokens and max_completion_tokens together: `cap_fields: preferred`
    (the default for api.openai.com) clamps what the client sent, else sets only one."""
    double, url = await _choices(aiohttp_server, ("max_tokens", "max_completion_tokens"))
    users = {"alice": {"keys": [ALICE_KEY], "max_output_tokens": 40}}
    config = make_config(url, store="memory", users=users, cap_fields="preferred")
    proxy = await aiohttp_server(create_app(config))
    client = sdk(proxy, ALICE_KEY)
    await client.chat.completions.create(model="gpt", messages=MESSAGES)
    await client.chat.completions.create(model="gpt", messages=MESSAGES, max_tokens=500)
    first, second = double.bodies
    assert first["max_completion_tokens"] == 40 and "max_tokens" not in first
    assert second["max_tokens"] == 40 and "max_completion_tokens" not in second
    await client.close()


# --- 3. a key within its user ----------------------------------------------------------------
async def test_a_keys_quota_cannot_widen_its_users(
    aiohttp_server: ServerFactory, upstream: TestServer, store_url: str
) -> None:
    users = f"""
  alice:
    daily_tokens: 300
    max_output_tokens: 16
    keys:
      - {{key: "{CI_KEY}", name: ci, daily_tokens: 5000}}
"""
    proxy = await _proxy(aiohttp_server, str(upstream.make_url("/v1")), store_url, users)
    client = sdk(proxy, CI_KEY)
    total = 0
    for _ in range(40):
        try:
            r = await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
        except openai.RateLimitError as exc:
            assert exc.code == "daily_quota_exceeded"
            assert "(key" not in exc.message  # the user's quota refused it, not the key's
            break
        assert r.usage is not None
        total += r.usage.total_tokens
    else:
        pytest.fail("the user's quota never refused the key")
    assert 0 < total <= 300  # on main: the key's 5,000 replaced the user's 300
    await client.close()


async def _hold(session: aiohttp.ClientSession, proxy: TestServer, key: str) -> int:
    """Start a stream the mock stalls after two tokens: it stays in flight until closed."""
    resp = await session.post(
        proxy.make_url("/v1/chat/completions"),
        json={"model": "mock-gpt", "messages": MESSAGES, "stream": True},
        headers={"Authorization": f"Bearer {key}", "x-mock-stall-after": "2"},
    )
    if resp.status == 200:
        await resp.content.readany()
    status = resp.status
    if status != 200:
        resp.release()
    return status


async def test_a_keys_concurrency_counts_its_own_requests_within_its_users(
    aiohttp_server: ServerFactory, upstream: TestServer, store_url: str
) -> None:
    users = f"""
  alice:
    max_concurrent_requests: 3
    keys:
      - {{key: "{CI_KEY}", name: ci, max_concurrent_requests: 2}}
      - {{key: "{OTHER_KEY}", name: wide, max_concurrent_requests: 10}}
"""
    proxy = await _proxy(aiohttp_server, str(upstream.make_url("/v1")), store_url, users)
    async with aiohttp.ClientSession() as s:
        # The other key holds two of the user's three: ci, with none of its own, gets in
        # (on main it was refused: its limit was checked against the user's whole set).
        assert await _hold(s, proxy, OTHER_KEY) == 200
        assert await _hold(s, proxy, OTHER_KEY) == 200
        assert await _hold(s, proxy, CI_KEY) == 200
        # The user is full: a key allowed 10 is refused (on main: it ran 8 at once).
        assert await _hold(s, proxy, OTHER_KEY) == 429
    async with aiohttp.ClientSession() as s:
        # Closing the first session settled all three.
        await settled(proxy.app, 4)
        assert await _hold(s, proxy, CI_KEY) == 200
        assert await _hold(s, proxy, CI_KEY) == 200
        assert await _hold(s, proxy, CI_KEY) == 429  # the key's own two
        assert await _hold(s, proxy, OTHER_KEY) == 200  # the user's third


# --- 7. reservations whose reply never arrived -----------------------------------------------
async def _blocked_on_redis(r: aioredis.Redis) -> bool:
    for c in await r.client_list():
        if c.get("cmd", "").startswith("evalsha") and "b" in c.get("flags", ""):
            return True
    return False


async def _until(check: Any, what: str) -> None:
    """Poll a condition of a real server, with a deadline (not a sleep standing in for sync)."""
    async with asyncio.timeout(20):
        while not await check():  # noqa: ASYNC110 (the condition lives in another process)
            await asyncio.sleep(0.02)


async def test_a_client_that_hangs_up_mid_reserve_leaves_nothing_in_flight(
    aiohttp_server: ServerFactory, upstream: TestServer, redis_url: str
) -> None:
    users = f'  alice:\n    keys: ["{ALICE_KEY}"]\n    max_concurrent_requests: 1\n'
    proxy = await _proxy(aiohttp_server, str(upstream.make_url("/v1")), redis_url, users)
    r = aioredis.Redis.from_url(redis_url)
    try:
        await r.client_pause(3000, all=False)  # scripts wait
        async with aiohttp.ClientSession() as s:
            task = asyncio.ensure_future(s.post(
                proxy.make_url("/v1/chat/completions"),
                json={"model": "mock-gpt", "messages": MESSAGES},
                headers={"Authorization": f"Bearer {ALICE_KEY}"},
            ))
            await _until(lambda: _blocked_on_redis(r), "the reserve is waiting on Redis")
            task.cancel()  # the client hangs up while its reserve is in flight
            with pytest.raises(asyncio.CancelledError):
                await task
        await r.client_unpause()
        await settled(proxy.app, 1)
        budget = proxy.app[st.SERVICES].budget

        async def released() -> bool:
            await budget.drain_background()
            return await r.zcard("tokenmeter:{alice}:inflight") == 0

        await _until(released, "the abandoned reservation is released")
        client = sdk(proxy, ALICE_KEY)
        ok = await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
        assert ok.usage is not None  # on main: refused for the lease's 60 s
        await client.close()
    finally:
        await r.client_unpause()
        await r.aclose()


async def test_a_timed_out_reserve_under_fail_closed_is_released(
    aiohttp_server: ServerFactory, upstream: TestServer, redis_url: str
) -> None:
    config = make_config(
        str(upstream.make_url("/v1")),
        store={"url": redis_url, "timeout_ms": 300, "on_error": "fail_closed"},
        users={"alice": {"keys": [ALICE_KEY], "max_concurrent_requests": 1}},
    )
    proxy = await aiohttp_server(create_app(config))
    client = sdk(proxy, ALICE_KEY)
    r = aioredis.Redis.from_url(redis_url)
    try:
        await r.client_pause(1500, all=False)
        with pytest.raises(openai.InternalServerError) as err:
            await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
        assert err.value.status_code == 503
        await r.client_unpause()
        # The paused script ran after the proxy gave up on it: its reservation is in Redis.
        budget = proxy.app[st.SERVICES].budget
        assert await budget.probe()
        assert await budget.replay() == 0  # the release the proxy owed
        assert await r.zcard("tokenmeter:{alice}:inflight") == 0
        ok = await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
        assert ok.usage is not None  # on main: refused for the lease's 60 s
    finally:
        await r.client_unpause()
        await r.aclose()
        await client.close()


# --- 12, 16, 18. a stalled store -------------------------------------------------------------
@pytest.fixture
async def paused_redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    r = aioredis.Redis.from_url(redis_url)
    yield r
    await r.client_unpause()
    await r.aclose()


async def test_a_stalled_store_costs_one_timeout_not_two_per_request(
    aiohttp_server: ServerFactory, upstream: TestServer, redis_url: str,
    paused_redis: aioredis.Redis, caplog: pytest.LogCaptureFixture,
) -> None:
    config = make_config(str(upstream.make_url("/v1")), store={"url": redis_url, "timeout_ms": 200},
                         users={"alice": {"keys": [ALICE_KEY], "daily_tokens": 100000}})
    proxy = await aiohttp_server(create_app(config))
    budget = proxy.app[st.SERVICES].budget
    # However slow this machine, no second request may try the store within this test: the
    # background probe alone may find it back.
    budget.health.trial_every_s = 3600
    client = sdk(proxy, ALICE_KEY)
    await paused_redis.client_pause(60000, all=False)
    usages = []
    for _ in range(20):
        r = await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
        assert r.usage is not None
        usages.append(r.usage.total_tokens)
    m = await scrape(proxy)
    # One request found the store stalled; the others did not wait on it, and no settlement
    # waited on it either (on main: 20 reserve and 20 settle timeouts).
    assert sample(m, "tokenmeter_store_errors_total", op="reserve") == 1
    assert sample(m, "tokenmeter_store_errors_total", op="settle") == 0
    assert sample(m, "tokenmeter_settle_backlog_tokens") == sum(usages)
    # Twenty usages and one release of the reserve whose reply never came.
    assert sample(m, "tokenmeter_settlements_spooled_total") == 21
    errors = [rec for rec in caplog.records
              if rec.name.startswith("tokenmeter") and rec.levelname == "ERROR"]
    assert len(errors) == 1, [e.getMessage() for e in errors]  # on main: 40 lines
    await paused_redis.client_unpause()
    assert await budget.probe() and await budget.replay() == 0
    m = await scrape(proxy)
    assert sample(m, "tokenmeter_settle_backlog") == 0
    day = [k for k in await paused_redis.keys("tokenmeter:{alice}:u:daily_tokens:*")]
    assert len(day) == 1 and await redis_int(paused_redis, day[0]) == sum(usages)
    await client.close()


async def test_an_idle_replica_reports_the_store_down(
    aiohttp_server: ServerFactory, upstream: TestServer, redis_url: str,
    paused_redis: aioredis.Redis,
) -> None:
    config = make_config(str(upstream.make_url("/v1")), store={"url": redis_url, "timeout_ms": 200},
                         users={"alice": {"keys": [ALICE_KEY]}})
    proxy = await aiohttp_server(create_app(config))
    assert sample(await scrape(proxy), "tokenmeter_store_up") == 1
    await paused_redis.client_pause(60000, all=False)
    async with aiohttp.ClientSession() as s, s.get(proxy.make_url("/readyz")) as resp:
        assert (await resp.json())["store"] == "unreachable"
    # The same probe that answered /readyz set the gauge (on main it stayed 1 on a replica
    # that served no request, so TokenmeterStoreDown never fired there).
    assert sample(await scrape(proxy), "tokenmeter_store_up") == 0


async def test_usage_replayed_after_an_outage_sends_the_quota_notice(
    aiohttp_server: ServerFactory, upstream: TestServer, redis_url: str,
    paused_redis: aioredis.Redis, caplog: pytest.LogCaptureFixture,
) -> None:
    """Live settles and replays share one path: crossing a notice threshold by usage the
    store took only after an outage is noticed too (the replay once skipped it)."""
    users = f'  alice:\n    keys: ["{ALICE_KEY}"]\n    daily_tokens: 100\n'
    text = budget_yaml(str(upstream.make_url("/v1")), redis_url, users,
                       "alerts: {thresholds: [0.5]}").replace(
        "  timeout_ms: 5000\n", "  timeout_ms: 200\n"
    )
    proxy = await aiohttp_server(create_app(parse_config(text)))
    budget = proxy.app[st.SERVICES].budget
    budget.health.trial_every_s = 3600
    client = sdk(proxy, ALICE_KEY)
    await paused_redis.client_pause(60000, all=False)
    served = 0
    while served < 60:  # past half of the quota, all of it while the store cannot count
        r = await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
        assert r.usage is not None
        served += r.usage.total_tokens
    m = await scrape(proxy)
    assert sample(m, "tokenmeter_budget_threshold_crossings_total", user="alice") == 0
    await paused_redis.client_unpause()
    assert await budget.probe() and await budget.replay() == 0
    m = await scrape(proxy)
    assert sample(m, "tokenmeter_budget_threshold_crossings_total", user="alice",
                  threshold="0.5") == 1
    notices = [r.getMessage() for r in caplog.records if r.name == "tokenmeter.alerts"]
    assert any('"threshold":0.5' in n and f'"used":{served}' in n for n in notices), notices
    await client.close()
