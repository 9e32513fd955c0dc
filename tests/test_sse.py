from __future__ import annotations

from proxy.sse import Event, SSEDecoder

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
    d = SSEDecoder()
    out: list[Event] = []
    for p in parts:
        out.extend(d.feed(p))
    out.extend(d.flush())
    return out


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
    assert d.feed(b"\n") == [Event(b'{"partial":true}')]
    assert not d.has_pending


def test_cut_stream_flushes_last_event() -> None:
    d = SSEDecoder()
    d.feed(b'data: {"n":1}\n\ndata: {"n":2}')
    assert d.flush() == [Event(b'{"n":2}')]


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
        _, ends = d.feed_with_ends(p)
        out.extend(base + e for e in ends)
        base += len(p)
    return out[: len(EXPECTED)]
