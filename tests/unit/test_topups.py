"""The top-up rule of `admission: estimate` (proxy.budget.topups), as values: each decision by
example, the rule's invariants over any allowance and any check, and whole streams simulated
event by event against any sequence of store answers."""

from __future__ import annotations

from dataclasses import dataclass, replace

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.budget import estimate as est
from proxy.budget.topups import NEVER, Act, Allowance, Decision, Seen

EST, CAP = 300, 32_000


def _at(events: int, tokens: int | None = None, at_boundary: bool = True) -> Seen:
    """A stream of one token per event, unless told otherwise."""
    return Seen(events, events if tokens is None else tokens, at_boundary)


# --- each decision, by example ------------------------------------------------------------------


def test_only_reservations_short_of_their_cap_are_topped_up() -> None:
    assert Allowance.of(300, None) is None  # not admitted under `estimate`
    assert Allowance.of(32_000, 32_000) is None  # holds its whole cap already
    assert Allowance.of(300, 32_000) == Allowance(300, 32_000, 300)


def test_the_first_check_is_at_the_first_event_and_places_the_next() -> None:
    allowance = Allowance(EST, CAP, EST)
    assert allowance.next_at == 1
    decision = allowance.check(_at(1), pending=False)
    # 1 token per event: 224 tokens to three quarters (225), half of it is 112 events on.
    assert decision == Decision(Act.NOTHING, replace(allowance, events=1, tokens=1, burst=1,
                                                     next_at=113))


def test_three_quarters_streamed_starts_a_top_up_of_half_the_estimate_at_least_min_step() -> None:
    allowance = Allowance(EST, CAP, EST, events=200, tokens=200, next_at=225)
    decision = allowance.check(_at(225), pending=False)
    assert decision.act is Act.START
    assert decision.step == est.step(EST, CAP - EST) == est.MIN_STEP
    assert decision.allowance.next_at == 226  # from now on, every event
    # Near the cap, the step is what the cap has left.
    near_cap = Allowance(1_000, 1_100, 1_000, events=800, tokens=800, next_at=800)
    assert near_cap.check(_at(800), pending=False).step == 100


def test_a_top_up_out_lets_the_stream_run_until_near_what_it_holds() -> None:
    allowance = Allowance(EST, CAP, EST, events=280, tokens=280, next_at=281)
    running = allowance.check(_at(281), pending=True)
    assert running.act is Act.NOTHING and running.allowance.next_at == 282
    # slack at one token per event: 2 * 1 + 2 = 4; 296 is within it of 300.
    waiting = allowance.check(_at(296), pending=True)
    assert waiting == Decision(Act.WAIT, allowance)  # unchanged: checked again once applied


def test_a_granted_top_up_moves_the_line() -> None:
    allowance = Allowance(EST, CAP, EST, events=295, tokens=295, next_at=296)
    topped = allowance.granted(256)
    assert topped.reserved == 556
    decision = topped.check(_at(296), pending=False)
    assert decision.act is Act.NOTHING
    assert decision.allowance.next_at > 297  # back to checks placed ahead


def test_a_refused_stream_runs_to_what_it_holds_and_ends_between_two_events() -> None:
    allowance = Allowance(EST, CAP, EST, events=290, tokens=290, next_at=291).refusal()
    assert allowance.check(_at(291), pending=False).act is Act.NOTHING  # not near yet
    assert allowance.check(_at(296), pending=False).act is Act.END
    # Mid-event (its start already forwarded): no error event can follow; the next event.
    mid = allowance.check(_at(296, at_boundary=False), pending=False)
    assert mid.act is Act.NOTHING and mid.allowance.next_at == 297
    # ... and no further top-up is asked for, ever.
    assert allowance.check(_at(291), pending=False).step == 0


def test_a_stream_holding_its_cap_is_checked_no_more() -> None:
    allowance = Allowance(CAP, CAP, EST, events=10, tokens=10, next_at=11)
    assert allowance.check(_at(11), pending=False).allowance.next_at == NEVER


def test_a_chunk_that_brought_many_tokens_widens_the_slack() -> None:
    """Checked at every event (a top-up out), one check brings 40 tokens (a chunk the tap could
    not cut finer): from then on the stream waits 80 short of the line, not 4."""
    allowance = Allowance(1_000, CAP, 1_000, events=800, tokens=800, next_at=801)
    decision = allowance.check(_at(801, 840), pending=True)
    assert decision.act is Act.NOTHING and decision.allowance.burst == 40
    later = replace(decision.allowance, next_at=850)  # a check placed ahead: burst kept
    assert later.check(_at(850, 919), pending=True).act is Act.NOTHING
    assert later.check(_at(850, 920), pending=True).act is Act.WAIT


def test_a_small_reservation_is_topped_up_before_its_slack_is_passed() -> None:
    """Slack wider than a quarter of what is held (a burst of 50 on a reservation of 200):
    the top-up starts at the line, not at three quarters, which lies past it."""
    allowance = Allowance(200, CAP, 200, burst=50, events=99, tokens=99, next_at=120)
    decision = allowance.check(_at(120), pending=False)
    assert decision.act is Act.START
    # Within slack already: due again at once, where it waits for the answer.
    assert decision.allowance.next_at == 120
    assert decision.allowance.check(_at(120), pending=True).act is Act.WAIT
    # A reservation of 1 (a learned estimate of a one-token answer): the same at once.
    tiny = Allowance(1, CAP, 1).check(_at(1), pending=False)
    assert tiny.act is Act.START and tiny.allowance.next_at == 1


# --- the rule's invariants, for any allowance and any check -------------------------------------


@st.composite
def _cases(draw: st.DrawFn) -> tuple[Allowance, Seen, bool]:
    cap = draw(st.integers(2, 100_000))
    estimate = draw(st.integers(1, cap - 1))
    reserved = draw(st.integers(estimate, cap))
    events = draw(st.integers(0, 5_000))
    tokens = draw(st.integers(0, 40 * events + 5))
    last_events = draw(st.integers(0, events))
    allowance = Allowance(
        reserved, cap, estimate, refused=draw(st.booleans()), burst=draw(st.integers(0, 200)),
        events=last_events, tokens=draw(st.integers(0, tokens)),
        next_at=draw(st.sampled_from([last_events + 1, events, max(1, events - 7)])),
    )
    return allowance, Seen(events, tokens, draw(st.booleans())), draw(st.booleans())


def _near(allowance: Allowance, seen: Seen) -> bool:
    """Within slack of what is held, the burst counted as `check` counts it."""
    burst = allowance.burst
    if allowance.next_at == allowance.events + 1:
        burst = max(burst, seen.tokens - allowance.tokens)
    return seen.tokens >= allowance.reserved - allowance.slack(seen, burst)


@given(_cases())
def test_each_act_has_its_one_reason(case: tuple[Allowance, Seen, bool]) -> None:
    allowance, seen, pending = case
    decision = allowance.check(seen, pending)
    near = _near(allowance, seen)
    assert (decision.act is Act.WAIT) == (pending and near)
    assert (decision.act is Act.END) == (
        not pending and allowance.refused and near and seen.at_boundary)
    if decision.act is Act.START:
        assert not pending and not allowance.refused
        assert 0 < decision.step <= allowance.cap - allowance.reserved
    else:
        assert decision.step == 0
    if decision.act is Act.WAIT:
        assert decision.allowance == allowance
    else:
        assert decision.allowance.reserved == allowance.reserved  # only answers move it
        assert (decision.allowance.events, decision.allowance.tokens) == (
            seen.events, seen.tokens)
        assert decision.allowance.burst >= allowance.burst


@given(_cases())
def test_the_line_is_never_passed_without_a_top_up_or_an_end(
    case: tuple[Allowance, Seen, bool],
) -> None:
    """Within slack of what it holds, a stream that can still grow is never let run to a
    check further than the next event: it waits for the top-up out, starts one, or ends
    (or, refused and mid-event, is checked again at the next event)."""
    allowance, seen, pending = case
    decision = allowance.check(seen, pending)
    near = _near(allowance, seen)
    if decision.act is not Act.WAIT and not (decision.act is Act.START and near):
        assert decision.allowance.next_at > seen.events
    if not near or allowance.reserved >= allowance.cap:
        return
    if pending:
        assert decision.act is Act.WAIT
    elif allowance.refused:
        assert decision.act is Act.END or (
            not seen.at_boundary and decision.allowance.next_at == seen.events + 1)
    else:
        # Started, and due again at once: the caller waits for its answer.
        assert decision.act is Act.START and decision.allowance.next_at == seen.events


@given(_cases())
def test_checks_fall_on_every_event_while_a_top_up_is_out_or_was_refused(
    case: tuple[Allowance, Seen, bool],
) -> None:
    allowance, seen, pending = case
    decision = allowance.check(seen, pending)
    if decision.act is Act.WAIT:
        return
    if decision.act is Act.START and _near(allowance, seen):
        assert decision.allowance.next_at == seen.events
    elif pending or allowance.refused or decision.act is Act.START:
        assert decision.allowance.next_at == seen.events + 1
    elif allowance.reserved >= allowance.cap:
        assert decision.allowance.next_at == NEVER


# --- whole streams, simulated event by event -----------------------------------------------------


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
    most_over: int = -(10**9)  # the most tokens streamed past what was held, after event 1


def _simulate(estimate: int, cap: int, per_event: list[int], answers: list[_Answer],
              mid_event: set[int]) -> tuple[_Run, Allowance]:
    """The relay and the driver over one stream: each event forwarded, then checked when due
    (`mid_event`: checks whose bytes end inside an event, never two in a row); a top-up's
    answer is applied at the first check after it came in, or waited for."""
    allowance = Allowance(estimate, cap, estimate)
    run = _Run()
    out: tuple[int, int | None] | None = None  # (event its answer is in by, grant)
    replies = iter(answers)

    def apply(grant: int | None) -> None:
        nonlocal allowance, out
        out = None
        allowance = allowance.refusal() if grant is None else allowance.granted(grant)

    for tokens in per_event:
        if run.tokens + tokens > cap:  # the upstream stops at the cap it was sent
            break
        run.streamed += 1
        run.tokens += tokens
        if run.streamed > 1:  # the first event comes before any check can be made
            run.most_over = max(run.most_over, run.tokens - allowance.reserved)
        if run.streamed < allowance.next_at:
            continue
        if out is not None and out[0] <= run.streamed:
            apply(out[1])
        seen = Seen(run.streamed, run.tokens, run.streamed not in mid_event)
        while allowance.next_at <= run.streamed:  # as TopUps.check: until the next is ahead
            decision = allowance.check(seen, out is not None)
            if decision.act is Act.WAIT:
                assert out is not None
                apply(out[1])
                continue
            allowance = decision.allowance
            if decision.act is Act.END:
                run.ended = True
                return run, allowance
            if decision.act is Act.START:
                run.asked += 1
                reply = next(replies, _Answer(None, 0))
                grant = None if reply.granted is None else min(reply.granted, decision.step)
                out = (run.streamed + reply.after, grant)
    return run, allowance


_ANSWERS = st.lists(
    st.builds(_Answer, st.one_of(st.none(), st.integers(1, 2_000)), st.integers(0, 40)),
    max_size=30)


@st.composite
def _streams(draw: st.DrawFn) -> tuple[int, int, list[int], list[_Answer], set[int]]:
    """A stream whose tokens per event vary within a factor of two (what the slack allows
    for: two events at the rate seen so far), in runs, any store answers and delays, and a
    few checks that land mid-event."""
    low = draw(st.integers(1, 20))
    cap = draw(st.integers(50, 8_000))
    estimate = draw(st.integers(1, cap - 1))
    runs = draw(st.lists(st.tuples(st.integers(1, 300), st.integers(low, 2 * low)),
                         min_size=1, max_size=8))
    per_event = [tokens for count, tokens in runs for _ in range(count)]
    mid = draw(st.sets(st.integers(1, len(per_event)), max_size=20))
    mid_event = {e for e in mid if e - 1 not in mid}
    return estimate, cap, per_event, draw(_ANSWERS), mid_event


@given(_streams())
def test_a_stream_never_streams_past_what_it_holds(
    case: tuple[int, int, list[int], list[_Answer], set[int]],
) -> None:
    """Whatever the store answers and however late: from the first check on, the tokens
    streamed never pass what the reservation holds (granted top-ups applied), a stream is ended only after a refusal and
    then within its slack of the line, and one never refused streams whole (to its cap)."""
    estimate, cap, per_event, answers, mid_event = case
    run, allowance = _simulate(estimate, cap, per_event, answers, mid_event)
    most = max(per_event)
    if estimate > 3 * most + 2:
        assert run.most_over <= 0, run
    else:
        # A reservation within slack of its first event (a learned estimate of a few tokens)
        # is near its line from the first check on (the first event may pass it already): a
        # check mid-event lets that event finish.
        assert run.most_over <= max(0, per_event[0] - estimate) + most, run
    assert allowance.reserved <= cap
    if run.ended:
        assert allowance.refused
        seen = Seen(run.streamed, run.tokens)
        assert run.tokens >= allowance.reserved - allowance.slack(seen, allowance.burst)
    elif not allowance.refused:
        whole = 0
        for tokens in per_event:
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
    per_event = [rate] * (10_000 // rate)
    answers = [_Answer(10**6, delay)] * 1_000
    run, allowance = _simulate(estimate, cap, per_event, answers, set())
    assert not run.ended and run.tokens == 10_000 // rate * rate
    step = est.step(estimate, cap)
    assert run.asked <= (run.tokens * 4 // 3 - estimate) // step + 2
    assert allowance.reserved >= run.tokens
