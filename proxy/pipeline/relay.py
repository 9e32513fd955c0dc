"""The relay step of a request: its upstream's answer goes to the client, metered on the way.

Streaming responses are relayed chunk by chunk: each chunk is written to the client before the
proxy looks at it, and the SSE decoder and translator read it on the side (`tap`). A JSON answer
is read whole and returned. What the relay learns (a failure, a client that left) is recorded
in the request's `Outcome`; settling is the pipeline's (`proxy.pipeline.handler`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Protocol

from aiohttp import web
from multidict import CIMultiDict

from proxy.budget.refusals import QuotaEnded
from proxy.config.load import CostHeaders
from proxy.errors import (
    ErrorClass,
    ProxyError,
    UpstreamIncomplete,
    UpstreamTimeout,
    UpstreamUnavailable,
    stream_error_event,
)
from proxy.pipeline.context import Attempt, Observers, Outcome
from proxy.pipeline.ending import ENDING, EndHeld, Writer
from proxy.pipeline.services import Services
from proxy.pipeline.topup import StoreFailed, TopUps
from proxy.pipeline.watchdog import Watch
from proxy.protocol import upstream_errors
from proxy.protocol.tap import StreamTap
from proxy.protocol.translators import Translator
from proxy.record import RequestRecord
from proxy.routing.exceptions_map import Phase, map_upstream_exceptions
from proxy.routing.upstream import client_response_headers
from proxy.telemetry.families import MeteringStage

REQUEST_ID_HEADER = "x-tokenmeter-request-id"
# The OpenAI and Anthropic SDKs retry a 408, 409, 429 or 5xx unless this says "false".
SHOULD_RETRY_HEADER = "x-should-retry"

log = logging.getLogger("tokenmeter.relay")


async def relay(request: web.Request, attempt: Attempt, svc: Services,
                outcome: Outcome) -> web.StreamResponse:
    up, upstream = attempt.response, attempt.route.upstream
    try:
        with svc.metrics.relaying(upstream.name):
            if up.status == 200 and up.content_type == "text/event-stream":
                runtime = outcome.runtime or svc.runtime.current
                write_timeout = runtime.config.server.client_write_timeout_s
                with svc.watchdog.watch(
                    up.close, upstream.idle_timeout_s, write_timeout=write_timeout,
                    abort_client=lambda: _client_timed_out(request, outcome, write_timeout),
                ) as watch:
                    return await _relay_stream(request, attempt, svc, outcome, watch)
            return await _relay_body(attempt, outcome)
    finally:
        # release(): a response read to its end returns its connection to the pool; one cut
        # short (client gone, error) has its connection closed, which ends the upstream request.
        up.release()


def client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def _client_timed_out(request: web.Request, outcome: Outcome,
                      write_timeout: float | None) -> None:
    """The watchdog's verdict on a client that stopped reading: its connection is ended (the
    relay's write then fails, and the upstream response is closed with it)."""
    log.warning("request %s: the client read nothing for %g s (client_write_timeout_s); "
                "its stream is ended", outcome.request_id, write_timeout or 0)
    outcome.fail(ErrorClass.CLIENT_TIMEOUT)
    _abort(request)


async def _relay_body(attempt: Attempt, outcome: Outcome) -> web.StreamResponse:
    # A JSON answer is useless to a client until complete, so reading it whole costs nothing.
    # Its time counts against the request's total cap; an error body of a stream request gets
    # the idle timeout.
    up, upstream = attempt.response, attempt.route.upstream
    deadline = attempt.deadline
    if deadline is None:
        deadline = asyncio.get_running_loop().time() + upstream.idle_timeout_s
    with map_upstream_exceptions(
        upstream, Phase.IDLE if attempt.deadline is None else Phase.TOTAL
    ):
        async with asyncio.timeout_at(deadline):
            body = await up.read()
    if up.status < 300:  # an error's class was decided as it came (attempts.answer_class)
        attempt.translator.on_body(body)
    elif outcome.runtime is not None:  # an error may echo the key it was sent: not relayed
        body = upstream_errors.scrub(body, outcome.runtime.router.key_forms)
    headers = _client_headers(attempt, outcome.request_id)
    outcome.observers.answered(up.status, body, headers)
    if up.status >= 400 and (
        retries_spent(outcome) or upstream_errors.blames_request(up.status, outcome.error_class)
    ):
        headers[SHOULD_RETRY_HEADER] = "false"
    return web.Response(status=up.status, body=body, headers=headers)


def retries_spent(outcome: Outcome) -> bool:
    """The proxy made more than one upstream call for this request (retries, fallbacks): its
    failing answer is final. An SDK's retries of it would each repeat all of the proxy's
    (3 attempts times 3 SDK tries: 9 upstream calls, 3 rows, for one call), so the answer says
    `x-should-retry: false`. An answer after a single call (retries off, a status the proxy
    does not retry, a Retry-After past its deadline) is left to the SDK's own judgement."""
    return outcome.attempts > 1


async def _relay_stream(
    request: web.Request, attempt: Attempt, svc: Services, outcome: Outcome, watch: Watch,
) -> web.StreamResponse:
    up, translator = attempt.response, attempt.translator
    resp = web.StreamResponse(status=up.status,
                              headers=_client_headers(attempt, outcome.request_id))
    if not await _prepared(request, resp, outcome):
        return resp
    stream = Stream(_writer(resp, translator, svc, outcome), watch,
                    _tap(translator, svc, outcome), translator, outcome, lambda: _abort(request))
    # Under `admission: estimate`: the reservation grows as the stream runs (topup); between
    # its checks the loop pays one comparison per chunk. A read that fails (or is cut by the
    # watchdog: `silent`) becomes the proxy's error; a write to a client that left does not.
    topups = TopUps.for_stream(svc.budget, attempt.candidacy.reservation, translator,
                               (outcome.runtime or svc.runtime.current).config)
    try:
        with map_upstream_exceptions(attempt.route.upstream, Phase.STREAM,
                                     silent=lambda: watch.expired):
            chunks = _chunks(up.content.iter_any(), outcome.observers)
            await (stream.pump(chunks) if topups is None else stream.pump_checked(chunks, topups))
            if watch.expired:  # the watchdog closed a silent upstream: not a clean end
                raise TimeoutError
        await stream.finish()
    except (ConnectionResetError, BrokenPipeError):
        # aiohttp raises these (ClientConnectionResetError among them) from write() when the
        # client went away, or was cut off for not reading.
        outcome.client_left()
        stream.tap.close()
    except (UpstreamTimeout, UpstreamUnavailable, QuotaEnded, StoreFailed) as failure:
        _log_end(outcome.request_id, failure)
        await stream.fail(failure)
    except Exception:
        # Headers are out: no error response is possible any more, only an error event.
        log.exception("relaying stream %s failed", outcome.request_id)
        await stream.fail(ProxyError(
            "The proxy failed while relaying this stream; it is incomplete.", code="internal"))
    finally:
        if topups is not None:
            await topups.close()
    return resp


async def _prepared(request: web.Request, resp: web.StreamResponse, outcome: Outcome) -> bool:
    """The stream's headers sent; False: the client hung up as the upstream's answer came
    (its socket is closing, and the handler's cancellation is on its way). Nothing reached
    it."""
    try:
        await resp.prepare(request)
    except (ConnectionError, RuntimeError):
        if not client_gone(request):
            raise
        outcome.fail(ErrorClass.CLIENT_DISCONNECT, 499)
        return False
    return True


def _tap(translator: Translator, svc: Services, outcome: Outcome) -> StreamTap:
    return StreamTap(translator, outcome.meter,
                     on_error=svc.metrics.metering_failure_counter(MeteringStage.STREAM))


def _writer(resp: web.StreamResponse, translator: Translator, svc: Services,
            outcome: Outcome) -> Writer:
    # Observers of the bytes written to the client get them, with their times. The wrapper
    # is there only then; the hot path of a stream nobody observes is untouched.
    observers = outcome.observers
    writer: Writer = resp if not observers.streaming else Observed(
        resp, observers.stream_writer(), outcome.meter.upstream_start or time.perf_counter())
    if svc.ledger is not None:  # the final event waits for the row (proxy.pipeline.ending)
        writer = resp[ENDING] = EndHeld(writer, translator.final_events)
    return writer


def _chunks(chunks: AsyncIterable[bytes], observers: Observers) -> AsyncIterable[bytes]:
    """The upstream's chunks, through the observers that read them (e.g. a miss the response
    cache stores), when there are some."""
    return _observed(chunks, observers) if observers.receiving else chunks


async def _observed(chunks: AsyncIterable[bytes], observers: Observers
                    ) -> AsyncIterator[bytes]:
    received, relayed = observers.received, observers.relayed
    async for chunk in chunks:
        received(chunk)
        yield chunk
        relayed()


def _log_end(request_id: str, failure: ProxyError) -> None:
    if isinstance(failure, QuotaEnded):
        # Its quota could not be topped up: the upstream response is closed (by `relay`'s
        # release of a response not read to its end) and the client told why.
        log.info("request %s: stream ended by its quota (%s)", request_id, failure.limit)
    elif isinstance(failure, StoreFailed):
        # The same end, for a top-up the store did not answer under `fail_closed`.
        log.warning("request %s: stream ended: its top-up failed on the budget store and the "
                    "proxy fails closed", request_id)


@dataclass(frozen=True, slots=True)
class Observed:
    """A client's writer whose bytes its observers also get: each write, with its time in
    milliseconds after the upstream request was sent (a capture's replay keeps the stream's
    pacing)."""

    resp: Writer
    streamed: Callable[[bytes, float], None]  # `Observers.stream_writer`
    since: float  # perf_counter() when the upstream request was sent

    def write(self, data: bytes) -> Awaitable[None]:
        # The client's write itself, not a coroutine around it: no frame more per chunk.
        self.streamed(data, (time.perf_counter() - self.since) * 1000)
        return self.resp.write(data)


class Checks(Protocol):
    """What the relay asks of a stream's top-ups (`proxy.pipeline.topup.TopUps`)."""

    @property
    def next_at(self) -> int: ...

    def tokens(self) -> int: ...

    async def check(self, events: int, arrived: int, before: int,
                    at_boundary: bool) -> None: ...


@dataclass(frozen=True, slots=True)
class Stream:
    """A stream on its way to the client: written to `resp` under `watch`, read on the side
    by the tap and its translator, its failures recorded in `outcome`; `abort` ends the
    client's connection without the final chunk (a broken stream, not a clean end)."""

    resp: Writer
    watch: Watch
    tap: StreamTap
    translator: Translator
    outcome: Outcome
    abort: Callable[[], None]

    async def write(self, data: bytes, now: float) -> None:
        # `writing`: a client that reads slowly makes write() wait, and the upstream is not
        # read meanwhile; that wait is not the upstream's silence (watchdog).
        watch = self.watch
        watch.writing = now
        await self.resp.write(data)
        watch.writing = 0.0

    async def pump(self, chunks: AsyncIterable[bytes]) -> None:
        """Each chunk forwarded as it comes, then looked at: every stream without top-ups.
        The hot path, written out: no call per chunk but the tap's and the write."""
        tap, watch, resp = self.tap, self.watch, self.resp
        feed, look = tap.feed, tap.look
        perf = time.perf_counter
        async for chunk in chunks:
            now = watch.last = perf()
            out = feed(chunk, now)  # nearly always `chunk` itself, not parsed yet
            if out:
                watch.writing = now  # as in `write`
                await resp.write(out)
                watch.writing = 0.0
            look()  # forward first, look second

    async def pump_checked(self, chunks: AsyncIterable[bytes], topups: Checks) -> None:
        """A stream under top-ups, checked by the bytes arrived (proxy.budget.topups): a chunk
        that cannot reach the next check goes as in `pump`, at the cost of one comparison. One
        that may is cut by the tap where its events end, and the piece that reaches the check
        is metered before it is forwarded, then checked (with the tap's word on whether the
        bytes forwarded end between two events once it is), so a piece that would pass what
        the stream holds is topped up before it goes out, or goes out as the last. Pieces
        before it go as in `pump`."""
        tap, watch = self.tap, self.watch
        feed, look = tap.feed, tap.look
        perf = time.perf_counter
        arrived = 0  # bytes of the upstream's stream so far
        async for chunk in chunks:
            if arrived + len(chunk) < topups.next_at:
                arrived += len(chunk)
                now = watch.last = perf()
                out = feed(chunk, now)
                if out:
                    await self.write(out, now)
                look()
                continue
            for piece in tap.pieces(chunk, 1):
                arrived += len(piece)
                now = watch.last = perf()
                if arrived < topups.next_at:
                    out = feed(piece, now)
                    if out:
                        await self.write(out, now)
                    look()
                else:
                    await self._checked(piece, arrived, now, topups)

    async def _checked(self, piece: bytes, arrived: int, now: float, topups: Checks) -> None:
        """The piece that reaches a check: looked at, checked, then forwarded; when the check
        ends the stream, forwarded first all the same (its tokens were generated, and are
        charged), and the end follows it."""
        tap, meter = self.tap, self.outcome.meter
        events, before = meter.chunks, topups.tokens()
        out = tap.feed(piece, now)
        tap.look()
        try:
            # A piece without content streamed nothing to check (a final usage that counts
            # hidden output comes when nothing more will be generated: the settle has it);
            # the next piece with content is checked.
            if meter.chunks > events:
                await topups.check(meter.chunks, arrived, before, tap.client_at_boundary)
        except (QuotaEnded, StoreFailed):
            if out:
                await self.write(out, now)
            raise
        if out:
            await self.write(out, now)

    async def finish(self) -> None:
        """The upstream's stream ended: what the tap held back is forwarded, unless the
        stream lacks its final event (`[DONE]`, `response.completed`, ...): the upstream gave
        up, as a reset would have, without saying so, and the client is told."""
        tap, translator = self.tap, self.translator
        at_boundary = tap.client_at_boundary
        rest = tap.close()
        if translator.stream_error is not None:  # the upstream's error event ended it
            self.outcome.fail(translator.stream_error)
        if not (tap.broken or translator.end_of_stream()):
            await self.fail(UpstreamIncomplete(
                "The upstream ended the stream without its final event; this response is "
                "incomplete."
            ), at_boundary)
        elif rest:
            await self.write(rest, time.perf_counter())
        # No write_eof here: aiohttp writes the final chunk after the handler returns, which
        # is after settling, so a client that has seen the end of its stream is accounted.

    async def fail(self, failure: ProxyError, at_boundary: bool | None = None) -> None:
        """The stream broke after its headers went out. The client gets a last event in the
        API's error shape, so it can tell a truncated answer from a complete one (the SDKs
        raise on it), then the stream ends. If the break came in the middle of an event whose
        start was already forwarded, no event can follow it cleanly: the connection is cut
        instead, which clients see as a broken stream, just as clear. `at_boundary`: the
        tap's `client_at_boundary` read before it was closed (closing releases what it held,
        which changes the answer); None: read here."""
        self.outcome.fail(failure.error_class)
        if at_boundary is None:
            at_boundary = self.tap.client_at_boundary
        self.tap.close()  # meters a last, unterminated event; its held bytes are not forwarded
        if at_boundary:
            event = stream_error_event(failure, self.translator.named_events,
                                       self.translator.error_shape, self.outcome.request_id)
            with contextlib.suppress(ConnectionError):
                await self.write(event, time.perf_counter())
                return
        self.abort()


def _client_headers(attempt: Attempt, request_id: str) -> CIMultiDict[str]:
    headers = client_response_headers(attempt.response.headers)
    for name, value in attempt.response_headers.items():
        headers[name] = value  # our limits replace the upstream's same-named x-ratelimit-*
    # The ledger row's id: a client (or its support ticket) can find its request in the books.
    headers[REQUEST_ID_HEADER] = request_id
    return headers


async def tell_cost(resp: web.StreamResponse, record: RequestRecord, switch: CostHeaders,
                    write_timeout: float | None) -> None:
    """What the request cost and the tokens it was charged, from its record (the ledger
    row's figures): as headers of a JSON answer not yet sent, or as an SSE comment line after
    a stream's last event (SSE parsers skip comments), before aiohttp ends the stream."""
    figures = cost_figures(record)
    if not resp.prepared:
        if switch.json_answers:
            resp.headers.update({f"x-tokenmeter-{name.replace('_', '-')}": value
                                 for name, value in figures})
        return
    # Only after a clean end: a stream that ended in an error event ends with that event,
    # which is what tells a client its answer is incomplete.
    if switch.streams and record.stream and record.error_class is ErrorClass.NONE:
        line = " ".join(f"{name}={value}" for name, value in figures)
        # A client that stopped reading at the very end is not waited for longer than one
        # that stopped mid-stream. The line goes out with the stream's last chunk, in one
        # write: aiohttp's own end of the response then finds it ended.
        with contextlib.suppress(ConnectionError, TimeoutError):
            async with asyncio.timeout(write_timeout):
                await resp.write_eof(f": tokenmeter {line}\n\n".encode())


def cost_figures(record: RequestRecord) -> tuple[tuple[str, str], ...]:
    """(name, value): `cost_usd` (exact, nine decimals; absent when the model has no price),
    then the tokens charged, the cache's only when there are some."""
    usage = record.usage
    out: list[tuple[str, str]] = []
    if record.cost is not None:
        out.append(("cost_usd", f"{Decimal(record.cost.nanousd).scaleb(-9):f}"))
    out += [("input_tokens", str(usage.input_tokens)),
            ("output_tokens", str(usage.output_tokens))]
    if usage.cached_input_tokens:
        out.append(("cached_input_tokens", str(usage.cached_input_tokens)))
    if usage.cache_creation_input_tokens:
        out.append(("cache_creation_input_tokens", str(usage.cache_creation_input_tokens)))
    return tuple(out)


def _abort(request: web.Request) -> None:
    """End the client's connection without the final chunk: a broken stream, not a clean end."""
    if request.transport is not None:
        request.transport.abort()
