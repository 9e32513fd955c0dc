"""The ledger's face to the proxy: `record` a row at settle, `start`, `flush`, `stop`, `health`.

`record` is one `os.write` to the local spool and never raises: a broken ledger never fails a
request, it is loud instead (an error log once per episode, `tokenmeter_ledger_*` metrics,
`health()` for /readyz). The shipper task moves rows to the database in the background; a
database that is down when the proxy starts does not delay the start: rows wait in the spool.

Durability: a row whose `record` returned survives a SIGKILL of the process (the OS holds it;
the next start, or another replica sharing the spool directory, adopts and ships it). A power
loss may lose the last rows not yet in the database: there is no fsync per row, by design (it
would cost every request a disk flush).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from proxy.budget.spool import default_dir
from proxy.config.ledger import LedgerConfig
from proxy.ledger.row import LedgerRow
from proxy.ledger.shipper import BACKOFF_MAX_S, Shipper, Sink
from proxy.ledger.sink_postgres import PostgresSink
from proxy.ledger.sink_sqlite import SqliteSink
from proxy.ledger.spool import RowSpool, Segment, encode_row
from proxy.telemetry.metrics import LedgerStage, Metrics

log = logging.getLogger("tokenmeter.ledger")

MIB = 1024 * 1024
# How long `start` waits for the first connection attempt, so /readyz is right from the first
# request in the usual case; a slow or absent database is left to the shipper.
START_WAIT_S = 2.0
SQLITE_FILE = "ledger.sqlite3"


@dataclass(frozen=True, slots=True)
class LedgerHealth:
    ok: bool  # False: the database is unreachable/failing, or rows are being dropped
    detail: str  # one line for /readyz, no secrets (no password from the URL)
    pending_rows: int  # rows in the spool not yet in the database


class Ledger:
    def __init__(self, config: LedgerConfig, metrics: Metrics, *, state_dir: Path | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        state = state_dir if state_dir is not None else default_dir()
        self.replica: str = config.replica_id or f"{socket.gethostname()}-{os.getpid()}"
        sink: Sink
        if config.url is not None and config.dialect == "postgresql":
            sink = PostgresSink(config.url)
        elif config.url is not None:
            sink = SqliteSink(Path(config.url.removeprefix("sqlite://")))
        else:
            sink = SqliteSink(state / SQLITE_FILE)
        self.location: str = sink.location
        spool_dir = Path(config.spool_dir) if config.spool_dir else state
        self._spool = RowSpool(spool_dir, int(config.spool_max_mb * MIB))
        self._metrics = metrics
        self._shipper = Shipper(self._spool, sink, metrics, config, clock=clock)
        self._rows = self._shipper.rows  # set on every row: wakes an idle shipper
        self._task: asyncio.Task[None] | None = None
        self._dropped = 0  # rows dropped in the current episode (since the last row spooled)
        self._drop_reason = ""

    @property
    def spool_dir(self) -> Path:
        return self._spool.directory

    # --- settle's path ----------------------------------------------------------------------
    def record(self, row: LedgerRow) -> None:
        """Append the row to the spool: one write, no waiting on any database. Never raises."""
        try:
            if self._spool.append(encode_row(row)):
                if not self._rows.is_set():
                    self._rows.set()
                if self._dropped:
                    self._recovered()
                return
            reason = (f"the spool is full ({self._spool.pending_bytes / MIB:.1f} MB waiting, "
                      f"ledger.spool_max_mb {self._spool.max_bytes / MIB:g})")
        except Exception as exc:
            self._metrics.ledger_failed(LedgerStage.SPOOL)
            reason = f"cannot write the spool in {self._spool.directory} ({exc})"
        self._metrics.ledger_dropped(1)
        self._dropped += 1
        if self._dropped == 1:
            self._drop_reason = reason
            log.error("ledger: dropping rows: %s; request %s has no row", reason,
                      getattr(row, "request_id", "?"))

    def _recovered(self) -> None:
        log.warning("ledger: rows are spooled again; %d were dropped", self._dropped)
        self._dropped = 0

    # --- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        """Adopt what a previous run left, then ship in the background. Never raises."""
        if self._task is not None:
            return
        try:
            found = await asyncio.to_thread(self._spool.scan_dead)
            rows = self._spool.take(found)
            if rows:
                log.warning("ledger: %d rows a previous run left in %s will be stored", rows,
                            self._spool.directory)
        except Exception as exc:
            self._metrics.ledger_failed(LedgerStage.SPOOL)
            log.error("ledger: cannot read the spool %s: %s", self._spool.directory, exc)
        self._task = asyncio.create_task(self._shipper.run(), name="tokenmeter-ledger-shipper")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(START_WAIT_S):
                await self._shipper.attempted.wait()

    async def flush(self, timeout_s: float) -> bool:
        """Store everything recorded so far; True when it all is (within `timeout_s`)."""
        marks = self._spool.marks()
        progress = self._shipper.progress
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            progress.clear()  # cleared before looking: a batch stored after the look wakes us
            if _reached(marks):
                return True
            remaining = deadline - asyncio.get_running_loop().time()
            if self._task is None or self._task.done() or remaining <= 0:
                return False
            self._shipper.kick()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await progress.wait()

    async def stop(self, drain_s: float) -> None:
        """Ship what is left within `drain_s`, then close; rows not stored stay in the spool
        for the next start."""
        stored = await self.flush(drain_s) if self._task is not None else False
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        sink = self._shipper.sink
        try:
            async with asyncio.timeout(BACKOFF_MAX_S):
                await sink.close()
        except Exception as exc:
            log.debug("ledger: closing %s: %s", self.location, exc)
        sink.shutdown()
        left = self._spool.close()
        if left:
            log.warning("ledger: %d rows not yet stored in %s stay in the spool %s for the next "
                        "start", left, self.location, self._spool.directory)
        elif stored:
            log.info("ledger: every row stored in %s", self.location)

    async def prune(self) -> int:
        """Delete rows past `retention_days` now, slice by slice (the shipper also does this
        at start and hourly). The rows deleted."""
        total = 0
        while True:
            deleted = await self._shipper.prune_slice()
            total += deleted
            if deleted == 0:
                return total

    # --- health -----------------------------------------------------------------------------
    def health(self) -> LedgerHealth:
        pending = self._spool.pending_rows
        shipper = self._shipper
        if self._spool.dropping:
            return LedgerHealth(False, f"rows are being dropped: {self._drop_reason}", pending)
        if shipper.too_new is not None:
            return LedgerHealth(False, str(shipper.too_new), pending)
        if shipper.down_since is not None:
            down = time.monotonic() - shipper.down_since
            return LedgerHealth(False, f"{self.location} failing for {down:.0f} s "
                                f"({shipper.error}); {pending} rows wait in the spool", pending)
        if self._task is None:
            return LedgerHealth(False, f"not started; {pending} rows in the spool", pending)
        if not shipper.ever_connected:
            return LedgerHealth(False, f"connecting to {self.location}; {pending} rows wait",
                                pending)
        return LedgerHealth(True, f"{self.location}; {pending} rows waiting", pending)


def _reached(marks: list[tuple[Segment, int]]) -> bool:
    return all(seg.gone or seg.start >= mark for seg, mark in marks)


def make_ledger(config: LedgerConfig, metrics: Metrics, *, state_dir: Path | None = None,
                clock: Callable[[], float] = time.time) -> Ledger | None:
    """The ledger `config` asks for; None when it is off."""
    if not config.enabled:
        return None
    return Ledger(config, metrics, state_dir=state_dir, clock=clock)
