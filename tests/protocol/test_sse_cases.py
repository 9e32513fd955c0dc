"""The SSE decoder: every chunking of a stream yields the same events, the fast paths take
whole data events and nothing else, and the relay's helpers (`pieces`, `events_at_most`) cut
and bound chunks as `feed` reads them. (tests/protocol/test_sse.py checks the fast paths against `feed`
on random streams.)"""

from __future__ import annotations

import pytest

from proxy.protocol.sse import Event, LineSplitter, SSEDecoder, events_at_most

pytestmark = pytest.mark.unit

STREAM = (
    b": keep-alive comment\n\n"
    b'data: {"a":1}\n\n'
    b"event: response.output_text.delta\n"
    b'data: {"delta":"x"}\n\n'
    b"data: line one\r\n"
    b"data: line two\r\n\r\n"
    b"data:no-space\r\r"
    b"id: 7\nretry: 100\ndata\n\n"
    b"event: ignored-without-data\n\n"
    b"data: [DONE]\n\n"
)
EXPECTED = [
    Event(b'{"a":1}'),
    Event(b'{"delta":"x"}', "response.output_text.delta"),
    Event(b"line one\nline two"),
    Event(b"no-space"),
    Event(b""),
    Event(b"[DONE]"),
]


def decode(parts: list[bytes]) -> list[Event]:
    """The events, without where they ended (which depends on the cuts)."""
    d = SSEDecoder()
    out: list[Event] = []
    for p in parts:
        out.extend(d.feed(p))
    out.extend(d.flush())
    return [Event(e.data, e.event) for e in out]


def test_whole_stream() -> None:
    assert decode([STREAM]) == EXPECTED


def test_split_at_every_offset() -> None:
    for i in range(len(STREAM) + 1):
        assert decode([STREAM[:i], STREAM[i:]]) == EXPECTED, i


def test_split_at_every_pair_of_offsets() -> None:
    # Three pieces catches a CR and its LF landing in different feeds with data in between.
    n = len(STREAM)
    for i in range(0, n + 1, 3):
        for j in range(i, n + 1, 5):
            assert decode([STREAM[:i], STREAM[i:j], STREAM[j:]]) == EXPECTED, (i, j)


def test_byte_by_byte() -> None:
    assert decode([STREAM[i : i + 1] for i in range(len(STREAM))]) == EXPECTED


def test_partial_line_is_kept_until_completed() -> None:
    d = SSEDecoder()
    assert d.feed(b'data: {"par') == []
    assert d.has_pending
    assert d.feed(b'tial":true}\n') == []
    assert d.feed(b"\n") == [Event(b'{"partial":true}', None, 1)]
    assert not d.has_pending


def test_cut_stream_flushes_last_event() -> None:
    d = SSEDecoder()
    d.feed(b'data: {"n":1}\n\ndata: {"n":2}')
    assert d.flush() == [Event(b'{"n":2}', None, 0)]


def test_event_ends_point_past_blank_line_at_every_split() -> None:
    # Where each event ends in the stream must not depend on how the stream was cut.
    whole_ends = _ends([STREAM])
    assert len(whole_ends) == len(EXPECTED)
    assert STREAM[: whole_ends[0]].endswith(b'{"a":1}\n\n')
    for i in range(len(STREAM) + 1):
        for got, want in zip(_ends([STREAM[:i], STREAM[i:]]), whole_ends, strict=True):
            # A CRLF cut between its CR and LF ends the event at the CR: the LF is then the
            # first byte of what follows, which is harmless to whoever slices by these ends.
            assert got == want or (got == want - 1 == i and STREAM[got - 1 : want] == b"\r\n")


def _ends(parts: list[bytes]) -> list[int]:
    d = SSEDecoder()
    out: list[int] = []
    base = 0
    for p in parts:
        out.extend(base + e.end for e in d.feed(p))
        base += len(p)
    return out[: len(EXPECTED)]


def test_fast_path_takes_one_whole_data_event_and_nothing_else() -> None:
    d = SSEDecoder()
    assert d.whole_event(b'data: {"a":1}\n\n') == b'{"a":1}'
    assert d.whole_event(b"data: \n\n") == b""
    for chunk in (b'data: {"a":1}\r\n\r\n', b"data: a\ndata: b\n\n", b"data: a\n\ndata: b\n\n",
                  b"event: x\ndata: a\n\n", b"data: a\n", b"data:a\n\n", b": c\n\n"):
        assert d.whole_event(chunk) is None, chunk
    # A CR inside is a line end to `feed`: not one line.
    for chunk in (b"data: a\rb\n\n", b"data: a\r\n\n"):
        assert d.whole_event(chunk) is None, chunk
        assert d.whole_events(chunk) is None, chunk
    d.feed(b"data: half")  # with bytes pending, a whole-looking chunk is not a whole event
    assert d.whole_event(b"data: x\n\n") is None


def test_many_events_fast_path_takes_whole_data_events_only() -> None:
    d = SSEDecoder()
    assert d.whole_events(b"data: a\n\ndata: {}\n\ndata: \n\n") == [b"a", b"{}", b""]
    for chunk in (b"data: a\n\ndata: b\n", b"data: a\n\nevent: x\ndata: b\n\n",
                  b"data: a\r\n\r\n", b": ping\n\ndata: a\n\n", b"data: a\ndata: b\n\n",
                  b"data: a\n\nb"):
        assert d.whole_events(chunk) is None, chunk
    # With anything pending, in the splitter (a partial line) or the assembler (a data line
    # and no blank one yet), the chunk continues it.
    for before in (b"data: half", b"data: a\n", b"event: e\n"):
        pending = SSEDecoder()
        pending.feed(before)
        assert pending.whole_events(b"data: x\n\n") is None, before
        assert pending.whole_event(b"data: x\n\n") is None, before


# --- the line splitter and the assembler ----------------------------------------------------------


def test_lines_end_in_lf_crlf_or_cr_each_at_its_offset_in_the_chunk() -> None:
    s = LineSplitter()
    assert s.has_pending is False
    assert s.split(b"a\rb\r\nc\nd\r") == [(b"a", 2), (b"b", 5), (b"c", 7), (b"d", 9)]
    assert s.has_pending is True  # the CR may be half of a CRLF
    assert s.split(b"\ne\n") == [(b"e", 3)]  # ... and was: its LF is skipped
    assert s.has_pending is False
    assert s.split(b"\r") == [(b"", 1)]
    assert s.split(b"x\n") == [(b"x", 2)]  # not an LF after it: nothing skipped
    # A chunk that opens with a CR, CRs and LFs in any order, blank lines among them.
    assert LineSplitter().split(b"\ra\n\r\r\n") == [(b"", 1), (b"a", 3), (b"", 4), (b"", 6)]
    assert LineSplitter().split(b"a\r\nb\nc\nd") == [(b"a", 3), (b"b", 5), (b"c", 7)]


def test_a_partial_line_is_joined_to_the_next_chunk_and_flushed_at_the_end() -> None:
    s = LineSplitter()
    assert s.split(b"") == [] and s.split(b"ab") == [] and s.has_pending is True
    assert s.split(b"c\rd\ne\nf") == [(b"abc", 2), (b"d", 4), (b"e", 6)]
    assert s.flush() == b"f"
    assert s.has_pending is False and s.flush() == b""
    s.split(b"x\r")
    assert s.flush() == b"" and s.has_pending is False  # a pending CR ends with the stream
    assert s.split(b"\nz\n") == [(b"", 1), (b"z", 3)]  # an LF after it is a line end again


def test_an_event_name_is_text_even_when_its_bytes_are_not_utf8() -> None:
    d = SSEDecoder()
    assert d.feed(b"event: \xffdelta\ndata: x\n\n") == [Event(b"x", "\ufffddelta", 23)]
    assert d.feed(b"event:plain\ndata:y\n\n") == [Event(b"y", "plain", 20)]
    assert d.feed(b"data: z\n\n") == [Event(b"z", None, 9)]  # the name lasts one event


def test_flush_dispatches_a_cut_event_and_leaves_nothing_pending() -> None:
    d = SSEDecoder()
    assert d.flush() == []
    d.feed(b"event: e\ndata: a\ndata: b")
    assert d.has_pending is True
    assert d.flush() == [Event(b"a\nb", "e", 0)]
    assert d.has_pending is False
    d.feed(b"data: c\n")  # a whole line, no blank one yet
    assert d.flush() == [Event(b"c", None, 0)]
    d.feed(b"event: only\r")
    assert d.flush() == [] and d.has_pending is False
    assert d.feed(b"\ndata: next\n\n") == [Event(b"next", None, 13)]


# --- pieces and events_at_most: what the relay cuts and bounds chunks by -------------------------


def test_pieces_cut_a_chunk_just_past_each_blank_line() -> None:
    d = SSEDecoder()
    assert d.pieces(b"") == []
    assert d.pieces(b"data: a\n\n") == [b"data: a\n\n"]
    assert d.pieces(b"data: a\n\ndata: b\r\n\r\ndata: c") == [
        b"data: a\n\n", b"data: b\r\n\r\n", b"data: c"]
    assert d.pieces(b"\ndata: b\n\n") == [b"\n", b"data: b\n\n"]  # a blank line first
    assert d.pieces(b"data: a\r\rdata: b\r") == [b"data: a\r\r", b"data: b\r"]
    assert not d.has_pending  # cutting fed nothing


def test_pieces_follow_what_was_fed_before() -> None:
    after_a_line = SSEDecoder()
    after_a_line.feed(b"data: a")  # the next LF ends this line: not a blank one
    assert after_a_line.pieces(b"\n\ndata: b\n\n") == [b"\n\n", b"data: b\n\n"]
    after_a_cr = SSEDecoder()
    after_a_cr.feed(b"data: a\r")  # the next LF is its CRLF's second half
    assert after_a_cr.pieces(b"\n\r\ndata: b\r\n\r\n") == [b"\n\r\n", b"data: b\r\n\r\n"]
    # Feeding the pieces one by one is feeding the chunk.
    chunk = b"\n\r\ndata: b\r\n\r\ndata: c"
    whole, cut = SSEDecoder(), SSEDecoder()
    whole.feed(b"data: a\r")
    cut.feed(b"data: a\r")
    by_piece = [e[:2] for p in cut.pieces(chunk) for e in cut.feed(p)]
    assert by_piece == [e[:2] for e in whole.feed(chunk)] == [(b"a", None), (b"b", None)]


def test_events_at_most_bounds_the_events_a_chunk_completes() -> None:
    cases = {
        b"": 0, b"data: a": 0, b"data: a\n": 0, b"data: a\n\n": 1, b"\n": 1, b"\ndata: x": 1,
        b"\ndata: x\n\n": 2, b"data: a\n\ndata: b\n\n": 2, b"x\n\n\n\n": 2,
        b"data: a\r\n\r\n": 2, b"data: a\r\r": 2, b"a\r\nb\n": 2, b"\r": 1, b"\r\n\r\n\n": 3,
    }
    assert {chunk: events_at_most(chunk) for chunk in cases} == cases
    # Never fewer than `feed` completes, whatever was fed before.
    for before in (b"", b"data: a", b"data: a\n", b"data: a\r", b"data: a\r\n"):
        for chunk in cases:
            d = SSEDecoder()
            d.feed(before)
            assert len(d.feed(chunk)) <= events_at_most(chunk), (before, chunk)


def test_a_stream_is_mid_event_only_inside_an_event_whatever_its_line_ends() -> None:
    """`mid_event`: the bytes fed stop inside an event. A CR ending them ends its line (the
    LF a CRLF may add is only skipped), so a CR-framed stream is between events after each
    one, as LF- and CRLF-framed ones are; `has_pending` still remembers that CR."""
    for eol in (b"\n", b"\r\n", b"\r"):
        decoder = SSEDecoder()
        decoder.feed(b"data: a" + eol + eol)
        assert not decoder.mid_event, eol
        assert decoder.has_pending == (eol == b"\r")
        decoder.feed(b"data: b")
        assert decoder.mid_event  # a line begun
        decoder.feed(eol)
        assert decoder.mid_event  # an event's line ended, its blank line to come
        decoder.feed(eol)
        assert not decoder.mid_event
    decoder = SSEDecoder()
    decoder.feed(b"data: a\r")
    assert decoder.mid_event  # the line ended, the event did not
    assert [e.data for e in decoder.feed(b"\n\r\n")] == [b"a"]
    assert not decoder.mid_event
