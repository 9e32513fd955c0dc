"""The response cache's steps in a request's path (docs/cache.md), between admission and the
budget's reservation:

    admit -> consult: a hit is admitted by the budget and replayed here (no upstream call)
    -> forward ... -> finish: a miss's answer, if whole and successful, becomes an entry

A hit is an answer to the request as asked, so it must fit what that request would have been
allowed: an entry longer than the request's own output cap is not a hit for it, and a hit is
admitted through the budget's own checks (its rate and concurrency limits; under `cache.
charge_hits: full` the charge it stands for, refused with the 429 the request would get when it
does not fit). The entry's answer is replayed in the form the client asked for."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, MutableMapping

from aiohttp import hdrs, web

from proxy.budget import admission as adm
from proxy.budget import limits as lim
from proxy.budget import refusals
from proxy.budget.accounting import Reservation
from proxy.budget.refusals import Refused
from proxy.cache.cache import (
    HIT_HEADER,
    REASON_HEADER,
    CacheQuery,
    Decision,
    Fill,
    Finished,
    ResponseCache,
)
from proxy.config.cache import CacheConfig, ChargeHits
from proxy.cost import CostLines
from proxy.errors import ErrorClass
from proxy.pipeline.context import Outcome, RequestContext, RequestObserver, Settlement
from proxy.pipeline.relay import REQUEST_ID_HEADER
from proxy.pipeline.services import Services, Settling
from proxy.protocol.translators import Translator
from proxy.protocol.usage import ZERO
from proxy.record import BypassReason, CacheResult, RequestRecord


async def consult(request: web.Request, ctx: RequestContext, svc: Services, outcome: Outcome,
                  shape: type[Translator]) -> web.StreamResponse | None:
    """The hit's answer, or None: the request goes upstream (a miss's fill kept in
    `outcome.cache` for the relay)."""
    cache = svc.cache
    if cache is None or not ctx.runtime.config.cache.maybe_enabled:
        return None  # the cache off costs a request this test
    upstream = ctx.route.upstream
    ask = CacheQuery(ctx.operation, ctx.request_model, f"{upstream.name} {upstream.base_url}",
              ctx.request.body, ctx.principal,
              request.headers.get(hdrs.CACHE_CONTROL, ""), len(ctx.request.raw),
              _own_cap(ctx, svc, shape), upstream.first_byte_timeout_s)
    decision = await cache.consult(ctx.runtime.config.cache, ask)
    if decision.entry is None:
        _decided(outcome, decision, ctx, svc)
        return None
    reservation = await _admit(ctx, svc, decision)
    outcome.cache_decided(decision.served())
    outcome.served_from_cache(reservation)
    body = await cache.replay(decision, ctx.request.body, stream=ctx.stream)
    if body is None:  # its entry holds no answer (counted): a miss, which goes upstream
        outcome.not_served_from_cache()
        _decided(outcome, decision.missed(), ctx, svc)
        await svc.budget.release(reservation)
        return None
    return await _replay(request, ctx, decision, body, outcome)


def _plan(ctx: RequestContext, svc: Services) -> lim.Plan:
    """The request's budget plan, as admission makes it (a 429 for a cost window the model
    has no price for)."""
    policy = ctx.runtime.config
    try:
        return svc.budget.plan(ctx.principal, ctx.request_model, policy)
    except Refused as exc:
        raise refusals.render(exc.refusal, svc.budget.clock(), policy.timezone) from None


def _own_cap(ctx: RequestContext, svc: Services, shape: type[Translator]) -> Callable[[], int]:
    """The most output tokens the request may be answered with (its body's cap under its
    plan's; 0: unbounded), as admission reads it, worked out only when an entry is found."""
    def cap() -> int:
        return shape(ctx.request).max_output(_plan(ctx, svc).output_cap)
    return cap


async def _admit(ctx: RequestContext, svc: Services, hit: Decision) -> Reservation:
    """A hit admitted like the request it stands for: its in-flight sets and request-rate
    windows, holding 0 tokens under `charge_hits: none`, and under `full` the usage and cost
    it will be charged, all or nothing (a 429 in the API's shape when it does not fit: a hit
    is never clamped, its answer being whole)."""
    assert hit.entry is not None
    policy = ctx.runtime.config
    plan = _plan(ctx, svc)
    full = policy.cache.charge_hits is ChargeHits.FULL
    usage = hit.entry.usage if full else ZERO
    cost = CostLines.of(plan.price, usage).nanousd if full and plan.price is not None else 0
    ask = adm.Ask(principal=ctx.principal, model=ctx.request_model, plan=plan,
                  prompt_tokens=usage.input_tokens, asked_output=usage.output_tokens,
                  choices=1, stream=ctx.stream, hidden_output=False)
    try:
        return await svc.budget.reserve_hit(ask, usage, cost, policy)
    except Refused as exc:
        raise refusals.render(exc.refusal, svc.budget.clock(), policy.timezone) from None


def told(record: RequestRecord) -> RequestRecord:
    """The figures a request's answer tells (`relay.tell_cost`): a hit charged in full
    (`charge_hits: full`: its row names the windows charged) tells what it was charged, its
    saved usage and cost; any other request, its row's own (a hit charged nothing: 0)."""
    if record.cache == CacheResult.HIT.value and record.windows:
        return dataclasses.replace(record, usage=record.saved_usage, cost=record.saved_cost)
    return record


def headers(outcome: Outcome) -> dict[str, str]:
    """The headers a miss's (or a bypass's: with its reason) answer carries."""
    return outcome.cache.headers()


async def _replay(request: web.Request, ctx: RequestContext, decision: Decision, body: bytes,
                  outcome: Outcome) -> web.StreamResponse:
    sent = {HIT_HEADER: "hit", hdrs.AGE: str(int(decision.age_s or 0)),
            REQUEST_ID_HEADER: outcome.request_id}
    if not ctx.stream:
        outcome.observers.answered(200, body, sent)
        outcome.meter.content(time.perf_counter())
        return web.Response(body=body, headers=sent, content_type="application/json")
    resp = web.StreamResponse(status=200, headers={
        **sent, hdrs.CONTENT_TYPE: "text/event-stream; charset=utf-8",
        hdrs.CACHE_CONTROL: "no-cache"})
    await resp.prepare(request)
    outcome.meter.content(time.perf_counter())
    outcome.observers.streamed(body, 0.0)
    await resp.write(body)
    return resp


def _decided(outcome: Outcome, decision: Decision, ctx: RequestContext,
             svc: Services) -> None:
    """A miss (or a bypass): its result for the record, and its fill, if it has one, among
    the request's observers."""
    outcome.cache_decided(decision)
    outcome.observe(outcome.observers.adding(_filling(decision, ctx, svc)))


def _filling(decision: Decision, ctx: RequestContext, svc: Services) -> FillObserver | None:
    """The fill's factory: an observer of a miss whose answer the cache stores, else None."""
    cache = svc.cache
    if decision.fill is None or cache is None:
        return None
    return FillObserver(decision.fill, cache, ctx.runtime.config.cache, svc.settling)


class FillObserver(RequestObserver):
    """A miss's answer kept for its entry as it passes (the upstream's stream as it came, or
    its JSON body), bounded by the fill itself; when the request is over, the entry is made
    off the loop and stored in a task of its own (its flight ends), tracked with the settle
    tasks so shutdown waits for it."""

    __slots__ = ("_cache", "_config", "_fill", "_settling")

    def __init__(self, fill: Fill, cache: ResponseCache, config: CacheConfig,
                 settling: Settling) -> None:
        self._fill, self._cache, self._config = fill, cache, config
        self._settling = settling

    def answered(self, status: int, body: bytes, headers: MutableMapping[str, str]) -> None:
        if status == 200:
            self._fill.take(body)
        if self._fill.too_large:  # known before the headers go out: said beside `miss`
            headers[REASON_HEADER] = BypassReason.TOO_LARGE.value

    def received(self, chunk: bytes) -> None:
        self._fill.take(chunk)

    def relayed(self) -> None:
        self._fill.relayed()

    def finished(self, done: Settlement) -> None:
        task = asyncio.ensure_future(
            self._cache.complete(self._fill, self._config, _finished(done)))
        self._settling.tasks.add(task)
        task.add_done_callback(self._settling.finished)


def _finished(done: Settlement) -> Finished | None:
    """What a whole, successful answer of the model asked for left to store, else None: an
    error, a cut stream, a client that left, a fallback's answer, or an answer whose usage
    the upstream did not report (what a hit saves must be what the model used)."""
    cand = done.candidacy
    if (cand is None or done.status != 200 or done.error_class is not ErrorClass.NONE
            or done.fallback_from is not None or cand.translator.counts_usage()):
        return None
    return Finished(cand.translator.usage(), _capped_ok(done))


def _capped_ok(done: Settlement) -> bool:
    """Whether an answer ended by its output cap may be stored: only when the cap sent is the
    client's own (not clamped by a budget, not the proxy's default or top-up cap)."""
    assert done.candidacy is not None
    reservation = done.candidacy.reservation
    if reservation.clamped or reservation.topup_cap is not None:
        return False
    translator = done.candidacy.translator
    asked = translator.codec.asked_caps(translator.request.body)
    return bool(asked) and (reservation.upstream_cap is None
                            or reservation.upstream_cap in asked)
