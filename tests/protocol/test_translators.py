"""The translator facade (proxy/protocol/translators.py): one object per request over a shape and a
reader, the prompt counted once for both, the tap's per-event calls the reader's own."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.errors import InvalidRequest
from proxy.protocol.anthropic import CountTokensReader
from proxy.protocol.readers import ChatReader, EventFlag
from proxy.protocol.shaping import ChatShape
from proxy.protocol.translators import (
    TRANSLATORS,
    ChatTranslator,
    CountTokensTranslator,
    MessagesTranslator,
    Translator,
    parse_body,
)
from proxy.protocol.usage import Usage

pytestmark = pytest.mark.unit


def _chat(**body: Any) -> ChatTranslator:
    raw = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi there"}], **body}
    return ChatTranslator(parse_body(json.dumps(raw).encode()), model="fallback")


def test_a_translator_is_a_shape_and_a_reader_for_the_serving_model() -> None:
    tr = _chat(stream=True)
    assert isinstance(tr.shape, ChatShape) and isinstance(tr.reader, ChatReader)
    assert tr.model == tr.shape.model == tr.reader.model == "fallback"
    assert tr.strips_usage  # the upstream's stream_usage, by default on
    assert json.loads(tr.upstream_body(50))["model"] == "fallback"
    assert tr.max_output(50) == 50 and tr.choices() == 1


def test_the_per_event_calls_are_the_readers_own() -> None:
    """The tap binds these once per stream and calls them per event: no call in between."""
    tr = _chat(stream=True)
    assert tr.on_event == tr.reader.on_event
    assert tr.take_content_run == tr.reader.take_content_run


def test_a_subclass_may_still_override_the_per_event_call() -> None:
    seen: list[bytes] = []

    class Noting(ChatTranslator):
        def on_event(self, data: bytes, name: str | None,
                     marked: bool | None = None) -> EventFlag:
            seen.append(data)
            return super().on_event(data, name, marked)

    tr = Noting(parse_body(b'{"model":"m","messages":[],"stream":true}'))
    assert tr.on_event(b'{"choices":[{"index":0,"delta":{"content":"a"}}]}', None) is (
        EventFlag.CONTENT)
    assert len(seen) == 1 and tr.seen_content


def test_the_prompt_is_counted_once_for_admission_and_settle() -> None:
    tr = _chat(stream=True)
    assert not tr.prompt_counted
    counted = tr.prompt_tokens()
    assert tr.prompt_counted and counted == tr.estimate_prompt_tokens()
    tr.on_event(b'{"choices":[{"index":0,"delta":{"content":"the"}}]}', None)
    assert tr.usage() == Usage(input_tokens=counted, output_tokens=1, source="estimated")
    assert tr.prompt_usage() == Usage(input_tokens=counted, source="estimated")


def test_the_readers_state_is_the_translators() -> None:
    tr = _chat(stream=True)
    for data in (b'{"model":"gpt-4o-x","choices":[{"index":0,"delta":{"content":"a"}}]}',
                 b'{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}',
                 b'{"choices":[],"usage":{"prompt_tokens":2,"completion_tokens":1}}',
                 b"[DONE]"):
        tr.on_event(data, None)
    assert (tr.seen_content, tr.started, tr.complete, tr.terminated) == (True,) * 4
    assert tr.response_model == "gpt-4o-x" and tr.stream_error is None
    assert tr.end_of_stream() and not tr.counts_usage()
    assert tr.usage() == Usage(input_tokens=2, output_tokens=1)
    assert tr.output_tokens_so_far() == 1


def test_the_anthropic_shapes() -> None:
    with pytest.raises(InvalidRequest):
        MessagesTranslator(parse_body(b'{"model":"claude-x","messages":[]}'))
    count = CountTokensTranslator(parse_body(b'{"model":"claude-x","messages":[]}'))
    assert isinstance(count.reader, CountTokensReader)
    count.on_body(b'{"input_tokens":3}')
    assert count.usage() == Usage() and count.prompt_usage() == Usage()


def test_every_path_is_served_once() -> None:
    shapes: tuple[type[Translator], ...] = (*TRANSLATORS, MessagesTranslator,
                                            CountTokensTranslator)
    paths = [s.path for s in shapes]
    assert len(set(paths)) == len(paths)
    assert {s.upstream_api for s in shapes} == {"openai", "anthropic"}
