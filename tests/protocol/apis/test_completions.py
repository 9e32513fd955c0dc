"""The legacy Completions codec (proxy/protocol/apis/completions.py): its one text kind, a
stream's chunks assembled into the answer, an answer replayed chunk by chunk."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.protocol.apis.completions import CODEC
from proxy.protocol.codec import Text, TextKind
from proxy.protocol.sse import SSEDecoder

pytestmark = pytest.mark.unit

HEAD: dict[str, Any] = {"id": "x", "created": 7, "model": "m"}
USAGE = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}


def _chunks(raw: bytes) -> list[Any]:
    decoder = SSEDecoder()
    return [e.data if e.data == b"[DONE]" else json.loads(e.data)
            for e in [*decoder.feed(raw), *decoder.flush()]]


def _choice(index: int, text: str, finish: str | None = None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish}


@pytest.mark.parametrize("include_usage", [False, True])
def test_a_replay_is_each_choices_text_then_its_finish_then_the_usage(
        include_usage: bool) -> None:
    answer = {**HEAD, "object": "text_completion", "extra": 1, "usage": USAGE, "choices": [
        _choice(0, "ab", "stop"), {"index": 1, "text": None, "finish_reason": "length"},
        {"text": "a" * 513}]}
    raw = CODEC.replay(answer, include_usage=include_usage)
    assert raw.endswith(b"\n\ndata: [DONE]\n\n")
    *chunks, done = _chunks(raw)
    assert done == b"[DONE]"
    head = {**HEAD, "object": "text_completion"}
    extra = {"usage": None} if include_usage else {}
    expected = [{**head, "choices": [choice], **extra} for choice in (
        _choice(0, "ab"), _choice(0, "", "stop"),
        _choice(1, ""), _choice(1, "", "length"),
        _choice(0, "a" * 512), _choice(0, "a"), _choice(0, ""))]
    if include_usage:
        expected.append({**head, "choices": [], "usage": USAGE})
    assert chunks == expected
    assert _chunks(CODEC.replay({"id": "x"}, include_usage=True)) == [b"[DONE]"]


def test_a_stream_is_assembled_into_its_answer() -> None:
    head = {**HEAD, "object": "text_completion", "extra": 1}
    events = [{**head, "choices": [{"index": 1, "text": "c"}]},
              {**head, "choices": [{"index": 0, "text": "a", "logprobs": {"x": 1}}]},
              {**head, "choices": [{"index": 0, "text": "b", "finish_reason": "stop"}]},
              {**head, "choices": [{"index": 1, "text": None, "finish_reason": "length"}]},
              {**head, "choices": [], "usage": USAGE}]
    assert CODEC.assemble(events) == {**HEAD, "object": "text_completion", "choices": [
        _choice(0, "ab", "stop"), _choice(1, "c", "length")], "usage": USAGE}
    assert "usage" not in (CODEC.assemble(events[:4]) or {})
    assert CODEC.assemble([]) is None
    assert CODEC.assemble([*events, {"error": "x"}]) is None


def test_the_walker_finds_each_choices_text() -> None:
    answer = {"choices": [{"text": "a"}, {"index": 2, "text": "b"}, {"text": ""}, "junk",
                          {"text": 3}]}
    assert list(CODEC.texts(answer)) == [
        Text(TextKind.OUTPUT, (0,), answer["choices"][0], "text", "a"),
        Text(TextKind.OUTPUT, (2,), answer["choices"][1], "text", "b")]


def test_each_choices_finish_reason() -> None:
    answer = {"choices": [{"finish_reason": "stop"}, {"finish_reason": "length"}]}
    assert CODEC.finish_reasons(answer) == ["stop", "length"]
    assert CODEC.finished(answer, capped_ok=True)
    assert not CODEC.finished(answer, capped_ok=False)
    assert CODEC.ended(b'{"finish_reason": "stop"}', capped_ok=False)
