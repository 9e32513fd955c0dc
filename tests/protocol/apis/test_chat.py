"""The Chat Completions codec (proxy/protocol/apis/chat.py): its walker's texts and places, a
stream's chunks assembled into the answer, an answer replayed chunk by chunk, the id of the
tool call a streamed text belongs to."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.protocol.apis.chat import CODEC
from proxy.protocol.codec import Text, TextKind
from proxy.protocol.sse import SSEDecoder

pytestmark = pytest.mark.unit

HEAD: dict[str, Any] = {"id": "c1", "created": 7, "model": "m", "system_fingerprint": "fp",
                        "service_tier": "default"}
CALL: dict[str, Any] = {"id": "t1", "type": "function",
                        "function": {"name": "f", "arguments": "{}"}}
USAGE = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
ANSWER: dict[str, Any] = {
    **HEAD, "object": "chat.completion",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "Hi", "reasoning_content": "rc",
                                 "reasoning": "r", "refusal": "no", "tool_calls": [CALL]},
         "logprobs": None, "finish_reason": "tool_calls"},
        {"index": 1, "message": {"role": "assistant", "content": None},
         "logprobs": None, "finish_reason": "length"}],
    "usage": USAGE}


def _chunks(raw: bytes) -> list[Any]:
    decoder = SSEDecoder()
    events = [*decoder.feed(raw), *decoder.flush()]
    assert all(e.event is None for e in events)
    return [e.data if e.data == b"[DONE]" else json.loads(e.data) for e in events]


def _choice(index: int, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}


@pytest.mark.parametrize("include_usage", [False, True])
def test_a_replay_is_a_chunk_per_text_each_choice_then_the_usage(include_usage: bool) -> None:
    raw = CODEC.replay({**ANSWER, "extra": 1}, include_usage=include_usage)
    assert raw.endswith(b"\n\ndata: [DONE]\n\n")
    *chunks, done = _chunks(raw)
    assert done == b"[DONE]"
    head = {**HEAD, "object": "chat.completion.chunk"}
    extra = {"usage": None} if include_usage else {}
    expected = [{**head, "choices": [choice], **extra} for choice in (
        _choice(0, {"role": "assistant", "content": ""}),
        _choice(0, {"reasoning_content": "rc"}),
        _choice(0, {"reasoning": "r"}),
        _choice(0, {"content": "Hi"}),
        _choice(0, {"refusal": "no"}),
        _choice(0, {"tool_calls": [{"index": 0, **CALL}]}),
        _choice(0, {}, "tool_calls"),
        _choice(1, {"role": "assistant", "content": None}),
        _choice(1, {}, "length"),
    )]
    if include_usage:
        expected.append({**head, "choices": [], "usage": USAGE})
    assert chunks == expected


def test_a_replay_fills_in_what_an_answer_leaves_out() -> None:
    answer = {"id": "c", "choices": [
        {"message": {"content": "a" * 513, "tool_calls": [CALL, CALL]}},
        {"index": 3}, {"index": 4, "message": {"role": "other"}}]}
    *chunks, _ = _chunks(CODEC.replay(answer, include_usage=True))
    assert [c["choices"] for c in chunks] == [
        [_choice(0, {"role": "assistant", "content": ""})],
        [_choice(0, {"content": "a" * 512})], [_choice(0, {"content": "a"})],
        [_choice(0, {"tool_calls": [{"index": 0, **CALL}]})],
        [_choice(0, {"tool_calls": [{"index": 1, **CALL}]})],
        [_choice(0, {})],
        [_choice(3, {"role": "assistant", "content": None})], [_choice(3, {})],
        [_choice(4, {"role": "other", "content": None})], [_choice(4, {})]]
    # No usage chunk without a usage, even when asked.
    assert all(c["usage"] is None for c in chunks)
    assert _chunks(CODEC.replay({"id": "c"}, include_usage=False)) == [b"[DONE]"]


def test_a_stream_is_assembled_into_its_answer() -> None:
    head = {**HEAD, "object": "chat.completion.chunk", "extra": "x"}
    events = [
        {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {**head, "choices": [{"index": 0, "delta": {"reasoning_content": "r"}}]},
        {**head, "choices": [{"index": 0, "delta": {"reasoning_content": "c"}}]},
        {**head, "choices": [{"index": 0, "delta": {"reasoning": "t"}}]},
        {**head, "choices": [{"index": 0, "delta": {"content": "H"}}]},
        {**head, "choices": [{"index": 0, "delta": {"content": "i"}}]},
        {**head, "choices": [{"index": 1, "delta": {"refusal": "n", "role": ""}}]},
        {**head, "choices": [{"index": 1, "delta": {"refusal": "o", "content": None}}]},
        {**head, "choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 1, "id": "t2", "type": "function", "function": {"name": "g"}}]}}]},
        {**head, "choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "t1", "function": {"name": "f", "arguments": "{"}}]}}]},
        {**head, "choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": "}"}}]}}]},
        {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        {**head, "choices": [{"index": 1, "delta": {}, "finish_reason": ""}]},
        {**head, "choices": [], "usage": None},
        {**head, "choices": [], "usage": USAGE},
        {**head, "choices": []},
    ]
    assert CODEC.assemble(events) == {
        **HEAD, "object": "chat.completion",
        "choices": [
            {"index": 0, "message": {
                "role": "assistant", "content": "Hi", "reasoning_content": "rc",
                "reasoning": "t", "tool_calls": [
                    {"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                    {"id": "t2", "type": "function", "function": {"name": "g", "arguments": ""}},
                ]}, "logprobs": None, "finish_reason": "tool_calls"},
            {"index": 1, "message": {"role": "assistant", "content": None, "refusal": "no"},
             "logprobs": None, "finish_reason": None}],
        "usage": USAGE}


def test_a_choices_role_and_an_empty_content_are_kept() -> None:
    events = [{"choices": [{"delta": {"role": "other", "content": ""}}]},
              {"choices": [{"delta": {"content": ""}}]}]
    answer = CODEC.assemble(events)
    assert answer is not None
    assert answer["choices"][0]["message"] == {"role": "other", "content": ""}


def test_a_delta_with_content_and_more_is_read_whole() -> None:
    events = [{"choices": [{"delta": {"content": "a"}}]},
              {"choices": [{"delta": {"content": "b", "reasoning": "r"}}]}]
    answer = CODEC.assemble(events)
    assert answer is not None
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": "ab",
                                               "reasoning": "r"}


def test_a_tool_call_without_index_or_type_is_the_next_one() -> None:
    events = [{"choices": [{"delta": {"tool_calls": [
        {"id": "a", "type": "custom", "function": {"name": "f", "arguments": None}},
        {"function": None}]}}]}]
    assert CODEC.assemble(events) == {"object": "chat.completion", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [
            {"id": "a", "type": "custom", "function": {"name": "f", "arguments": ""}},
            {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}]},
         "logprobs": None, "finish_reason": None}]}


def test_a_first_content_piece_alone_opens_its_choice() -> None:
    events = [{"choices": [{"index": 2, "delta": {"content": "a"}}]},
              {"choices": [{"index": 2, "delta": {"content": "b"}}]}]
    answer = CODEC.assemble(events)
    assert answer is not None
    assert answer["choices"] == [{"index": 2, "message": {"role": "assistant", "content": "ab"},
                                  "logprobs": None, "finish_reason": None}]
    assert "usage" not in answer


def test_a_stream_without_choices_or_with_an_error_is_no_answer() -> None:
    assert CODEC.assemble([]) is None
    assert CODEC.assemble([{"id": "c", "choices": []}, {"usage": USAGE}]) is None
    ok = {"choices": [{"delta": {"content": "a"}}]}
    assert CODEC.assemble([ok, {"error": {"message": "x"}}]) is None


def test_the_walker_finds_every_text_of_a_message_with_its_place() -> None:
    message: dict[str, Any] = {"role": "assistant", "content": "c", "reasoning_content": "rc", "reasoning": "r",
               "refusal": "no", "tool_calls": [CALL, {"index": 5, "function": {"name": "g"}},
                                               "junk", {"function": "x"},
                                               {"function": {"name": "", "arguments": [1]}},
                                               {"function": {"name": 5, "arguments": ""}}],
               "function_call": {"name": "h", "arguments": "a"}}
    answer: dict[str, Any] = {"choices": [{"index": 1, "message": message}, "junk", {"message": "x"},
                          {"message": {"content": ""}}]}
    assert list(CODEC.texts(answer)) == [
        Text(TextKind.OUTPUT, (1, "content"), message, "content", "c"),
        Text(TextKind.REASONING, (1, "reasoning_content"), message, "reasoning_content", "rc"),
        Text(TextKind.REASONING, (1, "reasoning"), message, "reasoning", "r"),
        Text(TextKind.REFUSAL, (1, "refusal"), message, "refusal", "no"),
        Text(TextKind.TOOL_NAME, (1, "tool", 0), CALL["function"], "name", "f"),
        Text(TextKind.TOOL_ARGS, (1, "tool", 0), CALL["function"], "arguments", "{}"),
        Text(TextKind.TOOL_NAME, (1, "tool", 5), message["tool_calls"][1]["function"], "name",
             "g"),
        Text(TextKind.TOOL_NAME, (1, "function_call"), message["function_call"], "name", "h"),
        Text(TextKind.TOOL_ARGS, (1, "function_call"), message["function_call"], "arguments",
             "a"),
    ]
    assert list(CODEC.texts({"choices": "x"})) == []


def test_the_walker_reads_a_delta_before_a_message() -> None:
    delta = {"content": "d"}
    chunk = {"choices": [{"delta": delta, "message": {"content": "m"}}]}
    assert list(CODEC.texts(chunk)) == [Text(TextKind.OUTPUT, (0, "content"), delta, "content",
                                              "d")]
    fallback = {"choices": [{"delta": None, "message": {"content": "m"}}]}
    assert [t.text for t in CODEC.texts(fallback)] == ["m"]


@pytest.mark.parametrize("piece", ["", "p"])
def test_a_chunk_of_one_content_piece_is_read_like_any_other(piece: str) -> None:
    for choice in ({"delta": {"content": piece}}, {"index": 3, "delta": {"content": piece}}):
        expected = [Text(TextKind.OUTPUT, (choice.get("index", 0), "content"), choice["delta"],
                         "content", piece)] if piece else []
        assert list(CODEC.texts({"choices": [choice]})) == expected
    # Not a piece of content alone: the general walk.
    assert [t.field for t in CODEC.texts({"choices": [{"delta": {"refusal": "r"}}]})] == [
        "refusal"]
    assert list(CODEC.texts({"choices": [{"delta": {"content": None}}]})) == []
    assert list(CODEC.texts({"choices": ["junk"]})) == []
    both = {"choices": [{"delta": {"content": "a", "reasoning": "r"}}]}
    assert [t.field for t in CODEC.texts(both)] == ["content", "reasoning"]
    two = {"choices": [{"delta": {"content": "a"}}, {"index": 1, "delta": {"content": "b"}}]}
    assert [t.at for t in CODEC.texts(two)] == [(0, "content"), (1, "content")]


def test_each_choices_finish_reason() -> None:
    assert CODEC.finish_reasons({"choices": [{"finish_reason": "stop"}, {}, "x"]}) == [
        "stop", None, None]
    assert CODEC.finish_reasons({"choices": None}) == []
    assert CODEC.finished(ANSWER, capped_ok=True)
    assert not CODEC.finished(ANSWER, capped_ok=False)


def test_the_id_of_a_streamed_tool_calls_text() -> None:
    chunk = {"choices": [
        {"index": 0, "delta": {"tool_calls": [{"index": 1, "id": "other"}]}},
        "junk",
        {"index": 1, "delta": {"tool_calls": [
            {"index": 0, "id": "zero"}, "junk", {"index": 1, "id": 5}, {"index": 1, "id": "one"}]}},
    ]}
    texts = {t.at: t for t in CODEC.texts({"choices": [{"index": 1, "delta": {"tool_calls": [
        {"index": 1, "function": {"name": "f"}}]}}]})}
    assert CODEC.call_id(chunk, texts[(1, "tool", 1)]) == "one"
    text = Text(TextKind.TOOL_NAME, (0, "tool", 1), {}, "name", "f")
    assert CODEC.call_id(chunk, text) == "other"
    # A call without an index is the n-th; a message is read where there is no delta.
    answer = {"choices": [{"message": {"tool_calls": [{"id": "a"}, {"id": "b"}]}}]}
    assert CODEC.call_id(answer, text) == "b"
    assert CODEC.call_id(answer, Text(TextKind.TOOL_NAME, (1, "tool", 1), {}, "name", "f")) is None
    assert CODEC.call_id(chunk, Text(TextKind.TOOL_NAME, (0, "function_call"), {}, "name",
                                     "f")) is None
    assert CODEC.call_id({"choices": [{"delta": None}]}, text) is None


@pytest.mark.parametrize(("raw", "capped_ok", "ended"), [
    (b'{"finish_reason" :  "stop"}', False, True),
    (b'{"finish_reason":"length"}', False, False),
    (b'{"finish_reason":"length"}', True, True),
    (b'{"finish_reason":"stop"} {"finish_reason":"length"}', False, False),
    (b'{"finish_reason":null}', True, False),
])
def test_ended_reads_every_finish_reason_off_the_bytes(raw: bytes, capped_ok: bool,
                                                       ended: bool) -> None:
    assert CODEC.ended(raw, capped_ok) is ended
