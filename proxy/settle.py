"""The last step of every request: charge the budget, record metrics, cost and the log line.

It runs once per request, from the relay's `finally`, shielded from the client's disconnect. It
never raises: a failure here is a billing hole, so it is logged at error level and counted.
"""

from __future__ import annotations

import logging

from aiohttp import web

from proxy import state as st
from proxy.accesslog import log_request
from proxy.exchange import Exchange
from proxy.metrics import RequestRecord
from proxy.usage import Usage

log = logging.getLogger("tokenmeter.settle")


async def settle(app: web.Application, ex: Exchange) -> None:
    metrics = app[st.METRICS]
    runtime = ex.runtime or app[st.RUNTIME_HOLDER].current
    try:
        usage: Usage = ex.usage()
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
            fallback_from=ex.fallback_from,
            attempts=ex.attempts,
        )
        metrics.observe(record)
        if route is not None and route.latency is not None and figures.upstream_ttft is not None:
            app[st.LATENCY].observe(route, figures.upstream_ttft)
        price = runtime.price_for(ex.model)
        if price is not None:
            metrics.observe_cost(record, price.input, price.cached_input, price.output)
        metrics.observe_gaps(record, ex.meter.gap_buckets())
        log_request(record)
    except Exception:
        # Loud, never silent: a request whose usage we could not record is a billing hole.
        metrics.metering_errors.labels("settle").inc()
        log.exception("failed to settle request %s", ex.request_id)
