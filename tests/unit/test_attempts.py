"""proxy.routing.attempts: the upstream's requested wait and the backoff between retries."""

from __future__ import annotations

import email.utils
import random

import pytest

from proxy.config.load import RetryConfig
from proxy.routing.attempts import backoff_s, retry_after_s


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
