"""The path of one metered request: parse -> auth -> budget reserve -> upstream (`attempts`:
retries, fallbacks) -> relay + meter (`tap`) -> `settle`.

Streaming responses are relayed chunk by chunk: each chunk is written to the client before the
proxy looks at it, and the SSE decoder and translator read it on the side. Settling (usage,
metrics, the log line) runs in `finally`, shielded from the cancellation a client disconnect
causes, so a request that dies half-way is still accounted for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from proxy import attempts
from proxy import state as st
from proxy.auth import Principal, client_key
from proxy.budget import rate_limit_headers
from proxy.errors import (
    InvalidRequest,
    NotFound,
    ProxyError,
    RequestTooLarge,
    UpstreamTimeout,
    UpstreamUnavailable,
    stream_error_event,
)
from proxy.exchange import Exchange
from proxy.listener import BODY_TIMED_OUT
from proxy.meter import RequestMeter
from proxy.settle import settle
from proxy.tap import StreamTap
from proxy.translators import ParsedRequest, Translator, parse_body
from proxy.upstream import Upstream, client_response_headers, upstream_request_headers
from proxy.watchdog import WATCHDOG, Watch

log = logging.getLogger("tokenmeter.relay")


def classify_upstream_error(status: int, body: bytes) -> str:
    if status in (401, 403):
        return "auth"
    if status == 429:
        return "rate_limit"
    fault = attempts.request_fault(body)
    if status >= 500:
        return fault or "upstream_5xx"  # a validation error some servers answer with a 500
    return "context_length" if fault == "context_length" else "bad_request"


def make_handler(
    translator_cls: type[Translator],
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handler(request: web.Request) -> web.StreamResponse:
        return await handle(request, translator_cls)

    return handler


async def handle(request: web.Request, translator_cls: type[Translator]) -> web.StreamResponse:
    ex = Exchange(uuid.uuid4().hex, translator_cls.operation, RequestMeter())
    try:
        return await _serve(request, translator_cls, ex)
    except ProxyError as exc:
        ex.status, ex.error_class = exc.status, exc.error_class
        return exc.to_response()
    except asyncio.CancelledError:
        # aiohttp cancels the handler when the client disconnects, and the listener when the
        # body missed its deadline (it answered 408 itself).
        if request.get(BODY_TIMED_OUT):
            ex.status, ex.error_class = 408, "body_timeout"
            raise
        if ex.error_class != "client_timeout":  # the proxy cut it: that is the finer cause
            ex.error_class = "client_disconnect"
        if not ex.upstream_answered:
            ex.status = 499
        raise
    except ConnectionError:
        # A write to a client that has gone (without handler cancellation, or before it lands).
        if not _client_gone(request):
            ex.error_class = "internal"
            raise
        ex.status, ex.error_class = 499, "client_disconnect"
        return web.Response(status=499)
    except Exception:
        ex.error_class = "internal"
        raise
    finally:
        ex.meter.finish()
        task = asyncio.ensure_future(settle(request.app, ex))
        request.app[st.SETTLING].tasks.add(task)
        task.add_done_callback(request.app[st.SETTLING].finished)
        # If we are cancelled while waiting, the settle task runs on; shutdown waits for SETTLING.
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(task)


async def _serve(
    request: web.Request, translator_cls: type[Translator], ex: Exchange
) -> web.StreamResponse:
    runtime = ex.runtime = request.app[st.RUNTIME_HOLDER].current
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise RequestTooLarge(
            f"The request body is larger than the proxy accepts "
            f"({runtime.config.server.max_body_mb:g} MB, server.max_body_mb)."
        ) from None
    parsed = parse_body(raw)
    ex.model, ex.stream = parsed.model, parsed.stream
    if parsed.stream and not translator_cls.streams:
        raise InvalidRequest(f"{translator_cls.path} does not support streaming", param="stream")
    principal = ex.principal = runtime.users.authenticate(request)
    route = runtime.router.resolve(parsed.model)
    if route is None:
        raise NotFound(
            f"The model `{parsed.model}` is not routed to any upstream by this proxy.",
            param="model", code="model_not_found",
        )
    plan = attempts.candidates(runtime.router, route, parsed.model, request.app[st.LATENCY])
    fallbacks = request.app[st.METRICS].fallbacks
    reason = ""
    for index, cand in enumerate(plan):
        if index:
            ex.fallback_from = parsed.model
            fallbacks.labels(plan[index - 1].route.pattern, cand.model, reason).inc()
        elif cand.model != parsed.model:  # the primary is slow: its first fallback goes first
            ex.fallback_from = parsed.model
            fallbacks.labels(route.pattern, cand.model, cand.reason).inc()
        outcome = await _attempt(request, translator_cls, parsed, principal, cand, ex,
                                 last=index == len(plan) - 1)
        if isinstance(outcome, str):
            reason = outcome
            continue
        return await _relay(request, outcome, ex)
    raise AssertionError("the last candidate answers or raises")


async def _attempt(
    request: web.Request, translator_cls: type[Translator], parsed: ParsedRequest,
    principal: Principal, cand: attempts.Candidate, ex: Exchange, *, last: bool,
) -> aiohttp.ClientResponse | str:
    """One candidate: reserve its budget and call its upstream (with retries). Returns the
    response to relay, or, when it failed in a way the next candidate may do better with, the
    failure's class (its reservation is then given back whole)."""
    runtime = ex.runtime
    assert runtime is not None
    app = request.app
    budget, metrics = app[st.BUDGET], app[st.METRICS]
    ex.route, ex.model = cand.route, cand.model
    upstream = cand.route.upstream
    translator = ex.translator = translator_cls(
        parsed, upstream.stream_usage, cand.model, write_all_caps=upstream.write_all_caps
    )
    reservation = ex.reservation = await budget.reserve(principal, translator, runtime.config)
    # Model names are the client's text: they go into a header only if they are plain
    # printable ASCII, never as a way to inject a header line.
    ex.response_headers = {}
    if _header_safe(cand.model):
        ex.response_headers["x-tokenmeter-model"] = cand.model
    if ex.fallback_from is not None and _header_safe(ex.fallback_from):
        ex.response_headers["x-tokenmeter-fallback-from"] = ex.fallback_from
    if reservation.stored:  # admitted during a store outage: the counts are unknown
        ex.response_headers.update(
            rate_limit_headers(reservation.plan.windows, reservation.used, budget.clock())
        )
    headers = upstream_request_headers(
        request.headers, upstream,
        client_key=client_key(request) if principal.forward_client_key else None,
    )

    def on_attempt() -> None:
        ex.in_flight = True

    def on_retry(u: Upstream, reason: str) -> None:
        ex.in_flight = False
        ex.attempts += 1
        metrics.retries.labels(u.name, reason).inc()

    ex.meter.mark_upstream_start()
    loop = asyncio.get_running_loop()
    # Streams have no total cap (idle time is watched instead); a JSON answer has one.
    ex.deadline = None if ex.stream else loop.time() + upstream.total_timeout_s
    try:
        async with asyncio.timeout_at(ex.deadline):
            up = await attempts.call_upstream(
                app[st.SESSION], upstream, translator.path, translator.upstream_body(), headers,
                on_retry=on_retry, rng=app[st.RNG], on_attempt=on_attempt,
            )
    except TimeoutError:
        ex.in_flight = False
        exc = _total_timeout(upstream)
        if last:
            raise exc from None
        failure = exc.error_class
    except (UpstreamTimeout, UpstreamUnavailable) as exc:
        ex.in_flight = False
        if last:
            raise
        failure = exc.error_class
    else:
        ex.in_flight = up.status < 300
        if (
            last
            or up.status == 200
            or not attempts.fallback_worthy(up.status)
            or await attempts.blames_request(up)
        ):
            ex.upstream_answered = True
            return up
        failure = attempts.status_class(up.status)
        up.close()
    log.warning("request %s: model %s failed (%s), trying its next fallback",
                ex.request_id, cand.model, failure)
    ex.attempts += 1
    ex.reservation = None
    await budget.release(reservation)
    return failure


async def _relay(
    request: web.Request, up: aiohttp.ClientResponse, ex: Exchange
) -> web.StreamResponse:
    assert ex.route is not None and ex.translator is not None
    upstream = ex.route.upstream
    active = request.app[st.METRICS].active.labels(upstream.name)
    active.inc()
    try:
        ex.status = up.status
        if up.status == 200 and up.content_type == "text/event-stream":
            with request.app[WATCHDOG].watch(
                up, upstream.idle_timeout_s, write_timeout=_client_write_timeout(ex),
                abort_client=lambda: _client_timed_out(request, ex),
            ) as watch:
                return await _relay_stream(request, up, ex.translator, ex, watch)
        return await _relay_body(up, ex.translator, ex, upstream)
    finally:
        # release(): a response read to its end returns its connection to the pool; one cut
        # short (client gone, error) has its connection closed, which ends the upstream request.
        up.release()
        active.dec()


def _header_safe(value: str) -> bool:
    return value.isascii() and value.isprintable()


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def _client_write_timeout(ex: Exchange) -> float | None:
    """`server.client_write_timeout_s`: how long one write may wait on a client that does not
    read (None: as long as it takes)."""
    if ex.runtime is None:
        return None
    return ex.runtime.config.server.client_write_timeout_s


def _client_timed_out(request: web.Request, ex: Exchange) -> None:
    """The watchdog's verdict on a client that stopped reading: its connection is ended (the
    relay's write then fails, and the upstream response is closed with it)."""
    log.warning("request %s: the client read nothing for %g s (client_write_timeout_s); "
                "its stream is ended", ex.request_id, _client_write_timeout(ex) or 0)
    ex.error_class = "client_timeout"
    _abort(request)


def _total_timeout(upstream: Upstream) -> UpstreamTimeout:
    return UpstreamTimeout(
        f"Upstream `{upstream.name}` did not complete the response within "
        f"{upstream.total_timeout_s:g} s (total_timeout_s).",
        code="total_timeout",
    )


async def _relay_body(
    up: aiohttp.ClientResponse, translator: Translator, ex: Exchange, upstream: Upstream
) -> web.StreamResponse:
    # A JSON answer is useless to a client until complete, so reading it whole costs nothing.
    # Its time counts against the request's total cap; an error body of a stream request gets
    # the idle timeout.
    deadline = ex.deadline
    if deadline is None:
        deadline = asyncio.get_running_loop().time() + upstream.idle_timeout_s
    try:
        async with asyncio.timeout_at(deadline):
            body = await up.read()
    except TimeoutError:
        if ex.deadline is not None:
            raise _total_timeout(upstream) from None
        raise UpstreamTimeout(
            f"Upstream `{upstream.name}` stopped sending its response.", code="idle_timeout"
        ) from None
    except aiohttp.ClientError as exc:
        raise UpstreamUnavailable(f"The upstream response broke ({type(exc).__name__}).") from None
    if up.status < 300:
        translator.on_body(body)
    else:
        ex.error_class = classify_upstream_error(up.status, body)
    return web.Response(status=up.status, body=body, headers=_client_headers(up, ex))


async def _relay_stream(
    request: web.Request, up: aiohttp.ClientResponse, translator: Translator, ex: Exchange,
    watch: Watch,
) -> web.StreamResponse:
    resp = web.StreamResponse(status=up.status, headers=_client_headers(up, ex))
    try:
        await resp.prepare(request)
    except (ConnectionError, RuntimeError):
        # The client hung up as the upstream's answer came: its socket is closing, and the
        # handler's cancellation is on its way. Nothing reached it.
        if not _client_gone(request):
            raise
        ex.status, ex.error_class = 499, "client_disconnect"
        return resp
    errors = request.app[st.METRICS].metering_errors.labels("stream")
    tap = StreamTap(translator, ex.meter, on_error=errors.inc)
    passthrough, observe = tap.passthrough, tap.observe
    perf = time.perf_counter
    try:
        async for chunk in up.content.iter_any():
            now = watch.last = perf()
            # `writing`: a client that reads slowly makes write() wait, and the upstream is not
            # read meanwhile; that wait is not the upstream's silence (see watchdog).
            if passthrough(chunk):
                watch.writing = now
                await resp.write(chunk)  # forward first, look second
                watch.writing = 0.0
                observe(chunk, now)
            else:
                out = tap.filter(chunk, now)
                if out:
                    watch.writing = now
                    await resp.write(out)
                    watch.writing = 0.0
        if watch.expired:  # the watchdog closed a silent upstream: that is not a clean end
            raise TimeoutError
        at_boundary = tap.client_at_boundary
        rest = tap.close()
        if not (tap.broken or translator.end_of_stream()):
            # Closed without its final event (`[DONE]`, `response.completed`, ...): the upstream
            # gave up, as a reset would have, without saying so.
            failure: ProxyError = UpstreamUnavailable(
                "The upstream ended the stream without its final event; this response is "
                "incomplete.", code="upstream_incomplete",
            )
            await _fail_stream(request, resp, tap, translator, ex, watch, failure, at_boundary)
        elif rest:
            watch.writing = perf()
            await resp.write(rest)
            watch.writing = 0.0
        # No write_eof here: aiohttp writes the final chunk after the handler returns, which is
        # after settling, so a client that has seen the end of its stream is already accounted.
    except (ConnectionResetError, BrokenPipeError):
        # aiohttp raises these (ClientConnectionResetError among them) from write() when the
        # client went away, or was cut off for not reading.
        if ex.error_class != "client_timeout":
            ex.error_class = "client_disconnect"
        tap.close()
    except (TimeoutError, aiohttp.ClientError):
        if watch.expired:
            failure = UpstreamTimeout(
                f"The upstream sent nothing for {watch.timeout:g} s (idle_timeout_s); this "
                "response is incomplete.", code="idle_timeout",
            )
        else:
            failure = UpstreamUnavailable(
                "The upstream connection broke mid-stream; this response is incomplete.",
                code="upstream_reset",
            )
        await _fail_stream(request, resp, tap, translator, ex, watch, failure)
    except Exception:
        # Headers are out: no error response is possible any more, only an error event.
        log.exception("relaying stream %s failed", ex.request_id)
        failure = ProxyError("The proxy failed while relaying this stream; it is incomplete.",
                             code="internal")
        await _fail_stream(request, resp, tap, translator, ex, watch, failure)
    return resp


async def _fail_stream(
    request: web.Request, resp: web.StreamResponse, tap: StreamTap, translator: Translator,
    ex: Exchange, watch: Watch, failure: ProxyError, at_boundary: bool | None = None,
) -> None:
    """A stream that broke after its headers went out. The client gets a last event in OpenAI's
    error shape, so it can tell a truncated answer from a complete one (the SDKs raise on it),
    then the stream ends. If the break came in the middle of an event whose start was already
    forwarded, no event can follow it cleanly: the connection is cut instead, which clients see
    as a broken stream, just as clear. `at_boundary`: as it was before the tap was closed."""
    ex.error_class = failure.error_class
    if at_boundary is None:
        at_boundary = tap.client_at_boundary
    tap.close()  # meters a last, unterminated event; its held bytes are not forwarded
    if at_boundary:
        with contextlib.suppress(ConnectionError):
            watch.writing = time.perf_counter()
            await resp.write(stream_error_event(failure, translator.named_events))
            watch.writing = 0.0
            return
    _abort(request)


def _client_headers(up: aiohttp.ClientResponse, ex: Exchange) -> CIMultiDict[str]:
    headers = client_response_headers(up.headers)
    for name, value in ex.response_headers.items():
        headers[name] = value  # our limits replace the upstream's same-named x-ratelimit-*
    return headers


def _abort(request: web.Request) -> None:
    """End the client's connection without the final chunk: a broken stream, not a clean end."""
    if request.transport is not None:
        request.transport.abort()
