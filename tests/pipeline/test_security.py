"""Secrets stay secret, malformed or smuggling requests never reach the upstream, /metrics can be
kept private, and no input lets a client pick where the proxy connects."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from openai.types.chat import ChatCompletionMessageParam

from proxy.cli import ClientErrorFilter
from proxy.config.load import parse_config
from proxy.server.app import create_app, create_metrics_app
from proxy.testing.mock_upstream import MOCK_STATE, MockState
from tests.helpers import ServerFactory, sample, scrape

CLIENT_KEY = "sk-client-secret-for-security-test"
UPSTREAM_KEY = "sk-upstream-secret-for-security-test"
MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "a prompt that must not be logged"}
]
BODY = b'{"model":"mock-gpt","messages":[{"role":"user","content":"hi"}]}'


def secured_config(upstream: TestServer, metrics: str = "") -> str:
    return f"""
upstreams:
  mock:
    base_url: {upstream.make_url("/v1")}
    api_key: {UPSTREAM_KEY}
    retry: {{initial_backoff_ms: 1}}
metrics:
  discover_models: false
{metrics}
users:
  alice:
    keys: ["{CLIENT_KEY}"]
    daily_tokens: 100000
    max_output_tokens: 50
    requests_per_minute: 5
"""


@pytest.fixture
async def proxy(aiohttp_server: ServerFactory, upstream: TestServer) -> TestServer:
    return await aiohttp_server(create_app(parse_config(secured_config(upstream))))


def mock(upstream: TestServer) -> MockState:
    return upstream.app[MOCK_STATE]


async def test_keys_and_prompts_never_leak(
    proxy: TestServer, upstream: TestServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    seen: list[str] = []
    async with openai.AsyncOpenAI(base_url=str(proxy.make_url("/v1")), api_key=CLIENT_KEY,
                                  max_retries=0) as client:
        async def call(**kw: Any) -> None:
            try:
                raw = await client.chat.completions.with_raw_response.create(
                    model="mock-gpt", messages=MESSAGES, **kw
                )
                seen.append(raw.http_response.text + str(raw.headers))
            except openai.APIStatusError as exc:
                seen.append(exc.response.text + str(exc.response.headers))
            except openai.APIError as exc:
                seen.append(str(exc.body))

        await call()
        stream = await client.chat.completions.create(
            model="mock-gpt", messages=MESSAGES, stream=True,
            extra_headers={"x-mock-reset-after": "2"},
        )
        with pytest.raises(openai.APIError) as broken:
            seen.extend([chunk.model_dump_json() async for chunk in stream])
        seen.append(str(broken.value.body))
        for status in ("401", "500", "429"):
            await call(extra_headers={"x-mock-status": status, "x-mock-retry-after-ms": "1"})
        await call()  # the sixth in a minute: refused by the budget
    async with openai.AsyncOpenAI(base_url=str(proxy.make_url("/v1")), api_key=CLIENT_KEY + "x",
                                  max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError) as err:
            await wrong.chat.completions.create(model="mock-gpt", messages=MESSAGES)
        seen.append(err.value.response.text)
    async with aiohttp.ClientSession() as s, s.get(proxy.make_url("/metrics")) as r:
        seen.append(await r.text())
    seen.extend(r.getMessage() + (r.exc_text or "") for r in caplog.records)
    everything = "\n".join(seen)
    for secret in (CLIENT_KEY, UPSTREAM_KEY, "a prompt that must not be logged"):
        assert secret not in everything
    # The test means something: the upstream got its key, never the client's.
    auth = {req.headers.get("authorization") for req in mock(upstream).requests}
    assert auth == {f"Bearer {UPSTREAM_KEY}"}


async def _raw(server: TestServer, data: bytes) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection(server.host, server.port)
    writer.write(data)
    await writer.drain()
    response = await reader.read()
    writer.close()
    status = int(response.split(b" ", 2)[1])
    return status, response.split(b"\r\n\r\n", 1)[1]


def _request(*extra: bytes, target: bytes = b"/v1/chat/completions", length: bool = True) -> bytes:
    head = [b"POST " + target + b" HTTP/1.1", b"Host: 127.0.0.1", b"Connection: close",
            b"Content-Type: application/json", b"Authorization: Bearer " + CLIENT_KEY.encode(),
            *extra]
    if length:
        head.append(b"Content-Length: " + str(len(BODY)).encode())
    return b"\r\n".join(head) + b"\r\n\r\n" + BODY


@pytest.mark.parametrize(
    "data",
    [
        _request(b"Transfer-Encoding: chunked"),  # CL.TE smuggling
        _request(b"Content-Length: 3"),  # two lengths
        _request(b"Transfer-Encoding: identity", length=False),
        _request(b"X-Injected: a\rSet-Cookie: b"),  # bare CR: header injection
        _request(b"X-Folded: a", b" continued"),  # obs-fold
        _request(b"X-Nul: a\x00b"),
        _request(b"Bad Name: 1"),
    ],
    ids=["cl-te", "two-cl", "te-identity", "bare-cr", "obs-fold", "nul", "space-in-name"],
)
async def test_smuggling_and_injection_are_refused_before_the_upstream(
    proxy: TestServer, upstream: TestServer, data: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    server_log, demote = logging.getLogger("aiohttp.server"), ClientErrorFilter()
    server_log.addFilter(demote)  # as `tokenmeter serve` installs it
    try:
        status, _ = await _raw(proxy, data)
    finally:
        server_log.removeFilter(demote)
    assert status == 400
    assert mock(upstream).requests == []
    # A client's malformed request is its problem: one warning, not an error with a traceback.
    assert [r.levelname for r in caplog.records if r.name == "aiohttp.server"] == ["WARNING"]


async def test_hop_by_hop_and_client_credentials_are_not_forwarded(
    proxy: TestServer, upstream: TestServer
) -> None:
    status, _ = await _raw(proxy, _request(
        b"Connection: x-internal", b"X-Internal: secret-route", b"Keep-Alive: timeout=5",
        b"Proxy-Authorization: Basic Zm9vOmJhcg==", b"X-Api-Key: " + CLIENT_KEY.encode(),
        b"X-Kept: yes",
    ))
    assert status == 200
    (received,) = mock(upstream).requests
    for name in ("x-internal", "keep-alive", "proxy-authorization", "x-api-key"):
        assert name not in received.headers
    assert received.headers["x-kept"] == "yes"
    assert received.headers["authorization"] == f"Bearer {UPSTREAM_KEY}"


@pytest.mark.parametrize(
    "target",
    [b"http://evil.example/v1/chat/completions", b"//evil.example/v1/chat/completions",
     b"/v1/../../evil.example/v1/chat/completions", b"/v1/chat/completions?base_url=http://evil"],
)
async def test_no_request_chooses_the_upstream(
    proxy: TestServer, upstream: TestServer, target: bytes
) -> None:
    status, _ = await _raw(proxy, _request(b"X-Forwarded-Host: evil.example", target=target))
    # Either refused, or served by the one configured upstream: never anywhere else.
    assert status in (200, 404)
    for req in mock(upstream).requests:
        assert req.headers["host"] == f"{upstream.host}:{upstream.port}"
        assert req.path == "/v1/chat/completions"


async def test_missing_and_invalid_keys_never_reach_the_upstream(
    proxy: TestServer, upstream: TestServer
) -> None:
    async with aiohttp.ClientSession() as s:
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic eDp5"},
                        {"Authorization": "Bearer"}, {"api-key": "nope"}):
            async with s.post(proxy.make_url("/v1/chat/completions"), data=BODY,
                              headers=headers) as r:
                assert r.status == 401
                err = (await r.json())["error"]
                assert set(err) == {"message", "type", "param", "code"}
                assert err["code"] == "invalid_api_key"
    assert mock(upstream).requests == []


async def test_metrics_on_their_own_port_with_a_token(
    aiohttp_server: ServerFactory, upstream: TestServer
) -> None:
    text = secured_config(upstream, "  port: 0\n  token: scrape-token-123")
    app = create_app(parse_config(text))
    proxy = await aiohttp_server(app)
    metrics = await aiohttp_server(create_metrics_app(app))
    async with openai.AsyncOpenAI(base_url=str(proxy.make_url("/v1")), api_key=CLIENT_KEY,
                                  max_retries=0) as client:
        await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
    async with aiohttp.ClientSession() as s:
        async with s.get(proxy.make_url("/metrics")) as r:
            assert r.status == 404  # not on the API port
        async with s.get(metrics.make_url("/metrics")) as r:
            assert r.status == 401
            assert (await r.json())["error"]["code"] == "invalid_token"
        async with s.get(metrics.make_url("/metrics"),
                         headers={"Authorization": "Bearer wrong"}) as r:
            assert r.status == 401
    m = await scrape(metrics, headers={"Authorization": "Bearer scrape-token-123"})
    assert sample(m, "tokenmeter_requests_total", user="alice", status="200") == 1


# --- issue 31, item 12: an upstream's error body that echoes its key ------------------------------

# A key with a slash: JSON encoders that escape it (`\/`) write it another way.
ECHOED_KEY = "sk-ant-api03-echo/Secret+for-security-test"


async def _echoing_upstream(request: web.Request) -> web.Response:
    """An upstream, written out by hand, that answers 400 with the key it was sent in its
    message: as it came, JSON-escaped with `\\/`, and (OpenAI's route) in the error's param."""
    sent = (request.headers.get("x-api-key")
            or request.headers.get("Authorization", "").removeprefix("Bearer "))
    escaped = sent.replace("/", "\\/")
    if request.path.endswith("/messages"):
        text = ('{"type":"error","error":{"type":"invalid_request_error",'
                f'"message":"invalid x-api-key: {sent} (also {escaped})"}}}}')
    else:
        text = ('{"error":{"type":"invalid_request_error","code":null,'
                f'"message":"bad key {escaped}","param":"{sent}"}}}}')
    return web.Response(status=400, text=text, content_type="application/json")


async def test_an_upstream_error_that_echoes_its_key_reaches_the_client_without_it(
    aiohttp_server: ServerFactory,
) -> None:
    """Both APIs: the upstream's 400 names the operator's key (literally and JSON-escaped); the
    client (the SDKs' exception bodies) gets the error with `[REDACTED]` in its place, still
    JSON in the API's shape. A successful answer is never rewritten (tested elsewhere: the
    cost and stream tests compare bytes)."""
    app = web.Application()
    app.router.add_post("/v1/messages", _echoing_upstream)
    app.router.add_post("/v1/chat/completions", _echoing_upstream)
    up = await aiohttp_server(app)
    config = parse_config(f"""
upstreams:
  claude: {{base_url: "{up.make_url('/v1')}", api: anthropic, api_key: "{ECHOED_KEY}"}}
  openai: {{base_url: "{up.make_url('/v1')}", api_key: "{ECHOED_KEY}"}}
models:
  - {{match: "claude-*", upstream: claude}}
  - {{match: "*", upstream: openai}}
metrics: {{discover_models: false}}
users:
  alice: {{keys: ["{CLIENT_KEY}"]}}
""")
    proxy = await aiohttp_server(create_app(config))
    escaped = ECHOED_KEY.replace("/", "\\/")
    async with anthropic.AsyncAnthropic(base_url=str(proxy.make_url("")), api_key=CLIENT_KEY,
                                        max_retries=0) as claude:
        with pytest.raises(anthropic.BadRequestError) as caught:
            await claude.messages.create(model="claude-x", max_tokens=8,
                                         messages=[{"role": "user", "content": "hi"}])
    text = caught.value.response.text
    assert ECHOED_KEY not in text and escaped not in text, text
    assert "Secret+for" not in str(caught.value.body)
    body = caught.value.response.json()
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"] == "invalid x-api-key: [REDACTED] (also [REDACTED])"
    async with openai.AsyncOpenAI(base_url=str(proxy.make_url("/v1")), api_key=CLIENT_KEY,
                                  max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as bad:
            await client.chat.completions.create(model="gpt-x", messages=MESSAGES)
    text = bad.value.response.text
    assert ECHOED_KEY not in text and escaped not in text, text
    assert bad.value.response.json()["error"] == {
        "type": "invalid_request_error", "code": None, "message": "bad key [REDACTED]",
        "param": "[REDACTED]"}
