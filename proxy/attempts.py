"""Which upstream call to make, and again: retries with backoff, fallbacks, slow-model switching.

Everything here happens before the client has been sent a byte, which is what makes it safe: a
request is retried (same upstream) on connect errors and on the statuses its upstream's `retry`
lists, and handed to the route's fallbacks (other models, routed by their own entries) when the
retries are spent. Once a stream has started nothing is retried; the relay reports the failure
in the stream instead. A 5xx whose body blames the request (some servers answer a validation
error with a 500) is neither retried nor handed on: it would fail the same way every time.
"""

from __future__ import annotations

import asyncio
import collections
import email.utils
import json
import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import aiohttp
from multidict import CIMultiDict

from proxy.config import LatencyFallback, RetryConfig
from proxy.errors import ProxyError, UpstreamTimeout, UpstreamUnavailable
from proxy.upstream import Route, Router, Upstream


@dataclass(frozen=True, slots=True)
class Candidate:
    model: str
    route: Route
    reason: str  # "primary", or why the previous candidate was left: an error class, "slow"


def retry_after_s(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """The upstream's requested wait: OpenAI's `retry-after-ms`, else RFC 9110 `Retry-After`
    (seconds or an HTTP date). None when absent or unreadable."""
    raw_ms = headers.get("retry-after-ms")
    if raw_ms:
        try:
            ms = float(raw_ms)
        except ValueError:
            ms = math.nan
        if math.isfinite(ms) and ms >= 0:
            return ms / 1000
    raw = headers.get("retry-after")
    if not raw:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(raw)
        except (TypeError, ValueError):
            return None
        return max(0.0, when.timestamp() - (time.time() if now is None else now))
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def backoff_s(retry: RetryConfig, n: int, rng: random.Random) -> float:
    """Wait before retry `n` (1-based): exponential, capped, with equal jitter."""
    base = min(retry.max_backoff_ms, retry.initial_backoff_ms * 2.0 ** (n - 1)) / 1000
    return base * (0.5 + rng.random() / 2)


def fallback_worthy(status: int) -> bool:
    """An answer another model may do better with: overloaded, rate limited or broken. A 4xx
    about the request itself would fail the same way anywhere, so it goes to the client."""
    return status in (408, 429) or status >= 500


# OpenAI's error type for a bad request, and vLLM's.
_REQUEST_ERROR_TYPES = frozenset({"invalid_request_error", "BadRequestError"})
# Codes OpenAI gives errors about the request's parameters.
_REQUEST_ERROR_CODES = frozenset({
    "context_length_exceeded", "invalid_value", "invalid_type", "missing_required_parameter",
    "unsupported_parameter", "unsupported_value", "integer_below_min_value",
    "integer_above_max_value", "string_above_max_length", "invalid_request_error",
})


def request_fault(body: bytes) -> str | None:
    """`context_length` or `bad_request` when `body` is an error in OpenAI's shape (or vLLM's
    flat one) that blames the request: its type is `invalid_request_error`, its code names a bad
    parameter, or its message the context length. None for anything else."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    err = obj.get("error")
    if not isinstance(err, dict):
        if obj.get("object") != "error":
            return None
        err = obj
    code = err.get("code") if isinstance(err.get("code"), str) else ""
    message = err.get("message")
    message = message.lower() if isinstance(message, str) else ""
    if code == "context_length_exceeded" or "context length" in message:
        return "context_length"
    if err.get("type") in _REQUEST_ERROR_TYPES or code in _REQUEST_ERROR_CODES:
        return "bad_request"
    return None


async def blames_request(response: aiohttp.ClientResponse) -> bool:
    """A 5xx whose body blames the request. The body is read (aiohttp keeps it for the relay);
    one that does not come within a second blames nothing."""
    if response.status < 500:
        return False
    try:
        async with asyncio.timeout(1.0):
            body = await response.read()
    except (TimeoutError, aiohttp.ClientError):
        return False
    return request_fault(body) is not None


def status_class(status: int) -> str:
    if status == 429:
        return "rate_limit"
    if status >= 500:
        return "upstream_5xx"
    return f"status_{status}"


class LatencyTracker:
    """Recent upstream TTFTs per (upstream, route pattern): a bounded set of keys, since both
    come from the configuration, never from a client."""

    _MAX_SAMPLES = 2000

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._samples: dict[tuple[str, str], collections.deque[tuple[float, float]]] = {}

    def observe(self, route: Route, ttft_s: float) -> None:
        key = (route.upstream.name, route.pattern)
        samples = self._samples.get(key)
        if samples is None:
            samples = self._samples[key] = collections.deque(maxlen=self._MAX_SAMPLES)
        samples.append((self._clock(), ttft_s))

    def p95(self, route: Route, window_s: float) -> tuple[float | None, int]:
        samples = self._samples.get((route.upstream.name, route.pattern))
        if not samples:
            return None, 0
        horizon = self._clock() - window_s
        while samples and samples[0][0] < horizon:
            samples.popleft()
        values = sorted(v for _, v in samples)
        if not values:
            return None, 0
        return values[min(len(values) - 1, math.ceil(0.95 * len(values)) - 1)], len(values)

    def is_slow(self, route: Route, rule: LatencyFallback) -> bool:
        p95, n = self.p95(route, rule.window_s)
        return p95 is not None and n >= rule.min_samples and p95 * 1000 > rule.ttft_p95_ms


def candidates(
    router: Router, route: Route, model: str, tracker: LatencyTracker
) -> list[Candidate]:
    """The primary, then its fallbacks in order. A primary whose recent TTFT p95 is over its
    threshold goes last instead of first: it still serves if every fallback fails, and once its
    slow samples age out of the window it is tried first again."""
    out = [Candidate(model, route, "primary")]
    for name in route.fallbacks:
        fallback = router.resolve(name)
        if fallback is not None and name != model:
            out.append(Candidate(name, fallback, "error"))
    rule = route.latency
    if rule is not None and len(out) > 1 and tracker.is_slow(route, rule):
        first = out[1]
        out = [Candidate(first.model, first.route, "slow"), *out[2:], out[0]]
    return out


RetryHook = Callable[[Upstream, str], None]


def _nothing() -> None:
    pass


async def call_upstream(
    session: aiohttp.ClientSession,
    upstream: Upstream,
    path: str,
    body: bytes,
    headers: CIMultiDict[str],
    *,
    on_retry: RetryHook,
    rng: random.Random,
    on_attempt: Callable[[], None] = _nothing,
) -> aiohttp.ClientResponse:
    """POST to `upstream` until it answers with something not worth retrying, the attempts are
    spent, or the next wait would end past the retry deadline. Returns the last response (any
    status); raises UpstreamTimeout / UpstreamUnavailable when no response came at all.
    `on_attempt` runs as each request goes out, `on_retry` once its failure is given up on."""
    retry = upstream.retry
    loop = asyncio.get_running_loop()
    deadline = loop.time() + retry.deadline_s
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=upstream.connect_timeout_s)
    url = upstream.base_url + path
    attempt = 0
    while True:
        attempt += 1
        failure: ProxyError
        on_attempt()
        try:
            async with asyncio.timeout(upstream.first_byte_timeout_s):
                response = await session.post(url, data=body, headers=headers, timeout=timeout)
        except aiohttp.ConnectionTimeoutError:  # a TimeoutError too: first
            failure = UpstreamTimeout(
                f"Connecting to upstream `{upstream.name}` timed out "
                f"({upstream.connect_timeout_s:g} s, connect_timeout_s).",
                code="connect_timeout",
            )
        except TimeoutError:
            # The request may be running upstream: a second copy would double its cost.
            raise UpstreamTimeout(
                f"Upstream `{upstream.name}` sent no response within "
                f"{upstream.first_byte_timeout_s:g} s (first_byte_timeout_s).",
                code="first_byte_timeout",
            ) from None
        except aiohttp.ClientError as exc:
            failure = UpstreamUnavailable(
                f"Upstream `{upstream.name}` is unreachable ({type(exc).__name__})."
            )
        else:
            if (
                response.status not in retry.on_status
                or attempt >= retry.max_attempts
                or response.headers.get("x-should-retry", "").lower() == "false"
                or await blames_request(response)
            ):
                return response
            wait = retry_after_s(response.headers)
            if wait is None:
                wait = backoff_s(retry, attempt, rng)
            if loop.time() + wait > deadline:
                return response  # the client (or a fallback) gets the answer now, not later
            on_retry(upstream, status_class(response.status))
            await _discard(response)
            await asyncio.sleep(wait)
            continue
        wait = backoff_s(retry, attempt, rng)
        if attempt >= retry.max_attempts or loop.time() + wait > deadline:
            raise failure
        on_retry(upstream, failure.error_class)
        await asyncio.sleep(wait)


async def _discard(response: aiohttp.ClientResponse) -> None:
    """Read a small error body so its connection can be reused; close it if that is slow."""
    try:
        async with asyncio.timeout(1.0):
            await response.read()
    except (TimeoutError, aiohttp.ClientError):
        response.close()
    finally:
        response.release()
