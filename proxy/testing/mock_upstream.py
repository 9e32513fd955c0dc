"""A simulated OpenAI-compatible (and Anthropic Messages) upstream for tests, benchmarks and
the quickstart.

It speaks the wire format of the real API closely enough for the `openai` SDK to parse it, and
generates text whose token count is known exactly (every word of `WORDS` is one token in both
o200k_base and cl100k_base), so a test can check the proxy's metering to the token. Prompt tokens
it counts by a fixed rule of its own (`proxy.testing.mock_tokens`), not with the proxy's
tokenizer, so its reports and the proxy's estimates are independent, as with a real server.
Behaviour comes from `MockSettings`, and each request may override any field through an
`x-mock-*` header, so one server can play many scenarios: slow or stalled streams, resets,
injected errors, missing usage.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import functools
import hashlib
import json
import math
import random
import struct
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from proxy.testing.mock_settings import (
    GARBAGE,
    HEALTHY,
    MOCK_STATE,
    SCENARIO_HEADER,
    SETTINGS,
    MockSettings,
    MockState,
    ReceivedRequest,
    effective,
)
from proxy.testing.mock_tokens import count_anthropic, count_messages, count_text, count_texts

__all__ = ["MOCK_STATE", "WORDS", "MockSettings", "MockState", "create_mock_app",
           "generated_text", "run_mock"]

WORDS = (" the", " of", " and", " to", " in", " is", " that", " it", " for", " on")


def generated_text(n: int) -> str:
    return "".join(WORDS[i % len(WORDS)] for i in range(n))


_FINGERPRINT = "fp_tokenmeter_mock"
# Tokens per write when pacing is off: big enough to be fast, small enough to still be a stream
# and to let the other streams on the loop progress.
_BURST = 64
_STALL_POLL_S = 0.05
# The fields of a Responses API `response` object that the mock never varies.
_RESPONSE_STATIC = (
    '{"background":false,"error":null,"parallel_tool_calls":true,"previous_response_id":null,'
    '"reasoning":{"effort":null,"summary":null},"store":false,"temperature":1.0,'
    '"text":{"format":{"type":"text"}},"tool_choice":"auto","tools":[],"top_p":1.0,'
    '"truncation":"disabled","user":null,"metadata":{}}'
)


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


@dataclass
class _ApiError(Exception):
    status: int
    message: str
    param: str | None = None
    code: str | None = None
    type_: str = "invalid_request_error"
    headers: Mapping[str, str] = field(default_factory=dict)
    # The error's type in Anthropic's shape when it is not the status's usual one.
    anthropic_type: str | None = None

    def response(self, request_id: str, *, anthropic: bool = False) -> web.Response:
        headers = {"Content-Type": "application/json", "x-request-id": request_id, **self.headers}
        if anthropic:
            type_ = self.anthropic_type or _ANTHROPIC_TYPES.get(self.status, "api_error")
            body = {"type": "error", "error": {"type": type_, "message": self.message}}
            headers["request-id"] = request_id
            return web.Response(status=self.status, body=_dumps(body), headers=headers)
        error = dict(message=self.message, type=self.type_, param=self.param, code=self.code)
        return web.Response(status=self.status, body=_dumps({"error": error}), headers=headers)


# Anthropic's error type per status (docs.anthropic.com, "Errors").
_ANTHROPIC_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
    500: "api_error", 529: "overloaded_error",
}


@dataclass(frozen=True)
class _Call:
    request: web.Request
    cfg: MockSettings
    body: dict[str, Any]
    model: str
    prompt_tokens: int
    request_id: str
    started: float

    @property
    def stream(self) -> bool:
        return self.body.get("stream") is True

    def headers(self, content_type: str) -> dict[str, str]:
        elapsed_ms = (asyncio.get_running_loop().time() - self.started) * 1000
        return {
            "Content-Type": content_type,
            "x-request-id": self.request_id,
            "openai-processing-ms": str(round(elapsed_ms)),
        }


_Endpoint = Callable[[_Call], Awaitable[web.StreamResponse]]


def _endpoint(
    fn: _Endpoint, *, needs_body: bool = True, inject: bool = True, anthropic: bool = False
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handler(request: web.Request) -> web.StreamResponse:
        started = asyncio.get_running_loop().time()
        raw = await request.read()
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = None
        body = parsed if isinstance(parsed, dict) else None
        headers = {name.lower(): value for name, value in request.headers.items()}
        received = ReceivedRequest(path=request.path, headers=headers, body=body)
        state = request.app[MOCK_STATE]
        state.requests.append(received)
        state.active += 1
        request_id = "req_" + uuid.uuid4().hex
        try:
            try:
                cfg = effective(request.app[SETTINGS], request.headers)
            except ValueError as exc:
                raise _ApiError(400, str(exc)) from None
            if cfg.fail_first is not None:
                scenario = request.headers.get(SCENARIO_HEADER, "")
                seen = state.attempts[scenario] = state.attempts.get(scenario, 0) + 1
                if seen > cfg.fail_first:
                    cfg = dataclasses.replace(cfg, **HEALTHY)
            if needs_body and body is None:
                raise _ApiError(400, "We could not parse the JSON body of your request.")
            body = body or {}
            model = body.get("model") if needs_body else cfg.model
            if not isinstance(model, str) or not model:
                raise _ApiError(400, "you must provide a model parameter")
            prompt_tokens = _prompt_tokens(request.path, body) if needs_body else 0
            call = _Call(request, cfg, body, model, prompt_tokens, request_id, started)
            if inject:
                await _sleep_ms(cfg.delay_ms)
                if cfg.status != 200:
                    raise _injected_error(call)
            return await fn(call)
        except _ApiError as exc:
            return exc.response(request_id, anthropic=anthropic)
        finally:
            state.active -= 1
            received.closed.set()

    return handler


def _injected_error(call: _Call) -> _ApiError:
    error = _default_error(call)
    if call.cfg.error_type is not None:
        error.type_ = error.anthropic_type = call.cfg.error_type
    return error


def _default_error(call: _Call) -> _ApiError:
    status, code = call.cfg.status, call.cfg.error_code
    if code == "context_length_exceeded":
        message = (
            "This model's maximum context length is 128000 tokens. However, your messages "
            f"resulted in {call.prompt_tokens} tokens. Please reduce the length of the messages."
        )
        return _ApiError(status, message, "messages", code)
    if status == 401:
        message = "Incorrect API key provided: sk-mock. You can find your API key in your account."
        return _ApiError(401, message, None, code or "invalid_api_key")
    if status == 429:
        code = code or "rate_limit_exceeded"
        type_ = "insufficient_quota" if code == "insufficient_quota" else "requests"
        message = f"Rate limit reached for {call.model} (mock). Please try again in 1s."
        headers = _retry_headers(call.cfg) or {"retry-after": "1"}
        return _ApiError(429, message, None, code, type_=type_, headers=headers)
    if status >= 500:
        message = "The server had an error while processing your request. Sorry about that!"
        return _ApiError(status, message, None, code, type_="server_error",
                         headers=_retry_headers(call.cfg))
    return _ApiError(status, f"Mock upstream injected HTTP {status}.", None, code)


def _retry_headers(cfg: MockSettings) -> dict[str, str]:
    if cfg.retry_after_ms is None:
        return {}
    ms = cfg.retry_after_ms
    return {"retry-after-ms": f"{ms:g}", "retry-after": str(math.ceil(ms / 1000))}


async def _sleep_ms(ms: float) -> None:
    if ms > 0:
        await asyncio.sleep(ms / 1000)


def _prompt_tokens(path: str, body: dict[str, Any]) -> int:
    if path.endswith(("/messages", "/messages/count_tokens")):
        if not isinstance(body.get("messages"), list):
            raise _ApiError(400, "messages: Field required", "messages")
        return count_anthropic(body)
    if path.endswith("/chat/completions"):
        if not isinstance(messages := body.get("messages"), list):
            message = "Missing required parameter: 'messages'."
            raise _ApiError(400, message, "messages", "missing_required_parameter")
        return count_messages(messages)
    if path.endswith("/responses"):
        value, param = body.get("input", ""), "input"
        if isinstance(value, list):
            return count_messages(value)
    elif path.endswith("/embeddings"):
        value, param = body.get("input"), "input"
        if value in (None, "", []):
            raise _ApiError(400, "Missing required parameter: 'input'.", "input")
    elif path.endswith("/completions"):
        value, param = body.get("prompt", ""), "prompt"
    else:
        return 0
    return _count_input(value, param)


def _count_input(value: Any, param: str) -> int:
    """The tokens of an `input` or `prompt`: a text, a list of texts, one token array or a
    list of token arrays."""
    if isinstance(value, str):
        return count_text(value)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return count_texts(value)
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return len(value)
    if isinstance(value, list) and all(isinstance(v, list) for v in value):
        return sum(len(v) for v in value)
    raise _ApiError(400, f"Invalid value for '{param}'.", param)


def _output_count(call: _Call, keys: tuple[str, ...]) -> tuple[int, bool]:
    """Tokens to generate, and whether a max-tokens parameter cut the generation short."""
    limit = call.cfg.output_tokens
    for key in keys:
        value = call.body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _ApiError(400, f"Invalid value for '{key}'.", key)
        limit = min(limit, value)
    return limit, limit < call.cfg.output_tokens


def _completion_usage(call: _Call, n: int) -> dict[str, Any] | None:
    if not call.cfg.usage:
        return None
    return {
        "prompt_tokens": call.prompt_tokens,
        "completion_tokens": n,
        "total_tokens": call.prompt_tokens + n,
        "prompt_tokens_details": {"cached_tokens": call.cfg.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": call.cfg.reasoning_tokens},
    }


async def _json_response(call: _Call, obj: dict[str, Any]) -> web.StreamResponse:
    await _sleep_ms(call.cfg.ttft_ms)
    resp = web.StreamResponse(headers=call.headers("application/json"))
    body = _dumps(obj)
    resp.content_length = len(body)
    try:
        await resp.prepare(call.request)
        await _writer(resp, call.cfg)(body)
        await resp.write_eof()
    except ConnectionError:
        return resp
    call.request.app[MOCK_STATE].record_usage(obj.get("usage"))
    return resp


def _writer(resp: web.StreamResponse, cfg: MockSettings) -> Callable[[bytes], Awaitable[None]]:
    """resp.write, or with chunk_seed, writes of random pieces (each flushed on its own)."""
    if cfg.chunk_seed is None:
        return resp.write
    rng = random.Random(cfg.chunk_seed)

    async def write(data: bytes) -> None:
        start = 0
        while start < len(data):
            end = min(len(data), start + rng.randint(1, 64))
            await resp.write(data[start:end])
            await asyncio.sleep(0)  # let the transport send this piece on its own
            start = end

    return write


def _fault(cfg: MockSettings, n: int) -> tuple[int, str | None]:
    """How many tokens to send, and what happens after them instead of a normal end.

    Positions are clamped to the tokens generated so that an asked-for fault always happens
    (before the final events); with several set the earliest wins, on a tie the reset, then the
    stall.
    """
    faults = [
        (min(after, n), name)
        for after, name in (
            (cfg.reset_after, "reset"), (cfg.stall_after, "stall"), (cfg.end_after, "end"),
        )
        if after is not None
    ]
    return min(faults, key=lambda fault: fault[0]) if faults else (n, None)


async def _hang(request: web.Request) -> None:
    # With handler cancellation (run_mock, aiohttp's TestServer) the disconnect cancels us here;
    # polling the transport covers servers run without it, where nothing else would wake us.
    while (transport := request.transport) is not None and not transport.is_closing():  # noqa: ASYNC110
        await asyncio.sleep(_STALL_POLL_S)


@dataclass(frozen=True)
class _Script:
    """What a stream is made of: `preamble` sent at once, `head` with the first token, token
    i's event, then `tail`; `usage` is what it reports (recorded once it was all sent)."""

    token: Callable[[int], bytes]
    head: bytes
    tail: bytes
    preamble: bytes = b""
    usage: Mapping[str, Any] | None = None


async def _stream(call: _Call, n: int, script: _Script) -> web.StreamResponse:
    """Send `script` with `n` tokens (fewer when a fault is asked for).

    Token i is due at t_first + i / rate: following a schedule rather than sleeping per token
    means a late wake-up is caught up by writing everything due in one write, so the stream
    keeps the asked-for rate instead of drifting behind it.
    """
    cfg = call.cfg
    resp = web.StreamResponse(headers=call.headers("text/event-stream; charset=utf-8"))
    resp.headers["Cache-Control"] = "no-cache"
    loop = asyncio.get_running_loop()
    count, fault = _fault(cfg, n)
    garbage = min(cfg.garbage_after, count) if cfg.garbage_after is not None else -1
    try:
        await resp.prepare(call.request)
        write = _writer(resp, cfg)
        if script.preamble and not (fault == "end" and count == 0):
            await write(script.preamble)
        t_first = loop.time() + cfg.ttft_ms / 1000
        pending = await _send_tokens(write, cfg, script, (count, garbage), t_first)
        if fault is not None:
            await _break_off(call.request, resp, fault)
            return resp
        await asyncio.sleep(max(0.0, t_first - loop.time()))  # no tokens: still wait out ttft
        if garbage == count:
            pending.append(GARBAGE)
        await write(b"".join([*pending, script.tail]))
        await resp.write_eof()
    except ConnectionError:
        return resp  # The client went away: there is nobody left to tell.
    call.request.app[MOCK_STATE].record_usage(script.usage)
    return resp


async def _send_tokens(
    write: Callable[[bytes], Awaitable[None]], cfg: MockSettings, script: _Script,
    counts: tuple[int, int], t_first: float,
) -> list[bytes]:
    """Write the head and tokens 0 .. count - 1 on their schedule (GARBAGE before token
    `garbage`); what is still unwritten: the head when there were no tokens."""
    count, garbage = counts
    loop = asyncio.get_running_loop()
    interval = 1.0 / cfg.tokens_per_second if cfg.tokens_per_second > 0 else 0.0
    pending, i = [script.head], 0
    while i < count:
        now = loop.time()
        if now < (due := t_first + i * interval):
            await asyncio.sleep(due - now)
            continue
        if interval:
            upto = min(count, max(i + 1, int((now - t_first) / interval) + 1))
        else:
            upto = min(count, i + _BURST)
        pending.extend(script.token(k) for k in range(i, upto))
        if i <= garbage < upto:
            pending.insert(len(pending) - (upto - garbage), GARBAGE)
        await write(b"".join(pending))
        pending, i = [], upto
        if not interval:
            await asyncio.sleep(0)
    return pending


async def _break_off(request: web.Request, resp: web.StreamResponse, fault: str) -> None:
    """The asked-for fault instead of the stream's normal end."""
    if fault == "reset":
        if (transport := request.transport) is not None:
            transport.abort()
    elif fault == "stall":
        await _hang(request)
    elif fault == "end":
        await resp.write_eof()


def _data(obj: Any) -> bytes:
    return b"data: " + _dumps(obj) + b"\n\n"


def _word_events(render: Callable[[str], bytes]) -> Callable[[int], bytes]:
    # A stream has only len(WORDS) distinct token events: render each once, not once per token.
    rendered = [render(word) for word in WORDS]
    return lambda i: rendered[i % len(rendered)]


async def _completion(call: _Call, *, chat: bool) -> web.StreamResponse:
    """Chat completions and legacy completions: the same shapes, bar the choice objects."""
    limits = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    n, cut = _output_count(call, limits)
    finish, usage = ("length" if cut else "stop"), _completion_usage(call, n)
    cid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    kind = "chat.completion" if chat else "text_completion"
    base = {"id": cid, "object": kind, "created": int(time.time()), "model": call.model}
    base["system_fingerprint"] = _FINGERPRINT

    def choice(content: Any, finish_reason: str | None, key: str = "delta") -> dict[str, Any]:
        if not chat:
            return {"text": content, "index": 0, "logprobs": None, "finish_reason": finish_reason}
        return {"index": 0, key: content, "logprobs": None, "finish_reason": finish_reason}

    thought = min(call.cfg.reasoning_content_tokens, n) if chat else 0
    if not call.stream:
        message = {"role": "assistant", "content": generated_text(n - thought), "refusal": None}
        if thought:
            message["reasoning_content"] = generated_text(thought)
        content = {**message, "annotations": []} if chat else generated_text(n)
        obj = {**base, "choices": [choice(content, finish, "message")]}
        return await _json_response(call, obj if usage is None else {**obj, "usage": usage})
    options = call.body.get("stream_options")
    include = isinstance(options, dict) and options.get("include_usage") is True and bool(usage)
    chunk_base = {**base, "object": "chat.completion.chunk"} if chat else base
    usage_null = {"usage": None} if include else {}

    def chunk(*choices: dict[str, Any]) -> bytes:
        return _data({**chunk_base, "choices": list(choices), **usage_null})

    head = chunk(choice({"role": "assistant", "content": ""}, None)) if chat else b""
    tail = chunk(choice({} if chat else "", finish))
    if include:
        tail += _data({**chunk_base, "choices": [], "usage": usage})
    token = _word_events(lambda word: chunk(choice({"content": word} if chat else word, None)))
    if thought:
        token = _then(thought, _word_events(
            lambda word: chunk(choice({"reasoning_content": word}, None))), b"", token)
    if not call.cfg.omit_done:
        tail += b"data: [DONE]\n\n"
    reported = usage if include else None
    return await _stream(call, n, _Script(token, head, tail, usage=reported))


def _event(kind: str, seq: int, payload: dict[str, Any]) -> bytes:
    data = _dumps({"type": kind, "sequence_number": seq, **payload})
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


async def _responses(call: _Call) -> web.StreamResponse:
    n, cut = _output_count(call, ("max_output_tokens",))
    text, status = generated_text(n), ("incomplete" if cut else "completed")
    rid, msg_id, created = "resp_" + uuid.uuid4().hex, "msg_" + uuid.uuid4().hex, int(time.time())
    usage = None
    if call.cfg.usage:
        usage = {
            "input_tokens": call.prompt_tokens,
            "input_tokens_details": {"cached_tokens": call.cfg.cached_tokens},
            "output_tokens": n,
            "output_tokens_details": {"reasoning_tokens": call.cfg.reasoning_tokens},
            "total_tokens": call.prompt_tokens + n,
        }

    incomplete = {"reason": "max_output_tokens"}

    def response(state: str, output: list[Any], usage: Any) -> dict[str, Any]:
        return {
            "id": rid,
            "object": "response",
            "created_at": created,
            "status": state,
            "incomplete_details": incomplete if state == "incomplete" else None,
            "instructions": call.body.get("instructions"),
            "max_output_tokens": call.body.get("max_output_tokens"),
            "model": call.model,
            "output": output,
            "usage": usage,
            **json.loads(_RESPONSE_STATIC),
        }

    def part(content: str) -> dict[str, Any]:
        return {"type": "output_text", "annotations": [], "logprobs": [], "text": content}

    def item(state: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        return dict(id=msg_id, type="message", status=state, content=content, role="assistant")

    done_item = item(status, [part(text)])
    final = response(status, [done_item], usage)
    if not call.stream:
        return await _json_response(call, final)
    at = {"item_id": msg_id, "output_index": 0, "content_index": 0}
    preamble = _event("response.created", 0, {"response": response("in_progress", [], None)})
    preamble += _event("response.in_progress", 1, {"response": response("in_progress", [], None)})
    added = {"output_index": 0, "item": item("in_progress", [])}
    head = _event("response.output_item.added", 2, added)
    head += _event("response.content_part.added", 3, {**at, "part": part("")})
    # The sequence number changes per token: splice it between a pre-rendered prefix and suffix.
    prefix = _event("response.output_text.delta", 0, {}).removesuffix(b"0}\n\n")
    suffixes = [b"," + _dumps({**at, "delta": w, "logprobs": []})[1:] + b"\n\n" for w in WORDS]
    seq = 4 + n
    tail = _event("response.output_text.done", seq, {**at, "text": text, "logprobs": []})
    tail += _event("response.content_part.done", seq + 1, {**at, "part": part(text)})
    tail += _event("response.output_item.done", seq + 2, {"output_index": 0, "item": done_item})
    tail += _event(f"response.{status}", seq + 3, {"response": final})

    def token(i: int) -> bytes:
        return prefix + str(4 + i).encode() + suffixes[i % len(WORDS)]

    return await _stream(call, n, _Script(token, head, tail, preamble, usage))


def _anthropic_event(payload: dict[str, Any]) -> bytes:
    kind: str = payload["type"]
    return b"event: " + kind.encode() + b"\ndata: " + _dumps(payload) + b"\n\n"


def _anthropic_usage(call: _Call, output: int) -> dict[str, Any]:
    """As Anthropic reports it: message_delta's usage has all but `cache_creation`, the writes
    by cache lifetime, which the message (and message_start's) has."""
    cfg = call.cfg
    cached = cfg.cache_creation_tokens + cfg.cache_read_tokens
    return {
        "input_tokens": max(0, call.prompt_tokens - cached),
        "cache_creation_input_tokens": cfg.cache_creation_tokens,
        "cache_read_input_tokens": cfg.cache_read_tokens,
        "output_tokens": output,
    }


def _cache_creation(cfg: MockSettings) -> dict[str, int]:
    hour = cfg.cache_creation_1h_tokens
    return {"ephemeral_5m_input_tokens": cfg.cache_creation_tokens - hour,
            "ephemeral_1h_input_tokens": hour}


def _forced_tool(body: dict[str, Any]) -> str | None:
    """The tool a request makes the model call (`tool_choice` of type `tool` or `any`)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not (isinstance(tools, list) and tools and isinstance(choice, dict)):
        return None
    if choice.get("type") == "tool" and isinstance(choice.get("name"), str):
        return str(choice["name"])
    first = tools[0]
    if choice.get("type") == "any" and isinstance(first, dict):
        return str(first.get("name", "tool"))
    return None


_SIGNATURE = "bW9jay10aGlua2luZy1zaWduYXR1cmU="  # a thinking block's (opaque) signature


def _thinking_count(call: _Call) -> int:
    """Thinking tokens for a request that enables extended thinking (`thinking: {type:
    enabled, budget_tokens}`): the mock's `thinking_tokens`, at most the budget."""
    thinking = call.body.get("thinking")
    if not isinstance(thinking, dict) or thinking.get("type") != "enabled":
        return 0
    budget = thinking.get("budget_tokens")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise _ApiError(400, "thinking.budget_tokens: Field required", "thinking.budget_tokens")
    return min(call.cfg.thinking_tokens, budget)


def _then(first: int, before: Callable[[int], bytes], switch: bytes,
          after: Callable[[int], bytes]) -> Callable[[int], bytes]:
    """Token events: `first` of `before`'s, then `switch` and `after`'s from its token 0."""

    def token(i: int) -> bytes:
        if i < first:
            return before(i)
        return (switch + after(0)) if i == first else after(i - first)

    return token


async def _messages(call: _Call) -> web.StreamResponse:
    """Anthropic's Messages API: one text block of generated words, or, when `tool_choice`
    forces a tool, one tool_use block whose input is {"q": the generated words}; with extended
    thinking enabled, a thinking block of generated words first (its tokens are output tokens
    too, within max_tokens)."""
    if "max_tokens" not in call.body:
        raise _ApiError(400, "max_tokens: Field required", "max_tokens")
    n, cut = _output_count(call, ("max_tokens",))
    think = _thinking_count(call)
    if think:  # max_tokens bounds thinking and answer together
        limit = int(call.body["max_tokens"])
        think = min(think, limit)
        n = min(call.cfg.output_tokens, limit - think)
        cut = n < call.cfg.output_tokens
    tool = _forced_tool(call.body)
    stop_reason, usage = ("max_tokens" if cut else "end_turn"), _anthropic_usage(call, think + n)
    split = {"cache_creation": _cache_creation(call.cfg)}
    if tool is not None and not cut:
        stop_reason = "tool_use"
    message: dict[str, Any] = {
        "id": "msg_" + uuid.uuid4().hex[:24], "type": "message", "role": "assistant",
        "model": call.model, "content": [], "stop_reason": None, "stop_sequence": None,
    }
    tool_id = "toolu_" + uuid.uuid4().hex[:24]
    if not call.stream:
        content: list[dict[str, Any]] = [{"type": "text", "text": generated_text(n)}]
        if tool is not None:
            input_ = {"q": generated_text(n)}
            content = [{"type": "tool_use", "id": tool_id, "name": tool, "input": input_}]
        if think:
            content.insert(0, {"type": "thinking", "thinking": generated_text(think),
                               "signature": _SIGNATURE})
        final = {**message, "content": content, "stop_reason": stop_reason,
                 "usage": {**usage, **split}}
        return await _json_response(call, final)
    # As Anthropic does: message_start carries the input usage and an output count of 1, and
    # message_delta the cumulative final usage.
    preamble = _anthropic_event({"type": "message_start",
                                 "message": {**message,
                                             "usage": {**usage, **split, "output_tokens": 1}}})
    answer = 1 if think else 0  # the answer block's index: after the thinking block, if any

    def delta(payload: dict[str, Any], index: int = answer) -> bytes:
        return _anthropic_event({"type": "content_block_delta", "index": index,
                                 "delta": payload})

    def block(index: int, content_block: dict[str, Any]) -> bytes:
        return _anthropic_event({"type": "content_block_start", "index": index,
                                 "content_block": content_block})

    opening, extra, tail = block(answer, {"type": "text", "text": ""}), b"", b""
    if tool is None:
        word = _word_events(lambda w: delta({"type": "text_delta", "text": w}))
    else:
        # The input's JSON in pieces: its opening, a piece per word, its close.
        opening = block(answer, {"type": "tool_use", "id": tool_id, "name": tool, "input": {}})
        extra = delta({"type": "input_json_delta", "partial_json": '{"q": "'})
        word = _word_events(lambda w: delta({"type": "input_json_delta", "partial_json": w}))
        tail = delta({"type": "input_json_delta", "partial_json": '"}'})
    ping = _anthropic_event({"type": "ping"})
    token, head = word, opening + ping + extra
    if think:
        close = (delta({"type": "signature_delta", "signature": _SIGNATURE}, 0)
                 + _anthropic_event({"type": "content_block_stop", "index": 0}))
        thought = _word_events(lambda w: delta({"type": "thinking_delta", "thinking": w}, 0))
        token = _then(think, thought, close + opening + extra, word)
        head = block(0, {"type": "thinking", "thinking": "", "signature": ""}) + ping
        if not n:  # all thinking, no answer: only the thinking block, closed
            tail = close
    if n or not think:
        tail += _anthropic_event({"type": "content_block_stop", "index": answer})
    tail += _anthropic_event({"type": "message_delta",
                              "delta": {"stop_reason": stop_reason, "stop_sequence": None},
                              "usage": usage})
    tail += _anthropic_event({"type": "message_stop"})
    return await _stream(call, think + n, _Script(token, head, tail, preamble, usage))


async def _count_tokens(call: _Call) -> web.StreamResponse:
    obj = {"input_tokens": call.prompt_tokens}
    return web.Response(body=_dumps(obj), headers=call.headers("application/json"))


async def _embeddings(call: _Call) -> web.StreamResponse:
    raw = call.body["input"]
    # A list of ints is one tokenised input; any other list is a batch of inputs.
    inputs: list[Any] = raw if isinstance(raw, list) and not isinstance(raw[0], int) else [raw]
    dims, fmt = call.body.get("dimensions") or 8, call.body.get("encoding_format") or "float"
    if isinstance(dims, bool) or not isinstance(dims, int) or not 1 <= dims <= 4096:
        raise _ApiError(400, "Invalid value for 'dimensions'.", "dimensions")
    if fmt not in ("float", "base64"):
        raise _ApiError(400, "Invalid value for 'encoding_format'.", "encoding_format")
    data = []
    for index, value in enumerate(inputs):
        # Deterministic per input, and multiples of 1/256 so float32 (base64) loses nothing.
        seed = value.encode() if isinstance(value, str) else _dumps(value)
        vector = [b / 256 for b in hashlib.shake_256(seed).digest(dims)]
        packed = base64.b64encode(struct.pack(f"<{dims}f", *vector)).decode()
        embedding = packed if fmt == "base64" else vector
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    obj: dict[str, Any] = {"object": "list", "data": data, "model": call.model}
    if call.cfg.usage:
        obj["usage"] = {"prompt_tokens": call.prompt_tokens, "total_tokens": call.prompt_tokens}
    return await _json_response(call, obj)


def _model_object(model: str) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": 1_700_000_000, "owned_by": "tokenmeter-mock"}


async def _models(call: _Call) -> web.StreamResponse:
    listing = {"object": "list", "data": [_model_object(call.cfg.model)]}
    return web.Response(body=_dumps(listing), headers=call.headers("application/json"))


async def _stats(call: _Call) -> web.StreamResponse:
    return web.json_response(call.request.app[MOCK_STATE].reported)


async def _not_found(call: _Call) -> web.StreamResponse:
    raise _ApiError(404, f"Invalid URL ({call.request.method} {call.request.path})")


def create_mock_app(settings: MockSettings | None = None) -> web.Application:
    # Benchmarks send long prompts, beyond aiohttp's default 1 MiB body limit.
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[SETTINGS] = settings if settings is not None else MockSettings()
    app[MOCK_STATE] = MockState()
    add = app.router.add_route
    add("GET", "/v1/models", _endpoint(_models, needs_body=False))
    add("POST", "/v1/chat/completions", _endpoint(functools.partial(_completion, chat=True)))
    add("POST", "/v1/completions", _endpoint(functools.partial(_completion, chat=False)))
    add("POST", "/v1/responses", _endpoint(_responses))
    add("POST", "/v1/embeddings", _endpoint(_embeddings))
    add("POST", "/v1/messages", _endpoint(_messages, anthropic=True))
    add("POST", "/v1/messages/count_tokens", _endpoint(_count_tokens, anthropic=True))
    add("GET", "/_mock/stats", _endpoint(_stats, needs_body=False, inject=False))
    add("*", "/{tail:.*}", _endpoint(_not_found, needs_body=False, inject=False))
    return app


def run_mock(settings: MockSettings, host: str, port: int) -> None:
    line = f"mock upstream listening on http://{host}:{port}/v1"

    def announce(*_: Any) -> None:
        print(line, flush=True)

    # handler_cancellation: a client disconnect must end the handler (and set `closed`) at once,
    # as with the real upstream, rather than the mock generating on for nobody.
    web.run_app(
        create_mock_app(settings),
        host=host,
        port=port,
        print=announce,
        access_log=None,
        handler_cancellation=True,
    )
