"""The Messages codec (proxy/protocol/apis/messages.py): its walker's texts and places, a
stream's events assembled into the message, a message replayed block by block as Anthropic's
stream sends it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.protocol.apis.messages import CODEC
from proxy.protocol.codec import Text, TextKind
from proxy.protocol.sse import SSEDecoder
from proxy.protocol.usage import Usage

pytestmark = pytest.mark.unit

CITATION = {"type": "char_location", "cited_text": "c"}
BLOCKS: list[dict[str, Any]] = [
    {"type": "thinking", "thinking": "hm", "signature": "sig"},
    {"type": "text", "text": "Hi", "citations": [CITATION]},
    {"type": "text", "text": "Yo"},
    {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"q": 1}},
    {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {}},
    {"type": "redacted_thinking", "data": "abc"},
]
MESSAGE: dict[str, Any] = {
    "id": "msg_1", "type": "message", "role": "assistant", "model": "claude",
    "content": BLOCKS, "stop_reason": "tool_use", "stop_sequence": None,
    "usage": {"input_tokens": 9, "output_tokens": 30}}


def _events(raw: bytes) -> list[tuple[str | None, dict[str, Any]]]:
    decoder = SSEDecoder()
    return [(e.event, json.loads(e.data)) for e in [*decoder.feed(raw), *decoder.flush()]]


def _named(name: str, **body: Any) -> tuple[str, dict[str, Any]]:
    return name, {"type": name, **body}


def _delta(index: int, **delta: Any) -> tuple[str, dict[str, Any]]:
    return _named("content_block_delta", index=index, delta=delta)


def test_a_replay_is_every_event_the_api_sends() -> None:
    start = {**MESSAGE, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": 9, "output_tokens": 1}}
    blocks = [
        {"type": "thinking", "thinking": "", "signature": ""},
        {"type": "text", "text": "", "citations": []},
        {"type": "text", "text": ""},
        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}},
        {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {}},
        BLOCKS[5],
    ]
    deltas: list[list[tuple[str, dict[str, Any]]]] = [
        [_delta(0, type="thinking_delta", thinking="hm"),
         _delta(0, type="signature_delta", signature="sig")],
        [_delta(1, type="text_delta", text="Hi"),
         _delta(1, type="citations_delta", citation=CITATION)],
        [_delta(2, type="text_delta", text="Yo")],
        [_delta(3, type="input_json_delta", partial_json='{"q":1}')],
        [_delta(4, type="input_json_delta", partial_json="{}")],
        [],
    ]
    expected = [_named("message_start", message=start)]
    for index, block in enumerate(blocks):
        expected.append(_named("content_block_start", index=index, content_block=block))
        expected += deltas[index]
        expected.append(_named("content_block_stop", index=index))
    expected += [_named("message_delta", delta={"stop_reason": "tool_use", "stop_sequence": None},
                        usage=MESSAGE["usage"]),
                 _named("message_stop")]
    assert _events(CODEC.replay(MESSAGE, include_usage=False)) == expected


def test_a_replay_fills_in_what_a_message_leaves_out() -> None:
    message = {"id": "m", "stop_sequence": "END", "content": [
        {"type": "text", "text": "a" * 513, "citations": None},
        {"type": "thinking", "thinking": "t"},
        {"type": "text"}, {"type": "tool_use", "name": "f"}, {"type": "thinking"}]}
    events = _events(CODEC.replay(message, include_usage=True))
    assert events[0] == _named("message_start", message={
        **message, "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"output_tokens": 1}})
    assert [body.get("delta") for _, body in events[1:-2]] == [
        None, {"type": "text_delta", "text": "a" * 512}, {"type": "text_delta", "text": "a"},
        None,
        None, {"type": "thinking_delta", "thinking": "t"},
        {"type": "signature_delta", "signature": ""}, None,
        None, {"type": "text_delta", "text": ""}, None,
        None, {"type": "input_json_delta", "partial_json": "{}"}, None,
        None, {"type": "thinking_delta", "thinking": ""},
        {"type": "signature_delta", "signature": ""}, None]
    assert events[1][1]["content_block"] == {"type": "text", "text": "", "citations": []}
    assert events[-2] == _named("message_delta", delta={"stop_reason": None,
                                                        "stop_sequence": "END"}, usage={})
    assert [name for name, _ in _events(CODEC.replay({}, include_usage=False))] == [
        "message_start", "message_delta", "message_stop"]


def _stream(message: dict[str, Any]) -> list[dict[str, Any]]:
    return [body for _, body in _events(CODEC.replay(message, include_usage=False))]


def test_a_stream_is_assembled_into_its_message() -> None:
    events = _stream(MESSAGE)
    assert CODEC.assemble(events) == MESSAGE
    # The usage of message_start is completed by message_delta's, field by field.
    events[0]["message"]["usage"] = {"input_tokens": 9, "output_tokens": 1,
                                     "cache_read_input_tokens": 4}
    answer = CODEC.assemble(events)
    assert answer is not None
    assert answer["usage"] == {"input_tokens": 9, "output_tokens": 30,
                               "cache_read_input_tokens": 4}


def test_pieces_of_a_block_are_joined_and_an_empty_input_is_an_object() -> None:
    events: list[dict[str, Any]] = [
        {"type": "message_start", "message": {"id": "m", "content": ["x"], "usage": None}},
        {"type": "content_block_start", "index": 1, "content_block": {"type": "tool_use"}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "thinking"}},
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "thinking_delta", "thinking": "a"}},
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "thinking_delta", "thinking": "b"}},
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "signature_delta", "signature": "s"}},
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "signature_delta", "signature": "t"}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "unknown_delta"}},
        {"type": "content_block_start", "index": 2, "content_block": {"type": "text"}},
        {"type": "content_block_delta", "index": 2,
         "delta": {"type": "citations_delta", "citation": 1}},
        {"type": "content_block_delta", "index": 2,
         "delta": {"type": "citations_delta", "citation": 2}},
        {"type": "content_block_delta", "index": 2, "delta": {"type": "text_delta", "text": "x"}},
        {"type": "content_block_delta", "index": 2, "delta": {"type": "text_delta", "text": "y"}},
        {"type": "content_block_start", "index": 3, "content_block": {"type": "tool_use"}},
        {"type": "content_block_delta", "index": 3,
         "delta": {"type": "input_json_delta", "partial_json": '{"a"'}},
        {"type": "content_block_delta", "index": 3,
         "delta": {"type": "input_json_delta", "partial_json": ":1}"}},
        {"type": "content_block_delta", "index": 1,
         "delta": {"type": "input_json_delta", "partial_json": ""}},
        {"type": "message_delta"},
        {"type": "message_stop"},
    ]
    assert CODEC.assemble(events) == {"id": "m", "usage": {}, "content": [
        {"type": "thinking", "thinking": "ab", "signature": "st"},
        {"type": "tool_use", "input": {}},
        {"type": "text", "citations": [1, 2], "text": "xy"},
        {"type": "tool_use", "input": {"a": 1}}]}


def test_assembling_a_stream_leaves_its_events_as_they_were() -> None:
    events = _stream(MESSAGE)
    before = json.loads(json.dumps(events))
    assert CODEC.assemble(events) == MESSAGE
    assert events == before


def test_a_stream_cut_failed_or_without_its_start_is_no_message() -> None:
    events = _stream(MESSAGE)
    assert CODEC.assemble(events[:-1]) is None
    assert CODEC.assemble(events[1:]) is None
    assert CODEC.assemble([*events[:3], {"type": "error"}, *events[3:]]) is None
    # A message_delta before message_start is not applied to it.
    assert CODEC.assemble([{"type": "message_delta", "delta": {"stop_reason": "x"}},
                           *events]) == MESSAGE


def test_the_walker_finds_every_text_of_a_message_with_its_place() -> None:
    message = {"content": [*BLOCKS, "junk", {"type": "tool_use", "name": "", "input": None},
                           {"type": "text", "text": ""}, {"type": "tool_use", "name": "g"}]}
    assert list(CODEC.texts(message)) == [
        Text(TextKind.REASONING, (0,), BLOCKS[0], "thinking", "hm"),
        Text(TextKind.OUTPUT, (1,), BLOCKS[1], "text", "Hi"),
        Text(TextKind.OUTPUT, (2,), BLOCKS[2], "text", "Yo"),
        Text(TextKind.TOOL_NAME, (3,), BLOCKS[3], "name", "f"),
        Text(TextKind.TOOL_ARGS, (3,), BLOCKS[3], "input", '{"q":1}'),
        Text(TextKind.TOOL_NAME, (4,), BLOCKS[4], "name", "web_search"),
        Text(TextKind.TOOL_ARGS, (4,), BLOCKS[4], "input", "{}"),
        Text(TextKind.TOOL_ARGS, (7,), message["content"][7], "input", "null"),
        Text(TextKind.TOOL_NAME, (9,), message["content"][9], "name", "g"),
    ]
    assert list(CODEC.texts({"content": "x"})) == []


def test_the_walker_finds_the_texts_of_a_streams_events() -> None:
    start = {"type": "content_block_start", "index": 3, "content_block": BLOCKS[3]}
    assert list(CODEC.texts(start)) == [Text(TextKind.TOOL_NAME, (3,), BLOCKS[3], "name", "f")]
    opened = {"type": "content_block_start", "index": 1, "content_block": {"text": "x"}}
    assert [t.kind for t in CODEC.texts(opened)] == [TextKind.OUTPUT]
    assert list(CODEC.texts({"type": "content_block_start", "content_block": "x"})) == []
    for kind, field, text_kind in (("text_delta", "text", TextKind.OUTPUT),
                                   ("thinking_delta", "thinking", TextKind.REASONING),
                                   ("input_json_delta", "partial_json", TextKind.TOOL_ARGS)):
        delta = {"type": kind, field: "p"}
        event = {"type": "content_block_delta", "index": 2, "delta": delta}
        assert list(CODEC.texts(event)) == [Text(text_kind, (2,), delta, field, "p")]
        assert list(CODEC.texts({**event, "delta": {"type": kind, field: ""}})) == []
        assert list(CODEC.texts({**event, "delta": {"type": kind, field: 1}})) == []
    odd: tuple[Any, ...] = ({"type": "signature_delta", "signature": "s"}, {"text": "t"}, "x", None)
    for delta in odd:
        assert list(CODEC.texts({"type": "content_block_delta", "delta": delta})) == []


def test_the_finish_reason_and_usage_of_a_message() -> None:
    assert CODEC.finish_reasons({"stop_reason": None}) == [None]
    assert CODEC.finish_reasons({}) == []
    assert CODEC.usage(MESSAGE) == Usage(input_tokens=9, output_tokens=30)
    for reason, ended in (("end_turn", True), ("stop_sequence", True), ("tool_use", True),
                          ("max_tokens", False), ("refusal", False)):
        assert CODEC.finished({"stop_reason": reason}, capped_ok=False) is ended
        assert CODEC.ended(b'"stop_reason" : "' + reason.encode() + b'"', False) is ended
    assert CODEC.finished({"stop_reason": "max_tokens"}, capped_ok=True)


def test_the_id_of_a_tool_calls_text_is_its_blocks() -> None:
    text = Text(TextKind.TOOL_NAME, (3,), BLOCKS[3], "name", "f")
    assert CODEC.call_id({"content_block": BLOCKS[3]}, text) == "toolu_1"
    assert CODEC.call_id({"content_block": {"id": 1}}, text) is None
    assert CODEC.call_id({"content_block": "x"}, text) is None
    assert CODEC.call_id({}, text) is None
