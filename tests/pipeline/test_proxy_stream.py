"""The proxy driven by the real openai SDK over loopback, in front of the simulated upstream."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer
from openai.types.chat import ChatCompletionMessageParam

from proxy.protocol import tokenizer
from proxy.server.app import create_app
from proxy.testing import mock_tokens
from proxy.testing.mock_upstream import MOCK_STATE, MockSettings, create_mock_app, generated_text
from tests.helpers import ServerFactory, Stack, config_for, relayed, sample, scrape

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Tell me a secret prompt text 8472."}
]


def _normalise(raw: bytes) -> bytes:
    """Per-request ids and timestamps differ between two calls; nothing else may."""
    raw = re.sub(rb'"id":"[^"]*"', b'"id":"X"', raw)
    raw = re.sub(rb'"created":\d+', b'"created":0', raw)
    return raw


async def _raw_post(url: str, body: dict[str, object]) -> bytes:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        assert r.status == 200
        return await r.read()


async def test_stream_bytes_equal_upstream_and_usage_chunk_removed(stack: Stack) -> None:
    body = {"model": "mock-gpt", "messages": MESSAGES, "stream": True}
    direct = await _raw_post(stack.upstream_url + "/chat/completions", body)
    proxied = await _raw_post(stack.base_url + "/chat/completions", body)
    # The proxy asked the upstream for usage; the upstream then adds `"usage":null` to each chunk
    # (allowed to stay) and a usage-only chunk (removed). Everything else is byte-identical.
    assert _normalise(relayed(proxied)).replace(b',"usage":null', b"") == _normalise(direct)
    assert b'"usage":{' not in proxied
    sent = stack.mock.requests[-1].body
    assert sent is not None and sent["stream_options"] == {"include_usage": True}
    # Open mode meters without limiting: no output cap is added to the client's request.
    assert "max_completion_tokens" not in sent and "max_tokens" not in sent


async def test_stream_with_client_usage_is_passed_through_unchanged(stack: Stack) -> None:
    body = {
        "model": "mock-gpt", "messages": MESSAGES, "stream": True,
        "stream_options": {"include_usage": True},
    }
    direct = await _raw_post(stack.upstream_url + "/chat/completions", body)
    proxied = await _raw_post(stack.base_url + "/chat/completions", body)
    assert _normalise(relayed(proxied)) == _normalise(direct)


async def test_sdk_streaming_chat_is_metered(stack: Stack) -> None:
    client = stack.client()
    stream = await client.chat.completions.create(
        model="mock-gpt", messages=MESSAGES, stream=True
    )
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == generated_text(16)
    assert all(c.usage is None for c in chunks)  # the client did not ask for usage

    expected_input = mock_tokens.count_messages(MESSAGES)  # reported: the upstream's count
    m = await stack.metrics()
    assert sample(m, "tokenmeter_tokens_total", type="output", source="reported",
                  model="mock-gpt", user="default") == 16
    assert sample(m, "tokenmeter_tokens_total", type="input", source="reported") == expected_input
    assert sample(m, "tokenmeter_requests_total", status="200", error_class="none") == 1
    assert sample(m, "gen_ai_server_time_to_first_token_seconds_count", model="mock-gpt") == 1
    assert sample(m, "tokenmeter_inter_chunk_latency_seconds_count") == 15

    (line,) = stack.access_lines()
    assert line["output_tokens"] == 16 and line["input_tokens"] == expected_input
    assert line["token_source"] == "reported" and line["user"] == "default"
    assert line["content_chunks"] == 16 and line["status"] == 200


async def test_sdk_usage_matches_upstream_report_with_details(stack: Stack) -> None:
    client = stack.client()
    stream = await client.chat.completions.create(
        model="mock-gpt", messages=MESSAGES, stream=True,
        stream_options={"include_usage": True},
        extra_headers={"x-mock-cached-tokens": "5", "x-mock-reasoning-tokens": "3"},
    )
    chunks = [c async for c in stream]
    usage = chunks[-1].usage
    assert usage is not None
    m = await stack.metrics()
    assert sample(m, "tokenmeter_tokens_total", type="input") == usage.prompt_tokens
    assert sample(m, "tokenmeter_tokens_total", type="output") == usage.completion_tokens
    assert sample(m, "tokenmeter_tokens_total", type="cached_input") == 5
    assert sample(m, "tokenmeter_tokens_total", type="reasoning") == 3


async def test_ttft_matches_upstream_delay(stack: Stack) -> None:
    client = stack.client()
    stream = await client.chat.completions.create(
        model="mock-gpt", messages=MESSAGES, stream=True,
        extra_headers={"x-mock-ttft-ms": "120", "x-mock-tokens-per-second": "500"},
    )
    async for _ in stream:
        pass
    (line,) = stack.access_lines()
    assert line["ttft_ms"] >= 120
    assert line["ttft_ms"] - 120 < 25  # "within a few ms", with room for a loaded CI box
    assert line["upstream_ttft_ms"] <= line["ttft_ms"]
    assert 0 <= line["overhead_ms"] < 20
    # 16 tokens at 500/s: 15 gaps of 2 ms in the decode phase (a late first token shortens the
    # measured phase a little on a loaded box, so the bounds are loose but would catch a wrong
    # formula: chunk counts instead of tokens, or the TTFT folded into the decode phase).
    assert 1.5 <= line["tpot_ms"] <= 3.0
    assert 330 <= line["tokens_per_second"] <= 670


async def test_non_streaming_chat(stack: Stack) -> None:
    client = stack.client()
    resp = await client.chat.completions.create(
        model="mock-gpt", messages=MESSAGES, max_tokens=7
    )
    assert resp.choices[0].message.content == generated_text(7)
    assert resp.usage is not None and resp.usage.completion_tokens == 7
    m = await stack.metrics()
    assert sample(m, "tokenmeter_tokens_total", type="output", source="reported") == 7
    assert sample(m, "tokenmeter_tokens_total", type="input") == resp.usage.prompt_tokens
    (line,) = stack.access_lines()
    assert line["stream"] is False and line["ttft_ms"] is None


async def test_responses_streaming_and_not(stack: Stack) -> None:
    client = stack.client()
    async with client.responses.stream(model="mock-gpt", input="Hello there") as stream:
        async for _ in stream:
            pass
        final = await stream.get_final_response()
    assert final.output_text == generated_text(16)
    assert final.usage is not None
    resp = await client.responses.create(model="mock-gpt", input="Hi", max_output_tokens=4)
    assert resp.usage is not None and resp.usage.output_tokens == 4
    m = await stack.metrics()
    assert sample(m, "tokenmeter_tokens_total", type="output", source="reported") == 20
    assert sample(m, "tokenmeter_tokens_total", type="input") == (
        final.usage.input_tokens + resp.usage.input_tokens
    )
    assert sample(m, "gen_ai_server_time_to_first_token_seconds_count", operation="responses") == 1
    lines = stack.access_lines()
    assert [ln["operation"] for ln in lines] == ["responses", "responses"]
    assert lines[0]["content_chunks"] == 16


async def test_completions_and_embeddings(stack: Stack) -> None:
    client = stack.client()
    stream = await client.completions.create(model="mock-gpt", prompt="Once", stream=True)
    text = "".join([c.choices[0].text async for c in stream if c.choices])
    assert text == generated_text(16)
    emb = await client.embeddings.create(model="mock-gpt", input=["a b c", "d e"])
    assert len(emb.data) == 2 and len(emb.data[0].embedding) == 8
    m = await stack.metrics()
    assert sample(m, "tokenmeter_tokens_total", type="output") == 16
    assert sample(m, "tokenmeter_tokens_total", type="input") == (
        mock_tokens.count_text("Once") + emb.usage.prompt_tokens  # both reported by the mock
    )
    ops = sorted(ln["operation"] for ln in stack.access_lines())
    assert ops == ["embeddings", "text_completion"]


async def test_no_upstream_usage_is_estimated_with_tiktoken(stack: Stack) -> None:
    client = stack.client()
    stream = await client.chat.completions.create(
        model="mock-gpt", messages=MESSAGES, stream=True,
        extra_headers={"x-mock-usage": "off"},
    )
    async for _ in stream:
        pass
    resp = await client.responses.create(
        model="mock-gpt", input="Hello", extra_headers={"x-mock-usage": "off"}
    )
    assert resp.usage is None
    m = await stack.metrics()
    # Each generated word is one token, so the estimate is exact here.
    assert sample(m, "tokenmeter_tokens_total", type="output", source="estimated") == 32
    assert sample(m, "tokenmeter_tokens_total", type="output", source="reported") == 0
    assert sample(m, "tokenmeter_tokens_total", type="input", source="estimated") == (
        tokenizer.count_messages("mock-gpt", MESSAGES) + tokenizer.count_text("mock-gpt", "Hello")
    )
    assert {ln["token_source"] for ln in stack.access_lines()} == {"estimated"}


async def test_headers_credentials_and_secrets(stack: Stack) -> None:
    client = stack.client(api_key="sk-client-secret-1234")
    await client.chat.completions.create(
        model="mock-gpt", messages=MESSAGES,
        extra_headers={"x-custom": "kept", "Connection": "keep-alive, x-hop", "x-hop": "dropped"},
    )
    seen = stack.mock.requests[-1].headers
    assert seen["authorization"] == "Bearer sk-upstream-secret-5678"
    assert seen["x-custom"] == "kept"
    assert "x-hop" not in seen
    assert seen.get("accept-encoding") == "identity"
    logged = "\n".join(r.getMessage() for r in stack.caplog.records)
    metrics_text = repr(await stack.metrics())
    for secret in ("sk-client-secret-1234", "sk-upstream-secret-5678", "secret prompt text 8472"):
        assert secret not in logged
        assert secret not in metrics_text


async def test_model_label_is_bounded(stack: Stack) -> None:
    client = stack.client()
    await client.chat.completions.create(
        model="client-made-up-model-123", messages=MESSAGES
    )
    m = await stack.metrics()
    assert sample(m, "tokenmeter_requests_total", model="*") == 1
    assert not any("client-made-up" in str(k) for k in m)
    (line,) = stack.access_lines()
    assert line["model"] == "client-made-up-model-123"  # the log keeps what was asked


async def test_upstream_connections_are_reused(aiohttp_server: ServerFactory) -> None:
    peers: set[object] = set()

    @web.middleware
    async def record_peer(request: web.Request, handler: Handler) -> web.StreamResponse:
        transport = request.transport
        peers.add(transport.get_extra_info("peername") if transport else None)
        return await handler(request)

    mock = create_mock_app(MockSettings(tokens_per_second=0, ttft_ms=0, output_tokens=8))
    mock.middlewares.append(record_peer)
    upstream = await aiohttp_server(mock)
    proxy = await aiohttp_server(create_app(config_for(str(upstream.make_url("/v1")))))
    async with aiohttp.ClientSession() as s:
        for stream in (True, False, True, False):
            async with s.post(proxy.make_url("/v1/chat/completions"),
                              json={"model": "mock-gpt", "messages": MESSAGES, "stream": stream}) as r:
                assert r.status == 200
                await r.read()
    # One pooled connection for sequential requests: no TCP handshake per request.
    assert len(peers) == 1


async def test_stream_usage_can_be_turned_off_per_upstream(
    aiohttp_server: ServerFactory, upstream: TestServer
) -> None:
    cfg = config_for(str(upstream.make_url("/v1")), stream_usage=False)
    proxy = await aiohttp_server(create_app(cfg))
    body = {"model": "mock-gpt", "messages": MESSAGES, "stream": True}
    proxied = await _raw_post(str(proxy.make_url("/v1/chat/completions")), body)
    sent = upstream.app[MOCK_STATE].requests[-1].body
    assert sent is not None and "stream_options" not in sent  # the body went as the client sent it
    assert b'"usage":null' not in proxied
    m = await scrape(proxy)
    assert sample(m, "tokenmeter_tokens_total", type="output", source="estimated") == 16


async def test_the_access_log_names_the_model_the_upstream_answered(stack: Stack) -> None:
    """The three models of a request, as OTel names them: the one asked for, the one sent
    upstream and the one the upstream's answer names (here, the mock echoes what it got)."""
    client = stack.client()
    await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
    stream = await client.chat.completions.create(model="mock-gpt", messages=MESSAGES,
                                                  stream=True)
    async for _ in stream:
        pass
    await client.responses.create(model="mock-gpt", input="hi")
    await stack.settled(3)
    lines = stack.access_lines()
    assert [line["response_model"] for line in lines] == ["mock-gpt"] * 3
    assert all(line["model"] == "mock-gpt" and line["fallback_from"] is None for line in lines)
