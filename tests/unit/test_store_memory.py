"""proxy.budget.store.MemoryStore: reserve, settle, renew and reap, on a clock the test moves."""

from __future__ import annotations

from proxy.budget.store import USER, Entry, InFlightLimit, MemoryStore
from tests.helpers import FakeClock

SLOT = "tm:{alice}"
DAY = f"{SLOT}:u:daily_tokens:20260101"


def _entry(amount: int, limit: int | None = 100) -> Entry:
    return Entry(DAY, limit, amount, 3600)


async def test_reserve_refuses_past_the_limit_and_settle_replaces_the_estimate() -> None:
    store = MemoryStore(clock=FakeClock(1000.0))
    ok = await store.reserve(SLOT, "r1", [_entry(60)], [InFlightLimit(USER, None)], 30)
    assert ok.ok and ok.used == (60,)
    refused = await store.reserve(SLOT, "r2", [_entry(60)], [InFlightLimit(USER, None)], 30)
    assert not refused.ok and refused.refused_entry == 0 and refused.used == (60,)
    # The request used 25, not the 60 it reserved: the counter holds what was used.
    assert await store.settle(SLOT, "r1", [_entry(25)]) == (25,)
    # Settling twice (a replay) counts once.
    assert await store.settle(SLOT, "r1", [_entry(25)]) == (25,)
    assert await store.read([DAY]) == (25,)


async def test_concurrency_limit_frees_on_settle() -> None:
    store = MemoryStore(clock=FakeClock(0.0))
    one = [InFlightLimit(USER, 1)]
    assert (await store.reserve(SLOT, "a", [], one, 30)).ok
    second = await store.reserve(SLOT, "b", [], one, 30)
    assert not second.ok and second.refused_in_flight == 0
    await store.settle(SLOT, "a", [])
    assert (await store.reserve(SLOT, "b", [], one, 30)).ok


async def test_an_expired_lease_is_reaped_and_its_reservation_given_back() -> None:
    clock = FakeClock(0.0)
    store = MemoryStore(clock=clock)
    one = [InFlightLimit(USER, 1)]
    assert (await store.reserve(SLOT, "dead", [_entry(80)], one, 30)).ok
    clock.now = 29.0
    assert not (await store.reserve(SLOT, "x", [_entry(10)], one, 30)).ok
    clock.now = 31.0  # the holder died: its lease ran out
    again = await store.reserve(SLOT, "x", [_entry(10)], one, 30)
    assert again.ok and again.used == (10,)  # the 80 was given back


async def test_renew_keeps_a_live_reservation() -> None:
    clock = FakeClock(0.0)
    store = MemoryStore(clock=clock)
    one = [InFlightLimit(USER, 1)]
    assert (await store.reserve(SLOT, "live", [_entry(50)], one, 30)).ok
    clock.now = 20.0
    await store.renew(SLOT, ["live", "unknown"], 30)
    clock.now = 45.0  # past the first lease, within the renewed one
    assert not (await store.reserve(SLOT, "y", [], one, 30)).ok
    assert await store.read([DAY]) == (50,)


async def test_counters_expire_with_their_ttl_and_marks_fire_once() -> None:
    clock = FakeClock(0.0)
    store = MemoryStore(clock=clock)
    await store.add_once(SLOT, "r", [Entry(DAY, None, 5, 10)])
    assert await store.read([DAY]) == (5,)
    clock.now = 11.0
    assert await store.read([DAY]) == (0,)
    assert await store.mark_once("notice", 60)
    assert not await store.mark_once("notice", 60)
    clock.now = 72.0
    assert await store.mark_once("notice", 60)
    assert store.sizes()["reserved"] == 0


async def test_a_settle_leaves_nothing_behind_and_a_second_one_changes_nothing() -> None:
    store = MemoryStore(clock=FakeClock(0.0))
    for i in range(5_000):
        assert (await store.reserve(SLOT, f"r{i}", [_entry(60, None)],
                                    [InFlightLimit(USER, None)], 30)).ok
        await store.settle(SLOT, f"r{i}", [_entry(1, None)])
    assert await store.read([DAY]) == (5_000,)
    # A retried settle (its first reply lost) is recognised without a marker per request.
    assert await store.settle(SLOT, "r7", [_entry(1, None)]) == (5_000,)
    sizes = store.sizes()
    assert (sizes["marks"], sizes["mark_heap"], sizes["reserved"], sizes["leases"],
            sizes["reaped"]) == (0, 0, 0, 0, 0), sizes


async def test_a_reaped_reservation_is_charged_by_its_late_settle_once() -> None:
    clock = FakeClock(0.0)
    store = MemoryStore(clock=clock)
    assert (await store.reserve(SLOT, "slow", [_entry(80)], [InFlightLimit(USER, None)], 30)).ok
    clock.now = 31.0  # its lease ran out (renewal failed): the next reserve reaps it
    assert (await store.reserve(SLOT, "x", [_entry(10)], [InFlightLimit(USER, None)], 30)).ok
    assert await store.read([DAY]) == (10,)  # the 80 was given back
    assert await store.settle(SLOT, "slow", [_entry(50)]) == (60,)  # what it used, outright
    assert await store.settle(SLOT, "slow", [_entry(50)]) == (60,)  # once
    assert store.sizes()["reaped"] == 0


async def test_an_addition_is_applied_once_per_id() -> None:
    store = MemoryStore(clock=FakeClock(0.0))
    assert await store.add_once(SLOT, "batch-1", [_entry(7)], 600) == (7,)
    assert await store.add_once(SLOT, "batch-1", [_entry(7)], 600) == (7,)
    # An id never reserved is not an addition when settled: nothing was granted under it.
    assert await store.settle(SLOT, "never", [_entry(9)]) == (7,)
