"""What an upstream's answer means: one classifier for retries, fallbacks, settling and
`tokenmeter bench`.

Sans-I/O: it sees a status and, when one was read, a body; it imports no aiohttp. The class
decides what may happen next: `blames_request` (never retried, never handed to a fallback: it
would fail the same way anywhere) and `fallback_worthy` (another model may do better).
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from proxy.errors import ErrorClass
from proxy.protocol.secrets import key_forms

# OpenAI's error type for a bad request, and vLLM's.
_REQUEST_ERROR_TYPES = frozenset({"invalid_request_error", "BadRequestError"})
# Codes OpenAI gives errors about the request's parameters.
_REQUEST_ERROR_CODES = frozenset({
    "context_length_exceeded", "invalid_value", "invalid_type", "missing_required_parameter",
    "unsupported_parameter", "unsupported_value", "integer_below_min_value",
    "integer_above_max_value", "string_above_max_length", "invalid_request_error",
})

# Answers the request itself caused: the same request fails the same way anywhere.
REQUEST_FAULTS = frozenset({ErrorClass.BAD_REQUEST, ErrorClass.CONTEXT_LENGTH})

# Failures another model (another upstream, or a lighter one) may not have: overloaded, rate
# limited, broken, slow or out of reach. Anything about the request or the client is final.
FALLBACK_WORTHY = frozenset({
    ErrorClass.RATE_LIMIT, ErrorClass.UPSTREAM_5XX, ErrorClass.UPSTREAM_TIMEOUT,
    ErrorClass.CONNECT_TIMEOUT, ErrorClass.FIRST_BYTE_TIMEOUT, ErrorClass.TOTAL_TIMEOUT,
    ErrorClass.IDLE_TIMEOUT, ErrorClass.UPSTREAM_UNREACHABLE, ErrorClass.UPSTREAM_RESET,
    ErrorClass.UPSTREAM_INCOMPLETE,
})


def classify(status: int, body: bytes | None = None) -> ErrorClass:
    """The class of an upstream's answer. `body` is the error body when it was read (None
    when it was not: a 4xx then counts as `bad_request`, a 5xx as `upstream_5xx`).

    401/403 `auth`; 429 `rate_limit`; 408 `upstream_timeout` (the upstream gave up waiting:
    retried and handed on like a 5xx, not the client's fault); a 5xx whose body blames the
    request (some servers answer a validation error with a 500) `bad_request` or
    `context_length`, any other 5xx `upstream_5xx`; any other status from 300 up
    `context_length` or `bad_request`; below 300 `none`."""
    if status < 300:
        return ErrorClass.NONE
    if status in (401, 403):
        return ErrorClass.AUTH
    if status == 429:
        return ErrorClass.RATE_LIMIT
    if status == 408:
        return ErrorClass.UPSTREAM_TIMEOUT
    fault = request_fault(body) if body else None
    if status >= 500:
        return fault or ErrorClass.UPSTREAM_5XX
    return fault or ErrorClass.BAD_REQUEST


def request_fault(body: bytes) -> ErrorClass | None:
    """`context_length` or `bad_request` when `body` is an error in OpenAI's shape (or vLLM's
    flat one, `{"object": "error", "message", "type", "code"}`) that blames the request: its
    type is `invalid_request_error`, its code names a bad parameter, or its message the context
    length. None for anything else."""
    try:
        obj = json.loads(body)
    except ValueError:  # UnicodeDecodeError included
        return None
    if not isinstance(obj, dict):
        return None
    err = obj.get("error")
    if not isinstance(err, dict):
        if obj.get("object") != "error":
            return None
        err = obj
    code = err.get("code") if isinstance(err.get("code"), str) else ""
    message = err.get("message")
    message = message.lower() if isinstance(message, str) else ""
    if code == "context_length_exceeded" or "context length" in message:
        return ErrorClass.CONTEXT_LENGTH
    # A type that is not a string may be a list or an object: not hashable, not in the set.
    kind = err.get("type")
    if (isinstance(kind, str) and kind in _REQUEST_ERROR_TYPES) or code in _REQUEST_ERROR_CODES:
        return ErrorClass.BAD_REQUEST
    return None


# The status Anthropic answers each of its error types with (docs.anthropic.com, "Errors"): an
# error that ends a stream mid-way names its type only, the stream's status being 200.
_ANTHROPIC_STATUS = {
    "invalid_request_error": 400, "authentication_error": 401, "billing_error": 402,
    "permission_error": 403, "not_found_error": 404, "request_too_large": 413,
    "rate_limit_error": 429, "api_error": 500, "timeout_error": 504, "overloaded_error": 529,
}


def stream_error(data: bytes) -> ErrorClass:
    """The class of an `error` event that ended a stream (Anthropic's `{"type": "error",
    "error": {"type": ..., "message": ...}}`): what the same error would have been as an answer
    with its status. An error of a type not listed (or unreadable) is the upstream's failure,
    `upstream_5xx`: the stream did not end as it should, and nothing says the request did it."""
    try:
        obj = json.loads(data)
    except ValueError:  # UnicodeDecodeError included
        obj = None
    err = obj.get("error") if isinstance(obj, dict) else None
    kind = err.get("type") if isinstance(err, dict) else None
    status = _ANTHROPIC_STATUS.get(kind, 500) if isinstance(kind, str) else 500
    return classify(status, data)


def blames_request(status: int, cls: ErrorClass) -> bool:
    """A 5xx that is really the request's fault: not retried, even when its status is in
    `retry.on_status`, and not handed on. (A 4xx is the request's fault by its status; 408 and
    409 are retried when configured, whatever their body.)"""
    return status >= 500 and cls in REQUEST_FAULTS


def fallback_worthy(cls: ErrorClass) -> bool:
    """A failure the next candidate model may not have."""
    return cls in FALLBACK_WORTHY


def error_message(body: bytes, limit: int = 200) -> str:
    """A short human message from an error body in OpenAI's shape (or vLLM's flat one, or a
    bare `{"error": "text"}`), else the body's start. For reports, never for logs: it is the
    upstream's text."""
    message = body[:limit].decode("utf-8", "replace")
    try:
        obj = json.loads(body)
    except ValueError:
        return message
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict):
            message = str(err.get("message") or message)
        elif isinstance(err, str):
            message = err
        elif obj.get("object") == "error" and obj.get("message"):
            message = str(obj["message"])
    return message[:limit]


# What stands in for a secret scrubbed from an upstream's error body (capture's word for it).
SCRUBBED = b"[REDACTED]"


def secret_forms(secrets: Iterable[str]) -> tuple[bytes, ...]:
    """The byte strings `secrets` can appear as in a JSON body (`secrets.key_forms`), longest
    first so a longer form goes before a shorter one inside it. Made once per configuration."""
    forms = {form.encode() for secret in secrets if secret for form in key_forms(secret)}
    return tuple(sorted(forms, key=len, reverse=True))


def scrub(body: bytes, forms: tuple[bytes, ...]) -> bytes:
    """`body` with every one of `forms` (`secret_forms`) replaced by `[REDACTED]`: an upstream
    that echoes the key it was sent (Anthropic's 401 and 400 answers can) must not hand the
    operator's key to the client. For error bodies only: small, and never an answer's text."""
    for form in forms:
        if form in body:
            body = body.replace(form, SCRUBBED)
    return body
