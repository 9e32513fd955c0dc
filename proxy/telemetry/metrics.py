"""Prometheus metrics, one registry per app, updated only through `Metrics`' domain verbs.

The families are declared in `proxy.telemetry.families`, the verbs that update them (one class
per wing) are in `proxy.telemetry.verbs`, and the collectors and their multiprocess machinery in
`proxy.telemetry.collectors`. This module puts them together and answers /metrics.

Workers (`serve --workers N`, proxy/server/workers.py) use prometheus_client's multiprocess
mode: each worker's values live in files of its own in `PROMETHEUS_MULTIPROC_DIR`, and whichever
worker answers /metrics reads them all (`exposition`). Counters and histograms are summed; each
gauge combines as its family says. A single process (no multiprocess directory) exposes its
own registry directly.
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from proxy.telemetry.collectors import (
    REFRESH_S,
    BufferedValue,
    merged_exposition,
    multiprocess_dir,
)
from proxy.telemetry.families import (
    BudgetFamilies,
    CacheFamilies,
    CaptureFamilies,
    LatencyFamilies,
    ProcessFamilies,
    ReconcileFamilies,
    RequestFamilies,
    StoreFamilies,
    TagFamilies,
)
from proxy.telemetry.verbs import (
    BooksVerbs,
    BudgetVerbs,
    CaptureVerbs,
    LedgerMetrics,
    ProcessVerbs,
    ReconcileVerbs,
    RequestVerbs,
    StoreVerbs,
)


class Metrics(RequestVerbs, BudgetVerbs, StoreVerbs, BooksVerbs, CaptureVerbs, ReconcileVerbs,
              ProcessVerbs):
    """Every collector of one app, updated only through the verbs of its wings."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # The latency histograms are made before a worker's values are buffered, so in a
        # worker they are written through to the shared files on every observation.
        LatencyFamilies.__init__(self, r)
        self._shared_dir = multiprocess_dir()
        # A single process's shipper child keeps its figures here (`include_shipper`).
        self._shipper_dir: str | None = None
        if self._shared_dir is not None:
            BufferedValue.install()
        shared = self._shared_dir is not None
        RequestFamilies.__init__(self, r, shared)
        BudgetFamilies.__init__(self, r)
        StoreFamilies.__init__(self, r)
        ProcessFamilies.__init__(self, r, shared)
        TagFamilies.__init__(self, r)
        self.ledger = LedgerMetrics(r)
        CaptureFamilies.__init__(self, r)
        ReconcileFamilies.__init__(self, r)
        CacheFamilies.__init__(self, r)

    @property
    def shared(self) -> bool:
        """This process is one of several workers whose metrics are summed (multiprocess)."""
        return self._shared_dir is not None

    def publish(self) -> None:
        """A worker's values (callback gauges read now) written into the shared files."""
        for gauge, count in self._callbacks:
            gauge.set(count())
        if self._shared_dir is not None:
            BufferedValue.flush()

    async def keep_fresh(self) -> None:
        """A worker's loop: its values published every REFRESH_S, so a scrape answered by
        another worker sees them at most that old."""
        while True:
            self.publish()
            await asyncio.sleep(REFRESH_S)

    def exposition(self) -> bytes:
        """The text format of /metrics: this registry's, or, in a worker, every worker's series
        combined from the multiprocess files (file reads only: `publish` first, on the loop's
        thread, so this one's own figures are current)."""
        if self._shared_dir is None:
            if self._shipper_dir is not None:
                return merged_exposition(self.registry, self._shipper_dir)
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, self._shared_dir)  # type: ignore[no-untyped-call]
        return generate_latest(registry)

    @property
    def reads_files(self) -> bool:
        """`exposition` reads another process's metric files (a worker's, or a shipper's)."""
        return self._shared_dir is not None or self._shipper_dir is not None

    def include_shipper(self, directory: str | None) -> None:
        """/metrics of a single process also shows what its ledger shipper process counts in
        `directory` (prometheus_client multiprocess files); None: stop showing them."""
        self._shipper_dir = directory

