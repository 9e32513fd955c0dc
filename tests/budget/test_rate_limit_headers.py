"""`x-ratelimit-*` headers in OpenAI's style, from a plan's windows and the counters' values."""

from __future__ import annotations

from datetime import datetime
from zoneinfo import ZoneInfo

import pytest

from proxy.budget import limits as lim
from proxy.budget.refusals import rate_limit_headers
from proxy.config.policy import Policy, UserConfig

pytestmark = pytest.mark.unit


def test_headers_for_limited_windows_only() -> None:
    now = datetime(2026, 12, 2, 10, 0, 5, tzinfo=ZoneInfo("UTC")).timestamp()
    user = UserConfig(requests_per_minute=2, daily_tokens=1000)
    policy = Policy(users={"alice": user})
    plan = lim.plan(policy, "alice", lim.effective_limits(user, policy.defaults),
                    "gpt-4o", now)
    used = tuple(2 if w.name == "requests_per_minute" else 1200 for w in plan.windows)
    h = rate_limit_headers(plan.windows, used, now)
    assert h["x-ratelimit-limit-requests"] == "2"
    assert h["x-ratelimit-remaining-requests"] == "0"
    assert h["x-ratelimit-reset-requests"] == "55s"
    assert h["x-ratelimit-limit-tokens-day"] == "1000"
    assert h["x-ratelimit-remaining-tokens-day"] == "0"  # never negative
    assert h["x-ratelimit-reset-tokens-day"] == "13h59m55s"
    assert not any("input-tokens" in k for k in h)  # unlimited windows send nothing
