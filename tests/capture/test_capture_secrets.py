"""No secret in any field of a capture, on either store, with the SDKs as clients through a real
proxy: secrets an upstream streams token by token inside a tool call's arguments (issue 31,
item 11), and the keys the proxy knows (the upstream's, the client's own), whatever they look
like and however JSON escapes them (item 12). The upstreams here are scripted in the test (a
stream of pieces the way OpenAI and Anthropic send tool calls), sharing no code with capture."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anthropic
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.capture.record import Capture
from proxy.capture.store import CaptureStore
from proxy.server.app import create_app
from tests.helpers import ServerFactory, make_config, tokenmeter, until

SK = "sk-proj-Zx9Qw8Er7Ty6Ui5Op4As3Df2"
MAIL = "alice.smith@example.com"
ARGS = json.dumps({"api_key": SK, "notify": MAIL})  # what the model "calls" the tool with
# Keys that look like no pattern: only known literally. `/` and `"` change under JSON escaping.
CLIENT_KEY = 'tm-alice/"Qx7-client-0042'
UPSTREAM_KEY = 'up-upstream/"Kv3-key-0099'


def pieces(text: str, size: int = 3) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def forms(secret: str) -> list[str]:
    """The secret and the forms JSON gives it, once and twice escaped."""
    once = json.dumps(secret)[1:-1]
    return [secret, once, json.dumps(once)[1:-1]]


def _openai_events() -> list[bytes]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
                "model": "tool-model",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    objs = [chunk({"role": "assistant", "content": None, "tool_calls": [
        {"index": 0, "id": "call_1", "type": "function",
         "function": {"name": "send", "arguments": ""}}]})]
    objs += [chunk({"tool_calls": [{"index": 0, "function": {"arguments": p}}]})
             for p in pieces(ARGS)]
    objs += [chunk({}, "tool_calls"),
             {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
              "model": "tool-model", "choices": [],
              "usage": {"prompt_tokens": 9, "completion_tokens": 30, "total_tokens": 39}}]
    return [b"data: " + json.dumps(o).encode() + b"\n\n" for o in objs] + [b"data: [DONE]\n\n"]


def _anthropic_events() -> list[bytes]:
    def event(kind: str, obj: dict[str, Any]) -> bytes:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **obj})}\n\n".encode()

    out = [event("message_start", {"message": {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "tool-model",
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": 9, "output_tokens": 1}}}),
        event("content_block_start", {"index": 0, "content_block": {
            "type": "tool_use", "id": "toolu_1", "name": "send", "input": {}}})]
    out += [event("content_block_delta",
                  {"index": 0, "delta": {"type": "input_json_delta", "partial_json": p}})
            for p in pieces(ARGS)]
    out += [event("content_block_stop", {"index": 0}),
            event("message_delta", {"delta": {"stop_reason": "tool_use", "stop_sequence": None},
                                    "usage": {"output_tokens": 30}}),
            event("message_stop", {})]
    return out


def _scripted_upstream() -> web.Application:
    """Streams a tool call whose arguments hold SK and MAIL, three characters an event; a
    request with `x-echo-key` is refused (400) with a body that repeats the key the proxy sent
    it, as some upstreams' errors do."""

    async def answer(request: web.Request) -> web.StreamResponse:
        anthropic_api = request.path == "/v1/messages"
        sent = request.headers.get("x-api-key") if anthropic_api else (
            request.headers.get("Authorization", "").removeprefix("Bearer "))
        if request.headers.get("x-echo-key"):
            return web.json_response(
                {"type": "error", "error": {"type": "invalid_request_error",
                                            "message": f"Invalid key {sent}"}}, status=400)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in _anthropic_events() if anthropic_api else _openai_events():
            await response.write(event)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    app.router.add_post("/v1/messages", answer)
    return app


async def _proxy(aiohttp_server: ServerFactory, upstream: TestServer, store_url: str,
                 api: str) -> TestServer:
    # The store's table made before the proxy starts (whose writer opens the store at start,
    # for retention): two first opens at once race in PostgreSQL's CREATE ... IF NOT EXISTS.
    await (await CaptureStore.open(store_url)).close()
    config = make_config(
        str(upstream.make_url("/v1")), api=api, api_key=UPSTREAM_KEY,
        users={"alice": {"keys": [CLIENT_KEY]}},
        extra={"capture": {"enabled": True, "url": store_url, "sample": 1.0}},
    )
    return await aiohttp_server(create_app(config))


async def _stored_raw(url: str, request_id: str) -> Capture:
    """The capture as stored, read with no redaction at all (a stream's output reassembled
    from its stored events as is): what is on disk, joined the way a reader joins it."""
    store = await CaptureStore.open(url)
    try:
        async def there() -> bool:
            return await store.get(request_id) is not None

        await until(there, deadline=30)
        found = await store.get(request_id, lambda text: text)
        assert found is not None
        return found
    finally:
        await store.close()


def _show(url: str, request_id: str, fmt: str) -> str:
    shown = tokenmeter("captures", "show", request_id, "--format", fmt, "--url", url)
    assert shown.returncode == 0, shown.stderr
    return shown.stdout


def _streamed_arguments(capture: Capture) -> str:
    """The tool call's arguments joined from the stored events, as a client joins them."""
    joined = ""
    for event in capture.events:
        data = event.text.rpartition("data: ")[2]
        if not data.startswith("{"):
            continue
        obj = json.loads(data)
        for choice in obj.get("choices") or ():
            for call in choice["delta"].get("tool_calls") or ():
                joined += call["function"].get("arguments", "")
        delta = obj.get("delta") or {}
        joined += delta.get("partial_json", "")
    return joined


def _texts(capture: Capture) -> str:
    """Every text the capture holds, as it holds it (not escaped again by a dump)."""
    bodies = (capture.request, capture.upstream_request, capture.response,
              capture.upstream_error)
    return "\n".join([*(b.text for b in bodies if b is not None),
                       *(e.text for e in capture.events), capture.output_text or "",
                       capture.reasoning or "", *(json.dumps(c) for c in capture.tool_calls),
                       *(c["arguments"] for c in capture.tool_calls if "arguments" in c)])


def _no_secret_in(text: str, *secrets: str) -> None:
    for secret in secrets:
        for form in forms(secret):
            assert form not in text, form


@pytest.mark.timeout(120)
@pytest.mark.parametrize("api", ["openai", "anthropic"])
async def test_a_streamed_tool_calls_secrets_are_in_no_field_of_its_capture(
    store_url: str, aiohttp_server: ServerFactory, api: str
) -> None:
    upstream = await aiohttp_server(_scripted_upstream())
    proxy = await _proxy(aiohttp_server, upstream, store_url, api)
    if api == "openai":
        client = openai.AsyncOpenAI(base_url=str(proxy.make_url("/v1")), api_key=CLIENT_KEY,
                                    max_retries=0)
        raw = await client.chat.completions.with_raw_response.create(
            model="tool-model", stream=True, max_tokens=64,
            messages=[{"role": "user", "content": "send it"}],
            tools=[{"type": "function", "function": {"name": "send", "parameters": {}}}])
        request_id = raw.headers["x-tokenmeter-request-id"]
        got = ""
        async for chunk in raw.parse():
            for call in (chunk.choices[0].delta.tool_calls or ()) if chunk.choices else ():
                got += call.function.arguments or "" if call.function else ""
    else:
        aclient = anthropic.AsyncAnthropic(base_url=str(proxy.make_url("")).rstrip("/"),
                                           api_key=CLIENT_KEY, max_retries=0)
        async with aclient.messages.stream(
            model="tool-model", max_tokens=64, messages=[{"role": "user", "content": "send"}],
            tools=[{"name": "send", "input_schema": {"type": "object"}}],
        ) as stream:
            message = await stream.get_final_message()
            request_id = stream.response.headers["x-tokenmeter-request-id"]
        got = json.dumps(message.content[0].input)  # type: ignore[union-attr]
    assert json.loads(got) == json.loads(ARGS)  # the client got the answer untouched
    capture = await _stored_raw(store_url, request_id)
    assert capture.events and capture.stream
    # Joined as a client joins them, the stored events' arguments hold neither secret.
    joined = _streamed_arguments(capture)
    assert "[REDACTED]" in joined
    _no_secret_in(joined, SK, MAIL)
    assert len(capture.tool_calls) == 1
    _no_secret_in(_texts(capture), SK, MAIL)
    _no_secret_in(json.dumps(capture.to_json()), SK, MAIL)
    for fmt in ("json", "text"):
        _no_secret_in(await asyncio.to_thread(_show, store_url, request_id, fmt), SK, MAIL)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("api", ["openai", "anthropic"])
async def test_the_keys_the_proxy_knows_are_redacted_whatever_their_shape(
    store_url: str, aiohttp_server: ServerFactory, api: str
) -> None:
    """The client's own key in its prompt (as JSON escapes it, and inside a JSON string in a
    message), and the upstream's key echoed in the upstream's error body: none of them, in any
    form, in the capture."""
    upstream = await aiohttp_server(_scripted_upstream())
    proxy = await _proxy(aiohttp_server, upstream, store_url, api)
    said = [{"role": "user", "content": f"my key is {CLIENT_KEY}"},
            {"role": "assistant", "content": json.dumps({"token": CLIENT_KEY})},
            {"role": "user", "content": "ok?"}]
    echo = {"x-echo-key": "1"}
    if api == "openai":
        client = openai.AsyncOpenAI(base_url=str(proxy.make_url("/v1")), api_key=CLIENT_KEY,
                                    max_retries=0)
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model="tool-model", max_tokens=16,
                                                 messages=said,  # type: ignore[arg-type]
                                                 extra_headers=echo)
        response = refused.value.response
    else:
        aclient = anthropic.AsyncAnthropic(base_url=str(proxy.make_url("")).rstrip("/"),
                                           api_key=CLIENT_KEY, max_retries=0)
        with pytest.raises(anthropic.BadRequestError) as arefused:
            await aclient.messages.create(model="tool-model", max_tokens=16,
                                          messages=said,  # type: ignore[arg-type]
                                          extra_headers=echo)
        response = arefused.value.response
    request_id = response.headers["x-tokenmeter-request-id"]
    assert json.dumps({"k": CLIENT_KEY})[7:-2] in response.request.content.decode()
    capture = await _stored_raw(store_url, request_id)
    assert capture.upstream_error is not None and "[REDACTED]" in capture.upstream_error.text
    assert capture.request.text.count("[REDACTED]") == 2
    _no_secret_in(_texts(capture), CLIENT_KEY, UPSTREAM_KEY)
    _no_secret_in(json.dumps(capture.to_json()), CLIENT_KEY, UPSTREAM_KEY)
    for fmt in ("json", "text"):
        _no_secret_in(await asyncio.to_thread(_show, store_url, request_id, fmt),
                      CLIENT_KEY, UPSTREAM_KEY)
