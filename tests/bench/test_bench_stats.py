"""The pure figures of `tokenmeter bench`: percentiles, TPOT, goodput, aggregation, ratios."""

from __future__ import annotations

import itertools
import math
import random
from typing import Any

import pytest

from proxy.bench.stats import (
    Dist,
    RequestResult,
    aggregate,
    compare,
    meets_slo,
    parse_slo,
    percentile,
    tpot,
)
from proxy.bench.workload import generate_prompt, poisson_arrivals
from proxy.protocol.tokenizer import count_text


def ok(ttft: float, e2e: float, tokens: int, **kw: Any) -> RequestResult:
    return RequestResult(endpoint="a", load=1, prompt_tokens=8, start=0.0, ok=True, ttft=ttft,
                         e2e=e2e, usage_output_tokens=tokens, local_output_tokens=tokens,
                         **kw)


def test_percentile_interpolates_between_closest_ranks() -> None:
    data = [15.0, 20, 35, 40, 50]
    assert percentile(data, 0) == 15 and percentile(data, 100) == 50
    assert percentile(data, 50) == 35
    assert percentile(data, 40) == pytest.approx(29.0)  # rank 1.6: 20 + 0.6 * 15
    assert percentile(data, 90) == pytest.approx(46.0)
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile(data, 101)


def test_dist_summarises_unsorted_values() -> None:
    d = Dist.of([5.0, 1, 4, 2, 3])
    assert (d.n, d.min, d.p50, d.max, d.mean) == (5, 1, 3, 5, 3)
    assert d.p10 == pytest.approx(1.4) and d.p90 == pytest.approx(4.6)
    assert Dist.of([]).n == 0 and math.isnan(Dist.of([]).p50)


def test_tpot_is_decode_time_over_tokens_after_the_first() -> None:
    assert tpot(e2e=1.05, ttft=0.05, output_tokens=101) == pytest.approx(0.01)
    assert tpot(e2e=1.0, ttft=0.5, output_tokens=1) is None
    assert ok(0.05, 1.05, 101).tpot == pytest.approx(0.01)
    assert ok(0.05, 1.05, 101, stream=False).tpot is None
    # The server's usage wins over the local count.
    r = RequestResult(endpoint="a", load=1, prompt_tokens=8, start=0, ok=True, ttft=0.0, e2e=1.0,
                      usage_output_tokens=11, local_output_tokens=21)
    assert r.output_tokens == 11 and r.tpot == pytest.approx(0.1)


def test_parse_slo_units() -> None:
    assert parse_slo("ttft=200ms,tpot=5ms,e2e=2s") == {"ttft": 0.2, "tpot": 0.005, "e2e": 2.0}
    assert parse_slo("tpot=500us, ttft=150") == {"tpot": 0.0005, "ttft": 0.15}
    for bad in ("ttft", "speed=1ms", "ttft=fast", "ttft=-1ms", "ttft=0"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_goodput_counts_requests_meeting_every_slo() -> None:
    fast = ok(0.05, 0.15, 101)  # tpot 1 ms
    slow_start = ok(0.30, 0.40, 101)  # tpot 1 ms, ttft too long
    slow_decode = ok(0.05, 2.05, 101)  # tpot 20 ms
    failed = RequestResult(endpoint="a", load=1, prompt_tokens=8, start=0, ok=False, status=500,
                           error_class="server_error")
    slo = parse_slo("ttft=200ms,tpot=5ms")
    assert [meets_slo(r, slo) for r in (fast, slow_start, slow_decode, failed)] == [
        True, False, False, False]
    st = aggregate([fast, slow_start, slow_decode, failed], endpoint="a", mode="concurrency",
                   load=1, prompt_tokens=8, duration_s=2.0, slo=slo)
    assert st.goodput == pytest.approx(0.5) and st.goodput_fraction == pytest.approx(0.25)
    assert (st.requests, st.ok, st.errors) == (4, 3, 1)
    assert st.errors_by_status == {"500": 1} and st.errors_by_class == {"server_error": 1}
    assert st.request_throughput == pytest.approx(1.5)
    assert st.output_tokens_per_s == pytest.approx(303 / 2)
    assert st.stream_tokens_per_s.p50 == pytest.approx(1000)
    assert st.ttft.p50 == pytest.approx(0.05) and st.e2e.max == pytest.approx(2.05)


def test_usage_difference_and_itl() -> None:
    a = RequestResult(endpoint="a", load=1, prompt_tokens=8, start=0, ok=True, ttft=0.1,
                      e2e=0.2, itl=(0.01, 0.03), usage_output_tokens=100, local_output_tokens=90)
    b = RequestResult(endpoint="a", load=1, prompt_tokens=8, start=0, ok=True, ttft=0.1,
                      e2e=0.2, itl=(0.02,), usage_output_tokens=None, local_output_tokens=50)
    st = aggregate([a, b], endpoint="a", mode="concurrency", load=1, prompt_tokens=8,
                   duration_s=1.0)
    assert (st.usage_output_tokens, st.local_output_tokens, st.usage_reported) == (100, 90, 1)
    assert st.usage_diff_tokens == -10 and st.usage_diff_pct == pytest.approx(-10.0)
    assert st.itl.n == 3 and st.itl.p50 == pytest.approx(0.02)
    assert st.goodput is None
    assert st.output_tokens_per_s == pytest.approx(150)  # usage where reported, else local


def test_compare_ratios_and_deltas() -> None:
    base = aggregate([ok(0.06, 0.16, 101)], endpoint="proxy", mode="concurrency", load=1,
                     prompt_tokens=8, duration_s=1.0)
    other = aggregate([ok(0.05, 0.15, 101)], endpoint="direct", mode="concurrency", load=1,
                      prompt_tokens=8, duration_s=1.0)
    c = compare(base, other)
    assert c.ratios["ttft_p50"] == pytest.approx(1.2)
    assert c.deltas["ttft_p50"] == pytest.approx(0.01)
    assert c.ratios["stream_tokens_per_s_p50"] == pytest.approx(1.0)
    assert c.ratios["output_tokens_per_s"] == pytest.approx(1.0)


def test_generated_prompts_have_the_exact_token_count() -> None:
    rng = random.Random(1)
    for model in ("gpt-4o", "gpt-4"):
        for n in (1, 7, 300):
            p = generate_prompt(n, model, rng)
            assert p.tokens == n == count_text(model, p.messages[0]["content"])
    a, b = generate_prompt(50, "gpt-4o", rng), generate_prompt(50, "gpt-4o", rng)
    assert a.messages[0]["content"][:40] != b.messages[0]["content"][:40]


def test_poisson_arrivals_have_the_asked_mean_rate() -> None:
    gen = poisson_arrivals(50.0, random.Random(3))
    times = [next(gen) for _ in range(5001)]
    assert times[0] == 0 and all(b > a for a, b in itertools.pairwise(times))
    assert 5000 / times[-1] == pytest.approx(50.0, rel=0.05)
