"""Whether the budget store answers: one owner of that fact, its gauge and its log lines.

A failed operation marks the store down; a probe (once a second, and every /readyz) or a later
success marks it up. While it is down, requests do not wait on it: the policy decides admission
at once (but for one request at a time, which tries the store) and settlements go to the spool,
so a stalled store costs one request at a time one timeout instead of every request two. The log
says so once when the store goes down, then once every `SUMMARY_S` with what happened meanwhile,
and once when it is back: an hour's outage at 1,000 requests a second is a handful of lines.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

from proxy.budget.store import StoreError
from proxy.telemetry.metrics import Metrics

log = logging.getLogger("tokenmeter.budget")

SUMMARY_S = 30.0
TRIAL_EVERY_S = 1.0


class StoreHealth:
    def __init__(self, metrics: Metrics, clock: Callable[[], float] = time.monotonic) -> None:
        self._metrics = metrics
        self._clock = clock
        self.up = True
        self._down_since = 0.0
        self._last_summary = 0.0
        self._trial = False
        self._failed_at = 0.0
        self.trial_every_s = TRIAL_EVERY_S
        self._errors: Counter[str] = Counter()
        self._skipped: Counter[str] = Counter()

    def failed(self, op: str, exc: StoreError) -> None:
        self._metrics.store_failed(op)
        self._failed_at = self._clock()
        if self.up:
            self.up = False
            self._down_since = self._last_summary = self._clock()
            log.error("budget store unreachable (%s failed: %s); until it answers again, "
                      "requests skip it and their usage is kept in the local spool", op, exc)
        else:
            self._errors[op] += 1

    def ok(self, op: str, started: float | None = None) -> None:
        self._metrics.store_answered(
            op, None if started is None else time.perf_counter() - started
        )
        if not self.up:
            self.up = True
            log.warning("budget store answers again after %.1f s%s", self._clock()
                        - self._down_since, self._summary_words())
            self._errors.clear()
            self._skipped.clear()

    def begin_trial(self) -> bool:
        """While the store is down, may this request try it? One at a time and at most once
        per `trial_every_s` after the last failure (a half-open circuit, beside the probe),
        so the others, and a client sending one request after another, do not each wait out
        a timeout. The caller that got True calls `end_trial`."""
        if self._trial or self._clock() - self._failed_at < self.trial_every_s:
            return False
        self._trial = True
        return True

    def end_trial(self) -> None:
        self._trial = False

    def skipped(self, what: str) -> None:
        """A request that went on without the store: 'admitted', 'refused' or 'spooled'."""
        self._skipped[what] += 1

    def tick(self, final: bool = False) -> None:
        """Called once a second: while down, a summary line every SUMMARY_S (and a last one
        at shutdown, `final`, so nothing said meanwhile is lost)."""
        if self.up:
            return
        now = self._clock()
        if final or now - self._last_summary >= SUMMARY_S:
            self._last_summary = now
            log.error("budget store still unreachable after %.0f s%s", now - self._down_since,
                      self._summary_words())
            self._errors.clear()
            self._skipped.clear()

    def _summary_words(self) -> str:
        parts = [f"{n} requests {what}" for what, n in sorted(self._skipped.items())]
        parts += [f"{n} more {op} failures" for op, n in sorted(self._errors.items())]
        return (" (meanwhile: " + ", ".join(parts) + ")") if parts else ""
