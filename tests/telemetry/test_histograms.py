"""proxy.telemetry.metrics' collectors skip prometheus_client's per-call checks on labelled
children, and its histograms find their bucket by bisection: the exposition is the library's
own, value for value, whatever is observed (bounds, between them, past the last, negative, NaN),
in a single process and in multiprocess mode."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    values,
)
from prometheus_client.mmap_dict import MmapedDict
from prometheus_client.multiprocess import MultiProcessCollector

from proxy.telemetry.collectors import FastCounter, FastGauge, FastHistogram
from proxy.telemetry.families import TPOT_BUCKETS, TTFT_BUCKETS
from proxy.telemetry.metrics import Metrics

AMOUNTS = st.one_of(
    st.sampled_from([*TTFT_BUCKETS, *TPOT_BUCKETS, 0.0, -1.0, 1e9, math.inf, math.nan]),
    st.floats(min_value=-1.0, max_value=100.0, allow_nan=False),
)


def _pair(registry_a: CollectorRegistry, registry_b: CollectorRegistry,
          buckets: tuple[float, ...]) -> tuple[Histogram, Histogram]:
    ours = FastHistogram("h_seconds", "h", ["model"], buckets=buckets, registry=registry_a)
    theirs = Histogram("h_seconds", "h", ["model"], buckets=buckets, registry=registry_b)
    return ours, theirs


@pytest.mark.timeout(60)
@settings(max_examples=200, deadline=None)
@given(st.lists(AMOUNTS, max_size=40), st.sampled_from([TTFT_BUCKETS, TPOT_BUCKETS]))
def test_bisection_exposes_what_the_library_does(amounts: list[float],
                                                 buckets: tuple[float, ...]) -> None:
    a, b = CollectorRegistry(), CollectorRegistry()
    ours, theirs = _pair(a, b, buckets)
    for x in amounts:
        ours.labels("m").observe(x)
        theirs.labels("m").observe(x)
    assert _exposed(a) == _exposed(b)


def _exposed(registry: CollectorRegistry) -> list[bytes]:
    """The exposition, less the `_created` timestamps (each histogram's own clock reading)."""
    return [line for line in generate_latest(registry).splitlines() if b"_created" not in line]


@pytest.mark.timeout(60)
def test_bisection_in_multiprocess_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    amounts = [*TTFT_BUCKETS, 0.0, 0.00049, 0.0011, 61.0, -2.0, math.nan]
    exposed = []
    for name in ("ours", "theirs"):
        with _multiprocess(tmp_path / name, monkeypatch) as d:
            kind = FastHistogram if name == "ours" else Histogram
            h = kind("h_seconds", "h", ["model"], buckets=TTFT_BUCKETS,
                     registry=CollectorRegistry())
            for x in amounts:
                h.labels("m").observe(x)
            exposed.append(_merged(d))
    assert exposed[0] == exposed[1]
    assert b'h_seconds_bucket{le="0.0005",model="m"} 4.0' in exposed[0]  # 0.0005 and below


@pytest.mark.timeout(60)
def test_a_labelled_parent_still_refuses_an_observation() -> None:
    h = FastHistogram("h_seconds", "h", ["model"], registry=CollectorRegistry())
    with pytest.raises(ValueError):
        h.observe(1.0)


@pytest.mark.timeout(60)
def test_mostrecent_gauges_in_multiprocess_mode(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # The budget gauges: `mostrecent`, whose value files carry the time of each set (two
    # workers' values are merged by it). Ours stamps it as the library does.
    exposed = []
    for name in ("ours", "theirs"):
        with _multiprocess(tmp_path / name, monkeypatch) as d:
            kind = FastGauge if name == "ours" else Gauge
            g = kind("g", "g", ["user", "window"], registry=CollectorRegistry(),
                     multiprocess_mode="mostrecent")
            before = time.time()
            for x in (5, 0, 1e12, 7.5):
                g.labels("u", "daily_tokens").set(x)
            exposed.append(_merged(d))
            ((_, (value, stamp)),) = [
                (k, v) for f in d.iterdir()
                for k, v in _read_values(f) if "daily_tokens" in k]
            assert value == 7.5 and before <= stamp <= time.time()  # stamped, as the library
    assert exposed[0] == exposed[1]
    assert b'g{user="u",window="daily_tokens"} 7.5' in exposed[0]
    with pytest.raises(ValueError):
        FastGauge("g2", "g", ["u"], registry=CollectorRegistry(),
               multiprocess_mode="mostrecent").set(1.0)  # a labelled parent is not a series


@contextlib.contextmanager
def _multiprocess(d: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """prometheus_client in multiprocess mode, its value files in `d`, for the block."""
    d.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(d))
    values.ValueClass = values.get_value_class()  # type: ignore[no-untyped-call]
    try:
        yield d
    finally:
        monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR")
        values.ValueClass = values.get_value_class()  # type: ignore[no-untyped-call]


def _merged(d: Path) -> bytes:
    """The exposition the value files in `d` merge into."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(d))  # type: ignore[no-untyped-call]
    return generate_latest(registry)


def _read_values(path: Path) -> list[tuple[str, tuple[float, float]]]:
    """(key, (value, timestamp)) of every series in a multiprocess value file."""
    d = MmapedDict(str(path), read_mode=True)  # type: ignore[no-untyped-call]
    try:
        return [(k, (v, t)) for k, v, t in d.read_all_values()]  # type: ignore[no-untyped-call]
    finally:
        d.close()  # type: ignore[no-untyped-call]


@pytest.mark.timeout(60)
@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(min_value=0.0, max_value=1e6, allow_nan=False), max_size=20),
       st.lists(st.floats(min_value=-1e6, max_value=1e6, allow_nan=False), max_size=20))
def test_counters_and_gauges_expose_what_the_library_does(increments: list[float],
                                                          sets: list[float]) -> None:
    a, b = CollectorRegistry(), CollectorRegistry()
    counters = (FastCounter("c", "c", ["u"], registry=a), Counter("c", "c", ["u"], registry=b))
    gauges = (FastGauge("g", "g", ["u"], registry=a), Gauge("g", "g", ["u"], registry=b))
    for x in increments:
        for counter in counters:
            counter.labels("x").inc(x)
    for x in sets:
        for gauge in gauges:
            gauge.labels("x").set(x)
    assert _exposed(a) == _exposed(b)
    with pytest.raises(ValueError):
        counters[0].labels("x").inc(-1)  # as the library: counters only go up
    with pytest.raises(ValueError):
        gauges[0].set(1.0)  # a labelled parent is not a series


@pytest.mark.timeout(30)
def test_budget_gauges_follow_a_changed_limit() -> None:
    # The limit gauge is set when the limit changes (a reload), not on every request.
    metrics = Metrics()
    metrics.budget_state("ana", "daily_tokens", 10, 100)
    metrics.budget_state("ana", "daily_tokens", 30, 100)
    text = metrics.exposition()
    assert b'tokenmeter_budget_limit_tokens{user="ana",window="daily_tokens"} 100.0' in text
    assert b'tokenmeter_budget_remaining_tokens{user="ana",window="daily_tokens"} 70.0' in text
    metrics.budget_state("ana", "daily_tokens", 40, 250)
    text = metrics.exposition()
    assert b'tokenmeter_budget_limit_tokens{user="ana",window="daily_tokens"} 250.0' in text
    assert b'tokenmeter_budget_used_tokens{user="ana",window="daily_tokens"} 40.0' in text
    assert b'tokenmeter_budget_remaining_tokens{user="ana",window="daily_tokens"} 210.0' in text
