"""Sans-I/O core of a relayed stream: reads the SSE bytes on the side of the relay.

For nearly every chunk `passthrough(chunk)` is true: the relay writes the chunk to the client
first and then calls `observe`, so metering never delays a byte. The one exception is a stream
whose usage the proxy asked for (`stream_options.include_usage`) without the client asking: its
usage-only event must not reach the client. A chunk that may hold it (it contains a usage object,
or a choice has already finished, after which only that event and `[DONE]` follow) goes through
`filter`, which works on whole raw events and returns the bytes to forward. An event whose first
bytes were already forwarded is never dropped, so the client's stream is never corrupted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from proxy.meter import RequestMeter
from proxy.sse import SSEDecoder
from proxy.translators import CONTENT, FINISH, USAGE_ONLY, Translator

log = logging.getLogger("tokenmeter.tap")


class StreamTap:
    __slots__ = ("_broken", "_decoder", "_held", "_holding", "_meter", "_on_error", "_on_event",
                 "_strip", "_tainted")

    def __init__(self, translator: Translator, meter: RequestMeter,
                 on_error: Callable[[], None] = lambda: None) -> None:
        self._broken = False
        self._on_error = on_error
        self._decoder = SSEDecoder()
        self._on_event = translator.on_event
        self._meter = meter
        self._strip = translator.strips_usage
        self._holding = False  # a choice finished: relay event by event from here on
        self._held = b""  # bytes of the current event, fed to the decoder but not forwarded
        self._tainted = False  # the current event's first bytes were already forwarded

    @property
    def broken(self) -> bool:
        """Metering failed and stopped: what the translator knows of the stream is partial."""
        return self._broken

    @property
    def client_at_boundary(self) -> bool:
        """The bytes forwarded so far end between two events, so another event may follow."""
        if self._held:  # held bytes start a new event, unless its start went out already
            return not self._tainted
        return not self._decoder.has_pending

    def passthrough(self, chunk: bytes) -> bool:
        return not self._strip or not (
            self._holding or b'"usage":{' in chunk or b'"usage": {' in chunk
        )

    def _break(self) -> None:
        """A bug in metering must not cost the client its stream: say so loudly, stop looking,
        and forward everything from here on as it comes."""
        log.exception("metering failed mid-stream; the rest is forwarded unmetered")
        self._on_error()
        self._broken = True
        self._strip = False

    def observe(self, chunk: bytes, now: float) -> None:
        """A chunk that has been forwarded as is."""
        if self._broken:
            return
        try:
            self._observe(chunk, now)
        except Exception:
            self._break()

    def _observe(self, chunk: bytes, now: float) -> None:
        # Fast path for what fast upstreams send: one whole `data:` event per chunk, LF-framed,
        # with nothing pending in the decoder. It yields exactly what the decoder would.
        if (
            chunk[:6] == b"data: "
            and chunk.find(b"\n") == len(chunk) - 2
            and chunk[-1:] == b"\n"
            and b"\r" not in chunk
            and not self._decoder.has_pending
        ):
            self._flags(chunk[6:-2], None, now)
            self._tainted = False
            return
        for event in self._decoder.feed(chunk):
            self._flags(event.data, event.event, now)
        self._tainted = self._decoder.has_pending

    def _flags(self, data: bytes, name: str | None, now: float) -> int:
        flags = self._on_event(data, name)
        if flags & CONTENT:
            self._meter.content(now)
        if flags & FINISH:
            self._holding = True
        return flags

    def filter(self, chunk: bytes, now: float) -> bytes:
        """A chunk that may contain the usage-only event: returns what to forward."""
        try:
            return self._filter(chunk, now)
        except Exception:
            self._break()
            rest, self._held = self._held, b""
            return rest + chunk

    def _filter(self, chunk: bytes, now: float) -> bytes:
        buf = self._held + chunk
        shift = len(self._held)
        events, ends = self._decoder.feed_with_ends(chunk)
        out: list[bytes] = []
        pos = 0
        for event, end in zip(events, ends, strict=True):
            flags = self._flags(event.data, event.event, now)
            if not (flags & USAGE_ONLY and not self._tainted):
                out.append(buf[pos : shift + end])
            pos = shift + end
            self._tainted = False
        rest = buf[pos:]
        if self._holding:
            self._held = rest
        else:
            # Before any choice finished, an incomplete event is content: never hold it back.
            out.append(rest)
            self._held = b""
            self._tainted = bool(rest) or self._decoder.has_pending
        return b"".join(out)

    def close(self) -> bytes:
        """End of the upstream stream: the held rest (if any) is forwarded, and a final event not
        terminated by a blank line (a cut stream) is still metered."""
        rest, self._held = self._held, b""
        if not self._broken:
            try:
                for event in self._decoder.flush():
                    self._on_event(event.data, event.event)
            except Exception:
                self._break()
        return rest
