"""The `estimate` admission policy's arithmetic and the in-process store's top-ups and output
history (the Redis scripts are checked against the same cases in tests/test_admission_estimate.py)."""

from __future__ import annotations

import json

from proxy.budget import estimate as est
from proxy.budget.store import USER, Entry, InFlightLimit, MemoryStore, TopUpResult
from proxy.protocol.translators import ChatTranslator, parse_body
from proxy.testing.mock_upstream import WORDS
from tests.helpers import FakeClock


def test_estimate_is_a_high_percentile_bounded_by_the_cap() -> None:
    assert est.estimate((), 32_000, 1024) == 1024
    assert est.estimate((), 500, 1024) == 500
    samples = tuple(range(1, 101))  # 1..100
    assert est.estimate(samples, 32_000, 1024) == 90
    assert est.estimate(samples, 50, 1024) == 50
    assert est.estimate((700,), 32_000, 1024) == 700
    assert est.estimate((0, 0), 32_000, 1024) == 1


def test_step_is_half_the_estimate_at_least_the_minimum_never_past_the_cap() -> None:
    assert est.step(4_000, 30_000) == 2_000
    assert est.step(100, 30_000) == est.MIN_STEP
    assert est.step(4_000, 700) == 700
    assert est.step(4_000, 0) == 0


def test_sample_key_is_in_the_users_slot() -> None:
    assert est.sample_key("tm:{alice}", "alice", "0123abcd4567", "gpt-x") == (
        "tm:{alice}:est:alice:0123abcd4567:gpt-x")


async def test_history_keeps_the_last_samples() -> None:
    store = MemoryStore()
    for n in range(est.SAMPLES + 5):
        await store.record_output("k", n, est.SAMPLES, 60)
    held = await store.output_samples("k")
    assert sorted(held) == list(range(5, est.SAMPLES + 5))  # a ring: in no order
    assert await store.output_samples("other") == ()


async def test_top_up_adds_to_counters_and_reservation_all_or_nothing() -> None:
    clock = FakeClock(1_000_000.0)
    store = MemoryStore(clock=clock)
    day = Entry("day", 2_000, 1_100, 60)  # prompt 100 + estimate 1,000
    out = Entry("out", None, 1_000, 60)
    flight = [InFlightLimit(USER, None)]
    assert (await store.reserve("s", "r1", [day, out], flight, 10.0)).ok
    per_token = [Entry("day", 2_000, 1, 60), Entry("out", None, 1, 60)]
    assert await store.top_up("s", "r1", per_token, 500, 1) == TopUpResult(500)
    assert await store.read(["day", "out"]) == (1_600, 1_500)
    # Less room than a step: the rest is granted; then nothing is left: refused, at the day.
    assert await store.top_up("s", "r1", per_token, 500, 1) == TopUpResult(400)
    assert await store.top_up("s", "r1", per_token, 500, 1) == TopUpResult(0, refused_entry=0)
    assert await store.read(["day", "out"]) == (2_000, 1_900)
    # The settle replaces everything reserved, top-ups included, by what was used.
    await store.settle("s", "r1", [Entry("day", 2_000, 1_300, 60), Entry("out", None, 1_200, 60)])
    assert await store.read(["day", "out"]) == (1_300, 1_200)
    assert (await store.top_up("s", "r1", per_token, 500, 1)).gone


async def test_a_reaped_reservation_gives_its_top_ups_back() -> None:
    clock = FakeClock(1_000_000.0)
    store = MemoryStore(clock=clock)
    flight = [InFlightLimit(USER, None)]
    assert (await store.reserve("s", "r1", [Entry("day", 5_000, 1_000, 600)], flight, 2.0)).ok
    assert await store.top_up("s", "r1", [Entry("day", 5_000, 1, 600)], 700, 1) == (
        TopUpResult(700))
    clock.now += 3  # the proxy died: its lease runs out
    assert (await store.top_up("s", "r1", [Entry("day", 5_000, 1, 600)], 700, 1)).gone
    assert (await store.reserve("s", "r2", [Entry("day", 5_000, 10, 600)], flight, 2.0)).ok
    assert await store.read(["day"]) == (10,)


def test_output_tokens_so_far_counts_new_events_only_and_rates_by_a_sample() -> None:
    """One-token events (the mock's words): the sampled rate is exact, whatever the calls."""
    body = {"model": "mock-gpt", "messages": [{"role": "user", "content": "hi"}],
            "stream": True}
    translator = ChatTranslator(parse_body(json.dumps(body).encode()))
    assert translator.output_tokens_so_far() == 0
    for n in range(1, 401):
        event = {"id": "c", "object": "chat.completion.chunk", "model": "mock-gpt",
                 "choices": [{"index": 0, "delta": {"content": WORDS[n % len(WORDS)]},
                              "finish_reason": None}]}
        translator.on_event(json.dumps(event).encode(), None)
        if n % 37 == 0 or n == 400:
            assert translator.output_tokens_so_far() == n
    assert translator.usage().output_tokens == 400
