"""The client's body, read once (proxy/protocol/request.py): what is refused, without a network
(tests/test_hostile_json.py sends the same through the proxy)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.errors import InvalidRequest
from proxy.protocol.request import MAX_DEPTH, parse_body, positive_int

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("raw", "says"), [
    (b'{"model":"m","model":"n"}', "key 'model' twice"),
    (b'{"model":"m","t":NaN}', "NaN"),
    (b'{"model":"m","t":1e400}', "too large for a double"),
    (b"[1]", "must be a JSON object"),
    (b"{", "could not parse"),
    (b'{"model":""}', "'model'"),
    (b'{"messages":[]}', "must provide a model"),
    (b'{"model":"a\\u0000b"}', "control characters"),
    (b'{"model":"m","stream":"yes"}', "'stream'"),
])
def test_ambiguous_or_unusable_bodies_are_refused(raw: bytes, says: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_body(raw)
    assert says in str(caught.value)


def _nested(depth: int) -> bytes:
    return b'{"model":"m","x":' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"


def test_nesting_up_to_the_bound_is_read_and_past_it_refused() -> None:
    assert parse_body(_nested(MAX_DEPTH)).model == "m"
    for depth in (MAX_DEPTH + 1, 100_000):
        with pytest.raises(InvalidRequest, match=f"more than {MAX_DEPTH} levels"):
            parse_body(_nested(depth))


def test_the_body_is_kept_as_sent() -> None:
    raw = json.dumps({"model": "m", "stream": True, "extra": {"a": [1, 2.5]}}).encode()
    parsed = parse_body(raw)
    assert (parsed.model, parsed.stream, parsed.raw) == ("m", True, raw)
    assert parsed.body == json.loads(raw)


@pytest.mark.parametrize(("value", "code"), [
    ("3", "invalid_type"), (True, "invalid_type"), (2.0, "invalid_type"),
    ([1], "invalid_type"), (0, "integer_below_min_value"), (-4, "integer_below_min_value"),
])
def test_a_count_is_a_positive_integer(value: Any, code: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        positive_int({"n": value}, "n")
    assert (caught.value.param, caught.value.code) == ("n", code)
    assert positive_int({"n": None}, "n") is None and positive_int({"n": 3}, "n") == 3
