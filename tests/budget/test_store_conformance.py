"""One store, specified once: every `Store` answers the same operations the same way.

Each test runs on the in-process store, on the Redis store against a real redis-server, and on
the Redis store against a real Redis Cluster, and asserts the same literal answers on all three;
the state machine at the end runs one random sequence on the in-process store and a Redis store
side by side and compares every answer and every snapshot. All run on a clock the test moves
(the stores judge leases and tombstones by it); what expires by TTL (counters, markers,
histories) expires in Redis by the server's own clock, so those tests use TTLs of a second and
poll until it has passed.
"""

from __future__ import annotations

import asyncio
import enum
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import pytest
import redis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from proxy.budget.clamp import Clamp
from proxy.budget.store import (
    REAPED_TTL_S,
    USER,
    Hold,
    InFlightLimit,
    MemoryStore,
    ReserveRequest,
    ReserveResult,
    Scope,
    ScopeKind,
    Snapshot,
    Store,
    TopUpResult,
    WindowAmount,
)
from proxy.budget.store_redis import RedisStore
from tests.helpers import FakeClock, until
from tests.servers import Cluster

T = TypeVar("T")
START = 1_800_000_000.0
SLOT = "tm:{alice}"
DAY = f"{SLOT}:u:daily_tokens:20270115"
OUT = f"{SLOT}:u:daily_output:20270115"
KEY_DAY = f"{SLOT}:k.ci:daily_tokens:20270115"
ANY = [InFlightLimit(USER, None)]
CI = Scope(ScopeKind.KEY, "ci")


class Kind(enum.Enum):
    MEMORY = "memory"
    REDIS = "redis"  # one redis-server
    CLUSTER = "cluster"  # three primaries


@dataclass(frozen=True)
class Subject:
    store: Store
    clock: FakeClock
    kind: Kind

    async def expired(self, probe: Callable[[], Awaitable[object]], expected: object) -> None:
        """After TTLs of a second: the in-process store's clock is moved past them; Redis
        drops keys by its own clock, so poll until it has."""
        self.clock.now += 2
        if self.kind is Kind.MEMORY:
            assert await probe() == expected
            return

        async def done() -> bool:
            return await probe() == expected

        await until(done, deadline=15)

    async def size(self) -> int:
        return (await self.store.snapshot(SLOT, [])).size


@pytest.fixture(params=list(Kind), ids=lambda kind: kind.value)
async def subject(request: pytest.FixtureRequest) -> AsyncIterator[Subject]:
    clock = FakeClock(START)
    store: Store
    if request.param is Kind.MEMORY:
        store = MemoryStore(clock)
    elif request.param is Kind.REDIS:
        store = RedisStore(request.getfixturevalue("redis_url"), 5_000, clock)
    else:
        cluster: Cluster = request.getfixturevalue("redis_cluster")
        cluster.flush()
        store = RedisStore(cluster.url, 5_000, clock)
    yield Subject(store, clock, request.param)
    await store.close()


def day(amount: int, limit: int | None = 100, ttl_s: int = 3600) -> WindowAmount:
    return WindowAmount(DAY, limit, amount, ttl_s)


def req(entries: Sequence[WindowAmount], in_flight: Sequence[InFlightLimit] = ANY,
        clamp: Clamp | None = None) -> ReserveRequest:
    """What a reserve asks: `entries`, a place in every set of `in_flight`, maybe a clamp."""
    return ReserveRequest(tuple(entries), tuple(in_flight), clamp)


# --- reserve and settle --------------------------------------------------------------------------

async def test_reserve_refuses_past_the_limit_and_settle_replaces_the_estimate(
    subject: Subject,
) -> None:
    s = subject.store
    assert await s.reserve(SLOT, "r1", req([day(60)]), 30) == _ok((60,))
    refused = await s.reserve(SLOT, "r2", req([day(60)]), 30)
    assert (refused.ok, refused.refused_entry, refused.used) == (False, 0, (60,))
    assert await s.settle(SLOT, "r1", [day(25)]) == (25,)  # what was used, not the 60
    assert await s.settle(SLOT, "r1", [day(25)]) == (25,)  # a retried settle counts once
    assert await s.settle(SLOT, "never", [day(9)]) == (25,)  # nothing was granted under it
    assert await s.read([DAY, "tm:{alice}:nothing"]) == (25, 0)
    assert await subject.size() == 1  # the counter: a settle leaves nothing else


async def test_in_flight_limits_of_the_user_and_of_a_key(subject: Subject) -> None:
    s = subject.store
    one_each = [InFlightLimit(USER, 2), InFlightLimit(CI, 1)]
    assert (await s.reserve(SLOT, "a", req([], one_each), 30)).ok
    by_key = await s.reserve(SLOT, "b", req([], one_each), 30)
    assert (by_key.ok, by_key.refused_in_flight) == (False, 1)
    # A set without a limit never refuses; the user's set counts every reservation.
    unlimited_key = [InFlightLimit(USER, 2), InFlightLimit(CI, None)]
    assert (await s.reserve(SLOT, "c", req([], unlimited_key), 30)).ok
    by_user = await s.reserve(SLOT, "d", req([], [InFlightLimit(USER, 2)]), 30)
    assert (by_user.ok, by_user.refused_in_flight) == (False, 0)
    await s.settle(SLOT, "a", [])
    assert (await s.reserve(SLOT, "b", req([], one_each), 30)).refused_in_flight == 1  # c holds it
    await s.settle(SLOT, "c", [])
    assert (await s.reserve(SLOT, "b", req([], one_each), 30)).ok
    assert set(await s.leases(SLOT)) == {"b"}


async def test_a_lease_that_ran_out_is_reaped_and_its_late_settle_charged_once(
    subject: Subject,
) -> None:
    s, clock = subject.store, subject.clock
    one = [InFlightLimit(USER, 1)]
    assert (await s.reserve(SLOT, "dead", req([day(80)], one), 30)).ok
    clock.now += 29
    assert not (await s.reserve(SLOT, "x", req([day(10)], one), 30)).ok
    clock.now += 1  # the lease ends now: the next reserve in the slot reaps it
    assert await s.reserve(SLOT, "x", req([day(10)], one), 30) == _ok((10,))  # the 80 given back
    snap = await s.snapshot(SLOT, [DAY])
    assert snap.reaped == ("dead",)
    assert snap.holds == (Hold("x", START + 60, ((DAY, 10),)),)
    assert await s.settle(SLOT, "dead", [day(50)]) == (60,)  # what it used, outright
    assert await s.settle(SLOT, "dead", [day(50)]) == (60,)  # once
    assert (await s.snapshot(SLOT, [])).reaped == ()


async def test_a_tombstone_older_than_its_ttl_charges_nothing(subject: Subject) -> None:
    s, clock = subject.store, subject.clock
    assert (await s.reserve(SLOT, "dead", req([day(80, None, 30 * 86400)]), 30)).ok
    clock.now += 31
    assert (await s.reserve(SLOT, "x", req([day(1, None, 30 * 86400)]), 30)).ok
    clock.now += REAPED_TTL_S
    assert (await s.snapshot(SLOT, [])).reaped == ()
    assert await s.settle(SLOT, "dead", [day(50, None)]) == (1,)


async def test_renew_keeps_a_live_reservation(subject: Subject) -> None:
    s, clock = subject.store, subject.clock
    one = [InFlightLimit(USER, 1)]
    assert (await s.reserve(SLOT, "live", req([day(50)], one), 30)).ok
    clock.now += 20
    await s.renew(SLOT, ["live", "unknown"], 30)
    assert await s.leases(SLOT) == {"live": START + 50}
    clock.now += 25  # past the first lease, within the renewed one
    assert not (await s.reserve(SLOT, "y", req([], one), 30)).ok
    assert await s.read([DAY]) == (50,)


# --- clamp and top-up ----------------------------------------------------------------------------

async def test_a_clamp_grants_what_fits_and_refuses_below_its_minimum(subject: Subject) -> None:
    s = subject.store
    # prompt 10, 1 per output token in the day (limit 100) and the output window (limit 60)
    clamp = Clamp(requested=80, minimum=20, bases=(10, 0), rates=(1, 1))
    entries = [day(90), WindowAmount(OUT, 60, 80, 3600)]
    first = await s.reserve(SLOT, "a", req(entries, clamp=clamp), 30)
    assert (first.ok, first.granted, first.used) == (True, 60, (70, 60))
    # 30 left in the day, none in the output window: refused there, nothing added.
    second = await s.reserve(SLOT, "b", req(entries, clamp=Clamp(80, 1, (10, 0), (1, 1))), 30)
    assert (second.ok, second.refused_entry, second.used) == (False, 1, (70, 60))
    await s.settle(SLOT, "a", [day(30), WindowAmount(OUT, 60, 20, 3600)])
    # Room for everything asked: the entries' own amounts.
    whole = await s.reserve(SLOT, "c", req([day(30), WindowAmount(OUT, 60, 20, 3600)],
                                           clamp=Clamp(20, 5, (10, 0), (1, 1))), 30)
    assert (whole.ok, whole.granted, whole.used) == (True, 20, (60, 40))
    # Not even the prompt fits: refused at the day whatever the minimum.
    over = await s.reserve(SLOT, "d", req([day(60)], clamp=Clamp(10, 0, (50,), (1,))), 30)
    assert (over.ok, over.refused_entry) == (False, 0)


async def test_a_clamp_names_the_window_that_bound_it(subject: Subject) -> None:
    """The window a clamped grant names is the one whose room the grant used up, as the
    store saw it in the same step; none when everything asked was granted."""
    s = subject.store
    # prompt 10, 1 per output token in the day (limit 100) and the output window (limit 60);
    # the requests window (1 per request) has room throughout and never binds.
    reqs = WindowAmount(f"{SLOT}:u:daily_requests:20270115", 10, 1, 3600)
    clamp = Clamp(requested=80, minimum=1, bases=(10, 0, 1), rates=(1, 1, 0))
    entries = [day(90), WindowAmount(OUT, 60, 80, 3600), reqs]
    by_output = await s.reserve(SLOT, "a", req(entries, clamp=clamp), 30)
    assert (by_output.granted, by_output.binding, by_output.used) == (60, 1, (70, 60, 1))
    # The day now has 20 output tokens of room, the output window 50: the day binds.
    await s.settle(SLOT, "a", [day(70), WindowAmount(OUT, 60, 10, 3600), reqs])
    by_day = await s.reserve(SLOT, "b", req(entries, clamp=clamp), 30)
    assert (by_day.granted, by_day.binding, by_day.used) == (20, 0, (100, 30, 2))
    # Granted whole: nothing bound.
    await s.settle(SLOT, "b", [day(0), WindowAmount(OUT, 60, 0, 3600), reqs])
    small = Clamp(requested=5, minimum=1, bases=(10, 0, 1), rates=(1, 1, 0))
    whole = await s.reserve(SLOT, "c", req([day(15), WindowAmount(OUT, 60, 5, 3600), reqs],
                                           clamp=small), 30)
    assert (whole.granted, whole.binding) == (5, None)


async def test_top_up_adds_to_counters_and_reservation_all_or_nothing(
    subject: Subject,
) -> None:
    s = subject.store
    d, out = WindowAmount(DAY, 2_000, 1_100, 600), WindowAmount(OUT, None, 1_000, 600)
    assert (await s.reserve(SLOT, "r1", req([d, out]), 10)).ok
    per_token = [WindowAmount(DAY, 2_000, 1, 600), WindowAmount(OUT, None, 1, 600)]
    assert await s.top_up(SLOT, "r1", per_token, 500, 1) == TopUpResult(500)
    assert await s.read([DAY, OUT]) == (1_600, 1_500)
    # Less room than a step: the rest; then nothing is left: refused, at the day.
    assert await s.top_up(SLOT, "r1", per_token, 500, 1) == TopUpResult(400)
    assert await s.top_up(SLOT, "r1", per_token, 500, 1) == TopUpResult(0, refused_entry=0)
    snap = await s.snapshot(SLOT, [DAY, OUT])
    assert snap.holds == (Hold("r1", START + 10, ((DAY, 2_000), (OUT, 1_900))),)
    # The settle replaces everything reserved, top-ups included, by what was used.
    await s.settle(SLOT, "r1", [WindowAmount(DAY, 2_000, 1_300, 600), WindowAmount(OUT, None, 1_200, 600)])
    assert await s.read([DAY, OUT]) == (1_300, 1_200)
    assert await s.top_up(SLOT, "r1", per_token, 500, 1) == TopUpResult(0, gone=True)


async def test_a_reaped_reservation_gives_its_top_ups_back(subject: Subject) -> None:
    s, clock = subject.store, subject.clock
    assert (await s.reserve(SLOT, "r1", req([WindowAmount(DAY, 5_000, 1_000, 600)]), 2)).ok
    assert await s.top_up(SLOT, "r1", [WindowAmount(DAY, 5_000, 1, 600)], 700, 1) == TopUpResult(700)
    clock.now += 2
    assert (await s.top_up(SLOT, "r1", [WindowAmount(DAY, 5_000, 1, 600)], 1, 1)).gone
    assert (await s.reserve(SLOT, "r2", req([WindowAmount(DAY, 5_000, 10, 600)]), 2)).used == (10,)


async def test_requests_share_a_remainder_first_come_first_served(subject: Subject) -> None:
    s = subject.store
    clamp = Clamp(1_500, 256, (10,), (1,))
    entry = [WindowAmount(DAY, 5_000, 1_510, 60)]
    got = [await s.reserve(SLOT, f"r{i}", req(entry, clamp=clamp), 30) for i in range(6)]
    assert [r.ok for r in got] == [True, True, True, True, False, False]
    assert [r.granted for r in got[:4]] == [1_500, 1_500, 1_500, 460]
    assert got[3].used == (5_000,)
    assert got[4].refused_entry == 0 and got[4].used == (5_000,)
    # A settlement below the grant gives room back: the next request takes it.
    await s.settle(SLOT, "r0", [WindowAmount(DAY, 5_000, 1_000, 60)])
    again = await s.reserve(SLOT, "r9", req(entry, clamp=clamp), 30)
    assert again.ok and again.granted == 500


async def test_the_stores_clamp_alike_on_windows_of_every_size(redis_url: str) -> None:
    """Grant by grant on random windows of every measure, up to cost windows' nano-dollars
    (the Lua division of integers held in doubles; the arithmetic itself:
    tests/budget/test_clamp.py)."""
    rng = random.Random(7)
    stores: tuple[Store, Store] = (MemoryStore(), RedisStore(redis_url, 5000))
    seen: set[str] = set()
    try:
        for case in range(150):
            n = rng.randint(1, 4)
            limits = [rng.choice([None, rng.randint(0, 60_000)]) for _ in range(n)]
            prior = [rng.randint(0, 40_000) for _ in range(n)]
            bases = tuple(rng.choice([0, 1, rng.randint(1, 3000)]) for _ in range(n))
            rates = tuple(rng.choice([0, 1, rng.randint(1, 20_000)]) for _ in range(n))
            requested = rng.randint(1, 40_000)
            clamp = Clamp(requested, rng.randint(1, requested), bases, rates)
            slot = f"tm:{{c{case}}}"
            keys = [f"{slot}:w{i}" for i in range(n)]
            worst = [b + r * requested for b, r in zip(bases, rates, strict=True)]
            entries = [WindowAmount(k, limit, w, 600) for k, limit, w in zip(keys, limits, worst,
                                                                      strict=True)]
            results = []
            for store in stores:
                # What is used already, added under an id of its own.
                await store.add_once(slot, "prior", [WindowAmount(k, None, u, 600)
                                                   for k, u in zip(keys, prior, strict=True)])
                results.append(await store.reserve(slot, "r", req(entries, clamp=clamp), 30))
            assert results[0] == results[1], (case, limits, prior, clamp)
            seen.add("refused" if not results[0].ok
                     else "whole" if results[0].granted == requested else "clamped")
            if results[0].ok:
                for u, limit in zip(results[0].used, limits, strict=True):
                    assert limit is None or u <= limit
                # The window named as binding has no room for one output token more.
                b = results[0].binding
                assert (b is None) == (results[0].granted == requested)
                if b is not None:
                    assert results[0].used[b] + rates[b] > (limits[b] or 0)
        assert seen == {"refused", "whole", "clamped"}
    finally:
        for store in stores:
            await store.close()


# --- additions, markers, histories ---------------------------------------------------------------

async def test_an_addition_is_applied_once_and_replaces_a_reservation_under_its_id(
    subject: Subject,
) -> None:
    s = subject.store
    assert await s.add_once(SLOT, "batch-1", [day(7)], 600) == (7,)
    assert await s.add_once(SLOT, "batch-1", [day(7)], 600) == (7,)
    one_each = [InFlightLimit(USER, 1), InFlightLimit(CI, 1)]
    assert (await s.reserve(SLOT, "old", req([day(40)], one_each), 30)).ok
    assert await s.add_once(SLOT, "old", [day(5)], 600) == (12,)
    assert await s.leases(SLOT) == {}
    assert (await s.reserve(SLOT, "n", req([], one_each), 30)).ok
    assert await s.mark_once(f"{SLOT}:notice", 60)
    assert not await s.mark_once(f"{SLOT}:notice", 60)


async def test_histories_keep_the_last_samples(subject: Subject) -> None:
    s = subject.store
    for n in range(10):
        await s.record_output(f"{SLOT}:est:m", n, 4, 600)
    assert await s.output_samples(f"{SLOT}:est:m") == (8, 9, 6, 7)  # a ring of 4
    assert await s.output_samples(f"{SLOT}:est:other") == ()


async def test_a_flag_is_set_again_to_keep_it_and_goes_with_its_ttl(subject: Subject) -> None:
    """What the `estimate` policy learns of an upstream's model (issue 31): a flag every
    replica reads, kept as long as it is set again, gone with its TTL otherwise."""
    s = subject.store
    gone, kept = "tm:hides:mock:model-a", "tm:hides:mock:model-b"
    assert not await s.flagged(gone)
    await s.flag(gone, 1)
    await s.flag(kept, 1)
    await s.flag(kept, 600)  # set again: its TTL starts again, the longer one
    assert await s.flagged(gone) and await s.flagged(kept)
    assert not await s.flagged("tm:hides:mock:model-c")

    async def both() -> tuple[bool, bool]:
        return await s.flagged(gone), await s.flagged(kept)

    await subject.expired(both, (False, True))


# --- bounds: what expires, and what is left -------------------------------------------------------

async def test_histories_markers_and_counters_expire_with_their_ttl(subject: Subject) -> None:
    """A history per model name the upstream answers (a glob route), a done marker per batch,
    a counter per window: each goes with its TTL, in every store alike."""
    s = subject.store
    for i in range(100):
        await s.record_output(f"{SLOT}:est:alice:k:model-{i}", i, 32, 1)
        await s.add_once(SLOT, f"batch-{i}", [WindowAmount(f"{SLOT}:u:minute:{i}", None, 1, 1)], 1)
        await s.mark_once(f"{SLOT}:notice:{i}", 1)
    assert (await s.snapshot(SLOT, [])).size == 400  # 100 histories, markers, counters, marks
    await s.record_output(f"{SLOT}:est:alice:k:kept", 1, 32, 600)
    await s.add_once(SLOT, "kept", [day(1)], 600)
    await subject.expired(subject.size, 3)  # the three written with a longer TTL
    assert await s.output_samples(f"{SLOT}:est:alice:k:model-0") == ()
    assert await s.read([f"{SLOT}:u:minute:0", DAY]) == (0, 1)


async def test_a_thousand_settled_requests_leave_their_counters_alone(subject: Subject) -> None:
    s, clock = subject.store, subject.clock
    held = [InFlightLimit(USER, 10), InFlightLimit(CI, 10)]
    entries = [day(60, None), WindowAmount(KEY_DAY, None, 60, 3600)]
    for i in range(1_000):
        assert (await s.reserve(SLOT, f"r{i}", req(entries, held), 30)).ok
        if i % 100 == 99:  # a reservation reaped now and then, settled late
            clock.now += 31
            assert (await s.reserve(SLOT, "next", req([], held), 30)).ok
            await s.settle(SLOT, "next", [])
        await s.settle(SLOT, f"r{i}", [day(1, None), WindowAmount(KEY_DAY, None, 1, 3600)])
        clock.now += 0.25
    snap = await s.snapshot(SLOT, [DAY, KEY_DAY])
    assert snap.counters == {DAY: 1_000, KEY_DAY: 1_000}
    assert (snap.holds, snap.reaped, snap.size) == ((), (), 2)


def _ok(used: tuple[int, ...]) -> ReserveResult:
    return ReserveResult(True, used)


# --- one random sequence, two stores, step by step ------------------------------------------------

SLOTS = ("tm:{alice}", "tm:{t:platform}")
LONG = 86_400  # TTLs the machine's clock never reaches: Redis expires keys by its own clock
IDS = st.sampled_from([f"r{i}" for i in range(6)])
WINDOWS = ("u:daily_tokens:1", "u:daily_output:1", "k.ci:weekly_tokens:1")
limits = st.one_of(st.none(), st.integers(0, 150))


@st.composite
def plans(draw: st.DrawFn) -> tuple[str, list[WindowAmount], Clamp | None]:
    """A slot, entries in it and, sometimes, a clamp whose requested output they reserve."""
    slot = draw(st.sampled_from(SLOTS))
    windows = draw(st.lists(st.sampled_from(WINDOWS), max_size=3, unique=True))
    bases = [draw(st.integers(0, 20)) for _ in windows]
    rates = [draw(st.integers(0, 3)) for _ in windows]
    requested = draw(st.integers(1, 30))
    entries = [WindowAmount(f"{slot}:{w}", draw(limits), b + r * requested, LONG)
               for w, b, r in zip(windows, bases, rates, strict=True)]
    clamp = None
    if draw(st.booleans()):
        clamp = Clamp(requested, draw(st.integers(0, requested)), tuple(bases), tuple(rates))
    return slot, entries, clamp


@st.composite
def usages(draw: st.DrawFn) -> tuple[str, list[WindowAmount]]:
    slot = draw(st.sampled_from(SLOTS))
    windows = draw(st.lists(st.sampled_from(WINDOWS), max_size=3, unique=True))
    return slot, [WindowAmount(f"{slot}:{w}", draw(limits), draw(st.integers(0, 40)), LONG)
                  for w in windows]


in_flights = st.builds(
    lambda user, key, with_key: [InFlightLimit(USER, user)] + (
        [InFlightLimit(CI, key)] if with_key else []),
    st.one_of(st.none(), st.integers(1, 3)), st.one_of(st.none(), st.integers(1, 2)),
    st.booleans())
leases = st.sampled_from([0.25, 1.0, 5.0, 30.0])


class SideBySide(RuleBasedStateMachine):
    """The in-process store and a Redis store, one clock, the same calls: the same answers."""

    def __init__(self, url: str) -> None:
        super().__init__()
        with redis.Redis.from_url(url) as r:
            r.flushall()
        self.loop = asyncio.new_event_loop()
        self.clock = FakeClock(START)
        self.stores: tuple[Store, Store] = (MemoryStore(self.clock),
                                            RedisStore(url, 5_000, self.clock))

    def both(self, call: Callable[[Store], Awaitable[T]]) -> T:
        memory, in_redis = (self.loop.run_until_complete(call(s)) for s in self.stores)
        assert memory == in_redis
        return memory

    @rule(plan=plans(), res_id=IDS, in_flight=in_flights, lease_s=leases)
    def reserve(self, plan: tuple[str, list[WindowAmount], Clamp | None], res_id: str,
                in_flight: list[InFlightLimit], lease_s: float) -> None:
        slot, entries, clamp = plan
        self.both(lambda s: s.reserve(slot, res_id, req(entries, in_flight, clamp), lease_s))

    @rule(usage=usages(), res_id=IDS)
    def settle(self, usage: tuple[str, list[WindowAmount]], res_id: str) -> None:
        slot, entries = usage
        self.both(lambda s: s.settle(slot, res_id, entries))

    @rule(usage=usages(), batch=st.one_of(IDS, st.sampled_from(["b0", "b1"])))
    def add_once(self, usage: tuple[str, list[WindowAmount]], batch: str) -> None:
        slot, entries = usage
        self.both(lambda s: s.add_once(slot, batch, entries, LONG))

    @rule(usage=usages(), res_id=IDS, step=st.integers(1, 20), minimum=st.integers(0, 20))
    def top_up(self, usage: tuple[str, list[WindowAmount]], res_id: str, step: int,
               minimum: int) -> None:
        slot, entries = usage
        per_token = [WindowAmount(e.key, e.limit, e.amount % 3, e.ttl_s) for e in entries]
        self.both(lambda s: s.top_up(slot, res_id, per_token, step, min(minimum, step)))

    @rule(slot=st.sampled_from(SLOTS), res_ids=st.lists(IDS, max_size=3), lease_s=leases)
    def renew(self, slot: str, res_ids: list[str], lease_s: float) -> None:
        self.both(lambda s: s.renew(slot, res_ids, lease_s))

    @rule(model=st.sampled_from(["a", "b"]), tokens=st.integers(0, 99),
          keep=st.sampled_from([2, 3]))
    def record_output(self, model: str, tokens: int, keep: int) -> None:
        key = f"{SLOTS[0]}:est:{model}"
        self.both(lambda s: s.record_output(key, tokens, keep, LONG))
        self.both(lambda s: s.output_samples(key))

    @rule(name=st.sampled_from(["n1", "n2"]))
    def mark_once(self, name: str) -> None:
        self.both(lambda s: s.mark_once(f"{SLOTS[1]}:{name}", LONG))

    @rule(quarters=st.integers(1, 160))
    def advance(self, quarters: int) -> None:
        self.clock.now += quarters / 4

    @invariant()
    def same_state(self) -> None:
        for slot in SLOTS:
            self.both(_state_of(slot))

    def teardown(self) -> None:
        for s in self.stores:
            self.loop.run_until_complete(s.close())
        self.loop.close()


def _state_of(slot: str) -> Callable[[Store], Awaitable[tuple[Snapshot, dict[str, float]]]]:
    async def state(s: Store) -> tuple[Snapshot, dict[str, float]]:
        return await s.snapshot(slot, [f"{slot}:{w}" for w in WINDOWS]), await s.leases(slot)

    return state


def test_the_stores_answer_alike_step_by_step(redis_url: str) -> None:
    class OnThisServer(SideBySide):
        def __init__(self) -> None:
            super().__init__(redis_url)

    run_state_machine_as_test(OnThisServer, settings=settings(
        max_examples=40, stateful_step_count=25, deadline=None,
        suppress_health_check=[HealthCheck.too_slow]))
