"""One exception hierarchy for everything the proxy itself refuses or fails at.

Each error knows its HTTP status and OpenAI error `type`/`code`; `to_response` is the only place
that turns one into bytes, so every error the proxy originates has OpenAI's shape:
`{"error": {"message", "type", "param", "code"}}`. Upstream errors never pass through here: their
bodies are forwarded unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from aiohttp import web


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
    def error_class(self) -> str:
        """Bounded label for `tokenmeter_requests_total{error_class}`."""
        return self.code or self.type

    def to_body(self) -> dict[str, dict[str, str | None]]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def to_response(self) -> web.Response:
        return web.Response(
            status=self.status,
            body=json.dumps(self.to_body()).encode(),
            content_type="application/json",
            headers=self.headers,
        )


def stream_error_event(exc: ProxyError, named: bool) -> bytes:
    """The last event of a stream that broke: `data: {"error": {...}}`, which the openai SDKs
    raise as an APIError. The Responses API names its events, so there it is also an `error`
    event with that API's top-level `type`/`code`/`message`/`param`."""
    body: dict[str, object] = dict(exc.to_body())
    if named:
        err = exc.to_body()["error"]
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


class UpstreamUnavailable(ProxyError):
    """The upstream could not be reached or broke before sending a response."""

    status = 502
    type = "upstream_error"
    code = "upstream_unreachable"


class UpstreamTimeout(ProxyError):
    status = 504
    type = "upstream_error"
    code = "upstream_timeout"


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
    def error_class(self) -> str:
        return "budget_exceeded"
