"""proxy.routing.attempts: the upstream's requested wait, the backoff between retries, and the
candidates a request tries in order."""

from __future__ import annotations

import email.utils
import random

import pytest

from proxy.config.load import RetryConfig, parse_config
from proxy.routing.attempts import LatencyTracker, backoff_s, candidates, retry_after_s
from proxy.routing.upstream import Router

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"retry-after-ms": "1500"}, 1.5),
        ({"retry-after-ms": "250", "retry-after": "9"}, 0.25),  # OpenAI's ms header wins
        ({"retry-after-ms": "nan", "retry-after": "2"}, 2.0),  # unreadable ms: the other one
        ({"retry-after-ms": "-1", "retry-after": "3"}, 3.0),
        ({"retry-after": "7"}, 7.0),
        ({"retry-after": "0"}, 0.0),
        ({"retry-after": "-5"}, None),
        ({"retry-after": "inf"}, None),
        ({"retry-after": "soon"}, None),
        ({}, None),
    ],
)
def test_retry_after(headers: dict[str, str], expected: float | None) -> None:
    assert retry_after_s(headers) == expected


def test_retry_after_as_an_http_date() -> None:
    now = 1_800_000_000.0
    date = email.utils.formatdate(now + 42, usegmt=True)
    assert retry_after_s({"retry-after": date}, now=now) == pytest.approx(42)
    past = email.utils.formatdate(now - 42, usegmt=True)
    assert retry_after_s({"retry-after": past}, now=now) == 0.0


def test_backoff_is_exponential_capped_with_equal_jitter() -> None:
    retry = RetryConfig(initial_backoff_ms=100, max_backoff_ms=1000)
    rng = random.Random(7)
    for n, base in [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (5, 1.0), (9, 1.0)]:
        waits = [backoff_s(retry, n, rng) for _ in range(200)]
        assert all(base * 0.5 <= w < base for w in waits), (n, min(waits), max(waits))
        assert max(waits) - min(waits) > base * 0.3  # spread out, not one value


def test_zero_backoff_never_waits() -> None:
    assert backoff_s(RetryConfig(initial_backoff_ms=0), 3, random.Random(1)) == 0.0


def _router(latency: str = "") -> Router:
    text = f"""
upstreams:
  a: {{base_url: "http://a.invalid/v1"}}
  b: {{base_url: "http://b.invalid/v1"}}
models:
  - match: primary
    upstream: a
    fallbacks: [backup, spare, primary]
{latency}
  - {{match: backup, upstream: b}}
  - {{match: spare, upstream: b}}
"""
    return Router(parse_config(text, "t.yaml"))


def test_candidates_are_the_model_then_its_fallbacks_in_order() -> None:
    router = _router()
    route = router.resolve("primary")
    assert route is not None
    plan = candidates(router, route, "primary", LatencyTracker())
    # The model itself is not tried twice, even when listed among its own fallbacks.
    assert [(c.model, c.reason) for c in plan] == [
        ("primary", "primary"), ("backup", "error"), ("spare", "error")]
    assert [c.route.upstream.name for c in plan] == ["a", "b", "b"]


def test_a_slow_primary_goes_last_until_its_samples_age_out() -> None:
    router = _router("    latency_fallback: {ttft_p95_ms: 100, window_s: 60, min_samples: 3}")
    route = router.resolve("primary")
    assert route is not None
    now = [1000.0]
    tracker = LatencyTracker(clock=lambda: now[0])
    assert candidates(router, route, "primary", tracker)[0].model == "primary"  # no verdict
    for _ in range(3):
        tracker.observe(route, 0.5)  # 500 ms TTFT, over the 100 ms threshold
    slow = candidates(router, route, "primary", tracker)
    assert [(c.model, c.reason) for c in slow] == [
        ("backup", "slow"), ("spare", "error"), ("primary", "primary")]
    now[0] += 61  # the slow samples leave the window
    assert candidates(router, route, "primary", tracker)[0].model == "primary"
