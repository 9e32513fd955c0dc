"""The in-process store: an LRU bounded in bytes whose entries also end at their TTL; and the
single flight's bookkeeping."""

from __future__ import annotations

import asyncio

from proxy.cache.entry import Entry, EntryUnreadable, Form
from proxy.cache.flight import Flights
from proxy.cache.store import MemoryCacheStore
from proxy.protocol.usage import Usage
from tests.helpers import FakeClock


async def test_the_lru_keeps_its_byte_bound_and_drops_the_least_recently_used() -> None:
    clock = FakeClock(1000)
    store = MemoryCacheStore(lambda: 300, clock)
    for key in ("a", "b", "c"):
        await store.put(key, b"x" * 99, ttl_s=60)
    assert len(store) == 3 and store.size == 300
    assert await store.get("a") == b"x" * 99  # a is now the most recent
    await store.put("d", b"y" * 99, ttl_s=60)
    assert await store.get("b") is None and await store.get("a") is not None
    assert store.size <= 300
    await store.put("huge", b"z" * 400, ttl_s=60)  # larger than the bound: not kept
    assert await store.get("huge") is None and store.size <= 300


async def test_entries_end_at_their_ttl() -> None:
    clock = FakeClock(1000)
    store = MemoryCacheStore(lambda: 10_000, clock)
    await store.put("k", b"v", ttl_s=10)
    clock.now += 9.9
    assert await store.get("k") == b"v"
    clock.now += 0.1
    assert await store.get("k") is None and store.size == 0


STREAM = (b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m",'
          b'"choices":[{"index":0,"delta":{"role":"assistant","content":"hi"},'
          b'"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n')


def test_entries_round_trip_and_damage_is_unreadable() -> None:
    usage = Usage(input_tokens=3, output_tokens=4)
    entry = Entry("chat", Form.JSON, b'{"id": "x",\n "choices": []}', usage, 12.5)
    back = Entry.decode(entry.encode())
    assert back.payload == entry.payload and back.usage == entry.usage  # the bytes as they came
    assert back.answer() == {"id": "x", "choices": []}
    assert back.size == len(entry.encode())
    streamed = Entry.decode(Entry("chat", Form.STREAM, STREAM, usage, 1.0).encode())
    assert streamed.form is Form.STREAM and streamed.payload == STREAM
    answer = streamed.answer()
    assert answer is not None and answer["choices"][0]["message"]["content"] == "hi"
    damaged = Entry("chat", Form.STREAM, b"data: {not json\n\n", usage, 1.0)
    assert damaged.answer() is None  # a miss (counted), never a 5xx
    for raw in (b"{", b"[]", b'{"v": 99}\n', b'{"v": 1, "operation": "chat"}',
                entry.encode().replace(b'"input_tokens"', b'"x"'),
                entry.encode().replace(b'"json"', b'"xml"')):
        try:
            Entry.decode(raw)
        except EntryUnreadable:
            continue
        raise AssertionError(raw)


class _Leader:
    """A leader's answer as a waiter sees it: stalled or not, as the test says."""

    def __init__(self) -> None:
        self.stuck = False

    def stalled(self, now: float, stall_s: float) -> bool:
        return self.stuck


async def test_a_flight_has_one_leader_and_its_waiters_get_its_entry() -> None:
    flights = Flights()
    leader = _Leader()
    assert flights.lead("k", leader) is None  # the caller leads
    waiting = flights.lead("k", _Leader())
    assert waiting is not None
    entry = Entry("chat", Form.JSON, b"{}", Usage(), 0.0)
    waiter = asyncio.ensure_future(Flights.wait(waiting, within_s=10))
    flights.land("k", entry)
    assert await waiter is entry and len(flights) == 0
    assert flights.lead("k", leader) is None
    late = flights.lead("k", _Leader())
    assert late is not None
    assert await Flights.wait(late, within_s=0.01) is None  # the bound: go upstream


async def test_a_waiter_leaves_a_stalled_leader_at_once() -> None:
    flights = Flights()
    leader = _Leader()
    assert flights.lead("k", leader) is None
    flight = flights.lead("k", _Leader())
    assert flight is not None
    leader.stuck = True  # its client stopped reading: the next check lets the waiter go
    assert await Flights.wait(flight, within_s=3600, stall_s=0.02) is None
    assert len(flights) == 1  # the leader still lands it
