"""Sans-I/O core of a relayed stream: what of the upstream's bytes reaches the client, and what
the meter learns from them.

The relay drives it with one loop, the same for every chunk:

    out = tap.feed(chunk, now)   # what to forward
    if out:
        await resp.write(out)
    tap.look()                   # parse what `feed` left for after the write
    ...
    rest = tap.close()           # end of stream: forward `rest` too

Forward first, look second. For nearly every chunk `feed` returns the chunk itself without
parsing it, and the parse runs in `look`, after the write, so metering never delays a byte. The
one exception is a stream whose usage the proxy asked for (`stream_options.include_usage`)
without the client asking: its usage-only event must not reach the client. A chunk that may hold
it (it contains a usage object, or a choice has already finished, after which only that event and
`[DONE]` follow) is parsed in `feed`, by whole raw events, and `feed` returns the bytes to
forward; `look` is then a no-op. An event whose first bytes were already forwarded is never
dropped, so the client's stream is never corrupted.

Why `feed` + `look` and not one call: the parse must come after the write, and the write is the
caller's (it awaits). Deferring the parse to the next `feed` instead would leave the last chunk
unparsed when the handler is cancelled (a client disconnect does that) and would meter a chunk
whose write failed; a `look` after the write meters exactly the bytes written, the caller never
chooses between code paths, and the common case costs one store more than no deferral at all.
`feed` returns bytes, not a (bytes, parsed) pair: the pair would be allocated per chunk, and the
caller needs nothing from it that `look` does not already know.

Before either, `feed` drops the upstream's own `: tokenmeter` comment lines (`OwnComments`):
the cost comment a client reads is the proxy's alone. A chunk without one costs a bytes search
and an `endswith` (about 0.2 us of the ~2.8 us per chunk of benchmarks/bench_tap.py).

Hot-path notes (measured with benchmarks/bench_tap.py): the usage sniff (`carries_usage`) is one
scan of the chunk done once, here, and handed to the translator, which would otherwise scan the
same bytes again; `EventFlag` values are compared by identity or as plain ints, since an IntFlag
`&` costs about 0.4 us, a sixth of the whole per-chunk cost.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from proxy.protocol.sse import SSEDecoder, events_at_most
from proxy.protocol.timing import ContentMeter
from proxy.protocol.translators import EventFlag, Translator, carries_usage

log = logging.getLogger("tokenmeter.tap")

_CONTENT_FLAG = EventFlag.CONTENT  # the one result of the hot path, tested by identity
# What starts the proxy's own comment line (proxy.pipeline.relay's cost line): one the upstream
# sends is dropped, so the only one a client reads is the proxy's.
OWN_COMMENT = b": tokenmeter"
_LINE_ENDS = (b"\n", b"\r")
_CONTENT = int(EventFlag.CONTENT)
_FINISH = int(EventFlag.FINISH)
_USAGE_ONLY = int(EventFlag.USAGE_ONLY)


class OwnComments:
    """Drops every line of the upstream's stream that starts with `: tokenmeter` (an SSE comment
    line), with its line end (LF, CRLF or CR): the proxy's cost comment is the proxy's to
    write. Bytes in, bytes out, across any cuts: a line cut by a chunk's end is dropped to its
    end in the next, and a chunk's tail that may be the start of such a line (a line start
    followed by a proper prefix of `: tokenmeter`) is held until the next chunk says.

    The caller skips `scrub` for a chunk that holds no `: tokenmeter`, ends at a line end and
    finds `pending` false (nearly every chunk): one bytes search per chunk on the hot path."""

    __slots__ = ("_dropping", "_held", "_skip_lf", "pending")

    def __init__(self) -> None:
        self._held = b""  # a tail that may start a `: tokenmeter` line, not forwarded yet
        self._dropping = False  # in such a line, its end not seen yet
        self._skip_lf = False  # such a line ended with a chunk's last byte, a CR: an LF next
        #                        is its CRLF's second half
        # Any of those, or the bytes so far stop inside a line (so the next chunk's first byte
        # is no line start): the next chunk must go through `scrub`.
        self.pending = False

    def scrub(self, chunk: bytes) -> bytes:
        """`chunk` without the `: tokenmeter` lines (and with the tail held before it)."""
        buf = self._held + chunk if self._held else chunk
        line_start = not self.pending or bool(self._held)  # at buf[0]
        self._held = b""
        pos = at = 0  # forwarded up to `pos`; look for the mark from `at`
        out: list[bytes] = []
        if self._skip_lf and buf:
            self._skip_lf = False
            pos = at = int(buf[:1] == b"\n")
            line_start = True
        if self._dropping:
            pos = at = self._line_end(buf, pos)
            if self._dropping:
                return b""
            line_start = True
        while (j := buf.find(OWN_COMMENT, at)) >= 0:
            if (line_start and j == 0) or (j > 0 and buf[j - 1] in b"\n\r"):
                out.append(buf[pos:j])
                pos = at = self._line_end(buf, j)
                if self._dropping:
                    break
            else:
                at = j + 1
        self.pending = self._dropping or self._skip_lf
        if not self.pending and pos < len(buf) and not buf.endswith(_LINE_ENDS):
            self.pending = True  # stops inside a line
            keep = self._tail(buf, pos, line_start)
            if keep < len(buf):
                self._held = buf[keep:]
                buf = buf[:keep]
        if not out:
            return buf[pos:] if pos else buf
        out.append(buf[pos:])
        return b"".join(out)

    def _line_end(self, buf: bytes, start: int) -> int:
        """Past the end of the line that goes on at `start` (its CRLF whole); `_dropping` says
        whether it goes on past `buf`, `_skip_lf` whether its CR ended `buf`."""
        lf, cr = buf.find(b"\n", start), buf.find(b"\r", start)
        end = lf if cr < 0 or 0 <= lf < cr else cr
        self._dropping = end < 0
        if end < 0:
            return len(buf)
        if end == cr:
            if end + 1 == len(buf):
                self._skip_lf = True
            elif buf[end + 1 : end + 2] == b"\n":
                end += 1
        return end + 1

    @staticmethod
    def _tail(buf: bytes, pos: int, line_start: bool) -> int:
        """Where a tail of `buf` that may start a `: tokenmeter` line begins (its last line
        starts there, after `pos`, and what follows is a proper prefix of the mark); else
        len(buf). `buf` does not end with a line end."""
        window = max(pos, len(buf) - len(OWN_COMMENT))
        since = max(window - 1, 0)
        start = max(buf.rfind(b"\n", since), buf.rfind(b"\r", since)) + 1
        if start == 0 and not (line_start and window == 0):
            return len(buf)
        start = max(start, pos)
        return start if OWN_COMMENT.startswith(buf[start:]) else len(buf)

    def release(self) -> bytes:
        """End of stream: a held tail was no `: tokenmeter` line after all."""
        rest, self._held = self._held, b""
        return rest


class StreamTap:
    __slots__ = ("_broken", "_decoder", "_held", "_holding", "_meter", "_next", "_next_at",
                 "_on_error", "_on_event", "_own", "_strip", "_tainted", "_take_run",
                 "_translator")

    def __init__(self, translator: Translator, meter: ContentMeter,
                 on_error: Callable[[], None] = lambda: None) -> None:
        self._broken = False
        self._on_error = on_error
        self._decoder = SSEDecoder()
        self._on_event = translator.on_event
        self._take_run = translator.take_content_run
        self._translator = translator
        self._meter = meter
        self._strip = translator.strips_usage
        self._holding = False  # a choice finished: relay event by event from here on
        self._held = b""  # bytes of the current event, fed to the decoder but not forwarded
        self._tainted = False  # the current event's first bytes were already forwarded
        self._next = b""  # the chunk `feed` forwarded unparsed, for `look`
        self._next_at = 0.0
        self._own = OwnComments()

    @property
    def broken(self) -> bool:
        """Metering failed and stopped: what the translator knows of the stream is partial."""
        return self._broken

    @property
    def client_at_boundary(self) -> bool:
        """The bytes forwarded so far end between two events, so another event may follow."""
        if self._held:  # held bytes start a new event, unless its start went out already
            return not self._tainted
        return not self._decoder.mid_event

    def pieces(self, chunk: bytes, events: int) -> list[bytes]:
        """`chunk` cut just past each event it ends, if it may end `events` events or more;
        else `[chunk]`, whole (a bytes count or three: `events_at_most`). The cuts follow the
        decoder's own framing (LF, CRLF or CR line ends, a CRLF split across chunks): `feed`
        and `look` the pieces one at a time, and each event is forwarded and metered before
        the next, so a caller can act between any two (a stream's top-ups, proxy.pipeline.
        relay) without framing events itself."""
        if events_at_most(chunk) < events:
            return [chunk]
        return self._decoder.pieces(chunk)

    def feed(self, chunk: bytes, now: float) -> bytes:
        """The bytes to forward for `chunk`, which arrived at `now`. Call `look` after writing
        them (whether or not they were empty)."""
        # The upstream's `: tokenmeter` comment lines go first, before anything reads the
        # chunk: the decoder, the translator and the client see the stream without them.
        own = self._own
        if own.pending or chunk.find(OWN_COMMENT) >= 0 or not chunk.endswith(_LINE_ENDS):
            chunk = own.scrub(chunk)
            if not chunk:
                self._next = b""
                return chunk
        if self._strip and (self._holding or carries_usage(chunk)):
            self._next = b""
            try:
                return self._filter(chunk, now)
            except Exception:
                self._break()
                rest, self._held = self._held, b""
                return rest + chunk
        self._next = chunk
        self._next_at = now
        return chunk

    def look(self) -> None:
        """Meter the chunk `feed` forwarded unparsed, if any. Runs after the write."""
        chunk = self._next
        if not chunk or self._broken:
            return
        self._next = b""
        try:
            data = self._decoder.whole_event(chunk)
            if data is not None:
                # The sniff in `feed` covered this very event (stripping streams only).
                self._event(data, None, self._next_at, False if self._strip else None)
                self._tainted = False
                return
            now = self._next_at
            events = self._decoder.whole_events(chunk)
            if events is not None:
                self._runs(chunk, events, now, None)
                self._tainted = False
                return
            # The first event may have begun in an earlier chunk, outside the sniff; the others
            # lie wholly in this one.
            marked, known = None, False if self._strip else None
            for event in self._decoder.feed(chunk):
                self._event(event.data, event.event, now, marked)
                marked = known
            self._tainted = self._decoder.mid_event
        except Exception:
            self._break()

    def _break(self) -> None:
        """A bug in metering must not cost the client its stream: say so loudly, stop looking,
        and forward everything from here on as it comes."""
        log.exception("metering failed mid-stream; the rest is forwarded unmetered")
        self._on_error()
        self._broken = True
        self._strip = False

    def _event(self, data: bytes, name: str | None, now: float, marked: bool | None) -> int:
        flags = self._on_event(data, name, marked)
        if flags is _CONTENT_FLAG:
            self._meter.content(now)
            return _CONTENT
        bits = int(flags)
        if bits & _CONTENT:
            self._meter.content(now)
        if bits & _FINISH:
            self._holding = True
        return bits

    def _runs(self, chunk: bytes, events: list[bytes], now: float,
              out: list[bytes] | None) -> None:
        """`chunk` is whole one-line data events (`events`, their data), nothing pending:
        runs of plain content are taken in one step (`Translator.take_content_run`), the other
        events one by one. With `out`, the bytes to forward are appended to it: all but a
        usage-only event of a stripping stream. Once an event a run could have taken but did
        not turns out to be content (a kind the run does not know, or vLLM's usage in every
        event), the rest of the chunk goes event by event: no run scan per event."""
        pos = i = 0
        runs = True
        translator = self._translator
        while i < len(events):
            could = False
            if runs:
                could = translator.seen_content
                count, end = self._take_run(chunk, pos, events, i)
                if count:
                    self._meter.content_run(now, count)
                    if out is not None:
                        out.append(chunk[pos:end])
                    pos, i = end, i + count
                    continue
            data = events[i]
            end = pos + len(data) + 8
            flags = self._event(data, None, now, None)
            if could and flags & _CONTENT:
                runs = False
            if out is not None and not flags & _USAGE_ONLY:
                out.append(chunk[pos:end])
            pos, i = end, i + 1

    def _filter(self, chunk: bytes, now: float) -> bytes:
        if not self._held:
            events = self._decoder.whole_events(chunk)
            if events is not None:
                forward: list[bytes] = []
                self._runs(chunk, events, now, forward)
                self._tainted = False
                return b"".join(forward)
        buf = self._held + chunk
        shift = len(self._held)
        out: list[bytes] = []
        pos = 0
        for event in self._decoder.feed(chunk):
            flags = self._event(event.data, event.event, now, None)
            end = shift + event.end
            if not (flags & _USAGE_ONLY and not self._tainted):
                out.append(buf[pos:end])
            pos = end
            self._tainted = False
        rest = buf[pos:]
        if self._holding:
            self._held = rest
        else:
            # Before any choice finished, an incomplete event is content: never hold it back.
            out.append(rest)
            self._held = b""
            self._tainted = bool(rest) or self._decoder.mid_event
        return b"".join(out)

    def close(self) -> bytes:
        """End of the upstream stream: the held rest (if any) is returned for forwarding, and a
        final event not terminated by a blank line (a cut stream) is still metered. A chunk
        `feed` forwarded whose `look` never came (its write failed) stays unmetered."""
        self._next = b""
        rest, self._held = self._held + self._own.release(), b""
        if not self._broken:
            try:
                for event in self._decoder.flush():
                    self._on_event(event.data, event.event, None)
            except Exception:
                self._break()
        return rest
