"""The collectors behind `proxy.telemetry.metrics`, and what makes them work across processes.

`FastCounter`, `FastGauge` and `FastHistogram` are prometheus_client's, with their labelled
children remembered and the library's per-call checks skipped (the request path makes a few
dozen updates). Workers (`serve --workers N`, proxy/server/workers.py) use prometheus_client's
multiprocess mode: `BufferedValue` keeps a worker's values in memory and writes them into its
files every REFRESH_S; `SharedGapHistogram` is the inter-chunk histogram in those files;
`merged_exposition` adds a ledger shipper's series to a single process's own.
"""

from __future__ import annotations

import os
import time
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from math import isnan
from types import TracebackType
from typing import Any, ClassVar, Self

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, values
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector


class Memo:
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


class FastCounter(Memo, Counter):
    def inc(self, amount: float = 1, exemplar: dict[str, str] | None = None) -> None:
        """prometheus_client's inc without its two checking calls on a labelled child (about
        13 increments a request); a parent, a negative amount and exemplars take its path."""
        if exemplar is not None or amount < 0 or (self._labelnames and not self._labelvalues):
            super().inc(amount, exemplar)
            return
        self._value.inc(amount)


class FastGauge(Memo, Gauge):
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


class FastHistogram(Memo, Histogram):
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


class BudgetPair:
    """A used/limit pair of budget gauges labelled (owner, window), the limit set only when it
    changes (as `Metrics.budget_state` does for the users' token windows). `scale` turns the
    store's units into the gauges' (nano-dollars into USD)."""

    __slots__ = ("_limit", "_limits", "_scale", "_used")

    def __init__(self, used: FastGauge, limit: FastGauge, scale: float = 1.0) -> None:
        self._used = used
        self._limit = limit
        self._scale = scale
        self._limits: dict[tuple[str, str], int] = {}

    def set(self, owner: str, window: str, used: int, limit: int | None) -> None:
        self._used.labels(owner, window).set(used / self._scale)
        if limit is not None and self._limits.get((owner, window)) != limit:
            self._limits[(owner, window)] = limit
            self._limit.labels(owner, window).set(limit / self._scale)



class GapHistogram(Collector):
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


class SharedGapHistogram:
    """`GapHistogram` for workers: the same series, kept in the multiprocess files of a real
    `Histogram` (whose buckets are stored per bucket, not cumulated, as the arrays come)."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...]) -> None:
        # Not registered: in multiprocess mode /metrics reads the files, not a registry.
        self._histogram = FastHistogram(name, doc, ("model", "upstream", "operation"),
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


class BufferedValue:
    """prometheus_client's value class for a worker: updated in memory, written into the
    multiprocess file by `BufferedValue.flush` (every REFRESH_S, before this worker answers a
    scrape, and at exit) instead of on every update.

    The stock multiprocess value takes a lock, calls getpid and packs into the mmap on every
    inc: about 34 writes per request, 1.7x the single-process cost of the metric updates. Here
    an update is an add and a flag, as cheap as the single-process value. The price: another
    worker's figures on /metrics are up to REFRESH_S old, and a worker killed outright (SIGKILL,
    OOM) loses what it counted in its last REFRESH_S (a single process so killed loses all its
    counters). Single-threaded by design: every metric is updated on the event loop's thread."""

    _multiprocess = True
    _file_class: ClassVar[Any] = None  # the stock multiprocess value class written through
    _pending: ClassVar[list[BufferedValue]] = []  # values changed since the last flush

    __slots__ = ("_dirty", "_file", "_timestamp", "_value")

    def __init__(  # noqa: PLR0913, PLR0917  prometheus_client's ValueClass signature
        self, typ: str, metric_name: str, name: str, labelnames: Sequence[str],
        labelvalues: Sequence[str], help_text: str, **kwargs: Any,
    ) -> None:
        self._file = BufferedValue._file_class(typ, metric_name, name, labelnames, labelvalues,
                                                help_text, **kwargs)
        self._value: float = self._file.get()
        self._timestamp: float | None = None
        self._dirty = False

    def inc(self, amount: float) -> None:
        self._value += amount
        if not self._dirty:
            self._dirty = True
            BufferedValue._pending.append(self)

    def set(self, value: float, timestamp: float | None = None) -> None:
        self._value = value
        self._timestamp = timestamp  # mostrecent gauges: the newest write wins across workers
        if not self._dirty:
            self._dirty = True
            BufferedValue._pending.append(self)

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


def merged_exposition(registry: CollectorRegistry, directory: str) -> bytes:
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
