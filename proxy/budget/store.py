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
- `renew`: extend the leases of reservations still streaming;
- `flag` / `flagged`: a flag with a time to live, what every replica learns of an upstream's
  model (`proxy.budget.estimate.learned_key`): one key each, set again to keep it.

So what a settled request leaves in the store is nothing: memory is bounded by the requests in
flight, the reaped ones within `REAPED_TTL_S` and the batches within their marker's ttl.
The Redis store does the same in Lua (`proxy/budget/lua`), so replicas sharing one Redis share one
budget; the in-process store keeps the same structures under the same names, TTLs and bounds,
and both take their arithmetic from `proxy.budget.clamp` (tests/budget/test_store_conformance.py
runs the same operations on both and compares every answer).

A slot is the unit of atomicity: the user's (`prefix:{alice}`), or for a team's users the
team's (`prefix:{t:platform}`), whose first in-flight set then holds every reservation of the
team, so any member's request reaps a member's dead reservation off the team's counters.
"""

from __future__ import annotations

import enum
import heapq
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Generic, Protocol, TypeVar

from proxy.budget.clamp import Clamp, grant


class StoreError(Exception):
    """The store could not be reached or did not answer in time."""


@dataclass(frozen=True, slots=True)
class WindowAmount:
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
class ReserveRequest:
    """What one reserve asks of a slot, checked and held in one atomic step: an amount in
    every window, a place in every in-flight set, and under a clamp how far the output may
    shrink (`proxy.budget.admission.claim_for` works it out for a request)."""

    entries: tuple[WindowAmount, ...]  # one per window
    in_flight: tuple[InFlightLimit, ...]  # the slot's first set (the user's, or the team's) first
    # The store may grant fewer output tokens, down to `clamp.minimum` (None: all or nothing).
    clamp: Clamp | None = None


@dataclass(frozen=True, slots=True)
class ReserveResult:
    ok: bool
    used: tuple[int, ...]  # per entry: counter value after the call (before on refusal)
    refused_entry: int | None = None  # index of the window that refused
    refused_in_flight: int | None = None  # index of the concurrency limit that refused
    # Under a clamp: the output tokens granted, and so reserved (None: no clamp was asked).
    granted: int | None = None
    # Granted fewer than asked: the window (index) that left the least room, as the store saw
    # it in the step that granted them (no later read of the counters can tell).
    binding: int | None = None


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
# A slot's in-flight sets and reservation records live this long after its last reserve: far
# beyond any lease (a renewed stream's included), and what bounds them should no reserve ever
# come again to reap them.
HELD_TTL_S = 2 * 86400


class SettleKind(enum.Enum):
    """How a settlement is made exactly-once in the store."""

    RESERVED = "r"  # replaces a reservation the store granted: `Store.settle`
    ADDITION = "a"  # usage without a reservation (store down): `Store.add_once`


@dataclass(frozen=True, slots=True)
class Hold:
    """A reservation the store holds: what it added to which counters, and until when."""

    res_id: str
    deadline: float  # epoch seconds, the store's clock
    amounts: tuple[tuple[str, int], ...]  # (counter key, amount)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One slot, read in one atomic step: what `proxy.reconcile` compares with the books."""

    now: float  # the store's clock (leases are judged by it)
    counters: Mapping[str, int]  # the counters asked for (0: none)
    holds: tuple[Hold, ...]  # the slot's reservations, by deadline (then id)
    reaped: tuple[str, ...]  # tombstones: reservations reaped, not settled since (oldest first)
    # The keys the store holds in all (on a Redis Cluster, the node serving the slot), whose
    # bound is that of the module's docstring: counters, markers, histories, and per slot its
    # in-flight sets, records and tombstones.
    size: int


class Store(Protocol):
    # True: every call completes without yielding to the event loop (no I/O), so a caller
    # needs no task to see it through a cancellation.
    in_process: bool

    async def reserve(self, slot: str, res_id: str, request: ReserveRequest,
                      lease_s: float) -> ReserveResult:
        """Reap expired leases; refuse if any of the request's in-flight sets is full or any
        window would go over; else add the amounts and hold `res_id` in every in-flight set
        under a lease of `lease_s`. With the request's `clamp`, in the same atomic step: grant
        the output tokens that fit (see `proxy.budget.clamp`) and name the window that bound
        the grant when it is below what was asked, refuse below its minimum, and
        reserve the clamped amounts instead of the entries' own when the grant is below what
        was asked."""
        ...

    async def settle(self, slot: str, res_id: str,
                     entries: Sequence[WindowAmount]) -> tuple[int, ...]:
        """Replace the granted reservation `res_id`'s amounts by `entries`; if its lease ran
        out and it was reaped (its amounts given back) within `REAPED_TTL_S`, add `entries`
        outright; if neither, it was settled already and nothing changes. Returns the
        counters."""
        ...

    async def add_once(self, slot: str, batch_id: str, entries: Sequence[WindowAmount],
                       done_ttl_s: int = DONE_TTL_S) -> tuple[int, ...]:
        """Add `entries` once per `batch_id` within `done_ttl_s` (replacing a reservation
        held under that id, if any: spool lines written before `settle` existed are replayed
        this way); returns the counters."""
        ...

    async def renew(self, slot: str, res_ids: Sequence[str], lease_s: float) -> None: ...

    async def top_up(self, slot: str, res_id: str, entries: Sequence[WindowAmount], step: int,
                     minimum: int) -> TopUpResult:
        """Add up to `step` output tokens to the live reservation `res_id`, atomically: each
        entry's `amount` is what one output token counts in its window; the grant is the most
        every window has room for, up to `step`, refused (nothing added) below `minimum`. What
        is granted is added to the counters and to the reservation's recorded amounts, so a
        settle replaces it and a reap gives it back with the rest."""
        ...

    async def output_samples(self, key: str) -> tuple[int, ...]:
        """The recent output lengths kept under `key` (the `estimate` policy's history), in no
        particular order."""
        ...

    async def record_output(self, key: str, tokens: int, keep: int, ttl_s: int) -> None:
        """Add one output length to `key`'s ring of the last `keep`; the history goes
        `ttl_s` after its last write."""
        ...

    async def leases(self, slot: str) -> dict[str, float]:
        """The reservations `slot` holds: id -> lease deadline (epoch seconds, the store's
        clock). One past its deadline is an orphan (its proxy died) until the slot's next
        reserve reaps it."""
        ...

    async def read(self, keys: Sequence[str]) -> tuple[int, ...]: ...

    async def snapshot(self, slot: str, keys: Sequence[str]) -> Snapshot:
        """The counters `keys` (all in `slot`) and the slot's reservations and tombstones,
        read in one atomic step."""
        ...

    async def mark_once(self, key: str, ttl_s: int) -> bool:
        """True the first time `key` is marked within its ttl (threshold notices)."""
        ...

    async def flag(self, key: str, ttl_s: int) -> None:
        """Set the flag `key` for `ttl_s` from now, a flag already set included (what the
        `estimate` policy learns of an upstream's model: `proxy.budget.estimate.learned_key`)."""
        ...

    async def flagged(self, key: str) -> bool:
        """Whether the flag `key` is set (and its ttl has not run out)."""
        ...

    async def ping(self) -> None: ...

    async def close(self) -> None: ...


V = TypeVar("V")


class _Expiring(Generic[V]):
    """Values that expire, dropped in time order (as Redis drops keys past their TTL). A key has
    one entry queued in a heap at a time: a write that moves its expiry later queues nothing,
    and the entry, popped at the earlier time, queues itself again at the later one. So memory
    is bounded by the keys alive, plus keys discarded before their entry's time."""

    __slots__ = ("_heap", "_values")

    def __init__(self) -> None:
        self._values: dict[str, tuple[V, float, float]] = {}  # key -> (value, expires, queued)
        self._heap: list[tuple[float, str]] = []

    def get(self, key: str) -> V | None:
        """The value (`expire` has run for the current time: what is held is alive)."""
        item = self._values.get(key)
        return None if item is None else item[0]

    def set(self, key: str, value: V, expires_at: float) -> None:
        old = self._values.get(key)
        if old is not None and old[2] <= expires_at:
            queued = old[2]
        else:
            heapq.heappush(self._heap, (expires_at, key))
            queued = expires_at
        self._values[key] = (value, expires_at, queued)

    def expires_at(self, key: str) -> float | None:
        item = self._values.get(key)
        return None if item is None else item[1]

    def discard(self, key: str) -> None:
        self._values.pop(key, None)  # its heap entry is dropped when its time comes

    def expire(self, now: float) -> None:
        heap = self._heap
        while heap and heap[0][0] <= now:
            queued, key = heapq.heappop(heap)
            item = self._values.get(key)
            if item is None or item[2] != queued:
                continue  # discarded, or queued again since
            if item[1] <= now:
                del self._values[key]
            else:
                heapq.heappush(heap, (item[1], key))
                self._values[key] = (item[0], item[1], item[1])

    def items(self) -> list[tuple[str, V]]:
        return [(k, item[0]) for k, item in self._values.items()]

    def __len__(self) -> int:
        return len(self._values)


class _Held:
    """A slot's reservations: what Redis keeps in its `inflight` ZSET, `reserved` HASH, `sets`
    HASH and the other in-flight sets (`inflight:<part>`), which expire together."""

    __slots__ = ("leases", "members", "records", "sets")

    def __init__(self) -> None:
        self.leases: dict[str, float] = {}  # id -> lease deadline (the first in-flight set)
        self.records: dict[str, tuple[tuple[str, int], ...]] = {}  # id -> (counter, amount)...
        self.sets: dict[str, tuple[str, ...]] = {}  # id -> the other in-flight sets holding it
        self.members: dict[str, set[str]] = {}  # other in-flight set -> ids

    def drop(self, res_id: str) -> tuple[tuple[str, int], ...] | None:
        """Forget `res_id`; its record, if it had one."""
        self.leases.pop(res_id, None)
        for name in self.sets.pop(res_id, ()):
            members = self.members.get(name)
            if members is not None:
                members.discard(res_id)
                if not members:
                    del self.members[name]
        return self.records.pop(res_id, None)

    def keys(self) -> int:
        """How many keys Redis would hold for these (an empty container is no key)."""
        return (bool(self.leases) + bool(self.records) + bool(self.sets)) + len(self.members)


class MemoryStore:
    """The Redis store's semantics in this process only (one replica, or tests): the same
    operations on the same structures, named alike, with the same TTLs and bounds."""

    in_process = True

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._counters: _Expiring[int] = _Expiring()
        self._marks: _Expiring[int] = _Expiring()  # done markers and `mark_once`'s
        self._samples: _Expiring[dict[str, int]] = _Expiring()  # `estimate` histories
        self._held: _Expiring[_Held] = _Expiring()  # slot -> its reservations
        self._reaped: _Expiring[dict[str, float]] = _Expiring()  # slot -> id -> reaped at

    def _now(self) -> float:
        now = self._clock()
        for values in (self._counters, self._marks, self._samples, self._held, self._reaped):
            values.expire(now)
        return now

    def _value(self, key: str) -> int:
        return self._counters.get(key) or 0

    def _add(self, key: str, delta: int, ttl_s: int, now: float) -> int:
        """INCRBY, with the TTL set when the counter is created (as the scripts' `add`)."""
        expires = self._counters.expires_at(key)
        value = self._value(key) + delta
        self._counters.set(key, value, now + ttl_s if expires is None else expires)
        return value

    def _drop(self, slot: str, res_id: str) -> tuple[tuple[str, int], ...] | None:
        held = self._held.get(slot)
        if held is None:
            return None
        record = held.drop(res_id)
        if not held.leases and not held.records:
            self._held.discard(slot)
        return record

    def _reap(self, slot: str, now: float) -> None:
        held = self._held.get(slot)
        expired = [] if held is None else [r for r, d in held.leases.items() if d <= now]
        if not expired:
            return
        tombs = {r: at for r, at in (self._reaped.get(slot) or {}).items()
                 if at > now - REAPED_TTL_S}
        for res_id in expired:
            tombs[res_id] = now
            for key, amount in self._drop(slot, res_id) or ():
                if self._counters.get(key) is not None:
                    self._add(key, -amount, 0, now)
        self._reaped.set(slot, tombs, now + REAPED_TTL_S)

    def _full(self, slot: str, in_flight: Sequence[InFlightLimit]) -> int | None:
        """The first in-flight set already at its limit."""
        held = self._held.get(slot) or _Held()
        for i, f in enumerate(in_flight):
            count = len(held.leases) if i == 0 else \
                len(held.members.get(f"{slot}:inflight:{f.part}", ()))
            if f.limit is not None and count >= f.limit:
                return i
        return None

    async def reserve(self, slot: str, res_id: str, request: ReserveRequest,
                      lease_s: float) -> ReserveResult:
        entries, in_flight, clamp = request.entries, request.in_flight, request.clamp
        now = self._now()
        self._reap(slot, now)
        used = tuple(self._value(e.key) for e in entries)
        full = self._full(slot, in_flight)
        if full is not None:
            return ReserveResult(False, used, refused_in_flight=full)
        amounts = tuple(e.amount for e in entries)
        granted = binding = None
        if clamp is not None:
            fit = grant(clamp, tuple(e.limit for e in entries), used)
            if fit.output < clamp.minimum:
                return ReserveResult(False, used, refused_entry=fit.binding or 0)
            granted, binding = fit.output, fit.binding
            if granted < clamp.requested:
                amounts = clamp.amounts(granted)
        for i, (e, u, a) in enumerate(zip(entries, used, amounts, strict=True)):
            if e.limit is not None and u + a > e.limit:
                return ReserveResult(False, used, refused_entry=i)
        after = tuple(self._add(e.key, a, e.ttl_s, now)
                      for e, a in zip(entries, amounts, strict=True))
        held = self._held.get(slot) or _Held()
        held.leases[res_id] = now + lease_s
        held.records[res_id] = tuple((e.key, a) for e, a in zip(entries, amounts, strict=True))
        names = tuple(f"{slot}:inflight:{f.part}" for f in in_flight[1:])
        if names:
            held.sets[res_id] = names
            for name in names:
                held.members.setdefault(name, set()).add(res_id)
        self._held.set(slot, held, now + HELD_TTL_S)
        return ReserveResult(True, after, granted=granted, binding=binding)

    def _replace(self, record: tuple[tuple[str, int], ...], entries: Sequence[WindowAmount],
                 now: float) -> tuple[int, ...]:
        """Each entry's amount in place of what the record holds of its counter."""
        reserved = dict(record)
        return tuple(self._add(e.key, e.amount - reserved.get(e.key, 0), e.ttl_s, now)
                     for e in entries)

    async def settle(self, slot: str, res_id: str,
                     entries: Sequence[WindowAmount]) -> tuple[int, ...]:
        now = self._now()
        record = self._drop(slot, res_id)
        if record is None:
            tombs = self._reaped.get(slot) or {}
            at = tombs.pop(res_id, None)
            if not tombs:
                self._reaped.discard(slot)
            if at is None or at <= now - REAPED_TTL_S:
                return tuple(self._value(e.key) for e in entries)
        return self._replace(record or (), entries, now)

    async def add_once(self, slot: str, batch_id: str, entries: Sequence[WindowAmount],
                       done_ttl_s: int = DONE_TTL_S) -> tuple[int, ...]:
        now = self._now()
        done = f"{slot}:done:{batch_id}"
        if self._marks.get(done) is not None:
            return tuple(self._value(e.key) for e in entries)
        self._marks.set(done, 1, now + done_ttl_s)
        return self._replace(self._drop(slot, batch_id) or (), entries, now)

    async def top_up(self, slot: str, res_id: str, entries: Sequence[WindowAmount], step: int,
                     minimum: int) -> TopUpResult:
        now = self._now()
        held = self._held.get(slot)
        deadline = None if held is None else held.leases.get(res_id)
        record = None if held is None else held.records.get(res_id)
        if held is None or deadline is None or deadline <= now or record is None:
            return TopUpResult(0, gone=True)
        rates = tuple(e.amount for e in entries)
        # A window that output does not count in has no say in a top-up.
        limits = tuple(e.limit if e.amount > 0 else None for e in entries)
        fit = grant(Clamp(step, minimum, (0,) * len(entries), rates), limits,
                    tuple(self._value(e.key) for e in entries))
        if fit.output < minimum:
            return TopUpResult(0, refused_entry=fit.binding or 0)
        more = {e.key: e.amount * fit.output for e in entries if e.amount > 0}
        for e in entries:
            if e.amount > 0:
                self._add(e.key, e.amount * fit.output, e.ttl_s, now)
        held.records[res_id] = tuple((k, a + more.get(k, 0)) for k, a in record)
        return TopUpResult(fit.output)

    async def output_samples(self, key: str) -> tuple[int, ...]:
        self._now()
        ring = self._samples.get(key) or {}
        return tuple(v for k, v in ring.items() if k != "n")

    async def record_output(self, key: str, tokens: int, keep: int, ttl_s: int) -> None:
        # The script's ring: `n` counts the writes, fields 0..keep-1 the last `keep` lengths.
        now = self._now()
        ring = self._samples.get(key) or {"n": 0}
        ring[str(ring["n"] % keep)] = tokens
        ring["n"] += 1
        self._samples.set(key, ring, now + ttl_s)

    async def renew(self, slot: str, res_ids: Sequence[str], lease_s: float) -> None:
        now = self._now()
        held = self._held.get(slot)
        for res_id in res_ids:
            if held is not None and res_id in held.leases:
                held.leases[res_id] = now + lease_s

    async def leases(self, slot: str) -> dict[str, float]:
        self._now()
        held = self._held.get(slot)
        return {} if held is None else dict(held.leases)

    async def read(self, keys: Sequence[str]) -> tuple[int, ...]:
        self._now()
        return tuple(self._value(k) for k in keys)

    async def snapshot(self, slot: str, keys: Sequence[str]) -> Snapshot:
        now = self._now()
        held = self._held.get(slot) or _Held()
        holds = tuple(Hold(r, d, held.records.get(r, ()))
                      for r, d in sorted(held.leases.items(), key=lambda item: (item[1], item[0])))
        tombs = sorted((at, r) for r, at in (self._reaped.get(slot) or {}).items()
                       if at > now - REAPED_TTL_S)
        size = (len(self._counters) + len(self._marks) + len(self._samples) + len(self._reaped)
                + sum(h.keys() for _, h in self._held.items()))
        return Snapshot(now, MappingProxyType({k: self._value(k) for k in keys}), holds,
                        tuple(r for _, r in tombs), size)

    async def mark_once(self, key: str, ttl_s: int) -> bool:
        now = self._now()
        if self._marks.get(key) is not None:
            return False
        self._marks.set(key, 1, now + ttl_s)
        return True

    async def flag(self, key: str, ttl_s: int) -> None:
        self._marks.set(key, 1, self._now() + ttl_s)

    async def flagged(self, key: str) -> bool:
        self._now()
        return self._marks.get(key) is not None

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None
