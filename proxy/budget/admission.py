"""Admission: what one upstream attempt of a request asks of its budget, and what it is granted.

Pure values and functions of them. `Budget.reserve` (`proxy.budget.accounting`) runs them around
the store's one atomic step, which is all that needs the store:

    ask = Ask(...)                      # the pipeline's facts about the attempt, once
    claim = claim_for(ask, estimate)    # what to hold: entries, in-flight sets, how far to clamp
    answer = await store.reserve(plan.slot, res_id, claim.request, lease_s)
                                        # checked and held atomically across replicas
    decide(ask, claim, answer)          # -> Grant, or the Refusal that became a 429

The `Grant` owns the output cap: the pipeline builds the body sent upstream once, with
`Grant.upstream_cap`, after the grant (a clamp is a smaller cap, not a second pass over a body).

The policies (`proxy.config.policy.AdmissionPolicy`): `worst_case` holds the prompt plus the
whole cap or refuses; `clamp` may be granted fewer output tokens, down to the rule's minimum
(`proxy.budget.clamp` has the arithmetic the stores share); `estimate` has a stream hold a
learned estimate of its output instead of its cap (`proxy.budget.estimate`) and top it up as it
runs, while a request that cannot be topped up falls back to `clamp`.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.budget import estimate as est
from proxy.budget import limits as lim
from proxy.budget.clamp import AdmissionRule, Clamp, output_rate
from proxy.budget.principal import Principal
from proxy.budget.refusals import Refusal
from proxy.budget.store import ReserveRequest, ReserveResult, WindowAmount


@dataclass(frozen=True, slots=True, kw_only=True)  # three counts in a row: by name only
class Ask:
    """What one attempt of a request asks for: who, which model under which plan, and the
    request's own facts, each computed once by the pipeline before the reserve."""

    principal: Principal
    model: str  # the model sent upstream (a fallback's, when one serves)
    plan: lim.Plan
    prompt_tokens: int  # estimated when a limit counts the prompt, else 0
    # The most output tokens the request's body allows under the plan's cap, all choices
    # together (`Translator.max_output`; 0: unbounded, or an API without output).
    asked_output: int
    choices: int  # generations the upstream runs and bills (`n`, `best_of`)
    stream: bool
    # The model or the request can bill output the stream does not show (reasoning, audio):
    # top-ups could not follow it (`proxy.budget.estimate.hides_output`).
    hidden_output: bool
    # The store flag of what was learned of this (upstream, model) (`estimate.learned_key`):
    # a stream that `estimates` holds its cap instead when it is set. None: nothing to learn
    # (not a stream, or its route's `hidden_output` decides).
    learned_key: str | None = None

    @property
    def user(self) -> str:
        return self.principal.user

    @property
    def rule(self) -> AdmissionRule:
        return self.principal.admission

    @property
    def min_output(self) -> int | None:
        """The fewest output tokens worth sending the request with, when its rule clamps: the
        rule's minimum, never below one per choice nor above what was asked."""
        if not self.rule.clamps or self.asked_output <= 0:
            return None
        return min(self.asked_output, max(self.rule.min_output_tokens, self.choices))

    @property
    def estimate_key(self) -> str | None:
        """Where the (user, key, model)'s output lengths are kept: every request under
        `estimate`, streamed or not, teaches the estimate."""
        if not self.rule.estimates or self.asked_output <= 0:
            return None
        return est.sample_key(self.plan.slot, self.user, self.principal.key_id or "-",
                              self.model)

    @property
    def estimates(self) -> bool:
        """It holds a learned estimate of its output instead of its cap: a limited stream
        under `estimate` whose output all shows in the stream, so top-ups can follow it. Any
        other request under `estimate` holds its cap, clamped as under `clamp`."""
        return (self.estimate_key is not None and self.stream and self.principal.enforce
                and any(w.limit is not None for w in self.plan.windows)
                and not self.hidden_output)


@dataclass(frozen=True, slots=True)
class Claim:
    """What the store is asked to hold for an `Ask` (`request`: its entries parallel to the
    plan's windows, the plan's in-flight sets, the clamp), and what holding it whole grants."""

    output: int  # output tokens: what was asked, or the estimate
    cost_nanousd: int  # the worst case of `output` at the plan's price (0 without one)
    request: ReserveRequest
    topup_cap: int | None  # `output` is an estimate; the stream keeps this cap upstream


@dataclass(frozen=True, slots=True)
class Grant:
    """What an attempt was granted: the cap its body is built with and what it holds."""

    # The most output tokens the body sent upstream allows, all choices together: what was
    # asked, or less when clamped. None: no cap is written (a plan without one, or an API
    # without output); the body is the client's, with the attempt's other changes.
    upstream_cap: int | None
    # Output tokens held in the windows: the cap, or under `estimate` the estimate (or less).
    held_output: int
    cost_nanousd: int  # nano-dollars held in cost windows (0 without them)
    # Clamped (`upstream_cap` below what was asked): what was asked, and the window that left
    # the least room (None when none did: a clamp no window caused).
    clamped_from: int | None = None
    binding: lim.Window | None = None
    topup_cap: int | None = None  # `estimate`: top-ups may raise `held_output` up to this

    @property
    def clamped(self) -> bool:
        return self.clamped_from is not None


def clamp_of(plan: lim.Plan, prompt: int, output: int, minimum: int) -> Clamp:
    """Each window's amount as `base + rate * output` (see `proxy.budget.clamp`)."""
    bases: list[int] = []
    rates: list[int] = []
    price = plan.price
    for w in plan.windows:
        measure = w.measure
        if measure is lim.Measure.TOTAL:
            bases.append(prompt)
            rates.append(1)
        elif measure is lim.Measure.INPUT:
            bases.append(prompt)
            rates.append(0)
        elif measure is lim.Measure.OUTPUT:
            bases.append(0)
            rates.append(1)
        elif measure is lim.Measure.COST and price is not None:
            bases.append(lim.reserve_cost(price, prompt, 0))
            rates.append(output_rate(price))
        elif measure is lim.Measure.COST:  # unlimited and unpriced: counted as free
            bases.append(0)
            rates.append(0)
        else:  # REQUESTS
            bases.append(1)
            rates.append(0)
    return Clamp(output, minimum, tuple(bases), tuple(rates))


def claim_for(ask: Ask, estimate: int | None = None) -> Claim:
    """What to hold for `ask`: the prompt plus its output in every window of its plan.
    `estimate`: the learned estimate of a request that `Ask.estimates`, which it holds
    instead of its cap (clamped like the cap would be, if less is left)."""
    plan, prompt, minimum = ask.plan, ask.prompt_tokens, ask.min_output
    output, topup_cap = ask.asked_output, None
    if estimate is not None:
        guess = estimate if minimum is None else max(estimate, minimum)
        if guess < output:
            output, topup_cap = guess, output
    price = plan.price
    cost = lim.reserve_cost(price, prompt, output) if price is not None else 0
    entries = tuple(WindowAmount(w.key, w.limit, lim.amount(w, prompt, output, cost), w.ttl_s)
                    for w in plan.windows)
    clamp = None
    # Nothing to clamp against without a limit: the plain reservation, at no extra cost.
    if (minimum is not None and minimum < output
            and any(e.limit is not None for e in entries)):
        clamp = clamp_of(plan, prompt, output, minimum)
    return Claim(output, cost, ReserveRequest(entries, plan.in_flight, clamp), topup_cap)


def whole(ask: Ask, claim: Claim) -> Grant:
    """The claim granted whole: what the store held, or, while it is down, what a request
    admitted unchecked is settled against."""
    return Grant(_cap(ask, ask.asked_output), claim.output, claim.cost_nanousd,
                 topup_cap=claim.topup_cap)


def decide(ask: Ask, claim: Claim, answer: ReserveResult) -> Grant | Refusal:
    """What the store's answer to `claim` means for the attempt."""
    if not answer.ok:
        return refusal(ask, claim, answer)
    granted, clamp = answer.granted, claim.request.clamp
    if clamp is None or granted is None or granted >= claim.output:
        return whole(ask, claim)
    cost = _cost(ask.plan, clamp, granted)
    if claim.topup_cap is not None:
        # The room left was below the estimate: the stream holds what is left and keeps its
        # own cap (top-ups may still find room); not a clamp of the request.
        return Grant(_cap(ask, ask.asked_output), granted, cost, topup_cap=claim.topup_cap)
    window = ask.plan.windows[answer.binding] if answer.binding is not None else None
    return Grant(_cap(ask, granted), granted, cost, clamped_from=claim.output, binding=window)


def refusal(ask: Ask, claim: Claim, answer: ReserveResult) -> Refusal:
    """What refused the claim: the in-flight set that was full, or the window that would
    have gone over (with what it needed at least, when it could have been clamped)."""
    plan = ask.plan
    if answer.refused_in_flight is not None:
        return Refusal(ask.user, plan.windows, answer.used, None, 0,
                       plan.in_flight[answer.refused_in_flight])
    refused = answer.refused_entry
    assert refused is not None
    window = plan.windows[refused]
    clamp = claim.request.clamp
    if clamp is not None:  # what it needed at least: the prompt and the fewest outputs
        return Refusal(ask.user, plan.windows, answer.used, window,
                       clamp.amounts(clamp.minimum)[refused], None, at_least=True)
    return Refusal(ask.user, plan.windows, answer.used, window,
                   claim.request.entries[refused].amount, None)


def refused_limit(refusal: Refusal) -> str:
    """The refusal's label in the refusals counter."""
    if refusal.window is None:
        return "max_concurrent_requests"
    return refusal.window.name


def _cap(ask: Ask, output: int) -> int | None:
    if ask.plan.output_cap is None or ask.asked_output <= 0:
        return None
    return output


def _cost(plan: lim.Plan, clamp: Clamp, granted: int) -> int:
    """Nano-dollars held in cost windows when `granted` output tokens are: the clamp's amount
    (whole nano-dollars per token, rounded up), 0 without a price."""
    if plan.price is None:
        return 0
    return max((a for w, a in zip(plan.windows, clamp.amounts(granted), strict=True)
                if w.measure is lim.Measure.COST), default=0)
