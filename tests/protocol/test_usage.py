"""proxy.protocol.usage.parse_usage: both namings, their details, and garbage."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.protocol.usage import Usage, parse_usage, usage_int

pytestmark = pytest.mark.unit


def test_chat_naming_with_details() -> None:
    u = parse_usage({"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18,
                     "prompt_tokens_details": {"cached_tokens": 5},
                     "completion_tokens_details": {"reasoning_tokens": 3}})
    assert u == Usage(11, 7, 5, 3, "reported")
    assert u.total_tokens == 18


def test_responses_naming_with_details() -> None:
    u = parse_usage({"input_tokens": 9, "output_tokens": 4,
                     "input_tokens_details": {"cached_tokens": 2},
                     "output_tokens_details": {"reasoning_tokens": 1}})
    assert u == Usage(9, 4, 2, 1)


def test_embeddings_have_only_prompt_tokens() -> None:
    assert parse_usage({"prompt_tokens": 8, "total_tokens": 8}) == Usage(8, 0)


@pytest.mark.parametrize("obj", [None, [], "usage", 3, {}, {"total_tokens": 5}])
def test_not_a_usage_object(obj: Any) -> None:
    assert parse_usage(obj) is None


@pytest.mark.parametrize(
    ("value", "expected"),
    [(True, 0), (-3, 0), ("12", 0), (1.5, 0), (12.0, 12), (None, 0), ([1], 0)],
)
def test_garbage_counts_are_zero_not_a_crash(value: Any, expected: int) -> None:
    u = parse_usage({"prompt_tokens": value, "completion_tokens": 1,
                     "prompt_tokens_details": "garbage"})
    assert u is not None and u.input_tokens == expected and u.cached_input_tokens == 0


@pytest.mark.parametrize(
    ("obj", "expected"),
    [({"input_tokens": 5}, Usage(5, 0)), ({"output_tokens": 3}, Usage(0, 3)),
     ({"prompt_tokens": 4}, Usage(4, 0)), ({"completion_tokens": 2}, Usage(0, 2)),
     # Either naming, one field of it: the Responses naming is read first.
     ({"output_tokens": 3, "prompt_tokens": 4}, Usage(0, 3)),
     ({"input_tokens": 0, "output_tokens": 0}, Usage()),
     ({"prompt_tokens": 0.0, "completion_tokens": 0}, Usage())],
)
def test_one_field_of_either_naming_is_a_usage(obj: dict[str, Any], expected: Usage) -> None:
    assert parse_usage(obj) == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [(0, 0), (1, 1), (0.0, 0), (1.0, 1), (-0.0, 0), (-1.0, 0), (float("nan"), 0),
     (float("inf"), 0), (2**40, 2**40)],
)
def test_usage_int_takes_whole_non_negative_numbers(value: Any, expected: int) -> None:
    got = usage_int(value)
    assert got == expected and type(got) is int
