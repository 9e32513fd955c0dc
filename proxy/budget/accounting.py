"""Reserve a request's worst case before it goes upstream; settle it to the actual usage after.

The reservation is prompt tokens (estimated with tiktoken, only when a token limit needs it) plus
the output cap the proxy enforces on the request (all its choices); in cost windows, that worst
case priced at the model's price (the prompt as uncached input), and the settlement is the real
cost (cached input at its price) at the same price, carried on the reservation, whatever the
price table says by then. Concurrent requests therefore cannot push a user over a limit: each
one holds its worst case until it settles. Store failures
follow the configured policy (`fail_open` admits and meters, `fail_closed` refuses with 503);
settlements the store cannot take go to the local spool and are replayed exactly once when it is
back (`proxy.budget.spool`), so usage is not lost to an outage, a shutdown or a restart.

What a request claims and what it is granted is decided by `proxy.budget.admission`, pure; this
runs it around the store. Under the `clamp` policy a request whose worst case does not fit is
admitted with fewer output tokens, if its minimum fits: the store grants and reserves them in
the same atomic step, and the caller builds its body with the granted cap
(`Reservation.upstream_cap`). Under `estimate` a stream reserves a learned estimate of its
output, clamped the same way, and keeps its own cap upstream: `top_up` adds to the live
reservation in steps while it runs (`proxy.pipeline.topup`), each step checked and added in one
atomic store step like a reserve, so the windows are never promised past their limits.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from proxy.budget import admission as adm
from proxy.budget import estimate as est
from proxy.budget import limits as lim
from proxy.budget.notify import Notifier
from proxy.budget.principal import Principal
from proxy.budget.refusals import Refusal, Refused, unpriced
from proxy.budget.spool import REPLAY_DONE_TTL_S, Debit, SettleSpool
from proxy.budget.store import (
    ReserveRequest,
    ReserveResult,
    ScopeKind,
    SettleKind,
    Store,
    StoreError,
    TopUpResult,
    WindowAmount,
)
from proxy.budget.store_health import StoreHealth
from proxy.config.policy import DEFAULT_MAX_OUTPUT_TOKENS, AdmissionPolicy, Policy, Price
from proxy.cost import CostLines, price_for
from proxy.errors import ServiceUnavailable
from proxy.ids import new_id
from proxy.protocol.usage import Usage
from proxy.telemetry.metrics import Metrics

log = logging.getLogger("tokenmeter.budget")


@dataclass(frozen=True, slots=True)
class Reservation:
    """One attempt's hold on its budget: what it asked (`ask`) and what it was granted
    (`grant`), under the store's id, with the windows' counters after the reserve."""

    res_id: str
    ask: adm.Ask
    grant: adm.Grant
    used: tuple[int, ...]  # per window, after reserving; None-store admission: all zero
    stored: bool  # False: admitted while the store was unreachable (fail_open)

    @property
    def user(self) -> str:
        return self.ask.user

    @property
    def plan(self) -> lim.Plan:
        return self.ask.plan

    @property
    def price(self) -> Price | None:
        """The price cost windows were reserved at; settled at it too."""
        return self.ask.plan.price

    @property
    def admission(self) -> AdmissionPolicy:
        """The policy it was admitted under (a label of the reserved / over-reserved
        counters)."""
        return self.ask.rule.policy

    @property
    def held_output(self) -> int:
        """Output tokens held in the windows before any top-up (`adm.Grant.held_output`)."""
        return self.grant.held_output

    @property
    def upstream_cap(self) -> int | None:
        """The output cap written into the body sent upstream (`adm.Grant.upstream_cap`)."""
        return self.grant.upstream_cap

    @property
    def topup_cap(self) -> int | None:
        """Under `estimate`: the cap sent upstream, which top-ups may raise `held_output` to
        (None: not topped up)."""
        return self.grant.topup_cap

    @property
    def clamped(self) -> bool:
        return self.grant.clamped

    @property
    def estimate_key(self) -> str | None:
        """The store key of the (user, key, model)'s output history (`adm.Ask.estimate_key`)."""
        return self.ask.estimate_key

    @property
    def learned_key(self) -> str | None:
        """Admitted under `estimate` as a stream: the store flag its stream may teach
        (`proxy.budget.estimate.learned_key`), else None."""
        return self.ask.learned_key if self.ask.estimates else None

    @property
    def reserved_tokens(self) -> int:
        """Tokens held, top-ups aside: the prompt and the output."""
        return self.ask.prompt_tokens + self.grant.held_output


class Budget:
    def __init__(self, store: Store, metrics: Metrics, notifier: Notifier,
                 clock: Callable[[], float] = time.time, spool: SettleSpool | None = None) -> None:
        self.store = store
        self.metrics = metrics
        self.notifier = notifier
        self.clock = clock
        self.health = StoreHealth(metrics)
        self.spool = spool
        self._spool_failing = False  # the last spool write failed (said once per episode)
        self._active: dict[str, Reservation] = {}
        self._topped: dict[str, int] = {}  # res_id -> output tokens added by top-ups
        self._background: set[asyncio.Task[None]] = set()
        # Plans of this minute: (user, key, model) -> (policy, limits, enforce, plan).
        self._plans: dict[tuple[str, str | None, str], tuple[Policy, object, bool, lim.Plan]] = {}
        self._plans_minute = -1

    # --- reserve ------------------------------------------------------------------------
    def plan(self, principal: Principal, model: str, policy: Policy) -> lim.Plan:
        """The windows, concurrency limits and output cap that apply to a request now. Open
        and pass-through modes meter without limiting: no cap, only unlimited windows. A cost
        window needs the model's price: without one the request is refused (`BudgetExceeded`),
        since a budget that cannot be counted cannot be kept.

        A plan is the same all minute long (every window's stamp and reset are minutes or
        longer, and a day in any time zone starts on a minute), so it is made once a minute per
        user, key and model and kept while the configuration is the same objects; only a
        counter's time to live, set when the counter is made, may come out up to a minute
        longer."""
        now = self.clock()
        minute = int(now // 60)
        if minute != self._plans_minute:
            self._plans.clear()
            self._plans_minute = minute
        key = (principal.user, principal.key_id, model)
        kept = self._plans.get(key)
        if (kept is not None and kept[0] is policy and kept[1] is principal.limits
                and kept[2] == principal.enforce):
            return kept[3]
        made = self._plan(principal, model, policy, now)
        self._plans[key] = (policy, principal.limits, principal.enforce, made)
        return made

    def _plan(self, principal: Principal, model: str, policy: Policy, now: float) -> lim.Plan:
        plan = lim.plan(policy, principal.user, principal.limits, model, now)
        if not principal.enforce:
            return plan.unenforced()
        price = None
        if plan.costed:
            price = price_for(policy.prices, model)
            if price is None:
                window = next(w for w in plan.windows
                              if w.measure is lim.Measure.COST and w.limit is not None)
                self.metrics.budget_refused(principal.user, window.name)
                raise unpriced(principal.user, model, window)
        return lim.Plan(plan.slot, plan.windows, plan.in_flight,
                        plan.output_cap or DEFAULT_MAX_OUTPUT_TOKENS, plan.costed, price)

    async def output_estimate(self, key: str, cap: int, initial: int) -> int:
        """The output tokens a request under `estimate` reserves (see `proxy.budget.estimate`);
        `initial` when the store holds no history or cannot be read."""
        if not self.health.up:
            return est.estimate((), cap, initial)
        try:
            samples = await self.store.output_samples(key)
        except StoreError as exc:
            self.health.failed("estimate", exc)
            samples = ()
        return est.estimate(samples, cap, initial)

    async def learn(self, reservation: Reservation, output_tokens: int) -> None:
        """A completed request's output length joins its (user, key, model)'s history."""
        if reservation.estimate_key is None or not self.health.up:
            return
        try:
            await self.store.record_output(reservation.estimate_key, output_tokens,
                                           est.SAMPLES, est.ESTIMATE_TTL_S)
        except StoreError as exc:
            self.health.failed("estimate", exc)

    async def learned_hidden(self, key: str | None) -> bool:
        """Whether an (upstream, model) was learned to hide output (see
        `proxy.budget.estimate`): False when nothing is to be learned, or the store cannot
        say."""
        if key is None or not self.health.up:
            return False
        try:
            return await self.store.flagged(key)
        except StoreError as exc:
            self.health.failed("estimate", exc)
            return False

    async def learn_hidden(self, reservation: Reservation) -> None:
        """The stream of `reservation` showed its (upstream, model) hides output, or streams
        it in pieces larger than a top-up step: later admissions reserve its cap."""
        key = reservation.learned_key
        if key is None or not self.health.up:
            return
        try:
            await self.store.flag(key, est.LEARNED_TTL_S)
        except StoreError as exc:
            self.health.failed("estimate", exc)

    def learn_hidden_later(self, reservation: Reservation) -> None:
        """`learn_hidden` off the stream's path: a stream never waits for it."""
        task = asyncio.ensure_future(self.learn_hidden(reservation))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def top_up(self, reservation: Reservation, step: int, policy: Policy) -> TopUpResult:
        """Add up to `step` output tokens to a stream's reservation in every window, all or
        nothing (the last room left is granted when it is less than a step). Never raises: a
        store that fails follows `store.on_error` (fail_open grants the step unrecorded, and
        the settle counts what was used; fail_closed refuses, naming no window)."""
        plan = reservation.plan
        if not reservation.stored or not self.health.up:
            if policy.store.on_error == "fail_closed" and reservation.stored:
                return TopUpResult(0, refused_entry=None)  # no window's: the store's
            return self._topped_up(reservation, step)
        rates = adm.clamp_of(plan, reservation.ask.prompt_tokens, 0, 0).rates
        entries = tuple(WindowAmount(w.key, w.limit, r, w.ttl_s)
                        for w, r in zip(plan.windows, rates, strict=True))
        started = time.perf_counter()
        try:
            result = await self.store.top_up(plan.slot, reservation.res_id, entries, step, 1)
        except StoreError as exc:
            self.health.failed("top_up", exc)
            if policy.store.on_error == "fail_closed":
                return TopUpResult(0, refused_entry=None)
            return self._topped_up(reservation, step)
        self.health.ok("top_up", started)
        if result.granted:
            self._topped_up(reservation, result.granted)
        return result

    def _topped_up(self, reservation: Reservation, granted: int) -> TopUpResult:
        if reservation.res_id in self._active:  # not after its settle: nothing would pop it
            self._topped[reservation.res_id] = self._topped.get(reservation.res_id, 0) + granted
        self.metrics.budget_reserved(reservation.user, reservation.admission, granted)
        return TopUpResult(granted)

    async def reserve(self, ask: adm.Ask, policy: Policy) -> Reservation:
        """Hold what `ask` claims (see `proxy.budget.admission`) in every window of its plan,
        and the request in its in-flight sets, or raise `Refused` with what refused it. The
        reservation's `upstream_cap` is the output cap its body is built with. The store's
        failures follow `policy.store.on_error`."""
        estimate = await self._estimate(ask) if ask.estimates else None
        return await self._hold(ask, adm.claim_for(ask, estimate), policy)

    async def reserve_hit(self, ask: adm.Ask, usage: Usage, cost_nanousd: int,
                          policy: Policy) -> Reservation:
        """A response-cache hit admitted as the request it stands for: through the same
        checks (its in-flight sets, its request-rate windows), holding exactly what it will
        be charged, `usage` and `cost_nanousd` (zero under `cache.charge_hits: none`), all
        or nothing: a hit is never clamped. Raises `Refused` as `reserve` does."""
        plan = ask.plan
        entries = tuple(WindowAmount(w.key, w.limit, lim.amount(w, usage.input_tokens,
                                                         usage.output_tokens, cost_nanousd),
                              w.ttl_s) for w in plan.windows)
        claim = adm.Claim(usage.output_tokens, cost_nanousd,
                          ReserveRequest(entries, plan.in_flight), None)
        return await self._hold(ask, claim, policy)

    async def _hold(self, ask: adm.Ask, claim: adm.Claim, policy: Policy) -> Reservation:
        if ask.plan.holds_nothing:  # metered only: granted whole, nothing stored or settled
            return Reservation(new_id(), ask, adm.whole(ask, claim), (), stored=False)
        res_id = new_id()
        answer = await self._ask_store(ask, claim, res_id, policy)
        if answer is None:
            return self._unchecked(ask, claim, policy)
        decision = adm.decide(ask, claim, answer)
        if isinstance(decision, Refusal):
            self.metrics.budget_refused(ask.user, adm.refused_limit(decision))
            raise Refused(decision)
        if decision.clamped_from is not None:
            binding = decision.binding
            self.metrics.budget_clamped(ask.user, binding.name if binding is not None else "",
                                        decision.clamped_from - decision.held_output)
        reservation = Reservation(res_id, ask, decision, answer.used, stored=True)
        self._active[res_id] = reservation
        self.metrics.budget_reserved(ask.user, ask.rule.policy,
                                     ask.prompt_tokens + decision.held_output)
        self._update_gauges(ask.user, ask.plan.windows, answer.used)
        return reservation

    def unreserved(self, principal: Principal, model: str, policy: Policy) -> Reservation:
        """What a charge nothing was reserved for is settled against: a response-cache hit
        charged in full (`cache.charge_hits: full`) that never went through admission. It is
        settled as an addition to its plan's windows, like a request admitted while the store
        was down (`Store.add_once`: once per id, whose done-marker the store keeps for
        `REPLAY_DONE_TTL_S`). Raises `Refused` as `plan` does (a cost window, no price)."""
        plan = self.plan(principal, model, policy)
        ask = adm.Ask(principal=principal, model=model, plan=plan, prompt_tokens=0,
                      asked_output=0, choices=1, stream=False, hidden_output=False)
        return Reservation(new_id(), ask, adm.Grant(None, 0, 0), (0,) * len(plan.windows),
                           stored=False)

    async def _estimate(self, ask: adm.Ask) -> int | None:
        """The output estimate `ask` holds instead of its cap (`Ask.estimates`); None when its
        (upstream, model) was learned to hide output: it holds its cap, as under `clamp`. The
        two reads go to the store together."""
        key = ask.estimate_key
        assert key is not None
        estimate = self.output_estimate(key, ask.asked_output, ask.rule.initial_estimate)
        learned = self.learned_hidden(ask.learned_key)
        if self.store.in_process:  # no I/O: nothing to overlap
            hidden, guess = await learned, await estimate
        else:
            hidden, guess = await asyncio.gather(learned, estimate)
        return None if hidden else guess

    async def _ask_store(self, ask: adm.Ask, claim: adm.Claim, res_id: str,
                         policy: Policy) -> ReserveResult | None:
        """The store's answer to `claim`, or None when it did not give one (down, or failing
        now): the policy then decides without it (`_unchecked`)."""
        plan, lease_s = ask.plan, policy.store.lease_seconds
        if self.store.in_process:  # never fails, never yields: nothing can cut it short
            return await self.store.reserve(plan.slot, res_id, claim.request, lease_s)
        # While the store is down, one request at a time tries it (and brings it back at once
        # when it answers); the others go on without waiting for a timeout.
        trial = not self.health.up
        if trial and not self.health.begin_trial():
            return None
        started = time.perf_counter()
        # Shielded: a client that hangs up must not leave a reservation behind whose reply
        # nobody reads (it would block the user until its lease ran out); `_abandoned` gives
        # back whatever the call turns out to have reserved. (A task costs a turn of the event
        # loop, which is why the in-process store goes without.)
        call = asyncio.ensure_future(
            self.store.reserve(plan.slot, res_id, claim.request, lease_s))
        try:
            answer = await asyncio.shield(call)
        except asyncio.CancelledError:
            call.add_done_callback(lambda t: self._abandoned(t, plan, res_id))
            raise
        except StoreError as exc:
            self.health.failed("reserve", exc)
            # The script may have run before the reply was lost: release its id when the
            # store answers again; this request is settled under an id of its own.
            self._settle_later(plan, res_id, _zero(plan), tokens=0)
            return None
        finally:
            if trial:
                self.health.end_trial()
        self.health.ok("reserve", started)
        return answer

    def _unchecked(self, ask: adm.Ask, claim: adm.Claim, policy: Policy) -> Reservation:
        """The store is down: the policy decides at once."""
        if policy.store.on_error == "fail_closed":
            self.health.skipped("refused")
            raise ServiceUnavailable(
                "The budget store is unavailable and this proxy fails closed; retry shortly.",
                headers={"Retry-After": "1"},
            )
        self.health.skipped("admitted")
        return Reservation(new_id(), ask, adm.whole(ask, claim), (0,) * len(ask.plan.windows),
                           stored=False)

    def _abandoned(self, call: asyncio.Future[ReserveResult], plan: lim.Plan,
                   res_id: str) -> None:
        if call.cancelled():
            self._settle_later(plan, res_id, _zero(plan), tokens=0)
            return
        exc = call.exception()
        if isinstance(exc, StoreError):
            self.health.failed("reserve", exc)
        if exc is not None or call.result().ok:
            self._settle_later(plan, res_id, _zero(plan), tokens=0)

    # --- settle -------------------------------------------------------------------------
    async def settle(self, reservation: Reservation, usage: Usage,
                     priced: CostLines | None) -> None:
        """Never raises: what the store cannot take now goes to the spool. `priced`: the
        request's, at the reservation's price (settle prices a request once, for the books
        too); counted only when the reservation was priced for cost windows."""
        self._active.pop(reservation.res_id, None)
        topped = self._topped.pop(reservation.res_id, 0)
        plan = reservation.plan
        inp, out = usage.input_tokens, usage.output_tokens
        cost = priced.nanousd if priced is not None and reservation.price is not None else 0
        entries = tuple(
            WindowAmount(w.key, w.limit, lim.amount(w, inp, out, cost), w.ttl_s)
            for w in plan.windows
        )
        reserved = reservation.reserved_tokens + topped
        if reservation.stored:
            over = max(0, reserved - usage.total_tokens)
            self.metrics.budget_overreserved(reservation.user, reservation.admission, over)
        await self._settle(reservation, entries, usage.total_tokens)

    async def release(self, reservation: Reservation) -> None:
        """Give a reservation back whole, the request itself included: an upstream attempt
        that produced nothing before a fallback took over. Never raises, like settle."""
        self._active.pop(reservation.res_id, None)
        topped = self._topped.pop(reservation.res_id, 0)
        if reservation.stored:
            reserved = reservation.reserved_tokens + topped
            self.metrics.budget_overreserved(reservation.user, reservation.admission,
                                             reserved)
            await self._settle(reservation, _zero(reservation.plan), 0)

    async def _settle(self, reservation: Reservation, entries: tuple[WindowAmount, ...],
                      tokens: int) -> None:
        plan = reservation.plan
        if plan.holds_nothing:
            return
        kind = SettleKind.RESERVED if reservation.stored else SettleKind.ADDITION
        charge = Debit(slot=plan.slot, res_id=reservation.res_id, entries=entries,
                        tokens=tokens, kind=kind, notice=_notice_window(plan),
                        user=reservation.user, windows=plan.windows)
        if not self.health.up:
            self.health.skipped("spooled")
            self._spool(charge, per_id=kind is SettleKind.RESERVED)
            return
        with contextlib.suppress(StoreError):  # spooled by _apply
            await self._apply(charge)

    def _settle_later(self, plan: lim.Plan, res_id: str, entries: tuple[WindowAmount, ...],
                      tokens: int) -> None:
        """A settlement off the request's path (a release after an abandoned reserve)."""
        charge = Debit(slot=plan.slot, res_id=res_id, entries=entries, tokens=tokens,
                        kind=SettleKind.RESERVED)
        if not self.health.up:
            self._spool(charge, per_id=True)
            return

        async def run() -> None:
            with contextlib.suppress(StoreError):
                await self._apply(charge)

        task = asyncio.ensure_future(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _apply(self, charge: Debit, replay: bool = False) -> None:
        """The one way a settlement reaches the store, live or replayed from the spool: apply
        it, then the gauges and the quota notices. A failure marks the store down, spools the
        charge under its id (the store may have applied it before the reply was lost: the
        replay must be recognised; unless it came from the spool) and raises."""
        started = time.perf_counter()
        try:
            if charge.kind is SettleKind.RESERVED:
                used = await self.store.settle(charge.slot, charge.res_id, charge.entries)
            else:
                used = await self.store.add_once(charge.slot, charge.res_id, charge.entries,
                                                 REPLAY_DONE_TTL_S)
        except StoreError as exc:
            self.health.failed("settle", exc)
            if not replay:
                self._spool(charge, per_id=True)
            raise
        self.health.ok("settle", started)
        if charge.windows is not None:
            self._update_gauges(charge.user, charge.windows, used)
        notice = charge.notice
        if notice is not None:
            keys = [e.key for e in charge.entries]
            if notice.key in keys:
                await self.notifier.check(self.store, charge.user, notice,
                                          used[keys.index(notice.key)])

    def _spool(self, charge: Debit, per_id: bool) -> None:
        """`per_id`: owed under the charge's own id; else summed per counter with the other
        additions of the outage (applied later as one batch)."""
        if self.spool is None:
            # No store and no spool: nothing will ever deliver it. Loud, with what was lost.
            self._lost([charge.tokens],
                       f"the store is down and no spool is open (slot {charge.slot})")
            return
        try:
            if per_id:
                self.spool.owe(charge, self.clock())
            else:
                self.spool.add(charge, self.clock())
        except OSError as exc:
            # Not lost: memory holds it and a replay delivers it when the store is back. Only a
            # stop before that, with the disk still failing, loses it (counted then: `close`).
            if not self._spool_failing:
                self._spool_failing = True
                log.error("the settlement spool cannot be written (%s): settlements the store "
                          "cannot take are kept in memory until it is back; a stop before then "
                          "loses them", exc)
        else:
            if self._spool_failing:
                self._spool_failing = False
                log.warning("the settlement spool is written again")
        self.metrics.settlement_spooled()
        self._backlog()

    def _lost(self, tokens: list[int], why: str) -> None:
        """Settlements nothing will deliver any more: the one loss left."""
        for t in tokens:
            self.metrics.settlement_lost(t)
        log.error("LOST %d settlements (%d tokens): %s", len(tokens), sum(tokens), why)

    def close_spool(self) -> None:
        """At stop: what the spool still owes stays on disk for the next start; what only
        memory held (its write failed) and still cannot be written is lost now, loudly."""
        if self.spool is None:
            return
        count, tokens = self.spool.pending()
        lost = self.spool.close()
        if lost:
            self._lost(lost, "the store did not take them before this stop, and the spool "
                             "could not be written")
        if count > len(lost):
            log.warning("%d settlements (%d tokens) are owed to the budget store; they stay in "
                        "%s and are replayed at the next start", count - len(lost),
                        tokens - sum(lost), self.spool.directory)

    def _backlog(self) -> None:
        count, tokens = self.spool.pending() if self.spool is not None else (0, 0)
        self.metrics.settle_backlog(count, tokens)

    async def probe(self) -> bool:
        """Ping the store and record the answer: every replica's gauge and health stay true
        even when it serves no traffic."""
        started = time.perf_counter()
        try:
            await self.store.ping()
        except StoreError as exc:
            self.health.failed("ping", exc)
            return False
        self.health.ok("ping", started)
        return True

    async def replay(self) -> int:
        """Apply what the spool holds, while the store takes it. Returns how many are left."""
        if self.spool is None:
            return 0
        if self.health.up and self.spool.pending()[0]:
            for owed in self.spool.take():
                try:
                    await self._apply(owed.charge(self.clock()), replay=True)
                except StoreError:
                    break
                self.spool.done(owed)
                log.info("replayed a settlement of %d tokens for %s owed since a store failure",
                         owed.tokens, owed.slot)
        self._backlog()
        left = self.spool.pending()[0]
        if self._spool_failing and not left:
            self._spool_failing = False  # the next failure of the disk is said again
            log.warning("the settlements kept in memory while the spool could not be written "
                        "have reached the store")
        return left

    async def drain_background(self) -> None:
        while self._background:
            await asyncio.gather(*list(self._background))

    async def renew_leases(self, lease_s: float) -> None:
        if not self.health.up:
            return
        by_slot: dict[str, list[str]] = collections.defaultdict(list)
        for r in self._active.values():
            if r.stored:
                by_slot[r.plan.slot].append(r.res_id)
        for slot, ids in by_slot.items():
            try:
                await self.store.renew(slot, ids, lease_s)
            except StoreError as exc:
                self.health.failed("renew", exc)
                return

    # --- bookkeeping --------------------------------------------------------------------
    def _update_gauges(self, user: str, windows: tuple[lim.Window, ...],
                       used: tuple[int, ...]) -> None:
        m = self.metrics
        for w, u in zip(windows, used, strict=True):
            # The user's and the team's windows (a key's or a model group's have no gauges);
            # cost windows count nano-dollars, in gauges of their own.
            cost = w.measure is lim.Measure.COST
            if w.scope.kind is ScopeKind.USER:
                if cost:
                    m.budget_cost_state(user, w.name, u, w.limit)
                else:
                    m.budget_state(user, w.name, u, w.limit)
            elif w.scope.kind is ScopeKind.TEAM:
                if cost:
                    m.team_budget_cost_state(w.scope.name, w.name, u, w.limit)
                else:
                    m.team_budget_state(w.scope.name, w.name, u, w.limit)


def _notice_window(plan: lim.Plan) -> lim.Window | None:
    return next((w for w in plan.windows if w.is_users_daily_quota), None)


def _zero(plan: lim.Plan) -> tuple[WindowAmount, ...]:
    return tuple(WindowAmount(w.key, w.limit, 0, w.ttl_s) for w in plan.windows)


