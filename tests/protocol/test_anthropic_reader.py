"""The reader of Anthropic's Messages API answers (proxy/protocol/anthropic.py), on its own: which
events are content, and which usage wins."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.protocol.anthropic import CountTokensReader, MessagesReader
from proxy.protocol.readers import EventFlag
from proxy.protocol.request import parse_body
from proxy.protocol.usage import Usage

pytestmark = pytest.mark.unit

BODY = {"model": "claude-x", "max_tokens": 100, "stream": True,
        "messages": [{"role": "user", "content": "hi"}]}


def translator(**changes: Any) -> MessagesReader:
    """A reader of the answer to BODY, with `changes`."""
    return MessagesReader(parse_body(json.dumps({**BODY, **changes}).encode()), "claude-x",
                          sampled=True)


def _prompt() -> int:
    """The prompt's count the pipeline would pass: never asked for while message_start's is
    known."""
    raise AssertionError("the prompt was counted")


def event(payload: dict[str, Any]) -> tuple[bytes, str]:
    return json.dumps(payload, separators=(",", ":")).encode(), str(payload["type"])


def delta(kind: str, **fields: str) -> tuple[bytes, str]:
    return event({"type": "content_block_delta", "index": 0, "delta": {"type": kind, **fields}})


START = event({"type": "message_start", "message": {
    "id": "msg_1", "model": "claude-x-20260101", "usage": {
        "input_tokens": 5, "cache_creation_input_tokens": 20, "cache_read_input_tokens": 100,
        "output_tokens": 1}}})


def test_content_deltas_and_the_rest() -> None:
    t = translator()
    assert t.on_event(*START) == EventFlag(0)
    assert t.response_model == "claude-x-20260101"
    assert t.on_event(*event({"type": "ping"})) == EventFlag(0)
    assert t.on_event(*delta("thinking_delta", thinking="hmm")) == EventFlag.CONTENT
    assert t.on_event(*delta("signature_delta", signature="abc")) == EventFlag(0)
    assert t.on_event(*delta("text_delta", text="Hello")) == EventFlag.CONTENT
    assert t.on_event(*delta("input_json_delta", partial_json='{"a"')) == EventFlag.CONTENT
    assert not t.complete
    # Cumulative: the latest message_delta wins, and fields it leaves out keep their value.
    t.on_event(*event({"type": "message_delta", "delta": {"stop_reason": None},
                       "usage": {"output_tokens": 7}}))
    t.on_event(*event({"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                       "usage": {"output_tokens": 9, "cache_read_input_tokens": 100}}))
    assert t.on_event(*event({"type": "message_stop"})) == EventFlag.FINISH
    assert t.complete
    assert t.usage(_prompt) == Usage(input_tokens=125, output_tokens=9, cached_input_tokens=100,
                              cache_creation_input_tokens=20, cache_read_input_tokens=100)


def test_cut_before_message_delta_is_estimated() -> None:
    t = translator()
    t.on_event(*START)
    t.on_event(*delta("text_delta", text=" the of and"))
    usage = t.usage(_prompt)
    assert usage.source == "estimated"
    assert (usage.input_tokens, usage.cached_input_tokens) == (125, 100)
    assert usage.output_tokens == 3


def test_count_tokens_charges_nothing() -> None:
    body = {"model": "claude-x", "messages": BODY["messages"]}
    t = CountTokensReader(parse_body(json.dumps(body).encode()), "claude-x", sampled=True)
    t.on_body(b'{"input_tokens": 12}')
    assert not t.counts_usage()
    assert t.usage(_prompt) == Usage() and t.prompt_usage(_prompt) == Usage()


def test_an_answer_without_usage_is_estimated_from_its_blocks() -> None:
    t = translator(stream=False)
    t.on_body(json.dumps({"id": "m", "model": "claude-x-1", "content": [
        {"type": "text", "text": " the of and"},
        {"type": "tool_use", "input": {"a": 1}}]}).encode())
    assert t.response_model == "claude-x-1" and t.counts_usage()
    usage = t.usage(lambda: 11)
    assert (usage.input_tokens, usage.source) == (11, "estimated")
    assert usage.output_tokens > 3  # the text's 3 tokens and the tool input's


def test_cache_writes_by_lifetime() -> None:
    """message_start says which cache the writes went to; message_delta (cumulative, without
    `cache_creation`) leaves that split as it was."""
    t = translator()
    t.on_event(*event({"type": "message_start", "message": {"id": "m", "usage": {
        "input_tokens": 5, "cache_creation_input_tokens": 20, "cache_read_input_tokens": 100,
        "cache_creation": {"ephemeral_5m_input_tokens": 12, "ephemeral_1h_input_tokens": 8},
        "output_tokens": 1}}}))
    t.on_event(*delta("text_delta", text="Hello"))
    t.on_event(*event({"type": "message_delta", "delta": {"stop_reason": None},
                       "usage": {"output_tokens": 2, "cache_creation": None}}))
    t.on_event(*event({"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                       "usage": {"output_tokens": 4, "cache_creation_input_tokens": 20}}))
    assert t.usage(_prompt) == Usage(input_tokens=125, output_tokens=4, cached_input_tokens=100,
                              cache_creation_input_tokens=20, cache_read_input_tokens=100,
                              cache_creation_1h_input_tokens=8)


@pytest.mark.parametrize(("usage", "writes", "hour"), [
    ({"input_tokens": 1, "cache_creation_input_tokens": 30}, 30, 0),  # no split: all 5-minute
    ({"input_tokens": 1, "cache_creation_input_tokens": 30,
      "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 30}}, 30, 30),
    # Only the split: the writes are its sum.
    ({"input_tokens": 1,
      "cache_creation": {"ephemeral_5m_input_tokens": 4, "ephemeral_1h_input_tokens": 6}}, 10, 6),
    # A split that claims more 1-hour writes than writes: capped, never more than the writes.
    ({"input_tokens": 1, "cache_creation_input_tokens": 5,
      "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 9}}, 5, 5),
    ({"input_tokens": 1, "cache_creation_input_tokens": 5, "cache_creation": None}, 5, 0),
])
def test_non_streamed_cache_split(usage: dict[str, Any], writes: int, hour: int) -> None:
    t = translator(stream=False)
    t.on_body(json.dumps({"id": "m", "content": [], "usage": usage}).encode())
    got = t.usage(_prompt)
    assert (got.input_tokens, got.cache_creation_input_tokens) == (1 + writes, writes)
    assert got.cache_creation_1h_input_tokens == hour
