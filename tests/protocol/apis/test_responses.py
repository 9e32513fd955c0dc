"""The Responses codec (proxy/protocol/apis/responses.py): its walker's texts and places, a
stream assembled from its terminal event (or its items done), and an answer replayed event by
event as OpenAI's Responses stream numbers and names them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.protocol.apis.responses import CODEC
from proxy.protocol.codec import Text, TextKind
from proxy.protocol.sse import SSEDecoder

pytestmark = pytest.mark.unit

REASONING: dict[str, Any] = {
    "type": "reasoning", "id": "rs_1",
    "summary": [{"type": "summary_text", "text": "S"}],
    "content": [{"type": "reasoning_text", "text": "R"}]}
MESSAGE: dict[str, Any] = {
    "type": "message", "id": "msg_1", "role": "assistant",
    "content": [{"type": "output_text", "text": "Hi", "annotations": []},
                {"type": "refusal", "refusal": "No"}]}
CALL: dict[str, Any] = {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "f",
                        "arguments": "{}"}
CUSTOM: dict[str, Any] = {"type": "custom_tool_call", "id": "ct_1", "call_id": "c2", "name": "g",
                          "input": "x"}
ANSWER: dict[str, Any] = {
    "id": "resp_1", "object": "response", "status": "incomplete",
    "incomplete_details": {"reason": "max_output_tokens"},
    "output": [REASONING, MESSAGE, CALL, CUSTOM],
    "usage": {"input_tokens": 1, "output_tokens": 2}}


def _events(raw: bytes) -> list[tuple[str | None, dict[str, Any]]]:
    decoder = SSEDecoder()
    return [(e.event, json.loads(e.data)) for e in [*decoder.feed(raw), *decoder.flush()]]


def _expected(events: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    """Each event named as its type, numbered in order."""
    return [(name, {"type": name, "sequence_number": n, **body})
            for n, (name, body) in enumerate(events)]


def test_a_replay_is_every_event_the_api_sends_numbered_in_order() -> None:
    rs = {"item_id": "rs_1", "output_index": 0}
    msg = {"item_id": "msg_1", "output_index": 1}
    fc = {"item_id": "fc_1", "output_index": 2}
    ct = {"item_id": "ct_1", "output_index": 3}
    summary = {**rs, "summary_index": 0}
    thought = {**rs, "content_index": 0}
    text = {**msg, "content_index": 0}
    refusal = {**msg, "content_index": 1}
    opened = {**ANSWER, "status": "in_progress", "output": [], "usage": None}
    assert _events(CODEC.replay(ANSWER, include_usage=False)) == _expected([
        ("response.created", {"response": opened}),
        ("response.output_item.added", {"output_index": 0, "item": {
            "type": "reasoning", "id": "rs_1", "summary": [], "content": []}}),
        ("response.reasoning_summary_part.added",
         {**summary, "part": {"type": "summary_text", "text": ""}}),
        ("response.reasoning_summary_text.delta", {**summary, "delta": "S"}),
        ("response.reasoning_summary_text.done", {**summary, "text": "S"}),
        ("response.reasoning_summary_part.done", {**summary, "part": REASONING["summary"][0]}),
        ("response.content_part.added",
         {**thought, "part": {"type": "reasoning_text", "text": ""}}),
        ("response.reasoning_text.delta", {**thought, "delta": "R"}),
        ("response.reasoning_text.done", {**thought, "text": "R"}),
        ("response.content_part.done", {**thought, "part": REASONING["content"][0]}),
        ("response.output_item.done", {"output_index": 0, "item": REASONING}),
        ("response.output_item.added", {"output_index": 1, "item": {
            "type": "message", "id": "msg_1", "role": "assistant", "content": []}}),
        ("response.content_part.added",
         {**text, "part": {"type": "output_text", "text": "", "annotations": []}}),
        ("response.output_text.delta", {**text, "delta": "Hi"}),
        ("response.output_text.done", {**text, "text": "Hi"}),
        ("response.content_part.done", {**text, "part": MESSAGE["content"][0]}),
        ("response.content_part.added", {**refusal, "part": {"type": "refusal", "refusal": ""}}),
        ("response.refusal.delta", {**refusal, "delta": "No"}),
        ("response.refusal.done", {**refusal, "refusal": "No"}),
        ("response.content_part.done", {**refusal, "part": MESSAGE["content"][1]}),
        ("response.output_item.done", {"output_index": 1, "item": MESSAGE}),
        ("response.output_item.added", {"output_index": 2, "item": {**CALL, "arguments": ""}}),
        ("response.function_call_arguments.delta", {**fc, "delta": "{}"}),
        ("response.function_call_arguments.done", {**fc, "arguments": "{}"}),
        ("response.output_item.done", {"output_index": 2, "item": CALL}),
        ("response.output_item.added", {"output_index": 3, "item": {**CUSTOM, "input": ""}}),
        ("response.custom_tool_call_input.delta", {**ct, "delta": "x"}),
        ("response.custom_tool_call_input.done", {**ct, "input": "x"}),
        ("response.output_item.done", {"output_index": 3, "item": CUSTOM}),
        ("response.incomplete", {"response": ANSWER}),
    ])


@pytest.mark.parametrize(("status", "terminal"), [
    ("completed", "response.completed"), ("failed", "response.failed"),
    ("incomplete", "response.incomplete"), (None, "response.completed")])
def test_a_replay_ends_in_the_terminal_event_of_the_answers_status(
        status: str | None, terminal: str) -> None:
    answer = {"id": "resp_2", "status": status, "output": [
        {"type": "message", "id": "m", "content": [{"type": "output_text"}]},
        {"type": "function_call", "id": "f", "name": "n"}]}
    events = _events(CODEC.replay(answer, include_usage=True))
    assert events[-1] == (terminal, {"type": terminal, "sequence_number": len(events) - 1,
                                     "response": answer})
    # A part or call with no text is replayed as one empty delta.
    deltas = [(name, body["delta"]) for name, body in events if name and name.endswith(".delta")]
    assert deltas == [("response.output_text.delta", ""),
                      ("response.function_call_arguments.delta", "")]
    dones = [body for name, body in events if name in (
        "response.output_text.done", "response.function_call_arguments.done")]
    assert dones[0]["text"] == "" and dones[1]["arguments"] == ""


def test_a_replay_of_a_long_text_is_several_deltas() -> None:
    answer = {"id": "r", "status": "completed", "output": [
        {"type": "message", "id": "m", "content": [{"type": "output_text", "text": "a" * 1025}]}]}
    deltas = [body["delta"] for name, body in _events(CODEC.replay(answer, include_usage=False))
              if name == "response.output_text.delta"]
    assert deltas == ["a" * 512, "a" * 512, "a"]


def test_an_answer_with_no_output_replays_its_opening_and_terminal_events() -> None:
    events = _events(CODEC.replay({"id": "r", "status": "completed"}, include_usage=False))
    assert [name for name, _ in events] == ["response.created", "response.completed"]


def test_the_walker_finds_every_text_of_an_answer_with_its_place() -> None:
    answer = {"output": [REASONING, MESSAGE, CALL, CUSTOM, "junk",
                         {"type": "message", "content": ["junk", {"text": ""}, {"text": 3}]}]}
    assert list(CODEC.texts(answer)) == [
        Text(TextKind.REASONING, (0, "summary", 0), REASONING["summary"][0], "text", "S"),
        Text(TextKind.REASONING, (0, "content", 0), REASONING["content"][0], "text", "R"),
        Text(TextKind.OUTPUT, (1, "content", 0), MESSAGE["content"][0], "text", "Hi"),
        Text(TextKind.REFUSAL, (1, "content", 1), MESSAGE["content"][1], "refusal", "No"),
        Text(TextKind.TOOL_NAME, (2,), CALL, "name", "f"),
        Text(TextKind.TOOL_ARGS, (2,), CALL, "arguments", "{}"),
        Text(TextKind.TOOL_NAME, (3,), CUSTOM, "name", "g"),
        Text(TextKind.TOOL_ARGS, (3,), CUSTOM, "input", "x"),
    ]
    # A reasoning item's refusal-typed part is still reasoning; parts not a list are none.
    odd = {"type": "reasoning", "summary": "S", "content": [{"refusal": "r"}]}
    assert [t.kind for t in CODEC.texts({"output": [odd]})] == [TextKind.REASONING]
    after = {"type": "message", "content": ["junk", {"type": "output_text", "text": "t"}]}
    assert [t.at for t in CODEC.texts({"output": [after]})] == [(0, "content", 1)]
    assert list(CODEC.texts({"output": "x"})) == []
    assert list(CODEC.texts({})) == []
    assert list(CODEC.texts({"output": [{"type": "function_call", "name": "", "arguments": ""}]})) == []


@pytest.mark.parametrize(("kind", "text_kind", "at"), [
    ("response.output_text.delta", TextKind.OUTPUT, (2, "content", 1)),
    ("response.refusal.delta", TextKind.REFUSAL, (2, "content", 1)),
    ("response.reasoning_text.delta", TextKind.REASONING, (2, "content", 1)),
    ("response.reasoning_summary_text.delta", TextKind.REASONING, (2, "summary", 3)),
    ("response.function_call_arguments.delta", TextKind.TOOL_ARGS, (2,)),
    ("response.custom_tool_call_input.delta", TextKind.TOOL_ARGS, (2,)),
    ("response.output_audio_transcript.delta", TextKind.OUTPUT, (2, "audio", 0)),
])
def test_the_walker_finds_each_delta_events_text(kind: str, text_kind: TextKind,
                                                 at: tuple[Any, ...]) -> None:
    event = {"type": kind, "output_index": 2, "content_index": 1, "summary_index": 3,
             "delta": "d"}
    assert list(CODEC.texts(event)) == [Text(text_kind, at, event, "delta", "d")]
    assert list(CODEC.texts({**event, "delta": ""})) == []
    assert list(CODEC.texts({**event, "delta": 5})) == []


def test_a_delta_without_its_part_index_is_the_first_part() -> None:
    event = {"type": "response.output_text.delta", "output_index": 0, "delta": "d"}
    assert [t.at for t in CODEC.texts(event)] == [(0, "content", 0)]


def test_an_item_added_names_its_tool_and_nothing_else() -> None:
    added = {"type": "response.output_item.added", "output_index": 4,
             "item": {**CALL, "arguments": "{}"}}
    assert list(CODEC.texts(added)) == [
        Text(TextKind.TOOL_NAME, (4,), added["item"], "name", "f")]
    assert list(CODEC.texts({**added, "item": MESSAGE})) == []
    assert list(CODEC.texts({**added, "item": "x"})) == []
    # Other events carry no text, even with an `output` of their own.
    assert list(CODEC.texts({"type": "response.output_item.done", "item": CALL,
                             "output": [CALL]})) == []
    assert list(CODEC.texts({"type": 3, "output": [CALL]})) != []


def test_the_finish_reason_is_the_status_or_why_it_is_incomplete() -> None:
    assert CODEC.finish_reasons({"status": "completed"}) == ["completed"]
    assert CODEC.finish_reasons({}) == []
    assert CODEC.finish_reasons({"status": "incomplete", "incomplete_details": {
        "reason": "max_output_tokens"}}) == ["max_output_tokens"]
    assert CODEC.finish_reasons({"status": "incomplete", "incomplete_details": {
        "reason": "content_filter"}}) == ["content_filter"]
    assert CODEC.finish_reasons({"status": "incomplete", "incomplete_details": "x"}) == [None]
    assert CODEC.finished({"status": "incomplete", "incomplete_details": {
        "reason": "max_output_tokens"}}, capped_ok=True)


def test_a_stream_is_its_terminal_events_response() -> None:
    response = {"id": "r", "status": "completed", "output": [MESSAGE]}
    events: list[dict[str, Any]] = [{"type": "response.created", "response": {"output": []}},
              {"type": "response.output_item.done", "output_index": 0, "item": CALL},
              {"type": "response.completed", "response": response},
              {"type": "response.failed", "response": {"id": "later"}}]
    assert CODEC.assemble(events) == response
    for terminal in ("response.incomplete", "response.failed"):
        assert CODEC.assemble([{"type": terminal, "response": response}]) == response
    assert CODEC.assemble([{"type": "response.completed", "response": "x"}]) is None
    assert CODEC.assemble([{"type": "error"}, *events]) is None
    assert CODEC.assemble(events[:2]) is None


def test_a_terminal_response_without_output_takes_the_items_done_in_order() -> None:
    events: list[dict[str, Any]] = [
              {"type": "response.output_item.done", "output_index": 1, "item": CALL},
              {"type": "response.output_item.done", "output_index": 0, "item": MESSAGE},
              {"type": "response.output_item.done", "output_index": 2, "item": "x"},
              {"type": "response.completed", "response": {"id": "r", "output": []}}]
    assert CODEC.assemble(events) == {"id": "r", "output": [MESSAGE, CALL]}
    # Items done without an index are numbered as they came.
    unnumbered: list[dict[str, Any]] = [{"type": "response.output_item.done", "item": MESSAGE},
                  {"type": "response.output_item.done", "item": CALL},
                  {"type": "response.completed", "response": {"id": "r"}}]
    assert CODEC.assemble(unnumbered) == {"id": "r", "output": [MESSAGE, CALL]}
    # The response's own output wins; with no items done an empty output stays as it is.
    assert CODEC.assemble([events[0], {"type": "response.completed", "response": {
        "output": [MESSAGE]}}]) == {"output": [MESSAGE]}
    assert CODEC.assemble([{"type": "response.completed", "response": {
        "output": []}}]) == {"output": []}
