"""Admission as one decision: what an attempt claims, and what the store's answer grants it
(`proxy.budget.admission`); then, with the in-process store, that a grant keeps its promises
whatever the windows hold (Hypothesis)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from proxy.budget import estimate as est
from proxy.budget import limits as lim
from proxy.budget.accounting import Budget, Reservation
from proxy.budget.admission import Ask, Grant, claim_for, clamp_of, decide, refused_limit
from proxy.budget.clamp import WORST_CASE, AdmissionRule, grant
from proxy.budget.notify import Notifier
from proxy.budget.principal import Principal
from proxy.budget.refusals import Refusal, Refused
from proxy.budget.store import USER, InFlightLimit, MemoryStore, ReserveResult, WindowAmount
from proxy.config.policy import AdmissionPolicy, Limits, Policy, Price
from proxy.telemetry.metrics import Metrics

pytestmark = pytest.mark.unit

W = lim.WindowName
CLAMP = AdmissionRule(AdmissionPolicy.CLAMP, 256)
ESTIMATE = AdmissionRule(AdmissionPolicy.ESTIMATE, 256, 1000)
PRICE = Price(input=2.5, output=10.0)  # nano-dollars per token: 2,500 in, 10,000 out
SLOT = "{u:alice}"


def _window(name: lim.WindowName, limit: int | None) -> lim.Window:
    return lim.Window(name, USER, f"{SLOT}:{name.value}", limit, name.measure, 1e12, 600,
                      f"u:{name.value}")


def _plan(*windows: lim.Window, cap: int | None = 4096,
          price: Price | None = None) -> lim.Plan:
    return lim.Plan(SLOT, windows, (InFlightLimit(USER, None),), cap,
                    costed=price is not None, price=price)


def _ask(plan: lim.Plan, rule: AdmissionRule = WORST_CASE, *, prompt: int = 100,
         asked: int = 4000, choices: int = 1, stream: bool = False,
         hidden: bool = False) -> Ask:
    principal = Principal("alice", lim.unlimited(Limits()), key_id="k1", admission=rule)
    return Ask(principal=principal, model="gpt-4o", plan=plan, prompt_tokens=prompt,
               asked_output=asked, choices=choices, stream=stream, hidden_output=hidden)


def test_worst_case_claims_the_prompt_and_the_whole_cap() -> None:
    plan = _plan(_window(W.DAILY_TOKENS, 10_000), _window(W.DAILY_USD, None), price=PRICE)
    ask = _ask(plan)
    claim = claim_for(ask)
    cost = lim.reserve_cost(PRICE, 100, 4000)
    assert claim.request.entries == (WindowAmount(plan.windows[0].key, 10_000, 4100, 600),
                                     WindowAmount(plan.windows[1].key, None, cost, 600))
    assert claim.request.in_flight == plan.in_flight  # the request in every set of its plan
    assert (claim.output, claim.cost_nanousd, claim.request.clamp, claim.topup_cap) == (
        4000, cost, None, None)
    held = decide(ask, claim, ReserveResult(True, (4100, cost)))
    assert held == Grant(4000, 4000, cost)
    refused = decide(ask, claim, ReserveResult(False, (7000, 0), refused_entry=0))
    assert isinstance(refused, Refusal)
    assert (refused.window, refused.needed, refused.at_least) == (plan.windows[0], 4100, False)
    assert refused_limit(refused) == "daily_tokens"


def test_clamp_grants_what_fit_and_names_the_window_that_bound_it() -> None:
    plan = _plan(_window(W.DAILY_TOKENS, 10_000), _window(W.DAILY_OUTPUT_TOKENS, 50_000),
                 _window(W.DAILY_USD, 100_000_000), price=PRICE)
    ask = _ask(plan, CLAMP)
    claim = claim_for(ask)
    assert claim.request.clamp == clamp_of(plan, 100, 4000, 256)
    assert claim.request.clamp is not None
    # 7,000 tokens used today: 2,900 output tokens fit after the prompt.
    amounts = claim.request.clamp.amounts(2900)
    answer = ReserveResult(True, (7000 + amounts[0], amounts[1], amounts[2]), granted=2900,
                           binding=0)
    held = decide(ask, claim, answer)
    assert held == Grant(2900, 2900, amounts[2], clamped_from=4000, binding=plan.windows[0])
    assert held.clamped
    # Below the minimum the store refuses: the 429 says what it needed at least.
    refused = decide(ask, claim, ReserveResult(False, (9900, 0, 0), refused_entry=0))
    assert isinstance(refused, Refusal) and refused.at_least and refused.needed == 356
    assert (refused.user, refused.windows, refused.used, refused.window) == (
        "alice", plan.windows, (9900, 0, 0), plan.windows[0])


def test_the_minimum_is_one_per_choice_and_never_above_what_was_asked() -> None:
    plan = _plan(_window(W.DAILY_TOKENS, 10_000))
    assert _ask(plan, CLAMP, choices=300).min_output == 300
    assert _ask(plan, CLAMP, asked=100).min_output == 100
    assert _ask(plan, WORST_CASE).min_output is None
    # All of it asked for is the minimum: nothing to clamp.
    assert claim_for(_ask(plan, CLAMP, asked=100)).request.clamp is None


def test_estimate_holds_the_estimate_and_keeps_its_cap_upstream() -> None:
    plan = _plan(_window(W.DAILY_TOKENS, 10_000))
    ask = _ask(plan, ESTIMATE, stream=True)
    assert ask.estimates and ask.estimate_key == f"{SLOT}:est:alice:k1:gpt-4o"
    claim = claim_for(ask, 300)
    assert (claim.output, claim.topup_cap) == (300, 4000)
    assert claim.request.clamp is not None and claim.request.clamp.minimum == 256
    assert decide(ask, claim, ReserveResult(True, (400,), granted=300)) == Grant(
        4000, 300, 0, topup_cap=4000)
    # Less room than the estimate: it holds what is left, and is not clamped.
    assert decide(ask, claim, ReserveResult(True, (10_000,), granted=270)) == Grant(
        4000, 270, 0, topup_cap=4000)
    # An estimate below the minimum holds the minimum.
    assert claim_for(ask, 10).output == 256
    # An estimate of all that was asked (or more) holds it whole: nothing to top up.
    for whole in (4000, 5000):
        assert (claim_for(ask, whole).output, claim_for(ask, whole).topup_cap) == (4000, None)


def test_estimate_falls_back_to_clamp_where_top_ups_cannot_follow() -> None:
    plan = _plan(_window(W.DAILY_TOKENS, 10_000))
    for ask in (_ask(plan, ESTIMATE), _ask(plan, ESTIMATE, stream=True, hidden=True),
                _ask(_plan(_window(W.DAILY_TOKENS, None)), ESTIMATE, stream=True)):
        assert not ask.estimates
        assert ask.estimate_key is not None  # it still teaches the estimate
        assert ask.min_output == 256


def test_without_a_cap_the_body_is_not_capped() -> None:
    unenforced = _plan(_window(W.DAILY_TOKENS, None), cap=None)
    ask = _ask(unenforced, asked=9)
    assert decide(ask, claim_for(ask), ReserveResult(True, (109,))) == Grant(None, 9, 0)
    embeddings = _ask(_plan(_window(W.DAILY_TOKENS, 1000)), asked=0)
    assert decide(embeddings, claim_for(embeddings), ReserveResult(True, (100,))) == Grant(
        None, 0, 0)


def test_a_full_in_flight_set_refuses() -> None:
    plan = _plan(_window(W.DAILY_TOKENS, 10_000))
    ask = _ask(plan)
    refused = decide(ask, claim_for(ask), ReserveResult(False, (5,), refused_in_flight=0))
    assert isinstance(refused, Refusal) and refused.in_flight == plan.in_flight[0]
    assert refused_limit(refused) == "max_concurrent_requests"
    # No window refused it: the windows and what they held, and nothing needed in them.
    assert (refused.user, refused.windows, refused.used, refused.window, refused.needed) == (
        "alice", plan.windows, (5,), None, 0)


# --- properties, with the in-process store -----------------------------------------------

_RULES = st.sampled_from([WORST_CASE, CLAMP, ESTIMATE,
                          AdmissionRule(AdmissionPolicy.CLAMP, 1),
                          AdmissionRule(AdmissionPolicy.ESTIMATE, 4000, 1)])
_NAMES = (W.DAILY_TOKENS, W.DAILY_INPUT_TOKENS, W.DAILY_OUTPUT_TOKENS, W.DAILY_USD,
          W.REQUESTS_PER_MINUTE, W.TOKENS_PER_MINUTE)


@st.composite
def _windows(draw: st.DrawFn) -> tuple[tuple[lim.Window, int], ...]:
    """Windows of distinct names, each with its limit and what is used of it already."""
    names = draw(st.lists(st.sampled_from(_NAMES), min_size=1, max_size=4, unique=True))
    out = []
    for name in names:
        scale = 10**8 if name.measure is lim.Measure.COST else 20_000
        limit = draw(st.none() | st.integers(0, scale) | st.integers(scale // 10, scale))
        # Mostly some room left: where clamps and estimates are decided.
        used = draw(st.just(0) | st.integers(0, limit if limit is not None else scale))
        out.append((_window(name, limit), used))
    return tuple(out)


@dataclass(frozen=True)
class _Held:
    ask: Ask
    samples: list[int]  # the output lengths of its earlier requests
    before: tuple[int, ...]
    after: tuple[int, ...]
    result: Reservation | Refusal


async def _admit(ask: Ask, before: tuple[int, ...], samples: list[int]) -> _Held:
    store = MemoryStore(lambda: 1_800_000_000.0)
    windows = ask.plan.windows
    await store.add_once(SLOT, "earlier", [WindowAmount(w.key, None, u, w.ttl_s)
                                           for w, u in zip(windows, before, strict=True)])
    if ask.estimate_key is not None:
        for sample in samples:
            await store.record_output(ask.estimate_key, sample, 32, 600)
    metrics = Metrics()
    budget = Budget(store, metrics, Notifier(metrics, list, lambda: None, lambda: None),
                    clock=lambda: 1_800_000_000.0)
    try:
        result: Reservation | Refusal = await budget.reserve(ask, Policy())
    except Refused as exc:
        result = exc.refusal
    after = await store.read([w.key for w in windows])
    return _Held(ask, samples, before, after, result)


_BOOLS = st.booleans()


@st.composite
def _cases(draw: st.DrawFn, rules: st.SearchStrategy[AdmissionRule] = _RULES,
           streams: st.SearchStrategy[bool] = _BOOLS,
           hidden: st.SearchStrategy[bool] = _BOOLS,
           ) -> tuple[Ask, tuple[int, ...], list[int]]:
    """An attempt's ask, what its windows hold already, and its earlier output lengths."""
    windows = draw(_windows())
    plan = _plan(*(w for w, _ in windows), cap=16_000, price=PRICE)
    asked = draw(st.integers(1, 8000))
    ask = _ask(plan, draw(rules), prompt=draw(st.integers(0, 2000)), asked=asked,
               choices=draw(st.integers(1, min(8, asked))), stream=draw(streams),
               hidden=draw(hidden))
    samples = draw(st.lists(st.integers(1, 10_000), max_size=5))
    return ask, tuple(u for _, u in windows), samples


@given(_cases())
def test_a_grant_keeps_its_promises(case: tuple[Ask, tuple[int, ...], list[int]]) -> None:
    _keeps_its_promises(*case)


@given(_cases(st.sampled_from([CLAMP, AdmissionRule(AdmissionPolicy.CLAMP, 1)])))
def test_a_clamp_keeps_its_promises(case: tuple[Ask, tuple[int, ...], list[int]]) -> None:
    _keeps_its_promises(*case)


@given(_cases(st.just(ESTIMATE), st.just(True), st.just(False)))
def test_an_estimate_keeps_its_promises(case: tuple[Ask, tuple[int, ...], list[int]]) -> None:
    """Streams under `estimate` whose output shows: they hold an estimate, not their cap."""
    _keeps_its_promises(*case)


def _keeps_its_promises(ask: Ask, before: tuple[int, ...], samples: list[int]) -> None:
    held = asyncio.run(_admit(ask, before, samples))
    result, plan, asked, prompt = held.result, ask.plan, ask.asked_output, ask.prompt_tokens
    if isinstance(result, Refusal):
        event("refused")
        _refused_rightly(held, result)
        return
    cap = result.upstream_cap
    assert cap is not None
    event("clamped" if result.clamped else "estimate" if result.topup_cap else "whole")
    # The cap sent is never above what was asked, and never below the minimum.
    assert cap <= asked
    minimum = ask.min_output
    assert cap == asked or (minimum is not None and cap >= minimum)
    assert result.clamped == (cap < asked)
    # What it holds is at most what the cap allows (an estimate, or less when little is left).
    assert result.held_output <= cap
    assert result.topup_cap in (None, cap)
    # No window is overspent, and each holds what the reservation says it does.
    for w, was, now in zip(plan.windows, held.before, held.after, strict=True):
        assert now - was == lim.amount(w, prompt, result.held_output, result.grant.cost_nanousd)
        if w.limit is not None:
            assert now <= w.limit
    if result.clamped:
        binding = result.grant.binding
        assert binding is not None
        i = plan.windows.index(binding)
        # The binding window had no room for one output token more.
        rate = clamp_of(plan, prompt, asked, 1).rates[i]
        assert rate > 0 and held.after[i] + rate > (binding.limit or 0)


def _refused_rightly(held: _Held, refusal: Refusal) -> None:
    """A refusal names a window the fewest output tokens it could be sent with did not fit."""
    ask, plan = held.ask, held.ask.plan
    assert held.after == held.before  # nothing held
    assert refusal.window is not None and refusal.window.limit is not None
    i = plan.windows.index(refusal.window)
    estimate = None
    if ask.estimates:
        estimate = est.estimate(held.samples, ask.asked_output, ask.rule.initial_estimate)
    claim = claim_for(ask, estimate)
    if claim.request.clamp is not None:
        fit = grant(claim.request.clamp, [w.limit for w in plan.windows], held.before)
        assert fit.output < claim.request.clamp.minimum and fit.binding == i
        assert refusal.at_least
    else:
        assert held.before[i] + claim.request.entries[i].amount > refusal.window.limit
    assert refusal.needed > refusal.window.limit - held.before[i]


def test_a_clamp_counts_each_window_as_its_measure_does() -> None:
    """Each window's amount as `base + rate * output`: tokens the prompt plus the output,
    input the prompt, output the output, cost the priced prompt plus a whole nano-dollar
    rate per output token (free when unpriced), requests one."""
    windows = (_window(W.DAILY_TOKENS, 10_000), _window(W.DAILY_INPUT_TOKENS, 10_000),
               _window(W.DAILY_OUTPUT_TOKENS, 10_000), _window(W.DAILY_USD, 10**9),
               _window(W.REQUESTS_PER_MINUTE, 10))
    priced = clamp_of(_plan(*windows, price=PRICE), 100, 4000, 256)
    assert (priced.requested, priced.minimum) == (4000, 256)
    assert priced.bases == (100, 100, 0, lim.reserve_cost(PRICE, 100, 0), 1)
    assert priced.rates == (1, 0, 1, 10_000, 0)
    unpriced = clamp_of(_plan(*windows), 100, 4000, 256)
    assert unpriced.bases == (100, 100, 0, 0, 1)
    assert unpriced.rates == (1, 0, 1, 0, 0)


def test_a_clamped_grant_holds_the_cost_of_what_it_was_granted() -> None:
    """The cost held is the cost windows' amount at the granted output (the largest, with
    two), and nothing without a price."""
    plan = _plan(_window(W.DAILY_TOKENS, 10_000), _window(W.DAILY_USD, 10**9),
                 _window(W.MONTHLY_USD, 10**9), price=PRICE)
    ask = _ask(plan, CLAMP)
    claim = claim_for(ask)
    assert claim.request.clamp is not None
    amounts = claim.request.clamp.amounts(1000)
    held = decide(ask, claim, ReserveResult(True, (9000, 0, 0), granted=1000, binding=0))
    assert isinstance(held, Grant) and held.cost_nanousd == max(amounts[1:]) > 0
    unpriced = _plan(_window(W.DAILY_TOKENS, 10_000))
    free = _ask(unpriced, CLAMP)
    held = decide(free, claim_for(free), ReserveResult(True, (9000,), granted=1000, binding=0))
    assert held == Grant(1000, 1000, 0, clamped_from=4000, binding=unpriced.windows[0])


def test_a_grant_of_all_that_was_claimed_is_whole() -> None:
    """A clamp the store granted whole (or no count from it) is no clamp."""
    plan = _plan(_window(W.DAILY_TOKENS, 10_000))
    ask = _ask(plan, CLAMP)
    claim = claim_for(ask)
    whole = Grant(4000, 4000, 0)
    assert decide(ask, claim, ReserveResult(True, (4100,), granted=4000)) == whole
    assert decide(ask, claim, ReserveResult(True, (4100,), granted=None)) == whole
    assert decide(ask, claim, ReserveResult(True, (4099,), granted=3999)).clamped  # type: ignore[union-attr]


def test_a_refusal_without_a_clamp_names_what_the_window_needed() -> None:
    plan = _plan(_window(W.DAILY_TOKENS, 10_000), _window(W.DAILY_OUTPUT_TOKENS, 1_000))
    ask = _ask(plan)
    refused = decide(ask, claim_for(ask), ReserveResult(False, (100, 900), refused_entry=1))
    assert isinstance(refused, Refusal)
    assert (refused.window, refused.needed, refused.at_least, refused.in_flight) == (
        plan.windows[1], 4000, False, None)
    assert (refused.used, refused.user, refused.windows) == ((100, 900), "alice", plan.windows)
    assert refused_limit(refused) == "daily_output_tokens"


def test_the_estimate_key_names_the_key_or_a_dash_and_the_model_sent() -> None:
    plan = _plan(_window(W.DAILY_TOKENS, 10_000))
    keyless = Principal("bob", lim.unlimited(Limits()), admission=ESTIMATE)
    ask = Ask(principal=keyless, model="m", plan=plan, prompt_tokens=1, asked_output=10,
              choices=1, stream=True, hidden_output=False)
    assert ask.estimate_key == f"{SLOT}:est:bob:-:m"
    assert _ask(plan, ESTIMATE, asked=0).estimate_key is None  # nothing asked: nothing to learn
    assert _ask(plan, CLAMP, stream=True).estimate_key is None
    assert _ask(plan, CLAMP, asked=0).min_output is None


def test_a_clamped_grant_under_a_price_but_no_cost_window_holds_no_cost() -> None:
    plan = _plan(_window(W.DAILY_TOKENS, 10_000), price=PRICE)
    ask = _ask(plan, CLAMP)
    held = decide(ask, claim_for(ask), ReserveResult(True, (9000,), granted=1000, binding=0))
    assert held == Grant(1000, 1000, 0, clamped_from=4000, binding=plan.windows[0])
