"""A cache hit is the answer to the request as asked, admitted like it (issue 31, items 3-5):
the real openai SDK as the client, the proxy over loopback on a real redis-server (the budget
store, and so the cache's), the simulated upstream counting what it was sent.

- An entry longer than the request's own output cap (its key's `max_output_tokens`) is not a hit
  for it: the request goes upstream with its cap.
- Under `charge_hits: full` a hit is charged what it saved, and refused with the request's 429
  when that does not fit: the counter never passes the quota.
- A hit tells its cost as any answer does: the headers of a JSON answer, the comment ending a
  stream, with the row's figures (0 under `charge_hits: none`, what was charged under `full`).
- Hits count in the request-rate and concurrency limits.
- A stream entry is reassembled once, however many hits and forms it serves."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestServer
from openai.types.chat import ChatCompletionMessageParam

from proxy.config.policy import DEFAULT_MAX_OUTPUT_TOKENS
from proxy.cost import CostLines
from proxy.pipeline.services import SERVICES
from proxy.protocol.codec import Codec
from proxy.protocol.usage import Usage
from proxy.server.app import create_app
from proxy.testing.mock_settings import MOCK_STATE, MockSettings
from tests.helpers import FakeClock, ServerFactory, daily_used, make_config, until

BIG = "sk-alice-hits-big-0001"
SMALL = "sk-alice-hits-small-01"
PRICE = {"input": 3.0, "output": 15.0}
ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": "tell me about caching"}]
NOON = 1_800_000_000.0 - 1_800_000_000.0 % 86400 + 43200  # mid-day, mid-minute: no rollover


@pytest.fixture
def mock_settings() -> MockSettings:
    return MockSettings(tokens_per_second=0, ttft_ms=0, output_tokens=64)


async def _proxy(aiohttp_server: ServerFactory, upstream: TestServer, store: str,
                 alice: dict[str, Any], **cache: Any) -> TestServer:
    config = make_config(str(upstream.make_url("/v1")), store=store,
                         users={"alice": {"keys": [BIG], **alice}},
                         extra={"cache": {"enabled": True, **cache}, "prices": {"*": PRICE}})
    return await aiohttp_server(create_app(config, clock=FakeClock(NOON)))


def _client(proxy: TestServer, key: str = BIG) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(proxy.make_url("/v1")), api_key=key, max_retries=0)


def _seen(upstream: TestServer) -> int:
    return len(upstream.app[MOCK_STATE].requests)


async def _chat(client: openai.AsyncOpenAI, **extra: Any) -> tuple[Any, dict[str, str]]:
    raw = await client.chat.completions.with_raw_response.create(
        model="mock-gpt", messages=ASK, temperature=0, **extra)
    return raw.parse(), dict(raw.headers)


@pytest.mark.timeout(60)
async def test_a_key_capped_at_50_never_gets_a_400_token_entry(
    aiohttp_server: ServerFactory, upstream: TestServer, redis_url: str
) -> None:
    alice = {"keys": [BIG, {"key": SMALL, "name": "small", "max_output_tokens": 50}]}
    proxy = await _proxy(aiohttp_server, upstream, redis_url, alice)
    long = {"extra_headers": {"x-mock-output-tokens": "400"}}
    first, h1 = await _chat(_client(proxy), **long)
    assert h1["x-tokenmeter-cache"] == "miss" and first.usage.completion_tokens == 400
    again, h2 = await _chat(_client(proxy), **long)  # the big key: a hit
    assert h2["x-tokenmeter-cache"] == "hit" and again.id == first.id
    # The same request (the same entry: scope user) through the key capped at 50.
    capped, h3 = await _chat(_client(proxy, SMALL), **long)
    assert h3["x-tokenmeter-cache"] == "miss"
    assert capped.id != first.id and capped.usage.completion_tokens <= 50
    assert _seen(upstream) == 2
    # Streamed too.
    raw = await _client(proxy, SMALL).chat.completions.with_raw_response.create(
        model="mock-gpt", messages=ASK, temperature=0, stream=True,
        **long)  # type: ignore[call-overload]
    text = "".join([c.choices[0].delta.content or "" async for c in raw.parse() if c.choices])
    assert raw.headers["x-tokenmeter-cache"] == "miss" and text != first.choices[0].message.content
    # And an entry within the cap is a hit for the capped key: 30 tokens under a 50 cap.
    short = {"extra_headers": {"x-mock-output-tokens": "30"}, "max_tokens": 40}
    await _chat(_client(proxy), **short)
    _, h4 = await _chat(_client(proxy, SMALL), **short)
    assert h4["x-tokenmeter-cache"] == "hit"


@pytest.mark.timeout(60)
async def test_full_charged_hits_are_refused_at_the_quota_never_past_it(
    aiohttp_server: ServerFactory, upstream: TestServer, redis_url: str
) -> None:
    proxy = await _proxy(aiohttp_server, upstream, redis_url, {"daily_tokens": 300},
                         charge_hits="full")
    client = _client(proxy)
    first, h = await _chat(client, max_tokens=100)
    assert h["x-tokenmeter-cache"] == "miss"
    used = first.usage.total_tokens
    assert 300 // used >= 2  # room for the miss and at least one hit, not for ten
    served, refused = 1, 0
    for _ in range(10):
        try:
            _, h = await _chat(client, max_tokens=100)
        except openai.RateLimitError as exc:
            refused += 1
            assert "Daily tokens limit reached" in str(exc)
            continue
        assert h["x-tokenmeter-cache"] == "hit"
        served += 1
    assert (served, refused) == (300 // used, 10 - (300 // used - 1))
    await until(_equals(proxy, served * used))
    assert await daily_used(proxy) <= 300
    assert _seen(upstream) == 1


def _equals(proxy: TestServer, expected: int) -> Any:
    async def check() -> bool:
        return await daily_used(proxy) == expected
    return check


@pytest.mark.timeout(60)
@pytest.mark.parametrize("charge_hits", ["none", "full"])
async def test_a_hit_tells_its_cost_in_headers_and_in_the_streams_comment(
    aiohttp_server: ServerFactory, upstream: TestServer, redis_url: str, charge_hits: str
) -> None:
    proxy = await _proxy(aiohttp_server, upstream, redis_url, {"daily_tokens": 100_000},
                         charge_hits=charge_hits)
    first, h1 = await _chat(_client(proxy), max_tokens=100)
    assert h1["x-tokenmeter-cache"] == "miss"
    saved = Usage(input_tokens=first.usage.prompt_tokens,
                  output_tokens=first.usage.completion_tokens)
    figures = ({"cost_usd": "0.000000000", "input_tokens": "0", "output_tokens": "0"}
               if charge_hits == "none" else
               {"cost_usd": f"{Decimal(CostLines.of(_price(proxy), saved).nanousd).scaleb(-9):f}",
                "input_tokens": str(saved.input_tokens),
                "output_tokens": str(saved.output_tokens)})
    _, h2 = await _chat(_client(proxy), max_tokens=100)
    assert h2["x-tokenmeter-cache"] == "hit"
    assert {k: h2.get(f"x-tokenmeter-{k.replace('_', '-')}") for k in figures} == figures
    async with aiohttp.ClientSession() as s, s.post(
        proxy.make_url("/v1/chat/completions"), headers={"Authorization": f"Bearer {BIG}"},
        json={"model": "mock-gpt", "messages": ASK, "temperature": 0, "max_tokens": 100,
              "stream": True},
    ) as r:
        assert r.headers["x-tokenmeter-cache"] == "hit"
        body = (await r.read()).decode()
    comment = body.rstrip("\n").rsplit("\n", 1)[-1]
    line = " ".join(f"{k}={v}" for k, v in figures.items())
    assert comment == f": tokenmeter {line}", body[-300:]


def _price(proxy: TestServer) -> Any:
    price = proxy.app[SERVICES].runtime.current.price_for("mock-gpt")
    assert price is not None
    return price


@pytest.mark.timeout(60)
async def test_hits_count_in_the_request_rate(
    aiohttp_server: ServerFactory, upstream: TestServer, redis_url: str
) -> None:
    proxy = await _proxy(aiohttp_server, upstream, redis_url, {"requests_per_minute": 3})
    client = _client(proxy)
    _, h = await _chat(client, max_tokens=100)  # the miss: 1 of 3
    assert h["x-tokenmeter-cache"] == "miss"
    for _ in range(2):
        _, h = await _chat(client, max_tokens=100)
        assert h["x-tokenmeter-cache"] == "hit"
    with pytest.raises(openai.RateLimitError) as refused:  # the third hit: the 4th request
        await _chat(client, max_tokens=100)
    assert "Requests per minute limit reached" in str(refused.value)
    assert _seen(upstream) == 1


@pytest.mark.timeout(60)
async def test_hits_count_in_the_concurrency_limit(
    aiohttp_server: ServerFactory, upstream: TestServer, redis_url: str
) -> None:
    proxy = await _proxy(aiohttp_server, upstream, redis_url, {"max_concurrent_requests": 1})
    client = _client(proxy)
    _, h = await _chat(client, max_tokens=100)
    assert h["x-tokenmeter-cache"] == "miss"
    # Another request in flight (its upstream stalls after one token) holds the one place.
    async with aiohttp.ClientSession() as s, s.post(
        proxy.make_url("/v1/chat/completions"),
        headers={"Authorization": f"Bearer {BIG}", "x-mock-stall-after": "1"},
        json={"model": "mock-gpt", "messages": [{"role": "user", "content": "other"}],
              "temperature": 0, "max_tokens": 100, "stream": True},
    ) as held:
        assert held.status == 200
        await held.content.readany()  # its first token: it is in flight
        with pytest.raises(openai.RateLimitError) as refused:
            await _chat(client, max_tokens=100)
        assert "concurrent" in str(refused.value)
        held.close()
    # Its place given back when the proxy settles the stream its client left, the hit is served.
    async def served() -> bool:
        try:
            _, h = await _chat(client, max_tokens=100)
        except openai.RateLimitError:
            return False
        return h["x-tokenmeter-cache"] == "hit"

    await until(served, deadline=30, every=0.1)


@pytest.mark.timeout(60)
async def test_a_stream_entry_is_reassembled_once_whatever_its_hits(
    aiohttp_server: ServerFactory, upstream: TestServer, redis_url: str,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    reassemble = Codec.assemble_stream

    def counted(codec: Codec, raw: bytes) -> dict[str, Any] | None:
        calls.append(codec.operation)
        answer: dict[str, Any] | None = reassemble(codec, raw)
        return answer

    monkeypatch.setattr(Codec, "assemble_stream", counted)
    proxy = await _proxy(aiohttp_server, upstream, redis_url, {})
    client = _client(proxy)
    long = {"extra_headers": {"x-mock-output-tokens": "2000"},
            "max_tokens": DEFAULT_MAX_OUTPUT_TOKENS}
    raw = await client.chat.completions.with_raw_response.create(
        model="mock-gpt", messages=ASK, temperature=0, stream=True,
        **long)  # type: ignore[call-overload]
    text = "".join([c.choices[0].delta.content or "" async for c in raw.parse() if c.choices])
    assert raw.headers["x-tokenmeter-cache"] == "miss"
    for _ in range(3):  # as JSON, as a stream, as a stream with usage: each several times
        answer, h = await _chat(client, **long)
        assert h["x-tokenmeter-cache"] == "hit" and answer.choices[0].message.content == text
        for usage in (False, True):
            options = {"stream_options": {"include_usage": True}} if usage else {}
            again = await client.chat.completions.create(
                model="mock-gpt", messages=ASK, temperature=0, stream=True, **options,
                **long)  # type: ignore[call-overload]
            chunks = [c async for c in again]
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert calls == ["chat"]
    assert _seen(upstream) == 1
