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

from proxy.meter import RequestMeter
from proxy.sse import SSEDecoder, split_events
from proxy.translators import CONTENT, FINISH, USAGE_ONLY, Translator


class StreamTap:
    __slots__ = ("_decoder", "_held", "_holding", "_meter", "_on_event", "_strip")

    def __init__(self, translator: Translator, meter: RequestMeter) -> None:
        self._decoder = SSEDecoder()
        self._on_event = translator.on_event
        self._meter = meter
        self._strip = translator.strips_usage
        self._holding = False  # a choice finished: relay event by event from here on
        self._held = b""  # the incomplete event being held back

    def passthrough(self, chunk: bytes) -> bool:
        return not self._strip or not (
            self._holding or b'"usage":{' in chunk or b'"usage": {' in chunk
        )

    def observe(self, chunk: bytes, now: float) -> None:
        """A chunk that has been forwarded as is."""
        for event in self._decoder.feed(chunk):
            flags = self._on_event(event)
            if flags & CONTENT:
                self._meter.content(now)
            if flags & FINISH:
                self._holding = True

    def filter(self, chunk: bytes, now: float) -> bytes:
        """A chunk that may contain the usage-only event: returns what to forward."""
        tainted = not self._held and self._decoder.has_pending
        raws, self._held = split_events(self._held + chunk)
        out: list[bytes] = []
        for raw in raws:
            keep = True
            for event in self._decoder.feed(raw):
                flags = self._on_event(event)
                if flags & CONTENT:
                    self._meter.content(now)
                if flags & FINISH:
                    self._holding = True
                if flags & USAGE_ONLY and not tainted:
                    keep = False
            tainted = False
            if keep:
                out.append(raw)
        if self._held and not self._holding:
            # Before any choice finished, an incomplete event is content: never hold it back.
            rest, self._held = self._held, b""
            out.append(rest)
            self.observe(rest, now)
        return b"".join(out)

    def close(self) -> bytes:
        """End of the upstream stream: the held rest (if any) is forwarded, and a final event not
        terminated by a blank line (a cut stream) is still metered."""
        rest, self._held = self._held, b""
        events = self._decoder.feed(rest) if rest else []
        events += self._decoder.flush()
        for event in events:
            self._on_event(event)
        return rest
