"""The readers of the OpenAI shapes' answers (proxy/protocol/readers.py), on their own: events in,
flags and usage out; a run of content taken in one step as event by event."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.protocol.readers import (
    ChatReader,
    CompletionsReader,
    EventFlag,
    Reader,
    ResponsesReader,
    carries_usage,
)
from proxy.protocol.request import parse_body
from proxy.protocol.usage import Usage

pytestmark = pytest.mark.unit

CONTENT, FINISH, USAGE_ONLY, NOTHING = (EventFlag.CONTENT, EventFlag.FINISH,
                                        EventFlag.USAGE_ONLY, EventFlag(0))


def _reader(kind: type[Reader], sampled: bool = False, **body: Any) -> Reader:
    request = parse_body(json.dumps({"model": "gpt-4o", "stream": True, **body}).encode())
    return kind(request, request.model, sampled=sampled)


def _chunk(delta: dict[str, Any], finish: str | None = None, index: int = 0) -> bytes:
    return json.dumps({"model": "gpt-4o-2024", "choices": [
        {"index": index, "delta": delta, "finish_reason": finish}]},
        separators=(",", ":")).encode()


def _prompt() -> int:
    return 7


def test_chat_events_and_their_flags() -> None:
    r = _reader(ChatReader)
    assert r.on_event(_chunk({"role": "assistant", "content": ""}), None) is NOTHING
    assert r.response_model == "gpt-4o-2024" and r.started and not r.seen_content
    assert r.on_event(_chunk({"content": "Hello"}), None) is CONTENT
    assert r.on_event(_chunk({"content": " world"}), None) is CONTENT  # the substring path
    assert r.on_event(_chunk({}, "stop"), None) == FINISH
    assert r.complete  # every choice asked for finished, even before [DONE]
    usage = b'{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}'
    assert carries_usage(usage) and r.on_event(usage, None) == USAGE_ONLY
    assert r.on_event(b"[DONE]", None) is NOTHING and r.terminated
    assert r.usage(_prompt) == Usage(input_tokens=3, output_tokens=2)
    assert not r.counts_usage()


def test_a_stream_with_n_choices_is_complete_when_all_finished() -> None:
    r = _reader(ChatReader, n=2)
    r.on_event(_chunk({"content": "a"}, "stop", index=0), None)
    assert not r.complete
    r.on_event(_chunk({"content": "b"}, "length", index=1), None)
    assert r.complete


def test_a_cut_stream_is_estimated_and_an_empty_one_charged_nothing() -> None:
    r = _reader(ChatReader)
    r.on_event(_chunk({"content": " the of and"}), None)
    assert r.counts_usage() and not r.end_of_stream()
    assert r.usage(_prompt) == Usage(input_tokens=7, output_tokens=3, source="estimated")
    assert r.output_tokens_so_far() == 3
    empty = _reader(ChatReader)
    assert not empty.end_of_stream() and not empty.counts_usage()
    assert empty.usage(_prompt) == Usage(source="estimated")


def test_completions_text_is_content() -> None:
    r = _reader(CompletionsReader)
    assert r.on_event(b'{"choices":[{"index":0,"text":" the of","finish_reason":null}]}',
                      None) is CONTENT
    assert r.usage(_prompt).output_tokens == 2


def test_responses_events_named_or_not() -> None:
    r = _reader(ResponsesReader)
    assert r.on_event(b'{"type":"response.created"}', "response.created") is NOTHING
    assert r.on_event(b'{"type":"response.output_text.delta","delta":" the of"}', None) is CONTENT
    done = {"type": "response.completed", "response": {"model": "gpt-4o-x", "usage": {
        "input_tokens": 4, "output_tokens": 2,
        "output_tokens_details": {"reasoning_tokens": 1}}}}
    assert r.on_event(json.dumps(done).encode(), "response.completed") == FINISH
    assert r.complete and r.response_model == "gpt-4o-x"
    assert r.usage(_prompt) == Usage(input_tokens=4, output_tokens=2, reasoning_tokens=1)


def test_json_answers_of_each_shape() -> None:
    chat = _reader(ChatReader, stream=False)
    chat.on_body(b'{"choices":[{"message":{"content":" the of and"}}]}')
    assert chat.usage(_prompt) == Usage(input_tokens=7, output_tokens=3, source="estimated")
    responses = _reader(ResponsesReader, stream=False)
    responses.on_body(b'{"output":[{"content":[{"type":"output_text","text":" the of"}]}]}')
    assert responses.usage(_prompt).output_tokens == 2
    embeddings = _reader(Reader, stream=False)
    embeddings.on_body(b'{"model":"e","usage":{"prompt_tokens":5,"total_tokens":5}}')
    assert embeddings.usage(_prompt) == Usage(input_tokens=5)
    assert embeddings.prompt_usage(_prompt) == Usage(input_tokens=7, source="estimated")


WORDS = st.lists(st.sampled_from(["one", " two", ' "three"', " f\u00f6ur", "\n", ""]),
                 min_size=1, max_size=12)


@given(WORDS, st.booleans())
def test_a_run_of_content_is_taken_as_event_by_event(words: list[str], finish: bool) -> None:
    """`take_content_run` takes exactly what `on_event` would take by its last branch, and the
    reader ends in the same state."""
    events = [_chunk({"content": "x"})] + [_chunk({"content": w}) for w in words]
    if finish:
        events.append(_chunk({}, "stop"))
    chunk = b"".join(b"data: " + e + b"\n\n" for e in events[1:])
    one, run = _reader(ChatReader), _reader(ChatReader)
    for r in (one, run):
        r.on_event(events[0], None)
    flags = [one.on_event(e, None) for e in events[1:]]
    count, end = run.take_content_run(chunk, 0, events[1:], 0)
    taken = flags[:count]
    assert all(f is CONTENT for f in taken)
    for event in events[1 + count:]:
        run.on_event(event, None)
    assert end == sum(len(e) + 8 for e in events[1 : 1 + count])
    assert run.output.events == one.output.events
    assert run.usage(_prompt) == one.usage(_prompt)


SPECIAL = [b"[DONE]", b"42", b'{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2}}',
           _chunk({}, "stop"), _chunk({"content": ""})]


@given(st.lists(st.one_of(st.sampled_from(["a", " b", ' "c"', "\n"]),
                          st.sampled_from(range(len(SPECIAL)))), min_size=1, max_size=16))
def test_a_run_ends_before_the_first_event_it_may_not_take(items: list[str | int]) -> None:
    """Any mix of content and of events a run may not take (not an object, usage, a finish,
    an empty content): the run is the content events before the first of those, exactly."""
    events = [_chunk({"content": x}) if isinstance(x, str) else SPECIAL[x] for x in items]
    chunk = b"".join(b"data: " + e + b"\n\n" for e in events)
    reader = _reader(ChatReader)
    reader.on_event(_chunk({"content": "x"}), None)
    count, end = reader.take_content_run(chunk, 0, events, 0)
    plain = next((i for i, x in enumerate(items) if not isinstance(x, str)), len(items))
    assert count == plain
    assert end == (sum(len(e) + 8 for e in events[:count]) if count else 0)
    assert reader.output.events == [_chunk({"content": "x"}), *events[:count]]
