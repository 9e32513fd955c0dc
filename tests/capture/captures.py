"""Captures for tests: a complete record with the fields a test sets, the rest plausible."""

from __future__ import annotations

from typing import Any

from proxy.capture.record import Body, Capture, StreamEvent


def capture(request_id: str, started_at: float, **fields: Any) -> Capture:
    request = ('{"model": "gpt-4o-mini", "max_tokens": 64, "stream": true, '
               '"messages": [{"role": "user", "content": "hi ' + request_id + '"}]}')
    base: dict[str, Any] = {
        "request_id": request_id, "started_at": started_at, "api": "openai",
        "path": "/v1/chat/completions", "operation": "chat", "user": "alice",
        "key_name": "k1", "team": "t1", "requested_model": "gpt-4o-mini",
        "model": "gpt-4o-mini", "stream": True, "status": 200, "error_class": "none",
        "request": Body(request, len(request)),
        "upstream_request": Body(request, len(request)), "response": None,
        "events": (StreamEvent(12.5, 'data: {"choices":[{"delta":{"content":"hel"}}]}'),
                   StreamEvent(20.0, "data: [DONE]")),
        "output_text": "hello " + request_id,
    }
    return Capture(**{**base, **fields})
