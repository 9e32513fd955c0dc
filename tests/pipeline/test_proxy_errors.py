"""Errors: the proxy's own in OpenAI's shape, the upstream's passed through and classified,
broken streams and vanished clients still accounted for."""

from __future__ import annotations

import asyncio
import json
import socket

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestServer
from openai.types.chat import ChatCompletionMessageParam

from proxy.server.app import create_app
from proxy.testing.mock_upstream import generated_text
from tests.helpers import (
    ServerFactory,
    Stack,
    StackFactory,
    config_for,
    read_until,
    sample,
    scrape,
)

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


def _assert_openai_error(body: dict[str, object], code: str | None = None) -> dict[str, object]:
    err = body["error"]
    assert isinstance(err, dict)
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code
    return err


@pytest.mark.parametrize(
    ("raw", "param"),
    [(b"{not json", None), (b'{"messages": []}', "model"), (b'[1, 2]', None),
     (b'{"model": "mock-gpt", "stream": "yes"}', "stream")],
)
async def test_bad_request_bodies(stack: Stack, raw: bytes, param: str | None) -> None:
    async with aiohttp.ClientSession() as s, s.post(
        stack.base_url + "/chat/completions", data=raw,
        headers={"Content-Type": "application/json"},
    ) as r:
        assert r.status == 400
        err = _assert_openai_error(await r.json())
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert stack.mock.requests == []  # nothing reached the upstream
    await stack.settled(1)
    m = await stack.metrics()
    assert sample(m, "tokenmeter_requests_total", status="400", error_class="invalid_request") == 1


async def test_unknown_path_and_method(stack: Stack) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(stack.base_url + "/nope") as r:
            assert r.status == 404
            _assert_openai_error(await r.json(), "unknown_url")
        async with s.get(stack.base_url + "/chat/completions") as r:
            assert r.status == 405
            _assert_openai_error(await r.json(), "method_not_allowed")


async def test_embeddings_refuse_streaming(stack: Stack) -> None:
    async with aiohttp.ClientSession() as s, s.post(
        stack.base_url + "/embeddings", json={"model": "mock-gpt", "input": "x", "stream": True}
    ) as r:
        assert r.status == 400
        _assert_openai_error(await r.json())


@pytest.mark.parametrize(
    ("status", "code", "exc", "error_class"),
    [
        ("401", "invalid_api_key", openai.AuthenticationError, "auth"),
        ("429", "rate_limit_exceeded", openai.RateLimitError, "rate_limit"),
        ("400", "context_length_exceeded", openai.BadRequestError, "context_length"),
        ("500", None, openai.InternalServerError, "upstream_5xx"),
    ],
)
async def test_upstream_errors_pass_through_and_are_classified(
    stack: Stack, status: str, code: str | None, exc: type[Exception], error_class: str
) -> None:
    # A 429's Retry-After is honoured by the proxy's retries: 1 ms, not the mock's 1 s default.
    headers = {"x-mock-status": status, "x-mock-retry-after-ms": "1"}
    if code:
        headers["x-mock-error-code"] = code
    body = {"model": "mock-gpt", "messages": MESSAGES, "stream": True}
    async with aiohttp.ClientSession() as s:
        async with s.post(stack.upstream_url + "/chat/completions", json=body,
                          headers=headers) as r:
            direct = await r.read()
        async with s.post(stack.base_url + "/chat/completions", json=body, headers=headers) as r:
            assert r.status == int(status)
            assert await r.read() == direct  # the upstream's error body, unchanged
    with pytest.raises(exc):
        await stack.client().chat.completions.create(
            model="mock-gpt", messages=MESSAGES, extra_headers=headers
        )
    m = await stack.metrics()
    assert sample(m, "tokenmeter_requests_total", status=status, error_class=error_class) == 2
    assert sample(m, "tokenmeter_tokens_total") == 0


async def test_upstream_unreachable_is_502(
    aiohttp_server: ServerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proxy = await aiohttp_server(create_app(config_for(f"http://127.0.0.1:{port}/v1")))
    async with aiohttp.ClientSession() as s, s.post(
        proxy.make_url("/v1/chat/completions"), json={"model": "m", "messages": MESSAGES}
    ) as r:
        assert r.status == 502
        _assert_openai_error(await r.json(), "upstream_unreachable")


@pytest.fixture
async def short_idle_stack(make_stack: StackFactory, upstream: TestServer) -> Stack:
    # Short idle timeout so a stalled stream ends quickly. A fixture of its own name: an
    # override of `proxy_config` here would silently apply to every test in the module.
    return await make_stack(config_for(str(upstream.make_url("/v1")), idle_timeout_s=0.3))


async def test_stalled_stream_times_out_and_keeps_tokens(short_idle_stack: Stack) -> None:
    stack = short_idle_stack
    client = stack.client()
    stream = await client.chat.completions.create(
        model="mock-gpt", messages=MESSAGES, stream=True,
        extra_headers={"x-mock-stall-after": "5"},
    )
    got = ""
    with pytest.raises(openai.APIError) as err:
        async for chunk in stream:
            got += chunk.choices[0].delta.content or "" if chunk.choices else ""
    assert got == generated_text(5)
    # The last event is OpenAI's error shape: the SDK raised it, not a broken connection.
    assert err.value.code == "idle_timeout" and "incomplete" in err.value.message
    assert err.value.type == "upstream_error"
    await stack.settled(1)
    m = await stack.metrics()
    assert sample(m, "tokenmeter_requests_total", status="200", error_class="idle_timeout") == 1
    assert sample(m, "tokenmeter_tokens_total", type="output", source="estimated") == 5


async def test_reset_mid_stream_is_mirrored_and_counted(stack: Stack) -> None:
    client = stack.client()
    stream = await client.chat.completions.create(
        model="mock-gpt", messages=MESSAGES, stream=True,
        extra_headers={"x-mock-reset-after": "7"},
    )
    got = ""
    with pytest.raises(openai.APIError) as err:
        async for chunk in stream:
            got += chunk.choices[0].delta.content or "" if chunk.choices else ""
    assert got == generated_text(7)
    assert err.value.code == "upstream_reset"
    await stack.settled(1)
    m = await stack.metrics()
    assert sample(m, "tokenmeter_requests_total", error_class="upstream_reset") == 1
    assert sample(m, "tokenmeter_tokens_total", type="output", source="estimated") == 7
    assert sample(m, "tokenmeter_tokens_total", type="input", source="estimated") > 0


async def test_client_disconnect_closes_upstream_and_records_tokens(stack: Stack) -> None:
    body = {"model": "mock-gpt", "messages": MESSAGES, "stream": True}
    async with aiohttp.ClientSession() as s:
        resp = await s.post(stack.base_url + "/chat/completions", json=body,
                            headers={"x-mock-stall-after": "4"})
        # Read until 4 tokens arrived, then vanish.
        await read_until(resp.content, lambda seen: seen.count(b'"content":" ') >= 4)
        resp.close()
    # The upstream request ends promptly (the stall would otherwise last forever; the read
    # timeout is 0.3 s and this waits for the upstream's own close signal instead).
    await asyncio.wait_for(stack.mock.requests[-1].closed.wait(), timeout=5)
    await stack.settled(1)
    (line,) = stack.access_lines()
    assert line["error_class"] == "client_disconnect"
    assert line["output_tokens"] == 4 and line["token_source"] == "estimated"
    m = await stack.metrics()
    assert sample(m, "tokenmeter_tokens_total", type="output", source="estimated") == 4
    assert json.dumps(line)  # one JSON object per request


async def test_too_large_body_is_413_and_counted(
    aiohttp_server: ServerFactory, upstream: TestServer
) -> None:
    cfg = config_for(str(upstream.make_url("/v1")), extra={"server": {"max_body_mb": 0.01}})
    proxy = await aiohttp_server(create_app(cfg))
    big = {"model": "mock-gpt", "messages": [{"role": "user", "content": "x" * 20_000}]}
    async with aiohttp.ClientSession() as s, s.post(
        proxy.make_url("/v1/chat/completions"), json=big
    ) as r:
        assert r.status == 413
        _assert_openai_error(await r.json(), "request_too_large")
    m = await scrape(proxy)
    assert sample(m, "tokenmeter_requests_total", status="413", error_class="request_too_large") == 1


async def test_models_listing(stack: Stack) -> None:
    models = await stack.client().models.list()
    assert [m.id for m in models.data] == ["mock-gpt"]


async def test_models_listing_upstream_down_is_502(aiohttp_server: ServerFactory) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proxy = await aiohttp_server(create_app(config_for(f"http://127.0.0.1:{port}/v1")))
    async with aiohttp.ClientSession() as s, s.get(proxy.make_url("/v1/models")) as r:
        assert r.status == 502
        _assert_openai_error(await r.json(), "upstream_unreachable")
