"""A sans-I/O Server-Sent Events decoder: a line splitter, an event assembler, and one fast path.

`SSEDecoder.feed(bytes)` returns the events completed by those bytes and keeps the partial line
for the next call, so the relay can forward each upstream chunk the moment it arrives and parse it
on the side. As in httpx-sse, the work is split in two: `LineSplitter` cuts bytes into lines, and
`EventAssembler` turns lines into events. They follow the WHATWG event-stream rules that matter
here: lines end in LF, CRLF or CR (a CR at the end of one chunk may be the first half of a CRLF),
`data:` lines are joined with LF, comment lines are ignored, and an event is dispatched on a blank
line. Data is kept as bytes: JSON parsers take bytes, and most events are never decoded at all.

Each event carries `end`, where in the chunk that completed it the event ended (just past its
blank line): the stream tap slices the raw bytes it forwards by these offsets.

`SSEDecoder.whole_event(chunk)` is the one fast path: what fast upstreams send is one whole
`data:` event per chunk, LF-framed, and for such a chunk (with nothing pending) it returns the
event's data without running the splitter and the assembler. It returns exactly what `feed`
would (tests/protocol/test_sse.py checks that on random streams); for any other chunk it
returns None and the caller uses `feed`.

`stream_datas` and `timed_events` frame a whole stream kept as bytes (the cache's entries, a
capture's chunks) with the same decoder: nothing else in the proxy parses `data:` lines.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple


def events_at_most(chunk: bytes) -> int:
    """No fewer than the events `chunk` can complete, whatever came before it: one bytes scan
    or a few, no parse. Each event ends at a blank line, whose line end lies in the chunk that
    completes it. With LF line ends alone that is a `\\n\\n` in the chunk, or its first byte
    after a line that ended the chunk before; with CRs (CRLF-framed upstreams) every line end
    is counted, which is at most twice the events of a stream of one-line events."""
    if b"\r" not in chunk:
        return chunk.count(b"\n\n") + (chunk[:1] == b"\n")
    return chunk.count(b"\n") + chunk.count(b"\r") - chunk.count(b"\r\n")


class Event(NamedTuple):
    """One dispatched event. A NamedTuple, not a frozen dataclass: as immutable, and built in
    a third of the time (0.2 us against 0.36 us), once per event on the relay's path."""

    data: bytes
    event: str | None = None
    # Offset in the chunk whose bytes completed this event, just past its blank line (0 for an
    # event dispatched by `flush`).
    end: int = 0


class LineSplitter:
    """Bytes in, complete lines out (without their terminators), each with the offset in the
    chunk just past its terminator. A CR ending a chunk ends its line at once; an LF opening the
    next chunk is then the second half of that CRLF, and skipped."""

    __slots__ = ("_partial", "_pending_cr")

    def __init__(self) -> None:
        self._partial = b""
        self._pending_cr = False

    @property
    def has_pending(self) -> bool:
        return bool(self._partial) or self._pending_cr

    @property
    def mid_line(self) -> bool:
        """Bytes of a line not yet ended were fed. A CR that ended the last bytes is no such
        line: it ended its own, whatever comes next (an LF after it is only skipped)."""
        return bool(self._partial)

    def split(self, chunk: bytes) -> list[tuple[bytes, int]]:
        lines: list[tuple[bytes, int]] = []
        if not chunk:
            return lines
        skip = 0
        if self._pending_cr:
            self._pending_cr = False
            if chunk[:1] == b"\n":
                skip = 1
        partial = self._partial
        # An offset in buf minus `shift` is the offset in the caller's chunk.
        shift = len(partial) - skip
        buf = partial + chunk[skip:] if partial or skip else chunk
        start = 0
        end = len(buf)
        if b"\r" not in buf:  # what the upstreams we front send: split on LF alone
            parts = buf.split(b"\n")
            self._partial = parts.pop()
            pos = -shift
            for text in parts:
                pos += len(text) + 1
                lines.append((text, pos))
            return lines
        while start < end:
            cr = buf.find(b"\r", start)
            nl = buf.find(b"\n", start)
            if cr < 0 and nl < 0:
                break
            if cr < 0 or (0 <= nl < cr):
                lines.append((buf[start:nl], nl + 1 - shift))
                start = nl + 1
                continue
            # A CR: a CRLF pair, or a lone CR (which may be half of a CRLF split across feeds).
            text = buf[start:cr]
            if cr + 1 < end:
                start = cr + 2 if buf[cr + 1 : cr + 2] == b"\n" else cr + 1
            else:
                self._pending_cr = True
                start = end
            lines.append((text, start - shift))
        self._partial = buf[start:]
        return lines

    def shadow(self) -> LineSplitter:
        """A splitter that ends the next bytes' lines where this one would, without them
        reaching this one. A pending partial line is stood for by one byte: where lines end
        and which are blank do not depend on its text, and a long one is not copied."""
        other = LineSplitter()
        other._partial = b"-" if self._partial else b""
        other._pending_cr = self._pending_cr
        return other

    def flush(self) -> bytes:
        """End of stream: the unterminated last line (b"" if none)."""
        rest, self._partial = self._partial, b""
        self._pending_cr = False
        return rest


_new_event = tuple.__new__


class EventAssembler:
    """Lines in, events out: `data:` lines are gathered until a blank line dispatches them."""

    __slots__ = ("_data", "_event", "_has_data")

    def __init__(self) -> None:
        self._data: list[bytes] = []
        self._has_data = False
        self._event: str | None = None

    @property
    def has_pending(self) -> bool:
        return self._has_data or self._event is not None

    def line(self, line: bytes, end: int) -> Event | None:
        """One line; returns the event it completes, if any (`end`: where that line ended)."""
        if not line:
            event = None
            if self._has_data:
                # tuple.__new__ skips the NamedTuple constructor's extra call: once per event.
                event = _new_event(Event, (b"\n".join(self._data), self._event, end))
                self._data = []
                self._has_data = False
            self._event = None
            return event
        if line[:5] == b"data:":
            self._data.append(line[6:] if line[5:6] == b" " else line[5:])
            self._has_data = True
            return None
        if line[:1] == b":":
            return None
        name, sep, value = line.partition(b":")
        if sep and value[:1] == b" ":
            value = value[1:]
        if name == b"event":
            self._event = value.decode("utf-8", "replace")
        elif name == b"data":  # "data" with no colon: an empty data line
            self._data.append(b"")
            self._has_data = True
        # id and retry carry nothing a meter needs.
        return None


class SSEDecoder:
    __slots__ = ("_assembler", "_splitter")

    def __init__(self) -> None:
        self._splitter = LineSplitter()
        self._assembler = EventAssembler()

    @property
    def has_pending(self) -> bool:
        """Bytes of an unfinished event have been fed (and, in the relay, already forwarded)."""
        return self._splitter.has_pending or self._assembler.has_pending

    @property
    def mid_event(self) -> bool:
        """The bytes fed so far stop inside an event: in one of its lines, or after lines of
        one not yet ended by its blank line. Unlike `has_pending`, a CR ending the last bytes
        (a CR-framed stream's every event ends so) leaves the stream between two events."""
        return self._splitter.mid_line or self._assembler.has_pending

    def whole_event(self, chunk: bytes) -> bytes | None:
        """The fast path: if `chunk` is exactly one whole `data:` event (one line, LF-framed)
        and nothing is pending, its data, as `feed` would return it, and the chunk is consumed;
        else None, and nothing changed."""
        if (
            chunk[:6] == b"data: "
            and chunk.find(b"\n") == len(chunk) - 2
            and chunk[-1:] == b"\n"
            and b"\r" not in chunk
            and not (self._splitter.has_pending or self._assembler.has_pending)
        ):
            return chunk[6:-2]
        return None

    def whole_events(self, chunk: bytes) -> list[bytes] | None:
        """The fast path for many events per chunk: if `chunk` is nothing but whole one-line
        `data: ` events, LF-framed, and nothing is pending, their data, as `feed` would return
        them, and the chunk is consumed; else None, and nothing changed. Exact: with the chunk
        split on the event boundaries, a part without a newline leaves no room for a line of
        any other kind. (Looked for in the parts joined: a copy and a memchr, a sixth of the
        time of counting the chunk's newlines.)"""
        if (
            chunk[:6] != b"data: "
            or chunk[-2:] != b"\n\n"
            or b"\r" in chunk
            or self._splitter.has_pending
            or self._assembler.has_pending
        ):
            return None
        parts = chunk[6:-2].split(b"\n\ndata: ")
        if b"\n" in b"".join(parts):
            return None
        return parts

    def pieces(self, chunk: bytes) -> list[bytes]:
        """`chunk` cut just past each blank line in it, where events end, by the same framing
        as `feed` (LF, CRLF or CR line ends, a CRLF split across chunks), without feeding it:
        feeding the pieces one by one is feeding the chunk. The relay forwards a chunk piece by
        piece where it must look at every event before the next is sent
        (proxy.pipeline.relay)."""
        pieces: list[bytes] = []
        start = 0
        for text, end in self._splitter.shadow().split(chunk):
            if not text and end > start:
                pieces.append(chunk[start:end])
                start = end
        if start < len(chunk):
            pieces.append(chunk[start:])
        return pieces

    def feed(self, chunk: bytes) -> list[Event]:
        line = self._assembler.line
        events: list[Event] = []
        for text, end in self._splitter.split(chunk):
            if (event := line(text, end)) is not None:
                events.append(event)
        return events

    def flush(self) -> list[Event]:
        """End of stream: a final event not followed by a blank line is dispatched, as browsers
        do not, but an upstream cut mid-event still produced tokens we must count."""
        line = self._assembler.line
        rest = self._splitter.flush()
        events = [e for e in (line(rest, 0) if rest else None, line(b"", 0)) if e is not None]
        return events


def stream_datas(raw: bytes) -> list[bytes]:
    """The data of every event of a whole stream, framed once (the decoder's fast path for
    one-line `data:` events, else its full framing: CR or CRLF line ends, several data lines
    per event)."""
    decoder = SSEDecoder()
    datas = decoder.whole_events(raw)
    if datas is None:
        datas = [e.data for e in (*decoder.feed(raw), *decoder.flush())]
    return datas


def timed_events(chunks: Iterable[tuple[float, bytes]]) -> list[tuple[float, bytes, bytes]]:
    """A stream's events as (arrival of the chunk that completed it, raw bytes, data), from its
    chunks as they came (arrival, bytes)."""
    decoder = SSEDecoder()
    out: list[tuple[float, bytes, bytes]] = []
    pending = b""
    for at, chunk in chunks:
        buf = pending + chunk
        start = 0
        shift = len(pending)
        for event in decoder.feed(chunk):
            end = shift + event.end
            out.append((at, buf[start:end].strip(b"\r\n"), event.data))
            start = end
        pending = buf[start:]
    return out
