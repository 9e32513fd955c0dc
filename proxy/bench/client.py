"""One chat-completions request (or, with `Api.ANTHROPIC`, one Anthropic Messages request)
over a long-lived aiohttp session, timed chunk by chunk. A replayed request is sent in its own
API (`Prompt.api`), whatever the run's.

The hot loop per network read is: one perf_counter, the sans-I/O SSE decoder, and per event one
`json.loads` (a few microseconds for a chunk of this size). Timestamps use `time.perf_counter`,
not `loop.time()`: uvloop's loop clock has millisecond resolution and is cached per iteration.
Every failure (HTTP error, refused connection, reset mid-stream, timeout, an error event in the
stream) becomes a `RequestResult` with a class; nothing here raises on the endpoint's behalf.
"""

from __future__ import annotations

import enum
import itertools
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from proxy.bench.stats import RequestResult
from proxy.bench.workload import Api, Prompt
from proxy.errors import ErrorClass
from proxy.protocol.sse import SSEDecoder
from proxy.protocol.tokenizer import count_text
from proxy.protocol.upstream_errors import classify, error_message

# Api lives beside Prompt (a replayed prompt carries its own) and is importable from here too.
__all__ = ["ANSWER_CHARS", "ANTHROPIC_VERSION", "ERROR_CLASSES", "Api", "BenchError", "Endpoint",
           "Level", "RequestSpec", "classify_status", "send"]


class BenchError(enum.StrEnum):
    """What went wrong with one request, as the client saw it. These names are the bench's
    output (JSON, CSV, report) and predate the proxy's `ErrorClass`; an HTTP error's class
    comes from the proxy's own classifier (`proxy.protocol.upstream_errors.classify`) through
    `_FROM_ANSWER`, so both read an answer the same way."""

    RATE_LIMIT = "rate_limit"  # 429
    AUTH = "auth"  # 401, 403
    CONTEXT_LENGTH = "context_length"  # the error names the context length (any status)
    BAD_REQUEST = "bad_request"  # any other 4xx, or a 5xx whose body blames the request
    SERVER_ERROR = "server_error"  # 5xx, 408, or a non-200 success
    TIMEOUT = "timeout"  # no complete answer within --timeout
    CONNECTION = "connection"  # could not connect, or the server closed before answering
    STREAM_RESET = "stream_reset"  # the connection broke after the response started
    STREAM_ERROR = "stream_error"  # an error event inside a 200 stream
    INCOMPLETE = "incomplete"  # the stream ended without a finish, or the body was not JSON


ERROR_CLASSES = tuple(BenchError)


ANTHROPIC_VERSION = "2023-06-01"

# `bench --replay` keeps each answer's text for the comparison, up to this many characters.
ANSWER_CHARS = 16_384

_FROM_ANSWER: Mapping[ErrorClass, BenchError] = {
    ErrorClass.RATE_LIMIT: BenchError.RATE_LIMIT,
    ErrorClass.AUTH: BenchError.AUTH,
    ErrorClass.CONTEXT_LENGTH: BenchError.CONTEXT_LENGTH,
    ErrorClass.BAD_REQUEST: BenchError.BAD_REQUEST,
}


@dataclass(frozen=True)
class Endpoint:
    """Where to send: `base_url` ends in /v1 (or whatever precedes /chat/completions)."""

    base_url: str
    label: str
    api_key: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    # A replay of both APIs sends each its own key: an API named here gets this key (None:
    # none at all, never the other API's), any other `api_key`.
    api_keys: Mapping[Api, str | None] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.url_for(Api.OPENAI)

    def url_for(self, api: Api) -> str:
        path = "/messages" if api is Api.ANTHROPIC else "/chat/completions"
        return self.base_url.rstrip("/") + path

    def request_headers(self, api: Api = Api.OPENAI) -> dict[str, str]:
        out = {"Content-Type": "application/json", **self.headers}
        key = self.api_keys.get(api, self.api_key)
        if api is Api.ANTHROPIC:
            if not any(k.lower() == "anthropic-version" for k in out):
                out["anthropic-version"] = ANTHROPIC_VERSION
            if key:
                out["x-api-key"] = key
        elif key:
            out["Authorization"] = f"Bearer {key}"
        return out


@dataclass(frozen=True)
class RequestSpec:
    model: str
    stream: bool = True
    max_tokens: int | None = 256
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    timeout_s: float = 600.0
    tokenizer_model: str | None = None  # whose encoding counts the output (default: model)
    api: Api = Api.OPENAI

    def api_for(self, prompt: Prompt) -> Api:
        """A replayed request's own API (its recorded route's), else the run's."""
        return prompt.api or self.api

    def stream_for(self, prompt: Prompt) -> bool:
        """A replayed request streams as it was recorded; the others as --stream says."""
        return self.stream if prompt.stream is None else prompt.stream

    def _replay_body(self, prompt: Prompt) -> bytes:
        """The recorded body, its model replaced by --model when one was given; a stream asks
        for its usage (OpenAI sends none otherwise, and tokens and cost need it)."""
        body = dict(prompt.body or {})
        if self.model:
            body["model"] = self.model
        if (body.get("stream") is True and self.api_for(prompt) is Api.OPENAI
                and "stream_options" not in body):
            body["stream_options"] = {"include_usage": True}
        body.update(self.extra_body)
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()

    def body(self, prompt: Prompt) -> bytes:
        if prompt.body is not None:
            return self._replay_body(prompt)
        body: dict[str, Any] = {"model": self.model, "messages": list(prompt.messages)}
        limit = prompt.max_tokens or self.max_tokens
        if limit is not None:
            body["max_tokens"] = limit
        elif self.api is Api.ANTHROPIC:
            raise ValueError("the Anthropic Messages API requires max_tokens")
        if self.stream:
            body["stream"] = True
            if self.api is Api.OPENAI:  # Anthropic's stream always carries its usage
                body["stream_options"] = {"include_usage": True}
        body.update(self.extra_body)
        return json.dumps(body, separators=(",", ":")).encode()


def classify_status(status: int, body: bytes) -> tuple[BenchError, str]:
    """The class of an HTTP error (a non-200 answer) and a short message from its body."""
    cls = _FROM_ANSWER.get(classify(status, body), BenchError.SERVER_ERROR)
    return cls, error_message(body)


def _content(obj: Any) -> tuple[str, Any]:
    """The text of a chat chunk (content, or a reasoning model's reasoning text) and its usage."""
    if not isinstance(obj, dict):
        return "", None
    text = ""
    choices = obj.get("choices")
    if choices and isinstance(choices[0], dict):
        delta = choices[0].get("delta") or choices[0].get("message") or {}
        if isinstance(delta, dict):
            for key in ("content", "reasoning_content", "reasoning"):
                if isinstance(v := delta.get(key), str) and v:
                    text += v
        elif isinstance(choices[0].get("text"), str):  # a legacy-completions shaped chunk
            text = choices[0]["text"]
    return text, obj.get("usage")


def _anthropic_content(obj: Any) -> tuple[str, Any]:
    """The text of an Anthropic stream event (a content delta: text, thinking or a tool's
    input JSON) or non-streamed message, and the usage it carries (message_start's, a
    message_delta's cumulative one, the message's)."""
    if not isinstance(obj, dict):
        return "", None
    kind = obj.get("type")
    if kind == "content_block_delta":
        delta = obj.get("delta")
        if isinstance(delta, dict):
            for key in ("text", "thinking", "partial_json"):
                if isinstance(v := delta.get(key), str) and v:
                    return v, None
        return "", None
    if kind == "message_start":
        message = obj.get("message")
        return "", message.get("usage") if isinstance(message, dict) else None
    if kind == "message_delta":
        return "", obj.get("usage")
    if kind == "message":
        blocks = obj.get("content")
        text = "".join(
            v for b in (blocks if isinstance(blocks, list) else ()) if isinstance(b, dict)
            for v in (b.get("text"), b.get("thinking")) if isinstance(v, str))
        return text, obj.get("usage")
    return "", None


def _usage_counts(usage: Any) -> tuple[int | None, int | None]:
    if not isinstance(usage, dict):
        return None, None
    if "prompt_tokens" not in usage and "input_tokens" in usage:
        # Anthropic's: input_tokens is only the prompt's uncached part.
        out = usage.get("output_tokens")
        parts = [usage.get(k) for k in ("input_tokens", "cache_creation_input_tokens",
                                        "cache_read_input_tokens")]
        whole = sum(v for v in parts if isinstance(v, int))
        return (out if isinstance(out, int) else None), whole
    out, prompt = usage.get("completion_tokens"), usage.get("prompt_tokens")
    return (out if isinstance(out, int) else None), (prompt if isinstance(prompt, int) else None)


@dataclass(frozen=True, slots=True)
class Level:
    """The load level a request is sent at: its load and prompt size, and the level's start
    (perf_counter), which the request's start is measured from."""

    load: float
    prompt_tokens: int
    t_origin: float


@dataclass(slots=True)
class _Reading:
    """What a response yielded so far. Filled while reading (not returned at the end), so a
    connection that breaks mid-stream still leaves the text that arrived before it."""

    t_end: float
    chunks: list[str] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # perf_counter of each chunk's arrival
    usage: Any = None
    finished: bool = False
    error_class: BenchError | None = None
    error: str | None = None

    def fail(self, error_class: BenchError, error: str) -> None:
        self.error_class, self.error = error_class, error


async def send(
    session: aiohttp.ClientSession, endpoint: Endpoint, spec: RequestSpec, prompt: Prompt,
    level: Level,
) -> RequestResult:
    """Send one request and time it."""
    body = spec.body(prompt)
    api = spec.api_for(prompt)
    headers = endpoint.request_headers(api)
    stream = spec.stream_for(prompt)
    base: dict[str, Any] = dict(endpoint=endpoint.label, load=level.load,
                                prompt_tokens=level.prompt_tokens, stream=stream,
                                line=prompt.line)
    t0 = time.perf_counter()
    base["start"] = t0 - level.t_origin
    status: int | None = None
    timeout = aiohttp.ClientTimeout(total=spec.timeout_s)
    got = _Reading(t_end=t0)
    try:
        async with session.post(endpoint.url_for(api), data=body, headers=headers,
                                timeout=timeout) as resp:
            status = resp.status
            if status != 200:
                got.fail(*classify_status(status, await resp.read()))
            elif not stream:
                await _read_body(resp, api, got)
            else:
                await _read_stream(resp, api, got)
    except TimeoutError:
        got.fail(BenchError.TIMEOUT, f"no complete answer within {spec.timeout_s:g} s")
    except aiohttp.ClientConnectorError as exc:
        got.fail(BenchError.CONNECTION, str(exc))
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError,
            aiohttp.ClientOSError) as exc:
        got.fail(BenchError.STREAM_RESET if status == 200 else BenchError.CONNECTION,
                 f"{type(exc).__name__}: {exc}")
    except aiohttp.ClientError as exc:
        got.fail(BenchError.CONNECTION, f"{type(exc).__name__}: {exc}")
    text = "".join(got.chunks)
    local = count_text(spec.tokenizer_model or spec.model, text)
    out_usage, prompt_usage = _usage_counts(got.usage)
    if prompt.line:  # a replay keeps the answers to compare them, each bounded
        base["answer"] = text[:ANSWER_CHARS]
    if got.error_class is not None:
        return RequestResult(ok=False, status=status, error_class=got.error_class,
                             error=got.error, local_output_tokens=local, **base)
    times = got.times
    ttft = (times[0] - t0) if times else (got.t_end - t0)
    itl = tuple(b - a for a, b in itertools.pairwise(times))
    return RequestResult(
        ok=True, status=status, ttft=ttft, e2e=got.t_end - t0, itl=itl,
        usage_output_tokens=out_usage, usage_prompt_tokens=prompt_usage,
        local_output_tokens=local, **base,
    )


async def _read_body(resp: aiohttp.ClientResponse, api: Api, got: _Reading) -> None:
    """A non-streamed answer."""
    content = _anthropic_content if api is Api.ANTHROPIC else _content
    raw = await resp.read()
    got.t_end = time.perf_counter()
    try:
        text, got.usage = content(json.loads(raw))
    except ValueError:
        text = ""
        got.fail(BenchError.INCOMPLETE, "response body is not JSON")
    if text:
        got.chunks.append(text)
        got.times.append(got.t_end)
    got.finished = got.error_class is None


async def _read_stream(resp: aiohttp.ClientResponse, api: Api, got: _Reading) -> None:
    """A stream, timed per network read: the hot loop (see the module's docstring)."""
    anthropic = api is Api.ANTHROPIC
    content = _anthropic_content if anthropic else _content
    chunks, times = got.chunks, got.times
    decoder = SSEDecoder()
    loads, now = json.loads, time.perf_counter
    async for data in resp.content.iter_any():
        t = now()
        for event in decoder.feed(data):
            payload = event.data
            if payload == b"[DONE]":
                got.finished = True
                continue
            try:
                obj = loads(payload)
            except ValueError:
                continue  # not JSON: keep-alive noise, not ours to judge
            if isinstance(obj, dict) and obj.get("error"):
                err = obj["error"]
                got.fail(BenchError.STREAM_ERROR,
                         str(err.get("message") if isinstance(err, dict) else err))
                continue
            text, u = content(obj)
            if text:
                chunks.append(text)
                times.append(t)
            if u:
                # Anthropic's usage comes in parts (message_start's input, the cumulative
                # message_delta): the latest value of each field wins.
                got.usage = {**got.usage, **u} if anthropic and got.usage else u
            if anthropic and isinstance(obj, dict):
                got.finished = got.finished or obj.get("type") == "message_stop"
    got.t_end = time.perf_counter()
    if not got.finished and got.error_class is None:
        end = "event: message_stop" if anthropic else "data: [DONE]"
        got.fail(BenchError.INCOMPLETE, f"stream ended without {end}")
