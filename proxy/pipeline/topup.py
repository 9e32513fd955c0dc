"""The driver of a stream's top-ups under `admission: estimate`: the relay calls `check`.

What to do at each check is decided by the reservation's side (`proxy.budget.topups`, pure);
this runs it: counts the output tokens streamed so far (the translator's `output_tokens_so_far`:
the new events rated by a sample), starts a top-up (`Budget.top_up`) as a task so the store's
round trip overlaps the stream, waits for its answer when told to, counts the answers
(`tokenmeter_budget_topups_total`), and ends the stream when told to: `QuotaEnded` (a window
refused the top-up; `tokenmeter_budget_streams_ended_total`) or `StoreFailed` (the store failed
to answer under `store.on_error: fail_closed`: the store outage it is, `service_unavailable`),
which the relay sends as the final error event. What the stream produced is charged exactly at
settle.

The relay checks when the bytes arrived reach `next_at`: the tap cuts a chunk that may reach
it where its events end (`StreamTap.pieces`, any line ends), and the piece that reaches it is
metered before it is forwarded (`tokens` before it, `check` after), so a chunk that bunches
many events, or one event that carries a whole answer, cannot carry the stream past its
reservation unseen: it is topped up first, or it is the last. A piece of more than a top-up
step teaches the store that its (upstream, model) streams so (`Budget.learn_hidden_later`).
"""

from __future__ import annotations

import asyncio

from proxy.budget import refusals
from proxy.budget.accounting import Budget, Reservation
from proxy.budget.refusals import QuotaEnded
from proxy.budget.store import TopUpResult
from proxy.budget.topups import Act, Allowance, Seen
from proxy.config.policy import Policy
from proxy.errors import ServiceUnavailable
from proxy.protocol.translators import Translator


class StoreFailed(ServiceUnavailable):
    """The error event that ends a stream under `admission: estimate` whose top-up the store
    failed to answer while `store.on_error` is `fail_closed`: OpenAI's shape, type
    `server_error`, code and error class `service_unavailable` (status 200, as it streamed)."""


class TopUps:
    __slots__ = ("_allowance", "_budget", "_learned", "_policy", "_refused", "_reservation",
                 "_task", "_translator", "next_at")

    def __init__(self, budget: Budget, reservation: Reservation, translator: Translator,
                 policy: Policy, allowance: Allowance) -> None:
        self._budget = budget
        self._reservation = reservation
        self._translator = translator
        self._policy = policy
        self._allowance = allowance
        self._task: asyncio.Task[TopUpResult] | None = None
        self._refused: TopUpResult | None = None  # the answer that refused a top-up
        self._learned = False  # this stream taught the store what it saw (once is enough)
        self.next_at = allowance.next_at  # the bytes arrived at which `check` is due

    @staticmethod
    def for_stream(budget: Budget, reservation: Reservation, translator: Translator,
                   policy: Policy) -> TopUps | None:
        allowance = Allowance.of(reservation.held_output, reservation.topup_cap)
        if allowance is None:
            return None
        return TopUps(budget, reservation, translator, policy, allowance)

    def tokens(self) -> int:
        """The output tokens streamed so far: `check`'s `before`, asked before the piece that
        reaches `next_at` is fed to the tap."""
        return self._translator.output_tokens_so_far()

    async def check(self, events: int, arrived: int, before: int, at_boundary: bool) -> None:
        """The piece that brought the bytes arrived to `arrived` (>= `next_at`) is metered,
        not yet forwarded: `events` content events so far, it included, and `before` output
        tokens before it; `at_boundary`: the bytes forwarded end between two events once it
        is. Returns when it may go out; raises `QuotaEnded` or `StoreFailed` when it must be
        the last."""
        tokens = self._translator.output_tokens_so_far()
        seen = Seen(events, tokens, arrived, tokens - before, at_boundary)
        task = self._task
        if task is not None and task.done():
            self._task = None
            self._apply(task.result())
        while self.next_at <= arrived:  # the rule's word: checked again until the next is ahead
            decision = self._allowance.check(seen, self._task is not None)
            if decision.bunched and not self._learned:
                self._learned = True
                self._budget.learn_hidden_later(self._reservation)
            if decision.act is Act.WAIT:
                await self._answer()
                continue
            self._allowance = decision.allowance
            self.next_at = decision.allowance.next_at
            if decision.act is Act.START:
                self._task = asyncio.ensure_future(
                    self._budget.top_up(self._reservation, decision.step, self._policy))
            elif decision.act is Act.END:
                self._end(seen.tokens)

    async def _answer(self) -> None:
        """Wait for the top-up that is out, if any, and apply its answer."""
        task, self._task = self._task, None
        if task is not None:
            self._apply(await task)

    def _apply(self, result: TopUpResult) -> None:
        user = self._reservation.user
        if result.granted:
            self._allowance = self._allowance.granted(result.granted)
            self._budget.metrics.budget_topped_up(user, "granted", result.granted)
            return
        self._refused = result
        self._allowance = self._allowance.refusal()
        if result.gone:
            outcome = "gone"
        elif result.refused_entry is None:  # no window refused it: the store failed
            outcome = "unavailable"
        else:
            outcome = "refused"
        self._budget.metrics.budget_topped_up(user, outcome, 0)

    def _end(self, tokens: int) -> None:
        refused = self._refused
        assert refused is not None
        if refused.refused_entry is None:
            # Not the quota: the store failed (or is known down) and the proxy fails closed.
            # A store outage, booked as one (error class service_unavailable), never as a
            # user out of quota; the store's own failure is counted where it happened.
            raise StoreFailed(
                f"This stream was ended after {tokens} output tokens: the budget store is "
                "unavailable and this proxy fails closed, so its reservation could not grow."
            )
        window = self._reservation.plan.windows[refused.refused_entry]
        self._budget.metrics.budget_stream_ended(self._reservation.user, window.name)
        raise refusals.ended(self._reservation.user, window, tokens, self._budget.clock(),
                             self._policy.timezone)

    async def close(self) -> None:
        """The stream is over: a top-up still out is seen through (its answer is counted),
        so nothing is added to the reservation after it settles."""
        await self._answer()


__all__ = ["QuotaEnded", "StoreFailed", "TopUps"]
