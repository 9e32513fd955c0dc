"""proxy.telemetry.meter.RequestMeter.figures, driven by explicit timestamps."""

from __future__ import annotations

import pytest

from proxy.telemetry.families import TPOT_BUCKETS
from proxy.telemetry.meter import RequestMeter

pytestmark = pytest.mark.unit


def _meter() -> RequestMeter:
    m = RequestMeter(received=100.0)
    m.upstream_start = m.attempt_start = 100.002
    return m


def test_figures_from_known_timestamps() -> None:
    m = _meter()
    for t in (100.050, 100.060, 100.070, 100.080, 100.090):
        m.content(t)
    m.first_token_sent = 100.051
    m.end = 100.1
    f = m.figures(output_tokens=9)
    assert f.duration == pytest.approx(0.1)
    assert f.overhead == pytest.approx(0.002)
    assert f.ttft == pytest.approx(0.051)
    assert f.upstream_ttft == pytest.approx(0.048)
    assert f.content_chunks == 5
    assert f.mean_inter_chunk == pytest.approx(0.010)
    # Tokens, not chunks: 8 tokens after the first over a 40 ms decode phase.
    assert f.time_per_output_token == pytest.approx(0.040 / 8)
    assert f.output_tokens_per_second == pytest.approx(8 / 0.040)
    gaps = m.gap_buckets()
    assert sum(gaps) == 4 and len(gaps) == len(TPOT_BUCKETS) + 1


def test_no_content_means_no_latency_figures() -> None:
    m = RequestMeter(received=5.0)
    m.end = 6.0
    f = m.figures(output_tokens=0)
    assert f.duration == 1.0 and f.content_chunks == 0
    assert f.ttft is f.upstream_ttft is f.time_per_output_token is f.overhead is None


def test_one_chunk_or_one_token_has_no_decode_rate() -> None:
    m = _meter()
    m.content(100.5)
    assert m.figures(output_tokens=20).time_per_output_token is None
    m.content(100.6)
    assert m.figures(output_tokens=1).output_tokens_per_second is None
    assert m.figures(output_tokens=2).time_per_output_token == pytest.approx(0.1)


def test_finish_keeps_the_first_end() -> None:
    m = RequestMeter(received=0.0)
    m.end = 3.0
    m.finish()
    assert m.end == 3.0
