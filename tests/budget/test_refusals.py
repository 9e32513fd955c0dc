"""proxy.budget.refusals: a Refusal value rendered as OpenAI's 429, by kind."""

from __future__ import annotations

from datetime import datetime
from zoneinfo import ZoneInfo

import pytest

from proxy.budget import limits as lim
from proxy.budget.refusals import Refusal, RefusalKind, render
from proxy.budget.store import InFlightLimit, Scope, ScopeKind
from proxy.config.policy import Policy, UserConfig

pytestmark = pytest.mark.unit

NOW = datetime(2026, 3, 1, 12, 0, 30, tzinfo=ZoneInfo("UTC")).timestamp()


def _plan() -> lim.Plan:
    user = UserConfig(daily_tokens=100, tokens_per_minute=50, max_concurrent_requests=2)
    policy = Policy(users={"alice": user})
    return lim.plan(policy, "alice", lim.effective_limits(user, policy.defaults),
                    "gpt-4o", NOW)


def _window(plan: lim.Plan, name: lim.WindowName) -> lim.Window:
    return next(w for w in plan.windows if w.name is name and w.limit is not None)


def test_a_spent_daily_quota_is_not_retried() -> None:
    plan = _plan()
    used = tuple(90 for _ in plan.windows)
    refusal = Refusal("alice", plan.windows, used, _window(plan, lim.WindowName.DAILY_TOKENS),
                      30, None)
    assert refusal.kind is RefusalKind.QUOTA
    err = render(refusal, NOW, "UTC")
    assert (err.status, err.type, err.code) == (429, "insufficient_quota", "daily_quota_exceeded")
    assert err.headers["x-should-retry"] == "false"
    assert err.headers["Retry-After"] == str(12 * 3600 - 30)  # until local midnight
    assert "10 of 100 left" in err.message and "needs up to 30" in err.message


def test_a_full_minute_is_retried_after_it_rolls_over() -> None:
    plan = _plan()
    refusal = Refusal("alice", plan.windows, tuple(0 for _ in plan.windows),
                      _window(plan, lim.WindowName.TOKENS_PER_MINUTE), 60, None)
    assert refusal.kind is RefusalKind.RATE
    err = render(refusal, NOW, "UTC")
    assert (err.type, err.code) == ("tokens", "rate_limit_exceeded")
    # 60 can never fit a limit of 50: the client is told, and told not to retry.
    assert "can never fit" in err.message and err.headers["x-should-retry"] == "false"


def test_a_full_in_flight_set_names_the_key() -> None:
    plan = _plan()
    held = InFlightLimit(Scope(ScopeKind.KEY, "ci"), 2)
    refusal = Refusal("alice", plan.windows, tuple(0 for _ in plan.windows), None, 0, held)
    assert refusal.kind is RefusalKind.CONCURRENCY
    err = render(refusal, NOW, "UTC")
    assert (err.type, err.code) == ("requests", "concurrency_limit_exceeded")
    assert "(key 'ci')" in err.message and err.headers["Retry-After"] == "1"
