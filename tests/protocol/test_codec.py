"""The codecs' shared parts (proxy/protocol/codec.py): reading events that are JSON, writing
SSE events, a replay's pieces, the base codec's answers for a shape that carries no text, and
what is shared by every codec: redaction, what a capture shows, `ended` off the bytes."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from proxy.protocol.apis.chat import CODEC as CHAT
from proxy.protocol.apis.count_tokens import CODEC as COUNT_TOKENS
from proxy.protocol.apis.embeddings import CODEC as EMBEDDINGS
from proxy.protocol.apis.messages import CODEC as MESSAGES
from proxy.protocol.codec import (
    Codec,
    Shown,
    Text,
    TextKind,
    data_event,
    dumps,
    joined,
    loads,
    loads_all,
    named_event,
    pieces,
    redacted_json,
    stream_objects,
)
from proxy.protocol.codecs import CODECS, codec_for
from proxy.protocol.usage import Usage

pytestmark = pytest.mark.unit


def _upper(text: str) -> str:
    return text.upper()


def test_loads_is_an_object_or_nothing() -> None:
    assert loads(b'{"a": 1}') == {"a": 1}
    assert loads('{"a": 1}') == {"a": 1}
    assert loads(b"[1]") == {}
    assert loads(b"{") == {}


def test_loads_all_parses_each_event_whatever_the_others_are() -> None:
    assert loads_all([b'{"a":1}', b'{"b":2}']) == [{"a": 1}, {"b": 2}]
    assert loads_all([b'{"a":1}', b"3"]) == [{"a": 1}, {}]
    # One bad event, or one that is two values, leaves the others read one by one.
    assert loads_all([b'{"a":1}', b"{"]) == [{"a": 1}, {}]
    assert loads_all([b'{"a":1}', b'{"b":2},{"c":3}']) == [{"a": 1}, {}]
    assert loads_all([b'{"a":1},{"b":2}', b'{"c":3}']) == [{}, {"c": 3}]
    assert loads_all([]) == []


def test_stream_objects_are_a_whole_streams_events_or_none() -> None:
    raw = b'data: {"a":1}\n\ndata: {"b":2}\n\ndata: [DONE]\n\n'
    assert stream_objects(raw) == [{"a": 1}, {"b": 2}]
    assert stream_objects(b"") == []
    assert stream_objects(b'data: {"a":1}\n\ndata: 3\n\n') is None
    assert stream_objects(b'data: {"a":1}\n\ndata: {\n\n') is None
    assert stream_objects(b'data: {"a":1},{"b":2}\n\n') is None


def test_events_are_written_compact_and_as_utf8() -> None:
    assert dumps({"a": [1, "é"]}) == '{"a":[1,"é"]}'.encode()
    assert data_event({"a": 1}) == b'data: {"a":1}\n\n'
    assert named_event("x.y", {"a": 1}) == b'event: x.y\ndata: {"a":1}\n\n'


@pytest.mark.parametrize(("length", "sizes"), [
    (0, [0]), (1, [1]), (512, [512]), (513, [512, 1]), (1024, [512, 512]), (1025, [512, 512, 1])])
def test_a_text_is_replayed_in_pieces_of_512_characters(length: int, sizes: list[int]) -> None:
    text = "".join(chr(ord("a") + i % 26) for i in range(length))
    parts = pieces(text)
    assert [len(p) for p in parts] == sizes
    assert "".join(parts) == text


def test_joined_joins_each_texts_pieces_by_kind_and_place_in_order() -> None:
    texts = [Text(TextKind.OUTPUT, (0,), None, "", "a"),
             Text(TextKind.REASONING, (0,), None, "", "r"),
             Text(TextKind.OUTPUT, (1,), None, "", "x"),
             Text(TextKind.OUTPUT, (0,), None, "", "b")]
    assert joined(texts) == {(TextKind.OUTPUT, (0,)): "ab", (TextKind.REASONING, (0,)): "r",
                             (TextKind.OUTPUT, (1,)): "x"}
    assert list(joined(texts)) == [(TextKind.OUTPUT, (0,)), (TextKind.REASONING, (0,)),
                                   (TextKind.OUTPUT, (1,))]


def test_redacting_json_text_reaches_what_an_escape_hides() -> None:
    seen: list[str] = []

    def sub(text: str) -> str:
        seen.append(text)
        return text.replace("@", "[AT]")

    # Without an escape the text is redacted as it is.
    assert redacted_json('{"e": "a@b"}', sub) == '{"e": "a[AT]b"}'
    # An escape that hides an "@": the value is redacted, then written again.
    assert redacted_json('{"e": "a\\u0040b", "n": [1, "é"]}', sub) == (
        '{"e": "a[AT]b", "n": [1, "é"]}')
    assert redacted_json('["a\\u0040b"]', sub) == '["a[AT]b"]'
    # An escape that hides nothing: the text as it came, redacted.
    seen.clear()
    assert redacted_json('{"e": "a\\nb"}', sub) == '{"e": "a\\nb"}'
    assert seen[-1] == '{"e": "a\\nb"}'
    # Not JSON, not an object or an array, or nested too deep to decode: the text redacted.
    assert redacted_json('{"e": "a\\u0040b', sub) == '{"e": "a\\u0040b'
    assert redacted_json('"a\\u0040b@"', sub) == '"a\\u0040b[AT]"'
    deep = "[" * 100_000 + '"\\u0040@"' + "]" * 100_000
    assert redacted_json(deep, sub) == deep.replace("@", "[AT]")


class _Answers(Codec):
    """A codec whose answers have one text and one finish reason, and no finish mark."""

    operation = "test"
    natural: ClassVar[frozenset[str]] = frozenset({"done"})
    capped = "cut"
    cap_fields = ("max_a", "max_b")

    def texts(self, obj: dict[str, Any]) -> list[Text]:
        value = obj.get("text")
        return [Text(TextKind.OUTPUT, (0,), obj, "text", value)] if value else []

    def finish_reasons(self, answer: dict[str, Any]) -> list[Any]:
        return [answer["reason"]] if "reason" in answer else []

    def assemble(self, events: list[dict[str, Any]]) -> dict[str, Any] | None:
        return events[-1]


def test_a_shape_that_does_not_stream_has_no_texts_no_stream_and_no_finish() -> None:
    assert list(EMBEDDINGS.texts({"text": "x"})) == []
    assert EMBEDDINGS.assemble([{"a": 1}]) is None
    with pytest.raises(ValueError, match=r"^embeddings answers do not stream$"):
        EMBEDDINGS.replay({}, include_usage=True)
    assert EMBEDDINGS.finish_reasons({"finish_reason": "stop"}) == []
    assert not EMBEDDINGS.finished({}, capped_ok=True)
    assert not EMBEDDINGS.ended(b'{"finish_reason":"stop"}', capped_ok=True)
    assert EMBEDDINGS.asked_caps({"max_tokens": 1}) == []
    assert EMBEDDINGS.call_id({}, Text(TextKind.TOOL_NAME, (0,), {}, "name", "f")) is None
    assert not EMBEDDINGS.streams and EMBEDDINGS.capped is None
    assert EMBEDDINGS.usage({"usage": {"prompt_tokens": 3, "total_tokens": 3}}) == Usage(
        input_tokens=3)
    assert EMBEDDINGS.usage({}) is None
    assert COUNT_TOKENS.usage({"input_tokens": 9}) == Usage()


def test_the_codec_of_each_operation() -> None:
    assert set(CODECS) == {"chat", "text_completion", "responses", "embeddings", "messages",
                           "count_tokens"}
    for operation, codec in CODECS.items():
        assert codec.operation == operation and codec_for(operation) is codec
    assert codec_for("unknown") is EMBEDDINGS


def test_finished_is_every_reason_natural_or_the_clients_cap() -> None:
    codec = _Answers()
    assert codec.finished({"reason": "done"}, capped_ok=False)
    assert not codec.finished({"reason": "cut"}, capped_ok=False)
    assert codec.finished({"reason": "cut"}, capped_ok=True)
    assert not codec.finished({"reason": "other"}, capped_ok=True)
    assert not codec.finished({}, capped_ok=True)
    # Without a cap's reason, capped_ok adds none.
    assert not EMBEDDINGS._natural(capped_ok=True)
    assert codec._natural(capped_ok=False) == {"done"}


def test_ended_without_a_finish_mark_reads_the_body_or_assembles_the_stream() -> None:
    codec = _Answers()
    assert codec.ended(b'{"reason": "done"}', capped_ok=False)
    assert not codec.ended(b'{"reason": "cut"}', capped_ok=False)
    assert codec.ended(b'{"reason": "cut"}', capped_ok=True)
    assert codec.ended(b'data: {"reason": "x"}\n\ndata: {"reason": "done"}\n\n', False)
    assert not codec.ended(b'data: {"reason": "done"}\n\ndata: {"a": 1}\n\n', False)
    assert not codec.ended(b"data: {\n\n", capped_ok=True)


def test_a_finish_mark_needs_a_reason_and_every_reason_natural() -> None:
    assert not CHAT.ended(b'{"choices": []}', capped_ok=True)
    assert CHAT.ended(b'"finish_reason":"stop","finish_reason":"tool_calls"', capped_ok=False)
    assert not CHAT.ended(b'"finish_reason":"stop","finish_reason":"length"', capped_ok=False)


class _Raising(_Answers):
    def __init__(self, error: type[Exception]) -> None:
        self.error = error

    def assemble(self, events: list[dict[str, Any]]) -> dict[str, Any] | None:
        raise self.error()


def test_a_stream_is_assembled_from_its_events_framed_once() -> None:
    codec = _Answers()
    assert codec.assemble_stream(b'data: {"a": 1}\n\ndata: {"b": 2}\n\ndata: [DONE]\n\n') == {
        "b": 2}
    assert codec.assemble_stream(b"data: 1\n\n") is None


@pytest.mark.parametrize("error", [TypeError, KeyError, ValueError, AttributeError, IndexError])
def test_a_stream_of_a_shape_the_assembly_does_not_know_is_no_answer(
        error: type[Exception]) -> None:
    assert _Raising(error).assemble_stream(b'data: {"a": 1}\n\n') is None


def test_an_answers_body_is_its_compact_json_and_back() -> None:
    assert EMBEDDINGS.body({"a": [1, "é"]}) == '{"a":[1,"é"]}'.encode()
    assert EMBEDDINGS.answer_of(b'{"a": 1}') == {"a": 1}
    assert EMBEDDINGS.answer_of(b"[1]") is None
    assert EMBEDDINGS.answer_of(b"{") is None


def test_the_caps_a_request_sets_itself_in_the_codecs_order() -> None:
    codec = _Answers()
    assert codec.asked_caps({"max_b": 2, "max_a": 1, "other": 3}) == [1, 2]
    assert codec.asked_caps({"max_a": None, "max_b": 0}) == [0]
    assert codec.asked_caps({}) == []


def test_redaction_applies_to_every_text_and_leaves_the_answer_alone() -> None:
    answer: dict[str, Any] = {"content": [
        {"type": "text", "text": "hi"},
        {"type": "tool_use", "id": "t", "name": "look", "input": {"q": ["x", 1, {"k": "v"}]}}]}
    redacted = MESSAGES.redacted(answer, _upper)
    assert redacted == {"content": [
        {"type": "text", "text": "HI"},
        {"type": "tool_use", "id": "t", "name": "LOOK", "input": {"q": ["X", 1, {"k": "V"}]}}]}
    assert answer["content"][0]["text"] == "hi"
    chat = {"choices": [{"message": {"content": "a", "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": '{"e": "\\u0061"}'}}]}}]}
    redacted = CHAT.redacted(chat, _upper)
    call = redacted["choices"][0]["message"]["tool_calls"][0]
    assert redacted["choices"][0]["message"]["content"] == "A"
    # The arguments are JSON: the escape's letter is redacted as the letter it decodes to.
    assert call == {"id": "c", "function": {"name": "F", "arguments": '{"E": "A"}'}}


def test_what_a_capture_shows_of_a_stream() -> None:
    events = [
        {"choices": [{"index": 1, "delta": {"content": "b1"}}]},
        {"choices": [{"index": 0, "delta": {"content": "a1", "reasoning": "r"}}]},
        {"choices": [{"index": 1, "delta": {"content": "b2", "refusal": "no"}}]},
        {"choices": [{"index": 0, "delta": {"content": "a2", "tool_calls": [
            {"index": 0, "id": "c0", "function": {"name": "f", "arguments": "{"}},
            {"index": 1, "function": {"name": "g"}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "function": {"name": "2", "arguments": "}"}}]}}]},
    ]
    assert CHAT.shown(events) == Shown(
        text="b1b2a1a2", reasoning="r", refusal="no",
        tool_calls=({"id": "c0", "name": "f2", "arguments": "{}"}, {"name": "g"}))
    assert CHAT.shown([]) == Shown("", "", "", ())


def test_a_capture_shows_a_tool_calls_arguments_before_its_name() -> None:
    events = [{"type": "content_block_delta", "index": 0,
               "delta": {"type": "input_json_delta", "partial_json": "{}"}},
              {"type": "content_block_start", "index": 0,
               "content_block": {"type": "tool_use", "id": "t", "name": "f"}}]
    assert MESSAGES.shown(events).tool_calls == ({"arguments": "{}", "id": "t", "name": "f"},)
