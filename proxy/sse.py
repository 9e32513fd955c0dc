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
    __slots__ = ("_data", "_event", "_has_data", "_partial", "_pending_cr")

    def __init__(self) -> None:
        self._partial = b""
        self._pending_cr = False
        self._data: list[bytes] = []
        self._has_data = False
        self._event: str | None = None

    def feed(self, chunk: bytes) -> list[Event]:
        events: list[Event] = []
        if not chunk:
            return events
        if self._pending_cr:
            self._pending_cr = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
        buf = self._partial + chunk if self._partial else chunk
        start = 0
        end = len(buf)
        # Fast path: the upstreams we front emit LF only; fall back to a scan when a CR appears.
        if b"\r" not in buf:
            while True:
                nl = buf.find(b"\n", start)
                if nl < 0:
                    break
                self._line(buf[start:nl], events)
                start = nl + 1
        else:
            while start < end:
                cr = buf.find(b"\r", start)
                nl = buf.find(b"\n", start)
                if cr < 0 and nl < 0:
                    break
                if cr < 0 or (0 <= nl < cr):
                    self._line(buf[start:nl], events)
                    start = nl + 1
                    continue
                # A CR: a CRLF pair, or a lone CR (which may be half of a CRLF split across feeds).
                self._line(buf[start:cr], events)
                if cr + 1 < end:
                    start = cr + 2 if buf[cr + 1 : cr + 2] == b"\n" else cr + 1
                else:
                    self._pending_cr = True
                    start = end
        self._partial = buf[start:]
        return events

    def _line(self, line: bytes, events: list[Event]) -> None:
        if not line:
            if self._has_data:
                events.append(Event(b"\n".join(self._data), self._event))
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

    @property
    def has_pending(self) -> bool:
        """Bytes of an unfinished event have been fed (and, in the relay, already forwarded)."""
        return bool(self._partial or self._has_data or self._pending_cr or self._event)

    def flush(self) -> list[Event]:
        """End of stream: a final event not followed by a blank line is dispatched, as browsers
        do not, but an upstream cut mid-event still produced tokens we must count."""
        events: list[Event] = []
        if self._partial:
            self._line(self._partial, events)
            self._partial = b""
        self._line(b"", events)
        return events


def split_events(buf: bytes) -> tuple[list[bytes], bytes]:
    """Split raw stream bytes into complete raw events (each with its blank-line terminator) and the
    incomplete rest. Used only where whole events must be held back (see `relay`)."""
    out: list[bytes] = []
    start = 0
    while True:
        lf = buf.find(b"\n\n", start)
        crlf = buf.find(b"\r\n\r\n", start)
        if lf < 0 and crlf < 0:
            break
        end = crlf + 4 if crlf >= 0 and (lf < 0 or crlf < lf) else lf + 2
        out.append(buf[start:end])
        start = end
    return out, buf[start:]
