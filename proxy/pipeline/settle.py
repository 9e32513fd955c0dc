"""The last step of every request: charge the budget, record metrics, cost and the log line.

It runs once per request, from the relay's `finally`, shielded from the client's disconnect. It
never raises: a failure here is a billing hole, so it is logged at error level and counted. The
ledger row is handed over first, before the store is charged and whatever else fails (the
metrics, the log line): it is a local append, the charge a round trip that may stall.
"""

from __future__ import annotations

import logging
import time

from proxy.cost import usage_cost
from proxy.errors import ErrorClass
from proxy.ledger.ledger import Ledger
from proxy.ledger.row import LedgerRow
from proxy.pipeline.context import Settlement
from proxy.pipeline.services import Runtime, Services
from proxy.protocol.usage import Usage
from proxy.telemetry.accesslog import log_request
from proxy.telemetry.meter import Figures
from proxy.telemetry.metrics import MeteringStage, Metrics, RequestRecord

log = logging.getLogger("tokenmeter.settle")


async def settle(done: Settlement, svc: Services) -> None:
    metrics = svc.metrics
    runtime = done.runtime or svc.runtime.current
    try:
        # Reported usage is at hand; an estimate is counted in a thread (proxy.pipeline.
        # counting), the one wait that can come before the row.
        usage = await done.usage()
        figures = done.meter.figures(usage.output_tokens)
        # A request refused for its key names no one and cost nothing: no row (anyone can send
        # them, and a flood of them would fill the spool and push real rows out), no log line
        # each; counted, and sampled into the access log, below.
        unauthenticated = done.error_class is ErrorClass.INVALID_API_KEY
        # The row first, before the store is charged: one append to the local spool. The client may
        # already have its whole answer (the relay forwards `[DONE]` before settling), so a
        # process killed while the store is slow to take the charge must not take the row too.
        if svc.ledger is not None and not unauthenticated:
            _book(svc.ledger, done, runtime, usage, figures, metrics)
        if done.candidacy is not None:
            reservation = done.candidacy.reservation
            await svc.budget.settle(reservation, usage)
            # Only an answer that ended as the upstream meant it to says how long answers run
            # (see proxy.budget.estimate).
            if (reservation.estimate_key is not None and done.status == 200
                    and done.error_class is ErrorClass.NONE and usage.output_tokens > 0):
                await svc.budget.learn(reservation, usage.output_tokens)
        route, model, principal = done.route, done.model, done.principal
        record = RequestRecord(
            request_id=done.request_id,
            operation=done.operation,
            model=model,
            model_label=runtime.router.model_label(model, route) if model else "none",
            upstream=route.upstream.name if route is not None else "none",
            user=principal.user if principal is not None else "anonymous",
            key=(principal.key_name or principal.key_id) if principal else None,
            status=done.status,
            error_class=done.error_class,
            stream=done.stream,
            usage=usage,
            figures=figures,
            fallback_from=done.fallback_from,
            response_model=done.response_model,
            attempts=done.attempts,
        )
        metrics.record_request(record, runtime.price_for(model), done.meter.gap_buckets())
        if route is not None and route.latency is not None and figures.upstream_ttft is not None:
            svc.latency.observe(route, figures.upstream_ttft)
        if unauthenticated:
            metrics.auth_failed()
            svc.auth_failures.failed(done.request_id, done.operation)
        else:
            log_request(record)
    except Exception:
        # Loud, never silent: a request whose usage we could not record is a billing hole.
        metrics.metering_failed(MeteringStage.SETTLE)
        log.exception("failed to settle request %s", done.request_id)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def _book(ledger: Ledger, done: Settlement, runtime: Runtime, usage: Usage,
          figures: Figures, metrics: Metrics) -> None:
    """The request's ledger row, handed to the ledger's spool (one append, no I/O wait)."""
    try:
        principal, candidacy = done.principal, done.candidacy
        price = runtime.price_for(done.model)
        windows = ""
        if candidacy is not None:
            windows = " ".join(w.label for w in candidacy.reservation.plan.windows)
        ended = time.time()
        ledger.record(LedgerRow(
            request_id=done.request_id,
            started_at=ended - figures.duration,
            ended_at=ended,
            replica=ledger.replica,
            user_name=principal.user if principal is not None else "anonymous",
            key_name=(principal.key_name or principal.key_id) if principal else None,
            team=principal.team if principal is not None else None,
            operation=done.operation,
            requested_model=done.request_model,
            model=candidacy.model if candidacy is not None else None,
            response_model=done.response_model,
            upstream=candidacy.route.upstream.name if candidacy is not None else None,
            fallback_from=done.fallback_from,
            attempts=done.attempts,
            status=done.status,
            error_class=done.error_class.value,
            stream=done.stream,
            input_tokens=usage.input_tokens,
            output_tokens=usage.output_tokens,
            cached_input_tokens=usage.cached_input_tokens,
            reasoning_tokens=usage.reasoning_tokens,
            token_source=usage.source,
            ttft_ms=_ms(figures.ttft),
            upstream_ttft_ms=_ms(figures.upstream_ttft),
            overhead_ms=_ms(figures.overhead),
            duration_ms=figures.duration * 1000,
            output_tokens_per_s=figures.output_tokens_per_second,
            cost_nanousd=None if price is None else usage_cost(price, usage),
            price_version=None if price is None else runtime.price_version,
            windows=windows,
            cache_creation_input_tokens=usage.cache_creation_input_tokens,
        ))
    except Exception:
        # A row that could not even be made: the books miss this request. Loud.
        metrics.metering_failed(MeteringStage.LEDGER)
        log.exception("failed to make the ledger row of request %s", done.request_id)
