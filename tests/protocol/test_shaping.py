"""Request shaping (proxy/protocol/shaping.py): the output cap each API shape writes upstream,
clamped per choice, every field or one; stream usage asked for; the serving model."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.errors import InvalidRequest
from proxy.protocol.request import ParsedRequest, parse_body
from proxy.protocol.shaping import (
    ChatShape,
    CompletionsShape,
    CountTokensShape,
    EmbeddingsShape,
    MessagesShape,
    ResponsesShape,
    Shape,
)

pytestmark = pytest.mark.unit


def _req(body: dict[str, Any]) -> ParsedRequest:
    return parse_body(json.dumps({"model": "gpt-4o", **body}).encode())


def _shape(kind: type[Shape], body: dict[str, Any], **settings: Any) -> Shape:
    """`kind` for `body`, served by the model asked for."""
    request = _req(body)
    return kind(request, request.model, **settings)


def _sent(t: Shape, cap: int | None) -> tuple[dict[str, Any], int]:
    """The body that goes upstream and the most output tokens it can produce."""
    return json.loads(t.upstream_body(cap)), t.max_output(cap)


def test_chat_sets_every_cap_field_when_the_client_sent_none() -> None:
    body, most = _sent(_shape(ChatShape, {"messages": []}, ask_usage=False), 100)
    assert body["max_completion_tokens"] == body["max_tokens"] == 100
    assert most == 100


def test_chat_clamps_what_the_client_sent_and_keeps_a_lower_limit() -> None:
    t = _shape(ChatShape, {"messages": [], "max_tokens": 500}, ask_usage=False)
    body, most = _sent(t, 100)
    assert body["max_tokens"] == 100 and body["max_completion_tokens"] == 100 and most == 100
    low = _shape(ChatShape, {"messages": [], "max_tokens": 7}, ask_usage=False)
    body, most = _sent(low, 100)
    assert body["max_tokens"] == 7 and body["max_completion_tokens"] == 7 and most == 7


def test_preferred_field_only_without_write_all_caps() -> None:
    none_sent = _shape(ChatShape, {"messages": []}, ask_usage=False, write_all_caps=False)
    body, _ = _sent(none_sent, 40)
    assert body["max_completion_tokens"] == 40 and "max_tokens" not in body
    legacy = _shape(ChatShape, {"messages": [], "max_tokens": 500}, ask_usage=False,
                            write_all_caps=False)
    body, _ = _sent(legacy, 40)
    assert body["max_tokens"] == 40 and "max_completion_tokens" not in body  # never both


def test_n_shares_the_cap() -> None:
    t = _shape(ChatShape, {"messages": [], "n": 3}, ask_usage=False)
    body, most = _sent(t, 100)
    assert body["max_tokens"] == 33 and most == 99


def test_best_of_counts_as_generations() -> None:
    t = _shape(CompletionsShape, {"prompt": "x", "n": 2, "best_of": 4, "max_tokens": 500},
                              ask_usage=False)
    body, most = _sent(t, 100)
    assert body["max_tokens"] == 25 and most == 100
    # Without max_tokens the legacy default of 16 per generation is the bound, under the cap.
    implicit = _shape(CompletionsShape, {"prompt": "x", "best_of": 4}, ask_usage=False)
    body, most = _sent(implicit, 100)
    assert body["max_tokens"] == 16 and most == 64


def test_more_choices_than_the_cap_is_a_400_naming_the_parameter() -> None:
    t = _shape(ChatShape, {"messages": [], "n": 5}, ask_usage=False)
    with pytest.raises(InvalidRequest) as err:
        t.max_output(4)
    with pytest.raises(InvalidRequest):
        t.upstream_body(4)
    assert err.value.param == "n"


def test_no_cap_changes_nothing_and_reports_the_bound() -> None:
    raw = _req({"messages": [], "max_tokens": 9})
    t = ChatShape(raw, raw.model, ask_usage=False)
    assert t.upstream_body(None) == raw.raw  # the client's own bytes
    assert t.max_output(None) == 9
    assert _shape(ChatShape, {"messages": []}, ask_usage=False).max_output(None) == 0
    # The legacy API's documented default of 16 bounds it even without a cap field.
    assert _shape(CompletionsShape, {"prompt": "x"}, ask_usage=False).max_output(None) == 16


def test_completions_implicit_cap_is_kept_under_a_larger_cap() -> None:
    body, most = _sent(_shape(CompletionsShape, {"prompt": "x"}, ask_usage=False), 100)
    assert body["max_tokens"] == 16 and most == 16


def test_responses_cap_field() -> None:
    body, most = _sent(_shape(ResponsesShape, {"input": "hi", "max_output_tokens": 900}), 64)
    assert body["max_output_tokens"] == 64 and most == 64


@pytest.mark.parametrize(
    ("field", "value", "code"),
    [("max_tokens", "10", "invalid_type"), ("max_tokens", True, "invalid_type"),
     ("max_tokens", 2.5, "invalid_type"), ("max_tokens", 0, "integer_below_min_value"),
     ("n", -1, "integer_below_min_value"), ("max_completion_tokens", [1], "invalid_type")],
)
def test_bad_limits_are_refused_with_the_parameter(field: str, value: Any, code: str) -> None:
    t = _shape(ChatShape, {"messages": [], field: value}, ask_usage=False)
    with pytest.raises(InvalidRequest) as err:
        t.max_output(100)
    assert err.value.param == field
    assert err.value.code == code


_LIMIT = st.none() | st.integers(1, 5000)


@given(shape=st.sampled_from([ChatShape, CompletionsShape, ResponsesShape]),
       limits=st.tuples(_LIMIT, _LIMIT, _LIMIT), choices=st.tuples(_LIMIT, _LIMIT),
       cap=st.integers(1, 20_000), write_all_caps=st.booleans())
def test_the_body_is_the_same_under_the_output_it_allows(
    shape: type[Shape], limits: tuple[int | None, ...], choices: tuple[int | None, ...],
    cap: int, write_all_caps: bool,
) -> None:
    """Admission asks for `max_output(cap)` and the body is built with what it is granted: when
    that is all of it, the body is the one `cap` itself writes, byte for byte."""
    fields = ("max_tokens", "max_completion_tokens", "max_output_tokens")
    body: dict[str, Any] = {"prompt": "x", "input": "x", "messages": []}
    body |= {f: v for f, v in zip(fields, limits, strict=True) if v is not None}
    body |= {f: v for f, v in zip(("n", "best_of"), choices, strict=True) if v is not None}
    t = _shape(shape, body, ask_usage=False, write_all_caps=write_all_caps)
    try:
        asked = t.max_output(cap)
    except InvalidRequest:  # more choices than the cap serves: refused before any body
        return
    assert 1 <= asked <= cap
    assert t.upstream_body(asked) == t.upstream_body(cap)
    assert t.max_output(asked) == asked


# --- stream usage and the serving model --------------------------------------------------------


def test_stream_usage_is_asked_for_and_stripped_only_when_the_client_did_not() -> None:
    streamed = {"messages": [], "stream": True}
    ours = _shape(ChatShape, streamed)
    assert ours.strips_usage and ours.expects_usage
    assert json.loads(ours.upstream_body(None))["stream_options"] == {"include_usage": True}
    # The client's other options are kept, its own request for usage is not ours to strip.
    kept = _shape(ChatShape, {**streamed, "stream_options": {"x": 1}})
    assert json.loads(kept.upstream_body(None))["stream_options"] == {"x": 1, "include_usage": True}
    theirs = _shape(CompletionsShape, {"prompt": "x", "stream": True,
                                       "stream_options": {"include_usage": True}})
    assert not theirs.strips_usage and theirs.expects_usage
    # Not asked (the upstream's stream_usage off), or not a stream: the client's bytes.
    for shape in (_shape(ChatShape, streamed, ask_usage=False), _shape(ChatShape, {"messages": []})):
        assert not shape.strips_usage and not shape.expects_usage
        assert shape.upstream_body(None) == shape.request.raw


def test_the_apis_that_always_report_usage_are_never_changed_for_it() -> None:
    responses = _shape(ResponsesShape, {"input": "hi", "stream": True})
    messages = _shape(MessagesShape, {"messages": [], "max_tokens": 9, "stream": True})
    for shape in (responses, messages):
        assert shape.expects_usage and not shape.strips_usage
        assert shape.upstream_body(None) == shape.request.raw


def test_a_fallback_model_is_written_first_of_the_changes() -> None:
    request = _req({"messages": [], "stream": True, "max_tokens": 500})
    shape = ChatShape(request, "other-model")
    sent = shape.upstream_body(100)
    assert list(json.loads(sent))[-2:] == ["stream_options", "max_completion_tokens"]
    assert json.loads(sent)["model"] == "other-model"
    assert sent.startswith(b'{"model":"other-model"')  # where the client had it


# --- other shapes ------------------------------------------------------------------------------


def test_messages_requires_max_tokens_and_count_tokens_has_no_cap() -> None:
    with pytest.raises(InvalidRequest) as caught:
        _shape(MessagesShape, {"messages": []})
    assert caught.value.param == "max_tokens"
    shape = _shape(MessagesShape, {"messages": [], "max_tokens": 5000})
    assert json.loads(shape.upstream_body(300))["max_tokens"] == 300
    assert shape.max_output(300) == 300
    count = _shape(CountTokensShape, {"messages": [{"role": "user", "content": "hi"}]})
    assert count.max_output(300) == 0 and count.upstream_body(300) == count.request.raw
    assert count.count_prompt() == 0


def test_embeddings_have_no_output_and_count_their_input() -> None:
    shape = _shape(EmbeddingsShape, {"input": ["one two", "three"]})
    assert shape.max_output(100) == 0 and shape.upstream_body(100) == shape.request.raw
    assert shape.count_prompt() == 3
    assert _shape(EmbeddingsShape, {"input": [[1, 2, 3], [4]]}).count_prompt() == 4


def test_the_prompt_counts_what_each_api_sends_as_its_prompt() -> None:
    """System prompts and tools are prompt text in Anthropic's shape; instructions in the
    Responses API's."""
    messages = [{"role": "user", "content": "hello there"}]
    bare = _shape(MessagesShape, {"messages": messages, "max_tokens": 9}).count_prompt()
    system = _shape(MessagesShape, {"messages": messages, "max_tokens": 9,
                                    "system": [{"type": "text", "text": "be brief"}]})
    assert system.count_prompt() > bare
    plain = _shape(ResponsesShape, {"input": "hello there"}).count_prompt()
    told = _shape(ResponsesShape, {"input": "hello there", "instructions": "be brief"})
    assert told.count_prompt() > plain > 0
