"""Which upstream call to make, and again: retries with backoff, fallbacks, slow-model switching.

Everything here happens before the client has been sent a byte, which is what makes it safe: a
request is retried (same upstream) on connect errors and on the statuses its upstream's `retry`
lists, and handed to the route's fallbacks (other models, routed by their own entries) when the
retries are spent. Once a stream has started nothing is retried; the relay reports the failure
in the stream instead. A 5xx whose body blames the request (some servers answer a validation
error with a 500) is neither retried nor handed on: it would fail the same way every time.
What an answer means is `proxy.protocol.upstream_errors.classify`'s to say, asked once per
answer, as it arrives (`answer_class`): the retry, the fallback and the request's record all read
that one class (`Answer`). What an aiohttp exception means is `proxy.routing.exceptions_map`'s.
"""

from __future__ import annotations

import asyncio
import collections
import email.utils
import functools
import logging
import math
import random
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Protocol

import aiohttp
from multidict import CIMultiDict
from yarl import URL

from proxy.config.load import LatencyFallback, RetryConfig
from proxy.errors import ConnectTimeout, ErrorClass, ProxyError, UpstreamUnreachable
from proxy.protocol import upstream_errors
from proxy.routing.exceptions_map import Phase, map_upstream_exceptions
from proxy.routing.upstream import Route, Router, Upstream, redirect_refused

log = logging.getLogger("tokenmeter")


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


@dataclass(frozen=True, slots=True)
class Answer:
    """An upstream's answer and its class, decided once as it arrived (`answer_class`)."""

    response: aiohttp.ClientResponse
    error_class: ErrorClass  # `none` for a success


async def answer_class(response: aiohttp.ClientResponse) -> ErrorClass:
    """The class of an upstream's answer: the one decision retries, fallbacks and the request's
    record read. An error's body is read (some servers answer a bad request with a 500, and a
    4xx's says `context_length` from `bad_request`; aiohttp keeps it for the relay), within a
    second: a body that does not come by then blames nothing, and its status decides."""
    if response.status < 300:
        return ErrorClass.NONE
    body: bytes | None
    try:
        async with asyncio.timeout(1.0):
            body = await response.read()
    except (TimeoutError, aiohttp.ClientError):
        body = None
    return upstream_errors.classify(response.status, body)


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


RetryHook = Callable[[Upstream, ErrorClass], None]  # the failure's class: the retry's reason


def _nothing() -> None:
    pass


@dataclass(frozen=True, slots=True)
class Call:
    """One request to an upstream, sent again as it is when retried."""

    path: str
    body: bytes
    headers: CIMultiDict[str]


class AttemptWatch(Protocol):
    """What is told of each attempt: as it starts (on a copy of its headers, which it may add
    to), its answer, and its failure."""

    def attempt_started(self, headers: MutableMapping[str, str], host: str,
                        port: int | None) -> None: ...

    def attempt_answered(self, status: int, error_class: ErrorClass) -> None: ...

    def attempt_ended(self, error_class: ErrorClass) -> None: ...


@dataclass(frozen=True, slots=True)
class Retrying:
    """Whom a call's attempts report to, and the jitter of their waits."""

    on_retry: RetryHook  # once a failure is given up on, with its class: the retry's reason
    rng: random.Random
    on_attempt: Callable[[], None] = _nothing  # as each request goes out
    # Who watches each attempt (the request's observers, e.g. its spans: a `traceparent`
    # per attempt); None: nobody.
    trace: AttemptWatch | None = None


@functools.lru_cache(maxsize=1024)
def _url(text: str) -> URL:
    """An upstream URL parsed once, not on every request (aiohttp parses a string each time).
    Upstreams and their paths are a handful: the cache is their number."""
    return URL(text)


async def call_upstream(session: aiohttp.ClientSession, upstream: Upstream, call: Call,
                        retrying: Retrying) -> Answer:
    """POST to `upstream` until it answers with something not worth retrying, the attempts are
    spent, or the next wait would end past the retry deadline. Returns the last answer (any
    status but a redirect) with its class; raises UpstreamTimeout / UpstreamUnavailable kinds
    (ConnectTimeout, FirstByteTimeout, UpstreamUnreachable) when no response came at all, and
    UpstreamRedirect at once, never retried or followed, when the upstream answered 3xx."""
    retry = upstream.retry
    loop = asyncio.get_running_loop()
    deadline = loop.time() + retry.deadline_s
    url = _url(upstream.base_url + call.path)
    attempt = 0
    trace = retrying.trace
    while True:
        attempt += 1
        failure: ProxyError
        retrying.on_attempt()
        headers = call.headers
        if trace is not None:  # each attempt's own traceparent, on a copy of the headers
            headers = headers.copy()
            trace.attempt_started(headers, url.host or "", url.port)
        try:
            response = await _send(session, upstream, url, call.body, headers)
        except (ConnectTimeout, UpstreamUnreachable) as exc:
            failure = exc  # no response came: worth another try
        except ProxyError as exc:  # a first-byte timeout or a redirect: never retried
            if trace is not None:
                trace.attempt_ended(exc.error_class)
            raise
        else:
            cls = ErrorClass.NONE if response.status < 300 else await answer_class(response)
            if trace is not None:
                trace.attempt_answered(response.status, cls)
            wait = _retry_wait(retry, response, cls, attempt, retrying.rng)
            if wait is None or loop.time() + wait > deadline:
                return Answer(response, cls)  # the client (or a fallback) gets it now
            retrying.on_retry(upstream, cls)
            if trace is not None:
                trace.attempt_ended(cls)
            await _discard(response)
            await asyncio.sleep(wait)
            continue
        if trace is not None:
            trace.attempt_ended(failure.error_class)
        wait = backoff_s(retry, attempt, retrying.rng)
        if attempt >= retry.max_attempts or loop.time() + wait > deadline:
            raise failure
        retrying.on_retry(upstream, failure.error_class)
        await asyncio.sleep(wait)


async def _send(session: aiohttp.ClientSession, upstream: Upstream, url: URL, body: bytes,
                headers: CIMultiDict[str]) -> aiohttp.ClientResponse:
    """One POST: its response, else the error of none (raised as `map_upstream_exceptions`
    names it); a redirect is refused."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=upstream.connect_timeout_s)
    # A first-byte timeout is raised as it is, never retried: the request may be running
    # upstream, and a second copy would double its cost.
    with map_upstream_exceptions(upstream, Phase.CONNECT):
        async with asyncio.timeout(upstream.first_byte_timeout_s):
            response = await session.post(url, data=body, headers=headers,
                                          timeout=timeout, allow_redirects=False)
    if (refused := redirect_refused(upstream, response.status)) is not None:
        log.warning("upstream %s answered %d: redirects are not followed",
                    upstream.name, response.status)
        await _discard(response)
        raise refused
    return response


def _retry_wait(retry: RetryConfig, response: aiohttp.ClientResponse, cls: ErrorClass,
                attempt: int, rng: random.Random) -> float | None:
    """How long to wait before trying an answer again (the upstream's word, else the
    backoff), or None: it is final. A 5xx that blames the request would fail the same way."""
    if (
        response.status not in retry.on_status
        or attempt >= retry.max_attempts
        or response.headers.get("x-should-retry", "").lower() == "false"
        or upstream_errors.blames_request(response.status, cls)
    ):
        return None
    wait = retry_after_s(response.headers)
    return backoff_s(retry, attempt, rng) if wait is None else wait


async def _discard(response: aiohttp.ClientResponse) -> None:
    """Read a small error body so its connection can be reused; close it if that is slow."""
    try:
        async with asyncio.timeout(1.0):
            await response.read()
    except (TimeoutError, aiohttp.ClientError):
        response.close()
    finally:
        response.release()
