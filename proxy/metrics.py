"""Prometheus metrics, one registry per app, updated in one place per request.

Names follow the OpenTelemetry GenAI semantic conventions in Prometheus form where one exists
(`gen_ai_server_*`); the rest live under `tokenmeter_`. Every label comes from a bounded set:
configured or upstream-listed model names (else the route pattern), configured users, upstream
names, operations, HTTP status codes and our own error classes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy import meter
from proxy.meter import Figures
from proxy.usage import Usage


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """Everything known about one finished request; the metrics and the log line read this."""

    request_id: str
    operation: str
    model: str  # the model that served it (logged, never a label)
    model_label: str
    upstream: str
    user: str
    key: str | None  # a key's configured name, else the first 12 hex digits of its hash
    status: int
    error_class: str  # "none" when the request succeeded
    stream: bool
    usage: Usage
    figures: Figures
    fallback_from: str | None = None  # the model asked for, when a fallback served instead
    attempts: int = 1  # upstream calls made: retries and fallbacks included


class _GapHistogram(Collector):
    """Inter-chunk latency histogram fed with whole per-request bucket arrays."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...]) -> None:
        self._name = name
        self._doc = doc
        self._buckets = buckets
        self._series: dict[tuple[str, str, str], tuple[list[int], list[float]]] = {}

    def merge(self, labels: tuple[str, str, str], counts: list[int], total: float) -> None:
        if not any(counts):
            return
        series = self._series.get(labels)
        if series is None:
            series = self._series[labels] = ([0] * len(counts), [0.0])
        acc, sums = series
        for i, c in enumerate(counts):
            acc[i] += c
        sums[0] += total

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(
            self._name, self._doc, labels=("model", "upstream", "operation")
        )
        bounds = [*(repr(b) for b in self._buckets), "+Inf"]
        for labels, (acc, sums) in list(self._series.items()):
            cumulative: list[tuple[str, float]] = []
            running = 0
            for bound, count in zip(bounds, acc, strict=True):
                running += count
                cumulative.append((bound, float(running)))
            family.add_metric(list(labels), cumulative, sums[0])
        yield family


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        hist_labels = ("model", "upstream", "operation")
        self.ttft = Histogram(
            "gen_ai_server_time_to_first_token_seconds",
            "Request received to first content token forwarded to the client (streaming).",
            hist_labels, buckets=meter.TTFT_BUCKETS, registry=r,
        )
        self.tpot = Histogram(
            "gen_ai_server_time_per_output_token_seconds",
            "Decode time per output token after the first one (streaming).",
            hist_labels, buckets=meter.TPOT_BUCKETS, registry=r,
        )
        self.duration = Histogram(
            "gen_ai_server_request_duration_seconds",
            "End-to-end request duration as seen by the proxy.",
            hist_labels, buckets=meter.DURATION_BUCKETS, registry=r,
        )
        self.upstream_ttft = Histogram(
            "tokenmeter_upstream_time_to_first_token_seconds",
            "Upstream call started to first content token received: the upstream's part of TTFT.",
            hist_labels, buckets=meter.TTFT_BUCKETS, registry=r,
        )
        self.overhead = Histogram(
            "tokenmeter_proxy_overhead_seconds",
            "Proxy's own time from request received to upstream call started.",
            ("operation",), buckets=meter.OVERHEAD_BUCKETS, registry=r,
        )
        self.tokens_per_second = Histogram(
            "tokenmeter_output_tokens_per_second",
            "Output tokens per second of one stream over its decode phase.",
            hist_labels, buckets=meter.TOKENS_PER_SECOND_BUCKETS, registry=r,
        )
        self.gaps = _GapHistogram(
            "tokenmeter_inter_chunk_latency_seconds",
            "Time between consecutive content chunks of a stream (inter-token latency).",
            meter.TPOT_BUCKETS,
        )
        r.register(self.gaps)
        self.tokens = Counter(
            "tokenmeter_tokens",
            "Tokens by type (input, output, cached_input, reasoning) and source.",
            ("type", "model", "user", "source"), registry=r,
        )
        self.requests = Counter(
            "tokenmeter_requests",
            "Requests by HTTP status and error class.",
            ("model", "user", "status", "error_class"), registry=r,
        )
        self.active = Gauge(
            "tokenmeter_active_requests", "Requests in flight.", ("upstream",), registry=r,
        )
        self.retries = Counter(
            "tokenmeter_upstream_retries",
            "Upstream calls retried (before any byte reached the client), by the reason.",
            ("upstream", "reason"), registry=r,
        )
        self.fallbacks = Counter(
            "tokenmeter_fallbacks",
            "Requests handed from a route to its next fallback model, by the reason "
            "(an error class, or slow: recent TTFT p95 over the threshold).",
            ("route", "to_model", "reason"), registry=r,
        )
        self.metering_errors = Counter(
            "tokenmeter_metering_errors",
            "Failures while metering or settling a request (usage may be missing).",
            ("stage",), registry=r,
        )
        budget = ("user", "window")
        self.budget_limit = Gauge(
            "tokenmeter_budget_limit_tokens", "Configured limit of a budget window.", budget,
            registry=r,
        )
        self.budget_used = Gauge(
            "tokenmeter_budget_used_tokens",
            "Used (settled plus in-flight reservations) in the current window.", budget,
            registry=r,
        )
        self.budget_remaining = Gauge(
            "tokenmeter_budget_remaining_tokens", "Limit minus used in the current window.",
            budget, registry=r,
        )
        self.budget_refusals = Counter(
            "tokenmeter_budget_refusals", "Requests refused by a budget limit.",
            ("user", "limit"), registry=r,
        )
        self.budget_reserved = Counter(
            "tokenmeter_budget_reserved_tokens", "Tokens reserved before requests went upstream.",
            ("user",), registry=r,
        )
        self.budget_overreserved = Counter(
            "tokenmeter_budget_overreserved_tokens",
            "Reserved minus actual tokens, released at settlement.", ("user",), registry=r,
        )
        self.threshold_crossings = Counter(
            "tokenmeter_budget_threshold_crossings",
            "Users crossing a notice threshold of their daily quota.", ("user", "threshold"),
            registry=r,
        )
        self.store_errors = Counter(
            "tokenmeter_store_errors", "Budget store operations that failed.", ("op",),
            registry=r,
        )
        self.store_latency = Histogram(
            "tokenmeter_store_latency_seconds", "Budget store round trip.", ("op",),
            buckets=meter.OVERHEAD_BUCKETS, registry=r,
        )
        self.store_up = Gauge(
            "tokenmeter_store_up",
            "1 if the budget store answered its last operation or probe (probed every second).",
            registry=r,
        )
        self.settle_backlog = Gauge(
            "tokenmeter_settle_backlog",
            "Settlements in the local spool, waiting for the store to come back (each user's "
            "usage while the store was down counts as one).", registry=r,
        )
        self.settle_backlog_tokens = Gauge(
            "tokenmeter_settle_backlog_tokens",
            "Tokens in the local spool, owed to the store.", registry=r,
        )
        self.settlements_spooled = Counter(
            "tokenmeter_settlements_spooled",
            "Settlements written to the local spool because the store could not take them.",
            registry=r,
        )
        self.settlements_lost = Counter(
            "tokenmeter_settlements_lost",
            "Settlements lost: the store was down and the spool could not be written.",
            registry=r,
        )
        self.settlement_tokens_lost = Counter(
            "tokenmeter_settlement_tokens_lost", "Tokens of the settlements lost.", registry=r,
        )
        self.connections_closed = Counter(
            "tokenmeter_client_connections_closed",
            "Client connections the proxy refused (max_connections) or cut (header or body "
            "deadline).", ("reason",), registry=r,
        )
        self.connections_open = Gauge(
            "tokenmeter_client_connections_open", "Client connections open now.", registry=r,
        )
        self.config_reloads = Counter(
            "tokenmeter_config_reloads", "Configuration reloads by result.", ("result",),
            registry=r,
        )
        self.cost = Counter(
            "tokenmeter_cost_usd", "Estimated cost from the configured price table.",
            ("model", "user", "type"), registry=r,
        )
        self.info = Gauge(
            "tokenmeter_open_mode", "1 when no users are configured and every request is accepted.",
            registry=r,
        )

    def observe(self, rec: RequestRecord) -> None:
        hl = (rec.model_label, rec.upstream, rec.operation)
        f = rec.figures
        self.duration.labels(*hl).observe(f.duration)
        if f.ttft is not None:
            self.ttft.labels(*hl).observe(f.ttft)
        if f.upstream_ttft is not None:
            self.upstream_ttft.labels(*hl).observe(f.upstream_ttft)
        if f.time_per_output_token is not None:
            self.tpot.labels(*hl).observe(f.time_per_output_token)
        if f.output_tokens_per_second is not None:
            self.tokens_per_second.labels(*hl).observe(f.output_tokens_per_second)
        if f.overhead is not None:
            self.overhead.labels(rec.operation).observe(f.overhead)
        u = rec.usage
        for kind, value in (
            ("input", u.input_tokens),
            ("output", u.output_tokens),
            ("cached_input", u.cached_input_tokens),
            ("reasoning", u.reasoning_tokens),
        ):
            if value:
                self.tokens.labels(kind, rec.model_label, rec.user, u.source).inc(value)
        self.requests.labels(rec.model_label, rec.user, str(rec.status), rec.error_class).inc()

    def observe_cost(
        self, rec: RequestRecord, input_price: float, cached_price: float | None,
        output_price: float,
    ) -> None:
        """Prices are USD per million tokens; cached input costs the input price if unset."""
        u = rec.usage
        cached = min(u.cached_input_tokens, u.input_tokens)
        labels = (rec.model_label, rec.user)
        for kind, tokens, price in (
            ("input", u.input_tokens - cached, input_price),
            ("cached_input", cached, input_price if cached_price is None else cached_price),
            ("output", u.output_tokens, output_price),
        ):
            if tokens and price:
                self.cost.labels(*labels, kind).inc(tokens * price / 1_000_000)

    def observe_gaps(self, rec: RequestRecord, counts: list[int]) -> None:
        f = rec.figures
        total = (f.mean_inter_chunk or 0.0) * max(f.content_chunks - 1, 0)
        self.gaps.merge((rec.model_label, rec.upstream, rec.operation), counts, total)
