"""The response cache's steps in a request's path (docs/cache.md), between admission and the
budget's reservation:

    admit -> consult: a hit is replayed here (no reservation, no upstream call) -> forward ...
    ... -> finish: a miss's answer, if whole and successful, becomes an entry

A hit still needs a valid key (admission authenticated it); it is not refused by a budget or
a rate limit, since it costs the upstream nothing (`cache.charge_hits` decides what settle
charges it). The entry's answer is replayed in the form the client asked for."""

from __future__ import annotations

import asyncio
import time

from aiohttp import hdrs, web

from proxy.cache.cache import HIT_HEADER, Ask, Decision, Finished
from proxy.errors import ErrorClass
from proxy.pipeline.context import Outcome, RequestContext, Settlement
from proxy.pipeline.relay import REQUEST_ID_HEADER
from proxy.pipeline.services import Services

_CAP_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


async def consult(request: web.Request, ctx: RequestContext, svc: Services,
                  outcome: Outcome) -> web.StreamResponse | None:
    """The hit's answer, or None: the request goes upstream (a miss's fill kept in
    `outcome.cache` for the relay)."""
    cache = svc.cache
    if cache is None or not ctx.runtime.config.cache.maybe_enabled:
        return None  # the cache off costs a request this test
    ask = Ask(ctx.operation, ctx.request_model, ctx.request.body, ctx.principal,
              request.headers.get(hdrs.CACHE_CONTROL, ""), len(ctx.request.raw))
    decision = await cache.consult(ctx.runtime.config.cache, ask)
    outcome.cache_decided(decision)
    if decision.entry is None:
        return None
    outcome.served_from_cache()
    return await _replay(request, ctx, decision, outcome)


def headers(outcome: Outcome) -> dict[str, str]:
    """The header a miss's (or a bypass's) answer carries."""
    value = outcome.cache.header
    return {HIT_HEADER: value} if value is not None else {}


async def _replay(request: web.Request, ctx: RequestContext, decision: Decision,
                  outcome: Outcome) -> web.StreamResponse:
    entry = decision.entry
    assert entry is not None
    sent = {HIT_HEADER: "hit", hdrs.AGE: str(int(decision.age_s or 0)),
            REQUEST_ID_HEADER: outcome.request_id}
    body = decision.body
    if outcome.collector is not None:  # capture keeps the answer the client got, as for a miss
        if ctx.stream:
            outcome.collector.streamed(body, 0.0)
        else:
            outcome.collector.answered(body)
    if not ctx.stream:
        outcome.meter.content(time.perf_counter())
        return web.Response(body=body, headers=sent, content_type="application/json")
    resp = web.StreamResponse(status=200, headers={
        **sent, hdrs.CONTENT_TYPE: "text/event-stream; charset=utf-8",
        hdrs.CACHE_CONTROL: "no-cache"})
    await resp.prepare(request)
    outcome.meter.content(time.perf_counter())
    await resp.write(body)
    return resp


def finish(done: Settlement, outcome: Outcome, svc: Services) -> None:
    """A miss's fill is completed in a task of its own (its entry is made off the loop and
    stored; its flight ends), tracked with the settle tasks so shutdown waits for it."""
    fill = outcome.cache_fill
    if fill is None or svc.cache is None or done.runtime is None:
        return
    task = asyncio.ensure_future(
        svc.cache.complete(fill, done.runtime.config.cache, _finished(done)))
    svc.settling.tasks.add(task)
    task.add_done_callback(svc.settling.finished)


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
    body = done.candidacy.translator.request.body
    asked = [body[f] for f in _CAP_FIELDS if f in body]
    return bool(asked) and (reservation.upstream_cap is None
                            or reservation.upstream_cap in asked)
