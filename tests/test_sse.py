"""The SSE decoder: every chunking of a stream yields the same events, and the fast path
(`whole_event`) yields exactly what the general decoder (`feed`) does."""

from __future__ import annotations

import itertools

from hypothesis import example, given
from hypothesis import strategies as st

from proxy.protocol.sse import Event, SSEDecoder

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
    d.feed(b"data: half")  # with bytes pending, a whole-looking chunk is not a whole event
    assert d.whole_event(b"data: x\n\n") is None


# --- the fast path against the general decoder, on random streams ---------------------------

_TEXT = st.text(alphabet='ab :{}"\u00e9x1', max_size=12).map(lambda t: t.encode())
_FIELD = st.one_of(
    _TEXT.map(lambda v: b"data: " + v),
    _TEXT.map(lambda v: b"data:" + v),
    st.just(b"data"),
    _TEXT.map(lambda v: b": " + v),  # a comment
    st.sampled_from([b"event: response.output_text.delta", b"event:done", b"id: 7",
                     b"retry: 100"]),
)
# Whole single-line data events, what the fast path is for, drawn often.
_EVENT_LINES = st.one_of(
    _TEXT.map(lambda v: [b"data: " + v]),
    st.lists(_FIELD, min_size=1, max_size=4),
    # Other lines, then a last one that, cut from them, looks like a whole event.
    st.tuples(st.lists(_FIELD, min_size=1, max_size=3), _TEXT).map(
        lambda t: [*t[0], b"data: " + t[1]]),
)


@st.composite
def _streams(draw: st.DrawFn) -> tuple[bytes, list[int]]:
    """A stream of events (LF or CRLF endings, or a mix with lone CRs; sometimes a last event cut
    before its blank line) and cut offsets: between lines (between events the fast path applies;
    inside one, a whole-looking rest follows a pending start) and anywhere."""
    ending = draw(st.sampled_from([b"\n", b"\r\n", None]))
    stream = b""
    boundaries = [0]  # between lines: a cut there leaves a whole-looking rest after a pending start
    for lines in draw(st.lists(_EVENT_LINES, max_size=8)):
        for line in [*lines, b""]:
            stream += line + (ending or draw(st.sampled_from([b"\n", b"\r\n", b"\r"])))
            boundaries.append(len(stream))
    if draw(st.booleans()):
        stream += b"data: cut"
    cuts = draw(st.lists(st.sampled_from(boundaries), max_size=12))
    cuts += draw(st.lists(st.integers(0, len(stream)), max_size=4))
    return stream, sorted(set(cuts))


def _pieces(stream: bytes, cuts: list[int]) -> list[bytes]:
    edges = [0, *cuts, len(stream)]
    return [stream[a:b] for a, b in itertools.pairwise(edges) if b > a]


@given(_streams())
# Near misses of the fast path: a rest after a pending event name or data line, a CRLF line,
# an event with the next line's first byte.
@example((b"event: e\ndata: x\n\n", [9]))
@example((b"data: a\ndata: x\n\n", [8]))
@example((b"data: x\r\n\n", []))
@example((b"data: x\nid: 7\n\n", [9]))
def test_fast_path_yields_what_the_general_decoder_yields(case: tuple[bytes, list[int]]) -> None:
    stream, cuts = case
    general, fast = SSEDecoder(), SSEDecoder()
    by_feed: list[tuple[bytes, str | None, int]] = []
    by_fast: list[tuple[bytes, str | None, int]] = []
    for piece in _pieces(stream, cuts):
        by_feed.extend(general.feed(piece))
        data = fast.whole_event(piece)
        if data is not None:
            by_fast.append((data, None, len(piece)))
        else:
            by_fast.extend(fast.feed(piece))
        assert fast.has_pending == general.has_pending
    by_feed.extend(general.flush())
    by_fast.extend(fast.flush())
    # The same events, data, names and where each ended in its chunk.
    assert by_fast == by_feed
    # And the same events as the stream fed whole: the cuts change nothing but the offsets.
    assert [e[:2] for e in by_feed] == [e[:2] for e in decode([stream])]


@given(_streams())
@example((b"data: a\n\ndata: b\n\n", []))
@example((b"data: a\n\n\n\ndata: b\n\n", []))  # a blank line more: not the fast path's
@example((b"data: a\n\ndata: b\nid: 1\n\n", []))
@example((b"data: a\n\ndata:b\n\n", []))
def test_many_events_fast_path_yields_what_the_general_decoder_yields(
    case: tuple[bytes, list[int]],
) -> None:
    stream, cuts = case
    general, fast = SSEDecoder(), SSEDecoder()
    for piece in _pieces(stream, cuts):
        expected = [(e.data, e.event) for e in general.feed(piece)]
        datas = fast.whole_events(piece)
        if datas is not None:
            assert [(d, None) for d in datas] == expected
        else:
            assert [(e.data, e.event) for e in fast.feed(piece)] == expected
        assert fast.has_pending == general.has_pending
    assert fast.flush() == general.flush()


def test_many_events_fast_path_takes_whole_data_events_only() -> None:
    d = SSEDecoder()
    assert d.whole_events(b"data: a\n\ndata: {}\n\ndata: \n\n") == [b"a", b"{}", b""]
    for chunk in (b"data: a\n\ndata: b\n", b"data: a\n\nevent: x\ndata: b\n\n",
                  b"data: a\r\n\r\n", b": ping\n\ndata: a\n\n", b"data: a\ndata: b\n\n"):
        assert d.whole_events(chunk) is None, chunk


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
