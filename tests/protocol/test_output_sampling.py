"""The output estimate's sample and folds at their edges (proxy/protocol/output.py), under a
sampler that picks the first events: which events rate the rest, the partial sixteenth, the
bytes that fold, the events counted whole, and the budget every count on the loop keeps."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from proxy.protocol import output, tokenizer
from proxy.protocol.output import OutputEstimate

pytestmark = pytest.mark.unit

MODEL = "gpt-4o"


def _texts(events: list[bytes]) -> Iterable[str]:
    return (e.decode() for e in events)


def _exact(events: list[bytes]) -> int:
    return tokenizer.count_texts(MODEL, _texts(events))


@pytest.fixture
def small_hold(monkeypatch: pytest.MonkeyPatch) -> int:
    """A hold of 4 KB: a few hundred events fold many times."""
    monkeypatch.setattr(output, "HOLD_BYTES", 4096)
    return 4096


class _FirstPicks:
    """A sampler that picks the first `k` events and draws `draw` for every `random()`: which
    events rate the rest, and whether a partial sixteenth adds one, made visible."""

    def __init__(self, draw: float) -> None:
        self.draw = draw

    def sample(self, events: list[bytes], k: int) -> list[bytes]:
        if not 0 <= k <= len(events):
            raise ValueError("sample larger than the population")  # as random.sample
        return events[:k]

    def random(self) -> float:
        return self.draw


# 17 events of like size: 16 make one whole sample, the 17th a sixteenth left over, sampled
# with the probability 1/16 (a draw below 1/16 adds it). The first event is 1 token, the second
# 2: one picked rates the 17 at 1 token each (17), two at 1.5 (25.5, rounded up).
SEVENTEEN = [b" the", b" the the"] + [b" the"] * 15


@pytest.mark.parametrize(("draw", "so_far"), [(0.0, 26), (1 / 16, 17), (0.5, 17)])
def test_a_partial_sixteenth_adds_one_to_the_sample_with_its_probability(
        monkeypatch: pytest.MonkeyPatch, draw: float, so_far: int) -> None:
    monkeypatch.setattr(output, "_SAMPLER", _FirstPicks(draw))
    est = OutputEstimate(MODEL, _texts, sampled=True)
    est.hold_run(SEVENTEEN, sum(map(len, SEVENTEEN)))
    assert est.so_far() == so_far


def test_events_counted_whole_add_up_across_calls_and_after_a_fold(
        monkeypatch: pytest.MonkeyPatch, small_hold: int) -> None:
    """After a fold of short events, the held events are all long: none is left to rate, so
    nothing is sampled (an empty sample would be an error), and each is counted whole."""
    monkeypatch.setattr(output, "_SAMPLER", _FirstPicks(0.5))
    est = OutputEstimate(MODEL, _texts, sampled=True)
    while not est.folded_tokens():
        est.hold(b" and the")
    folded = est.folded_tokens()
    assert est.events == [] and folded % 2 == 0
    long = (" tok" * 100).encode()
    est.hold(long)
    assert est.so_far() == folded + 100
    est.hold(long)
    assert est.so_far() == folded + 200
    assert est.tokens() == folded + 200


def test_every_count_on_the_loop_is_bounded_by_the_loop_budget(
        monkeypatch: pytest.MonkeyPatch, small_hold: int) -> None:
    """A fold and `so_far` run on the event loop: each of their counts is bounded by
    `LOOP_BUDGET`; only `tokens` (off the loop) counts with the larger default."""
    budgets: list[int] = []
    real = tokenizer.count_texts

    def counting(model: str, texts: Iterable[str], budget: int = tokenizer.PROMPT_BUDGET) -> int:
        budgets.append(budget)
        return real(model, texts, budget)

    monkeypatch.setattr(tokenizer, "count_texts", counting)
    for sampled in (False, True):
        est = OutputEstimate(MODEL, _texts, sampled=sampled)
        events = [b" and the"] * 100 + [(" tok" * 200).encode()] * 30
        for event in events:
            est.hold(event)
            est.so_far()
        assert budgets and set(budgets) == {tokenizer.LOOP_BUDGET}, sampled
        budgets.clear()
        est.tokens()
        assert budgets == [tokenizer.PROMPT_BUDGET]
        budgets.clear()


def test_an_event_just_whole_past_the_shortest_is_still_rated(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`WHOLE_PAST` bytes longer than the shortest is still sampled, one byte more is counted
    whole: each event is rated or counted, never both nor neither."""
    monkeypatch.setattr(output, "_SAMPLER", _FirstPicks(0.5))
    shortest = b" the"  # 1 token
    edge = b" the" * ((len(shortest) + output.WHOLE_PAST) // 4)  # 17 tokens, rated
    assert len(edge) == len(shortest) + output.WHOLE_PAST
    long = b" tok" * 100  # counted whole
    est = OutputEstimate(MODEL, _texts, sampled=True)
    est.hold_run([shortest, edge, long], len(shortest) + len(edge) + len(long))
    # The sample (the first event) rates the two alike at 1 token each; the long one is 100.
    assert est.so_far() == 2 + 100


def test_a_fold_comes_past_the_hold_and_the_count_starts_afresh(small_hold: int) -> None:
    """`HOLD_BYTES` held is kept, one byte more folds; runs add up; after a fold the count
    starts at nothing."""
    word = b" the"  # 4 bytes
    est = OutputEstimate(MODEL, _texts, sampled=False)
    held = [word] * (small_hold // 4)
    for event in held:
        est.hold(event)
    assert est.events == held  # exactly the hold: kept
    est.hold(word)
    assert est.events == [] and est.folded_tokens() == small_hold // 4 + 1  # past it: folded
    est.hold_run(held, small_hold)
    assert est.events == held  # a run of exactly the hold after a fold: kept
    est.hold_run([word], 4)
    assert est.events == [] and est.folded_tokens() == 2 * (small_hold // 4 + 1)
    half = [word] * (small_hold // 8)
    est.hold_run(half, small_hold // 2)
    est.hold_run(half, small_hold // 2)
    assert est.events == half + half  # two halves: the hold, kept
    est.hold_run([word], 4)
    assert est.events == []  # and a byte more folds
    assert est.tokens() == 3 * (small_hold // 4 + 1)


def test_a_fold_of_a_stream_whose_usage_was_asked_counts_a_sample(
        monkeypatch: pytest.MonkeyPatch, small_hold: int) -> None:
    """One event in 16 rates the fold: picked, the first hundred of 1,600 events (2 tokens
    each) rate all 1,600 at 2 tokens, though the other 1,500 are 1 token each."""
    monkeypatch.setattr(output, "_SAMPLER", _FirstPicks(0.5))
    events = [b" the the"] * 100 + [b" the"] * 1500
    size = sum(map(len, events))
    assert size > small_hold
    sampled = OutputEstimate(MODEL, _texts, sampled=True)
    sampled.hold_run(events, size)
    assert sampled.events == [] and sampled.folded_tokens() == 3200
    whole = OutputEstimate(MODEL, _texts, sampled=False)
    whole.hold_run(events, size)
    assert whole.folded_tokens() == 1700 == _exact(events)
