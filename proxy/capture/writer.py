"""Captures go to their store off the request path: a bounded queue and one task that makes
and writes them in batches. A request never waits on capture: `offer` only appends what settle
kept (the capture is made later, a batch at a time in one trip to a thread: a trip per request
cost more than the making), and when the queue is full it is dropped and counted
(tokenmeter_captures_dropped_total{reason="queue_full"}).
A batch the store refuses (or a store that cannot be opened) is dropped and counted too
(reason="store") and logged: captures are evidence, not books, so they are not spooled to disk
like ledger rows.

The store is opened when the first capture comes (or when retention first runs while capture is
enabled), so a replica that never captures never creates the table; a reload that enables
capture needs no restart. Retention deletes captures older than `capture.retention_days` (read
from the configuration in force) when the writer starts, then once an hour, a slice at a time:
a replica restarted more often than that still deletes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from proxy.capture.record import Capture
from proxy.telemetry.families import CaptureDrop, CaptureStage
from proxy.telemetry.metrics import Metrics

log = logging.getLogger("tokenmeter.capture")

BATCH = 64  # captures per store write
# After the first capture of a batch comes, how long the writer lets more gather: under load a
# batch fills (one thread trip and one transaction for many requests, not for each); when
# traffic is light a capture is written this much later, which nobody waits for.
LINGER_S = 0.05
RETENTION_EVERY_S = 3600.0
RETENTION_SLICE = 5000  # captures per delete: a writer waits on one slice at most


class Makes(Protocol):
    """A capture to be made (proxy.capture.collect.Pending): CPU work, run off the loop."""

    def capture(self) -> Capture: ...


class CaptureSink(Protocol):
    """Where captures are kept (proxy.capture.store.CaptureStore)."""

    async def write(self, captures: Sequence[Capture]) -> int:
        """Store `captures` (idempotent by request id); returns the bytes stored."""
        ...

    async def delete_older_than(self, cutoff: float, slice_rows: int) -> int: ...

    async def close(self) -> None: ...


class CaptureWriter:
    """The queue and its tasks: owned by the app (started and stopped by its cleanup context).
    `policy()` says, now, whether capture is enabled and how many days captures are kept."""

    def __init__(self, open_sink: Callable[[], Awaitable[CaptureSink]], metrics: Metrics,
                 queue_max: int, policy: Callable[[], tuple[bool, int]]) -> None:
        self._open_sink = open_sink
        self._metrics = metrics
        self._policy = policy
        self._queue: asyncio.Queue[Makes] = asyncio.Queue(queue_max)
        self._sink: CaptureSink | None = None
        self._tasks: list[asyncio.Task[None]] = []
        # One operation on the store at a time: the writer's batches and retention share one
        # connection (a PostgreSQL connection runs one query at a time), and retention runs at
        # start, when the first captures come too. Also opens the store once.
        self._busy = asyncio.Lock()

    def offer(self, pending: Makes) -> bool:
        """Queue `pending` for the store; False (counted) when the queue is full."""
        try:
            self._queue.put_nowait(pending)
        except asyncio.QueueFull:
            self._metrics.capture_dropped(CaptureDrop.QUEUE_FULL)
            return False
        return True

    def start(self) -> None:
        self._tasks = [asyncio.ensure_future(self._run()), asyncio.ensure_future(self._retain())]

    async def stop(self, drain_s: float) -> None:
        """What is queued is written (for at most `drain_s`), then the tasks end and the store
        is closed."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(drain_s):
                await self._queue.join()
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        async with self._busy:
            sink, self._sink = self._sink, None
        if sink is not None:
            await sink.close()

    async def _opened(self) -> CaptureSink:
        if self._sink is None:
            self._sink = await self._open_sink()
        return self._sink

    async def _run(self) -> None:
        queue = self._queue
        while True:
            batch = [await queue.get()]
            if queue.qsize() < BATCH - 1:
                await asyncio.sleep(LINGER_S)  # a batching window, not a synchronisation
            while len(batch) < BATCH and not queue.empty():
                batch.append(queue.get_nowait())
            try:
                await self._write(batch)
            finally:
                for _ in batch:
                    queue.task_done()

    async def _write(self, batch: list[Makes]) -> None:
        captures, failed = await asyncio.to_thread(_made, batch)
        for _ in range(failed):
            self._metrics.capture_failed(CaptureStage.RECORD)
        if not captures:
            return
        try:
            async with self._busy:
                stored = await (await self._opened()).write(captures)
        except Exception:
            log.exception("capture store: a batch of %d captures is lost", len(captures))
            self._metrics.capture_failed(CaptureStage.STORE)
            self._metrics.capture_dropped(CaptureDrop.STORE, len(captures))
        else:
            self._metrics.captured(len(captures), stored)

    async def _retain(self) -> None:
        # At start first: waiting the period first would never delete on a replica restarted
        # more often than that (a deploy a day, a crash loop).
        while True:
            await self.retain()
            await asyncio.sleep(RETENTION_EVERY_S)  # a timer, not a synchronisation

    async def retain(self) -> int:
        """One retention run (when capture is enabled): the captures deleted."""
        enabled, days = self._policy()
        if not enabled and self._sink is None:
            return 0
        try:
            async with self._busy:
                sink = await self._opened()
                return await sink.delete_older_than(time.time() - days * 86400.0,
                                                    RETENTION_SLICE)
        except Exception:
            log.exception("capture retention failed")
            self._metrics.capture_failed(CaptureStage.RETENTION)
            return 0


def _made(batch: list[Makes]) -> tuple[list[Capture], int]:
    """The batch's captures (in a worker thread), and how many could not be made (logged: the
    capture is lost, never the request's books)."""
    made: list[Capture] = []
    failed = 0
    for pending in batch:
        try:
            made.append(pending.capture())
        except Exception:
            failed += 1
            log.exception("failed to make a capture")
    return made, failed
