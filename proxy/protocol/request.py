"""The client's request body, read once, for every API shape: strict JSON (no key twice, no
NaN, no number past a double, nested no deeper than MAX_DEPTH) with a usable `model`, or a 400
in the API's shape. What is forwarded is the client's own bytes, so they must mean to the
upstream exactly what they mean here. What each shape sends upstream: `proxy.protocol.shaping`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from proxy.errors import InvalidRequest


class _BaseBody(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str = Field(min_length=1, max_length=256)
    stream: bool = False


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    model: str
    stream: bool
    body: dict[str, Any]
    raw: bytes


# The deepest a request body may nest arrays and objects. Real bodies stay far below it (a chat
# message's content parts are 4 levels down, a tool's JSON schema some dozens); past it the
# readers of the body that recurse (the JSON encoder when a body is rewritten, the estimate of an
# Anthropic prompt) could run out of Python's stack and answer 500 with a traceback.
MAX_DEPTH = 128

# C0 and C1 control characters and DEL: nothing a model is named with, and what terminals, log
# lines and report rows must not be handed from a client (a NUL cannot even be stored as
# PostgreSQL text). Lone surrogates are refused by the body model itself (not a valid string).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """Every JSON object of a request body: one with a key twice is refused, because readers
    disagree on what it means (Python and this proxy keep the last value, other parsers the
    first or an error), so the proxy could meter and route on one value and the upstream act
    on another."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise InvalidRequest(
                    f"The JSON body of your request has the key '{key}' twice in one object; "
                    "send each key once."
                )
            seen.add(key)
    return obj


def _constant(name: str) -> float:
    """`NaN`, `Infinity` and `-Infinity`: Python reads them, JSON does not have them."""
    raise InvalidRequest(
        f"The JSON body of your request contains {name}, which is not valid JSON; send a "
        "number or null."
    )


def _float(text: str) -> float:
    value = float(text)
    if math.isinf(value):  # 1e400: as ambiguous as Infinity (an error, inf or a decimal)
        raise InvalidRequest(
            f"The JSON body of your request has the number {text[:40]}, too large for a "
            "double; send a smaller number."
        )
    return value


_DECODER = json.JSONDecoder(object_pairs_hook=_object, parse_constant=_constant,
                            parse_float=_float)


def _nested_deeper(root: dict[str, Any], limit: int) -> bool:
    """`root` nests arrays and objects more than `limit` levels deep. Level by level, without
    recursion: each container is visited once, and the walk stops at `limit` levels."""
    level: list[Any] = [root]
    for _ in range(limit):
        below: list[Any] = []
        add = below.append
        for container in level:
            for value in container.values() if container.__class__ is dict else container:
                if value.__class__ is dict or value.__class__ is list:
                    add(value)
        if not below:
            return False
        level = below
    return True


def _too_deep() -> InvalidRequest:
    return InvalidRequest(
        f"The JSON body of your request nests arrays and objects more than {MAX_DEPTH} levels "
        "deep; this proxy accepts no deeper."
    )


def parse_body(raw: bytes) -> ParsedRequest:
    """The client's body, read once, or a 400 in the API's shape: not JSON, not an object,
    ambiguous (a key twice in one object, NaN or Infinity, a number past a double), nested
    deeper than MAX_DEPTH, or without a usable `model`. What is forwarded is the client's own
    bytes, so they must mean to the upstream exactly what they mean here."""
    try:
        # As json.loads(raw) reads bytes, with the strict decoder.
        body = _DECODER.decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))
    except ValueError:
        raise InvalidRequest(
            "We could not parse the JSON body of your request. The body must be a JSON object."
        ) from None
    except RecursionError:  # deeper than the parser's own limit (the stack's, about 1,000)
        raise _too_deep() from None
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    # Nesting deeper than MAX_DEPTH takes more than MAX_DEPTH brackets: two C-speed counts
    # spare nearly every body the walk.
    if raw.count(b"{") + raw.count(b"[") > MAX_DEPTH and _nested_deeper(body, MAX_DEPTH):
        raise _too_deep()
    try:
        head = _BaseBody.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        if param == "model" and err["type"] == "missing":
            raise InvalidRequest("you must provide a model parameter", param="model") from None
        raise InvalidRequest(f"Invalid value for '{param}': {err['msg']}", param=param) from None
    if _CONTROL.search(head.model):
        raise InvalidRequest(
            "Invalid value for 'model': a model name cannot contain control characters "
            "(U+0000-U+001F, U+007F-U+009F).", param="model", code="invalid_value",
        )
    return ParsedRequest(model=head.model, stream=head.stream, body=body, raw=raw)


def positive_int(body: dict[str, Any], field: str) -> int | None:
    """An optional integer parameter >= 1 (JSON null is the same as absent), or a 400 naming
    it, in OpenAI's words: a string, float or boolean where a count belongs is a client bug
    that would otherwise slip past the budget."""
    value = body.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        kind = {bool: "a boolean", str: "a string", float: "a decimal", list: "an array",
                dict: "an object"}.get(type(value), "another type")
        raise InvalidRequest(
            f"Invalid type for '{field}': expected an integer, but got {kind} instead.",
            param=field, code="invalid_type",
        )
    if value < 1:
        raise InvalidRequest(
            f"Invalid '{field}': integer below minimum value. Expected a value >= 1, but got "
            f"{value} instead.", param=field, code="integer_below_min_value",
        )
    return value



def strings(*values: Any) -> Iterable[str]:
    """The values that are non-empty strings (of a request's JSON, or of an answer's)."""
    return (v for v in values if isinstance(v, str) and v)
