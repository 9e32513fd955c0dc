"""The ledger's face to the serving process: `record` a row at settle, `start`, `flush`, `stop`,
`health`.

`record` queues the row's line; once per turn of the event loop (`loop.call_soon`) every line
queued in that turn goes to the local spool in one `os.write`. Settle runs before the answer's
last bytes are sent (a JSON answer waits for it; a stream's end is written after it), and the
write is the next callback the loop runs, ahead of the handler's own continuation: a row is in
the OS's hands before its answer's last bytes. A broken ledger never fails a request: it is
loud instead (an error log once per episode, `tokenmeter_ledger_*` metrics, `health()` for
/readyz).

The database work is not here: a shipper process (proxy.ledger.shipper_process) follows the
spool files and moves their rows into the database. `start` starts it as a child of this
process (and starts it again if it dies) unless a supervisor runs one for several workers
(`ship=False`). Durability: a row whose write was made survives a SIGKILL of this process or
of the shipper (the OS holds it; the shipper, restarted, ships it). A power loss may lose the
last rows not yet in the database: there is no fsync per row, by design.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from proxy.config.ledger import LedgerConfig
from proxy.ledger.row import LedgerRow
from proxy.ledger.shipper_process import (
    MULTIPROC_ENV,
    ShipperChild,
    ShipperSpec,
    make_sink,
    read_status,
)
from proxy.ledger.spool import SpoolWriter, encode_row, reached
from proxy.storage import urls
from proxy.telemetry.families import LedgerStage
from proxy.telemetry.metrics import Metrics

log = logging.getLogger("tokenmeter.ledger")

MIB = 1024 * 1024
# How long `start` waits for the shipper's first word, so /readyz is right from the first
# request in the usual case; a slow or absent database is left to the shipper.
START_WAIT_S = 10.0
FLUSH_POLL_S = 0.02  # how often `flush` looks at the shipper's cursors
STOP_GRACE_S = 15.0  # past `drain_s`, how long the shipper may take to exit before it is killed


@dataclass(frozen=True, slots=True)
class Shipping:
    """How the shipper process runs: how long it drains at a stop, and the config's
    `timezone`, whose local days it keeps a rollup of (`proxy.ledger.rollup.USAGE_LOCAL`)."""

    drain_s: float = 30.0
    zone: str = "UTC"


@dataclass(frozen=True, slots=True)
class LedgerHealth:
    ok: bool  # False: the database is unreachable/failing, or rows are being dropped
    detail: str  # one line for /readyz, no secrets (no password from the URL)
    pending_rows: int  # rows in the spool not yet in the database


class Ledger:
    def __init__(self, config: LedgerConfig, metrics: Metrics, *, state_dir: Path | None = None,
                 ship: bool = True, shipping: Shipping = Shipping()) -> None:
        """`ship`: start (and keep) a shipper process of our own; False when a supervisor runs
        the one for all its workers."""
        state = state_dir if state_dir is not None else urls.state_dir()
        self.replica: str = config.replica_id or f"{socket.gethostname()}-{os.getpid()}"
        self.location: str = make_sink(config, state).location
        self._spec = ShipperSpec.of(config, state, shipping.drain_s, shipping.zone)
        self._writer = SpoolWriter(self._spec.spool_dir, int(config.spool_max_mb * MIB))
        self._metrics = metrics
        self._ship = ship
        self._child: ShipperChild | None = None
        self._metrics_dir: str | None = None
        self._queued: list[bytes] = []
        self._then: list[Callable[[], None]] = []  # to run after the queued rows' write
        self._first_id = ""  # of the first row queued: named when they are dropped
        self._dropped = 0  # rows dropped in the current episode (since the last row spooled)
        self._drop_reason = ""

    @property
    def spool_dir(self) -> Path:
        return self._writer.directory

    @property
    def shipper_pid(self) -> int | None:
        return None if self._child is None else self._child.pid

    # --- settle's path ----------------------------------------------------------------------
    def record(self, row: LedgerRow, then: Callable[[], None] | None = None) -> None:
        """Queue the row for this loop turn's one write to the spool. Never raises. `then`
        runs once that write is over (the row is in the OS's hands, or was dropped and
        counted): a stream's final event waits for it (proxy.pipeline.ending)."""
        queued = self._queued
        queued.append(encode_row(row))
        if then is not None:
            self._then.append(then)
        if len(queued) == 1:
            self._first_id = row.request_id
            try:
                asyncio.get_running_loop().call_soon(self._write)
            except RuntimeError:  # no loop (a tool, a test): at once
                self._write()

    def _write(self) -> None:
        queued = self._queued
        if not queued:
            return
        self._queued = []
        thens, self._then = self._then, []
        try:
            self._spool(queued)
        finally:
            for then in thens:
                then()

    def _spool(self, queued: list[bytes]) -> None:
        try:
            if self._writer.append(b"".join(queued)):
                if self._dropped:
                    self._recovered()
                return
            reason = (f"the spool is full ({self._writer.pending_bytes / MIB:.1f} MB waiting, "
                      f"ledger.spool_max_mb {self._writer.max_bytes / MIB:g})")
        except Exception as exc:
            self._metrics.ledger_failed(LedgerStage.SPOOL)
            reason = f"cannot write the spool in {self._writer.directory} ({exc})"
        self._metrics.ledger_dropped(len(queued))
        first = self._dropped == 0
        self._dropped += len(queued)
        if first:
            self._drop_reason = reason
            log.error("ledger: dropping rows: %s; request %s has no row", reason,
                      self._first_id)

    def _recovered(self) -> None:
        log.warning("ledger: rows are spooled again; %d were dropped", self._dropped)
        self._dropped = 0

    # --- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        """Start our shipper process (`ship`), and wait a little for its first word. Never
        raises: without a shipper, rows wait in the spool."""
        if not self._ship or self._child is not None:
            return
        self._metrics_dir = tempfile.mkdtemp(prefix="tokenmeter-shipper-metrics-")
        env = {**os.environ, MULTIPROC_ENV: self._metrics_dir,
               "TOKENMETER_LOG_LEVEL": logging.getLevelName(logging.getLogger().level)}
        self._child = ShipperChild(self._spec, env, on_restart=self._shipper_died)
        try:
            await self._child.start()
        except OSError as exc:
            self._metrics.ledger_failed(LedgerStage.SHIPPER)
            log.error("ledger: cannot start the shipper process: %s; rows wait in %s", exc,
                      self.spool_dir)
            return
        self._metrics.include_shipper(self._metrics_dir)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + START_WAIT_S
        # Polled: its word is a file another process writes.
        while loop.time() < deadline and read_status(self.spool_dir, time.time()) is None:  # noqa: ASYNC110
            await asyncio.sleep(FLUSH_POLL_S * 5)

    def _shipper_died(self) -> None:
        self._metrics.ledger_failed(LedgerStage.SHIPPER)

    async def flush(self, timeout_s: float) -> bool:
        """Wait until the shipper has stored everything recorded so far; True when it has
        (within `timeout_s`)."""
        self._write()
        marks = self._writer.marks()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not reached(marks):
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(FLUSH_POLL_S)  # its cursors are files another process writes
        return True

    async def stop(self, drain_s: float) -> None:
        """Close the spool (the shipper adopts what it holds), then let our shipper ship what
        is left within `drain_s` and exit; rows not stored stay in the spool for the next
        start."""
        self._write()
        self._writer.close()
        child, self._child = self._child, None
        if child is not None:
            await child.stop(drain_s, drain_s + STOP_GRACE_S)
        self._metrics.include_shipper(None)
        if self._metrics_dir is not None:
            shutil.rmtree(self._metrics_dir, ignore_errors=True)
            self._metrics_dir = None

    # --- health -----------------------------------------------------------------------------
    def health(self) -> LedgerHealth:
        """What the shipper said last (a small file read: call it off the loop), and whether
        this process drops rows."""
        status = read_status(self.spool_dir, time.time())
        pending = status.pending_rows if status is not None else 0
        if self._writer.dropping:
            return LedgerHealth(False, f"rows are being dropped: {self._drop_reason}", pending)
        if status is None:
            return LedgerHealth(False, "the ledger shipper is not running; rows wait in the "
                                f"spool {self.spool_dir}", pending)
        return LedgerHealth(status.ok, status.detail, pending)


def make_ledger(config: LedgerConfig, metrics: Metrics, *, state_dir: Path | None = None,
                ship: bool = True, shipping: Shipping = Shipping()) -> Ledger | None:
    """The ledger `config` asks for; None when it is off."""
    if not config.enabled:
        return None
    return Ledger(config, metrics, state_dir=state_dir, ship=ship, shipping=shipping)
