"""Top-ups of a stream's reservation under `admission: estimate`, driven by the relay.

The stream reserved its prompt plus a learned estimate of its output (`proxy.budget.estimate`)
and kept its own output cap upstream. As it runs, the relay calls `check` when the count of
content events reaches `next_at`; `check` counts the output tokens streamed so far (the
translator's `output_tokens_so_far`: the new events rated by a sample) and:
- at three quarters of what is reserved, starts a top-up (`Budget.top_up`) as a task, so the
  store's round trip overlaps the stream instead of delaying a chunk;
- when the stream comes within a couple of events of what is reserved while that top-up is
  still out, waits for it (the one case that can delay a chunk: a store slower than the last
  quarter of a reservation takes to stream);
- when a top-up was refused (no room left in a window), lets the stream run to what it holds
  and ends it a couple of events short of the line: `QuotaEnded`, which the relay sends as the
  final error event. What the stream produced is charged exactly at settle.
A network chunk whose events may reach the next check (bounded from above by its blank lines,
`proxy.protocol.sse.events_at_most`: a `bytes.count` or three per chunk) is cut into its events
by the tap's own SSE framing (LF, CRLF or CR line ends alike), forwarded and checked one at a
time, so a chunk that bunches many events (a fast upstream, a busy proxy) cannot carry the
stream past its reservation; from the first top-up on, every chunk is. Other chunks go whole,
as any stream's. A top-up the store fails to answer under `store.on_error: fail_closed` ends
the stream the same way, as the store outage it is (`StoreFailed`, `service_unavailable`).
Between checks nothing runs per chunk but that bound and one integer comparison in the relay:
the next check is placed, from the tokens per event seen so far, at half the distance to the
next threshold.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable

from proxy.budget import estimate as est
from proxy.budget import refusals
from proxy.budget.accounting import Budget, Reservation
from proxy.budget.refusals import QuotaEnded
from proxy.budget.store import TopUpResult
from proxy.config.policy import Policy
from proxy.errors import ServiceUnavailable
from proxy.protocol.translators import Translator

NEVER = sys.maxsize


class StoreFailed(ServiceUnavailable):
    """The error event that ends a stream under `admission: estimate` whose top-up the store
    failed to answer while `store.on_error` is `fail_closed`: OpenAI's shape, type
    `server_error`, code and error class `service_unavailable` (status 200, as it streamed)."""


class TopUps:
    __slots__ = (
        "_budget",
        "_burst",
        "_cap",
        "_estimate",
        "_last",
        "_policy",
        "_refused",
        "_reservation",
        "_task",
        "_translator",
        "at_boundary",
        "next_at",
        "reserved",
    )

    def __init__(self, budget: Budget, reservation: Reservation, translator: Translator,
                 policy: Policy) -> None:
        assert reservation.topup_cap is not None
        self._budget = budget
        self._reservation = reservation
        self._translator = translator
        self._policy = policy
        self._cap = reservation.topup_cap
        self._estimate = reservation.output_cap
        self._task: asyncio.Task[TopUpResult] | None = None
        self._refused: TopUpResult | None = None
        self.reserved = reservation.output_cap  # output tokens the stream holds now
        self.next_at = 1  # the content-event count at which the relay calls `check`
        self._last = (0, 0)  # (events, tokens) at the last check
        # Whether the bytes forwarded so far end between two events (the relay's tap): the
        # error event can follow only there, else the end waits for the next chunk.
        self.at_boundary: Callable[[], bool] = lambda: True
        self._burst = 0  # the most tokens one chunk brought, while checked chunk by chunk

    @staticmethod
    def for_stream(budget: Budget, reservation: Reservation, translator: Translator,
                   policy: Policy) -> TopUps | None:
        if reservation.topup_cap is None or reservation.output_cap >= reservation.topup_cap:
            return None
        return TopUps(budget, reservation, translator, policy)

    async def check(self, events: int) -> None:
        """Called when `events` content events have streamed (>= `next_at`). Raises
        `QuotaEnded` when the stream must end here."""
        tokens = self._translator.output_tokens_so_far()
        if self.next_at == self._last[0] + 1:  # checked chunk by chunk: this chunk's tokens
            self._burst = max(self._burst, tokens - self._last[1])
        self._last = (events, tokens)
        rate = tokens / events if events else 1.0  # tokens per content event so far
        # A check lands within an event or so of where it aimed, a chunk at most.
        slack = max(int(2 * rate) + 2, 2 * self._burst)
        task = self._task
        if task is not None and (task.done() or tokens >= self.reserved - slack):
            self._task = None
            self._apply(await task)
        if self._refused is not None and tokens >= self.reserved - slack and self.at_boundary():
            self._end(tokens)
        if (self._task is None and self._refused is None and self.reserved < self._cap
                and tokens >= self.reserved * 3 // 4):
            step = est.step(self._estimate, self._cap - self.reserved)
            self._task = asyncio.ensure_future(
                self._budget.top_up(self._reservation, step, self._policy))
        if self._task is not None or self._refused is not None:
            self.next_at = events + 1
        elif self._refused is None and self.reserved >= self._cap:
            self.next_at = NEVER  # the upstream stops at the cap itself
        else:
            target = self.reserved * 3 // 4
            self.next_at = events + max(1, int((target - tokens) / max(rate, 1e-3) / 2))

    def _apply(self, result: TopUpResult) -> None:
        user = self._reservation.user
        if result.granted:
            self.reserved += result.granted
            self._budget.metrics.budget_topped_up(user, "granted", result.granted)
            return
        self._refused = result
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
        task, self._task = self._task, None
        if task is not None:
            self._apply(await task)


__all__ = ["QuotaEnded", "StoreFailed", "TopUps"]
