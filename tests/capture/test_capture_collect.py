"""A request's bytes kept for capture (bounded, unparsed on the request path) and the record
made of them at settle: the stream cut into its events with their arrival times, the output
reassembled, every text redacted before it is cut."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from proxy.capture.collect import Collector, Meta, completed, record
from proxy.capture.record import Capture, StreamEvent
from proxy.capture.redact import Redactor
from proxy.config.capture import DEFAULT_REDACT
from proxy.protocol.codec import loads_all, timed_events
from proxy.protocol.codecs import codec_for

pytestmark = pytest.mark.unit

META = Meta(request_id="r1", started_at=1.0, api="openai", path="/v1/chat/completions",
            operation="chat", user="alice", key_name=None, team=None,
            requested_model="gpt-4o-mini", model="gpt-4o-mini", stream=True, status=200,
            error_class="none")
KEY = "sk-proj-0123456789abcdefABCDEF"


_redact = Redactor.of([r"sk-[A-Za-z0-9_-]{16,}"])


def _chunk(delta: dict[str, object]) -> bytes:
    obj = {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def test_a_stream_is_cut_into_its_events_at_the_time_each_completed() -> None:
    stream = _chunk({"content": "Hel"}) + _chunk({"content": "lo"}) + b"data: [DONE]\n\n"
    cut = [stream[:10], stream[10:90], stream[90:]]  # the first event ends at byte 87
    events = timed_events([(1.0, cut[0]), (2.5, cut[1]), (4.0, cut[2])])
    assert [raw for _, raw, _ in events] == [e for e in stream.split(b"\n\n") if e]
    assert [at for at, _, _ in events][-1] == 4.0
    assert events[0][0] == 2.5  # completed by the second chunk


def test_the_record_reassembles_redacts_and_bounds() -> None:
    c = Collector(limit_bytes=1024)
    c.sent(json.dumps({"messages": [{"role": "user", "content": f"my key is {KEY}"}]}).encode())
    c.forwarded(b'{"max_tokens": 16}')
    for i, piece in enumerate(["The key ", KEY, " is secret"]):
        c.streamed(_chunk({"content": piece}), float(i))
    written = record(c, META, _redact)
    assert KEY not in json.dumps(written.to_json())
    capture = completed(written, _redact)  # as read: the stream cut into events
    assert capture.output_text == "The key [REDACTED] is secret"
    assert "[REDACTED]" in capture.request.text and not capture.request.truncated
    assert capture.upstream_request is not None and capture.upstream_request.text.endswith("16}")
    assert [e.at_ms for e in capture.events] == [0.0, 1.0, 2.0]


def test_bodies_and_streams_past_the_limit_are_cut_and_marked() -> None:
    c = Collector(limit_bytes=100)
    c.sent(b"x" * 1000)
    for i in range(50):
        c.streamed(_chunk({"content": "word "}), float(i))
    capture = record(c, META, _redact)
    assert capture.request.truncated and capture.request.size == 1000
    assert len(capture.request.text) == 100
    assert capture.events_truncated and len(c.chunks) < 50


def test_a_secret_cut_by_the_limit_is_still_redacted() -> None:
    c = Collector(limit_bytes=20)
    c.sent(b"0123456789 " + KEY.encode())  # the key straddles the limit
    capture = record(c, META, _redact)
    assert "sk-proj" not in capture.request.text


def test_openai_and_anthropic_outputs_are_reassembled_with_tool_calls_and_reasoning() -> None:
    openai = [json.dumps(x).encode() for x in (
        {"choices": [{"delta": {"reasoning_content": "think "}}]},
        {"choices": [{"delta": {"content": "Hi"}}]},
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "c1", "function": {
            "name": "f", "arguments": "{\"a\""}}]}}]},
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {
            "arguments": ": 1}"}}]}}]},
    )]
    out = codec_for("chat").shown(loads_all(openai))
    assert (out.text, out.reasoning) == ("Hi", "think ")
    assert out.tool_calls == ({"id": "c1", "name": "f", "arguments": "{\"a\": 1}"},)
    anthropic = [json.dumps(x).encode() for x in (
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "thinking_delta", "thinking": "hmm"}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "Yo"}},
        {"type": "content_block_start", "index": 2,
         "content_block": {"type": "tool_use", "id": "t1", "name": "g"}},
        {"type": "content_block_delta", "index": 2,
         "delta": {"type": "input_json_delta", "partial_json": "{}"}},
    )]
    out = codec_for("messages").shown(loads_all(anthropic))
    assert (out.text, out.reasoning) == ("Yo", "hmm")
    assert out.tool_calls == ({"id": "t1", "name": "g", "arguments": "{}"},)


def test_a_clean_stream_is_kept_as_chunks_and_cut_into_events_when_read() -> None:
    c = Collector(limit_bytes=4096)
    c.sent(b'{"stream": true}')
    stream = _chunk({"content": "Hel"}) + _chunk({"content": "lo"}) + b"data: [DONE]\n\n"
    for at, (a, b) in enumerate([(0, 10), (10, 90), (90, len(stream))]):
        c.streamed(stream[a:b], float(at))
    written = record(c, META, _redact)
    assert written.chunks is not None and written.events == ()  # nothing framed on write
    capture = completed(written, _redact)
    assert capture.output_text == "Hello" and capture.chunks is None
    assert [e.at_ms for e in capture.events] == [1.0, 2.0, 2.0]  # the chunk that ended each
    assert [e.text.encode() for e in capture.events] == [e for e in stream.split(b"\n\n") if e]


def test_a_secret_split_across_two_events_is_redacted_in_the_output_read() -> None:
    c = Collector(limit_bytes=4096)
    c.sent(b"{}")
    for i, piece in enumerate([KEY[:10], KEY[10:]]):  # neither half matches a pattern
        c.streamed(_chunk({"content": piece}), float(i))
    capture = completed(record(c, META, _redact), _redact)
    assert capture.output_text == "[REDACTED]"


MAIL = "jane.doe@example.com"


def _joined(capture_events: tuple[StreamEvent, ...], field: str) -> str:
    """A field's pieces joined across the stored events, as a client joins them."""
    out = ""
    for event in capture_events:
        data = event.text.rpartition("data: ")[2]
        if data.startswith("{"):
            out += _find(json.loads(data), field)
    return out


def _find(value: object, field: str) -> str:
    if isinstance(value, dict):
        return "".join(v if k == field and isinstance(v, str) else _find(v, field)
                       for k, v in value.items())
    if isinstance(value, list):
        return "".join(_find(v, field) for v in value)
    return ""


def _split_stream(events: list[bytes], operation: str = "chat") -> Capture:
    c = Collector(limit_bytes=64 * 1024)
    c.sent(b"{}")
    for i, event in enumerate(events):
        c.streamed(event, float(i))
    meta = replace(META, operation=operation)
    return completed(record(c, meta, Redactor.of(DEFAULT_REDACT)), Redactor.of([]))


def test_secrets_split_across_events_leave_no_field_whatever_the_text_kind() -> None:
    """Chat's content (two choices interleaved), reasoning and refusal, and a Responses
    stream's text deltas: each field's pieces are joined per choice or item; what a secret
    split between events leaves in them is [REDACTED] where it began, nothing after."""
    chat = []
    for a, b in zip([MAIL[:5], MAIL[5:12], MAIL[12:]], ["ok ", "fine ", "done"], strict=True):
        chat.append(b"data: " + json.dumps({"choices": [
            {"index": 0, "delta": {"content": a, "reasoning_content": KEY[:12] if a == MAIL[:5]
                                   else KEY[12:] if a == MAIL[5:12] else ""}},
            {"index": 1, "delta": {"refusal": b}}]}).encode() + b"\n\n")
    capture = _split_stream([*chat, b"data: [DONE]\n\n"])
    assert _joined(capture.events, "content") == "[REDACTED]"
    assert _joined(capture.events, "reasoning_content") == "[REDACTED]"
    assert _joined(capture.events, "refusal") == "ok fine done"  # the other choice untouched
    assert capture.output_text == "[REDACTED]" and capture.reasoning == "[REDACTED]"
    responses = [
        b"event: response.output_text.delta\ndata: " + json.dumps(
            {"type": "response.output_text.delta", "output_index": 0, "content_index": 0,
             "delta": piece}).encode() + b"\n\n"
        for piece in ["mail ", MAIL[:4], MAIL[4:9], MAIL[9:], " now"]]
    capture = _split_stream(responses, "responses")
    assert _joined(capture.events, "delta") == "mail [REDACTED] now"
    assert all(e.text.startswith("event: response.output_text.delta\ndata: ")
               for e in capture.events)


def test_a_clean_stream_is_still_kept_as_chunks() -> None:
    c = Collector(limit_bytes=4096)
    c.sent(b"{}")
    for i, piece in enumerate(["no ", "secret ", "here"]):
        c.streamed(_chunk({"content": piece}), float(i))
    assert record(c, META, Redactor.of(DEFAULT_REDACT)).chunks is not None


def test_a_json_answer_hiding_a_secret_behind_escapes_is_written_again_redacted() -> None:
    """Not streamed: an e-mail written `\\u0040` in the text and inside a tool call's
    arguments (JSON in a JSON string), found once the body's strings are decoded."""
    c = Collector(limit_bytes=4096)
    c.sent(b"{}")
    args = '{"to": "jane.doe\\u0040example.com"}'  # JSON with the `@` escaped
    body = ('{"choices": [{"message": {"content": "mail jane.doe\\u0040example.com", '
            '"tool_calls": [{"function": {"name": "f", "arguments": ' + json.dumps(args)
            + '}}]}}]}')
    c.answered(body.encode())
    capture = record(c, replace(META, stream=False), Redactor.of(DEFAULT_REDACT))
    assert capture.response is not None
    answer = json.loads(capture.response.text)
    message = answer["choices"][0]["message"]
    assert message["content"] == "mail [REDACTED]"
    assert "example" not in message["tool_calls"][0]["function"]["arguments"]
    clean = b'{"choices": [{"message": {"content": "line\\none"}}]}'
    c.answered(clean)
    kept = record(c, replace(META, stream=False), Redactor.of(DEFAULT_REDACT)).response
    assert kept is not None and kept.text == clean.decode()  # nothing found: byte for byte


def test_interleaved_tool_calls_are_each_joined_by_their_index() -> None:
    """Two tool calls streamed at once (their deltas interleaved, each at position 0 with its
    own `index`) and the deprecated `function_call`: each call's arguments are joined alone."""
    first, second = json.dumps({"k": KEY}), json.dumps({"to": MAIL})
    events = []
    for n in range(0, max(len(first), len(second)), 4):
        for index, args in ((0, first), (1, second)):
            if args[n:n + 4]:
                events.append(_chunk({"tool_calls": [
                    {"index": index, "function": {"arguments": args[n:n + 4]}}]}))
    events += [_chunk({"function_call": {"arguments": p}}) for p in (KEY[:9], KEY[9:])]
    capture = _split_stream(events)
    assert KEY not in _joined(capture.events, "arguments").replace('"', "")
    calls = [json.loads(c["arguments"]) for c in capture.tool_calls[:2]]
    assert calls == [{"k": "[REDACTED]"}, {"to": "[REDACTED]"}]
    assert capture.tool_calls[2] == {"arguments": "[REDACTED]"}  # the function_call
    assert all(KEY[:9] not in e.text and MAIL[:6] not in e.text for e in capture.events)
