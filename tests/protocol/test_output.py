"""The output estimate (proxy/protocol/output.py) on its own, with events that are their own
text: exact when it counts every event, close when a sample rates them, bounded memory."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from proxy.protocol import output, tokenizer
from proxy.protocol.output import OutputEstimate

pytestmark = pytest.mark.unit

MODEL = "gpt-4o"


def _texts(events: list[bytes]) -> Iterable[str]:
    return (e.decode() for e in events)


def _events(count: int) -> list[bytes]:
    """Texts whose token counts vary (words, numbers, unicode), so a wrong count shows."""
    kinds = [" the", " 1234567", " naïve", "\n\n", ' {"a": [1, 2]}', " antidisestablishment"]
    return [(kinds[i % len(kinds)] + str(i % 7)).encode() for i in range(count)]


def _exact(events: list[bytes]) -> int:
    return tokenizer.count_texts(MODEL, _texts(events))


@pytest.fixture
def small_hold(monkeypatch: pytest.MonkeyPatch) -> int:
    """A hold of 4 KB: a few hundred events fold many times."""
    monkeypatch.setattr(output, "HOLD_BYTES", 4096)
    return 4096


def test_held_events_are_counted_whole() -> None:
    est = OutputEstimate(MODEL, _texts, sampled=True)
    events = _events(50)
    for event in events:
        est.hold(event)
    assert est.events == events and est.folded_tokens() == 0
    assert est.tokens() == _exact(events)
    assert est.tokens(["one two"]) == 2  # an answer's texts instead of the events


def test_folds_count_every_event_when_no_usage_was_asked(small_hold: int) -> None:
    est = OutputEstimate(MODEL, _texts, sampled=False)
    events = _events(3000)
    for event in events[:1000]:
        est.hold(event)
        assert sum(map(len, est.events)) <= small_hold
    est.hold_run(events[1000:], sum(map(len, events[1000:])))
    assert est.tokens() == _exact(events)


def test_folds_rate_by_a_sample_when_usage_was_asked(small_hold: int) -> None:
    """Uniform events: the sample's rate is exact. Then the texts change, and it follows."""
    est = OutputEstimate(MODEL, _texts, sampled=True)
    uniform = [b" and the"] * 4000
    for event in uniform:
        est.hold(event)
    assert est.tokens() == 8000
    mixed = _events(20_000)
    for event in mixed:
        est.hold(event)
    assert est.tokens() == pytest.approx(8000 + _exact(mixed), rel=0.05)


def test_so_far_rates_the_events_seen_and_keeps_across_folds(small_hold: int) -> None:
    est = OutputEstimate(MODEL, _texts, sampled=True)
    assert est.so_far() == 0
    seen = []
    for i in range(3000):
        est.hold(b" and the")
        if i % 50 == 0:
            seen.append(est.so_far())
    assert seen == sorted(seen)  # never goes back, across folds
    assert est.so_far() == 6000
    assert est.tokens() == 6000


@pytest.mark.parametrize("sampled_fold", [False, True])
def test_uneven_events_are_never_left_to_the_sample(sampled_fold: bool,
                                                    small_hold: int) -> None:
    """Issue 31: 15 one-token events then one of 585, repeated. A one-in-16 sample that
    missed the large ones rated the stream at a token per event (about 80 tokens for 3,000).
    An event longer than the stream's shortest by more than `WHOLE_PAST` bytes is counted
    whole, in `so_far` and in a fold alike: the estimate is the exact count, every time."""
    events = [(" tok" * (585 if i % 16 == 15 else 1)).encode() for i in range(80)]
    exact = _exact(events)
    assert exact == 3_000
    for _ in range(20):  # the sample is random: whichever events it picks
        est = OutputEstimate(MODEL, _texts, sampled=sampled_fold)
        counts = []
        for event in events:
            est.hold(event)
            counts.append(est.so_far())
        assert counts[-1] == exact == est.tokens()
        # At every event: the large ones counted as they came.
        assert counts[15] == 600 and counts[31] == 1_200
