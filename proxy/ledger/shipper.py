"""The shipper: the loop moving spooled rows into the ledger database, in the shipper process
(proxy.ledger.shipper_process), one per spool directory.

It takes the spool's oldest waiting rows (up to `batch_rows`, whatever is there: it never waits
for a batch to fill), stores them in one transaction, and only then moves the spool's cursor.
Big reads are parsed in a worker thread and SQLite runs on a thread of its own, so its event
loop never waits on a file or the database.

Pacing: the directory is looked at every SCAN_S (what the writers appended; writers that are
gone, whose files are adopted). A batch costs a few thread hops and a commit whatever its size,
so once the shipper has caught up it lets rows gather for `SHIP_INTERVAL_S` before the next
batch (a flush or a drain cuts that short): at most four batches a second below saturation,
back to back when behind.

While the database is down or failing, rows wait in the spool; the shipper retries with a
backoff capped at `BACKOFF_MAX_S`, says so once per outage (an error log, then a warning when it
is back), counts every failed attempt in `tokenmeter_ledger_errors`, and `health` reports it.
A batch the database refuses for its content (not its connection) is split in halves until the
offending rows are found; those are dropped, loudly, so one bad row cannot stop the books.

Retention runs here too, between batches: a slice of at most `PRUNE_SLICE` rows per
transaction, at start and then hourly, so writers never wait on a long delete.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from proxy.config.ledger import LedgerConfig
from proxy.ledger.migrate import SchemaTooNew
from proxy.ledger.spool import Batch, RowSpool, read_batch, read_size
from proxy.telemetry.families import LedgerStage
from proxy.telemetry.verbs import LedgerMetrics

log = logging.getLogger("tokenmeter.ledger")

BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 5.0
# Once caught up, how long rows gather before the next batch: the latency into the database,
# against the per-batch cost (here about 1.5 ms of CPU with SQLite whatever the batch's size).
SHIP_INTERVAL_S = 0.25
# Reads up to this size are parsed on the loop (well under a millisecond); bigger in a thread.
INLINE_READ_BYTES = 64 * 1024
PUBLISH_EVERY_S = 1.0  # the spool gauges, when nothing else moves them
PING_EVERY_S = 10.0  # an idle shipper still notices a database gone, for /readyz
# How often the spool directory is looked at: rows the writers appended, segments they closed,
# writers that are gone (a listdir, a stat per live segment: tens of microseconds). The
# latency of a row into the database is this plus SHIP_INTERVAL_S at most.
SCAN_S = 0.25
PRUNE_SLICE = 5000
PRUNE_EVERY_S = 3600.0
PRUNE_RETRY_S = 300.0


class Sink(Protocol):
    """A ledger database (proxy.ledger.sink_sqlite, proxy.ledger.sink_postgres)."""

    name: str  # the metric label: sqlite or postgresql
    location: str  # for logs: no password

    @property
    def connected(self) -> bool: ...

    async def open(self) -> None:
        """Connect and migrate; raises when it cannot."""

    @staticmethod
    def prepare(values: list[Any]) -> tuple[Any, ...]:
        """A spool line's values as this database takes them (maybe in a worker thread)."""

    def is_poison(self, exc: BaseException) -> bool:
        """`exc` came from the rows themselves: retrying the same rows cannot help."""

    async def write(self, records: list[tuple[Any, ...]]) -> int:
        """Store in one transaction, a request id once; the rows newly stored."""

    async def prune(self, cutoff: float, limit: int) -> int:
        """Delete at most `limit` rows started before `cutoff` (epoch seconds)."""

    async def ping(self) -> None: ...

    async def close(self) -> None: ...

    def shutdown(self) -> None: ...


class Shipper:
    def __init__(self, spool: RowSpool, sink: Sink, metrics: LedgerMetrics, config: LedgerConfig, *,
                 clock: Callable[[], float]) -> None:
        """`config`: its batch_rows and retention_days."""
        self.spool = spool
        self.sink = sink
        self._metrics = metrics
        self._batch_rows = config.batch_rows
        self._retention_s = config.retention_days * 86400.0
        self._clock = clock
        self.progress = asyncio.Event()  # set after every batch stored or skipped
        self.attempted = asyncio.Event()  # the first connection attempt is over
        self.rows = asyncio.Event()  # set by a kick: look now
        self._kick = asyncio.Event()
        self._lock = asyncio.Lock()  # one statement at a time on the connection
        self._batch: Batch | None = None
        self._batch_start = -1
        # The outage: since when (monotonic), what failed; None when the last attempt worked.
        self.down_since: float | None = None
        self.error = ""
        self.too_new: SchemaTooNew | None = None
        self.ever_connected = False
        self._failures = 0
        self._next_prune = time.monotonic()  # at start
        self._pruned = 0
        self._next_ping = 0.0
        self._next_scan = 0.0
        self.live_writers = 0  # writers holding their lock at the last scan
        self._scanned_at = -1.0  # when the last scan that ended began (monotonic)
        self._next_publish = 0.0

    def kick(self) -> None:
        """Ship now (a flush, a drain): out of an idle wait, the pacing, or a backoff."""
        self._kick.set()
        self.rows.set()

    # --- the loop ---------------------------------------------------------------------------
    async def run(self) -> None:
        backoff = BACKOFF_MIN_S
        while True:
            stage = LedgerStage.SPOOL
            try:
                if time.monotonic() >= self._next_scan or self.rows.is_set():
                    self.rows.clear()
                    await self.scan()
                batch = await self._head_batch()
                self._publish(force=False)
                stage = LedgerStage.SHIP
                if not self.sink.connected:
                    stage = LedgerStage.CONNECT
                    await self._connect()
                    stage = LedgerStage.SHIP
                if batch is not None:
                    began = time.monotonic()
                    await self._ship(batch)
                    backoff = BACKOFF_MIN_S
                    await self._maybe_prune()
                    if self.spool.pending_rows < self._batch_rows:  # caught up: let rows gather
                        await self._pause(SHIP_INTERVAL_S - (time.monotonic() - began))
                    continue
                await self._maybe_prune()
                if time.monotonic() >= self._next_ping:
                    async with self._lock:
                        await self.sink.ping()
                    self._metrics.ledger_connected()
                    self._next_ping = time.monotonic() + PING_EVERY_S
                self._back()
                backoff = BACKOFF_MIN_S
                await _wait(self.rows, SCAN_S)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._failed(stage, exc)
                if stage is not LedgerStage.SPOOL:  # the connection may be broken: a new one
                    with contextlib.suppress(Exception):
                        async with self._lock:
                            await self.sink.close()
                self._publish(force=True)
                await self._pause(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)

    async def _pause(self, seconds: float) -> None:
        """Wait `seconds` unless kicked (new rows do not cut it short)."""
        if seconds > 0:
            await _wait(self._kick, seconds)
        self._kick.clear()

    async def _connect(self) -> None:
        try:
            async with self._lock:
                await self.sink.open()
        finally:
            self.attempted.set()
        self.ever_connected = True
        self._metrics.ledger_connected()
        self.too_new = None
        self._next_ping = time.monotonic() + PING_EVERY_S

    def scanned_after(self, moment: float) -> bool:
        """Whether a scan began after `moment` (monotonic) and is over."""
        return self._scanned_at > moment

    async def scan(self) -> None:
        """Look at the spool directory: what the writers appended, and adopt the files of
        those that are gone."""
        began = time.monotonic()
        self._next_scan = began + SCAN_S
        try:
            found = await asyncio.to_thread(self.spool.scan, self.spool.known())
        except OSError as exc:
            self._metrics.ledger_failed(LedgerStage.SPOOL)
            log.error("ledger: cannot scan the spool %s: %s", self.spool.directory, exc)
            return
        self.live_writers = found.live_owners
        rows = self.spool.take(found)
        self._scanned_at = began
        if rows:
            # Routine since shipping left the serving process: a writer that stopped (a clean
            # shutdown, a worker restarted) leaves its last rows for the shipper. Not a loss, so
            # not a warning; a crash is reported where it happens (the supervisor's restart).
            log.info("ledger: took over %d rows from the spool files of a process that has "
                     "exited, in %s", rows, self.spool.directory)

    async def _head_batch(self) -> Batch | None:
        """The oldest rows waiting, read once and kept until stored (a retry sends the same)."""
        batch = self._batch
        if batch is not None and not batch.segment.gone \
                and batch.segment.start == self._batch_start:
            return batch
        self._batch = None
        seg = self.spool.head()
        if seg is None:
            return None
        try:
            if min(seg.end - seg.start, read_size(self._batch_rows)) <= INLINE_READ_BYTES:
                batch = read_batch(seg, seg.end, self._batch_rows, self.sink.prepare)
            else:
                batch = await asyncio.to_thread(read_batch, seg, seg.end, self._batch_rows,
                                                self.sink.prepare)
        except FileNotFoundError:
            # Someone removed the file under us: its rows are gone; say so, and go on.
            lost = seg.rows
            self._metrics.ledger_failed(LedgerStage.SPOOL)
            self._metrics.ledger_dropped(lost)
            log.error("ledger: spool file %s vanished with %d rows not yet stored", seg.path, lost)
            self.spool.forget(seg)
            self.progress.set()
            return None
        self._batch = batch
        self._batch_start = seg.start
        return batch

    async def _ship(self, batch: Batch) -> None:
        poisoned = 0
        if batch.records:
            _, poisoned = await self._store(batch.records)
        self._back()
        self._batch = None
        # A torn tail is one row; one this process already counted (a short write) is not
        # counted again. Counted before the cursor moves: whoever sees it moved sees the count.
        lost = batch.bad + poisoned + (1 if batch.torn and not batch.torn_counted else 0)
        if lost:
            self._metrics.ledger_dropped(lost)
            log.error("ledger: dropped %d rows of %s (%d unreadable lines, %d refused by the "
                      "database, %d bytes of a row cut by a crash)", lost, batch.segment.path,
                      batch.bad, poisoned, batch.torn)
        self.spool.advance(batch)
        self.progress.set()

    async def _store(self, records: list[tuple[Any, ...]]) -> tuple[int, int]:
        """(rows stored, rows dropped as poison)."""
        started = time.perf_counter()
        try:
            async with self._lock:
                stored = await self.sink.write(records)
        except Exception as exc:
            if not self.sink.is_poison(exc):
                raise
            if len(records) == 1:
                self._metrics.ledger_failed(LedgerStage.ROW)
                log.error("ledger: the database refuses a row (%s: %s); dropping it",
                          type(exc).__name__, _one_line(exc))
                return 0, 1
            mid = len(records) // 2
            a = await self._store(records[:mid])
            b = await self._store(records[mid:])
            return a[0] + b[0], a[1] + b[1]
        self._metrics.ledger_stored(self.sink.name, stored, time.perf_counter() - started)
        return stored, 0

    # --- retention --------------------------------------------------------------------------
    async def _maybe_prune(self) -> None:
        if time.monotonic() < self._next_prune:
            return
        try:
            await self.prune_slice()
        except Exception as exc:
            self._metrics.ledger_failed(LedgerStage.RETENTION)
            log.error("ledger: retention failed (%s: %s); next try in %d s",
                      type(exc).__name__, _one_line(exc), PRUNE_RETRY_S)
            self._next_prune = time.monotonic() + PRUNE_RETRY_S

    async def prune_slice(self) -> int:
        """Delete one slice of rows past retention; when it was the last, the next run is due
        in an hour. The rows deleted."""
        cutoff = self._clock() - self._retention_s
        async with self._lock:
            deleted = await self.sink.prune(cutoff, PRUNE_SLICE)
        self._pruned += deleted
        if deleted < PRUNE_SLICE:
            if self._pruned:
                log.info("ledger: deleted %d rows older than %d days", self._pruned,
                         self._retention_s // 86400)
            self._pruned = 0
            self._next_prune = time.monotonic() + PRUNE_EVERY_S
        return deleted

    # --- health and metrics -----------------------------------------------------------------
    def _failed(self, stage: LedgerStage, exc: BaseException) -> None:
        self._metrics.ledger_failed(stage)
        self._failures += 1
        self.error = f"{type(exc).__name__}: {_one_line(exc)}" if str(exc) \
            else type(exc).__name__
        if isinstance(exc, SchemaTooNew):
            self.too_new = exc
        if self.down_since is None:
            self.down_since = time.monotonic()
            log.error("ledger: %s to %s failed (%s); rows wait in the spool %s, retrying "
                      "every %.0f s at most", stage.value, self.sink.location, self.error,
                      self.spool.directory, BACKOFF_MAX_S)
        else:
            log.debug("ledger: %s still failing: %s", stage.value, self.error)

    def _back(self) -> None:
        if self.down_since is not None:
            log.warning("ledger: %s works again after %.1f s and %d failed attempts; %d rows "
                        "waiting in the spool", self.sink.location,
                        time.monotonic() - self.down_since, self._failures,
                        self.spool.pending_rows)
            self.down_since = None
            self._failures = 0
            self.error = ""

    def lag_s(self) -> float:
        """Age of the oldest row waiting (0: none), from the head batch's rows."""
        batch = self._batch
        if self.spool.pending_rows <= 0 or batch is None or batch.oldest_ended_at is None:
            return 0.0
        return max(0.0, self._clock() - batch.oldest_ended_at)

    def _publish(self, *, force: bool) -> None:
        now = time.monotonic()
        if force or now >= self._next_publish:
            self._next_publish = now + PUBLISH_EVERY_S
            self._metrics.ledger_pending(self.spool.pending_rows, self.spool.pending_bytes,
                                         self.lag_s())


async def _wait(event: asyncio.Event, seconds: float) -> None:
    if not event.is_set():
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await event.wait()


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]
