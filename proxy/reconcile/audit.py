"""The proxy reconciling its own books: `tokenmeter reconcile`, run every
`ledger.reconcile_every_s` inside the proxy, so drift and orphans reach Prometheus (and the
`TokenmeterReconcileDrift` / `TokenmeterReconcileOrphans` alerts) without a cron job.

Each reading is judged against the one before (as the CLI's `--recheck` does; see
`proxy.reconcile.plan`): the ledger trails the store by the shipper's lag, and one reading
cannot tell lag from loss. Nothing is exported before a second reading of the day.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from datetime import datetime
from zoneinfo import ZoneInfo

from proxy.budget.store import Store, StoreError
from proxy.config.load import Config
from proxy.ledger.query import LedgerReader, LedgerUnavailable, locate, open_reader
from proxy.reconcile.plan import Reconciliation, reconcile
from proxy.telemetry.families import ReconcileFailure
from proxy.telemetry.metrics import Metrics

log = logging.getLogger("tokenmeter.reconcile")


class Auditor:
    """Owns the previous reading and the ledger reader; one per app."""

    def __init__(self, store: Store, metrics: Metrics,
                 clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self._metrics = metrics
        self._clock = clock
        self._reader: LedgerReader | None = None
        self._previous: Reconciliation | None = None

    async def once(self, config: Config) -> Reconciliation | None:
        """One reading, exported; None when the store or the ledger cannot be read now (or a
        bug of ours stopped it): counted by reason in `tokenmeter_reconcile_failures_total`,
        whose alert watches that the audit goes on. After any failure the ledger's reader is
        closed and the next reading opens a new one: a database that restarted (its
        connections closed) or a ledger file replaced does not blind the audit for good."""
        try:
            return await self._once(config)
        except StoreError as exc:
            self._failed(ReconcileFailure.STORE)
            log.warning("reconcile skipped: cannot read the store: %s", exc)
        except (LedgerUnavailable, OSError) as exc:
            self._failed(ReconcileFailure.LEDGER)
            log.warning("reconcile skipped: cannot read the ledger: %s", exc)
        except Exception:
            # The audit must outlive its own bugs: the next round runs anyway. Loud.
            self._failed(ReconcileFailure.INTERNAL)
            log.exception("reconcile failed")
        await self.close()
        return None

    def _failed(self, reason: ReconcileFailure) -> None:
        self._metrics.reconcile_failed(reason)

    async def _once(self, config: Config) -> Reconciliation:
        if self._reader is None:
            self._reader = await open_reader(locate(config.ledger))
        day = datetime.fromtimestamp(self._clock(), ZoneInfo(config.timezone)).date()
        previous = self._previous if self._previous and self._previous.day == day else None
        judged = await reconcile(config, self._store, self._reader, day, earlier=previous)
        self._previous = judged  # its figures are the reading's own, whatever its verdicts
        if previous is None:
            return judged
        self._metrics.reconciled(judged.drift_by_window(), len(judged.orphans))
        if not judged.agrees:
            log.error("the ledger and the store disagree beyond requests in flight: %s",
                      judged.drift_by_window())
        return judged

    async def run(self, config: Callable[[], Config]) -> None:
        while True:
            every = config().ledger.reconcile_every_s or 60.0  # 0: off (checked at start)
            await asyncio.sleep(every)
            await self.once(config())

    async def close(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            with contextlib.suppress(Exception):  # a broken connection: nothing to wait for
                await reader.close()
