"""The `estimate` admission policy enforced by real proxies over loopback, driven by the real
openai SDK against the mock upstream: on the in-process store, and on a real redis-server shared
by two replicas."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable
from datetime import datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import aiohttp
import openai
import pytest
import redis.asyncio as aioredis
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.budget import limits as lim
from proxy.budget.store_redis import RedisStore
from proxy.pipeline import services as st
from proxy.server.app import create_app
from proxy.testing.mock_upstream import MOCK_STATE, MockSettings
from tests.helpers import (
    ALICE_KEY,
    MESSAGES,
    ServerFactory,
    budget_yaml,
    daily_used,
    make_config,
    prompt_estimate,
    sample,
    scrape,
    sdk,
    until,
)
from tests.helpers import ProxiesFactory as Factory
from tests.servers import ServedProxy

QUOTA = 20_000
ASKED = 32_000


@pytest.fixture
def mock_settings() -> MockSettings:
    # Paced: a stream arrives event by event, as a model's does, not in one write.
    return MockSettings(tokens_per_second=4000, ttft_ms=0, output_tokens=900)




def _alice(daily: int, **admission: Any) -> dict[str, Any]:
    """Alice under `admission: {policy: estimate, ...}`, from the configuration."""
    return {"alice": {"keys": [ALICE_KEY], "daily_tokens": daily, "max_output_tokens": 64_000,
                      "admission": {"policy": "estimate", **admission}}}


async def test_non_streamed_request_falls_back_to_clamp(
    make_proxies: Factory, upstream: TestServer
) -> None:
    proxies = await make_proxies(_alice(QUOTA))
    client = sdk(proxies[-1], ALICE_KEY)
    raw = await client.chat.completions.with_raw_response.create(
        model="mock-gpt", messages=MESSAGES, max_tokens=ASKED,
    )
    completion = raw.parse()
    granted = QUOTA - prompt_estimate()
    assert raw.headers["x-tokenmeter-output-clamped"] == f"{ASKED}->{granted}"
    sent = upstream.app[MOCK_STATE].requests[-1].body
    assert sent is not None and sent["max_tokens"] == granted
    assert completion.usage is not None
    assert await daily_used(proxies[0]) == completion.usage.total_tokens <= QUOTA
    await client.close()


async def _stream(client: openai.AsyncOpenAI, tokens: int,
                  max_tokens: int = ASKED) -> tuple[int, int | None]:
    """A streamed chat completion of `tokens` output tokens (if let run): the content events the
    client got (one token each) and the completion tokens the upstream reported, if it did."""
    got, reported = 0, None
    stream = await client.chat.completions.create(
        model="mock-gpt", messages=MESSAGES, max_tokens=max_tokens, stream=True,
        stream_options={"include_usage": True},
        extra_headers={"x-mock-output-tokens": str(tokens)},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            got += 1
        if chunk.usage is not None:
            reported = chunk.usage.completion_tokens
    return got, reported


async def test_agent_stream_is_served_with_an_estimate_not_its_cap(
    make_proxies: Factory, upstream: TestServer
) -> None:
    """20,000 left, max_tokens 32,000, streamed: served whole, the cap kept upstream, the
    day's counter exactly what was used."""
    proxies = await make_proxies(_alice(QUOTA))
    client = sdk(proxies[-1], ALICE_KEY)
    got, reported = await _stream(client, 900)
    assert got == reported == 900
    sent = upstream.app[MOCK_STATE].requests[-1].body
    assert sent is not None and sent["max_tokens"] == ASKED
    prompt = prompt_estimate()
    assert await daily_used(proxies[0]) == prompt + 900 <= QUOTA
    await client.close()


async def test_long_streams_are_topped_up_then_cut_at_the_quota(
    make_proxies: Factory, upstream: TestServer
) -> None:
    """An estimate of 300: a 1,500-token stream is topped up as it runs and served whole; the
    stream that runs into the end of the day's quota is cut there with an error event the SDK
    raises naming the quota, charged what it produced, and the counter never passes the
    limit."""
    quota = 4_000
    proxies = await make_proxies(_alice(quota, initial_estimate=300))
    client = sdk(proxies[-1], ALICE_KEY)
    prompt = prompt_estimate()
    got, reported = await _stream(client, 1_500)
    assert got == reported == 1_500
    used = prompt + 1_500
    await until(lambda: _charged(proxies[0], used))  # settled after the client's [DONE]
    metrics = await scrape(proxies[-1])
    assert sample(metrics, "tokenmeter_budget_topups_total", user="alice",
                  outcome="granted") >= 4
    # The learned estimate is now 1,500 (one completed stream): the next stream reserves it
    # and is topped up until the day runs out.
    client2 = sdk(proxies[0], ALICE_KEY)
    counted = 0
    with pytest.raises(openai.APIError) as cut:
        stream = await client2.chat.completions.create(
            model="mock-gpt", messages=MESSAGES, max_tokens=ASKED, stream=True,
            extra_headers={"x-mock-output-tokens": "20000"},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                counted += 1
    assert cut.value.code == "daily_quota_exceeded"
    assert "daily tokens" in cut.value.message.lower()
    assert 0 < counted <= quota - used - prompt
    await until(lambda: _charged(proxies[0], used + prompt + counted))

    async def booked_as_over_budget() -> bool:  # settle records the request last
        metrics = await scrape(proxies[0])
        return sample(metrics, "tokenmeter_requests_total", error_class="budget_exceeded") == 1

    await until(booked_as_over_budget)
    metrics = await scrape(proxies[0])
    assert sample(metrics, "tokenmeter_budget_streams_ended_total", user="alice",
                  window="daily_tokens") == 1
    # The next request finds the day spent: a 429 in OpenAI's shape.
    with pytest.raises(openai.RateLimitError) as refused:
        await _stream(client, 100)
    assert refused.value.code == "daily_quota_exceeded"
    await client.close()
    await client2.close()


async def test_a_teams_monthly_window_ends_a_topped_up_stream(
    make_proxies: Factory, upstream: TestServer
) -> None:
    """The issue-12 windows under `estimate`: top-ups check every window of the request, a
    team's monthly quota among them; the stream that reaches it is cut with its code, and the
    team's counter never passes it."""
    team_quota = 3_000
    users = _alice(1_000_000, initial_estimate=300)
    users["alice"]["team"] = "platform"
    proxies = await make_proxies(users, teams={"platform": {"monthly_tokens": team_quota}})
    client = sdk(proxies[-1], ALICE_KEY)
    counted = 0
    with pytest.raises(openai.APIError) as cut:
        stream = await client.chat.completions.create(
            model="mock-gpt", messages=MESSAGES, max_tokens=ASKED, stream=True,
            extra_headers={"x-mock-output-tokens": "20000"},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                counted += 1
    assert cut.value.code == "monthly_quota_exceeded"
    charged = prompt_estimate() + counted
    assert 300 < charged <= team_quota
    runtime = proxies[0].app[st.SERVICES].runtime.current
    budget = proxies[0].app[st.SERVICES].budget
    (team,) = [w for w in lim.windows_at(runtime.config, "alice", budget.clock())
               if w.name is lim.WindowName.MONTHLY_TOKENS]

    async def team_used() -> bool:
        return (await budget.store.read([team.key]))[0] == charged

    await until(team_used)
    await client.close()


async def test_race_for_the_last_tokens(make_proxies: Factory, store_url: str) -> None:
    """200 streams of 2,000 tokens each race across the replicas for a day's 5,000 tokens under
    `estimate` (an estimate of 300). Asserted: the counter never passes the quota and equals
    what the served and cut streams produced (plus their prompts); every refusal is a 429 in
    OpenAI's shape whose message says less was left than its prompt plus min_output_tokens
    (so none was refused while its own minimum fitted); every admitted stream either finished
    whole or was cut with the quota's error event."""
    quota = 5_000
    proxies = await make_proxies(_alice(quota, initial_estimate=300))
    clients = [sdk(p, ALICE_KEY) for p in proxies]
    prompt = prompt_estimate()

    async def one(i: int) -> tuple[str, int]:
        counted = 0
        try:
            stream = await clients[i % len(clients)].chat.completions.create(
                model="mock-gpt", messages=MESSAGES, max_tokens=ASKED, stream=True,
                extra_headers={"x-mock-output-tokens": "2000"},
            )
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    counted += 1
        except openai.RateLimitError as exc:
            assert exc.status_code == 429 and exc.code == "daily_quota_exceeded"
            assert exc.response.headers["x-should-retry"] == "false"
            left = re.search(r": ([0-9,]+) of [0-9,]+ left", exc.message)
            assert left is not None, exc.message
            assert int(left.group(1).replace(",", "")) < prompt + 256
            return "refused", 0
        except openai.APIError as exc:
            assert exc.code == "daily_quota_exceeded", exc
            return "cut", counted
        assert counted == 2_000
        return "served", counted

    results = await asyncio.gather(*(one(i) for i in range(200)))
    admitted = [n for kind, n in results if kind != "refused"]
    assert any(kind == "refused" for kind, _ in results)
    assert any(kind == "cut" for kind, _ in results)
    charged = sum(prompt + n for n in admitted)
    assert charged <= quota
    await until(lambda: _charged(proxies[0], charged))
    for c in clients:
        await c.close()



async def test_an_upstream_that_sends_everything_at_once_is_cut_within_its_reservation(
    make_proxies: Factory
) -> None:
    """An unpaced upstream: the whole answer arrives in a few large chunks. The relay forwards
    a topped-up stream event by event, so it still stops short of the quota."""
    quota = 1_000
    proxies = await make_proxies(_alice(quota, initial_estimate=300))
    client = sdk(proxies[-1], ALICE_KEY)
    counted = 0
    with pytest.raises(openai.APIError) as cut:
        stream = await client.chat.completions.create(
            model="mock-gpt", messages=MESSAGES, max_tokens=ASKED, stream=True,
            extra_headers={"x-mock-output-tokens": "2000", "x-mock-tokens-per-second": "0"},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                counted += 1
    assert cut.value.code == "daily_quota_exceeded"
    charged = prompt_estimate() + counted
    assert charged <= quota
    await until(lambda: _charged(proxies[0], charged))
    await client.close()


async def _charged(proxy: TestServer, expected: int) -> bool:
    """The stream's settle is done once the counter shows exactly its charge (the client may
    see the error event before the proxy has settled)."""
    return await daily_used(proxy) == expected


async def test_a_killed_proxys_topped_up_reservation_is_released_by_its_lease(
    upstream: TestServer, redis_url: str, tmp_path: Path, aiohttp_server: ServerFactory
) -> None:
    """A `tokenmeter serve` on Redis is SIGKILLed during a stream that has been topped up: once
    the lease (2 s) has run out, the next reservation reaps it whole, top-ups included, and
    the day's counter is back to what the settled requests used: nothing double-charged."""
    cfg = tmp_path / "tm.yaml"
    users = (f"  alice:\n    keys: [{ALICE_KEY}]\n    daily_tokens: 100000\n"
             "    max_output_tokens: 64000\n"
             "    admission: {policy: estimate, initial_estimate: 300}\n")
    cfg.write_text(budget_yaml(str(upstream.make_url("/v1")), redis_url, users,
                               lease_seconds=2))
    proxy = ServedProxy(cfg, tmp_path / "proxy.log")
    r = aioredis.from_url(redis_url)
    day = datetime.now(ZoneInfo("UTC")).strftime("%Y%m%d")
    key = lim.daily_key("tokenmeter", "alice", "daily_tokens", day)
    slot = "tokenmeter:{alice}"
    prompt = prompt_estimate()

    async def used() -> int:
        return int(await r.get(key) or 0)

    try:
        await proxy.started()
        client = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key=ALICE_KEY,
                                    max_retries=0)
        got, _ = await _stream(client, 500)
        assert got == 500
        await client.close()
        settled = prompt + 500
        await until(lambda: _equals(used(), settled))
        async with aiohttp.ClientSession() as s:
            resp = await s.post(
                f"{proxy.url}/v1/chat/completions",
                json={"model": "mock-gpt", "messages": MESSAGES, "stream": True,
                      "max_tokens": ASKED},
                headers={"Authorization": f"Bearer {ALICE_KEY}",
                         "x-mock-output-tokens": "20000", "x-mock-tokens-per-second": "400"},
            )
            assert resp.status == 200
            body = b""
            # The estimate learned is 500; past 600 tokens the stream has been topped up.
            while body.count(b'"content":" ') < 600:
                body += await resp.content.readany()
            await until(lambda: _above(used(), settled + prompt + 500))
            proxy.kill()
        held = await used()
        assert held > settled + prompt + 500  # the topped-up reservation, held by no one
    finally:
        proxy.kill()

    await until(lambda: _lease_over(redis_url, slot), deadline=10.0)
    config = make_config(str(upstream.make_url("/v1")), store=redis_url,
                         users={"alice": {"keys": [ALICE_KEY], "daily_tokens": 100_000}})
    survivor = await aiohttp_server(create_app(config))
    client = sdk(survivor, ALICE_KEY)
    done = await client.chat.completions.create(
        model="mock-gpt", messages=MESSAGES, max_tokens=100,
        extra_headers={"x-mock-output-tokens": "16"},
    )
    assert done.usage is not None
    total = done.usage.total_tokens
    await until(lambda: _equals(used(), settled + total))
    assert await r.zcard(f"{slot}:inflight") == 0
    await client.close()
    await r.aclose()


async def _lease_over(redis_url: str, slot: str) -> bool:
    """Every reservation's lease in `slot` has run out, by Redis's own clock."""
    store = RedisStore(redis_url, 5000)
    try:
        deadlines = list((await store.leases(slot)).values())
    finally:
        await store.close()
    r = aioredis.from_url(redis_url)
    try:
        now: tuple[int, int] = await r.time()
    finally:
        await r.aclose()
    return bool(deadlines) and max(deadlines) < now[0] + now[1] / 1e6


async def _equals(value: Awaitable[int], expected: int) -> bool:
    return await value == expected


async def _above(value: Awaitable[int], floor: int) -> bool:
    return await value > floor


# --- an upstream that frames its events with CRLF or CR, and bunches them -----------------------

EOLS = {"lf": b"\n", "crlf": b"\r\n", "cr": b"\r"}


async def _bunching_chat(request: web.Request) -> web.StreamResponse:
    """OpenAI's streamed chat completions, `x-test-tokens` content events of one token each,
    its lines ended by `x-test-eol` (lf, crlf, cr) and the events bunched into writes of
    `BUNCH`: a fast upstream whose every network chunk holds many events."""
    raw = await request.read()
    body = json.loads(raw)
    eol = EOLS[request.headers["x-test-eol"]]
    tokens = int(request.headers["x-test-tokens"])

    def event(delta: dict[str, Any], finish: str | None = None) -> bytes:
        chunk = {"id": "chatcmpl-t", "object": "chat.completion.chunk", "created": 1,
                 "model": body["model"],
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        return b"data: " + json.dumps(chunk).encode() + eol + eol

    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    events = [event({"content": " tok"}) for _ in range(tokens)]
    events += [event({}, "stop"), b"data: [DONE]" + eol + eol]
    for at in range(0, len(events), BUNCH):
        await resp.write(b"".join(events[at:at + BUNCH]))
    return resp


BUNCH = 200


@pytest.fixture
async def bunching_upstream(aiohttp_server: ServerFactory) -> TestServer:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _bunching_chat)
    return await aiohttp_server(app)


async def _cut_at_the_quota(proxy: TestServer, eol: str) -> int:
    """A 2,000-token stream, in chunks of `BUNCH` events framed by `eol`, that its day's quota
    cannot hold: cut with the quota's error event; returns the content events the client got."""
    client = sdk(proxy, ALICE_KEY)
    counted = 0
    try:
        with pytest.raises(openai.APIError) as cut:
            stream = await client.chat.completions.create(
                model="mock-gpt", messages=MESSAGES, max_tokens=ASKED, stream=True,
                extra_headers={"x-test-eol": eol, "x-test-tokens": "2000"},
            )
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    counted += 1
    finally:
        await client.close()
    assert cut.value.code == "daily_quota_exceeded", cut.value
    return counted


@pytest.mark.parametrize("eol", ["lf", "crlf", "cr"])
async def test_a_bunched_stream_is_cut_at_its_quota_whatever_its_line_ends(
    eol: str, bunching_upstream: TestServer, store_url: str, aiohttp_server: ServerFactory
) -> None:
    """A fast upstream that bunches 200 events into each write, its lines ended by LF, CRLF or
    a lone CR (all three are SSE): the tap cuts every chunk where its events end, so each top-up
    check falls on an event, and the stream is ended between two events, with the quota's
    error event, just short of the day's limit, at the same event as the LF-framed stream. (On
    main a CR-framed stream never looked to be between events, so it was never ended: it ran
    whole, 2,000 tokens past a 1,000-token day.)"""
    quota = 1_000
    config = make_config(str(bunching_upstream.make_url("/v1")), store=store_url,
                         users=_alice(quota, initial_estimate=300))
    lf_proxy = await aiohttp_server(create_app(config))
    lf = await _cut_at_the_quota(lf_proxy, "lf")
    prompt = prompt_estimate()
    await until(lambda: _charged(lf_proxy, prompt + lf))
    # A fresh proxy (and day) for the stream under test: same quota, same estimate.
    config = make_config(str(bunching_upstream.make_url("/v1")),
                         store={"url": store_url, "prefix": "framed"},
                         users=_alice(quota, initial_estimate=300))
    proxy = await aiohttp_server(create_app(config))
    counted = await _cut_at_the_quota(proxy, eol)
    assert prompt + counted <= quota
    # The line falls where the LF-framed stream's fell, give or take the event a top-up's
    # answer lands on; a few events short of the limit, not hundreds.
    assert abs(counted - lf) <= 2, (lf, counted)
    assert quota - (prompt + counted) <= 16, counted
    await until(lambda: _charged(proxy, prompt + counted))
