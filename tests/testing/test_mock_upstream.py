from __future__ import annotations

import asyncio
import base64
import json
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient
from openai.types.chat import ChatCompletionMessageParam

from proxy.protocol.tokenizer import count_text
from proxy.testing import mock_tokens
from proxy.testing.mock_upstream import (
    MOCK_STATE,
    WORDS,
    MockSettings,
    MockState,
    create_mock_app,
    generated_text,
)
from tests.helpers import read_until

Client = TestClient[web.Request, web.Application]
MakeClient = Callable[..., Awaitable[Client]]
MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Say something in mock language."}
]
# Unpaced: tests that are not about timing run as fast as the machine allows.
FAST = MockSettings(tokens_per_second=0, ttft_ms=0)


@pytest.fixture
async def mock(aiohttp_client: MakeClient) -> Client:
    return await aiohttp_client(create_mock_app(FAST))


@pytest.fixture
async def sdk(mock: Client) -> AsyncIterator[openai.AsyncOpenAI]:
    client = openai.AsyncOpenAI(base_url=str(mock.make_url("/v1")), api_key="x", max_retries=0)
    async with client:
        yield client


def state(client: Client) -> MockState:
    app = client.app
    assert app is not None
    return app[MOCK_STATE]


def sse_events(raw: bytes) -> list[bytes]:
    assert raw.endswith(b"\n\n")
    return raw[:-2].split(b"\n\n")


@pytest.mark.parametrize("model", ["gpt-4o", "gpt-4"])
def test_every_word_is_one_token(model: str) -> None:
    """By the proxy's tokenizer and by the mock's own rule: output counts agree exactly."""
    assert all(count_text(model, word) == 1 for word in WORDS)
    assert count_text(model, generated_text(137)) == 137
    assert mock_tokens.count_text(generated_text(137)) == 137
    assert generated_text(0) == ""


def test_the_mocks_own_prompt_count() -> None:
    """The documented rule (proxy/mock_tokens.py), pinned: a word or a punctuation mark is a
    token, whitespace is free; 4 per message (all its strings counted), 2 per message list."""
    assert mock_tokens.count_text("Hello, world!") == 4
    assert mock_tokens.count_text("  naïve café_au_lait 2024 ") == 3
    assert mock_tokens.count_text("") == 0
    assert mock_tokens.count_messages([]) == 2
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "name": "ann", "content": [{"type": "text", "text": "Hi!"}]}]
    # (4 + system Be brief .) + (4 + user ann text Hi !) + 2
    assert mock_tokens.count_messages(messages) == (4 + 4) + (4 + 5) + 2


async def test_reported_prompt_count_is_the_mocks_not_the_proxys(sdk: openai.AsyncOpenAI) -> None:
    """A long word is one token to the mock and several to tiktoken: the usage the mock reports
    is its own count, independent of the estimate it is compared with."""
    word = "antidisestablishmentarianism"
    assert count_text("gpt-4o", word) > 1
    done = await sdk.completions.create(model="gpt-4o", prompt=word, max_tokens=1)
    assert done.usage is not None and done.usage.prompt_tokens == 1
    chat = await sdk.chat.completions.create(
        model="gpt-4o", messages=[{"role": "user", "content": word}], max_tokens=1)
    assert chat.usage is not None and chat.usage.prompt_tokens == 4 + 2 + 2  # user, word


async def test_models(sdk: openai.AsyncOpenAI) -> None:
    models = [m async for m in sdk.models.list()]
    assert [(m.id, m.object, m.owned_by) for m in models] == [
        ("mock-gpt", "model", "tokenmeter-mock")
    ]


@pytest.mark.parametrize("include_usage", [False, True])
async def test_chat_stream_via_sdk(sdk: openai.AsyncOpenAI, include_usage: bool) -> None:
    stream = await sdk.chat.completions.create(
        model="gpt-4o",
        messages=MESSAGES,
        stream=True,
        stream_options={"include_usage": True} if include_usage else openai.omit,
        extra_headers={"x-mock-output-tokens": "23", "x-mock-cached-tokens": "4"},
    )
    chunks = [chunk async for chunk in stream]
    assert len(chunks) == 23 + 2 + include_usage
    assert len({(c.id, c.created, c.model) for c in chunks}) == 1
    assert chunks[0].model == "gpt-4o"
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == generated_text(23)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish == [None] * 24 + ["stop"]
    if not include_usage:
        assert all(c.usage is None for c in chunks)
        return
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == []
    usage = chunks[-1].usage
    assert usage is not None
    prompt = mock_tokens.count_messages(MESSAGES)  # the mock's count, not the proxy's
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        prompt,
        23,
        prompt + 23,
    )
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 4


async def test_chat_stream_wire_format(mock: Client) -> None:
    body: dict[str, Any] = {"model": "m", "messages": MESSAGES, "stream": True}
    body["stream_options"] = {"include_usage": True}
    resp = await mock.post("/v1/chat/completions", json=body, headers={"x-mock-output-tokens": "3"})
    assert resp.status == 200
    assert resp.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert resp.headers["x-request-id"].startswith("req_")
    assert int(resp.headers["openai-processing-ms"]) >= 0
    events = sse_events(await resp.read())
    assert events[-1] == b"data: [DONE]"
    objects = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    for event, obj in zip(events, objects, strict=False):
        assert event == b"data: " + json.dumps(obj, separators=(",", ":")).encode()
    assert all(o["object"] == "chat.completion.chunk" and "usage" in o for o in objects)
    assert objects[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [o["choices"][0]["delta"] for o in objects[1:4]] == [{"content": w} for w in WORDS[:3]]
    assert objects[4]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "stop",
    }
    assert objects[5]["choices"] == []
    assert objects[5]["usage"]["completion_tokens"] == 3


async def test_chat_non_streaming_clamps_to_max_tokens(sdk: openai.AsyncOpenAI) -> None:
    headers = {"x-mock-reasoning-tokens": "2"}
    for limit in ("max_tokens", "max_completion_tokens"):
        completion = await sdk.chat.completions.create(
            model="gpt-4o",
            messages=MESSAGES,
            max_tokens=5 if limit == "max_tokens" else openai.omit,
            max_completion_tokens=5 if limit == "max_completion_tokens" else openai.omit,
            extra_headers=headers,
        )
        assert completion.object == "chat.completion"
        choice = completion.choices[0]
        assert (choice.message.role, choice.message.content) == ("assistant", generated_text(5))
        assert choice.finish_reason == "length"
        usage = completion.usage
        assert usage is not None
        assert (usage.completion_tokens, usage.total_tokens) == (5, usage.prompt_tokens + 5)
        assert usage.completion_tokens_details is not None
        assert usage.completion_tokens_details.reasoning_tokens == 2
    whole = await sdk.chat.completions.create(
        model="gpt-4o",
        messages=MESSAGES,
        max_tokens=64,
    )
    assert whole.choices[0].finish_reason == "stop"
    assert whole.choices[0].message.content == generated_text(64)


async def test_usage_off_is_never_sent(aiohttp_client: MakeClient) -> None:
    mock = await aiohttp_client(create_mock_app(MockSettings(tokens_per_second=0, usage=False)))
    body: dict[str, Any] = {"model": "m", "messages": MESSAGES}
    resp = await mock.post("/v1/chat/completions", json=body)
    assert "usage" not in await resp.json()
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    resp = await mock.post("/v1/chat/completions", json=body)
    assert b"usage" not in await resp.read()
    # ...and a header can switch it back on for one request.
    resp = await mock.post("/v1/chat/completions", json=body, headers={"x-mock-usage": "on"})
    assert b'"usage":{"prompt_tokens"' in await resp.read()


async def test_legacy_completions(sdk: openai.AsyncOpenAI) -> None:
    prompts = ["Once upon a time", "In a galaxy"]
    completion = await sdk.completions.create(model="gpt-4o", prompt=prompts, max_tokens=7)
    assert completion.object == "text_completion"
    assert completion.choices[0].text == generated_text(7)
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == mock_tokens.count_texts(prompts) == 7
    stream = await sdk.completions.create(
        model="gpt-4o",
        prompt="hello",
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"x-mock-output-tokens": "9"},
    )
    chunks = [chunk async for chunk in stream]
    assert len(chunks) == 9 + 2
    assert "".join(c.choices[0].text for c in chunks if c.choices) == generated_text(9)
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == mock_tokens.count_text("hello") == 1


async def test_responses_stream_via_sdk(sdk: openai.AsyncOpenAI, mock: Client) -> None:
    headers = {"x-mock-output-tokens": "12", "x-mock-cached-tokens": "3"}
    async with sdk.responses.stream(
        model="gpt-4o", input="Tell me a story", extra_headers=headers
    ) as stream:
        deltas = [
            event.delta async for event in stream if event.type == "response.output_text.delta"
        ]
        final = await stream.get_final_response()
    assert "".join(deltas) == generated_text(12)
    assert final.status == "completed"
    assert final.output_text == generated_text(12)
    assert final.usage is not None
    prompt = mock_tokens.count_text("Tell me a story")
    assert (final.usage.input_tokens, final.usage.output_tokens) == (prompt, 12)
    assert final.usage.total_tokens == prompt + 12
    assert final.usage.input_tokens_details.cached_tokens == 3
    assert final.usage.output_tokens_details.reasoning_tokens == 0

    raw = await sdk.responses.create(
        model="gpt-4o", input=[{"role": "user", "content": "Tell me a story"}], stream=True
    )
    events = [event async for event in raw]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[4:-4] == ["response.output_text.delta"] * 64
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    # The same framing as OpenAI: an `event:` line naming the type before each `data:` line.
    resp = await mock.post("/v1/responses", json={"model": "m", "input": "x", "stream": True})
    first = sse_events(await resp.read())[0]
    assert first.startswith(b'event: response.created\ndata: {"type":"response.created"')


async def test_responses_incomplete_and_usage_off(sdk: openai.AsyncOpenAI) -> None:
    response = await sdk.responses.create(model="gpt-4o", input="hi", max_output_tokens=4)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == generated_text(4)
    assert response.usage is not None
    assert response.usage.output_tokens == 4
    stream = await sdk.responses.create(
        model="gpt-4o", input="hi", stream=True, extra_headers={"x-mock-usage": "off"}
    )
    events = [event async for event in stream]
    assert events[-1].type == "response.completed"
    assert events[-1].response.usage is None


async def test_embeddings_via_sdk(sdk: openai.AsyncOpenAI) -> None:
    inputs = ["first text", "second, longer text"]
    decoded = await sdk.embeddings.create(model="text-embedding-3-small", input=inputs)
    assert [len(e.embedding) for e in decoded.data] == [8, 8]
    assert all(0 <= x < 1 for e in decoded.data for x in e.embedding)
    assert decoded.usage.prompt_tokens == mock_tokens.count_texts(inputs) == 2 + 4
    assert decoded.usage.total_tokens == decoded.usage.prompt_tokens
    floats = await sdk.embeddings.create(
        model="text-embedding-3-small", input=inputs, encoding_format="float"
    )
    assert [e.embedding for e in floats.data] == [e.embedding for e in decoded.data]
    raw = await sdk.embeddings.create(
        model="text-embedding-3-small", input=[[1, 2, 3]], encoding_format="base64"
    )
    packed = base64.b64decode(raw.data[0].embedding)  # type: ignore[arg-type]
    assert len(struct.unpack("<8f", packed)) == 8
    assert raw.usage.prompt_tokens == 3


async def test_injected_errors(sdk: openai.AsyncOpenAI) -> None:
    async def chat(**headers: str) -> None:
        await sdk.chat.completions.create(
            model="gpt-4o",
            messages=MESSAGES,
            extra_headers={f"x-mock-{k.replace('_', '-')}": v for k, v in headers.items()},
        )

    with pytest.raises(openai.RateLimitError) as rate:
        await chat(status="429")
    assert rate.value.code == "rate_limit_exceeded"
    assert rate.value.response.headers["retry-after"] == "1"
    with pytest.raises(openai.BadRequestError) as bad:
        await chat(status="400", error_code="context_length_exceeded")
    assert bad.value.code == "context_length_exceeded"
    assert bad.value.type == "invalid_request_error"
    assert "maximum context length" in bad.value.message
    with pytest.raises(openai.AuthenticationError) as auth:
        await chat(status="401")
    assert auth.value.code == "invalid_api_key"
    with pytest.raises(openai.InternalServerError) as server:
        await chat(status="503")
    assert server.value.type == "server_error"


async def test_bad_requests(sdk: openai.AsyncOpenAI, mock: Client) -> None:
    with pytest.raises(openai.BadRequestError, match="x-mock-output-tokens"):
        await sdk.chat.completions.create(
            model="gpt-4o",
            messages=MESSAGES,
            extra_headers={"x-mock-output-tokens": "many"},
        )
    for data in (b"{not json", json.dumps({"messages": MESSAGES}).encode()):
        resp = await mock.post("/v1/chat/completions", data=data)
        assert resp.status == 400
        error = (await resp.json())["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error"
    for path in ("/v1/nowhere", "/v2/chat/completions"):
        resp = await mock.post(path, json={})
        assert resp.status == 404
        assert (await resp.json())["error"]["message"] == f"Invalid URL (POST {path})"


async def test_reset_after_aborts_the_connection(sdk: openai.AsyncOpenAI, mock: Client) -> None:
    stream = await sdk.chat.completions.create(
        model="gpt-4o",
        messages=MESSAGES,
        stream=True,
        extra_headers={"x-mock-reset-after": "5"},
    )
    received: list[str] = []
    with pytest.raises(openai.APIConnectionError):
        async for chunk in stream:
            received.append(chunk.choices[0].delta.content or "")
    assert "".join(received) == generated_text(5)
    await asyncio.wait_for(state(mock).requests[-1].closed.wait(), 5)


async def test_stall_after_ends_when_the_client_leaves(
    sdk: openai.AsyncOpenAI, mock: Client
) -> None:
    stream = await sdk.chat.completions.create(
        model="gpt-4o",
        messages=MESSAGES,
        stream=True,
        extra_headers={"x-mock-stall-after": "3"},
    )
    chunks = aiter(stream)
    received = [(await anext(chunks)).choices[0].delta.content for _ in range(4)]
    assert "".join(c or "" for c in received) == generated_text(3)
    with pytest.raises(TimeoutError):  # stalled: nothing more comes while the client waits
        await asyncio.wait_for(anext(chunks), 0.2)
    request = state(mock).requests[-1]
    assert not request.closed.is_set()
    assert state(mock).active == 1
    await stream.close()
    await asyncio.wait_for(request.closed.wait(), 5)
    assert state(mock).active == 0


async def test_stall_without_handler_cancellation() -> None:
    # Servers run without handler cancellation cannot cancel the stall: it must notice by itself.
    app = create_mock_app(FAST)
    runner = web.AppRunner(app, handler_cancellation=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        body = json.dumps({"model": "m", "messages": MESSAGES, "stream": True}).encode()
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"x-mock-stall-after: 2\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        await writer.drain()
        # Up to the stall; an early EOF fails at once (a bare read loop would spin on b"").
        await read_until(reader, lambda data: data.count(b"data: ") >= 3)
        writer.close()
        await writer.wait_closed()
        await asyncio.wait_for(app[MOCK_STATE].requests[-1].closed.wait(), 5)
    finally:
        await runner.cleanup()


async def test_header_overrides_apply_to_one_request(mock: Client) -> None:
    body = {"model": "gpt-4o", "messages": MESSAGES}
    headers = {
        "x-mock-output-tokens": "3",
        "x-mock-cached-tokens": "7",
        "x-mock-reasoning-tokens": "2",
        "X-Mock-Status": "200",
    }
    first = await (await mock.post("/v1/chat/completions", json=body, headers=headers)).json()
    second = await (await mock.post("/v1/chat/completions", json=body)).json()
    assert first["choices"][0]["message"]["content"] == generated_text(3)
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 7}
    assert first["usage"]["completion_tokens_details"] == {"reasoning_tokens": 2}
    assert second["choices"][0]["message"]["content"] == generated_text(64)
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    recorded = state(mock).requests
    assert [r.path for r in recorded] == ["/v1/chat/completions"] * 2
    assert recorded[0].headers["x-mock-status"] == "200"
    assert recorded[0].body == body
    assert all(r.closed.is_set() for r in recorded)
    assert state(mock).active == 0


async def test_pacing_lower_bounds(mock: Client) -> None:
    # Lower bounds only: a loaded machine can make the mock late, never early.
    body = {"model": "m", "messages": MESSAGES, "stream": True}
    headers = {
        "x-mock-ttft-ms": "50",
        "x-mock-tokens-per-second": "400",
        "x-mock-output-tokens": "21",
        "x-mock-delay-ms": "30",
    }
    started = time.perf_counter()
    resp = await mock.post("/v1/chat/completions", json=body, headers=headers)
    headers_at = time.perf_counter() - started
    first = await resp.content.readuntil(b"\n\n")  # the role chunk, sent with the first token
    first_at = time.perf_counter() - started
    rest = await resp.read()
    done_at = time.perf_counter() - started
    assert b'"role":"assistant"' in first
    assert headers_at >= 0.030
    assert first_at >= 0.030 + 0.050
    assert done_at >= 0.030 + 0.050 + 20 / 400
    assert rest.count(b'"content":') == 21


async def test_fast_stream_is_complete(mock: Client) -> None:
    # At benchmark rates many tokens are due per wake-up and get coalesced into one write.
    body = {"model": "m", "messages": MESSAGES, "stream": True}
    headers = {"x-mock-tokens-per-second": "14000", "x-mock-output-tokens": "1500"}
    resp = await mock.post("/v1/chat/completions", json=body, headers=headers)
    events = sse_events(await resp.read())
    assert len(events) == 1500 + 3
    text = "".join(json.loads(e[6:])["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert text == generated_text(1500)


@pytest.mark.parametrize(
    "bad",
    [{"ttft_ms": -1.0}, {"status": 302}, {"reset_after": -1}, {"tokens_per_second": float("nan")}],
)
def test_settings_are_validated(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        MockSettings(**bad)


async def test_header_can_switch_off_a_configured_fault(aiohttp_client: MakeClient) -> None:
    mock = await aiohttp_client(create_mock_app(MockSettings(tokens_per_second=0, stall_after=1)))
    body = {"model": "m", "messages": MESSAGES, "stream": True}
    headers = {"x-mock-stall-after": "none"}
    resp = await mock.post("/v1/chat/completions", json=body, headers=headers)
    assert (await resp.read()).endswith(b"data: [DONE]\n\n")


async def test_fail_first_then_healthy_per_scenario(mock: Client) -> None:
    body = {"model": "gpt-4o", "messages": MESSAGES}
    headers = {"x-mock-status": "500", "x-mock-fail-first": "2", "x-mock-retry-after-ms": "250"}
    statuses = []
    for scenario in ("a", "a", "a", "b"):
        resp = await mock.post(
            "/v1/chat/completions", json=body, headers={**headers, "x-mock-scenario": scenario}
        )
        statuses.append(resp.status)
        if resp.status == 500:
            assert resp.headers["retry-after-ms"] == "250"
            assert resp.headers["retry-after"] == "1"
    assert statuses == [500, 500, 200, 500]


async def test_garbage_is_inserted_and_chunks_are_cut(mock: Client) -> None:
    body = {"model": "gpt-4o", "messages": MESSAGES, "stream": True}
    headers = {"x-mock-output-tokens": "10", "x-mock-garbage-after": "3"}
    plain = await (await mock.post("/v1/chat/completions", json=body, headers=headers)).read()
    assert b"not an event" in plain
    # The garbage comes after the third token event (plus the role chunk).
    before = plain.split(b"\x00\xff")[0]
    assert before.count(b'"content":" ') == 3
    resp = await mock.post(
        "/v1/chat/completions", json=body, headers={**headers, "x-mock-chunk-seed": "7"}
    )
    pieces = [piece async for piece in resp.content.iter_any()]
    joined = b"".join(pieces)
    assert len(pieces) > 5
    # Same events, ids and timestamps aside.
    assert joined.count(b"\n\n") == plain.count(b"\n\n")


async def test_stats_count_usage_of_finished_responses(mock: Client) -> None:
    body: dict[str, Any] = {"model": "gpt-4o", "messages": MESSAGES, "stream": True,
                            "stream_options": {"include_usage": True}}
    await (await mock.post("/v1/chat/completions", json=body,
                           headers={"x-mock-output-tokens": "7"})).read()
    await (await mock.post("/v1/chat/completions", json={**body, "stream": False},
                           headers={"x-mock-output-tokens": "5"})).read()
    broken = await mock.post("/v1/chat/completions", json=body,
                             headers={"x-mock-output-tokens": "9", "x-mock-reset-after": "2"})
    with pytest.raises(aiohttp.ClientPayloadError):
        await broken.read()
    stats = await (await mock.get("/_mock/stats")).json()
    assert stats["requests"] == 2
    assert stats["completion_tokens"] == 12


async def test_error_type_and_context_length_at_any_status(sdk: openai.AsyncOpenAI) -> None:
    """A validation error answered with a 500, as some servers send it."""
    with pytest.raises(openai.InternalServerError) as typed:
        await sdk.chat.completions.create(
            model="gpt-4o", messages=MESSAGES,
            extra_headers={"x-mock-status": "500", "x-mock-error-type": "invalid_request_error",
                           "x-mock-error-code": "invalid_value"},
        )
    assert (typed.value.type, typed.value.code) == ("invalid_request_error", "invalid_value")
    with pytest.raises(openai.InternalServerError) as context:
        await sdk.chat.completions.create(
            model="gpt-4o", messages=MESSAGES,
            extra_headers={"x-mock-status": "500", "x-mock-error-code": "context_length_exceeded"},
        )
    assert context.value.type == "invalid_request_error"
    assert "maximum context length" in context.value.message


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
async def test_end_after_zero_is_an_event_stream_without_events(mock: Client, path: str) -> None:
    body = {"model": "gpt-4o", "messages": MESSAGES, "input": "hi", "stream": True}
    resp = await mock.post(path, json=body, headers={"x-mock-end-after": "0"})
    assert resp.status == 200 and resp.content_type == "text/event-stream"
    assert await resp.read() == b""
    assert state(mock).reported["requests"] == 0


async def test_end_after_stops_cleanly_without_final_events(mock: Client) -> None:
    body = {"model": "gpt-4o", "messages": MESSAGES, "stream": True,
            "stream_options": {"include_usage": True}}
    resp = await mock.post("/v1/chat/completions", json=body, headers={"x-mock-end-after": "3"})
    events = sse_events(await resp.read())
    deltas = [json.loads(e[6:])["choices"][0]["delta"] for e in events]
    assert "".join(d.get("content") or "" for d in deltas) == generated_text(3)
    assert len(events) == 4  # the role chunk, three tokens: no finish, usage or [DONE]


async def test_omit_done_sends_everything_but_done(mock: Client) -> None:
    body = {"model": "gpt-4o", "messages": MESSAGES, "stream": True,
            "stream_options": {"include_usage": True}}
    resp = await mock.post("/v1/chat/completions", json=body, headers={"x-mock-omit-done": "on"})
    events = sse_events(await resp.read())
    assert b"[DONE]" not in events[-1]
    assert json.loads(events[-1][6:])["usage"]["completion_tokens"] == FAST.output_tokens
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "stop"
