"""Where budget counters live: the interface, and the in-process store for a single instance.

A store does three things atomically per user slot:
- `reserve`: drop reservations whose lease ran out (their proxy died), check the concurrency
  limit and every window (`used + amount <= limit`), and only if all pass add the amounts and
  record the reservation under a lease;
- `settle`: replace a reservation's amounts by the actual ones (or add them outright if the
  reservation is unknown: admitted while the store was down, or its lease expired), once per id;
- `renew`: extend the leases of reservations still streaming.
The Redis store does the same in Lua, so replicas sharing one Redis share one budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol


class StoreError(Exception):
    """The store could not be reached or did not answer in time."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One window of a reservation or settlement: a counter, its limit, an amount."""

    key: str
    limit: int | None
    amount: int
    ttl_s: int


@dataclass(frozen=True, slots=True)
class ReserveResult:
    ok: bool
    refused: int | None  # index into the entries, or -1 for the concurrency limit
    used: tuple[int, ...]  # per entry: counter value after the call (before on refusal)
    in_flight: int


class Store(Protocol):
    async def reserve(
        self, slot: str, res_id: str, entries: Sequence[Entry], max_concurrent: int | None,
        lease_s: float,
    ) -> ReserveResult: ...

    async def settle(self, slot: str, res_id: str, entries: Sequence[Entry]) -> tuple[int, ...]: ...

    async def renew(self, slot: str, res_ids: Sequence[str], lease_s: float) -> None: ...

    async def read(self, keys: Sequence[str]) -> tuple[int, ...]: ...

    async def mark_once(self, key: str, ttl_s: int) -> bool:
        """True the first time `key` is marked within its ttl (threshold notices)."""
        ...

    async def ping(self) -> None: ...

    async def close(self) -> None: ...


_DONE_TTL_S = 600  # settle is idempotent per reservation for this long (retries after errors)


class MemoryStore:
    """Same semantics as the Redis store, in this process only (one replica, or tests)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._counters: dict[str, tuple[int, float]] = {}  # key -> (value, expires_at)
        self._leases: dict[str, dict[str, float]] = {}  # slot -> res_id -> deadline
        self._reserved: dict[str, dict[str, tuple[tuple[str, int], ...]]] = {}
        self._marks: dict[str, float] = {}

    def _get(self, key: str, now: float) -> int:
        item = self._counters.get(key)
        if item is None or item[1] <= now:
            self._counters.pop(key, None)
            return 0
        return item[0]

    def _add(self, key: str, delta: int, ttl_s: int, now: float) -> int:
        item = self._counters.get(key)
        if item is None or item[1] <= now:
            value, expires = delta, now + ttl_s
        else:
            value, expires = item[0] + delta, item[1]
        self._counters[key] = (value, expires)
        return value

    def _reap(self, slot: str, now: float) -> None:
        leases = self._leases.get(slot, {})
        reserved = self._reserved.get(slot, {})
        for res_id in [r for r, deadline in leases.items() if deadline <= now]:
            del leases[res_id]
            for key, amt in reserved.pop(res_id, ()):
                if key in self._counters:
                    self._add(key, -amt, 0, now)

    async def reserve(
        self, slot: str, res_id: str, entries: Sequence[Entry], max_concurrent: int | None,
        lease_s: float,
    ) -> ReserveResult:
        now = self._clock()
        self._reap(slot, now)
        leases = self._leases.setdefault(slot, {})
        used = tuple(self._get(e.key, now) for e in entries)
        if max_concurrent is not None and len(leases) >= max_concurrent:
            return ReserveResult(False, -1, used, len(leases))
        for i, (e, u) in enumerate(zip(entries, used, strict=True)):
            if e.limit is not None and u + e.amount > e.limit:
                return ReserveResult(False, i, used, len(leases))
        after = tuple(self._add(e.key, e.amount, e.ttl_s, now) for e in entries)
        leases[res_id] = now + lease_s
        self._reserved.setdefault(slot, {})[res_id] = tuple((e.key, e.amount) for e in entries)
        return ReserveResult(True, None, after, len(leases))

    async def settle(self, slot: str, res_id: str, entries: Sequence[Entry]) -> tuple[int, ...]:
        now = self._clock()
        done = f"{slot}:done:{res_id}"
        if self._marks.get(done, 0.0) > now:
            return tuple(self._get(e.key, now) for e in entries)
        self._marks[done] = now + _DONE_TTL_S
        if len(self._marks) > 10_000:
            self._prune(now)
        reserved = dict(self._reserved.get(slot, {}).pop(res_id, ()))
        self._leases.get(slot, {}).pop(res_id, None)
        return tuple(
            self._add(e.key, e.amount - reserved.get(e.key, 0), e.ttl_s, now) for e in entries
        )

    def _prune(self, now: float) -> None:
        """Expiry is lazy on read; without Redis's own expiry, sweep now and then."""
        self._marks = {k: t for k, t in self._marks.items() if t > now}
        self._counters = {k: v for k, v in self._counters.items() if v[1] > now}

    async def renew(self, slot: str, res_ids: Sequence[str], lease_s: float) -> None:
        leases = self._leases.get(slot, {})
        deadline = self._clock() + lease_s
        for res_id in res_ids:
            if res_id in leases:
                leases[res_id] = deadline

    async def read(self, keys: Sequence[str]) -> tuple[int, ...]:
        now = self._clock()
        return tuple(self._get(k, now) for k in keys)

    async def mark_once(self, key: str, ttl_s: int) -> bool:
        now = self._clock()
        if self._marks.get(key, 0.0) > now:
            return False
        self._marks[key] = now + ttl_s
        return True

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None
