"""One exception hierarchy for everything the proxy itself refuses or fails at, and the one
closed set of error classes every request is counted under.

Each error knows its HTTP status and OpenAI error `type`/`code`; `to_response` is the only place
that turns one into bytes, so every error the proxy originates has OpenAI's shape:
`{"error": {"message", "type", "param", "code"}}`. Upstream errors never pass through here: their
bodies are forwarded unchanged, and `proxy.protocol.upstream_errors.classify` names their class.

A `code` is an OpenAI wire field and stays what clients have always seen; `error_class` is the
metrics label. For the proxy's own errors the class is the code's value (or the type's, for an
error without a code), so the wire code and the label can never drift apart.

This module imports no aiohttp at import time, so the sans-I/O classifier can use `ErrorClass`.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aiohttp import web


class ErrorClass(enum.StrEnum):
    """`tokenmeter_requests_total{error_class}`, the access log's `error_class`, and the
    `reason` of retries and fallbacks (with "slow"). A StrEnum: a member is equal to, hashes
    as, and formats as its value, so comparisons with the old strings and Prometheus labels
    are unchanged. Dashboards and alert rules may only match these values
    (tests/pipeline/test_error_classes.py checks)."""

    NONE = "none"
    # The client's side.
    CLIENT_DISCONNECT = "client_disconnect"  # it went away (499)
    CLIENT_TIMEOUT = "client_timeout"  # it stopped reading; the proxy cut it
    BODY_TIMEOUT = "body_timeout"  # its body did not arrive in server.body_timeout_s (408)
    # The proxy's refusals of a request (wire codes).
    INVALID_REQUEST = "invalid_request"
    INVALID_TYPE = "invalid_type"
    INVALID_VALUE = "invalid_value"
    INTEGER_BELOW_MIN_VALUE = "integer_below_min_value"
    UNKNOWN_URL = "unknown_url"
    MODEL_NOT_FOUND = "model_not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    INVALID_API_KEY = "invalid_api_key"
    INVALID_TOKEN = "invalid_token"  # /metrics without its bearer token
    REQUEST_TOO_LARGE = "request_too_large"
    UNSUPPORTED_CONTENT_ENCODING = "unsupported_content_encoding"  # a compressed body (415)
    REQUEST_TIMEOUT = "request_timeout"  # headers or body too slow (the listener's 408)
    TOO_MANY_CONNECTIONS = "too_many_connections"
    # any quota/rate/concurrency limit (429), and a stream under `admission: estimate` ended
    # mid-way because its quota could not be topped up (200, then an error event)
    BUDGET_EXCEEDED = "budget_exceeded"
    # The proxy's own failures.
    SERVICE_UNAVAILABLE = "service_unavailable"  # e.g. budget store down, failing closed
    INTERNAL = "internal"  # a bug
    SERVER_ERROR = "server_error"  # a bare ProxyError: its type, for want of a code
    # The upstream's answers (proxy.protocol.upstream_errors.classify).
    AUTH = "auth"
    RATE_LIMIT = "rate_limit"
    BAD_REQUEST = "bad_request"
    CONTEXT_LENGTH = "context_length"
    UPSTREAM_5XX = "upstream_5xx"
    # The upstream's failures to answer (UpstreamTimeout / UpstreamUnavailable kinds).
    UPSTREAM_TIMEOUT = "upstream_timeout"  # it answered 408, or a timeout of no finer kind
    CONNECT_TIMEOUT = "connect_timeout"
    FIRST_BYTE_TIMEOUT = "first_byte_timeout"
    IDLE_TIMEOUT = "idle_timeout"
    TOTAL_TIMEOUT = "total_timeout"
    UPSTREAM_UNREACHABLE = "upstream_unreachable"
    UPSTREAM_RESET = "upstream_reset"
    UPSTREAM_INCOMPLETE = "upstream_incomplete"
    UPSTREAM_REDIRECT = "upstream_redirect"  # it answered 3xx, which is never followed


class ProxyError(Exception):
    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers: dict[str, str] = dict(headers or {})

    @property
    def error_class(self) -> ErrorClass:
        """Bounded label for `tokenmeter_requests_total{error_class}`: the wire code's member.
        A code outside the set is a bug; it is counted as `internal` rather than raising in
        the middle of answering an error (tests/pipeline/test_error_classes.py covers every raiser's
        code)."""
        value = self.code or self.type
        try:
            return ErrorClass(value)
        except ValueError:
            return ErrorClass.INTERNAL

    def message_for(self, request_id: str | None) -> str:
        """The message as the client reads it: with the request's id when it has one (its
        ledger row's, also in `x-tokenmeter-request-id`). SDKs surface an error's message but
        not the proxy's headers, so the message is the one place a developer is sure to see
        the id they can quote in a ticket."""
        if request_id is None:
            return self.message
        return f"{self.message} (request id {request_id})"

    def to_body(self, request_id: str | None = None) -> dict[str, dict[str, str | None]]:
        return {
            "error": {
                "message": self.message_for(request_id),
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def to_anthropic_body(self, request_id: str | None = None) -> dict[str, object]:
        """Anthropic's error shape: the type is the status's (the SDK picks its exception by
        status; `rate_limit_error` for every refusal of a budget or limit)."""
        type_ = ANTHROPIC_ERROR_TYPES.get(self.status, "api_error")
        return {"type": "error",
                "error": {"type": type_, "message": self.message_for(request_id)}}

    def to_response(self, shape: ErrorShape | None = None,
                    request_id: str | None = None) -> web.Response:
        from aiohttp import web

        body = (self.to_anthropic_body(request_id) if shape is ErrorShape.ANTHROPIC
                else self.to_body(request_id))
        return web.Response(
            status=self.status,
            body=json.dumps(body).encode(),
            content_type="application/json",
            headers=self.headers,
        )


class ErrorShape(enum.Enum):
    """The body an API's clients expect the proxy's own errors in."""

    OPENAI = "openai"
    ANTHROPIC = "anthropic"


# Anthropic's error type per status (its "Errors" reference); other statuses are `api_error`.
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 413: "request_too_large", 415: "invalid_request_error",
    429: "rate_limit_error",
    529: "overloaded_error",
}


def stream_error_event(exc: ProxyError, named: bool,
                       shape: ErrorShape = ErrorShape.OPENAI,
                       request_id: str | None = None) -> bytes:
    """The last event of a stream that broke: `data: {"error": {...}}`, which the openai SDKs
    raise as an APIError. The Responses API names its events, so there it is also an `error`
    event with that API's top-level `type`/`code`/`message`/`param`. The message carries
    `request_id` as `to_body` does."""
    if shape is ErrorShape.ANTHROPIC:  # Anthropic streams name their `error` event
        return (b"event: error\ndata: " + json.dumps(exc.to_anthropic_body(request_id)).encode()
                + b"\n\n")
    body: dict[str, object] = dict(exc.to_body(request_id))
    if named:
        err = exc.to_body(request_id)["error"]
        body = {"type": "error", "code": err["code"], "message": err["message"],
                "param": err["param"], **body}
        return b"event: error\ndata: " + json.dumps(body).encode() + b"\n\n"
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class InvalidRequest(ProxyError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class NotFound(ProxyError):
    status = 404
    type = "invalid_request_error"
    code = "unknown_url"


class MethodNotAllowed(ProxyError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class AuthenticationFailed(ProxyError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class RequestTooLarge(ProxyError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class UnsupportedContentEncoding(ProxyError):
    """A request body sent compressed (`Content-Encoding` other than identity)."""

    status = 415
    type = "invalid_request_error"
    code = "unsupported_content_encoding"


class UpstreamUnavailable(ProxyError):
    """The upstream could not be reached, or broke before completing its response. A specific
    failure raises one of the kinds below; the plain one means no upstream answered at all."""

    status = 502
    type = "upstream_error"
    code = "upstream_unreachable"


class UpstreamUnreachable(UpstreamUnavailable):
    """No response: connection refused or dropped before any header, or a JSON answer broke
    while being read (that last one keeps this code for wire compatibility)."""

    code = "upstream_unreachable"


class UpstreamReset(UpstreamUnavailable):
    """The connection broke mid-stream, after bytes reached the client."""

    code = "upstream_reset"


class UpstreamIncomplete(UpstreamUnavailable):
    """The stream ended cleanly but without its final event."""

    code = "upstream_incomplete"


class UpstreamRedirect(UpstreamUnavailable):
    """The upstream answered with a redirect (3xx). Never followed: the request carries the
    operator's key and the client's prompt, which must not go to an origin the configuration
    does not name. Never retried either (it would redirect again); a fallback may be tried."""

    code = "upstream_redirect"


class UpstreamTimeout(ProxyError):
    """The upstream was too slow: raise one of the kinds below, each named for the limit
    that ran out."""

    status = 504
    type = "upstream_error"
    code = "upstream_timeout"


class ConnectTimeout(UpstreamTimeout):
    """No connection within connect_timeout_s (safe to retry: the request was never sent)."""

    code = "connect_timeout"


class FirstByteTimeout(UpstreamTimeout):
    """No response headers within first_byte_timeout_s (never retried: it may be running)."""

    code = "first_byte_timeout"


class IdleTimeout(UpstreamTimeout):
    """The upstream sent nothing for idle_timeout_s once its response had begun."""

    code = "idle_timeout"


class TotalTimeout(UpstreamTimeout):
    """A JSON answer not complete within total_timeout_s."""

    code = "total_timeout"


class ServiceUnavailable(ProxyError):
    status = 503
    type = "server_error"
    code = "service_unavailable"


class BudgetExceeded(ProxyError):
    """A quota or rate limit refused the request; `type`/`code` say which kind."""

    status = 429

    def __init__(self, message: str, *, type_: str, code: str, limit: str,
                 headers: Mapping[str, str]) -> None:
        super().__init__(message, code=code, headers=headers)
        self.type = type_
        self.limit = limit

    @property
    def error_class(self) -> ErrorClass:
        return ErrorClass.BUDGET_EXCEEDED
