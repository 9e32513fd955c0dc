"""Reserve a request's worst case before it goes upstream; settle it to the actual usage after.

The reservation is prompt tokens (estimated with tiktoken, only when a token limit needs it) plus
the output cap the proxy enforces on the request. Concurrent requests therefore cannot push a user
over a limit: each one holds its worst case until it settles. Store failures follow the configured
policy (`fail_open` admits and meters, `fail_closed` refuses with 503); settlements that fail are
kept and retried until the store is back, so usage is not lost.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from zoneinfo import ZoneInfo

from proxy import limits as lim
from proxy.auth import Principal
from proxy.errors import BudgetExceeded, ServiceUnavailable
from proxy.metrics import Metrics
from proxy.notify import Notifier
from proxy.store import Entry, Store, StoreError
from proxy.translators import Translator
from proxy.usage import Usage
from proxy.userconfig import Policy

log = logging.getLogger("tokenmeter.budget")

DEFAULT_OUTPUT_CAP = 4096
_RETRY_QUEUE_MAX = 100_000


@dataclass(frozen=True, slots=True)
class Reservation:
    res_id: str
    user: str
    plan: lim.Plan
    prompt_tokens: int
    output_cap: int
    used: tuple[int, ...]  # per window, after reserving; None-store admission: all zero
    stored: bool  # False: admitted while the store was unreachable (fail_open)


def _duration(seconds: float) -> str:
    """OpenAI's reset format: "1s", "6m0s", "1h2m3s"."""
    s = max(0, math.ceil(seconds))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    if h:
        return f"{h}h{m}m{sec}s"
    if m:
        return f"{m}m{sec}s"
    return f"{sec}s"


_HEADER_NAMES = {
    "requests_per_minute": "requests",
    "tokens_per_minute": "tokens",
    "daily_tokens": "tokens-day",
    "daily_input_tokens": "input-tokens-day",
    "daily_output_tokens": "output-tokens-day",
}


def rate_limit_headers(windows: tuple[lim.Window, ...], used: tuple[int, ...],
                       now: float) -> dict[str, str]:
    """`x-ratelimit-*` in OpenAI's style for every limited window (the tightest per name)."""
    out: dict[str, str] = {}
    best: dict[str, int] = {}
    for w, u in zip(windows, used, strict=True):
        if w.limit is None:
            continue
        name = _HEADER_NAMES[w.name]
        remaining = max(0, w.limit - u)
        if name in best and best[name] <= remaining:
            continue
        best[name] = remaining
        out[f"x-ratelimit-limit-{name}"] = str(w.limit)
        out[f"x-ratelimit-remaining-{name}"] = str(remaining)
        out[f"x-ratelimit-reset-{name}"] = _duration(w.resets_at - now)
    return out


class Budget:
    def __init__(self, store: Store, metrics: Metrics, notifier: Notifier,
                 clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.metrics = metrics
        self.notifier = notifier
        self.clock = clock
        self._active: dict[str, Reservation] = {}
        self._retry: collections.deque[tuple[Reservation, tuple[Entry, ...]]] = (
            collections.deque(maxlen=_RETRY_QUEUE_MAX)
        )

    # --- reserve ------------------------------------------------------------------------
    async def reserve(self, principal: Principal, translator: Translator,
                      policy: Policy) -> Reservation:
        now = self.clock()
        plan = lim.plan(policy, principal.user, principal.limits, translator.model, now)
        # Open and pass-through modes meter without limiting: the client's body stays as sent.
        cap = (plan.output_cap or DEFAULT_OUTPUT_CAP) if principal.enforce else None
        output = translator.cap_output(cap)
        prompt = 0
        if plan.needs_prompt_estimate and principal.enforce:
            prompt = await _estimate(translator)
        windows = plan.windows if principal.enforce else tuple(
            w for w in plan.windows if w.limit is None
        )
        plan = lim.Plan(plan.slot, windows, plan.max_concurrent if principal.enforce else None,
                        cap)
        entries = tuple(
            Entry(w.key, w.limit, lim.amount(w, prompt, output), w.ttl_s) for w in windows
        )
        res_id = uuid.uuid4().hex
        started = time.perf_counter()
        try:
            result = await self.store.reserve(
                plan.slot, res_id, entries, plan.max_concurrent, policy.store.lease_seconds
            )
        except StoreError as exc:
            self._store_failed("reserve", exc)
            if policy.store.on_error == "fail_closed":
                raise ServiceUnavailable(
                    "The budget store is unavailable and this proxy fails closed; retry shortly.",
                    headers={"Retry-After": "1"},
                ) from None
            return Reservation(res_id, principal.user, plan, prompt, output,
                               (0,) * len(windows), stored=False)
        self._store_ok("reserve", started)
        if not result.ok:
            raise self._refusal(principal, plan, entries, result.refused, result.used, now,
                                policy.timezone)
        reservation = Reservation(res_id, principal.user, plan, prompt, output, result.used,
                                  stored=True)
        self._active[res_id] = reservation
        reserved_total = prompt + output
        self.metrics.budget_reserved.labels(principal.user).inc(reserved_total)
        self._update_gauges(principal.user, windows, result.used)
        return reservation

    def _refusal(self, principal: Principal, plan: lim.Plan, entries: tuple[Entry, ...],
                 refused: int | None, used: tuple[int, ...], now: float,
                 tz: str) -> BudgetExceeded:
        headers = rate_limit_headers(plan.windows, used, now)
        if refused is None or refused < 0:
            self.metrics.budget_refusals.labels(principal.user, "max_concurrent_requests").inc()
            return BudgetExceeded(
                f"Too many concurrent requests for user '{principal.user}': the limit is "
                f"{plan.max_concurrent} at a time. Retry when one of them has finished.",
                type_="requests", code="concurrency_limit_exceeded",
                limit="max_concurrent_requests", headers={**headers, "Retry-After": "1"},
            )
        window, entry = plan.windows[refused], entries[refused]
        assert window.limit is not None
        self.metrics.budget_refusals.labels(principal.user, window.name).inc()
        left = max(0, window.limit - used[refused])
        retry_after = max(1, math.ceil(window.resets_at - now))
        reset_at = datetime.fromtimestamp(window.resets_at, ZoneInfo(tz)).isoformat()
        scope = _scope_words(window.scope)
        what = window.name.replace("_", " ")
        msg = (
            f"{what.capitalize()} limit reached for user '{principal.user}'{scope}: "
            f"{left:,} of {window.limit:,} left, and this request needs up to {entry.amount:,} "
            f"(the prompt plus max output tokens). It resets at {reset_at} "
            f"(in {_duration(window.resets_at - now)})."
        )
        daily = window.name.startswith("daily")
        never = entry.amount > window.limit  # would not fit even in an empty window
        if daily or never:
            if never:
                msg += " Lower max_tokens: this request can never fit this limit."
            return BudgetExceeded(
                msg, type_="insufficient_quota" if daily else "tokens",
                code="daily_quota_exceeded" if daily else "rate_limit_exceeded",
                limit=window.name,
                # The openai SDKs retry every 429 unless told not to; a spent daily quota will
                # not come back within any retry budget.
                headers={**headers, "Retry-After": str(retry_after), "x-should-retry": "false"},
            )
        return BudgetExceeded(
            msg, type_="requests" if window.measure == "requests" else "tokens",
            code="rate_limit_exceeded", limit=window.name,
            headers={**headers, "Retry-After": str(retry_after)},
        )

    # --- settle -------------------------------------------------------------------------
    async def settle(self, reservation: Reservation, usage: Usage) -> None:
        """Never raises: a failure is logged, counted and retried later."""
        self._active.pop(reservation.res_id, None)
        plan = reservation.plan
        entries = tuple(
            Entry(w.key, w.limit, lim.amount(w, usage.input_tokens, usage.output_tokens),
                  w.ttl_s)
            for w in plan.windows
        )
        reserved = reservation.prompt_tokens + reservation.output_cap
        if reservation.stored:
            over = max(0, reserved - usage.total_tokens)
            self.metrics.budget_overreserved.labels(reservation.user).inc(over)
        await self._settle_entries(reservation, entries)

    async def release(self, reservation: Reservation) -> None:
        """Give a reservation back whole, the request itself included: an upstream attempt
        that produced nothing before a fallback took over. Never raises, like settle."""
        self._active.pop(reservation.res_id, None)
        if reservation.stored:
            reserved = reservation.prompt_tokens + reservation.output_cap
            self.metrics.budget_overreserved.labels(reservation.user).inc(reserved)
        entries = tuple(Entry(w.key, w.limit, 0, w.ttl_s) for w in reservation.plan.windows)
        await self._settle_entries(reservation, entries)

    async def _settle_entries(self, reservation: Reservation, entries: tuple[Entry, ...]) -> bool:
        started = time.perf_counter()
        try:
            used = await self.store.settle(reservation.plan.slot, reservation.res_id, entries)
        except StoreError as exc:
            self._store_failed("settle", exc)
            self._retry.append((reservation, entries))
            return False
        self._store_ok("settle", started)
        self._update_gauges(reservation.user, reservation.plan.windows, used)
        await self._thresholds(reservation, used)
        return True

    async def _thresholds(self, reservation: Reservation, used: tuple[int, ...]) -> None:
        for w, u in zip(reservation.plan.windows, used, strict=True):
            if w.name == "daily_tokens" and w.scope == "u" and w.limit:
                await self.notifier.check(self.store, reservation.user, w, u)

    async def retry_pending(self) -> int:
        """Replay settlements that failed; stops at the first failure. Returns how many left."""
        while self._retry:
            reservation, entries = self._retry[0]
            started = time.perf_counter()
            try:
                used = await self.store.settle(reservation.plan.slot, reservation.res_id, entries)
            except StoreError:
                break
            self._store_ok("settle", started)
            self._retry.popleft()
            self._update_gauges(reservation.user, reservation.plan.windows, used)
            log.info("settled reservation %s after a store failure", reservation.res_id)
        self.metrics.settle_backlog.set(len(self._retry))
        return len(self._retry)

    async def renew_leases(self, lease_s: float) -> None:
        by_slot: dict[str, list[str]] = collections.defaultdict(list)
        for r in self._active.values():
            if r.stored:
                by_slot[r.plan.slot].append(r.res_id)
        for slot, ids in by_slot.items():
            try:
                await self.store.renew(slot, ids, lease_s)
            except StoreError as exc:
                self._store_failed("renew", exc)

    # --- bookkeeping --------------------------------------------------------------------
    def _store_failed(self, op: str, exc: StoreError) -> None:
        self.metrics.store_errors.labels(op).inc()
        self.metrics.store_up.set(0)
        log.error("budget store %s failed: %s", op, exc)

    def _store_ok(self, op: str, started: float) -> None:
        self.metrics.store_latency.labels(op).observe(time.perf_counter() - started)
        self.metrics.store_up.set(1)

    def _update_gauges(self, user: str, windows: tuple[lim.Window, ...],
                       used: tuple[int, ...]) -> None:
        for w, u in zip(windows, used, strict=True):
            if w.scope != "u":
                continue
            self.metrics.budget_used.labels(user, w.name).set(u)
            if w.limit is not None:
                self.metrics.budget_limit.labels(user, w.name).set(w.limit)
                self.metrics.budget_remaining.labels(user, w.name).set(max(0, w.limit - u))

    def active(self) -> Iterator[Reservation]:
        return iter(list(self._active.values()))


def _scope_words(scope: str) -> str:
    if scope.startswith("k."):
        return f" (key '{scope[2:]}')"
    if scope.startswith("m."):
        return f" (models '{scope[2:]}')"
    return ""


async def _estimate(translator: Translator) -> int:
    # tiktoken is native code that releases the GIL; a large prompt is counted off the loop so
    # one long request does not stall every stream on this replica.
    if len(translator.request.raw) > 32_768:
        return await asyncio.to_thread(translator.estimate_prompt_tokens)
    return translator.estimate_prompt_tokens()
