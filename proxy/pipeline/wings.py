"""The optional wings as observers of a request (`proxy.pipeline.observers`): each wing's
factory, and the observer that turns the points it reads into its own package's verbs.

- capture (`capture.enabled`): the request's bytes, bounded, then at settle the decision
  whether it is kept (`proxy.capture.policy`) and the capture queued for the writer;
- tracing (`tracing:`, once started): the request's server span and a client span per
  attempt, ended with the record's figures;
- the response cache's fill of a miss: made by the cache step (`proxy.pipeline.caching`),
  which alone knows whether the request is a miss to store.

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
from proxy.pipeline.context import Candidacy, ObserverFactory, RequestObserver, Settlement
from proxy.pipeline.services import Opening, Runtime
from proxy.record import RequestRecord
from proxy.telemetry.families import CaptureStage
from proxy.telemetry.metrics import Metrics
from proxy.telemetry.tracing import BudgetDecision, RequestTrace, Target, Tracing

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
                          allowed=principal is None or self._runtime.callers.of(
                              principal.user, principal.key_id).capture)
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


class TraceObserver(RequestObserver):
    """The request's spans: each attempt's client span (its `traceparent` sent upstream), and
    the server span, ended with the record's figures."""

    __slots__ = ("_trace",)

    def __init__(self, trace: RequestTrace) -> None:
        self._trace = trace

    def forwarded(self, candidacy: Candidacy, body: bytes) -> None:
        upstream = candidacy.route.upstream
        self._trace.candidate(Target(candidacy.model, upstream.api.value, upstream.name,
                                     candidacy.reservation.upstream_cap))

    def attempt_started(self, headers: MutableMapping[str, str], host: str,
                        port: int | None) -> None:
        self._trace.attempt_started(headers, host, port)

    def attempt_answered(self, status: int, error_class: ErrorClass) -> None:
        self._trace.attempt_answered(status, error_class)

    def attempt_ended(self, error_class: ErrorClass) -> None:
        self._trace.attempt_ended(error_class)

    def settled(self, done: Settlement, record: RequestRecord) -> None:
        """A failure here loses spans, never the request's books: logged, and that is all."""
        try:
            self._trace.settle(record, budget_decision(done))
        except Exception:
            log.exception("failed to end the spans of request %s", done.request_id)


def budget_decision(done: Settlement) -> BudgetDecision:
    """What the budget made of the request's last candidate, from its reservation."""
    if done.candidacy is None:
        refused = done.error_class is ErrorClass.BUDGET_EXCEEDED
        return BudgetDecision.REFUSED if refused else BudgetDecision.NONE
    reservation = done.candidacy.reservation
    if not reservation.stored:
        return BudgetDecision.UNENFORCED
    return BudgetDecision.CLAMPED if reservation.clamped else BudgetDecision.ADMITTED


def tracing(spans: Tracing) -> ObserverFactory:
    """Tracing's factory: the request's trace, its server span started as it opens (None
    before the exporter started, or after it stopped)."""

    def make(opening: Opening) -> RequestObserver | None:
        trace = spans.request(opening.headers, opening.operation)
        return None if trace is None else TraceObserver(trace)

    return make
