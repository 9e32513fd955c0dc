"""The last step of every request: price it, hand the ledger its row, charge the budget,
record the metrics and the log line.

It runs once per request, as a task the handler starts in its `finally` and shields from its
own cancellation (shutdown waits for it). It never raises: a failure here is a billing hole, so
it is logged at error level and counted. Each fact is made once: the usage (counted in a thread
when the upstream did not report it, the one wait before the row), its cost (`CostLines`, at the
reservation's price when the request has one) and the request's `RequestRecord`, which the
ledger row, the metrics and the access-log line read. The row is handed over before the store
is charged: it is a local append, the charge a round trip that may stall. A request refused for
its key gets no row and no line of its own (see `settle`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from proxy.budget import estimate as est
from proxy.budget.accounting import Reservation
from proxy.budget.refusals import Refused
from proxy.config.cache import ChargeHits
from proxy.config.policy import Price
from proxy.cost import CostLines
from proxy.errors import ErrorClass
from proxy.identity import key_label
from proxy.ledger.ledger import Ledger
from proxy.ledger.row import LedgerRow
from proxy.pipeline.context import Settlement
from proxy.pipeline.services import Runtime, Services
from proxy.protocol.usage import ZERO, Usage
from proxy.record import CacheResult, RequestRecord
from proxy.telemetry.accesslog import log_request
from proxy.telemetry.families import MeteringStage
from proxy.telemetry.metrics import Metrics

log = logging.getLogger("tokenmeter.settle")


async def settle(done: Settlement, svc: Services,
                 booked: Callable[[], None] | None = None) -> RequestRecord | None:
    """The request settled; its record (None when settling failed), whose cost and tokens the
    handler may tell the client (`cost_headers:`). `booked` is called once the request's row
    is spooled (not at all when it has none): the handler then lets its stream end.

    The charge is worked out once (usage, what it is charged against, the record), then the
    record's projections: the books (the row, then the store), the observers (spans, capture),
    the metrics and the log line."""
    try:
        charge = await _charge(done, svc)
        record = charge.record
        # A request refused for its key names no one and cost nothing: no row (anyone can send
        # them, and a flood of them would fill the spool and push real rows out), no log line
        # each; counted, and sampled into the access log, below.
        unauthenticated = done.error_class is ErrorClass.INVALID_API_KEY
        # The row first, before the store is charged: one append to the local spool. A stream's
        # final event waits for it (`booked`, proxy.pipeline.ending), not for the charge: a
        # slow store must neither hold the client's end nor, if the process is killed while
        # it is slow to take the charge, take the row with it.
        if svc.ledger is not None and not unauthenticated:
            _book(svc.ledger, record, svc.metrics, booked)
        # The observers before the store's round trips, which may fail or stall.
        done.observers.settled(done, record)
        await _charge_store(done, svc, charge)
        _measure(done, svc, charge)
        _log(done, svc, record, unauthenticated)
    except Exception:
        # Loud, never silent: a request whose usage we could not record is a billing hole.
        svc.metrics.metering_failed(MeteringStage.SETTLE)
        log.exception("failed to settle request %s", done.request_id)
        return None
    return record


@dataclass(frozen=True, slots=True)
class _Charged:
    """What a request is charged: its usage, the reservation it is charged against (None:
    nothing) and its record."""

    hit: bool
    usage: Usage
    charged: Reservation | None
    record: RequestRecord


async def _charge(done: Settlement, svc: Services) -> _Charged:
    runtime = done.runtime or svc.runtime.current
    hit = done.cache.result is CacheResult.HIT
    # Reported usage is at hand; an estimate is counted in a thread (proxy.pipeline.
    # counting), the one wait that can come before the row. A hit made no upstream call:
    # it used nothing (what it saved is priced in `_record`), whatever else it holds.
    usage = ZERO if hit else await done.usage()
    charged = _hit_charged(done, svc, runtime) if hit else _reserved(done)
    return _Charged(hit, usage, charged, _record(done, runtime, usage, charged))


async def _charge_store(done: Settlement, svc: Services, charge: _Charged) -> None:
    """The budget's store settles what the request used (and learns from it)."""
    charged, usage = charge.charged, charge.usage
    if charge.hit:
        await _charge_hit(done, svc, charge.record, charged)
        return
    if charged is None:
        return
    await svc.budget.settle(charged, usage, charge.record.cost)
    # Only an answer that ended as the upstream meant it to says how long answers run
    # (see proxy.budget.estimate).
    if (charged.estimate_key is not None and done.status == 200
            and done.error_class is ErrorClass.NONE and usage.output_tokens > 0):
        await svc.budget.learn(charged, usage.output_tokens)
    if _hid_output(done, usage, charged):
        await svc.budget.learn_hidden(charged)


def _measure(done: Settlement, svc: Services, charge: _Charged) -> None:
    """The request's metrics, and its upstream's latency sample for routing."""
    record = charge.record
    svc.metrics.record_request(record, done.meter.gap_buckets())
    route, ttft = done.route, record.figures.upstream_ttft
    # A hit says nothing of how fast the upstream is: no latency sample for routing.
    if route is not None and route.latency is not None and not charge.hit and ttft is not None:
        svc.latency.observe(route, ttft)


def _log(done: Settlement, svc: Services, record: RequestRecord,
         unauthenticated: bool) -> None:
    if unauthenticated:
        svc.metrics.auth_failed()
        svc.auth_failures.failed(done.request_id, done.operation)
    else:
        log_request(record)


def _hid_output(done: Settlement, usage: Usage, charged: Reservation) -> bool:
    """A stream admitted under `estimate` whose upstream reported more output than it showed,
    by more than a top-up step: its (upstream, model) hides output (see
    `proxy.budget.estimate`)."""
    if (charged.learned_key is None or done.candidacy is None or done.status != 200
            or usage.source != "reported"):
        return False
    return est.hid_output(usage.output_tokens,
                          done.candidacy.translator.streamed_output_tokens())


def _price(done: Settlement, runtime: Runtime) -> Price | None:
    """The price the request pays: its reservation's, which cost windows were reserved at,
    whatever the table says by now; else the table's."""
    if done.candidacy is not None and done.candidacy.reservation.price is not None:
        return done.candidacy.reservation.price
    return runtime.price_for(done.model)


def _reserved(done: Settlement) -> Reservation | None:
    return done.candidacy.reservation if done.candidacy is not None else None


def _hit_charged(done: Settlement, svc: Services, runtime: Runtime) -> Reservation | None:
    """What a cache hit is charged against: nothing under `cache.charge_hits: none` (the
    user's token and cost counters do not move); under `full`, the reservation its admission
    made (`Budget.reserve_hit`), else an addition to the windows its plan names
    (`Budget.unreserved`)."""
    if runtime.config.cache.charge_hits is ChargeHits.NONE:
        return None
    if done.hit_reservation is not None:
        return done.hit_reservation
    if done.candidacy is not None:
        return done.candidacy.reservation
    if done.principal is None:  # a hit is served to someone: never, but never a 5xx either
        return None
    try:
        return svc.budget.unreserved(done.principal, done.model, runtime.config)
    except Refused:
        # A cost window and no price for the model: the hit cannot be counted in it. Loud:
        # the user's budget misses what the hit would have cost.
        svc.metrics.metering_failed(MeteringStage.SETTLE)
        log.error("request %s: a cache hit of %s charged in full cannot be priced for %s's "
                  "cost window; not charged", done.request_id, done.model,
                  done.principal.user)
        return None


async def _charge_hit(done: Settlement, svc: Services, record: RequestRecord,
                      charged: Reservation | None) -> None:
    """A hit charged in full settles what it saved, at the cost the row books; one charged
    nothing settles its admission at no tokens (it counted as a request in its rate windows
    and held its place in the in-flight sets), and gives back whole whatever it reserved, if
    the cache answered after admission."""
    if charged is not None:
        await svc.budget.settle(charged, record.saved_usage, record.saved_cost)
    elif done.hit_reservation is not None:
        await svc.budget.settle(done.hit_reservation, ZERO, None)
    elif done.candidacy is not None:
        await svc.budget.release(done.candidacy.reservation)


def _record(done: Settlement, runtime: Runtime, usage: Usage,
            charged: Reservation | None) -> RequestRecord:
    """The request's one record, from which the row, the metrics and the log line are read.
    On a cache hit, what it saved is priced here once, at the price the request pays (the
    table in force, or its reservation's): the row, the metrics and a full charge read that
    one value."""
    candidacy, price = done.candidacy, _price(done, runtime)
    model = done.model
    saved = done.cache.saved if done.cache.result is CacheResult.HIT else None
    return RequestRecord(
        request_id=done.request_id,
        operation=done.operation,
        requested_model=done.request_model,
        sent_model=candidacy.model if candidacy is not None else None,
        model_label=runtime.router.model_label(model, done.route) if model else "none",
        upstream=candidacy.route.upstream.name if candidacy is not None else None,
        **_who(done),
        status=done.status,
        error_class=done.error_class,
        stream=done.stream,
        usage=usage,
        figures=done.meter.figures(usage.output_tokens),
        fallback_from=done.fallback_from,
        response_model=done.response_model,
        attempts=done.attempts,
        **_costs(price, runtime, usage, saved),
        windows=(" ".join(w.label for w in charged.plan.windows)
                 if charged is not None else ""),
        ended_at=time.time(),
        cache=done.cache.result,
        cache_reason=done.cache.reason,
        tags=done.tags,
        upstream_request_id=done.upstream_request_id,
    )


def _who(done: Settlement) -> dict[str, Any]:
    """The record's user, key and team (a request refused before its key was known:
    anonymous)."""
    principal = done.principal
    if principal is None:
        return {"user": "anonymous", "key": None, "team": None}
    return {"user": principal.user, "key": key_label(principal.key_name, principal.key_id),
            "team": principal.team}


def _costs(price: Price | None, runtime: Runtime, usage: Usage,
           saved: Usage | None) -> dict[str, Any]:
    """The record's cost and a hit's savings, at `price` (none: unpriced)."""
    return {
        "cost": None if price is None else CostLines.of(price, usage),
        "price_version": None if price is None else runtime.price_version,
        "saved_usage": ZERO if saved is None else saved,
        "saved_cost": None if price is None or saved is None else CostLines.of(price, saved),
    }


def _book(ledger: Ledger, record: RequestRecord, metrics: Metrics,
          then: Callable[[], None] | None) -> None:
    """The request's ledger row, handed to the ledger's spool (one append, no I/O wait);
    `then` runs once it is written."""
    try:
        ledger.record(LedgerRow.of(record, ledger.replica), then)
    except Exception:
        # A row that could not even be made: the books miss this request. Loud.
        metrics.metering_failed(MeteringStage.LEDGER)
        log.exception("failed to make the ledger row of request %s", record.request_id)
