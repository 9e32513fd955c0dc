"""Idle timeout for relayed streams, checked by one sweep instead of a timer per read.

aiohttp's `sock_read` timeout cancels and re-arms a timer on every read: measurable at 14,000
chunks a second. Here the relay only stores the time of each read in its `Watch`; a single task
per app looks at all watches a few times a second and closes the upstream response of a stream
that has been silent for longer than its upstream's `idle_timeout_s`.

Only the upstream's silence counts. While the relay waits for a write to the client (a client
that reads slowly pushes back, and the proxy stops reading the upstream meanwhile), the watch is
marked `writing` and its clock stands still. A write that takes longer than the optional client
write timeout ends the client's connection instead: that is the client's fault, not the
upstream's.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator

SWEEP_SECONDS = 0.1


class Watch:
    __slots__ = ("abort_client", "client_expired", "close_upstream", "expired", "last",
                 "timeout", "write_timeout", "writing")

    def __init__(
        self, close_upstream: Callable[[], None], timeout: float,
        write_timeout: float | None = None, abort_client: Callable[[], None] | None = None,
    ) -> None:
        # Ends the upstream response (its `close`): the relay's read then fails.
        self.close_upstream = close_upstream
        self.timeout = timeout
        self.last = time.perf_counter()
        self.expired = False
        # perf_counter() when the write in progress began, 0.0 when none is.
        self.writing = 0.0
        self.write_timeout = write_timeout
        self.abort_client = abort_client
        self.client_expired = False


class Watchdog:
    def __init__(self) -> None:
        self._watches: set[Watch] = set()

    @contextlib.contextmanager
    def watch(
        self, close_upstream: Callable[[], None], timeout: float, *,
        write_timeout: float | None = None, abort_client: Callable[[], None] | None = None,
    ) -> Iterator[Watch]:
        w = Watch(close_upstream, timeout, write_timeout, abort_client)
        self._watches.add(w)
        try:
            yield w
        finally:
            self._watches.discard(w)

    def sweep(self) -> None:
        now = time.perf_counter()
        for w in list(self._watches):
            if w.writing:
                # Waiting on the client: the upstream's clock restarts when the write is done.
                w.last = now
                if (
                    w.write_timeout is not None
                    and not w.client_expired
                    and now - w.writing > w.write_timeout
                ):
                    w.client_expired = True
                    if w.abort_client is not None:
                        w.abort_client()
            elif not w.expired and now - w.last > w.timeout:
                w.expired = True
                # Closing the connection ends the relay's read with a ClientError, which it
                # reports as a timeout because `expired` is set.
                w.close_upstream()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_SECONDS)
            self.sweep()
