"""Single flight, per process: of identical misses arriving together, the first goes upstream
(the leader) and the others wait for its entry. The leader always ends its flight, with the
entry or with None (its answer was not stored: an error, a cut stream, too large), and the
waiters then go upstream themselves; a waiter also stops waiting at its bound. Replicas do not
coordinate: each may make one call for the same request."""

from __future__ import annotations

import asyncio

from proxy.cache.entry import Entry


class Flights:
    __slots__ = ("_open",)

    def __init__(self) -> None:
        self._open: dict[str, asyncio.Future[Entry | None]] = {}

    def open(self, key: str) -> asyncio.Future[Entry | None] | None:
        return self._open.get(key)

    def lead(self, key: str) -> asyncio.Future[Entry | None] | None:
        """None: the caller leads the flight of `key` (and must `land` it); else the flight
        already under way, to wait for."""
        flight = self._open.get(key)
        if flight is not None:
            return flight
        self._open[key] = asyncio.get_running_loop().create_future()
        return None

    def land(self, key: str, entry: Entry | None) -> None:
        flight = self._open.pop(key, None)
        if flight is not None and not flight.done():
            flight.set_result(entry)

    @staticmethod
    async def wait(flight: asyncio.Future[Entry | None], within_s: float) -> Entry | None:
        try:
            async with asyncio.timeout(within_s):
                return await asyncio.shield(flight)
        except TimeoutError:
            return None

    def __len__(self) -> int:
        return len(self._open)
