"""The last step of every request: charge the budget, record metrics, cost and the log line.

It runs once per request, from the relay's `finally`, shielded from the client's disconnect. It
never raises: a failure here is a billing hole, so it is logged at error level and counted.
"""

from __future__ import annotations

import logging

from proxy.pipeline.context import Settlement
from proxy.server.state import Services
from proxy.telemetry.accesslog import log_request
from proxy.telemetry.metrics import MeteringStage, RequestRecord

log = logging.getLogger("tokenmeter.settle")


async def settle(done: Settlement, svc: Services) -> None:
    metrics = svc.metrics
    runtime = done.runtime or svc.runtime.current
    try:
        usage = done.usage
        if done.candidacy is not None:
            await svc.budget.settle(done.candidacy.reservation, usage)
        figures = done.meter.figures(usage.output_tokens)
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
        log_request(record)
    except Exception:
        # Loud, never silent: a request whose usage we could not record is a billing hole.
        metrics.metering_failed(MeteringStage.SETTLE)
        log.exception("failed to settle request %s", done.request_id)
