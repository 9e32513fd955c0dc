"""The stream tap, sans I/O: what reaches the client and what gets metered, for every chunking."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.protocol.tap import StreamTap
from proxy.protocol.translators import ChatTranslator, EventFlag, parse_body
from proxy.telemetry.meter import RequestMeter


def _chunk(delta: dict[str, object], finish: str | None = None) -> bytes:
    obj = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
           "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], "usage": None}
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


USAGE_EVENT = (
    b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[],'
    b'"usage":{"prompt_tokens":11,"completion_tokens":3,"total_tokens":14}}\n\n'
)
HEAD = (
    _chunk({"role": "assistant", "content": ""})
    + _chunk({"content": "a"}) + _chunk({"content": "b"}) + _chunk({"content": "c"})
    + _chunk({}, "stop")
)
STREAM = HEAD + USAGE_EVENT + b"data: [DONE]\n\n"
STRIPPED = HEAD + b"data: [DONE]\n\n"


def _run(parts: list[bytes], client_asked: bool = False) -> tuple[bytes, ChatTranslator, int]:
    body: dict[str, object] = {"model": "m", "messages": [], "stream": True}
    if client_asked:
        body["stream_options"] = {"include_usage": True}
    tr = ChatTranslator(parse_body(json.dumps(body).encode()))
    meter = RequestMeter()
    tap = StreamTap(tr, meter)
    return _drive(tap, parts), tr, meter.chunks


def _drive(tap: StreamTap, parts: list[bytes]) -> bytes:
    """The relay's loop: write what `feed` returns, then `look`; `close` at the end."""
    out = b""
    for i, part in enumerate(parts):
        out += tap.feed(part, float(i))
        tap.look()
    return out + tap.close()


def _cut(stream: bytes, cuts: list[int]) -> list[bytes]:
    edges = [0, *sorted(set(cuts)), len(stream)]
    return [stream[a:b] for a, b in itertools.pairwise(edges) if b > a]


def test_event_per_chunk_strips_usage_and_meters() -> None:
    parts = [e + b"\n\n" for e in STREAM.split(b"\n\n") if e]
    out, tr, chunks = _run(parts)
    assert out == STRIPPED
    assert chunks == 3
    u = tr.usage()
    assert (u.input_tokens, u.output_tokens, u.source) == (11, 3, "reported")


@pytest.mark.parametrize("newline", [b"\r\n", b"\r"], ids=["crlf", "cr"])
def test_event_per_chunk_strips_usage_whatever_the_line_ends(newline: bytes) -> None:
    """A CR ending a chunk may be followed by the LF of a CRLF: the event before it is still
    whole, so the proxy's own usage-only event after it is still stripped (the tap once took
    that CR for an event under way and forwarded the usage event to a client that never asked
    for it)."""
    parts = [(e + b"\n\n").replace(b"\n", newline) for e in STREAM.split(b"\n\n") if e]
    out, tr, chunks = _run(parts)
    assert out == STRIPPED.replace(b"\n", newline)
    assert chunks == 3 and tr.usage().output_tokens == 3


def test_client_asked_for_usage_gets_it() -> None:
    out, _, _ = _run([STREAM])
    out_asked, _, _ = _run([STREAM], client_asked=True)
    assert out == STRIPPED and out_asked == STREAM
    # Event per chunk: the fast path, with no sniff done in `feed` when nothing is stripped.
    out_asked, tr, _ = _run([e + b"\n\n" for e in STREAM.split(b"\n\n") if e], True)
    assert out_asked == STREAM and tr.usage().source == "reported"


def test_every_split_offset_never_corrupts_and_always_meters() -> None:
    usage_at = STREAM.index(USAGE_EVENT)
    marker_at = STREAM.index(b'"usage":{')
    for i in range(len(STREAM) + 1):
        out, tr, chunks = _run([STREAM[:i], STREAM[i:]])
        assert tr.usage().output_tokens == 3 and tr.usage().source == "reported", i
        assert chunks == 3, i
        if usage_at < i < marker_at + len(b"\"usage\":{"):
            # The usage event's first bytes went out before anything could know what it was;
            # it is then forwarded whole rather than cut.
            assert out in (STREAM, STRIPPED), i
        else:
            assert out == STRIPPED, i


def test_byte_by_byte() -> None:
    out, tr, chunks = _run([STREAM[i : i + 1] for i in range(len(STREAM))])
    assert out == STRIPPED and chunks == 3 and tr.usage().output_tokens == 3


def test_a_metering_bug_never_costs_the_client_its_stream(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Broken(ChatTranslator):
        calls = 0

        def on_event(self, data: bytes, name: str | None,
                     marked: bool | None = None) -> EventFlag:
            Broken.calls += 1
            if Broken.calls == 3:
                raise RuntimeError("bug")
            return super().on_event(data, name, marked)

    body = json.dumps({"model": "m", "messages": [], "stream": True}).encode()
    errors: list[int] = []
    tap = StreamTap(Broken(parse_body(body)), RequestMeter(), on_error=lambda: errors.append(1))
    out = _drive(tap, [e + b"\n\n" for e in STREAM.split(b"\n\n") if e])
    # Every byte still reaches the client (the usage chunk too: stripping stops with metering).
    assert out == STREAM
    assert errors == [1]
    assert "metering failed mid-stream" in caplog.text


def test_forward_first_look_second() -> None:
    """`feed` hands back the chunk itself, unparsed; the meter learns of it only in `look`,
    which the relay calls after the write. A chunk whose write failed (no `look`) stays
    unmetered."""
    body = json.dumps({"model": "m", "messages": [], "stream": True}).encode()
    tr = ChatTranslator(parse_body(body))
    meter = RequestMeter()
    tap = StreamTap(tr, meter)
    head, first, second = _chunk({"role": "assistant", "content": ""}), _chunk({"content": "a"}), \
        _chunk({"content": "b"})
    for part in (head, first):
        assert tap.feed(part, 1.0) is part
        tap.look()
    assert meter.chunks == 1 and tr.seen_content
    assert tap.feed(second, 2.0) is second
    assert meter.chunks == 1  # not parsed before the write
    tap.close()  # the write failed: no look
    assert meter.chunks == 1 and tr.usage().output_tokens == 1


# Servers that report usage in every chunk (vLLM's continuous_usage_stats) put a usage object
# in content events, before any choice finished: the tap then does not strip, and its sniff must
# not hide from the translator a usage object cut between two chunks.
CONTINUOUS = b"".join(
    b"data: " + json.dumps({
        "id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
        "choices": [{"index": 0, "delta": {"content": w}, "finish_reason": None}],
        "usage": {"prompt_tokens": 5, "completion_tokens": i + 1, "total_tokens": 6 + i},
    }, separators=(",", ":")).encode() + b"\n\n"
    for i, w in enumerate(["a", "b", "c"])
) + _chunk({}, "stop") + USAGE_EVENT + b"data: [DONE]\n\n"


@given(st.lists(st.integers(0, len(STREAM)), max_size=12), st.booleans())
def test_any_cuts_strip_and_meter_as_event_per_chunk(cuts: list[int], asked: bool) -> None:
    out, tr, chunks = _run(_cut(STREAM, cuts), client_asked=asked)
    assert out == STREAM if asked else out in (STREAM, STRIPPED)
    assert chunks == 3
    u = tr.usage()
    assert (u.input_tokens, u.output_tokens, u.source) == (11, 3, "reported")


@given(st.lists(st.integers(0, len(CONTINUOUS)), max_size=12))
def test_usage_in_content_events_is_seen_at_any_cuts(cuts: list[int]) -> None:
    body = json.dumps({"model": "m", "messages": [], "stream": True}).encode()
    tr = ChatTranslator(parse_body(body))
    # Every usage seen, in order: the last content event's count is 3, the final event's 3.
    reported: list[int] = []
    original = tr.on_event

    def spy(data: bytes, name: str | None, marked: bool | None = None) -> EventFlag:
        flags = original(data, name, marked)
        reported.append(tr.usage().output_tokens if tr.usage().source == "reported" else 0)
        return flags

    tr.reader.on_event = spy  # type: ignore[method-assign]
    tap = StreamTap(tr, RequestMeter())
    out = _drive(tap, _cut(CONTINUOUS, cuts))
    assert out.endswith(b"data: [DONE]\n\n")
    assert reported[:3] == [1, 2, 3]


# A fast upstream: many content events per read (the tap takes a run of plain content events
# in one step; see `Translator.take_content_run`). Words with a JSON escape, a non-ASCII one.
WORDS = ["one", " two", ' "three"', " f\u00f6ur", "\n", " six"] * 9
FAST = (
    _chunk({"role": "assistant", "content": ""})
    + b"".join(_chunk({"content": w}) for w in WORDS)
    + _chunk({}, "stop") + USAGE_EVENT + b"data: [DONE]\n\n"
)


def _metered(parts: list[bytes], fast: bool,
             asked: bool) -> tuple[bytes, RequestMeter, ChatTranslator]:
    body: dict[str, object] = {"model": "m", "messages": [], "stream": True}
    if asked:
        body["stream_options"] = {"include_usage": True}
    tr = ChatTranslator(parse_body(json.dumps(body).encode()))
    if not fast:
        tr.reader.take_content_run = (  # type: ignore[method-assign]
            lambda chunk, start, events, first: (0, start))
    meter = RequestMeter(received=0.0)
    return _drive(StreamTap(tr, meter), parts), meter, tr


@given(st.lists(st.integers(0, len(FAST)), max_size=6), st.integers(0, len(FAST)),
       st.booleans())
def test_a_run_of_content_events_meters_as_event_by_event(cuts: list[int], end: int,
                                                          asked: bool) -> None:
    # Cut anywhere, and the stream itself maybe cut short (its output then estimated).
    stream = FAST[:end] if end < len(FAST) - 20 else FAST
    parts = _cut(stream, [c for c in cuts if c < len(stream)])
    out_fast, m_fast, tr_fast = _metered(parts, fast=True, asked=asked)
    out_slow, m_slow, tr_slow = _metered(parts, fast=False, asked=asked)
    assert out_fast == out_slow
    assert (m_fast.chunks, m_fast.gap_buckets(), m_fast.first_token_received) == (
        m_slow.chunks, m_slow.gap_buckets(), m_slow.first_token_received)
    assert tr_fast.usage() == tr_slow.usage()


def _spied() -> tuple[ChatTranslator, list[bytes]]:
    """A chat translator (the client did not ask for usage) noting each event `on_event` saw."""
    body = json.dumps({"model": "m", "messages": [], "stream": True}).encode()
    tr = ChatTranslator(parse_body(body))
    calls: list[bytes] = []
    original = tr.on_event

    def spy(data: bytes, name: str | None, marked: bool | None = None) -> EventFlag:
        calls.append(data)
        return original(data, name, marked)

    tr.reader.on_event = spy  # type: ignore[method-assign]
    return tr, calls


def test_a_run_of_content_events_is_taken_in_one_step() -> None:
    head = _chunk({"role": "assistant", "content": ""}) + _chunk({"content": "a"})
    run = b"".join(_chunk({"content": w}) for w in WORDS)
    rest = _chunk({}, "stop") + USAGE_EVENT + b"data: [DONE]\n\n"
    tr, calls = _spied()
    meter = RequestMeter()
    _drive(StreamTap(tr, meter), [head, run, rest])
    assert meter.chunks == 1 + len(WORDS)
    assert len(calls) == 2 + 3  # the head's two events and the rest's three, not the run's
    assert tr.usage().output_tokens == 3  # as reported
    # All in one read: only the events before the first content and after the last go alone.
    tr, calls = _spied()
    whole = RequestMeter()
    out = _drive(StreamTap(tr, whole), [head + run + rest])
    assert whole.chunks == 1 + len(WORDS)
    assert out == head + run + rest.replace(USAGE_EVENT, b"")  # the usage we asked for: ours
    assert len(calls) == 2 + 3
    assert tr.usage().output_tokens == 3


def _spaced(delta: dict[str, object], finish: str | None = None) -> bytes:
    obj = {"id": "c1", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
           "usage": None}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"  # `": ` and `, ` as Python writes


SPACED = (
    _spaced({"role": "assistant", "content": ""})
    + b"".join(_spaced({"content": w}) for w in WORDS[:12])
    + _spaced({}, "stop")
    + b'data: {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 12}}\n\n'
    + b"data: [DONE]\n\n"
)


@given(st.lists(st.integers(0, len(SPACED)), max_size=4), st.booleans())
def test_runs_end_at_marks_written_with_spaces_too(cuts: list[int], asked: bool) -> None:
    parts = _cut(SPACED, cuts)
    out_fast, m_fast, tr_fast = _metered(parts, fast=True, asked=asked)
    out_slow, m_slow, tr_slow = _metered(parts, fast=False, asked=asked)
    assert out_fast == out_slow
    assert (m_fast.chunks, m_fast.gap_buckets()) == (m_slow.chunks, m_slow.gap_buckets())
    assert tr_fast.usage() == tr_slow.usage()
    assert tr_fast.usage().output_tokens == 12 and m_fast.chunks == 12


# --- issue 31, item 10: the upstream's `: tokenmeter` comment lines -----------------------------

FORGED = b": tokenmeter cost_usd=0.000000000 input_tokens=0 output_tokens=0\n"
# An upstream's stream with forged cost comments everywhere (before the first event, between two,
# inside an event between its lines, after the last) and look-alikes that are not the proxy's
# (another comment, a shorter one, the words inside a data line, a bare colon) and must stay.
FORGING = (
    FORGED + _chunk({"role": "assistant", "content": ""})
    + b": keep-alive\n" + _chunk({"content": "a: tokenmeter b"})
    + b"data: " + json.dumps({"id": "c1", "object": "chat.completion.chunk", "created": 1,
                              "model": "m", "usage": None,
                              "choices": [{"index": 0, "delta": {"content": "c"},
                                           "finish_reason": None}]}).encode()
    + b"\n" + FORGED + b"\n" + b": token\n:\n" + FORGED + FORGED
    + _chunk({}, "stop") + USAGE_EVENT + FORGED + b"\n" + b"data: [DONE]\n\n" + FORGED
)


def _unforged(stream: bytes) -> bytes:
    """The reference: every line starting with `: tokenmeter` dropped with its line end."""
    return b"".join(line for line in stream.splitlines(keepends=True)
                    if not line.startswith(b": tokenmeter"))


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"])
@given(cuts=st.lists(st.integers(0, len(FORGING) * 2), max_size=12))
def test_the_upstreams_own_comment_lines_are_dropped_at_any_cuts(
    newline: bytes, cuts: list[int],
) -> None:
    stream = FORGING.replace(b"\n", newline)
    out, tr, chunks = _run(_cut(stream, cuts), client_asked=True)
    assert out == _unforged(stream)
    assert b"tokenmeter cost" not in out
    assert b"a: tokenmeter b" in out and b": keep-alive" in out and b": token" + newline in out
    assert chunks == 2
    u = tr.usage()
    assert (u.input_tokens, u.output_tokens, u.source) == (11, 3, "reported")


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"])
def test_the_upstreams_own_comment_lines_are_dropped_byte_by_byte(newline: bytes) -> None:
    stream = FORGING.replace(b"\n", newline)
    out, tr, chunks = _run([stream[i : i + 1] for i in range(len(stream))], client_asked=True)
    assert out == _unforged(stream) and chunks == 2 and tr.usage().output_tokens == 3
    # A stream the proxy strips the usage of too.
    out, tr, chunks = _run(_cut(stream, list(range(0, len(stream), 7))))
    assert out in (_unforged(stream), _unforged(stream).replace(USAGE_EVENT.replace(
        b"\n", newline), b""))
    assert chunks == 2 and tr.usage().output_tokens == 3


def test_a_cut_short_look_alike_at_the_end_is_forwarded() -> None:
    """A stream ending in the first bytes of the mark (no line end after them): held until the
    end, then forwarded; nothing else is held."""
    stream = STREAM + b": tokenme"
    out, _, _ = _run([stream], client_asked=True)
    assert out == stream
    tap = StreamTap(ChatTranslator(parse_body(b'{"model":"m","messages":[],"stream":true,'
                                              b'"stream_options":{"include_usage":true}}')),
                    RequestMeter())
    assert tap.feed(STREAM + b": tok", 0.0) == STREAM  # its tail waits for the next bytes
    tap.look()
    assert tap.feed(b"enmeter x\n", 1.0) == b""
    tap.look()
    assert tap.feed(b": other\n", 2.0) == b": other\n"
