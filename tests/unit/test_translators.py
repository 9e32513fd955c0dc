"""The output cap each API shape writes upstream: clamped per choice, every field or one."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.errors import InvalidRequest
from proxy.protocol.translators import (
    ChatTranslator,
    CompletionsTranslator,
    ParsedRequest,
    ResponsesTranslator,
    Translator,
    parse_body,
)


def _req(body: dict[str, Any]) -> ParsedRequest:
    return parse_body(json.dumps({"model": "gpt-4o", **body}).encode())


def _sent(t: Translator, cap: int | None) -> tuple[dict[str, Any], int]:
    """The body that goes upstream and the most output tokens it can produce."""
    return json.loads(t.upstream_body(cap)), t.max_output(cap)


def test_chat_sets_every_cap_field_when_the_client_sent_none() -> None:
    body, most = _sent(ChatTranslator(_req({"messages": []}), ask_usage=False), 100)
    assert body["max_completion_tokens"] == body["max_tokens"] == 100
    assert most == 100


def test_chat_clamps_what_the_client_sent_and_keeps_a_lower_limit() -> None:
    t = ChatTranslator(_req({"messages": [], "max_tokens": 500}), ask_usage=False)
    body, most = _sent(t, 100)
    assert body["max_tokens"] == 100 and body["max_completion_tokens"] == 100 and most == 100
    low = ChatTranslator(_req({"messages": [], "max_tokens": 7}), ask_usage=False)
    body, most = _sent(low, 100)
    assert body["max_tokens"] == 7 and body["max_completion_tokens"] == 7 and most == 7


def test_preferred_field_only_without_write_all_caps() -> None:
    none_sent = ChatTranslator(_req({"messages": []}), ask_usage=False, write_all_caps=False)
    body, _ = _sent(none_sent, 40)
    assert body["max_completion_tokens"] == 40 and "max_tokens" not in body
    legacy = ChatTranslator(_req({"messages": [], "max_tokens": 500}), ask_usage=False,
                            write_all_caps=False)
    body, _ = _sent(legacy, 40)
    assert body["max_tokens"] == 40 and "max_completion_tokens" not in body  # never both


def test_n_shares_the_cap() -> None:
    t = ChatTranslator(_req({"messages": [], "n": 3}), ask_usage=False)
    body, most = _sent(t, 100)
    assert body["max_tokens"] == 33 and most == 99


def test_best_of_counts_as_generations() -> None:
    t = CompletionsTranslator(_req({"prompt": "x", "n": 2, "best_of": 4, "max_tokens": 500}),
                              ask_usage=False)
    body, most = _sent(t, 100)
    assert body["max_tokens"] == 25 and most == 100
    # Without max_tokens the legacy default of 16 per generation is the bound, under the cap.
    implicit = CompletionsTranslator(_req({"prompt": "x", "best_of": 4}), ask_usage=False)
    body, most = _sent(implicit, 100)
    assert body["max_tokens"] == 16 and most == 64


def test_more_choices_than_the_cap_is_a_400_naming_the_parameter() -> None:
    t = ChatTranslator(_req({"messages": [], "n": 5}), ask_usage=False)
    with pytest.raises(InvalidRequest) as err:
        t.max_output(4)
    with pytest.raises(InvalidRequest):
        t.upstream_body(4)
    assert err.value.param == "n"


def test_no_cap_changes_nothing_and_reports_the_bound() -> None:
    raw = _req({"messages": [], "max_tokens": 9})
    t = ChatTranslator(raw, ask_usage=False)
    assert t.upstream_body(None) == raw.raw  # the client's own bytes
    assert t.max_output(None) == 9
    assert ChatTranslator(_req({"messages": []}), ask_usage=False).max_output(None) == 0
    # The legacy API's documented default of 16 bounds it even without a cap field.
    assert CompletionsTranslator(_req({"prompt": "x"}), ask_usage=False).max_output(None) == 16


def test_completions_implicit_cap_is_kept_under_a_larger_cap() -> None:
    body, most = _sent(CompletionsTranslator(_req({"prompt": "x"}), ask_usage=False), 100)
    assert body["max_tokens"] == 16 and most == 16


def test_responses_cap_field() -> None:
    body, most = _sent(ResponsesTranslator(_req({"input": "hi", "max_output_tokens": 900})), 64)
    assert body["max_output_tokens"] == 64 and most == 64


@pytest.mark.parametrize(
    ("field", "value", "code"),
    [("max_tokens", "10", "invalid_type"), ("max_tokens", True, "invalid_type"),
     ("max_tokens", 2.5, "invalid_type"), ("max_tokens", 0, "integer_below_min_value"),
     ("n", -1, "integer_below_min_value"), ("max_completion_tokens", [1], "invalid_type")],
)
def test_bad_limits_are_refused_with_the_parameter(field: str, value: Any, code: str) -> None:
    t = ChatTranslator(_req({"messages": [], field: value}), ask_usage=False)
    with pytest.raises(InvalidRequest) as err:
        t.max_output(100)
    assert err.value.param == field
    assert err.value.code == code


_LIMIT = st.none() | st.integers(1, 5000)


@given(shape=st.sampled_from([ChatTranslator, CompletionsTranslator, ResponsesTranslator]),
       limits=st.tuples(_LIMIT, _LIMIT, _LIMIT), choices=st.tuples(_LIMIT, _LIMIT),
       cap=st.integers(1, 20_000), write_all_caps=st.booleans())
def test_the_body_is_the_same_under_the_output_it_allows(
    shape: type[Translator], limits: tuple[int | None, ...], choices: tuple[int | None, ...],
    cap: int, write_all_caps: bool,
) -> None:
    """Admission asks for `max_output(cap)` and the body is built with what it is granted: when
    that is all of it, the body is the one `cap` itself writes, byte for byte."""
    fields = ("max_tokens", "max_completion_tokens", "max_output_tokens")
    body: dict[str, Any] = {"prompt": "x", "input": "x", "messages": []}
    body |= {f: v for f, v in zip(fields, limits, strict=True) if v is not None}
    body |= {f: v for f, v in zip(("n", "best_of"), choices, strict=True) if v is not None}
    t = shape(_req(body), ask_usage=False, write_all_caps=write_all_caps)
    try:
        asked = t.max_output(cap)
    except InvalidRequest:  # more choices than the cap serves: refused before any body
        return
    assert 1 <= asked <= cap
    assert t.upstream_body(asked) == t.upstream_body(cap)
    assert t.max_output(asked) == asked
