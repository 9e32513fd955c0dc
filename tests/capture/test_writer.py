"""The capture writer: a request never waits on capture; a full queue or a failing store drops
captures and counts them; what is queued is written at stop."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from proxy.capture.record import Body, Capture
from proxy.capture.writer import CaptureWriter
from proxy.telemetry.metrics import Metrics


@dataclass(frozen=True)
class Made:
    """A capture already made (the writer's queue takes what makes one)."""

    made: Capture

    def capture(self) -> Capture:
        return self.made


def _capture(i: int) -> Made:
    return Made(Capture(request_id=f"r{i}", started_at=1.0, api="openai", path="/v1/chat/completions",
                   operation="chat", user="alice", key_name=None, team=None,
                   requested_model="m", model="m", stream=False, status=200,
                   error_class="none", request=Body("{}", 2), upstream_request=None,
                   response=None))


class Sink:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.stored: list[str] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def write(self, captures: Sequence[Capture]) -> int:
        await self.gate.wait()
        if self.fail:
            raise OSError("disk gone")
        self.stored += [c.request_id for c in captures]
        return 100 * len(captures)

    async def delete_older_than(self, cutoff: float, slice_rows: int) -> int:
        return 0

    async def close(self) -> None:
        pass


def _writer(sink: Sink, metrics: Metrics, queue_max: int) -> CaptureWriter:
    async def opened() -> Sink:
        return sink

    return CaptureWriter(opened, metrics, queue_max, lambda: (True, 7))


def _value(metrics: Metrics, name: str, **labels: str) -> float:
    registry: CollectorRegistry = metrics.registry
    return registry.get_sample_value(name, labels) or 0.0


async def test_queued_captures_are_written_and_counted() -> None:
    metrics, sink = Metrics(), Sink()
    writer = _writer(sink, metrics, queue_max=100)
    writer.start()
    assert all(writer.offer(_capture(i)) for i in range(10))
    await writer.stop(drain_s=10)
    assert sink.stored == [f"r{i}" for i in range(10)]
    assert _value(metrics, "tokenmeter_captures_total") == 10
    assert _value(metrics, "tokenmeter_capture_bytes_total") == 1000


async def test_a_full_queue_drops_without_waiting_and_counts() -> None:
    metrics, sink = Metrics(), Sink()
    sink.gate.clear()  # the store hangs: the queue fills
    writer = _writer(sink, metrics, queue_max=3)
    writer.start()
    offered = [writer.offer(_capture(i)) for i in range(10)]  # never awaits
    assert offered.count(False) >= 6
    assert _value(metrics, "tokenmeter_captures_dropped_total", reason="queue_full") == \
        offered.count(False)
    sink.gate.set()
    await writer.stop(drain_s=10)


async def test_a_failing_store_drops_the_batch_and_says_so() -> None:
    metrics = Metrics()
    writer = _writer(Sink(fail=True), metrics, queue_max=10)
    writer.start()
    writer.offer(_capture(1))
    await writer.stop(drain_s=10)
    assert _value(metrics, "tokenmeter_captures_dropped_total", reason="store") == 1
    assert _value(metrics, "tokenmeter_capture_errors_total", stage="store") == 1
