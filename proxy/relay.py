"""The path of one metered request: parse -> auth -> upstream -> relay + meter -> settle.

Streaming responses are relayed chunk by chunk: each chunk is written to the client before the
proxy looks at it, and the SSE decoder and translator read it on the side. Settling (usage,
metrics, the log line) runs in `finally`, shielded from the cancellation a client disconnect
causes, so a request that dies half-way is still accounted for.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from proxy import state as st
from proxy.accesslog import log_request
from proxy.auth import Principal, client_key
from proxy.budget import Reservation, rate_limit_headers
from proxy.errors import (
    InvalidRequest,
    NotFound,
    ProxyError,
    RequestTooLarge,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from proxy.meter import RequestMeter
from proxy.metrics import RequestRecord
from proxy.state import Runtime
from proxy.tap import StreamTap
from proxy.translators import Translator, parse_body
from proxy.upstream import Route, client_response_headers, upstream_request_headers
from proxy.usage import ZERO, Usage
from proxy.watchdog import WATCHDOG, Watch

log = logging.getLogger("tokenmeter.relay")


@dataclass(slots=True)
class Exchange:
    """Mutable facts about one request, filled in as it goes and read once when settling."""

    request_id: str
    operation: str
    meter: RequestMeter
    model: str = ""
    stream: bool = False
    runtime: Runtime | None = None
    principal: Principal | None = None
    route: Route | None = None
    translator: Translator | None = None
    reservation: Reservation | None = None
    response_headers: dict[str, str] = field(default_factory=dict)
    status: int = 500
    error_class: str = "none"
    upstream_answered: bool = False
    notes: list[str] = field(default_factory=list)


def classify_upstream_error(status: int, body: bytes) -> str:
    if status in (401, 403):
        return "auth"
    if status == 429:
        return "rate_limit"
    if status >= 500:
        return "upstream_5xx"
    code = message = ""
    try:
        err = json.loads(body).get("error") or {}
        code = str(err.get("code") or "")
        message = str(err.get("message") or "").lower()
    except (ValueError, AttributeError):
        pass
    if code == "context_length_exceeded" or "context length" in message:
        return "context_length"
    return "bad_request"


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
        # aiohttp cancels the handler when the client disconnects.
        ex.error_class = "client_disconnect"
        if not ex.upstream_answered:
            ex.status = 499
        raise
    except Exception:
        ex.error_class = "internal"
        raise
    finally:
        ex.meter.finish()
        task = asyncio.ensure_future(_settle(request.app, ex))
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
    ex.route = route
    translator = ex.translator = translator_cls(parsed, route.upstream.stream_usage)
    budget = request.app[st.BUDGET]
    reservation = ex.reservation = await budget.reserve(principal, translator, runtime.config)
    if reservation.stored:  # admitted during a store outage: the counts are unknown
        ex.response_headers = rate_limit_headers(
            reservation.plan.windows, reservation.used, budget.clock()
        )
    upstream = route.upstream
    # No sock_read: a per-read timer is costly at stream speed; the watchdog covers streams and
    # asyncio.timeout the wait for headers and for a JSON body.
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=upstream.connect_timeout_s)
    headers = upstream_request_headers(
        request.headers, upstream,
        client_key=client_key(request) if principal.forward_client_key else None,
    )
    session = request.app[st.SESSION]
    ex.meter.mark_upstream_start()
    try:
        async with asyncio.timeout(upstream.read_timeout_s):
            up = await session.post(
                upstream.base_url + translator.path,
                data=translator.upstream_body(),
                headers=headers,
                timeout=timeout,
            )
    except TimeoutError:
        raise UpstreamTimeout(f"Upstream `{upstream.name}` did not answer in time.") from None
    except aiohttp.ClientError as exc:
        raise UpstreamUnavailable(
            f"Upstream `{upstream.name}` is unreachable ({type(exc).__name__})."
        ) from None
    ex.upstream_answered = True
    active = request.app[st.METRICS].active.labels(upstream.name)
    active.inc()
    try:
        ex.status = up.status
        if up.status == 200 and up.content_type == "text/event-stream":
            with request.app[WATCHDOG].watch(up, upstream.read_timeout_s) as watch:
                return await _relay_stream(request, up, translator, ex, watch)
        return await _relay_body(up, translator, ex, upstream.read_timeout_s)
    finally:
        # release(): a response read to its end returns its connection to the pool; one cut
        # short (client gone, error) has its connection closed, which ends the upstream request.
        up.release()
        active.dec()


async def _relay_body(
    up: aiohttp.ClientResponse, translator: Translator, ex: Exchange, read_timeout: float
) -> web.StreamResponse:
    # A JSON answer is useless to a client until complete, so reading it whole costs nothing.
    try:
        async with asyncio.timeout(read_timeout):
            body = await up.read()
    except TimeoutError:
        raise UpstreamTimeout("The upstream stopped sending its response.") from None
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
    await resp.prepare(request)
    errors = request.app[st.METRICS].metering_errors.labels("stream")
    tap = StreamTap(translator, ex.meter, on_error=errors.inc)
    passthrough, observe = tap.passthrough, tap.observe
    perf = time.perf_counter
    try:
        async for chunk in up.content.iter_any():
            now = watch.last = perf()
            if passthrough(chunk):
                await resp.write(chunk)  # forward first, look second
                observe(chunk, now)
            else:
                out = tap.filter(chunk, now)
                if out:
                    await resp.write(out)
        rest = tap.close()
        if watch.expired:  # the watchdog closed a silent upstream: that is not a clean end
            raise TimeoutError
        if rest:
            await resp.write(rest)
        # No write_eof here: aiohttp writes the final chunk after the handler returns, which is
        # after settling, so a client that has seen the end of its stream is already accounted.
    except (ConnectionResetError, aiohttp.ClientConnectionResetError):
        # aiohttp raises these from write() when the client went away.
        ex.error_class = "client_disconnect"
        tap.close()
    except TimeoutError:
        ex.error_class = "timeout"
        tap.close()
        _abort(request)
    except aiohttp.ClientError:
        ex.error_class = "timeout" if watch.expired else "upstream_reset"
        tap.close()
        _abort(request)
    except Exception:
        # Headers are out: no error response is possible any more. Break the stream visibly.
        log.exception("relaying stream %s failed", ex.request_id)
        ex.error_class = "internal"
        tap.close()
        _abort(request)
    return resp


def _client_headers(up: aiohttp.ClientResponse, ex: Exchange) -> CIMultiDict[str]:
    headers = client_response_headers(up.headers)
    for name, value in ex.response_headers.items():
        headers[name] = value  # our limits replace the upstream's same-named x-ratelimit-*
    return headers


def _abort(request: web.Request) -> None:
    """Mirror an upstream failure: end the client's connection without the final chunk, so the
    client sees a broken stream rather than a clean end that never happened."""
    if request.transport is not None:
        request.transport.abort()


async def _settle(app: web.Application, ex: Exchange) -> None:
    metrics = app[st.METRICS]
    runtime = ex.runtime or app[st.RUNTIME_HOLDER].current
    try:
        usage: Usage = ZERO
        if ex.translator is not None and ex.upstream_answered and ex.status < 300:
            usage = ex.translator.usage()
        if ex.reservation is not None:
            await app[st.BUDGET].settle(ex.reservation, usage)
        figures = ex.meter.figures(usage.output_tokens)
        route = ex.route
        record = RequestRecord(
            request_id=ex.request_id,
            operation=ex.operation,
            model=ex.model,
            model_label=runtime.router.model_label(ex.model, route) if ex.model else "none",
            upstream=route.upstream.name if route is not None else "none",
            user=ex.principal.user if ex.principal is not None else "anonymous",
            key=(ex.principal.key_name or ex.principal.key_id) if ex.principal else None,
            status=ex.status,
            error_class=ex.error_class,
            stream=ex.stream,
            usage=usage,
            figures=figures,
        )
        metrics.observe(record)
        price = runtime.price_for(ex.model)
        if price is not None:
            metrics.observe_cost(record, price.input, price.cached_input, price.output)
        metrics.observe_gaps(record, ex.meter.gap_buckets())
        log_request(record)
    except Exception:
        # Loud, never silent: a request whose usage we could not record is a billing hole.
        metrics.metering_errors.labels("settle").inc()
        log.exception("failed to settle request %s", ex.request_id)
