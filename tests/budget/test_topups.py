"""The top-up rule of `admission: estimate` (proxy.budget.topups), as values: each decision by
example, the rule's invariants over any allowance and any check, and whole streams simulated
piece by piece, checks placed by the bytes arrived, against any sequence of store answers."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.budget import estimate as est
from proxy.budget.topups import NEVER, Act, Allowance, Seen, TopupDecision

pytestmark = pytest.mark.unit

EST, CAP = 300, 32_000
BYTES = 150  # an OpenAI chat chunk of one token, about


def _at(events: int, tokens: int | None = None, *, piece: int = 1,
        arrived: int | None = None, at_boundary: bool = True) -> Seen:
    """A stream of one token per event of `BYTES` bytes, unless told otherwise."""
    return Seen(events, events if tokens is None else tokens,
                events * BYTES if arrived is None else arrived, piece, at_boundary)


# --- each decision, by example ------------------------------------------------------------------


def test_only_reservations_short_of_their_cap_are_topped_up() -> None:
    assert Allowance.of(300, None) is None  # not admitted under `estimate`
    assert Allowance.of(32_000, 32_000) is None  # holds its whole cap already
    assert Allowance.of(300, 32_000) == Allowance(300, 32_000, 300)


def test_the_first_check_is_at_the_first_piece_and_places_the_next_by_bytes() -> None:
    allowance = Allowance(EST, CAP, EST)
    assert allowance.next_at == 1
    decision = allowance.check(_at(1), pending=False)
    # 224 tokens to three quarters (225): 224 bytes on, however many events that is (a byte
    # carries a token at most), not 112 events on at the rate seen.
    assert decision == TopupDecision(Act.NOTHING, replace(allowance, events=1, tokens=1, burst=1,
                                                     next_at=BYTES + 224))


def test_three_quarters_streamed_starts_a_top_up_of_half_the_estimate_at_least_min_step() -> None:
    allowance = Allowance(EST, CAP, EST, events=200, tokens=200, next_at=225 * BYTES)
    decision = allowance.check(_at(225), pending=False)
    assert decision.act is Act.START
    assert decision.step == est.step(EST, CAP - EST) == est.MIN_STEP
    # Out: the next check where the bytes could reach within slack (4) of what is held.
    assert decision.allowance.next_at == 225 * BYTES + (EST - 4 - 225)
    # Near the cap, the step is what the cap has left.
    near_cap = Allowance(1_000, 1_100, 1_000, events=800, tokens=800, next_at=800)
    assert near_cap.check(_at(800), pending=False).step == 100


def test_a_piece_that_passes_what_is_held_is_topped_up_for_it_before_it_goes_out() -> None:
    """15 one-token events, then one of 585 (issue 31): the check falls on the large piece
    (its bytes reach it), metered before it is forwarded. The top-up asked for covers it and
    its slack, not a step, and is due at once: the piece waits for the answer."""
    allowance = Allowance(EST, CAP, EST, events=15, tokens=15, next_at=15 * BYTES + 210)
    seen = _at(16, 600, piece=585, arrived=15 * BYTES + 3_000)
    decision = allowance.check(seen, pending=False)
    assert decision.act is Act.START and decision.bunched
    assert decision.step == 600 + 585 + 1 - EST  # under its line: slack is its largest piece
    assert decision.allowance.next_at == seen.arrived  # due again at once ...
    assert decision.allowance.check(seen, pending=True).act is Act.WAIT  # ... to wait
    topped = decision.allowance.granted(decision.step)
    after = topped.check(seen, pending=False)
    assert after.act is Act.NOTHING and after.allowance.next_at > seen.arrived
    # A piece of a step or less teaches nothing.
    assert not allowance.check(_at(16, 15 + est.MIN_STEP, piece=est.MIN_STEP),
                               pending=False).bunched


def test_a_piece_that_passes_what_is_held_after_a_refusal_is_the_last() -> None:
    allowance = Allowance(EST, CAP, EST, events=15, tokens=15, next_at=2_000).refusal()
    decision = allowance.check(_at(16, 600, piece=585, arrived=5_000), pending=False)
    assert decision.act is Act.END and decision.step == 0


def test_a_top_up_out_lets_the_stream_run_until_near_what_it_holds() -> None:
    allowance = Allowance(EST, CAP, EST, events=280, tokens=280, next_at=281 * BYTES)
    running = allowance.check(_at(281), pending=True)
    # slack at one token per event: 2 * 1 + 2 = 4; the next check where 296 can be reached.
    assert running.act is Act.NOTHING
    assert running.allowance.next_at == 281 * BYTES + (296 - 281)
    waiting = allowance.check(_at(296), pending=True)
    assert waiting == TopupDecision(Act.WAIT, allowance)  # unchanged: checked again once applied


def test_a_granted_top_up_moves_the_line() -> None:
    allowance = Allowance(EST, CAP, EST, events=295, tokens=295, next_at=296 * BYTES)
    topped = allowance.granted(256)
    assert topped.reserved == 556
    decision = topped.check(_at(296), pending=False)
    assert decision.act is Act.NOTHING
    assert decision.allowance.next_at == 296 * BYTES + (556 * 3 // 4 - 296)


def test_a_refused_stream_runs_to_what_it_holds_and_ends_between_two_events() -> None:
    allowance = Allowance(EST, CAP, EST, events=290, tokens=290, next_at=291).refusal()
    assert allowance.check(_at(291), pending=False).act is Act.NOTHING  # not near yet
    assert allowance.check(_at(296), pending=False).act is Act.END
    # Mid-event (its start already forwarded): no error event can follow; the next piece.
    mid = allowance.check(_at(296, at_boundary=False), pending=False)
    assert mid.act is Act.NOTHING and mid.allowance.next_at == 296 * BYTES + 1
    # ... and no further top-up is asked for, ever.
    assert allowance.check(_at(291), pending=False).step == 0


def test_a_stream_holding_its_cap_is_checked_no_more() -> None:
    allowance = Allowance(CAP, CAP, EST, events=10, tokens=10, next_at=11)
    assert allowance.check(_at(11), pending=False).allowance.next_at == NEVER


def test_a_piece_that_brought_many_tokens_widens_the_slack() -> None:
    """One piece brings 40 tokens (an event of 40): from then on the stream waits 40 short of
    what it holds, not 4."""
    allowance = Allowance(1_000, CAP, 1_000, events=800, tokens=800, next_at=801)
    decision = allowance.check(_at(801, 840, piece=40), pending=True)
    assert decision.act is Act.NOTHING and decision.allowance.burst == 40
    later = replace(decision.allowance, next_at=850)
    assert later.check(_at(850, 959), pending=True).act is Act.NOTHING
    assert later.check(_at(850, 960), pending=True).act is Act.WAIT


def test_a_small_reservation_is_topped_up_before_its_slack_is_passed() -> None:
    """Slack wider than a quarter of what is held (a burst of 80 on a reservation of 200):
    the top-up starts at the line, not at three quarters, which lies past it."""
    allowance = Allowance(200, CAP, 200, burst=80, events=99, tokens=99, next_at=120)
    decision = allowance.check(_at(120), pending=False)
    assert decision.act is Act.START
    # Within slack already: due again at once, where it waits for the answer.
    assert decision.allowance.next_at == 120 * BYTES
    assert decision.allowance.check(_at(120), pending=True).act is Act.WAIT
    # A reservation of 1 (a learned estimate of a one-token answer): the same at once.
    tiny = Allowance(1, CAP, 1).check(_at(1), pending=False)
    assert tiny.act is Act.START and tiny.allowance.next_at == BYTES


# --- the rule's invariants, for any allowance and any check -------------------------------------


@st.composite
def _cases(draw: st.DrawFn) -> tuple[Allowance, Seen, bool]:
    cap = draw(st.integers(2, 100_000))
    estimate = draw(st.integers(1, cap - 1))
    reserved = draw(st.integers(estimate, cap))
    events = draw(st.integers(0, 5_000))
    tokens = draw(st.integers(0, 40 * events + 5))
    piece = draw(st.integers(0, tokens))
    arrived = tokens + draw(st.integers(0, 200 * events + 5))  # a byte carries a token at most
    allowance = Allowance(
        reserved, cap, estimate, refused=draw(st.booleans()), burst=draw(st.integers(0, 200)),
        events=draw(st.integers(0, events)), tokens=draw(st.integers(0, tokens - piece)),
        next_at=draw(st.integers(1, max(1, arrived))),
    )
    return allowance, Seen(events, tokens, arrived, piece, draw(st.booleans())), draw(
        st.booleans())


def _slack(allowance: Allowance, seen: Seen) -> int:
    return allowance.slack(seen, max(allowance.burst, seen.piece))


def _near(allowance: Allowance, seen: Seen) -> bool:
    """Within slack of what is held, the piece at hand counted in the burst."""
    return seen.tokens >= allowance.reserved - _slack(allowance, seen)


@given(_cases())
def test_each_act_has_its_one_reason(case: tuple[Allowance, Seen, bool]) -> None:
    allowance, seen, pending = case
    decision = allowance.check(seen, pending)
    near = _near(allowance, seen)
    assert decision.bunched == (seen.piece > est.MIN_STEP)
    assert (decision.act is Act.WAIT) == (pending and near)
    assert (decision.act is Act.END) == (
        not pending and allowance.refused and near and seen.at_boundary)
    if decision.act is Act.START:
        assert not pending and not allowance.refused
        assert 0 < decision.step <= allowance.cap - allowance.reserved
        # Enough to get back under the line, or all the cap has left.
        assert allowance.reserved + decision.step >= min(
            allowance.cap, seen.tokens + _slack(allowance, seen) + 1)
    else:
        assert decision.step == 0
    if decision.act is Act.WAIT:
        assert decision.allowance == allowance
    else:
        assert decision.allowance.reserved == allowance.reserved  # only answers move it
        assert (decision.allowance.events, decision.allowance.tokens) == (
            seen.events, seen.tokens)
        assert decision.allowance.burst >= max(allowance.burst, seen.piece)


@given(_cases())
def test_no_bytes_that_could_pass_the_line_go_unchecked(
    case: tuple[Allowance, Seen, bool],
) -> None:
    """The next check is placed where the bytes arrived since could first carry the stream to
    its line (a byte carries a token at most), one piece on at least; and within slack of what
    it holds, a stream that can still grow waits for the top-up out, starts one and is due
    again at once, or ends (or, refused and mid-event, is checked at the next piece)."""
    allowance, seen, pending = case
    decision = allowance.check(seen, pending)
    near = _near(allowance, seen)
    after = decision.allowance
    if decision.act is not Act.WAIT and after.next_at != NEVER:
        line = allowance.reserved - _slack(allowance, seen)
        if decision.act is Act.START and near:
            assert after.next_at == seen.arrived
        else:
            assert seen.arrived < after.next_at <= seen.arrived + max(1, line - seen.tokens)
    if after.next_at == NEVER:
        assert allowance.reserved >= allowance.cap
    if not near or allowance.reserved >= allowance.cap:
        return
    if pending:
        assert decision.act is Act.WAIT
    elif allowance.refused:
        assert decision.act is Act.END or (
            not seen.at_boundary and after.next_at == seen.arrived + 1)
    else:
        assert decision.act is Act.START and after.next_at == seen.arrived


# --- whole streams, simulated piece by piece -----------------------------------------------------


@dataclass(frozen=True)
class _Answer:
    granted: int | None  # None: refused; else up to this much of the step (the last room)
    after: int  # events streamed before the answer is in (0: at once)


@dataclass
class _Run:
    streamed: int = 0  # content events forwarded
    tokens: int = 0
    ended: bool = False
    asked: int = 0  # top-ups started
    most_over: int = -(10**9)  # the most tokens forwarded past what was held


def _simulate(estimate: int, cap: int, events: list[tuple[int, int]], answers: list[_Answer],
              mid_event: set[int]) -> tuple[_Run, Allowance]:
    """The relay and the driver over one stream of (tokens, bytes) events, one piece each: a
    piece whose bytes do not reach the next check is forwarded unchecked; the one that does is
    metered, checked (and waited on) until the rule lets it go, then forwarded, the last when
    the rule ends the stream (`mid_event`: events that come in two pieces, the first ending
    inside the event). A top-up's answer is applied at the first check after it came in."""
    allowance = Allowance(estimate, cap, estimate)
    run = _Run()
    out: tuple[int, int | None] | None = None  # (event its answer is in by, grant)
    replies = iter(answers)
    arrived = 0

    def apply(grant: int | None) -> None:
        nonlocal allowance, out
        out = None
        allowance = allowance.refusal() if grant is None else allowance.granted(grant)

    def forward(tokens: int) -> None:
        run.streamed += 1
        run.tokens += tokens
        run.most_over = max(run.most_over, run.tokens - allowance.reserved)

    def check(seen: Seen) -> bool:
        """Checked until the next check is ahead; False: the stream ended here."""
        nonlocal allowance, out
        if out is not None and out[0] <= run.streamed:
            apply(out[1])
        while allowance.next_at <= seen.arrived:  # as TopUps.check: until the next is ahead
            decision = allowance.check(seen, out is not None)
            if decision.act is Act.WAIT:
                assert out is not None
                apply(out[1])
                continue
            allowance = decision.allowance
            if decision.act is Act.END:
                return False
            if decision.act is Act.START:
                run.asked += 1
                reply = next(replies, _Answer(None, 0))
                grant = None if reply.granted is None else min(reply.granted, decision.step)
                out = (run.streamed + reply.after, grant)
        return True

    for tokens, size in events:
        if run.tokens + tokens > cap:  # the upstream stops at the cap it was sent
            break
        rest = size
        if run.streamed + 1 in mid_event:
            # The event's first half comes alone: no event ends in it, nothing is metered,
            # and once it is out the bytes forwarded end inside an event.
            arrived += size // 2
            rest -= size // 2
            if arrived >= allowance.next_at:
                check(Seen(run.streamed, run.tokens, arrived, 0, False))
        arrived += rest
        if arrived < allowance.next_at:
            forward(tokens)
            continue
        going_on = check(Seen(run.streamed + 1, run.tokens + tokens, arrived, tokens))
        forward(tokens)
        if not going_on:
            run.ended = True
            break
    return run, allowance


_ANSWERS = st.lists(
    st.builds(_Answer, st.one_of(st.none(), st.integers(1, 2_000)), st.integers(0, 40)),
    max_size=30)


@st.composite
def _streams(draw: st.DrawFn) -> tuple[int, int, list[tuple[int, int]], list[_Answer], set[int]]:
    """A stream of events of any sizes, in runs (one-token events, then a huge one; a whole
    answer at once; anything between), each of at least as many bytes as tokens, any store
    answers and delays, and a few checks that land mid-event."""
    cap = draw(st.integers(50, 8_000))
    estimate = draw(st.integers(1, cap - 1))
    runs = draw(st.lists(st.tuples(st.integers(1, 300), st.integers(1, 1_000),
                                   st.integers(0, 300)), min_size=1, max_size=8))
    events = [(tokens, tokens * 4 + frame) for count, tokens, frame in runs
              for _ in range(count)]
    mid = draw(st.sets(st.integers(1, len(events)), max_size=20))
    mid_event = {e for e in mid if e - 1 not in mid}
    return estimate, cap, events, draw(_ANSWERS), mid_event


@given(_streams())
def test_a_stream_passes_what_it_holds_by_its_largest_event_at_most(
    case: tuple[int, int, list[tuple[int, int]], list[_Answer], set[int]],
) -> None:
    """Whatever its events' sizes, whatever the store answers and however late: a stream
    never forwards past what it holds (granted top-ups applied) unless it was refused, and
    then by what its largest event carried at most; a stream is ended only after a refusal,
    within its slack of the line, and one never refused streams whole (to its cap)."""
    estimate, cap, events, answers, mid_event = case
    run, allowance = _simulate(estimate, cap, events, answers, mid_event)
    if not allowance.refused:
        assert run.most_over <= 0, run
    else:
        assert run.most_over <= max(tokens for tokens, _ in events), run
    assert allowance.reserved <= cap
    if run.ended:
        assert allowance.refused
        seen = Seen(run.streamed, run.tokens, 0)
        assert run.tokens >= allowance.reserved - allowance.slack(seen, allowance.burst)
    elif not allowance.refused:
        whole = 0
        for tokens, _ in events:
            if whole + tokens > cap:
                break
            whole += tokens
        assert run.tokens == whole


@settings(max_examples=60)
@given(st.integers(1, 5_000), st.integers(1, 10), st.integers(0, 30))
def test_a_stream_the_store_always_tops_up_asks_a_step_at_a_time(
    estimate: int, rate: int, delay: int,
) -> None:
    """A long stream on a store that grants every step: it streams whole, and asks for one
    top-up per step its reservation grew by (each asked at three quarters of what it held),
    never one per event."""
    cap = 12_000
    events = [(rate, rate * 4 + 150)] * (10_000 // rate)
    answers = [_Answer(10**6, delay)] * 1_000
    run, allowance = _simulate(estimate, cap, events, answers, set())
    assert not run.ended and run.tokens == 10_000 // rate * rate
    step = est.step(estimate, cap)
    assert run.asked <= (run.tokens * 4 // 3 - estimate) // step + 2
    assert allowance.reserved >= run.tokens
    assert run.most_over <= 0


def test_three_quarters_is_rounded_down_to_a_whole_token() -> None:
    """301 tokens held: three quarters is 225.75, the top-up line 225 tokens; one token short
    of it runs on, and the next check is a whole number of bytes on."""
    allowance = Allowance(301, CAP, 301)
    first = allowance.check(_at(1), pending=False)
    assert first.act is Act.NOTHING and first.allowance.next_at == BYTES + 224
    assert isinstance(first.allowance.next_at, int)
    assert allowance.check(_at(224), pending=False).act is Act.NOTHING
    assert allowance.check(_at(225), pending=False).act is Act.START


def test_the_slack_is_two_events_at_the_rate_seen_or_the_largest_piece() -> None:
    allowance = Allowance(1_000, CAP, 1_000)
    assert allowance.slack(Seen(0, 0, 0), 0) == 4  # no event yet: a token per event
    assert allowance.slack(Seen(50, 500, 50 * BYTES, 10), 10) == 22  # 10 tokens an event
    assert allowance.slack(Seen(50, 75, 50 * BYTES), 1) == 5  # 1.5 an event: int(3.0) + 2
    assert allowance.slack(Seen(50, 500, 50 * BYTES), 40) == 40  # a piece of 40 seen
