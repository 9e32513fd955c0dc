"""The proxy reconciling its own books: `tokenmeter reconcile`, run every
`ledger.reconcile_every_s` inside the proxy, so drift and orphans reach Prometheus (and the
`TokenmeterReconcileDrift` / `TokenmeterReconcileOrphans` alerts) without a cron job.

Each reading is judged against the one before (as the CLI's `--recheck` does; see
`proxy.ledger.reconcile`): the ledger trails the store by the shipper's lag, and one reading
cannot tell lag from loss. Nothing is exported before a second reading of the day.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import datetime
from zoneinfo import ZoneInfo

from proxy.budget.store import Store, StoreError
from proxy.config.load import Config
from proxy.ledger.query import LedgerReader, LedgerUnavailable, locate, open_reader
from proxy.ledger.reconcile import Reconciliation, reconcile
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
        """One reading, exported; None when the store or the ledger cannot be read now."""
        try:
            if self._reader is None:
                self._reader = await open_reader(locate(config.ledger))
            day = datetime.fromtimestamp(self._clock(), ZoneInfo(config.timezone)).date()
            previous = self._previous if self._previous and self._previous.day == day \
                else None
            judged = await reconcile(config, self._store, self._reader, day, earlier=previous)
        except (StoreError, LedgerUnavailable, OSError) as exc:
            log.warning("reconcile skipped: %s", exc)
            return None
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
            try:
                await self.once(config())
            except Exception:
                # The audit must outlive its own bugs: the next round runs anyway. Loud.
                log.exception("reconcile failed")

    async def close(self) -> None:
        if self._reader is not None:
            await self._reader.close()
            self._reader = None
