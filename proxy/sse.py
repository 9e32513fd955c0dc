"""A sans-I/O Server-Sent Events decoder.

`feed(bytes)` returns the events completed by those bytes and keeps the partial line for the next
call, so the relay can forward each upstream chunk the moment it arrives and parse on the side.
It follows the WHATWG event-stream rules that matter here: lines end in LF, CRLF or CR (a CR at the
end of one chunk may be the first half of a CRLF), `data:` lines are joined with LF, comment lines
are ignored, and an event is dispatched on a blank line. Data is kept as bytes: JSON parsers take
bytes, and most events are never decoded at all.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Event:
    data: bytes
    event: str | None = None


class SSEDecoder:
    __slots__ = ("_data", "_ends", "_event", "_has_data", "_partial", "_pending_cr", "_shift")

    def __init__(self) -> None:
        self._partial = b""
        self._pending_cr = False
        self._data: list[bytes] = []
        self._has_data = False
        self._event: str | None = None
        self._ends: list[int] | None = None
        self._shift = 0

    @property
    def has_pending(self) -> bool:
        """Bytes of an unfinished event have been fed (and, in the relay, already forwarded)."""
        return bool(self._partial or self._has_data or self._pending_cr or self._event)

    def feed_with_ends(self, chunk: bytes) -> tuple[list[Event], list[int]]:
        """Like `feed`, plus where in `chunk` each event ended (just past its blank line)."""
        ends: list[int] = []
        self._ends = ends
        try:
            return self.feed(chunk), ends
        finally:
            self._ends = None

    def feed(self, chunk: bytes) -> list[Event]:
        events: list[Event] = []
        if not chunk:
            return events
        skip = 0
        if self._pending_cr:
            self._pending_cr = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
                skip = 1
        # An offset in buf, minus _shift, is the offset in the caller's chunk.
        self._shift = len(self._partial) - skip
        buf = self._partial + chunk if self._partial else chunk
        start = 0
        end = len(buf)
        line = self._line
        # Fast path: the upstreams we front emit LF only; fall back to a scan when a CR appears.
        if b"\r" not in buf:
            while True:
                nl = buf.find(b"\n", start)
                if nl < 0:
                    break
                line(buf[start:nl], nl + 1, events)
                start = nl + 1
        else:
            while start < end:
                cr = buf.find(b"\r", start)
                nl = buf.find(b"\n", start)
                if cr < 0 and nl < 0:
                    break
                if cr < 0 or (0 <= nl < cr):
                    line(buf[start:nl], nl + 1, events)
                    start = nl + 1
                    continue
                # A CR: a CRLF pair, or a lone CR (which may be half of a CRLF split across feeds).
                text = buf[start:cr]
                if cr + 1 < end:
                    start = cr + 2 if buf[cr + 1 : cr + 2] == b"\n" else cr + 1
                    line(text, start, events)
                else:
                    self._pending_cr = True
                    line(text, end, events)
                    start = end
        self._partial = buf[start:]
        return events

    def _line(self, line: bytes, end: int, events: list[Event]) -> None:
        if not line:
            if self._has_data:
                events.append(Event(b"\n".join(self._data), self._event))
                if self._ends is not None:
                    self._ends.append(end - self._shift)
            self._data = []
            self._has_data = False
            self._event = None
            return
        if line[:5] == b"data:":
            value = line[6:] if line[5:6] == b" " else line[5:]
            self._data.append(value)
            self._has_data = True
            return
        if line[:1] == b":":
            return
        field, sep, value = line.partition(b":")
        if sep and value[:1] == b" ":
            value = value[1:]
        if field == b"event":
            self._event = value.decode("utf-8", "replace")
        elif field == b"data":  # "data" with no colon: an empty data line
            self._data.append(b"")
            self._has_data = True
        # id and retry carry nothing a meter needs.

    def flush(self) -> list[Event]:
        """End of stream: a final event not followed by a blank line is dispatched, as browsers
        do not, but an upstream cut mid-event still produced tokens we must count."""
        events: list[Event] = []
        if self._partial:
            self._line(self._partial, 0, events)
            self._partial = b""
        self._line(b"", 0, events)
        return events
