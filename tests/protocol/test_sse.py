"""The SSE decoder on random streams: the fast paths (`whole_event`, `whole_events`) yield
exactly what the general decoder (`feed`) does, at any cut. The decoder's own tests, fast and
deterministic, are in tests/protocol/test_sse_cases.py; these draw hundreds of streams each."""

from __future__ import annotations

import itertools

from hypothesis import example, given
from hypothesis import strategies as st

from proxy.protocol.sse import Event, SSEDecoder


def decode(parts: list[bytes]) -> list[Event]:
    """The events, without where they ended (which depends on the cuts)."""
    d = SSEDecoder()
    out: list[Event] = []
    for p in parts:
        out.extend(d.feed(p))
    out.extend(d.flush())
    return [Event(e.data, e.event) for e in out]


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
