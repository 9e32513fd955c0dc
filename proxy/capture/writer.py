"""Captures go to their store off the request path: a bounded queue and one task that writes
them in batches. A request never waits on capture: `offer` only appends, and when the queue is
full the capture is dropped and counted (tokenmeter_captures_dropped_total{reason="queue_full"}).
A batch the store refuses is dropped and counted too (reason="store") and logged: captures are
evidence, not books, so they are not spooled to disk like ledger rows."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Protocol

from proxy.capture.record import Capture
from proxy.telemetry.metrics import CaptureDrop, CaptureStage, Metrics

log = logging.getLogger("tokenmeter.capture")

BATCH = 64  # captures per store write


class CaptureSink(Protocol):
    """Where captures are kept (proxy.capture.store)."""

    async def write(self, captures: Sequence[Capture]) -> int:
        """Store `captures` (idempotent by request id); returns the bytes stored."""
        ...


class CaptureWriter:
    """The queue and its writing task: owned by the app (started and stopped by its cleanup
    context)."""

    def __init__(self, sink: CaptureSink, metrics: Metrics, queue_max: int) -> None:
        self._sink = sink
        self._metrics = metrics
        self._queue: asyncio.Queue[Capture] = asyncio.Queue(queue_max)
        self._task: asyncio.Task[None] | None = None

    def offer(self, capture: Capture) -> bool:
        """Queue `capture` for the store; False (counted) when the queue is full."""
        try:
            self._queue.put_nowait(capture)
        except asyncio.QueueFull:
            self._metrics.capture_dropped(CaptureDrop.QUEUE_FULL)
            return False
        return True

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self, drain_s: float) -> None:
        """What is queued is written (for at most `drain_s`), then the task ends."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(drain_s):
                await self._queue.join()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        queue = self._queue
        while True:
            batch = [await queue.get()]
            while len(batch) < BATCH and not queue.empty():
                batch.append(queue.get_nowait())
            try:
                stored = await self._sink.write(batch)
            except Exception:
                log.exception("capture store: a batch of %d captures is lost", len(batch))
                self._metrics.capture_failed(CaptureStage.STORE)
                self._metrics.capture_dropped(CaptureDrop.STORE, len(batch))
            else:
                self._metrics.captured(len(batch), stored)
            finally:
                for _ in batch:
                    queue.task_done()
