"""proxy.protocol.upstream_errors: what an upstream's answer, or an error event that ended its
stream, means (retried, handed on, blamed on the request), and the message a report shows."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.errors import ErrorClass
from proxy.protocol.upstream_errors import (
    blames_request,
    classify,
    error_message,
    fallback_worthy,
    request_fault,
    stream_error,
)

pytestmark = pytest.mark.unit


def _openai(type_: str, code: str | None = None, message: str = "m") -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": None,
                                 "code": code}}).encode()


# vLLM's own shape: flat, `object: error`, an integer code.
VLLM_CONTEXT = json.dumps({
    "object": "error", "type": "BadRequestError", "param": None, "code": 400,
    "message": "This model's maximum context length is 4096 tokens. However, you requested "
               "5000 tokens (4000 in the messages, 1000 in the completion).",
}).encode()
VLLM_BAD = json.dumps({"object": "error", "type": "BadRequestError", "param": None, "code": 400,
                       "message": "temperature must be non-negative"}).encode()


@pytest.mark.parametrize(
    ("status", "body", "cls"),
    [
        (200, None, ErrorClass.NONE),
        (401, _openai("invalid_request_error", "invalid_api_key"), ErrorClass.AUTH),
        (403, None, ErrorClass.AUTH),
        (429, _openai("requests", "rate_limit_exceeded"), ErrorClass.RATE_LIMIT),
        (429, _openai("invalid_request_error"), ErrorClass.RATE_LIMIT),  # the status decides
        (408, _openai("invalid_request_error"), ErrorClass.UPSTREAM_TIMEOUT),
        (400, _openai("invalid_request_error", "context_length_exceeded"),
         ErrorClass.CONTEXT_LENGTH),
        (400, VLLM_CONTEXT, ErrorClass.CONTEXT_LENGTH),
        (400, VLLM_BAD, ErrorClass.BAD_REQUEST),
        (400, None, ErrorClass.BAD_REQUEST),
        (404, b"<html>not found</html>", ErrorClass.BAD_REQUEST),
        (409, None, ErrorClass.BAD_REQUEST),
        (422, b"\xff\xfe not utf-8", ErrorClass.BAD_REQUEST),
        (302, None, ErrorClass.BAD_REQUEST),
        (500, _openai("server_error"), ErrorClass.UPSTREAM_5XX),
        (500, _openai("invalid_request_error", "invalid_value"), ErrorClass.BAD_REQUEST),
        (500, _openai("server_error", "integer_above_max_value"), ErrorClass.BAD_REQUEST),
        (500, _openai("server_error", None, "Input exceeds the context length"),
         ErrorClass.CONTEXT_LENGTH),
        (500, VLLM_BAD, ErrorClass.BAD_REQUEST),
        (500, VLLM_CONTEXT, ErrorClass.CONTEXT_LENGTH),
        (500, None, ErrorClass.UPSTREAM_5XX),
        (502, b"Bad Gateway", ErrorClass.UPSTREAM_5XX),
        (503, b"\xff\xfe", ErrorClass.UPSTREAM_5XX),
        (500, b'{"error": "overloaded"}', ErrorClass.UPSTREAM_5XX),
        (500, b"[1, 2]", ErrorClass.UPSTREAM_5XX),
        (500, b'{"object": "list"}', ErrorClass.UPSTREAM_5XX),
    ],
)
def test_classify(status: int, body: bytes | None, cls: ErrorClass) -> None:
    assert classify(status, body) is cls


def test_what_may_happen_next_follows_from_the_class() -> None:
    assert blames_request(500, ErrorClass.BAD_REQUEST)
    assert blames_request(503, ErrorClass.CONTEXT_LENGTH)
    assert not blames_request(500, ErrorClass.UPSTREAM_5XX)
    assert not blames_request(409, ErrorClass.BAD_REQUEST)  # retried when configured
    worthy = {c for c in ErrorClass if fallback_worthy(c)}
    assert {ErrorClass.RATE_LIMIT, ErrorClass.UPSTREAM_5XX, ErrorClass.UPSTREAM_TIMEOUT,
            ErrorClass.CONNECT_TIMEOUT, ErrorClass.UPSTREAM_UNREACHABLE} <= worthy
    assert not worthy & {ErrorClass.BAD_REQUEST, ErrorClass.CONTEXT_LENGTH, ErrorClass.AUTH,
                         ErrorClass.NONE, ErrorClass.CLIENT_DISCONNECT}
    # Without a body, the class says what the old status-only rule said, for every status.
    for status in range(200, 600):
        old_rule = status in (408, 429) or status >= 500
        assert fallback_worthy(classify(status)) is old_rule, status


def test_request_fault_and_message_read_both_shapes() -> None:
    assert request_fault(VLLM_CONTEXT) is ErrorClass.CONTEXT_LENGTH
    assert request_fault(_openai("server_error")) is None
    assert error_message(VLLM_CONTEXT).startswith("This model's maximum context length")
    assert error_message(_openai("x", message="nope")) == "nope"
    assert error_message(b'{"error": "plain"}') == "plain"
    assert error_message(b"x" * 500) == "x" * 200



@pytest.mark.parametrize(
    ("status", "cls"),
    [(100, ErrorClass.NONE), (204, ErrorClass.NONE), (299, ErrorClass.NONE),
     (300, ErrorClass.BAD_REQUEST), (400, ErrorClass.BAD_REQUEST), (402, ErrorClass.BAD_REQUEST),
     (404, ErrorClass.BAD_REQUEST), (409, ErrorClass.BAD_REQUEST),
     (428, ErrorClass.BAD_REQUEST), (430, ErrorClass.BAD_REQUEST),
     (499, ErrorClass.BAD_REQUEST), (500, ErrorClass.UPSTREAM_5XX),
     (504, ErrorClass.UPSTREAM_5XX), (529, ErrorClass.UPSTREAM_5XX)],
)
def test_classify_by_status_alone_at_the_boundaries(status: int, cls: ErrorClass) -> None:
    assert classify(status) is cls
    assert classify(status, b"") is cls  # an empty body says nothing


def test_a_body_blames_the_request_only_from_300_up() -> None:
    blaming = _openai("invalid_request_error", "context_length_exceeded")
    assert classify(299, blaming) is ErrorClass.NONE
    assert classify(300, blaming) is ErrorClass.CONTEXT_LENGTH
    assert classify(499, _openai("invalid_request_error")) is ErrorClass.BAD_REQUEST
    assert classify(599, _openai("x", "invalid_type")) is ErrorClass.BAD_REQUEST
    assert classify(401, blaming) is ErrorClass.AUTH  # the status decides first


@pytest.mark.parametrize(
    ("body", "fault"),
    [
        (b"", None), (b"not json", None), (b"\xff\xfe", None), (b"null", None), (b"[]", None),
        (b'"error"', None), (b"{}", None), (b'{"error": null}', None),
        (b'{"error": "invalid_request_error"}', None),
        (_openai("server_error"), None),
        (_openai("invalid_request_error"), ErrorClass.BAD_REQUEST),
        (_openai("BadRequestError"), ErrorClass.BAD_REQUEST),
        (_openai("server_error", "unsupported_parameter"), ErrorClass.BAD_REQUEST),
        (_openai("server_error", "missing_required_parameter"), ErrorClass.BAD_REQUEST),
        (_openai("server_error", "rate_limit_exceeded"), None),
        (_openai("server_error", "context_length_exceeded"), ErrorClass.CONTEXT_LENGTH),
        (_openai("server_error", None, "The CONTEXT LENGTH is 8192"), ErrorClass.CONTEXT_LENGTH),
        (_openai("server_error", None, "context_length"), None),
        (_openai("invalid_request_error", None, "over the context length"),
         ErrorClass.CONTEXT_LENGTH),  # the context length first, whatever the type
        # Odd fields are nothing, not a crash.
        (json.dumps({"error": {"code": 400, "message": 7, "type": None}}).encode(), None),
        (json.dumps({"error": {"code": ["invalid_value"]}}).encode(), None),
        # An unhashable type once raised TypeError here, out of the classifier.
        (json.dumps({"error": {"type": ["invalid_request_error"]}}).encode(), None),
        (json.dumps({"error": {"type": {"a": 1}, "code": "invalid_value"}}).encode(),
         ErrorClass.BAD_REQUEST),
        (json.dumps({"object": "error", "type": []}).encode(), None),
        (json.dumps({"error": {"code": "invalid_value", "message": None}}).encode(),
         ErrorClass.BAD_REQUEST),
        # vLLM's flat shape, read only when it says it is an error.
        (json.dumps({"object": "error", "code": "context_length_exceeded"}).encode(),
         ErrorClass.CONTEXT_LENGTH),
        (json.dumps({"object": "error", "type": "invalid_request_error"}).encode(),
         ErrorClass.BAD_REQUEST),
        (json.dumps({"object": "list", "type": "invalid_request_error"}).encode(), None),
        (json.dumps({"type": "invalid_request_error", "code": "invalid_value"}).encode(), None),
        (json.dumps({"object": "error", "error": {"type": "server_error"},
                     "type": "invalid_request_error"}).encode(), None),
    ],
)
def test_request_fault(body: bytes, fault: ErrorClass | None) -> None:
    assert request_fault(body) is fault


@pytest.mark.parametrize(
    ("kind", "cls"),
    [
        ("invalid_request_error", ErrorClass.BAD_REQUEST),
        ("authentication_error", ErrorClass.AUTH),
        ("billing_error", ErrorClass.BAD_REQUEST),
        ("permission_error", ErrorClass.AUTH),
        ("not_found_error", ErrorClass.BAD_REQUEST),
        ("request_too_large", ErrorClass.BAD_REQUEST),
        ("rate_limit_error", ErrorClass.RATE_LIMIT),
        ("api_error", ErrorClass.UPSTREAM_5XX),
        ("timeout_error", ErrorClass.UPSTREAM_5XX),
        ("overloaded_error", ErrorClass.UPSTREAM_5XX),
        ("some_new_error", ErrorClass.UPSTREAM_5XX),
    ],
)
def test_a_stream_ending_error_is_classed_as_its_status_would_be(
    kind: str, cls: ErrorClass,
) -> None:
    event = json.dumps({"type": "error", "error": {"type": kind, "message": "m"}}).encode()
    assert stream_error(event) is cls


@pytest.mark.parametrize(
    "data",
    [b"", b"not json", b"\xff", b"[1]", b'{"type": "error"}', b'{"error": "overloaded"}',
     b'{"error": {"type": 429}}', b'{"error": {"message": "rate_limit_error"}}',
     b'{"type": "rate_limit_error"}', b'{"error": {"type": ["rate_limit_error"]}}',
     b'{"error": {"type": {"t": 1}}}'],
)
def test_an_unreadable_stream_error_is_the_upstreams_failure(data: bytes) -> None:
    assert stream_error(data) is ErrorClass.UPSTREAM_5XX


def test_a_stream_error_of_unknown_type_may_still_blame_the_request() -> None:
    """Read as a 500 with its body: a body that names the context length is the request's."""
    event = json.dumps({"type": "error", "error": {"type": "some_new_error",
                                                   "message": "exceeds the context length"}})
    assert stream_error(event.encode()) is ErrorClass.CONTEXT_LENGTH
    overloaded = json.dumps({"type": "error", "error": {
        "type": "overloaded_error", "message": "context length"}}).encode()
    assert stream_error(overloaded) is ErrorClass.CONTEXT_LENGTH


@pytest.mark.parametrize(
    ("status", "cls", "blamed"),
    [(500, ErrorClass.BAD_REQUEST, True), (599, ErrorClass.CONTEXT_LENGTH, True),
     (499, ErrorClass.BAD_REQUEST, False), (499, ErrorClass.CONTEXT_LENGTH, False),
     (500, ErrorClass.UPSTREAM_5XX, False), (500, ErrorClass.RATE_LIMIT, False),
     (500, ErrorClass.AUTH, False), (500, ErrorClass.NONE, False)],
)
def test_blames_request(status: int, cls: ErrorClass, blamed: bool) -> None:
    assert blames_request(status, cls) is blamed


def test_fallback_worthy_classes() -> None:
    assert {c for c in ErrorClass if fallback_worthy(c)} == {
        ErrorClass.RATE_LIMIT, ErrorClass.UPSTREAM_5XX, ErrorClass.UPSTREAM_TIMEOUT,
        ErrorClass.CONNECT_TIMEOUT, ErrorClass.FIRST_BYTE_TIMEOUT, ErrorClass.TOTAL_TIMEOUT,
        ErrorClass.IDLE_TIMEOUT, ErrorClass.UPSTREAM_UNREACHABLE, ErrorClass.UPSTREAM_RESET,
        ErrorClass.UPSTREAM_INCOMPLETE}


def _json(obj: Any) -> bytes:
    return json.dumps(obj).encode()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (_json({"error": {"message": "nope", "type": "x"}}), "nope"),
        (_json({"error": {"message": 404}}), "404"),
        (_json({"error": {"message": "", "type": "x"}}), '{"error": {"message": "", "type": "x"}}'),
        (_json({"error": {"type": "x"}}), '{"error": {"type": "x"}}'),
        (_json({"error": "plain"}), "plain"),
        (_json({"error": ["a"]}), '{"error": ["a"]}'),
        (_json({"object": "error", "message": "flat"}), "flat"),
        (_json({"object": "error", "message": ""}), '{"object": "error", "message": ""}'),
        (_json({"object": "list", "message": "not an error"}),
         '{"object": "list", "message": "not an error"}'),
        (_json({"error": None, "object": "error", "message": "flat"}), "flat"),
        (_json(["error"]), '["error"]'),
        (b"<html>Bad Gateway</html>", "<html>Bad Gateway</html>"),
        (b"\xff\xfeoops", "\ufffd\ufffdoops"),
        (b"", ""),
    ],
)
def test_error_message(body: bytes, message: str) -> None:
    assert error_message(body) == message


def test_error_message_is_cut_to_its_limit() -> None:
    assert error_message(b"x" * 500) == "x" * 200
    assert error_message(b"x" * 500, limit=7) == "x" * 7
    long = _json({"error": {"message": "m" * 300}})
    assert error_message(long) == "m" * 200
    assert error_message(long, 10) == "m" * 10
    assert error_message(_json({"error": "e" * 300}), 5) == "eeeee"
    assert error_message(_json({"object": "error", "message": "f" * 300})) == "f" * 200


def test_scrub_replaces_a_key_in_every_json_form() -> None:
    from proxy.protocol.upstream_errors import scrub, secret_forms

    key = 'sk-a/b"\u00e9'
    forms = secret_forms([key, ""])
    for body in (json.dumps({"m": key}).encode(),
                 json.dumps({"m": key}, ensure_ascii=False).encode(),
                 json.dumps({"m": key}).replace("/", "\\/").encode()):
        assert json.loads(scrub(body, forms)) == {"m": "[REDACTED]"}
    assert scrub(b'{"m": "nothing"}', forms) == b'{"m": "nothing"}'
