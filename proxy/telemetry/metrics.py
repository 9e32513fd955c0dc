"""Prometheus metrics, one registry per app, updated only through `Metrics`' domain verbs.

Names follow the OpenTelemetry GenAI semantic conventions in Prometheus form where one exists
(`gen_ai_server_*`); the rest live under `tokenmeter_`. Every label comes from a bounded set:
configured or upstream-listed model names (else the route pattern), configured users, upstream
names, operations, HTTP status codes and our own error classes.

Workers (`serve --workers N`, proxy/server/workers.py) use prometheus_client's multiprocess
mode: each worker's values live in files of its own in `PROMETHEUS_MULTIPROC_DIR`, and whichever
worker answers /metrics reads them all (`exposition`). Counters and histograms are summed. Each
gauge says how it combines (`multiprocess_mode`, ignored by a single process): `livesum` for a
worker's own share of something (requests in flight, connections, spool backlogs), `livemin`
for "is it up" (0 as soon as one live worker lost the store or the database), `livemax` for an
age, `mostrecent` for a fact about shared state that any worker may have read last (a budget's
use in the shared store, the last reconcile) and `livemostrecent` for configuration. A single
process (no multiprocess directory) keeps today's registry and exposition, unchanged.
"""

from __future__ import annotations

import asyncio
import enum
import os
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from math import isnan
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, Self

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, values
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from proxy.config.policy import AdmissionPolicy
from proxy.config.tags import NO_TAGS, TagDrop, Tags
from proxy.cost import NANOS_PER_USD, CostLines
from proxy.errors import ErrorClass
from proxy.protocol.usage import ZERO, Usage

if TYPE_CHECKING:
    from proxy.telemetry.meter import Figures  # meter buckets gaps on TPOT_BUCKETS from here


# Upper bounds in seconds. Fine enough to tell 1 ms from 5 ms and 50 ms from 100 ms in TTFT.
TTFT_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1,
    0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0,
)
# Time per output token from 50 us (14,000 tok/s: 71 us) to 100 ms (10 tok/s) and beyond;
# 1.33 ms is 750 tok/s.
TPOT_BUCKETS: tuple[float, ...] = (
    0.00001, 0.000025, 0.00005, 0.000075, 0.0001, 0.00015, 0.0002, 0.0003, 0.0005, 0.00075,
    0.001, 0.00133, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1,
    0.25, 0.5, 1.0, 2.5,
)
DURATION_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0,
    300.0, 600.0,
)
OVERHEAD_BUCKETS: tuple[float, ...] = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)
TOKENS_PER_SECOND_BUCKETS: tuple[float, ...] = (
    5.0, 10.0, 25.0, 50.0, 75.0, 100.0, 150.0, 200.0, 300.0, 500.0, 750.0, 1000.0, 1500.0,
    2000.0, 3000.0, 5000.0, 7500.0, 10000.0, 14000.0, 20000.0, 50000.0,
)


# CacheResult's values that the metrics tell apart (tests/telemetry/test_cache_metrics.py
# checks they are CacheResult's).
CACHE_NOT_CONSULTED = "none"  # not counted in tokenmeter_cache_requests_total
CACHE_HIT = "hit"


class _Memo:
    """`labels()` that remembers its children: prometheus_client validates and joins the
    values and takes a lock on every call (about 1.5 us), and a request makes a few dozen of
    them. The memo holds what the metric's own table holds, so it grows with label
    cardinality, not with requests; nothing here removes a child."""

    _memo: dict[tuple[Any, ...], Self]

    def labels(self, *values: Any, **by_name: Any) -> Self:
        if by_name:
            named: Self = super().labels(*values, **by_name)  # type: ignore[misc]
            return named
        try:
            return self._memo[values]
        except AttributeError:
            self._memo = {}
        except KeyError:
            pass
        child: Self = super().labels(*values)  # type: ignore[misc]
        self._memo[values] = child
        return child


class _Counter(_Memo, Counter):
    def inc(self, amount: float = 1, exemplar: dict[str, str] | None = None) -> None:
        """prometheus_client's inc without its two checking calls on a labelled child (about
        13 increments a request); a parent, a negative amount and exemplars take its path."""
        if exemplar is not None or amount < 0 or (self._labelnames and not self._labelvalues):
            super().inc(amount, exemplar)
            return
        self._value.inc(amount)


class _Gauge(_Memo, Gauge):
    def set(self, value: float) -> None:
        """prometheus_client's set without its checking call on a labelled child (the budget
        gauges: up to 30 sets a request under limits); a labelled parent takes its path, which
        refuses. The `mostrecent` modes stamp the time as the library does."""
        if self._labelnames and not self._labelvalues:
            super().set(value)
        elif self._is_most_recent:
            self._value.set(float(value), timestamp=time.time())
        else:
            self._value.set(float(value))


class _Histogram(_Memo, Histogram):
    def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None:
        """prometheus_client's observe, its bucket found by bisection: it walks the bounds in
        Python (up to 28 here, a dozen comparisons for a typical TTFT), and a request makes
        about 17 observations. `le` buckets: the first bound >= amount. NaN, exemplars and a
        labelled parent (which raises) take the library's own path."""
        if exemplar is not None or isnan(amount) or (self._labelnames
                                                     and not self._labelvalues):
            super().observe(amount, exemplar)
            return
        self._sum.inc(amount)
        self._buckets[bisect_left(self._upper_bounds, amount)].inc(1)


class InFlight:
    """`Metrics.relaying`'s context manager: the gauge up while the block runs. A class, not a
    contextlib generator: one per request, and a generator's costs a few microseconds."""

    __slots__ = ("_gauge",)

    def __init__(self, gauge: Gauge) -> None:
        self._gauge = gauge

    def __enter__(self) -> None:
        self._gauge.inc()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._gauge.dec()


class _BudgetPair:
    """A used/limit pair of budget gauges labelled (owner, window), the limit set only when it
    changes (as `Metrics.budget_state` does for the users' token windows). `scale` turns the
    store's units into the gauges' (nano-dollars into USD)."""

    __slots__ = ("_limit", "_limits", "_scale", "_used")

    def __init__(self, used: _Gauge, limit: _Gauge, scale: float = 1.0) -> None:
        self._used = used
        self._limit = limit
        self._scale = scale
        self._limits: dict[tuple[str, str], int] = {}

    def set(self, owner: str, window: str, used: int, limit: int | None) -> None:
        self._used.labels(owner, window).set(used / self._scale)
        if limit is not None and self._limits.get((owner, window)) != limit:
            self._limits[(owner, window)] = limit
            self._limit.labels(owner, window).set(limit / self._scale)


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """Everything known about one finished request, made once by settle: the metrics, the
    access-log line (`proxy.telemetry.accesslog`) and the ledger row (`LedgerRow.of`) each
    read their part of it. Never prompt or response text, never a key."""

    request_id: str
    operation: str
    requested_model: str  # what the client asked for
    sent_model: str | None  # sent upstream (a fallback's when one served); None: never sent
    model_label: str
    upstream: str | None  # None: no upstream was tried
    user: str  # "anonymous" when no key was accepted
    key: str | None  # a key's configured name, else the first 12 hex digits of its hash
    team: str | None
    status: int
    error_class: ErrorClass
    stream: bool
    usage: Usage
    figures: Figures
    fallback_from: str | None  # the model asked for, when a fallback served instead
    response_model: str | None  # the model the upstream's answer names (logged and booked)
    attempts: int  # upstream calls made: retries and fallbacks included
    cost: CostLines | None  # None: the model has no price
    price_version: str | None  # of the price table that priced `cost`
    windows: str  # budget windows charged, space-separated `scope:window:stamp`
    ended_at: float  # epoch seconds, UTC
    # What the response cache did: a `proxy.cache.outcome.CacheResult` value (none, hit, miss,
    # bypass; the cache is a layer above this one). On a hit `usage` is ZERO (no upstream
    # call) and these are what the stored answer used and its cost at the price of the day of
    # the hit (None: no price).
    cache: str = CACHE_NOT_CONSULTED
    cache_reason: str | None = None  # a bypass's: a `proxy.cache.outcome.BypassReason` value
    saved_usage: Usage = ZERO
    saved_cost: CostLines | None = None
    tags: Tags = NO_TAGS  # what the request was for (proxy.config.tags)
    # The upstream's own id of the answer (its `x-request-id` / `request-id`; None: no
    # upstream answered, or it sent none): what the SDKs show as `request_id`.
    upstream_request_id: str | None = None

    @property
    def started_at(self) -> float:
        """Epoch seconds, UTC: when the request was received (its end less its duration)."""
        return self.ended_at - self.figures.duration

    @property
    def model(self) -> str:
        """The model that served (or was last tried), else the one asked for (logged, never a
        label)."""
        return self.requested_model if self.sent_model is None else self.sent_model

    @property
    def upstream_label(self) -> str:
        return "none" if self.upstream is None else self.upstream

    @property
    def hit(self) -> bool:
        """Answered by the response cache: no upstream call."""
        return self.cache == CACHE_HIT


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


class _SharedGapHistogram:
    """`_GapHistogram` for workers: the same series, kept in the multiprocess files of a real
    `Histogram` (whose buckets are stored per bucket, not cumulated, as the arrays come)."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...]) -> None:
        # Not registered: in multiprocess mode /metrics reads the files, not a registry.
        self._histogram = _Histogram(name, doc, ("model", "upstream", "operation"),
                                    buckets=buckets, registry=None)

    def merge(self, labels: tuple[str, str, str], counts: list[int], total: float) -> None:
        if not any(counts):
            return
        child = self._histogram.labels(*labels)
        for value, count in zip(child._buckets, counts, strict=True):
            if count:
                value.inc(count)
        child._sum.inc(total)


def multiprocess_dir() -> str | None:
    """prometheus_client's multiprocess directory when this process writes its metrics there
    (a worker of `serve --workers N`); the mode is fixed when prometheus_client is imported."""
    if not getattr(values.ValueClass, "_multiprocess", False):
        return None
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR")


REFRESH_S = 1.0  # how often a worker writes its values into the shared files


class _BufferedValue:
    """prometheus_client's value class for a worker: updated in memory, written into the
    multiprocess file by `_BufferedValue.flush` (every REFRESH_S, before this worker answers a
    scrape, and at exit) instead of on every update.

    The stock multiprocess value takes a lock, calls getpid and packs into the mmap on every
    inc: about 34 writes per request, 1.7x the single-process cost of the metric updates. Here
    an update is an add and a flag, as cheap as the single-process value. The price: another
    worker's figures on /metrics are up to REFRESH_S old, and a worker killed outright (SIGKILL,
    OOM) loses what it counted in its last REFRESH_S (a single process so killed loses all its
    counters). Single-threaded by design: every metric is updated on the event loop's thread."""

    _multiprocess = True
    _file_class: ClassVar[Any] = None  # the stock multiprocess value class written through
    _pending: ClassVar[list[_BufferedValue]] = []  # values changed since the last flush

    __slots__ = ("_dirty", "_file", "_timestamp", "_value")

    def __init__(  # noqa: PLR0913, PLR0917  prometheus_client's ValueClass signature
        self, typ: str, metric_name: str, name: str, labelnames: Sequence[str],
        labelvalues: Sequence[str], help_text: str, **kwargs: Any,
    ) -> None:
        self._file = _BufferedValue._file_class(typ, metric_name, name, labelnames, labelvalues,
                                                help_text, **kwargs)
        self._value: float = self._file.get()
        self._timestamp: float | None = None
        self._dirty = False

    def inc(self, amount: float) -> None:
        self._value += amount
        if not self._dirty:
            self._dirty = True
            _BufferedValue._pending.append(self)

    def set(self, value: float, timestamp: float | None = None) -> None:
        self._value = value
        self._timestamp = timestamp  # mostrecent gauges: the newest write wins across workers
        if not self._dirty:
            self._dirty = True
            _BufferedValue._pending.append(self)

    def set_exemplar(self, exemplar: object) -> None:
        pass  # multiprocess mode has no exemplars

    def get(self) -> float:
        return self._value

    def get_exemplar(self) -> None:
        return None

    @classmethod
    def install(cls) -> None:
        """Metrics made from now on in this (multiprocess) process are buffered."""
        if values.ValueClass is not cls:
            cls._file_class = values.ValueClass
            values.ValueClass = cls

    @classmethod
    def flush(cls) -> None:
        pending, cls._pending = cls._pending, []
        for value in pending:
            value._dirty = False
            value._file.set(value._value, value._timestamp)


class MeteringStage(enum.Enum):
    STREAM = "stream"  # reading a relayed stream on the side
    SETTLE = "settle"  # charging, recording and logging a finished request
    LEDGER = "ledger"  # making a finished request's ledger row


class LedgerStage(enum.Enum):
    SPOOL = "spool"  # appending a row to the local spool
    SHIP = "ship"  # writing a batch into the database
    CONNECT = "connect"  # opening the database (and migrating its schema)
    RETENTION = "retention"  # deleting rows past ledger.retention_days
    ROW = "row"  # the database refused one row (it is dropped; the others are stored)
    SHIPPER = "shipper"  # the shipper process died (it is started again) or could not start


class CaptureDrop(enum.Enum):
    QUEUE_FULL = "queue_full"  # capture.queue_max captures were already waiting
    STORE = "store"  # the capture store failed to take a batch (it is not retried)


class CaptureStage(enum.Enum):
    RECORD = "record"  # building a capture from a request's bytes
    STORE = "store"  # writing a batch into the capture store
    RETENTION = "retention"  # deleting captures past capture.retention_days


class ReconcileFailure(enum.Enum):
    """Why an in-process reconcile reading (proxy.ledger.audit) was not made."""

    STORE = "store"  # the budget store could not be read
    LEDGER = "ledger"  # the ledger could not be opened or read (its reader is opened again)
    INTERNAL = "internal"  # a bug of ours (logged with its traceback)


class CacheStage(enum.Enum):
    """Where the response cache failed (the request was then a miss, or not stored)."""

    LOOKUP = "lookup"  # the store failed or took longer than cache.lookup_timeout_ms
    STORE = "store"  # the store failed to take an entry
    ENTRY = "entry"  # an entry could not be read back (another version, damaged)
    FILL = "fill"  # making an entry of a finished answer failed
    # An answer not kept for an entry: the fills in flight held cache.fills_mb already.
    BOUND = "bound"
class LedgerMetrics:
    """The ledger's collectors: the serving process counts rows it could not spool; the shipper
    process (proxy.ledger.shipper_process), which registers these alone, everything else. Its
    gauges are set by the shipper only, so across processes they combine as that one's value
    (`livesum`/`livemax` over the others' zeros; `up` is `livemax` for that reason)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._ledger_rows = _Counter(
            "tokenmeter_ledger_rows_written", "Ledger rows stored in the database.", ("sink",),
            registry=registry,
        )
        self._ledger_spool_rows = _Gauge(
            "tokenmeter_ledger_spool_rows", "Ledger rows in the local spool not yet stored.",
            registry=registry, multiprocess_mode="livesum",
        )
        self._ledger_spool_bytes = _Gauge(
            "tokenmeter_ledger_spool_bytes", "Disk taken by ledger rows not yet stored.",
            registry=registry, multiprocess_mode="livesum",
        )
        self._ledger_ship = _Histogram(
            "tokenmeter_ledger_ship_seconds", "Time to store one batch of ledger rows.",
            buckets=DURATION_BUCKETS, registry=registry,
        )
        self._ledger_lag = _Gauge(
            "tokenmeter_ledger_lag_seconds",
            "Age of the oldest ledger row not yet stored (0: nothing waits).", registry=registry,
            multiprocess_mode="livemax",
        )
        self._ledger_errors = _Counter(
            "tokenmeter_ledger_errors", "Ledger failures by stage.", ("stage",), registry=registry,
        )
        self._ledger_dropped = _Counter(
            "tokenmeter_ledger_rows_dropped",
            "Ledger rows lost: the spool was full or could not be written.", registry=registry,
        )
        self._ledger_up = _Gauge(
            "tokenmeter_ledger_up", "1 when the last write to the ledger database succeeded.",
            registry=registry, multiprocess_mode="livemax",
        )

    def ledger_stored(self, sink: str, rows: int, seconds: float) -> None:
        """A batch of `rows` reached the database (`sink`: sqlite or postgresql)."""
        self._ledger_rows.labels(sink).inc(rows)
        self._ledger_ship.observe(seconds)
        self._ledger_up.set(1)

    def ledger_pending(self, rows: int, spool_bytes: int, oldest_age_s: float) -> None:
        self._ledger_spool_rows.set(rows)
        self._ledger_spool_bytes.set(spool_bytes)
        self._ledger_lag.set(oldest_age_s)

    def ledger_connected(self) -> None:
        """The database answered (a connect or an idle ping): up before any batch is stored."""
        self._ledger_up.set(1)

    def ledger_failed(self, stage: LedgerStage) -> None:
        self._ledger_errors.labels(stage.value).inc()
        if stage in (LedgerStage.CONNECT, LedgerStage.SHIP):
            self._ledger_up.set(0)

    def ledger_dropped(self, rows: int) -> None:
        self._ledger_dropped.inc(rows)


def process_ledger_metrics() -> LedgerMetrics:
    """The ledger's collectors alone, for the shipper process, in the multiprocess directory
    its parent gave it. Written through (prometheus_client's own multiprocess value, not a
    worker's buffered one): a few updates per batch, and a scrape right after a batch sees it."""
    return LedgerMetrics(CollectorRegistry(auto_describe=True))


def _merged(registry: CollectorRegistry, directory: str) -> bytes:
    """A single process's registry with the series another process (its shipper) keeps in
    `directory`, samples of one name and labels summed: the shipper's ledger figures are set by
    it alone, so the sum is its value (the serving process's own at zero) or the two counts."""
    other = CollectorRegistry()
    MultiProcessCollector(other, directory)  # type: ignore[no-untyped-call]
    theirs = {family.name: family for family in other.collect()}
    merged = CollectorRegistry(auto_describe=False)
    families: list[Metric] = []
    for family in registry.collect():
        extra = theirs.pop(family.name, None)
        if extra is not None:
            sums: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
            for sample in (*family.samples, *extra.samples):
                key = (sample.name, tuple(sorted(sample.labels.items())))
                sums[key] = sums.get(key, 0.0) + sample.value
            combined = Metric(family.name, family.documentation, family.type)
            for (name, labels), value in sums.items():
                combined.add_sample(name, dict(labels), value)
            families.append(combined)
        else:
            families.append(family)
    families.extend(theirs.values())
    merged.register(_Fixed(families))
    return generate_latest(merged)


class _Fixed(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


class Metrics:
    """Every collector of one app, updated only through the verbs below: each says what
    happened in the domain's words and names its labels, so no caller depends on label order."""

    def __init__(self) -> None:  # noqa: PLR0915  one statement per collector, all in one place
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        hist_labels = ("model", "upstream", "operation")
        self._ttft = _Histogram(
            "gen_ai_server_time_to_first_token_seconds",
            "Request received to first content token forwarded to the client (streaming).",
            hist_labels, buckets=TTFT_BUCKETS, registry=r,
        )
        self._tpot = _Histogram(
            "gen_ai_server_time_per_output_token_seconds",
            "Decode time per output token after the first one (streaming).",
            hist_labels, buckets=TPOT_BUCKETS, registry=r,
        )
        self._duration = _Histogram(
            "gen_ai_server_request_duration_seconds",
            "End-to-end request duration as seen by the proxy.",
            hist_labels, buckets=DURATION_BUCKETS, registry=r,
        )
        self._upstream_ttft = _Histogram(
            "tokenmeter_upstream_time_to_first_token_seconds",
            "Upstream call started to first content token received: the upstream's part of TTFT.",
            hist_labels, buckets=TTFT_BUCKETS, registry=r,
        )
        self._overhead = _Histogram(
            "tokenmeter_proxy_overhead_seconds",
            "Proxy's own time from request received to upstream call started.",
            ("operation",), buckets=OVERHEAD_BUCKETS, registry=r,
        )
        self._tokens_per_second = _Histogram(
            "tokenmeter_output_tokens_per_second",
            "Output tokens per second of one stream over its decode phase.",
            hist_labels, buckets=TOKENS_PER_SECOND_BUCKETS, registry=r,
        )
        self._shared_dir = multiprocess_dir()
        # A single process's shipper child keeps its figures here (`include_shipper`).
        self._shipper_dir: str | None = None
        if self._shared_dir is not None:
            _BufferedValue.install()
        gaps_doc = "Time between consecutive content chunks of a stream (inter-token latency)."
        self._gaps: _GapHistogram | _SharedGapHistogram
        if self._shared_dir is None:
            self._gaps = _GapHistogram("tokenmeter_inter_chunk_latency_seconds", gaps_doc,
                                       TPOT_BUCKETS)
            r.register(self._gaps)
        else:
            self._gaps = _SharedGapHistogram("tokenmeter_inter_chunk_latency_seconds", gaps_doc,
                                             TPOT_BUCKETS)
        # Gauges read from a callback at scrape time (a worker writes them every REFRESH_S).
        self._callbacks: list[tuple[Gauge, Callable[[], float]]] = []
        self._tokens = _Counter(
            "tokenmeter_tokens",
            "Tokens by type (input, output, cached_input, reasoning, cache_creation_input, "
            "cache_read_input) and source.",
            ("type", "model", "user", "source"), registry=r,
        )
        self._requests = _Counter(
            "tokenmeter_requests",
            "Requests by HTTP status and error class.",
            ("model", "user", "status", "error_class"), registry=r,
        )
        self._active = _Gauge(
            "tokenmeter_active_requests", "Requests in flight.", ("upstream",), registry=r,
            multiprocess_mode="livesum",
        )
        self._retries = _Counter(
            "tokenmeter_upstream_retries",
            "Upstream calls retried (before any byte reached the client), by the reason.",
            ("upstream", "reason"), registry=r,
        )
        self._fallbacks = _Counter(
            "tokenmeter_fallbacks",
            "Requests handed from a route to its next fallback model, by the reason "
            "(an error class, or slow: recent TTFT p95 over the threshold).",
            ("route", "to_model", "reason"), registry=r,
        )
        self._auth_failures = _Counter(
            "tokenmeter_auth_failures",
            "Requests refused for a missing or unknown API key (401). They have no ledger row "
            "and no access-log line each (a sampled line says how many).", registry=r,
        )
        self._metering_errors = _Counter(
            "tokenmeter_metering_errors",
            "Failures while metering or settling a request (usage may be missing).",
            ("stage",), registry=r,
        )
        budget = ("user", "window")
        self._budget_limit = _Gauge(
            "tokenmeter_budget_limit_tokens", "Configured limit of a budget window.", budget,
            registry=r, multiprocess_mode="mostrecent",
        )
        # The limit last set per (user, window), as the gauge holds it (`budget_state`).
        self._budget_limits: dict[tuple[str, str], int] = {}
        self._budget_used = _Gauge(
            "tokenmeter_budget_used_tokens",
            "Used (settled plus in-flight reservations) in the current window.", budget,
            registry=r, multiprocess_mode="mostrecent",
        )
        self._budget_remaining = _Gauge(
            "tokenmeter_budget_remaining_tokens", "Limit minus used in the current window.",
            budget, registry=r, multiprocess_mode="mostrecent",
        )
        # The users' cost windows, and the teams' windows (the counters a team's users share),
        # in their own families: tokens and USD are not summed in one family, and a team is not a
        # user. Limits of 0 or less are set too; the rules divide by `> 0` only.
        team = ("team", "window")
        self._budget_usd = _BudgetPair(
            _Gauge("tokenmeter_budget_used_usd",
                   "Used (settled plus in-flight reservations) in the current cost window, USD.",
                   budget, registry=r, multiprocess_mode="mostrecent"),
            _Gauge("tokenmeter_budget_limit_usd", "Configured limit of a cost window, USD.",
                   budget, registry=r, multiprocess_mode="mostrecent"),
            NANOS_PER_USD)
        self._team_budget = _BudgetPair(
            _Gauge("tokenmeter_team_budget_used_tokens",
                   "A team's use (settled plus in-flight reservations) in the current window.",
                   team, registry=r, multiprocess_mode="mostrecent"),
            _Gauge("tokenmeter_team_budget_limit_tokens",
                   "Configured limit of a team's budget window.", team, registry=r,
                   multiprocess_mode="mostrecent"))
        self._team_budget_usd = _BudgetPair(
            _Gauge("tokenmeter_team_budget_used_usd",
                   "A team's use in the current cost window, USD.", team, registry=r,
                   multiprocess_mode="mostrecent"),
            _Gauge("tokenmeter_team_budget_limit_usd",
                   "Configured limit of a team's cost window, USD.", team, registry=r,
                   multiprocess_mode="mostrecent"),
            NANOS_PER_USD)
        self._budget_refusals = _Counter(
            "tokenmeter_budget_refusals", "Requests refused by a budget limit.",
            ("user", "limit"), registry=r,
        )
        self._budget_reserved = _Counter(
            "tokenmeter_budget_reserved_tokens",
            "Tokens reserved before requests went upstream (top-ups included), by admission "
            "policy.", ("user", "policy"), registry=r,
        )
        self._budget_overreserved = _Counter(
            "tokenmeter_budget_overreserved_tokens",
            "Reserved minus actual tokens, released at settlement, by admission policy.",
            ("user", "policy"), registry=r,
        )
        self._budget_clamped = _Counter(
            "tokenmeter_budget_clamped_requests",
            "Requests admitted with a lower output cap (admission: clamp), by the window that "
            "left the least room.", budget, registry=r,
        )
        self._budget_clamped_tokens = _Counter(
            "tokenmeter_budget_clamped_tokens",
            "Output tokens cut from requests' caps by clamping (asked for minus granted).",
            budget, registry=r,
        )
        self._budget_topups = _Counter(
            "tokenmeter_budget_topups",
            "Reservation top-ups of streams under admission: estimate, by outcome (granted, "
            "refused: no room left in a window, gone: the reservation had been reaped, "
            "unavailable: the store failed and the proxy fails closed).",
            ("user", "outcome"), registry=r,
        )
        self._budget_topup_tokens = _Counter(
            "tokenmeter_budget_topup_tokens",
            "Output tokens added to streams' reservations by top-ups.", ("user",), registry=r,
        )
        self._budget_streams_ended = _Counter(
            "tokenmeter_budget_streams_ended",
            "Streams ended mid-way because their quota could not be topped up, by window.",
            budget, registry=r,
        )
        self._threshold_crossings = _Counter(
            "tokenmeter_budget_threshold_crossings",
            "Users crossing a notice threshold of their daily quota.", ("user", "threshold"),
            registry=r,
        )
        self._store_errors = _Counter(
            "tokenmeter_store_errors", "Budget store operations that failed.", ("op",),
            registry=r,
        )
        self._store_latency = _Histogram(
            "tokenmeter_store_latency_seconds", "Budget store round trip.", ("op",),
            buckets=OVERHEAD_BUCKETS, registry=r,
        )
        self._store_up = _Gauge(
            "tokenmeter_store_up",
            "1 if the budget store answered its last operation or probe (probed every second).",
            registry=r, multiprocess_mode="livemin",
        )
        self._settle_backlog = _Gauge(
            "tokenmeter_settle_backlog",
            "Settlements in the local spool, waiting for the store to come back (each user's "
            "usage while the store was down counts as one).", registry=r,
            multiprocess_mode="livesum",
        )
        self._settle_backlog_tokens = _Gauge(
            "tokenmeter_settle_backlog_tokens",
            "Tokens in the local spool, owed to the store.", registry=r,
            multiprocess_mode="livesum",
        )
        self._settlements_spooled = _Counter(
            "tokenmeter_settlements_spooled",
            "Settlements written to the local spool because the store could not take them.",
            registry=r,
        )
        self._settlements_lost = _Counter(
            "tokenmeter_settlements_lost",
            "Settlements lost for good: the store did not take them and no spool holds them "
            "(none is open, or the process stopped while the spool could not be written).",
            registry=r,
        )
        self._settlement_tokens_lost = _Counter(
            "tokenmeter_settlement_tokens_lost", "Tokens of the settlements lost.", registry=r,
        )
        self._settle_spool_bad_lines = _Counter(
            "tokenmeter_settle_spool_bad_lines",
            "Lines of adopted settlement spool files that could not be read (skipped, logged "
            "with their file and line number; their usage is lost to the budgets).", registry=r,
        )
        self._connections_closed = _Counter(
            "tokenmeter_client_connections_closed",
            "Client connections the proxy refused (max_connections) or cut (header or body "
            "deadline).", ("reason",), registry=r,
        )
        self._connections_open = _Gauge(
            "tokenmeter_client_connections_open", "Client connections open now.", registry=r,
            multiprocess_mode="livesum",
        )
        self._config_reloads = _Counter(
            "tokenmeter_config_reloads", "Configuration reloads by result.", ("result",),
            registry=r,
        )
        self._cost = _Counter(
            "tokenmeter_cost_usd", "Estimated cost from the configured price table.",
            ("model", "user", "type"), registry=r,
        )
        # Tags: only keys with a closed list of values are labels (bounded series); free ones
        # reach the books alone. A family of their own, so no other metric multiplies by them.
        self._tag_tokens = _Counter(
            "tokenmeter_tag_tokens",
            "Tokens by tag (closed-list tag keys only) and type (input, output, cached_input, "
            "cache_creation_input).",
            ("tag", "value", "type"), registry=r,
        )
        self._tag_cost = _Counter(
            "tokenmeter_tag_cost_usd",
            "Estimated cost by tag (closed-list tag keys only), from the price table.",
            ("tag", "value"), registry=r,
        )
        self._tags_dropped = _Counter(
            "tokenmeter_tags_dropped", "Client tags dropped by the `tags:` rules, by reason.",
            ("reason",), registry=r,
        )
        self.ledger = LedgerMetrics(r)
        self._captures = _Counter(
            "tokenmeter_captures", "Requests captured whole (capture:), stored.", registry=r,
        )
        self._capture_bytes = _Counter(
            "tokenmeter_capture_bytes", "Bytes of captures stored (compressed).", registry=r,
        )
        self._captures_dropped = _Counter(
            "tokenmeter_captures_dropped",
            "Captures lost: the queue was full, or the capture store failed to take them.",
            ("reason",), registry=r,
        )
        self._capture_errors = _Counter(
            "tokenmeter_capture_errors", "Capture failures by stage.", ("stage",), registry=r,
        )
        self._cache_errors = _Counter(
            "tokenmeter_cache_errors",
            "Response cache failures by stage; each is a miss (or an answer not stored), "
            "never a failed request.", ("stage",), registry=r,
        )
        self._reconcile_drift = _Gauge(
            "tokenmeter_reconcile_drift_tokens",
            "Ledger total minus the store's counter, beyond what requests in flight explain, "
            "at the last reconcile (by window).", ("window",), registry=r,
            multiprocess_mode="mostrecent",
        )
        self._reconcile_orphans = _Gauge(
            "tokenmeter_reconcile_orphans",
            "Reservations still held past their lease at the last reconcile.", registry=r,
            multiprocess_mode="mostrecent",
        )
        self._reconcile_failures = _Counter(
            "tokenmeter_reconcile_failures",
            "In-process reconcile readings that could not be made, by reason: while they fail "
            "the drift gauge keeps its last value.", ("reason",), registry=r,
        )
        for failure in ReconcileFailure:  # every reason from 0, so an increase shows at once
            self._reconcile_failures.labels(failure.value)
        self._cache_requests = _Counter(
            "tokenmeter_cache_requests",
            "Requests the response cache was consulted for, by result (hit: answered from an "
            "entry; miss: went upstream, the store's failures included; bypass: passed by, "
            "for the reason x-tokenmeter-cache-reason gives: sampled, the client's "
            "Cache-Control, an operation not cached).", ("model", "result"), registry=r,
        )
        self._cache_saved_tokens = _Counter(
            "tokenmeter_cache_saved_tokens",
            "Tokens cache hits did not spend upstream: what the stored answers used, by type "
            "(as tokenmeter_tokens_total's).", ("type", "model", "user"), registry=r,
        )
        self._cache_saved_cost = _Counter(
            "tokenmeter_cache_saved_cost_usd",
            "What cache hits would have cost: the stored answers' usage at the price of the "
            "day of the hit.", ("model", "user"), registry=r,
        )
        # A hit's latency is the proxy's alone: kept apart, so it does not flatter the
        # upstream's TTFT, duration and decode figures.
        self._cache_hit_ttft = _Histogram(
            "tokenmeter_cache_hit_ttft_seconds",
            "Request received to first content token forwarded, for answers served from the "
            "response cache (streaming).", ("model", "operation"), buckets=TTFT_BUCKETS,
            registry=r,
        )
        self._cache_hit_duration = _Histogram(
            "tokenmeter_cache_hit_duration_seconds",
            "End-to-end duration of requests answered from the response cache.",
            ("model", "operation"), buckets=TTFT_BUCKETS, registry=r,
        )
        self._info = _Gauge(
            "tokenmeter_open_mode", "1 when no users are configured and every request is accepted.",
            registry=r, multiprocess_mode="livemostrecent",
        )
        # The request metrics carry `user` only (a team label would multiply every family by
        # it); a dashboard joins on this to filter them by team.
        self._user_info = _Gauge(
            "tokenmeter_user_info",
            'A configured user and their team (team="" for a user without one): 1 while the '
            "user is configured (0 for one a reload dropped, in a multi-worker process, which "
            "cannot remove a series).", ("user", "team"), registry=r,
            multiprocess_mode="livemostrecent",
        )
        self._user_teams: dict[str, str] = {}

    # Labels are passed in their declared order (prometheus_client sorts keyword labels on every
    # call); each verb's signature names them.
    # --- a request -----------------------------------------------------------------------
    def record_request(self, rec: RequestRecord, gaps: list[int]) -> None:
        """One finished request: latency, tokens, the request itself, its cost, its gaps; what
        the response cache did for it. A hit's latency goes to the cache's own histograms."""
        if rec.cache != CACHE_NOT_CONSULTED:
            self._observe_cache(rec)
        if rec.hit:
            self._observe_hit(rec)
        else:
            self._observe_latency(rec)
            self._observe_gaps(rec, gaps)
        self._observe(rec)
        if rec.cost is not None:
            self._observe_cost(rec, rec.cost)
        if rec.tags.items:
            self._observe_tags(rec)

    def tags_dropped(self, reasons: Sequence[TagDrop]) -> None:
        for reason in reasons:
            self._tags_dropped.labels(reason.value).inc()

    def relaying(self, upstream: str) -> InFlight:
        """A request in flight to `upstream` while its answer is relayed."""
        return InFlight(self._active.labels(upstream))

    def retried(self, upstream: str, reason: str) -> None:
        self._retries.labels(upstream, reason).inc()

    def fell_back(self, route: str, to_model: str, reason: str) -> None:
        self._fallbacks.labels(route, to_model, reason).inc()

    def auth_failed(self) -> None:
        self._auth_failures.inc()

    def metering_failed(self, stage: MeteringStage) -> None:
        self._metering_errors.labels(stage.value).inc()

    def metering_failure_counter(self, stage: MeteringStage) -> Callable[[], None]:
        """`metering_failed(stage)` bound once, for a stream's per-chunk path."""
        return self._metering_errors.labels(stage.value).inc

    # --- budgets ---------------------------------------------------------------------------
    def budget_reserved(self, user: str, policy: AdmissionPolicy, tokens: int) -> None:
        self._budget_reserved.labels(user, policy.value).inc(tokens)

    def budget_overreserved(self, user: str, policy: AdmissionPolicy, tokens: int) -> None:
        self._budget_overreserved.labels(user, policy.value).inc(tokens)

    def budget_clamped(self, user: str, window: str, tokens_cut: int) -> None:
        self._budget_clamped.labels(user, window).inc()
        self._budget_clamped_tokens.labels(user, window).inc(tokens_cut)

    def budget_topped_up(self, user: str, outcome: str, tokens: int) -> None:
        self._budget_topups.labels(user, outcome).inc()
        if tokens:
            self._budget_topup_tokens.labels(user).inc(tokens)

    def budget_stream_ended(self, user: str, window: str) -> None:
        self._budget_streams_ended.labels(user, window).inc()

    def budget_refused(self, user: str, limit: str) -> None:
        self._budget_refusals.labels(user, limit).inc()

    def budget_state(self, user: str, window: str, used: int, limit: int | None) -> None:
        self._budget_used.labels(user, window).set(used)
        if limit is not None:
            # A limit changes with the configuration only: set when it does, not twice a
            # request (every worker sets the new one at its next request: `mostrecent` keeps
            # the latest).
            if self._budget_limits.get((user, window)) != limit:
                self._budget_limits[(user, window)] = limit
                self._budget_limit.labels(user, window).set(limit)
            self._budget_remaining.labels(user, window).set(max(0, limit - used))

    def budget_cost_state(self, user: str, window: str, used_nanousd: int,
                          limit_nanousd: int | None) -> None:
        self._budget_usd.set(user, window, used_nanousd, limit_nanousd)

    def team_budget_state(self, team: str, window: str, used: int, limit: int | None) -> None:
        self._team_budget.set(team, window, used, limit)

    def team_budget_cost_state(self, team: str, window: str, used_nanousd: int,
                               limit_nanousd: int | None) -> None:
        self._team_budget_usd.set(team, window, used_nanousd, limit_nanousd)

    def threshold_crossed(self, user: str, threshold: float) -> None:
        self._threshold_crossings.labels(user, f"{threshold:g}").inc()

    # --- the store and the spool ----------------------------------------------------------
    def store_answered(self, op: str, seconds: float | None) -> None:
        if seconds is not None:
            self._store_latency.labels(op).observe(seconds)
        self._store_up.set(1)

    def store_failed(self, op: str) -> None:
        self._store_errors.labels(op).inc()
        self._store_up.set(0)

    def settlement_spooled(self) -> None:
        self._settlements_spooled.inc()

    def settlement_lost(self, tokens: int) -> None:
        self._settlements_lost.inc()
        self._settlement_tokens_lost.inc(tokens)

    def settle_spool_bad_lines(self, lines: int) -> None:
        self._settle_spool_bad_lines.inc(lines)

    def settle_backlog(self, settlements: int, tokens: int) -> None:
        self._settle_backlog.set(settlements)
        self._settle_backlog_tokens.set(tokens)

    # --- the books ------------------------------------------------------------------------
    def ledger_failed(self, stage: LedgerStage) -> None:
        self.ledger.ledger_failed(stage)

    def ledger_dropped(self, rows: int) -> None:
        self.ledger.ledger_dropped(rows)

    # --- capture ---------------------------------------------------------------------------
    def captured(self, count: int, stored_bytes: int) -> None:
        self._captures.inc(count)
        self._capture_bytes.inc(stored_bytes)

    def capture_dropped(self, reason: CaptureDrop, count: int = 1) -> None:
        self._captures_dropped.labels(reason.value).inc(count)

    def capture_failed(self, stage: CaptureStage) -> None:
        self._capture_errors.labels(stage.value).inc()

    def cache_failed(self, stage: CacheStage) -> None:
        self._cache_errors.labels(stage.value).inc()

    def reconciled(self, drift_by_window: dict[str, int], orphans: int) -> None:
        for window, drift in drift_by_window.items():
            self._reconcile_drift.labels(window).set(drift)
        self._reconcile_orphans.set(orphans)

    def reconcile_failed(self, reason: ReconcileFailure) -> None:
        self._reconcile_failures.labels(reason.value).inc()

    # --- the process -----------------------------------------------------------------------
    def connection_closed(self, reason: str) -> None:
        self._connections_closed.labels(reason).inc()

    def connections_open(self, count: Callable[[], float]) -> None:
        if self._shared_dir is None:
            self._connections_open.set_function(count)
        else:  # a callback is not shared between processes: its value is written (refresh)
            self._callbacks.append((self._connections_open, count))
            self._connections_open.set(count())

    # --- exposition ---------------------------------------------------------------------------
    @property
    def shared(self) -> bool:
        """This process is one of several workers whose metrics are summed (multiprocess)."""
        return self._shared_dir is not None

    def publish(self) -> None:
        """A worker's values (callback gauges read now) written into the shared files."""
        for gauge, count in self._callbacks:
            gauge.set(count())
        if self._shared_dir is not None:
            _BufferedValue.flush()

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
                return _merged(self.registry, self._shipper_dir)
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
        `directory` (prometheus_client multiprocess files); None: no longer."""
        self._shipper_dir = directory

    def config_reloaded(self, ok: bool) -> None:
        self._config_reloads.labels("ok" if ok else "error").inc()

    def open_mode(self, is_open: bool) -> None:
        self._info.set(1 if is_open else 0)

    def user_teams(self, teams: Mapping[str, str | None]) -> None:
        """The configured users, each with their team (None: none), as tokenmeter_user_info;
        called at start and on every reload. A user the new version drops, or whose team
        changed, loses the old series: removed, or set to 0 where the multiprocess files
        cannot forget it (every worker sets its own at its own reload)."""
        wanted = {user: team or "" for user, team in teams.items()}
        for user, team in self._user_teams.items():
            if wanted.get(user) != team:
                if self._shared_dir is None:
                    self._user_info.remove(user, team)
                else:
                    self._user_info.labels(user=user, team=team).set(0)
        for user, team in wanted.items():
            if self._user_teams.get(user) != team:
                # By name, not through the memo: a removed child must not come back from it.
                self._user_info.labels(user=user, team=team).set(1)
        self._user_teams = wanted

    def _observe_latency(self, rec: RequestRecord) -> None:
        hl = (rec.model_label, rec.upstream_label, rec.operation)
        f = rec.figures
        self._duration.labels(*hl).observe(f.duration)
        if f.ttft is not None:
            self._ttft.labels(*hl).observe(f.ttft)
        if f.upstream_ttft is not None:
            self._upstream_ttft.labels(*hl).observe(f.upstream_ttft)
        if f.time_per_output_token is not None:
            self._tpot.labels(*hl).observe(f.time_per_output_token)
        if f.output_tokens_per_second is not None:
            self._tokens_per_second.labels(*hl).observe(f.output_tokens_per_second)
        if f.overhead is not None:
            self._overhead.labels(rec.operation).observe(f.overhead)

    def _observe(self, rec: RequestRecord) -> None:
        u = rec.usage
        for kind, value in (
            ("input", u.input_tokens),
            ("output", u.output_tokens),
            ("cached_input", u.cached_input_tokens),
            ("reasoning", u.reasoning_tokens),
            ("cache_creation_input", u.cache_creation_input_tokens),
            ("cache_read_input", u.cache_read_input_tokens),
        ):
            if value:
                self._tokens.labels(kind, rec.model_label, rec.user, u.source).inc(value)
        self._requests.labels(rec.model_label, rec.user, str(rec.status), rec.error_class).inc()

    def _observe_cache(self, rec: RequestRecord) -> None:
        self._cache_requests.labels(rec.model_label, rec.cache).inc()
        u = rec.saved_usage
        for kind, value in (
            ("input", u.input_tokens),
            ("output", u.output_tokens),
            ("cached_input", u.cached_input_tokens),
            ("reasoning", u.reasoning_tokens),
            ("cache_creation_input", u.cache_creation_input_tokens),
        ):
            if value:
                self._cache_saved_tokens.labels(kind, rec.model_label, rec.user).inc(value)
        if rec.saved_cost is not None and rec.saved_cost.nanousd:
            self._cache_saved_cost.labels(rec.model_label, rec.user).inc(
                rec.saved_cost.nanousd / NANOS_PER_USD)

    def _observe_hit(self, rec: RequestRecord) -> None:
        labels = (rec.model_label, rec.operation)
        f = rec.figures
        self._cache_hit_duration.labels(*labels).observe(f.duration)
        if f.ttft is not None:
            self._cache_hit_ttft.labels(*labels).observe(f.ttft)

    def _observe_cost(self, rec: RequestRecord, cost: CostLines) -> None:
        """By the price the tokens paid (`CostLines`: input, cached_input, cache_write_5m,
        cache_write_1h, output): the nano-dollars the ledger sums, in USD."""
        labels = (rec.model_label, rec.user)
        for kind, usd in cost.usd():
            self._cost.labels(*labels, kind).inc(usd)

    def _observe_tags(self, rec: RequestRecord) -> None:
        u = rec.usage
        usd = None if rec.cost is None else rec.cost.nanousd / NANOS_PER_USD
        for tag in rec.tags.closed:
            for kind, value in (("input", u.input_tokens), ("output", u.output_tokens),
                                ("cached_input", u.cached_input_tokens),
                                ("cache_creation_input", u.cache_creation_input_tokens)):
                if value:
                    self._tag_tokens.labels(tag.key, tag.value, kind).inc(value)
            if usd:
                self._tag_cost.labels(tag.key, tag.value).inc(usd)

    def _observe_gaps(self, rec: RequestRecord, counts: list[int]) -> None:
        f = rec.figures
        total = (f.mean_inter_chunk or 0.0) * max(f.content_chunks - 1, 0)
        self._gaps.merge((rec.model_label, rec.upstream_label, rec.operation), counts, total)
