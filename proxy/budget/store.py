"""Where budget counters live: the interface, and the in-process store for a single instance.

A store does three things atomically per user slot:
- `reserve`: drop reservations whose lease ran out (their proxy died), check the concurrency
  limits (the user's in-flight set, and a key's own when it has a limit) and every window
  (`used + amount <= limit`), and only if all pass add the amounts and record the reservation
  under a lease; under the `clamp` admission policy the output tokens that fit are worked out
  and reserved in the same step (`proxy.budget.clamp`);
- `settle`: replace a reservation's amounts by the actual ones, once: the reservation's own
  record is what says it is not settled yet, so a settle leaves nothing behind. A reservation
  reaped because its lease ran out leaves a tombstone instead (rare: its proxy died, or could
  not renew), and its settle then adds the amounts outright;
- `add_once`: add usage the store holds no reservation for (requests admitted while it was
  down), once per id within a time to live, guarded by a done-marker per id: these are rare
  and batched (`proxy.budget.spool`), so markers stay few;
- `renew`: extend the leases of reservations still streaming.

So what a settled request leaves in the store is nothing: memory is bounded by the requests in
flight, the reaped ones within `REAPED_TTL_S` and the batches within their marker's ttl.
The Redis store does the same in Lua, so replicas sharing one Redis share one budget.

A slot is the unit of atomicity: the user's (`prefix:{alice}`), or for a team's users the
team's (`prefix:{t:platform}`), whose first in-flight set then holds every reservation of the
team, so any member's request reaps a member's dead reservation off the team's counters.
"""

from __future__ import annotations

import collections
import enum
import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from proxy.budget.clamp import Clamp, grant, room_for_output


class StoreError(Exception):
    """The store could not be reached or did not answer in time."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One window of a reservation or settlement: a counter, its limit, an amount."""

    key: str
    limit: int | None
    amount: int
    ttl_s: int


class ScopeKind(enum.Enum):
    USER = "u"  # the user's own counters
    KEY = "k"  # a key with limits of its own
    MODELS = "m"  # the user's use of a group of models (a glob)
    TEAM = "t"  # the counters a team's users share


@dataclass(frozen=True, slots=True)
class Scope:
    """Whose counter a window or an in-flight set is. `str()` is its part of a storage key
    (`u`, `k.<key>`, `m.<glob>`, `t.<team>`), which is never parsed back."""

    kind: ScopeKind
    name: str = ""  # the key's name, the model glob, or the team
    # Its part of a storage key, made once: every request's plan uses it.
    part: str = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        part = "u" if self.kind is ScopeKind.USER else f"{self.kind.value}.{self.name}"
        object.__setattr__(self, "part", part)

    def __str__(self) -> str:
        return self.part


USER = Scope(ScopeKind.USER)


@dataclass(frozen=True, slots=True)
class InFlightLimit:
    """A set of requests in flight and its limit: the user's, a key's, or a team's.

    `part` names the set within its slot: the scope's part, qualified by `owner` (the user)
    when the slot is a team's, whose users may have keys of the same name."""

    scope: Scope
    limit: int | None
    owner: str = ""
    part: str = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        part = f"{self.owner}:{self.scope.part}" if self.owner else self.scope.part
        object.__setattr__(self, "part", part)


@dataclass(frozen=True, slots=True)
class ReserveResult:
    ok: bool
    used: tuple[int, ...]  # per entry: counter value after the call (before on refusal)
    refused_entry: int | None = None  # index of the window that refused
    refused_in_flight: int | None = None  # index of the concurrency limit that refused
    # Under a clamp: the output tokens granted, and so reserved (None: no clamp was asked).
    granted: int | None = None


@dataclass(frozen=True, slots=True)
class TopUpResult:
    """A top-up's answer: the output tokens added to a live reservation (0: none)."""

    granted: int
    refused_entry: int | None = None  # the window without room for the minimum
    gone: bool = False  # no live reservation under that id (settled, or its lease ran out)


DONE_TTL_S = 600  # an addition is applied once per id for this long (live retries)
# A reaped reservation's tombstone is kept this long: its proxy's spool may replay the settle
# after a restart (as long as the spool's own replay window, `spool.REPLAY_DONE_TTL_S`).
REAPED_TTL_S = 9 * 86400


class Settlement(enum.Enum):
    """How a settlement is made exactly-once in the store."""

    RESERVED = "r"  # replaces a reservation the store granted: `Store.settle`
    ADDITION = "a"  # usage without a reservation (store down): `Store.add_once`


class Store(Protocol):
    # True: every call completes without yielding to the event loop (no I/O), so a caller
    # needs no task to see it through a cancellation.
    in_process: bool

    async def reserve(
        self, slot: str, res_id: str, entries: Sequence[Entry],
        in_flight: Sequence[InFlightLimit], lease_s: float, clamp: Clamp | None = None,
    ) -> ReserveResult:
        """Reap expired leases; refuse if any in-flight set is full or any window would go
        over; else add the amounts and hold `res_id` in every in-flight set under a lease.
        With `clamp`, in the same atomic step: grant the output tokens that fit (see
        `proxy.budget.clamp`), refuse below its minimum, and reserve the clamped amounts
        instead of the entries' own when the grant is below what was asked."""
        ...

    async def settle(self, slot: str, res_id: str, entries: Sequence[Entry]) -> tuple[int, ...]:
        """Replace the granted reservation `res_id`'s amounts by `entries`; if its lease ran
        out and it was reaped (its amounts given back), add `entries` outright; if neither,
        it was settled already and nothing changes. Returns the counters."""
        ...

    async def add_once(self, slot: str, batch_id: str, entries: Sequence[Entry],
                       done_ttl_s: int = DONE_TTL_S) -> tuple[int, ...]:
        """Add `entries` once per `batch_id` within `done_ttl_s` (replacing a reservation
        held under that id, if any: spool lines written before `settle` existed are replayed
        this way); returns the counters."""
        ...

    async def renew(self, slot: str, res_ids: Sequence[str], lease_s: float) -> None: ...

    async def top_up(self, slot: str, res_id: str, entries: Sequence[Entry], step: int,
                     minimum: int) -> TopUpResult:
        """Add up to `step` output tokens to the live reservation `res_id`, atomically: each
        entry's `amount` is what one output token counts in its window; the grant is the most
        every window has room for, up to `step`, refused (nothing added) below `minimum`. What
        is granted is added to the counters and to the reservation's recorded amounts, so a
        settle replaces it and a reap gives it back with the rest."""
        ...

    async def output_samples(self, key: str) -> tuple[int, ...]:
        """The recent output lengths kept under `key` (the `estimate` policy's history)."""
        ...

    async def record_output(self, key: str, tokens: int, keep: int, ttl_s: int) -> None:
        """Add one output length to `key`'s ring of the last `keep`."""
        ...

    async def leases(self, slot: str) -> dict[str, float]:
        """The reservations `slot` holds: id -> lease deadline (epoch seconds, the store's
        clock). One past its deadline is an orphan (its proxy died) until the slot's next
        reserve reaps it."""
        ...

    async def read(self, keys: Sequence[str]) -> tuple[int, ...]: ...

    async def mark_once(self, key: str, ttl_s: int) -> bool:
        """True the first time `key` is marked within its ttl (threshold notices)."""
        ...

    async def ping(self) -> None: ...

    async def close(self) -> None: ...


class _Expiring:
    """Values that expire, dropped in time order: each write pushes one heap entry, each entry
    is popped once, so the cost per write is O(log n) amortised and memory is bounded by
    what is alive (plus entries superseded by a later write, popped when their time comes)."""

    __slots__ = ("_heap", "values")

    def __init__(self) -> None:
        self.values: dict[str, tuple[int, float]] = {}  # key -> (value, expires_at)
        self._heap: list[tuple[float, str]] = []

    def get(self, key: str, now: float) -> int:
        item = self.values.get(key)
        if item is None or item[1] <= now:
            return 0
        return item[0]

    def alive(self, key: str, now: float) -> bool:
        item = self.values.get(key)
        return item is not None and item[1] > now

    def set(self, key: str, value: int, expires_at: float) -> None:
        old = self.values.get(key)
        self.values[key] = (value, expires_at)
        if old is None or old[1] != expires_at:
            heapq.heappush(self._heap, (expires_at, key))

    def add(self, key: str, delta: int, ttl_s: int, now: float) -> int:
        item = self.values.get(key)
        if item is None or item[1] <= now:
            value, expires = delta, now + ttl_s
        else:
            value, expires = item[0] + delta, item[1]
        self.set(key, value, expires)
        return value

    def discard(self, key: str) -> None:
        self.values.pop(key, None)  # its heap entry is popped when its time comes

    def expire(self, now: float) -> None:
        heap = self._heap
        while heap and heap[0][0] <= now:
            expires_at, key = heapq.heappop(heap)
            item = self.values.get(key)
            if item is not None and item[1] == expires_at:
                del self.values[key]

    def __len__(self) -> int:
        return len(self._heap)


class MemoryStore:
    """Same semantics as the Redis store, in this process only (one replica, or tests)."""

    in_process = True

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._counters = _Expiring()
        self._marks = _Expiring()
        self._leases: dict[str, dict[str, float]] = {}  # slot -> res_id -> deadline
        self._reserved: dict[str, tuple[tuple[str, int], ...]] = {}  # res_id -> amounts
        self._sets: dict[str, set[str]] = {}  # "slot:scope" -> res_ids in flight
        self._set_names: dict[str, tuple[str, ...]] = {}  # res_id -> its in-flight sets
        self._samples: dict[str, collections.deque[int]] = {}  # `estimate` histories
        self._reaped = _Expiring()  # "slot:res_id" of reservations reaped, not yet settled

    def _now(self) -> float:
        now = self._clock()
        self._counters.expire(now)
        self._marks.expire(now)
        self._reaped.expire(now)
        return now

    def _drop(self, slot: str, res_id: str, now: float, give_back: bool) -> dict[str, int]:
        leases = self._leases.get(slot)
        if leases is not None:
            leases.pop(res_id, None)
            if not leases:
                del self._leases[slot]
        for name in self._set_names.pop(res_id, ()):
            members = self._sets.get(name)
            if members is not None:
                members.discard(res_id)
                if not members:
                    del self._sets[name]
        reserved = dict(self._reserved.pop(res_id, ()))
        if give_back:
            for key, amt in reserved.items():
                if self._counters.alive(key, now):
                    self._counters.add(key, -amt, 0, now)
        return reserved

    def _reap(self, slot: str, now: float) -> None:
        leases = self._leases.get(slot, {})
        for res_id in [r for r, deadline in leases.items() if deadline <= now]:
            self._drop(slot, res_id, now, give_back=True)
            self._reaped.set(f"{slot}:{res_id}", 1, now + REAPED_TTL_S)

    async def reserve(
        self, slot: str, res_id: str, entries: Sequence[Entry],
        in_flight: Sequence[InFlightLimit], lease_s: float, clamp: Clamp | None = None,
    ) -> ReserveResult:
        now = self._now()
        self._reap(slot, now)
        used = tuple(self._counters.get(e.key, now) for e in entries)
        names = tuple(f"{slot}:{f.part}" for f in in_flight)
        for i, (f, name) in enumerate(zip(in_flight, names, strict=True)):
            if f.limit is not None and len(self._sets.get(name, ())) >= f.limit:
                return ReserveResult(False, used, refused_in_flight=i)
        amounts = tuple(e.amount for e in entries)
        granted = None
        if clamp is not None:
            fit = grant(clamp, tuple(e.limit for e in entries), used)
            if fit.output < clamp.minimum:
                return ReserveResult(False, used, refused_entry=fit.binding or 0)
            granted = fit.output
            if granted < clamp.requested:
                amounts = clamp.amounts(granted)
        for i, (e, u, a) in enumerate(zip(entries, used, amounts, strict=True)):
            if e.limit is not None and u + a > e.limit:
                return ReserveResult(False, used, refused_entry=i)
        after = tuple(self._counters.add(e.key, a, e.ttl_s, now)
                      for e, a in zip(entries, amounts, strict=True))
        self._leases.setdefault(slot, {})[res_id] = now + lease_s
        self._reserved[res_id] = tuple((e.key, a) for e, a in zip(entries, amounts, strict=True))
        for name in names:
            self._sets.setdefault(name, set()).add(res_id)
        self._set_names[res_id] = names
        return ReserveResult(True, after, granted=granted)

    async def settle(self, slot: str, res_id: str, entries: Sequence[Entry]) -> tuple[int, ...]:
        now = self._now()
        if res_id in self._reserved:
            reserved = self._drop(slot, res_id, now, give_back=False)
        elif self._reaped.alive(tomb := f"{slot}:{res_id}", now):
            self._reaped.discard(tomb)
            reserved = {}
        else:
            return tuple(self._counters.get(e.key, now) for e in entries)
        return tuple(
            self._counters.add(e.key, e.amount - reserved.get(e.key, 0), e.ttl_s, now)
            for e in entries
        )

    async def add_once(self, slot: str, batch_id: str, entries: Sequence[Entry],
                       done_ttl_s: int = DONE_TTL_S) -> tuple[int, ...]:
        now = self._now()
        res_id = batch_id
        done = f"{slot}:done:{res_id}"
        if self._marks.alive(done, now):
            return tuple(self._counters.get(e.key, now) for e in entries)
        self._marks.set(done, 1, now + done_ttl_s)
        reserved = self._drop(slot, res_id, now, give_back=False)
        return tuple(
            self._counters.add(e.key, e.amount - reserved.get(e.key, 0), e.ttl_s, now)
            for e in entries
        )

    async def top_up(self, slot: str, res_id: str, entries: Sequence[Entry], step: int,
                     minimum: int) -> TopUpResult:
        now = self._now()
        deadline = self._leases.get(slot, {}).get(res_id)
        reserved = self._reserved.get(res_id)
        if deadline is None or deadline <= now or reserved is None:
            return TopUpResult(0, gone=True)
        granted, binding = step, None
        for i, e in enumerate(entries):
            if e.amount > 0:
                fits = room_for_output(e.limit, self._counters.get(e.key, now), 0, e.amount)
                if fits is not None and fits < granted:
                    granted, binding = fits, i
        if granted < minimum:
            return TopUpResult(0, refused_entry=binding or 0)
        amounts = dict(reserved)
        for e in entries:
            if e.amount > 0:
                self._counters.add(e.key, e.amount * granted, e.ttl_s, now)
                amounts[e.key] = amounts.get(e.key, 0) + e.amount * granted
        self._reserved[res_id] = tuple(amounts.items())
        return TopUpResult(granted)

    async def output_samples(self, key: str) -> tuple[int, ...]:
        return tuple(self._samples.get(key, ()))

    async def record_output(self, key: str, tokens: int, keep: int, ttl_s: int) -> None:
        ring = self._samples.get(key)
        if ring is None:
            ring = self._samples[key] = collections.deque(maxlen=keep)
        ring.append(tokens)

    async def renew(self, slot: str, res_ids: Sequence[str], lease_s: float) -> None:
        leases = self._leases.get(slot, {})
        deadline = self._clock() + lease_s
        for res_id in res_ids:
            if res_id in leases:
                leases[res_id] = deadline

    async def leases(self, slot: str) -> dict[str, float]:
        return dict(self._leases.get(slot, {}))

    async def read(self, keys: Sequence[str]) -> tuple[int, ...]:
        now = self._now()
        return tuple(self._counters.get(k, now) for k in keys)

    async def mark_once(self, key: str, ttl_s: int) -> bool:
        now = self._now()
        if self._marks.alive(key, now):
            return False
        self._marks.set(key, 1, now + ttl_s)
        return True

    def sizes(self) -> dict[str, int]:
        """How much each internal structure holds (tests check these stay bounded)."""
        return {
            "counters": len(self._counters.values), "counter_heap": len(self._counters),
            "marks": len(self._marks.values), "mark_heap": len(self._marks),
            "reaped": len(self._reaped.values),
            "leases": sum(len(v) for v in self._leases.values()),
            "reserved": len(self._reserved), "sets": len(self._sets),
        }

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None
