"""The response cache through the whole proxy: the openai and anthropic SDKs as clients, the
simulated upstream (which counts what it was sent), the in-process store or a real
redis-server."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
import redis.asyncio as aioredis
import yaml
from aiohttp.test_utils import TestServer
from openai.types.chat import ChatCompletionMessageParam

from proxy.pipeline.services import SERVICES
from proxy.server.app import build_runtime, create_app
from proxy.testing.mock_settings import MOCK_STATE, MockSettings
from tests.helpers import (
    FakeClock,
    ServerFactory,
    config_data,
    daily_used,
    make_config,
    sample,
    scrape,
    settled,
    until,
)
from tests.servers import RedisServer, ServedProxy

ALICE = "sk-alice-cache-00001"
ALICE_2 = "sk-alice-cache-00002"
BOB = "sk-bob-cache-000001"
ASK: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "what is the capital of France"}]
USERS = {"alice": {"keys": [ALICE, ALICE_2], "daily_tokens": 1_000_000},
         "bob": {"keys": [BOB], "daily_tokens": 1_000_000}}


def _seen(upstream: TestServer) -> int:
    return len(upstream.app[MOCK_STATE].requests)


async def _proxy(aiohttp_server: ServerFactory, upstream: TestServer, *, store: str = "memory",
                 clock: FakeClock | None = None, api: str = "openai",
                 users: dict[str, Any] | None = None, **cache: Any) -> TestServer:
    config = make_config(str(upstream.make_url("/v1")), store=store, users=users or USERS,
                         api=api,
                         extra={"cache": {"enabled": True, **cache}})
    app = create_app(config, clock=clock) if clock is not None else create_app(config)
    return await aiohttp_server(app)


def _openai(proxy: TestServer, key: str = ALICE) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(proxy.make_url("/v1")), api_key=key, max_retries=0)


async def _chat(client: openai.AsyncOpenAI, **extra: Any) -> tuple[Any, dict[str, str]]:
    raw = await client.chat.completions.with_raw_response.create(
        model="mock-gpt", messages=ASK, temperature=0, max_tokens=50, **extra)
    return raw.parse(), dict(raw.headers)


async def _stream(client: openai.AsyncOpenAI, include_usage: bool,
                  **extra: Any) -> tuple[str, str | None, Any, dict[str, str], int]:
    options = {"stream_options": {"include_usage": True}} if include_usage else {}
    raw = await client.chat.completions.with_raw_response.create(
        model="mock-gpt", messages=ASK, temperature=0, max_tokens=50, stream=True,
        **options, **extra)  # type: ignore[call-overload]
    text, finish, usage, usage_chunks = "", None, None, 0
    async for chunk in raw.parse():
        if chunk.usage is not None:
            usage, usage_chunks = chunk.usage, usage_chunks + 1
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish, usage, dict(raw.headers), usage_chunks


@pytest.mark.timeout(60)
async def test_a_second_identical_chat_is_a_hit_in_either_form_and_costs_nothing(
    aiohttp_server: ServerFactory, upstream: TestServer
) -> None:
    proxy = await _proxy(aiohttp_server, upstream)
    client = _openai(proxy)
    first, h1 = await _chat(client)
    assert h1["x-tokenmeter-cache"] == "miss" and "age" not in h1
    used = await daily_used(proxy)
    assert used > 0
    second, h2 = await _chat(client)
    assert h2["x-tokenmeter-cache"] == "hit" and int(h2["age"]) >= 0
    assert second.model_dump() == first.model_dump()  # the same id: the stored answer
    assert _seen(upstream) == 1
    # Streamed from the JSON entry: the same text and finish, the usage chunk only if asked.
    text, finish, usage, h3, chunks = await _stream(client, include_usage=False)
    assert (text, finish) == (first.choices[0].message.content, first.choices[0].finish_reason)
    assert h3["x-tokenmeter-cache"] == "hit" and usage is None and chunks == 0
    text, _, usage, _, chunks = await _stream(client, include_usage=True)
    assert text == first.choices[0].message.content and chunks == 1
    assert usage.model_dump() == first.usage.model_dump()
    assert _seen(upstream) == 1
    # Hits charge the budget nothing (charge_hits: none) and ask no reservation.
    assert await daily_used(proxy) == used


@pytest.mark.timeout(60)
async def test_a_stream_entry_answers_a_json_request(
    aiohttp_server: ServerFactory, upstream: TestServer
) -> None:
    proxy = await _proxy(aiohttp_server, upstream)
    client = _openai(proxy)
    text, finish, _, h1, _ = await _stream(client, include_usage=False)
    assert h1["x-tokenmeter-cache"] == "miss" and text
    answer, h2 = await _chat(client)
    assert h2["x-tokenmeter-cache"] == "hit"
    assert answer.choices[0].message.content == text
    assert answer.choices[0].finish_reason == finish
    # The entry holds the usage the upstream reported, though this client never saw it.
    assert answer.usage is not None and answer.usage.completion_tokens > 0
    assert _seen(upstream) == 1


@pytest.mark.timeout(60)
async def test_anthropic_messages_hit_as_json_and_as_a_stream(
    aiohttp_server: ServerFactory, upstream: TestServer
) -> None:
    proxy = await _proxy(aiohttp_server, upstream, api="anthropic")
    client = anthropic.AsyncAnthropic(base_url=str(proxy.make_url("")), api_key=ALICE,
                                      max_retries=0)
    ask: dict[str, Any] = {"model": "claude-mock", "max_tokens": 64,
                           "extra_body": {"temperature": 0},
                           "messages": [{"role": "user", "content": "hello there"}]}
    async with client.messages.stream(**ask) as stream:
        streamed = await stream.get_final_message()
    raw = await client.messages.with_raw_response.create(**ask)
    assert raw.headers["x-tokenmeter-cache"] == "hit"
    answer = await raw.parse()
    assert answer.model_dump() == streamed.model_dump()
    async with client.messages.stream(**ask) as stream:
        again = await stream.get_final_message()
    assert again.model_dump() == streamed.model_dump()
    assert _seen(upstream) == 1


@pytest.mark.timeout(60)
async def test_scope_user_keeps_users_apart_and_global_shares(
    aiohttp_server: ServerFactory, upstream: TestServer
) -> None:
    proxy = await _proxy(aiohttp_server, upstream)
    first, _ = await _chat(_openai(proxy, ALICE))
    _, mine = await _chat(_openai(proxy, ALICE_2))  # another key of the same user
    assert mine["x-tokenmeter-cache"] == "hit"
    other, h = await _chat(_openai(proxy, BOB))
    assert h["x-tokenmeter-cache"] == "miss" and other.id != first.id
    assert _seen(upstream) == 2
    shared = await _proxy(aiohttp_server, upstream, scope="global")
    await _chat(_openai(shared, ALICE))
    _, h = await _chat(_openai(shared, BOB))
    assert h["x-tokenmeter-cache"] == "hit"
    assert _seen(upstream) == 3


@pytest.mark.timeout(60)
async def test_sampled_requests_are_not_cached_unless_configured(
    aiohttp_server: ServerFactory, upstream: TestServer
) -> None:
    proxy = await _proxy(aiohttp_server, upstream)
    client = _openai(proxy)
    for _ in range(2):
        _, h = await _chat(client, extra_body={"temperature": 0.7})
        assert h["x-tokenmeter-cache"] == "bypass"
        assert h["x-tokenmeter-cache-reason"] == "sampled"
    assert _seen(upstream) == 2
    sampled = await _proxy(aiohttp_server, upstream, cache_sampled=True)
    for _ in range(2):
        await _chat(_openai(sampled), extra_body={"temperature": 0.7})
    assert _seen(upstream) == 3


@pytest.mark.timeout(60)
async def test_a_bypass_says_why_in_a_header_and_the_access_log(
    aiohttp_server: ServerFactory, upstream: TestServer, caplog: pytest.LogCaptureFixture
) -> None:
    """`x-tokenmeter-cache: bypass` comes with `x-tokenmeter-cache-reason`, as the openai SDK's
    raw response shows it, and the access log's line carries the same `cache_reason`; a miss
    and a hit carry none."""
    caplog.set_level("INFO", logger="tokenmeter.access")
    proxy = await _proxy(aiohttp_server, upstream)
    client = _openai(proxy)
    seen = []
    asks: list[tuple[dict[str, Any], str | None]] = [
        ({}, None),  # a miss
        ({}, None),  # a hit
        ({"extra_body": {"temperature": 0.7}}, "sampled"),
        ({"extra_headers": {"Cache-Control": "no-store"}}, "no-store"),
        ({"extra_headers": {"Cache-Control": "no-cache"}}, "no-cache"),
    ]
    for extra, reason in asks:
        _, h = await _chat(client, **extra)
        seen.append((h["x-tokenmeter-cache"], h.get("x-tokenmeter-cache-reason")))
        assert (h["x-tokenmeter-cache"] == "bypass") == (reason is not None)
    raw = await client.embeddings.with_raw_response.create(model="mock-gpt", input="hello")
    seen.append((raw.headers["x-tokenmeter-cache"], raw.headers.get("x-tokenmeter-cache-reason")))
    assert seen == [("miss", None), ("hit", None), ("bypass", "sampled"),
                    ("bypass", "no-store"), ("bypass", "no-cache"), ("bypass", "not-cacheable")]
    await settled(proxy.app, len(seen))
    lines = [json.loads(r.getMessage()) for r in caplog.records
             if r.name == "tokenmeter.access"]
    assert [(line["cache"], line["cache_reason"]) for line in lines] == [
        ("miss", None), ("hit", None), ("bypass", "sampled"), ("bypass", "no-store"),
        ("bypass", "no-cache"), ("bypass", "not-cacheable")]


@pytest.mark.timeout(60)
async def test_an_answer_too_large_to_keep_says_so(
    aiohttp_server: ServerFactory, upstream: TestServer, caplog: pytest.LogCaptureFixture
) -> None:
    """An answer past `max_entry_kb` is a miss that is not stored: a JSON answer says
    `too-large` beside `miss` (its size is known before its headers go out), a stream says it
    in its access-log line, and neither becomes an entry (the next ask goes upstream)."""
    caplog.set_level("INFO", logger="tokenmeter.access")
    proxy = await _proxy(aiohttp_server, upstream, max_entry_kb=1)
    client = _openai(proxy)
    big = {"x-mock-output-tokens": "400", "x-mock-tokens-per-second": "100000"}
    small = {"extra_headers": {"x-mock-output-tokens": "4"}}
    seen = []
    for _ in range(2):
        raw = await client.chat.completions.with_raw_response.create(
            model="mock-gpt", messages=ASK, temperature=0, max_tokens=500, extra_headers=big)
        seen.append((raw.headers["x-tokenmeter-cache"],
                     raw.headers.get("x-tokenmeter-cache-reason")))
    # A stream's bound is STREAM_FACTOR times the entry's: 16 KB of events, passed here.
    streamed = await client.chat.completions.with_raw_response.create(
        model="mock-gpt", messages=ASK, temperature=0, max_tokens=2000, stream=True,
        extra_headers={"x-mock-output-tokens": "2000", "x-mock-tokens-per-second": "100000"})
    async for _ in streamed.parse():
        pass
    seen.append((streamed.headers["x-tokenmeter-cache"],
                 streamed.headers.get("x-tokenmeter-cache-reason")))
    for _ in range(2):
        _, h = await _chat(client, **small)
        seen.append((h["x-tokenmeter-cache"], h.get("x-tokenmeter-cache-reason")))
    # The stream's headers left before its size was known: a plain miss there.
    assert seen == [("miss", "too-large"), ("miss", "too-large"), ("miss", None),
                    ("miss", None), ("hit", None)]
    await settled(proxy.app, 5)
    lines = [json.loads(r.getMessage()) for r in caplog.records
             if r.name == "tokenmeter.access"]
    assert [(line["cache"], line["cache_reason"]) for line in lines] == [
        ("miss", "too-large"), ("miss", "too-large"), ("miss", "too-large"), ("miss", None),
        ("hit", None)]
    assert _seen(upstream) == 4


@pytest.mark.timeout(60)
async def test_a_configuration_that_makes_hits_impossible_is_warned_at_start(
    aiohttp_server: ServerFactory, upstream: TestServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Pass-through mode with the cache on: no request is ever looked up; the proxy says so
    when it starts, and a pass-through request says why it was passed by."""
    caplog.set_level("WARNING")
    url = str(upstream.make_url("/v1"))
    await aiohttp_server(create_app(make_config(url, extra={"cache": {"enabled": True}},
                                                users=USERS)))
    assert not [r for r in caplog.records if "no request can be a hit" in r.getMessage()]
    proxy = await aiohttp_server(create_app(make_config(
        url, extra={"mode": "passthrough", "cache": {"enabled": True}})))
    (warning,) = [r for r in caplog.records if "no request can be a hit" in r.getMessage()]
    assert warning.levelname == "WARNING" and "mode: passthrough" in warning.getMessage()
    _, h = await _chat(_openai(proxy, "sk-client-own-key-0001"))
    assert h["x-tokenmeter-cache"] == "bypass"
    assert h["x-tokenmeter-cache-reason"] == "passthrough"


@pytest.mark.timeout(60)
async def test_no_cache_refreshes_the_entry_and_no_store_leaves_it(
    aiohttp_server: ServerFactory, upstream: TestServer
) -> None:
    proxy = await _proxy(aiohttp_server, upstream)
    client = _openai(proxy)
    first, _ = await _chat(client)
    skipped, h = await _chat(client, extra_headers={"Cache-Control": "no-store"})
    assert h["x-tokenmeter-cache"] == "bypass" and skipped.id != first.id
    kept, h = await _chat(client)
    assert h["x-tokenmeter-cache"] == "hit" and kept.id == first.id  # no-store stored nothing
    fresh, h = await _chat(client, extra_headers={"Cache-Control": "no-cache"})
    assert h["x-tokenmeter-cache"] == "bypass" and fresh.id != first.id
    after, h = await _chat(client)
    assert h["x-tokenmeter-cache"] == "hit" and after.id == fresh.id  # no-cache stored it
    assert _seen(upstream) == 3


@pytest.mark.timeout(60)
async def test_an_entry_expires_at_its_ttl(
    aiohttp_server: ServerFactory, upstream: TestServer
) -> None:
    clock = FakeClock(1_800_000_000)
    proxy = await _proxy(aiohttp_server, upstream, clock=clock, ttl_s=60)
    client = _openai(proxy)
    first, _ = await _chat(client)
    clock.now += 59
    hit, h = await _chat(client)
    assert hit.id == first.id and h["age"] == "59"
    clock.now += 2
    expired, h = await _chat(client)
    assert h["x-tokenmeter-cache"] == "miss" and expired.id != first.id
    assert _seen(upstream) == 2


@pytest.mark.timeout(60)
async def test_an_error_or_a_clamped_answer_is_not_stored(
    aiohttp_server: ServerFactory, upstream: TestServer
) -> None:
    proxy = await _proxy(aiohttp_server, upstream)
    client = _openai(proxy)
    for _ in range(2):
        with pytest.raises(openai.InternalServerError):
            await _chat(client, extra_headers={"x-mock-status": "500"})
    seen = _seen(upstream)
    assert seen >= 2  # each went upstream (retries included)
    # An answer cut by the client's own cap is whole as asked: stored.
    for _ in range(2):
        cut, _ = await _chat(client, extra_body={"max_tokens": 3})
    assert cut.choices[0].finish_reason == "length"
    assert _seen(upstream) == seen + 1


@pytest.fixture
def mock_settings() -> MockSettings:
    # Slow enough that twenty requests sent together are all waiting while the first is
    # upstream (the test asserts one upstream call, not a time).
    return MockSettings(tokens_per_second=0, ttft_ms=400, output_tokens=16)


@pytest.mark.timeout(60)
async def test_twenty_identical_concurrent_requests_reach_the_upstream_once(
    aiohttp_server: ServerFactory, upstream: TestServer
) -> None:
    proxy = await _proxy(aiohttp_server, upstream)
    client = _openai(proxy)
    answers = await asyncio.gather(*(_chat(client) for _ in range(20)))
    assert _seen(upstream) == 1
    assert len({a.id for a, _ in answers}) == 1
    assert sorted(h["x-tokenmeter-cache"] for _, h in answers) == ["hit"] * 19 + ["miss"]


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        if server.proc is not None:
            server.proc.send_signal(signal.SIGCONT)
        server.stop()


@pytest.mark.timeout(180)
async def test_two_served_replicas_on_one_redis_share_a_hit_with_the_ttl_in_redis(
    upstream: TestServer, own_redis: RedisServer, tmp_path: Path
) -> None:
    config = tmp_path / "tokenmeter.yaml"
    config.write_text(yaml.safe_dump(config_data(
        str(upstream.make_url("/v1")), store=own_redis.url, users=USERS,
        extra={"cache": {"enabled": True, "ttl_s": 120}})))
    config.chmod(0o600)
    a, b = (ServedProxy(config, tmp_path / f"{n}.log") for n in "ab")
    try:
        await asyncio.gather(a.started(90), b.started(90))  # a loaded box starts slowly
        first, h = await _chat(_served(a))
        assert h["x-tokenmeter-cache"] == "miss"
        await until(lambda: _stored(own_redis))
        r = aioredis.Redis.from_url(own_redis.url)
        try:
            keys = [k async for k in r.scan_iter(match="tokenmeter:cache:*")]
            assert len(keys) == 1
            assert 0 < await r.pttl(keys[0]) <= 120_000
            raw = await r.get(keys[0])
            assert isinstance(raw, bytes)
            head, _, payload = raw.partition(b"\n")
            assert json.loads(head)["form"] == "json"
            assert json.loads(payload)["id"] == first.id  # the answer is what is stored
        finally:
            await r.aclose()
        second, h = await _chat(_served(b))
        assert h["x-tokenmeter-cache"] == "hit" and second.model_dump() == first.model_dump()
        assert _seen(upstream) == 1
    finally:
        a.kill()
        b.kill()


async def _stored(server: RedisServer) -> bool:
    r = aioredis.Redis.from_url(server.url)
    try:
        return bool([k async for k in r.scan_iter(match="tokenmeter:cache:*")])
    finally:
        await r.aclose()


def _served(proxy: ServedProxy) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key=ALICE, max_retries=0)


@pytest.mark.timeout(60)
async def test_a_paused_redis_is_a_miss_and_the_request_is_served(
    aiohttp_server: ServerFactory, upstream: TestServer, own_redis: RedisServer
) -> None:
    proxy = make_config(str(upstream.make_url("/v1")),
                        store={"url": own_redis.url, "timeout_ms": 200}, users=USERS,
                        extra={"cache": {"enabled": True}})
    # Another replica makes the entry (the one that made it keeps it in its memory too).
    maker = await aiohttp_server(create_app(proxy))
    server = await aiohttp_server(create_app(proxy))
    client = _openai(server)
    first, _ = await _chat(_openai(maker))
    await until(lambda: _stored(own_redis))  # the entry is there: a lookup would find it
    assert own_redis.proc is not None
    own_redis.proc.send_signal(signal.SIGSTOP)
    try:
        served, h = await _chat(client)
    finally:
        own_redis.proc.send_signal(signal.SIGCONT)
    assert h["x-tokenmeter-cache"] == "miss" and served.choices[0].message.content
    assert served.id != first.id
    assert sample(await scrape(server), "tokenmeter_cache_errors_total", stage="lookup") >= 1
    assert _seen(upstream) == 2


@pytest.mark.timeout(60)
async def test_an_answer_cut_by_the_proxys_cap_is_not_stored(
    aiohttp_server: ServerFactory, upstream: TestServer
) -> None:
    capped = {"alice": {"keys": [ALICE], "max_output_tokens": 3}}
    proxy = await _proxy(aiohttp_server, upstream, users=capped)
    for _ in range(2):
        answer, h = await _chat(_openai(proxy))  # asks for 50, the proxy sends 3
        assert h["x-tokenmeter-cache"] == "miss"
        assert answer.choices[0].finish_reason == "length"
    assert _seen(upstream) == 2


@pytest.mark.timeout(60)
async def test_overrides_reload_and_redaction(
    aiohttp_server: ServerFactory, upstream: TestServer
) -> None:
    config = make_config(str(upstream.make_url("/v1")), store="memory", users=USERS)
    proxy = await aiohttp_server(create_app(config))
    _, h = await _chat(_openai(proxy))
    assert "x-tokenmeter-cache" not in h  # off by default
    # A reload that turns it on (for all but bob), redacting what it stores, applies to the
    # next request: the runtime a request reads is replaced whole.
    on = make_config(str(upstream.make_url("/v1")), store="memory", users=USERS, extra={
        "cache": {"enabled": True, "redact": ["[A-Za-z]+"], "users": {"bob": {"enabled": False}}}})
    proxy.app[SERVICES].runtime.current = build_runtime(on)
    first, h = await _chat(_openai(proxy))
    assert h["x-tokenmeter-cache"] == "miss" and "REDACTED" not in str(first.choices[0])
    second, h = await _chat(_openai(proxy))
    assert h["x-tokenmeter-cache"] == "hit"
    content = second.choices[0].message.content or ""
    assert second.id == first.id and second.choices[0].finish_reason == "stop"  # text only
    assert content and set(content.replace("[REDACTED]", "")) <= set(" .,!?'0123456789")
    for _ in range(2):
        _, h = await _chat(_openai(proxy, BOB))
        assert "x-tokenmeter-cache" not in h
    assert _seen(upstream) == 4
