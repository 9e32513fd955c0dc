"""Resilience: timeouts, retries, fallbacks and partial failures, against real mock upstreams.

Each test drives the proxy with the `openai` SDK (or raw aiohttp where the SDK would hide the
wire) and checks three things: what the client got, what reached the upstream, and that the
books (usage, budgets, metrics) are right afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import uuid
from collections.abc import Iterator

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestServer
from openai.types.chat import ChatCompletionMessageParam

from proxy.config.load import parse_config
from proxy.server.app import create_app
from proxy.testing.mock_upstream import (
    MOCK_STATE,
    MockSettings,
    MockState,
    create_mock_app,
    generated_text,
)
from tests.helpers import ServerFactory, config_for, relayed, sample, scrape, settled, until

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
FAST_RETRY = {"initial_backoff_ms": 1, "max_backoff_ms": 5}
ALICE = "sk-alice-resilience-0001"


def mock_of(server: TestServer) -> MockState:
    return server.app[MOCK_STATE]


def sdk(server: TestServer, key: str = "sk-unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key=key, max_retries=0)


@pytest.fixture
async def upstream(aiohttp_server: ServerFactory) -> TestServer:
    return await aiohttp_server(create_mock_app(MockSettings(tokens_per_second=0, ttft_ms=0,
                                                             output_tokens=12)))


def scenario() -> dict[str, str]:
    """The mock counts fail_first per scenario: a fresh one per test."""
    return {"x-mock-scenario": uuid.uuid4().hex}


# --- retries ---------------------------------------------------------------------------------


async def test_5xx_is_retried_with_backoff_then_served(
    aiohttp_server: ServerFactory, upstream: TestServer
) -> None:
    proxy = await aiohttp_server(create_app(config_for(str(upstream.make_url("/v1")),
                                                       retry=FAST_RETRY)))
    async with sdk(proxy) as client:
        r = await client.chat.completions.create(
            model="mock-gpt", messages=MESSAGES,
            extra_headers={"x-mock-status": "503", "x-mock-fail-first": "2", **scenario()},
        )
    assert r.choices[0].message.content == generated_text(12)
    assert len(mock_of(upstream).requests) == 3
    await settled(proxy.app, 1)
    m = await scrape(proxy)
    assert sample(m, "tokenmeter_upstream_retries_total", reason="upstream_5xx") == 2
    assert sample(m, "tokenmeter_requests_total", status="200") == 1
    assert sample(m, "tokenmeter_requests_total") == 1  # one request, however many attempts
    assert sample(m, "tokenmeter_tokens_total", type="output", source="reported") == 12


async def test_429_retry_after_is_honoured(
    aiohttp_server: ServerFactory, upstream: TestServer
) -> None:
    proxy = await aiohttp_server(create_app(config_for(str(upstream.make_url("/v1")),
                                                       retry=FAST_RETRY)))
    started = time.perf_counter()
    async with sdk(proxy) as client:
        await client.chat.completions.create(
            model="mock-gpt", messages=MESSAGES,
            extra_headers={"x-mock-status": "429", "x-mock-fail-first": "1",
                           "x-mock-retry-after-ms": "300", **scenario()},
        )
    # The backoff alone would be under 5 ms: the wait is the upstream's Retry-After.
    assert time.perf_counter() - started >= 0.3
    assert len(mock_of(upstream).requests) == 2
    m = await scrape(proxy)
    assert sample(m, "tokenmeter_upstream_retries_total", reason="rate_limit") == 1


async def test_retry_after_past_the_deadline_goes_to_the_client_at_once(
    aiohttp_server: ServerFactory, upstream: TestServer
) -> None:
    retry = {"initial_backoff_ms": 1, "deadline_s": 1}
    proxy = await aiohttp_server(create_app(config_for(str(upstream.make_url("/v1")),
                                                       retry=retry)))
    async with sdk(proxy) as client:
        with pytest.raises(openai.RateLimitError) as err:
            await client.chat.completions.create(
                model="mock-gpt", messages=MESSAGES,
                extra_headers={"x-mock-status": "429", "x-mock-retry-after-ms": "60000"},
            )
    assert err.value.response.headers["retry-after-ms"] == "60000"  # the upstream's own answer
    assert len(mock_of(upstream).requests) == 1


async def test_attempts_are_bounded(aiohttp_server: ServerFactory, upstream: TestServer) -> None:
    retry = {"initial_backoff_ms": 1, "max_attempts": 4}
    proxy = await aiohttp_server(create_app(config_for(str(upstream.make_url("/v1")),
                                                       retry=retry)))
    async with sdk(proxy) as client:
        with pytest.raises(openai.InternalServerError):
            await client.chat.completions.create(
                model="mock-gpt", messages=MESSAGES, extra_headers={"x-mock-status": "500"}
            )
        with pytest.raises(openai.BadRequestError):  # a 400 is the request's fault: no retry
            await client.chat.completions.create(
                model="mock-gpt", messages=MESSAGES, extra_headers={"x-mock-status": "400"}
            )
    assert len(mock_of(upstream).requests) == 4 + 1
    await settled(proxy.app, 2)
    m = await scrape(proxy)
    assert sample(m, "tokenmeter_requests_total", status="500", error_class="upstream_5xx") == 1


async def test_connect_errors_are_retried_then_502(aiohttp_server: ServerFactory) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proxy = await aiohttp_server(create_app(config_for(f"http://127.0.0.1:{port}/v1",
                                                       retry=FAST_RETRY)))
    async with sdk(proxy) as client:
        with pytest.raises(openai.APIStatusError) as err:
            await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
    assert err.value.status_code == 502 and err.value.code == "upstream_unreachable"
    await settled(proxy.app, 1)
    m = await scrape(proxy)
    assert sample(m, "tokenmeter_upstream_retries_total", reason="upstream_unreachable") == 2
    assert sample(m, "tokenmeter_requests_total", status="502",
                  error_class="upstream_unreachable") == 1


async def test_a_stream_that_started_is_never_retried(
    aiohttp_server: ServerFactory, upstream: TestServer
) -> None:
    proxy = await aiohttp_server(create_app(config_for(str(upstream.make_url("/v1")),
                                                       retry=FAST_RETRY)))
    async with sdk(proxy) as client:
        stream = await client.chat.completions.create(
            model="mock-gpt", messages=MESSAGES, stream=True,
            extra_headers={"x-mock-reset-after": "3", "x-mock-fail-first": "1", **scenario()},
        )
        got = ""
        with pytest.raises(openai.APIError) as err:
            async for chunk in stream:
                got += chunk.choices[0].delta.content or "" if chunk.choices else ""
    assert got == generated_text(3) and err.value.code == "upstream_reset"
    assert len(mock_of(upstream).requests) == 1
    await settled(proxy.app, 1)
    m = await scrape(proxy)
    assert sample(m, "tokenmeter_upstream_retries_total") == 0
    assert sample(m, "tokenmeter_requests_total", status="200", error_class="upstream_reset") == 1
    assert sample(m, "tokenmeter_tokens_total", type="output", source="estimated") == 3


# --- timeouts --------------------------------------------------------------------------------


async def test_first_byte_timeout_is_504_and_not_retried(
    aiohttp_server: ServerFactory, upstream: TestServer
) -> None:
    proxy = await aiohttp_server(create_app(config_for(
        str(upstream.make_url("/v1")), retry=FAST_RETRY, first_byte_timeout_s=0.2)))
    async with sdk(proxy) as client:
        with pytest.raises(openai.APIStatusError) as err:
            await client.chat.completions.create(
                model="mock-gpt", messages=MESSAGES, stream=True,
                extra_headers={"x-mock-delay-ms": "2000"},
            )
    assert err.value.status_code == 504 and err.value.code == "first_byte_timeout"
    assert len(mock_of(upstream).requests) == 1
    await settled(proxy.app, 1)
    m = await scrape(proxy)
    assert sample(m, "tokenmeter_requests_total", status="504",
                  error_class="first_byte_timeout") == 1


async def test_total_timeout_caps_a_json_request(
    aiohttp_server: ServerFactory, upstream: TestServer
) -> None:
    proxy = await aiohttp_server(create_app(config_for(
        str(upstream.make_url("/v1")), total_timeout_s=0.3, first_byte_timeout_s=30)))
    async with sdk(proxy) as client:
        with pytest.raises(openai.APIStatusError) as err:
            await client.chat.completions.create(
                model="mock-gpt", messages=MESSAGES, extra_headers={"x-mock-ttft-ms": "3000"}
            )
    assert err.value.status_code == 504 and err.value.code == "total_timeout"


async def test_long_healthy_stream_outlives_idle_and_total_timeouts(
    aiohttp_server: ServerFactory, upstream: TestServer
) -> None:
    # 30 tokens at 40/s: 0.75 s in all, far past both caps, never silent for 0.3 s.
    proxy = await aiohttp_server(create_app(config_for(
        str(upstream.make_url("/v1")), idle_timeout_s=0.3, total_timeout_s=0.2)))
    async with sdk(proxy) as client:
        stream = await client.chat.completions.create(
            model="mock-gpt", messages=MESSAGES, stream=True,
            extra_headers={"x-mock-tokens-per-second": "40", "x-mock-output-tokens": "30"},
        )
        got = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert got == generated_text(30)


def _unresponsive_listener() -> Iterator[int]:
    """A port whose accept queue is full: the kernel drops further SYNs, so connecting hangs
    exactly as it does to a host that has gone away."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    fillers = []
    port = server.getsockname()[1]
    for _ in range(4):
        s = socket.socket()
        s.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            s.connect(("127.0.0.1", port))
        fillers.append(s)
    try:
        yield port
    finally:
        for s in fillers:
            s.close()
        server.close()


@pytest.fixture
def hanging_port() -> Iterator[int]:
    yield from _unresponsive_listener()


async def test_connect_timeout_has_its_own_class(
    aiohttp_server: ServerFactory, hanging_port: int
) -> None:
    proxy = await aiohttp_server(create_app(config_for(
        f"http://127.0.0.1:{hanging_port}/v1", connect_timeout_s=0.2,
        retry={"max_attempts": 2, "initial_backoff_ms": 1})))
    async with sdk(proxy) as client:
        with pytest.raises(openai.APIStatusError) as err:
            await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
    assert err.value.status_code == 504 and err.value.code == "connect_timeout"
    await settled(proxy.app, 1)
    m = await scrape(proxy)
    assert sample(m, "tokenmeter_upstream_retries_total", reason="connect_timeout") == 1


# --- fallbacks -------------------------------------------------------------------------------


@pytest.fixture
async def failing(aiohttp_server: ServerFactory) -> TestServer:
    # Its own server: x-mock-* headers from the client would reach the backup as well.
    return await aiohttp_server(create_mock_app(MockSettings(status=500)))


@pytest.fixture
async def backup(aiohttp_server: ServerFactory) -> TestServer:
    return await aiohttp_server(create_mock_app(MockSettings(tokens_per_second=0, ttft_ms=0,
                                                             output_tokens=5)))


LIMITS = """    requests_per_minute: 2
    model_limits:
      "primary-*": {daily_tokens: 60, max_output_tokens: 16}"""


def fallback_config(
    primary: str, backup: str, store: str = "memory", extra: str = "", limits: str = LIMITS
) -> str:
    return f"""
store: {{url: {store}, timeout_ms: 5000}}
upstreams:
  main: {{base_url: {primary}, retry: {{max_attempts: 2, initial_backoff_ms: 1}}}}
  spare: {{base_url: {backup}}}
models:
  - match: primary-model
    upstream: main
    fallbacks: [backup-model]
{extra}
  - match: "backup-*"
    upstream: spare
metrics: {{model_labels: [primary-model, backup-model], discover_models: false}}
users:
  alice:
    keys: ["{ALICE}"]
{limits}
"""


async def test_fallback_serves_and_is_charged_on_the_model_used(
    aiohttp_server: ServerFactory, failing: TestServer, backup: TestServer, store_url: str
) -> None:
    text = fallback_config(str(failing.make_url("/v1")), str(backup.make_url("/v1")), store_url)
    proxy = await aiohttp_server(create_app(parse_config(text)))
    async with sdk(proxy, ALICE) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="primary-model", messages=MESSAGES
        )
        r = raw.parse()
        assert r.model == "backup-model"  # the body says who served it...
        assert raw.headers["x-tokenmeter-model"] == "backup-model"  # ...and so does a header
        assert raw.headers["x-tokenmeter-fallback-from"] == "primary-model"
        assert r.choices[0].message.content == generated_text(5)
        # The primary's attempt was given back whole: the request counts once against the
        # 2-a-minute limit (a second one passes), and its tokens were never charged on the
        # primary's 60-token group (which would refuse it now).
        second = await client.chat.completions.create(model="primary-model", messages=MESSAGES)
        with pytest.raises(openai.RateLimitError):
            await client.chat.completions.create(model="primary-model", messages=MESSAGES)
    assert len(mock_of(failing).requests) == 2 * 2  # two tries each, then the backup
    assert len(mock_of(backup).requests) == 2
    assert all(req.body is not None and req.body["model"] == "backup-model"
               for req in mock_of(backup).requests)
    await settled(proxy.app, 3)
    m = await scrape(proxy)
    assert r.usage is not None and second.usage is not None
    served = r.usage.total_tokens + second.usage.total_tokens
    assert sample(m, "tokenmeter_tokens_total", model="backup-model") == served
    assert sample(m, "tokenmeter_tokens_total", model="primary-model") == 0
    assert sample(m, "tokenmeter_fallbacks_total", route="primary-model",
                  to_model="backup-model", reason="upstream_5xx") == 2
    assert sample(m, "tokenmeter_budget_used_tokens", user="alice", window="daily_tokens") == served


async def test_fallback_on_unreachable_primary_streams_from_backup(
    aiohttp_server: ServerFactory, backup: TestServer
) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    proxy = await aiohttp_server(create_app(parse_config(
        fallback_config(dead, str(backup.make_url("/v1"))))))
    async with sdk(proxy, ALICE) as client:
        stream = await client.chat.completions.create(
            model="primary-model", messages=MESSAGES, stream=True
        )
        chunks = [c async for c in stream]
    assert {c.model for c in chunks} == {"backup-model"}
    await settled(proxy.app, 1)
    m = await scrape(proxy)
    assert sample(m, "tokenmeter_fallbacks_total", reason="upstream_unreachable") == 1
    assert sample(m, "tokenmeter_requests_total", model="backup-model", status="200") == 1
    assert sample(m, "tokenmeter_requests_total", model="primary-model") == 0


async def test_slow_primary_is_skipped_while_its_ttft_p95_is_high(
    aiohttp_server: ServerFactory, backup: TestServer
) -> None:
    slow = await aiohttp_server(create_mock_app(MockSettings(tokens_per_second=0, ttft_ms=150,
                                                             output_tokens=3)))
    rule = "    latency_fallback: {ttft_p95_ms: 100, window_s: 60, min_samples: 3}"
    proxy = await aiohttp_server(create_app(parse_config(
        fallback_config(str(slow.make_url("/v1")), str(backup.make_url("/v1")),
                        extra=rule, limits=""))))
    served = []
    async with sdk(proxy, ALICE) as client:
        for _ in range(5):
            raw = await client.chat.completions.with_raw_response.create(
                model="primary-model", messages=MESSAGES, stream=True
            )
            async for _chunk in raw.parse():
                pass
            served.append(raw.headers["x-tokenmeter-model"])
            await settled(proxy.app, len(served))  # the TTFT sample is taken when settling
    assert served == ["primary-model"] * 3 + ["backup-model"] * 2
    m = await scrape(proxy)
    assert sample(m, "tokenmeter_fallbacks_total", reason="slow") == 2
    assert len(mock_of(slow).requests) == 3


def test_fallbacks_must_be_routable() -> None:
    from proxy.config.load import ConfigError

    with pytest.raises(ConfigError, match="fallbacks: 'nowhere' matches no models"):
        parse_config("""
upstreams: {a: {base_url: "http://127.0.0.1:1/v1"}}
models:
  - {match: m1, upstream: a, fallbacks: [nowhere]}
""")


# --- partial failures ------------------------------------------------------------------------


async def test_responses_stream_break_ends_with_an_error_event(
    aiohttp_server: ServerFactory, upstream: TestServer
) -> None:
    proxy = await aiohttp_server(create_app(config_for(str(upstream.make_url("/v1")))))
    async with aiohttp.ClientSession() as s, s.post(
        proxy.make_url("/v1/responses"),
        json={"model": "mock-gpt", "input": "hi", "stream": True},
        headers={"x-mock-reset-after": "4"},
    ) as r:
        raw = await r.read()  # a clean end: the error event, then the stream's last chunk
    last = raw.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
    assert last.startswith(b"event: error\ndata: ")
    assert b'"code": "upstream_reset"' in last and b'"error": {' in last
    await settled(proxy.app, 1)
    m = await scrape(proxy)
    assert sample(m, "tokenmeter_tokens_total", type="output", source="estimated") == 4


async def test_garbage_and_random_chunking_pass_through_and_meter_exactly(
    aiohttp_server: ServerFactory, upstream: TestServer
) -> None:
    proxy = await aiohttp_server(create_app(config_for(str(upstream.make_url("/v1")))))
    body = {"model": "mock-gpt", "messages": MESSAGES, "stream": True,
            "stream_options": {"include_usage": True}}
    headers = {"x-mock-garbage-after": "4", "x-mock-chunk-seed": "11"}
    async with aiohttp.ClientSession() as s:
        async with s.post(upstream.make_url("/v1/chat/completions"), json=body,
                          headers=headers) as r:
            direct = await r.read()
        async with s.post(proxy.make_url("/v1/chat/completions"), json=body,
                          headers=headers) as r:
            via_proxy = await r.read()
    # Byte for byte the same bar the per-response ids and timestamps: same length, same junk.
    via_proxy = relayed(via_proxy)
    assert len(via_proxy) == len(direct) and b"\x00\xff\xfenot an event" in via_proxy
    await settled(proxy.app, 1)
    m = await scrape(proxy)
    assert sample(m, "tokenmeter_tokens_total", type="output", source="reported") == 12
    assert sample(m, "tokenmeter_metering_errors_total") == 0


async def test_client_disconnect_mid_retry_wait_settles(
    aiohttp_server: ServerFactory, upstream: TestServer
) -> None:
    proxy = await aiohttp_server(create_app(config_for(str(upstream.make_url("/v1")))))
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(s.post(
            proxy.make_url("/v1/chat/completions"),
            json={"model": "mock-gpt", "messages": MESSAGES},
            headers={"x-mock-status": "503", "x-mock-retry-after-ms": "5000"},
        ))
        await until(lambda: bool(mock_of(upstream).requests))
        await mock_of(upstream).requests[0].closed.wait()  # the proxy is now waiting 5 s
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    await settled(proxy.app, 1)
    m = await scrape(proxy)
    assert sample(m, "tokenmeter_requests_total", error_class="client_disconnect") == 1
    assert len(mock_of(upstream).requests) == 1  # the retry never happened
