"""Single flight, per process: of identical misses arriving together, the first goes upstream
(the leader) and the others wait for its entry. The leader always ends its flight, with the
entry or with None (its answer was not stored: an error, a cut stream, too large), and the
waiters then go upstream themselves. No client can hold another: a waiter stops waiting, and
goes upstream itself, at its own bound (its upstream's first-byte timeout, at most
`lock_timeout_s`), and as soon as the leader's answer is not going to be stored (its fill went
over its bound) or the leader's client falls behind (the leader's relay has held a chunk for
`LEADER_STALL_S` without coming back for the next one, or a JSON answer that long without its
flight landing: a client that does not read). Replicas do not coordinate: each may make one
call for the same request."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Protocol

from proxy.cache.entry import Entry

# How long the leader's relay may hold a chunk it is writing to its client before the
# waiters stop waiting for it: a client that reads takes its writes in milliseconds; one that
# falls behind this far is not worth another client's wait.
LEADER_STALL_S = 1.0


class Leading(Protocol):
    """What a waiter reads of the leader's answer on its way (`proxy.cache.cache.Fill`)."""

    def stalled(self, now: float, stall_s: float) -> bool: ...


@dataclass(slots=True)
class Flight:
    landed: asyncio.Future[Entry | None]
    leader: Leading


class Flights:
    __slots__ = ("_open",)

    def __init__(self) -> None:
        self._open: dict[str, Flight] = {}

    def open(self, key: str) -> Flight | None:
        return self._open.get(key)

    def lead(self, key: str, leader: Leading) -> Flight | None:
        """None: the caller leads the flight of `key` (and must `land` it); else the flight
        already under way, to wait for."""
        flight = self._open.get(key)
        if flight is not None:
            return flight
        self._open[key] = Flight(asyncio.get_running_loop().create_future(), leader)
        return None

    def land(self, key: str, entry: Entry | None) -> None:
        flight = self._open.pop(key, None)
        if flight is not None and not flight.landed.done():
            flight.landed.set_result(entry)

    @staticmethod
    async def wait(flight: Flight, within_s: float,
                   stall_s: float = LEADER_STALL_S) -> Entry | None:
        """The leader's entry, or None (go upstream): at `within_s`, or as soon as the
        leader's answer will not be stored or its client falls behind (checked every half
        `stall_s`: a timer, not a wake-up per chunk of the leader's)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        while True:
            left = deadline - loop.time()
            if left <= 0:
                return None
            try:
                async with asyncio.timeout(min(left, stall_s / 2)):
                    return await asyncio.shield(flight.landed)
            except TimeoutError:
                if flight.leader.stalled(time.monotonic(), stall_s):
                    return None

    def __len__(self) -> int:
        return len(self._open)
