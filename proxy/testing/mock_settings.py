"""What the mock upstream does: its settings, the `x-mock-*` headers that override them per
request, and what it remembers of the requests it served (tests and the soak benchmark read it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass(frozen=True)
class MockSettings:
    """What the mock does; each field can be overridden per request by an `x-mock-*` header.

    tokens_per_second <= 0 streams as fast as possible. ttft_ms is the wait before the first token
    (before the whole response when not streaming), delay_ms the wait before the headers.
    reasoning_tokens is reported as a detail of, not added to, the completion tokens. A status
    other than 200 answers with an OpenAI error body (error_code, else a default for the status;
    error_type replaces the status's type: a 500 of type invalid_request_error is a validation
    error as some servers send it). The code context_length_exceeded gets OpenAI's message, at
    any status.
    stall_after / reset_after N: after N content tokens, hang until the client leaves / abort the
    TCP connection; end_after N: after N tokens, end the stream cleanly but without its final
    events (no finish, usage or `[DONE]`; N=0: a 200 event-stream with no event at all, which is
    llama-cpp-python's answer to a streamed prompt longer than its context); omit_done: a whole
    chat/completions stream, bar its `data: [DONE]`. garbage_after N: after N tokens, send bytes
    that are not SSE, then go on.
    retry_after_ms adds `retry-after-ms` (and a rounded-up `retry-after`) to injected errors.
    fail_first N: the faults above (status, stall, reset, garbage) hit only the first N requests
    of a scenario (the `x-mock-scenario` header), later ones are served normally: a retry test.
    chunk_seed: cut every write at random (seeded) byte offsets, to exercise chunk boundaries.
    """

    tokens_per_second: float = 750.0
    ttft_ms: float = 20.0
    output_tokens: int = 64
    usage: bool = True
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    status: int = 200
    error_code: str | None = None
    error_type: str | None = None
    delay_ms: float = 0.0
    stall_after: int | None = None
    reset_after: int | None = None
    model: str = "mock-gpt"
    garbage_after: int | None = None
    retry_after_ms: float | None = None
    fail_first: int | None = None
    chunk_seed: int | None = None
    end_after: int | None = None
    omit_done: bool = False
    # Anthropic Messages only: prompt tokens reported as written to / read from the prompt cache
    # (taken out of input_tokens, as Anthropic's input_tokens counts only the uncached rest).
    cache_creation_tokens: int = 0
    cache_read_tokens: int = 0
    # Of the cache writes, those reported as 1-hour ones (usage.cache_creation's
    # ephemeral_1h_input_tokens; the rest are ephemeral_5m_input_tokens).
    cache_creation_1h_tokens: int = 0
    # Anthropic Messages only: tokens of the thinking block answered to a request that enables
    # extended thinking (`thinking: {type: enabled, budget_tokens: N}`), at most N; streamed
    # as thinking_delta events before the answer, counted in output_tokens, within max_tokens.
    thinking_tokens: int = 16
    # Chat Completions only: of the output tokens, how many come first as the message's
    # `reasoning_content` (a reasoning model as DeepSeek, vLLM and llama.cpp serve one: streamed
    # as `reasoning_content` deltas before the content's), counted in completion_tokens.
    reasoning_content_tokens: int = 0

    def __post_init__(self) -> None:
        # Checked here so that header overrides, applied with dataclasses.replace, obey the same
        # rules as settings built in code.
        if not all(map(math.isfinite, (self.tokens_per_second, self.ttft_ms, self.delay_ms))):
            raise ValueError("tokens_per_second, ttft_ms and delay_ms must be finite")
        times = (self.ttft_ms, self.delay_ms)
        counts = (self.output_tokens, self.cached_tokens, self.reasoning_tokens,
                  self.cache_creation_tokens, self.cache_read_tokens,
                  self.cache_creation_1h_tokens, self.thinking_tokens)
        faults = (self.stall_after, self.reset_after, self.garbage_after, self.fail_first,
                  self.retry_after_ms, self.end_after)
        if min(*times, *counts, *(f or 0 for f in faults)) < 0:
            raise ValueError("times, token counts and fault positions must not be negative")
        if self.cache_creation_1h_tokens > self.cache_creation_tokens:
            raise ValueError("cache_creation_1h_tokens are part of cache_creation_tokens")
        if self.status != 200 and not 400 <= self.status <= 599:
            raise ValueError("status must be 200 or an error status (400-599)")


@dataclass(frozen=True)
class ReceivedRequest:
    """A request as the mock received it; `closed` is set once its handler is done, however."""

    path: str
    headers: dict[str, str]
    body: dict[str, Any] | None
    closed: asyncio.Event = field(default_factory=asyncio.Event, compare=False, repr=False)


class MockState:
    def __init__(self) -> None:
        self.requests: list[ReceivedRequest] = []
        self.active = 0
        self.attempts: dict[str, int] = {}  # per x-mock-scenario, for fail_first
        # Usage the mock reported in responses it finished sending (soak checks use it).
        self.reported = {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0}

    def record_usage(self, usage: Mapping[str, Any] | None) -> None:
        if usage is None:
            return
        self.reported["requests"] += 1
        prompt = usage.get("prompt_tokens", usage.get("input_tokens", 0))
        # Anthropic's input_tokens leaves out the prompt's cache reads and writes: the whole
        # prompt, as the proxy meters it, has them back.
        prompt += usage.get("cache_creation_input_tokens", 0)
        prompt += usage.get("cache_read_input_tokens", 0)
        self.reported["prompt_tokens"] += int(prompt)
        self.reported["completion_tokens"] += int(
            usage.get("completion_tokens", usage.get("output_tokens", 0))
        )


MOCK_STATE = web.AppKey("tokenmeter_mock_state", MockState)
SETTINGS = web.AppKey("tokenmeter_mock_settings", MockSettings)


def _optional_int(value: str) -> int | None:
    # "none" lets one request switch off a fault that the server was started with.
    return None if value.lower() in ("", "none", "off") else int(value)


def _switch(value: str) -> bool:
    if value.lower() not in ("on", "off", "true", "false", "1", "0"):
        raise ValueError(value)
    return value.lower() in ("on", "true", "1")


_OVERRIDES: tuple[tuple[str, str, Callable[[str], object]], ...] = (
    ("x-mock-tokens-per-second", "tokens_per_second", float),
    ("x-mock-ttft-ms", "ttft_ms", float),
    ("x-mock-output-tokens", "output_tokens", int),
    ("x-mock-usage", "usage", _switch),
    ("x-mock-cached-tokens", "cached_tokens", int),
    ("x-mock-reasoning-tokens", "reasoning_tokens", int),
    ("x-mock-status", "status", int),
    ("x-mock-error-code", "error_code", lambda value: value or None),
    ("x-mock-delay-ms", "delay_ms", float),
    ("x-mock-stall-after", "stall_after", _optional_int),
    ("x-mock-reset-after", "reset_after", _optional_int),
    ("x-mock-garbage-after", "garbage_after", _optional_int),
    ("x-mock-retry-after-ms", "retry_after_ms", lambda value: float(value) if value else None),
    ("x-mock-fail-first", "fail_first", _optional_int),
    ("x-mock-chunk-seed", "chunk_seed", _optional_int),
    ("x-mock-error-type", "error_type", lambda value: value or None),
    ("x-mock-end-after", "end_after", _optional_int),
    ("x-mock-omit-done", "omit_done", _switch),
    ("x-mock-cache-creation-tokens", "cache_creation_tokens", int),
    ("x-mock-cache-read-tokens", "cache_read_tokens", int),
    ("x-mock-cache-creation-1h-tokens", "cache_creation_1h_tokens", int),
    ("x-mock-thinking-tokens", "thinking_tokens", int),
    ("x-mock-reasoning-content-tokens", "reasoning_content_tokens", int),
)

# fail_first counts the requests of each value of this header (a test's own scenario).
SCENARIO_HEADER = "x-mock-scenario"


def override_headers() -> list[tuple[str, str]]:
    """(header, the MockSettings field it overrides): the headers `effective` reads."""
    return [(header, name) for header, name, _ in _OVERRIDES]


def headers_help() -> str:
    """The per-request headers, for `mock-upstream --help`: made from `_OVERRIDES`, so the
    list is the headers `effective` reads."""
    overrides = override_headers()
    width = max(len(header) for header, _ in overrides) + 2
    lines = ["per-request headers: each overrides the setting named beside it (MockSettings)",
             "for that request only; an *-after count takes 'none' to switch off a fault the",
             "server was started with:"]
    lines += [f"  {header:<{width}}{name}" for header, name in overrides]
    lines.append(f"  {SCENARIO_HEADER:<{width}}the scenario whose requests fail_first counts")
    return "\n".join(lines)


GARBAGE = b"\x00\xff\xfenot an event {{{\r\n: \xc3\x28 half-utf8\n\n"
HEALTHY: dict[str, Any] = {
    "status": 200, "error_code": None, "error_type": None, "stall_after": None,
    "reset_after": None, "garbage_after": None, "end_after": None, "omit_done": False,
}


def effective(base: MockSettings, headers: Mapping[str, str]) -> MockSettings:
    changes: dict[str, Any] = {}
    for header, name, parse in _OVERRIDES:
        if (raw := headers.get(header)) is not None:
            try:
                changes[name] = parse(raw.strip())
            except ValueError:
                raise ValueError(f"Invalid value for header {header}: {raw!r}.") from None
    try:
        return dataclasses.replace(base, **changes) if changes else base
    except ValueError as exc:
        raise ValueError(f"Invalid x-mock-* header: {exc}.") from None
