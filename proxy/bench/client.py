"""One chat-completions request over a long-lived aiohttp session, timed chunk by chunk.

The hot loop per network read is: one perf_counter, the sans-I/O SSE decoder, and per event one
`json.loads` (a few microseconds for a chunk of this size). Timestamps use `time.perf_counter`,
not `loop.time()`: uvloop's loop clock has millisecond resolution and is cached per iteration.
Every failure (HTTP error, refused connection, reset mid-stream, timeout, an error event in the
stream) becomes a `RequestResult` with a class; nothing here raises on the endpoint's behalf.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from proxy.bench.stats import RequestResult
from proxy.bench.workload import Prompt
from proxy.sse import SSEDecoder
from proxy.tokenizer import count_text

ERROR_CLASSES = (
    "rate_limit",  # 429
    "auth",  # 401, 403
    "context_length",  # 400 with code context_length_exceeded
    "bad_request",  # any other 4xx
    "server_error",  # 5xx
    "timeout",  # no complete answer within --timeout
    "connection",  # could not connect, or the server closed before answering
    "stream_reset",  # the connection broke after the response started
    "stream_error",  # an error event inside a 200 stream
    "incomplete",  # the stream ended without a finish, or the body was not what was expected
)


@dataclass(frozen=True)
class Endpoint:
    """Where to send: `base_url` ends in /v1 (or whatever precedes /chat/completions)."""

    base_url: str
    label: str
    api_key: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + "/chat/completions"

    def request_headers(self) -> dict[str, str]:
        out = {"Content-Type": "application/json", **self.headers}
        if self.api_key:
            out["Authorization"] = f"Bearer {self.api_key}"
        return out


@dataclass(frozen=True)
class RequestSpec:
    model: str
    stream: bool = True
    max_tokens: int | None = 256
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    timeout_s: float = 600.0
    tokenizer_model: str | None = None  # whose encoding counts the output (default: model)

    def body(self, prompt: Prompt) -> bytes:
        body: dict[str, Any] = {"model": self.model, "messages": list(prompt.messages)}
        limit = prompt.max_tokens or self.max_tokens
        if limit is not None:
            body["max_tokens"] = limit
        if self.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        body.update(self.extra_body)
        return json.dumps(body, separators=(",", ":")).encode()


def classify_status(status: int, body: bytes) -> tuple[str, str]:
    """The class of an HTTP error and a short message from its OpenAI-shaped body."""
    message, code = body[:200].decode("utf-8", "replace"), None
    try:
        err = json.loads(body).get("error")
        if isinstance(err, dict):
            message, code = str(err.get("message") or message), err.get("code")
        elif isinstance(err, str):
            message = err
    except (ValueError, AttributeError):
        pass
    if status == 429:
        cls = "rate_limit"
    elif status in (401, 403):
        cls = "auth"
    elif code == "context_length_exceeded":
        cls = "context_length"
    elif 400 <= status < 500:
        cls = "bad_request"
    else:
        cls = "server_error"
    return cls, message[:200]


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


def _usage_counts(usage: Any) -> tuple[int | None, int | None]:
    if not isinstance(usage, dict):
        return None, None
    out, prompt = usage.get("completion_tokens"), usage.get("prompt_tokens")
    return (out if isinstance(out, int) else None), (prompt if isinstance(prompt, int) else None)


async def send(
    session: aiohttp.ClientSession,
    endpoint: Endpoint,
    spec: RequestSpec,
    prompt: Prompt,
    *,
    load: float,
    prompt_tokens: int,
    t_origin: float,
) -> RequestResult:
    """Send one request and time it. `t_origin` (perf_counter) is the level's start."""
    body = spec.body(prompt)
    headers = endpoint.request_headers()
    base: dict[str, Any] = dict(endpoint=endpoint.label, load=load, prompt_tokens=prompt_tokens,
                                stream=spec.stream)
    t0 = time.perf_counter()
    base["start"] = t0 - t_origin
    status: int | None = None
    chunks: list[str] = []
    times: list[float] = []
    usage: Any = None
    timeout = aiohttp.ClientTimeout(total=spec.timeout_s)
    error_class = error = None
    finished = False
    t_end = t0
    try:
        async with session.post(endpoint.url, data=body, headers=headers, timeout=timeout) as resp:
            status = resp.status
            if status != 200:
                raw = await resp.read()
                error_class, error = classify_status(status, raw)
            elif not spec.stream:
                raw = await resp.read()
                t_end = time.perf_counter()
                try:
                    text, usage = _content(json.loads(raw))
                except ValueError:
                    text, usage = "", None
                    error_class, error = "incomplete", "response body is not JSON"
                if text:
                    chunks.append(text)
                    times.append(t_end)
                finished = error_class is None
            else:
                decoder = SSEDecoder()
                loads, now = json.loads, time.perf_counter
                async for data in resp.content.iter_any():
                    t = now()
                    for event in decoder.feed(data):
                        payload = event.data
                        if payload == b"[DONE]":
                            finished = True
                            continue
                        try:
                            obj = loads(payload)
                        except ValueError:
                            continue  # not JSON: keep-alive noise, not ours to judge
                        if isinstance(obj, dict) and obj.get("error"):
                            error_class = "stream_error"
                            err = obj["error"]
                            error = str(err.get("message") if isinstance(err, dict) else err)
                            continue
                        text, u = _content(obj)
                        if text:
                            chunks.append(text)
                            times.append(t)
                        if u:
                            usage = u
                t_end = time.perf_counter()
                if not finished and error_class is None:
                    error_class, error = "incomplete", "stream ended without data: [DONE]"
    except TimeoutError:
        error_class, error = "timeout", f"no complete answer within {spec.timeout_s:g} s"
    except aiohttp.ClientConnectorError as exc:
        error_class, error = "connection", str(exc)
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError,
            aiohttp.ClientOSError) as exc:
        error_class = "stream_reset" if status == 200 else "connection"
        error = f"{type(exc).__name__}: {exc}"
    except aiohttp.ClientError as exc:
        error_class, error = "connection", f"{type(exc).__name__}: {exc}"
    text = "".join(chunks)
    local = count_text(spec.tokenizer_model or spec.model, text)
    out_usage, prompt_usage = _usage_counts(usage)
    if error_class is not None:
        return RequestResult(ok=False, status=status, error_class=error_class, error=error,
                             local_output_tokens=local, **base)
    ttft = (times[0] - t0) if times else (t_end - t0)
    itl = tuple(b - a for a, b in itertools.pairwise(times))
    return RequestResult(
        ok=True, status=status, ttft=ttft, e2e=t_end - t0, itl=itl,
        usage_output_tokens=out_usage, usage_prompt_tokens=prompt_usage,
        local_output_tokens=local, **base,
    )
