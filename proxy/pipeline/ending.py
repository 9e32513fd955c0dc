"""A stream's final event, kept from the client until the request's ledger row is spooled.

The README promises that a client that has seen the end of its answer is in the books, even if
the proxy is SIGKILLed the next instant. A stream's end, for the SDKs, is its final event
(`data: [DONE]`, `event: message_stop`, `event: response.completed`): the openai SDK returns
from its loop at `[DONE]` and closes the connection without reading further. The relay forwards
each chunk as it comes, and settling (which spools the row) starts only after the upstream has
ended its response, which it may do well after its final event: in that gap a client had its
whole answer and the books had nothing (one of 2,960 completed requests after ten SIGKILLs
under load).

`EndHeld` wraps the client's writer: bytes before the line that starts the final event go out
as they come (a scan of each chunk for the API's final-event lines, `Translator.final_events`,
at a line's start); from that line on, everything is kept. The handler releases it once settle
has spooled the row (`proxy.ledger.ledger.Ledger.record`'s `then`), or settle is over without
one, and only then the stream's last chunk goes out. A final event split across two chunks
before its marker is complete goes out unheld (the row then follows it by a loop
turn or two); so does a stream whose upstream omits the `event:` lines.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol

from aiohttp import web


class Writer(Protocol):
    """Where a stream's bytes go: the client's `web.StreamResponse`, or a writer over it."""

    def write(self, data: bytes) -> Awaitable[None]: ...


async def _kept() -> None:
    """A write that only kept its bytes: nothing to wait for."""


def final_at(data: bytes, markers: tuple[bytes, ...]) -> int:
    """Where in `data` the first line starting with one of `markers` starts; -1: none. A marker
    inside a JSON string (an answer quoting SSE) is never at a line's start: JSON escapes its
    line breaks."""
    first = -1
    for marker in markers:
        at = data.find(marker)
        while at > 0 and data[at - 1] not in b"\r\n":
            at = data.find(marker, at + 1)
        if at >= 0 and (first < 0 or at < first):
            first = at
    return first


class EndHeld:
    """A stream's writer that keeps its final event, and all after it, until `release`."""

    __slots__ = ("_held", "_inner", "_markers")

    def __init__(self, inner: Writer, markers: tuple[bytes, ...]) -> None:
        self._inner = inner
        self._markers = markers
        self._held: list[bytes] | None = None  # None: nothing held yet

    @property
    def holding(self) -> bool:
        return self._held is not None

    def write(self, data: bytes) -> Awaitable[None]:
        held = self._held
        if held is not None:
            held.append(data)
            return _kept()
        at = final_at(data, self._markers)
        if at < 0:
            return self._inner.write(data)  # the client's write itself: no frame more
        self._held = [data[at:]]
        return self._inner.write(data[:at]) if at else _kept()

    async def release(self) -> None:
        """Write what is kept; from here on bytes go out as they come."""
        held, self._held = self._held, None
        if held:
            await self._inner.write(b"".join(held))


def resolves(future: asyncio.Future[None]) -> Callable[[], None]:
    """A callback that completes `future` (once: later calls do nothing)."""

    def done() -> None:
        if not future.done():
            future.set_result(None)

    return done


ENDING = web.ResponseKey("ending", EndHeld)  # on a relayed stream's response: its EndHeld
