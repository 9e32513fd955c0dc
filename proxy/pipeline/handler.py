"""The path of one metered request, top to bottom:

    admit -> attempt(s) -> relay + meter -> settle -> books and metrics

`admit` authenticates the request (from its headers alone), then reads and parses its body and
routes its model: a frozen `RequestContext`. `forward` tries the route's candidates in turn
(the model asked for, then its fallbacks; a primary that is slow goes last) and returns the
`Attempt` whose answer is relayed. Each candidate is admitted by the budget first
(`proxy.budget.admission`: an `Ask` reserved whole, clamped or refused), then its body is built
once with the output cap it was granted and sent, with retries (`attempts`). `relay` streams or
returns that answer while the tap meters it. Whatever happens, the request's `Outcome` is frozen
into a `Settlement` and settled in `finally`, shielded from the cancellation a client's
disconnect causes, so a request that dies half-way is still accounted for. Of the request's own
state only the `Outcome` changes along the way (the context, candidacies and attempts are
frozen); the shared services do too: the budget holds and gives back reservations, and the
metrics count fallbacks and retries as they happen.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import hdrs, web

from proxy.auth import client_key
from proxy.budget import refusals
from proxy.budget.accounting import Reservation
from proxy.budget.admission import Ask
from proxy.budget.estimate import hides_output, learned_key
from proxy.budget.principal import Principal
from proxy.budget.refusals import Refused
from proxy.budget.store import ScopeKind
from proxy.config.tags import HEADER as TAGS_HEADER
from proxy.config.tags import Tags
from proxy.errors import (
    AuthenticationFailed,
    ErrorClass,
    InvalidRequest,
    NotFound,
    ProxyError,
    RequestTooLarge,
    UnsupportedContentEncoding,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from proxy.ids import new_id
from proxy.pipeline import caching, counting
from proxy.pipeline.context import Attempt, Candidacy, Outcome, RequestContext, opened
from proxy.pipeline.ending import ENDING, resolves
from proxy.pipeline.relay import (
    REQUEST_ID_HEADER,
    SHOULD_RETRY_HEADER,
    client_gone,
    relay,
    retries_spent,
    tell_cost,
)
from proxy.pipeline.services import BODY_TIMED_OUT, SERVICES, Opening, Runtime, Services
from proxy.pipeline.settle import settle
from proxy.protocol import upstream_errors
from proxy.protocol.translators import ParsedRequest, Translator, parse_body
from proxy.routing import attempts
from proxy.routing.exceptions_map import Phase, map_upstream_exceptions
from proxy.routing.upstream import Upstream, upstream_request_headers
from proxy.telemetry.meter import RequestMeter
from proxy.telemetry.metrics import Metrics

log = logging.getLogger("tokenmeter.relay")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Bodies larger than this are parsed in a thread, not on the event loop. The C JSON decoder
# holds the GIL while it scans, so the loop still waits out a scan; it runs again whenever
# parse_body calls back into Python (per object, for its checks) and for validation, instead
# of after the whole body. What bounds a body's cost is who may send one: only an
# authenticated client's body is read at all.
PARSE_ON_LOOP_BYTES = 256 * 1024
# How many large bodies are parsed at once (per process): each makes its body's objects (a
# 28 MB body can become hundreds of MB), and more at once would only add memory.
BODY_PARSERS = web.AppKey("tokenmeter_body_parsers", asyncio.Semaphore)
BODY_PARSER_SLOTS = 2
# The id of the request's ledger row, for the error middleware's answer to an unhandled error.
REQUEST_ID = web.RequestKey("tokenmeter_request_id", str)


@dataclass(frozen=True, slots=True)
class Failed:
    """A candidate that failed in a way its fallback may do better with."""

    reason: ErrorClass  # the fallback metric's label


def make_handler(shape: type[Translator]) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        return await handle(request, request.app[SERVICES], shape)

    return handler


async def handle(request: web.Request, svc: Services, shape: type[Translator]
                 ) -> web.StreamResponse:
    outcome = _opened(request, svc, shape)
    relayed: web.StreamResponse | None = None  # the upstream's answer, as the client gets it
    try:
        ctx = await admit(request, svc, shape, outcome)
        hit = await caching.consult(request, ctx, svc, outcome, shape)
        if hit is not None:
            relayed = hit  # told its cost like any answer
            return hit
        attempt = await forward(request, ctx, svc, shape, outcome)
        relayed = await relay(request, attempt, svc, outcome)
        return relayed
    except ProxyError as exc:
        return _refused(request, exc, shape, outcome)
    except asyncio.CancelledError:
        # aiohttp cancels the handler when the client disconnects, and the listener when the
        # body missed its deadline (it answered 408 itself).
        if request.get(BODY_TIMED_OUT):
            outcome.fail(ErrorClass.BODY_TIMEOUT, 408)
        else:
            outcome.client_left()
        raise
    except ConnectionError as exc:
        return _connection_lost(request, outcome, exc)
    except Exception:
        outcome.fail(ErrorClass.INTERNAL)
        raise
    finally:
        await _settle(request, svc, outcome, relayed)


def _refused(request: web.Request, exc: ProxyError, shape: type[Translator],
             outcome: Outcome) -> web.Response:
    outcome.fail(exc.error_class, exc.status)
    response = _answer(exc, shape, outcome)
    if isinstance(exc, AuthenticationFailed) or not request.content.is_eof():
        # A client without a valid key gets no kept-alive connection: it would hold one of
        # server.max_connections for keepalive_timeout_s (authentication is admission's
        # first step, so this is every answer to an unauthenticated request). Nor does a
        # request whose body was refused unread (401, 413, 415): the listener stops
        # reading once the answer is out and closes the connection after a moment, so
        # the client can read the answer; the rest of the body is never drained.
        response.force_close()
    return response


def _connection_lost(request: web.Request, outcome: Outcome,
                     exc: ConnectionError) -> web.Response:
    """A write to a client that has gone (without handler cancellation, or before it lands),
    or a body read that the connection's close ended (`_read`)."""
    if request.get(BODY_TIMED_OUT):  # the listener answered 408 and closed the connection
        outcome.fail(ErrorClass.BODY_TIMEOUT, 408)
        return web.Response(status=408)
    if not client_gone(request):
        outcome.fail(ErrorClass.INTERNAL)
        raise exc
    outcome.fail(ErrorClass.CLIENT_DISCONNECT, 499)
    return web.Response(status=499)


def _opened(request: web.Request, svc: Services, shape: type[Translator]) -> Outcome:
    """The request's outcome, with the observers the wings' factories make for it."""
    outcome = Outcome(new_id(), shape.operation, RequestMeter())
    request[REQUEST_ID] = outcome.request_id
    if svc.observers:
        outcome.observe(opened(svc.observers, Opening(
            outcome.request_id, shape.operation, shape.upstream_api, "/v1" + shape.path,
            request.headers, svc.runtime.current)))
    return outcome


def _answer(exc: ProxyError, shape: type[Translator], outcome: Outcome) -> web.Response:
    """The proxy's own error answer, in the API's shape."""
    response = exc.to_response(shape.error_shape, outcome.request_id)
    # The proxy's own answers name the request's row too: a refused client can quote it.
    response.headers[REQUEST_ID_HEADER] = outcome.request_id
    if isinstance(exc, (UpstreamTimeout, UpstreamUnavailable)) and retries_spent(outcome):
        # No answer after the proxy's own retries: the SDK's would multiply them.
        response.headers[SHOULD_RETRY_HEADER] = "false"
    return response


async def _settle(request: web.Request, svc: Services, outcome: Outcome,
                  relayed: web.StreamResponse | None) -> None:
    """Settle the request, then tell the client what it cost: the answer's headers are not
    out yet (a JSON answer) or its stream's end is not (aiohttp ends it after the handler
    returns), so the figures are the ledger row's own."""
    done = outcome.finish()
    done.observers.finished(done)
    ending = relayed.get(ENDING) if relayed is not None else None
    booked: asyncio.Future[None] | None = None
    if ending is not None and ending.holding:
        booked = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(settle(done, svc, None if booked is None else resolves(booked)))
    svc.settling.tasks.add(task)
    task.add_done_callback(svc.settling.finished)
    # If we are cancelled while waiting, the settle task runs on; shutdown waits for it.
    with contextlib.suppress(asyncio.CancelledError):
        config = (outcome.runtime or svc.runtime.current).config
        if ending is not None and booked is not None:
            # The stream's final event, once its row is spooled (or settle is over without
            # one), not after the store's charge: a slow store does not hold the client.
            await asyncio.wait((task, booked), return_when=asyncio.FIRST_COMPLETED)
            with contextlib.suppress(ConnectionError, TimeoutError):
                async with asyncio.timeout(config.server.client_write_timeout_s):
                    await ending.release()
        record = await asyncio.shield(task)
        if relayed is not None and record is not None and not client_gone(request):
            await tell_cost(relayed, caching.told(record), config.cost_headers,
                            config.server.client_write_timeout_s)


async def admit(request: web.Request, svc: Services, shape: type[Translator],
                outcome: Outcome) -> RequestContext:
    """Authenticate, read, parse and route: what the rest of the request runs on.

    The key is checked from the headers before anything of the body is read: a client
    without a valid key never makes the proxy read, parse or inflate a body."""
    runtime = svc.runtime.current
    outcome.configured(runtime)  # the version this request runs under, start to end
    principal = runtime.users.authenticate(request)
    outcome.authenticated(principal)
    raw = await _read(request, runtime.config.server.max_body_mb)
    outcome.observers.sent(raw)
    parsed = await _parse(request, raw)
    outcome.read(parsed)
    outcome.tagged(_tags(request, runtime, svc.metrics, principal,
                         parsed.body if shape.upstream_api == "openai" else None))
    if parsed.stream and not shape.streams:
        raise InvalidRequest(f"{shape.path} does not support streaming", param="stream")
    route = runtime.router.resolve(parsed.model)
    if route is None:
        raise NotFound(
            f"The model `{parsed.model}` is not routed to any upstream by this proxy.",
            param="model", code="model_not_found",
        )
    if route.upstream.api != shape.upstream_api:
        raise InvalidRequest(
            f"The model `{parsed.model}` is served by an upstream of another API "
            f"({route.upstream.api}); this route is for {shape.upstream_api} models.",
            param="model",
        )
    ctx = RequestContext(outcome.request_id, shape.operation, runtime, principal, parsed, route)
    outcome.admitted(ctx)
    return ctx


def _tags(request: web.Request, runtime: Runtime, metrics: Metrics, principal: Principal,
          body: dict[str, object] | None) -> Tags:
    """The request's tags: the header's over an OpenAI body's `metadata` (which goes upstream
    untouched) over the caller's defaults (proxy.config.callers), key by key. What the rules
    drop is counted, never refused."""
    rules, defaults = runtime.tags, runtime.callers.of(principal.user, principal.key_id).tags
    if not rules.enabled:
        return defaults
    header = rules.header(request.headers.get(TAGS_HEADER))
    meta = rules.metadata(body) if body is not None else None
    tags = defaults if meta is None else meta.tags.over(defaults)
    for read in (header, meta):
        if read is not None and read.dropped:
            metrics.tags_dropped(read.dropped)
    return header.tags.over(tags)


async def _read(request: web.Request, max_body_mb: float) -> bytes:
    """The body as sent, at most server.max_body_mb of it.

    A compressed body is refused (415), never inflated: no SDK of either API compresses its
    requests, it would only spare the hop from the client to the proxy, and inflating is where
    a 1 MB request becomes a gigabyte (the listener turns aiohttp's own inflation off, too)."""
    for value in request.headers.getall(hdrs.CONTENT_ENCODING, ()):
        if any(c.strip().lower() not in ("", "identity") for c in value.split(",")):
            raise UnsupportedContentEncoding(
                "Compressed request bodies are not accepted; send the body without "
                "Content-Encoding.", headers={hdrs.ACCEPT_ENCODING: "identity"},
            )
    length = request.content_length
    if length is not None and length > request.client_max_size:
        raise _too_large(max_body_mb)  # known from the headers: nothing of it is read
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise _too_large(max_body_mb) from None
    except RuntimeError as exc:
        # aiohttp's payload says "Connection closed." when the connection closed under the
        # read (the listener cut a body past its deadline, a client hung up): not the proxy's
        # failure, and the handler may see it before (or instead of) its cancellation.
        raise ConnectionResetError(str(exc)) from None


def _too_large(max_body_mb: float) -> RequestTooLarge:
    # Made when it is raised: an error object per request that fits was a microsecond each.
    return RequestTooLarge(
        f"The request body is larger than the proxy accepts ({max_body_mb:g} MB, "
        "server.max_body_mb)."
    )


async def _parse(request: web.Request, raw: bytes) -> ParsedRequest:
    if len(raw) <= PARSE_ON_LOOP_BYTES:
        return parse_body(raw)
    slots = request.app[BODY_PARSERS]
    await slots.acquire()
    job = asyncio.ensure_future(asyncio.to_thread(parse_body, raw))

    def done(job: asyncio.Future[ParsedRequest]) -> None:
        # The slot is held until the thread ends, also when the request is cancelled while it
        # runs (a thread cannot be stopped): the bound is on threads, not on waiting requests.
        slots.release()
        if not job.cancelled():
            job.exception()  # retrieved: a cancelled request's parse error is not logged

    job.add_done_callback(done)
    return await asyncio.shield(job)


@dataclass(frozen=True, slots=True)
class _Turn:
    """One candidate's turn: its route and model, the API shape's translator for it, the
    model it stands in for (a fallback's), and whether its failure is the request's."""

    candidate: attempts.Candidate
    translator: Translator
    fallback_from: str | None
    last: bool


async def forward(request: web.Request, ctx: RequestContext, svc: Services,
                  shape: type[Translator], outcome: Outcome) -> Attempt:
    """Try the candidates in order; the first answer worth relaying is returned (the last
    candidate's answer, or its failure, always is)."""
    plan = attempts.candidates(ctx.runtime.router, ctx.route, ctx.request_model, svc.latency)
    reason = ErrorClass.NONE
    for index, cand in enumerate(plan):
        fallback_from = None
        if index:
            fallback_from = ctx.request_model
            svc.metrics.fell_back(plan[index - 1].route.pattern, cand.model, reason)
        elif cand.model != ctx.request_model:  # the primary is slow: its fallback goes first
            fallback_from = ctx.request_model
            svc.metrics.fell_back(ctx.route.pattern, cand.model, cand.reason)
        upstream = cand.route.upstream
        translator = shape(ctx.request, upstream.stream_usage, cand.model,
                           write_all_caps=upstream.write_all_caps)
        turn = _Turn(cand, translator, fallback_from, last=index == len(plan) - 1)
        result = await _try(request, ctx, svc, outcome, turn)
        if isinstance(result, Attempt):
            return result
        reason = result.reason
    raise AssertionError("the last candidate answers or raises")


async def _try(request: web.Request, ctx: RequestContext, svc: Services, outcome: Outcome,
               turn: _Turn) -> Attempt | Failed:
    """One candidate: reserve its budget, then call its upstream (with retries). Returns the
    attempt to relay, or, when it failed in a way the next candidate may do better with, the
    failure's class (its reservation is then given back whole)."""
    cand = turn.candidate
    reservation = await _reserve(ctx, svc, turn)
    candidacy = Candidacy(cand.route, cand.model, turn.translator, reservation)
    outcome.candidate(candidacy, turn.fallback_from)
    try:
        answer, deadline = await _call(request, ctx, svc, outcome, candidacy)
    except (UpstreamTimeout, UpstreamUnavailable) as exc:
        if turn.last:
            raise
        failure = exc.error_class
    else:
        up, failure = answer.response, answer.error_class
        if turn.last or up.status == 200 or not upstream_errors.fallback_worthy(failure):
            outcome.answered(up.status, failure,
                             turn.translator.upstream_request_id(up.headers))
            return Attempt(candidacy, up, deadline,
                           _response_headers(candidacy, turn.fallback_from, svc)
                           | caching.headers(outcome))
        up.close()
        outcome.observers.attempt_ended(failure)
    log.warning("request %s: model %s failed (%s), trying its next fallback",
                ctx.request_id, cand.model, failure)
    outcome.released()
    await svc.budget.release(reservation)
    return Failed(failure)


async def _reserve(ctx: RequestContext, svc: Services, turn: _Turn) -> Reservation:
    """Admission of one candidate: its plan, what its request asks for, and the budget's
    grant of it (a 429 when the budget refuses it)."""
    cand, translator, policy = turn.candidate, turn.translator, ctx.runtime.config
    plan = svc.budget.plan(ctx.principal, cand.model, policy)
    # Checks the client's output limits too (a 400) before anything is counted or reserved.
    asked = translator.max_output(plan.output_cap)
    prompt = await counting.prompt_tokens(translator) if plan.needs_prompt_estimate else 0
    configured = cand.route.hidden_output
    # What no list names is learned per (upstream, model) under `estimate`, unless the route
    # says (proxy.budget.estimate).
    learned = (learned_key(policy.store.prefix, cand.route.upstream.name, cand.model)
               if ctx.stream and configured is None and ctx.principal.admission.estimates
               else None)
    ask = Ask(principal=ctx.principal, model=cand.model, plan=plan, prompt_tokens=prompt,
              asked_output=asked, choices=translator.choices(), stream=ctx.stream,
              hidden_output=hides_output(cand.model, ctx.request.body, configured),
              learned_key=learned)
    try:
        return await svc.budget.reserve(ask, policy)
    except Refused as exc:
        raise refusals.render(exc.refusal, svc.budget.clock(), policy.timezone) from None


async def _call(request: web.Request, ctx: RequestContext, svc: Services, outcome: Outcome,
                candidacy: Candidacy) -> tuple[attempts.Answer, float | None]:
    """Send the candidate its body, built once with the output cap its reservation was
    granted, with retries: its answer and the deadline of the whole answer (loop time; None
    for a stream, whose idle time is watched instead). Raises `UpstreamTimeout` and
    `UpstreamUnavailable` when no answer came."""
    upstream, translator = candidacy.route.upstream, candidacy.translator
    body = translator.upstream_body(candidacy.reservation.upstream_cap)
    outcome.observers.forwarded(candidacy, body)
    headers = upstream_request_headers(
        request.headers, upstream,
        client_key=client_key(request) if ctx.principal.forward_client_key else None,
    )

    def on_retry(u: Upstream, reason: ErrorClass) -> None:
        outcome.retried()
        svc.metrics.retried(u.name, reason)

    outcome.meter.mark_upstream_start()
    deadline = None if ctx.stream else asyncio.get_running_loop().time() + upstream.total_timeout_s
    try:
        with map_upstream_exceptions(upstream, Phase.TOTAL):
            async with asyncio.timeout_at(deadline):
                answer = await attempts.call_upstream(
                    svc.http.session, upstream, attempts.Call(translator.path, body, headers),
                    attempts.Retrying(on_retry, svc.rng, outcome.sent,
                                      outcome.observers if outcome.observers else None),
                )
    except (UpstreamTimeout, UpstreamUnavailable) as exc:
        outcome.call_failed()
        outcome.observers.attempt_ended(exc.error_class)
        raise
    return answer, deadline


def _response_headers(candidacy: Candidacy, fallback_from: str | None,
                      svc: Services) -> dict[str, str]:
    # Model names are the client's text: they go into a header only if they are plain
    # printable ASCII, never as a way to inject a header line.
    headers: dict[str, str] = {}
    if _header_safe(candidacy.model):
        headers["x-tokenmeter-model"] = candidacy.model
    if fallback_from is not None and _header_safe(fallback_from):
        headers["x-tokenmeter-fallback-from"] = fallback_from
    reservation = candidacy.reservation
    if reservation.clamped:
        # The output cap the client's body allowed (under the proxy's caps, all choices) and
        # the one sent upstream; and the window that left the least room (with its scope when
        # it is not the user's own: a key's, a model group's, the team's).
        headers["x-tokenmeter-output-clamped"] = (
            f"{reservation.grant.clamped_from}->{reservation.upstream_cap}"
        )
        window = reservation.grant.binding
        if window is not None:
            reason = window.name.value
            if window.scope.kind is not ScopeKind.USER and _header_safe(window.scope.part):
                reason += f"; scope={window.scope.part}"
            headers["x-tokenmeter-clamp-reason"] = reason
    if reservation.stored:  # admitted during a store outage: the counts are unknown
        headers.update(refusals.rate_limit_headers(reservation.plan.windows, reservation.used,
                                                   svc.budget.clock()))
    return headers


def _header_safe(value: str) -> bool:
    return value.isascii() and value.isprintable()
