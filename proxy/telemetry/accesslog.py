"""One structured JSON line per request. Never prompt text, never keys."""

from __future__ import annotations

import json
import logging

from proxy.telemetry.metrics import RequestRecord

access_log = logging.getLogger("tokenmeter.access")


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 3)


def request_fields(rec: RequestRecord) -> dict[str, object]:
    u, f = rec.usage, rec.figures
    return {
        "event": "request",
        "request_id": rec.request_id,
        "operation": rec.operation,
        "user": rec.user,
        "key": rec.key,
        "model": rec.model[:200],
        "fallback_from": None if rec.fallback_from is None else rec.fallback_from[:200],
        "response_model": None if rec.response_model is None else rec.response_model[:200],
        "attempts": rec.attempts,
        "upstream": rec.upstream,
        "status": rec.status,
        "error_class": rec.error_class,
        "stream": rec.stream,
        "input_tokens": u.input_tokens,
        "output_tokens": u.output_tokens,
        "cached_input_tokens": u.cached_input_tokens,
        "reasoning_tokens": u.reasoning_tokens,
        "total_tokens": u.total_tokens,
        "token_source": u.source,
        "ttft_ms": _ms(f.ttft),
        "upstream_ttft_ms": _ms(f.upstream_ttft),
        "overhead_ms": _ms(f.overhead),
        "duration_ms": _ms(f.duration),
        "tpot_ms": _ms(f.time_per_output_token),
        "tokens_per_second": (
            None if f.output_tokens_per_second is None else round(f.output_tokens_per_second, 1)
        ),
        "content_chunks": f.content_chunks,
    }


def log_request(rec: RequestRecord) -> None:
    if access_log.isEnabledFor(logging.INFO):
        access_log.info(json.dumps(request_fields(rec), separators=(",", ":")))
