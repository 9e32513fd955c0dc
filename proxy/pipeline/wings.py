"""The optional wings as observers of a request (`proxy.pipeline.observers`): each wing's
factory, and the observer that turns the points it reads into its own package's verbs.

- capture (`capture.enabled`): the request's bytes, bounded, then at settle the decision
  whether it is kept (`proxy.capture.policy`) and the capture queued for the writer.

A wing is added here: an observer of the points it reads and a factory that `Services`
holds (proxy/server/app.py makes them from the configuration).
"""

from __future__ import annotations

import logging
import random
from collections.abc import MutableMapping

from proxy.capture.collect import Collector, Meta, Pending, redactor, sent_keys
from proxy.capture.policy import Subject, wanted
from proxy.capture.writer import CaptureWriter
from proxy.errors import ErrorClass
from proxy.pipeline.context import Candidacy, Settlement
from proxy.pipeline.observers import ObserverFactory, Opening, RequestObserver
from proxy.pipeline.services import Runtime
from proxy.telemetry.families import CaptureStage
from proxy.telemetry.metrics import Metrics
from proxy.telemetry.record import RequestRecord

log = logging.getLogger("tokenmeter.settle")


class CaptureObserver(RequestObserver):
    """The request's bytes kept as they pass (`Collector`: nothing parsed or redacted on the
    request path); at settle, whether `capture:` wants the request, and if so one append to
    the capture writer's queue (the capture is made off the loop, with its batch)."""

    __slots__ = ("_collector", "_metrics", "_rng", "_runtime", "_writer")

    def __init__(self, collector: Collector, runtime: Runtime, writer: CaptureWriter,
                 rng: random.Random, metrics: Metrics) -> None:
        self._collector = collector
        self._runtime = runtime
        self._writer = writer
        self._rng = rng
        self._metrics = metrics

    def sent(self, body: bytes) -> None:
        self._collector.sent(body)

    def forwarded(self, candidacy: Candidacy, body: bytes) -> None:
        self._collector.forwarded(body)

    def answered(self, status: int, body: bytes, headers: MutableMapping[str, str]) -> None:
        self._collector.answered(body)

    def streamed(self, data: bytes, at_ms: float) -> None:
        self._collector.streamed(data, at_ms)

    def settled(self, done: Settlement, record: RequestRecord) -> None:
        """A failure here loses the capture, never the request's books: counted, logged."""
        try:
            self._capture(done, record)
        except Exception:
            self._metrics.capture_failed(CaptureStage.RECORD)
            log.exception("failed to make the capture of request %s", done.request_id)

    def _capture(self, done: Settlement, record: RequestRecord) -> None:
        # A request refused for its key names no one: never captured.
        if done.error_class is ErrorClass.INVALID_API_KEY:
            return
        cfg = self._runtime.config.capture
        principal = done.principal
        subject = Subject(user=record.user, key_name=record.key, team=record.team,
                          model=done.request_model,
                          failed=done.error_class is not ErrorClass.NONE,
                          allowed=principal.capture if principal is not None else True)
        if not wanted(cfg, subject, self._rng.random()):
            return
        collected = self._collector
        meta = Meta(request_id=done.request_id,
                    started_at=record.started_at, api=collected.api,
                    path=collected.path, operation=done.operation, user=record.user,
                    key_name=record.key, team=record.team, requested_model=done.request_model,
                    model=record.sent_model, stream=done.stream, status=done.status,
                    error_class=done.error_class.value,
                    tags=tuple((t.key, t.value) for t in record.tags.items),
                    upstream_request_id=record.upstream_request_id)
        # The upstreams' keys are removed literally, whatever they look like (the client's
        # own, which the collector holds, are added when the capture is made).
        keys = [u.api_key for u in self._runtime.config.upstreams.values()]
        self._writer.offer(Pending(collected, meta, redactor(cfg.redact, keys)))


def capturing(writer: CaptureWriter, rng: random.Random, metrics: Metrics) -> ObserverFactory:
    """Capture's factory: an observer for each request while `capture.enabled` (a reload may
    turn it on or off), kept whole up to `max_body_kb` per part."""

    def make(opening: Opening) -> RequestObserver | None:
        cfg = opening.runtime.config.capture
        if not cfg.enabled:
            return None
        collector = Collector(cfg.max_body_kb * 1024, opening.api, opening.path,
                              sent_keys(opening.headers))
        return CaptureObserver(collector, opening.runtime, writer, rng, metrics)

    return make
