"""proxy.budget.limits.plan: which windows a request counts in, with explicit timestamps."""

from __future__ import annotations

from datetime import datetime
from zoneinfo import ZoneInfo

from proxy.budget import limits as lim
from proxy.config.policy import KeyConfig, Limits, Policy, UserConfig

UTC = ZoneInfo("UTC")


def _plan(user: UserConfig, now: float, model: str = "gpt-4o", tz: str = "UTC",
          key: KeyConfig | None = None) -> lim.Plan:
    policy = Policy(timezone=tz, users={"alice": user})
    limits = lim.effective_limits(user, key, policy.defaults, "ci" if key else None)
    return lim.plan(policy, "alice", limits, model, now)


def _limited(p: lim.Plan) -> dict[tuple[str, str], int | None]:
    """Limits by (storage scope, window name): the strings the store sees."""
    return {(str(w.scope), w.name.value): w.limit for w in p.windows if w.limit is not None}


def test_daily_totals_always_counted_and_limits_added() -> None:
    now = datetime(2026, 3, 1, 12, 0, 30, tzinfo=UTC).timestamp()
    p = _plan(UserConfig(daily_tokens=100, requests_per_minute=5), now)
    # The user's daily totals are counted even unlimited (`tokenmeter usage` reads them); a
    # limit on one makes it the same single counter, now limited.
    unlimited = {w.name for w in p.windows if w.limit is None}
    assert unlimited == {"daily_input_tokens", "daily_output_tokens"}
    assert len({(w.scope, w.name) for w in p.windows}) == len(p.windows) == 4
    assert _limited(p) == {("u", "daily_tokens"): 100, ("u", "requests_per_minute"): 5}
    minute = next(w for w in p.windows if w.name == "requests_per_minute")
    assert minute.resets_at == datetime(2026, 3, 1, 12, 1, tzinfo=UTC).timestamp()
    assert minute.measure is lim.Measure.REQUESTS
    # Every key of the user lives in one Redis Cluster slot.
    assert all(w.key.startswith(p.slot + ":") for w in p.windows)
    assert p.slot.endswith("{alice}")


def test_day_boundary_is_local_midnight_in_the_zone() -> None:
    berlin = ZoneInfo("Europe/Berlin")
    before = datetime(2026, 12, 2, 23, 59, 30, tzinfo=berlin).timestamp()
    p = _plan(UserConfig(daily_tokens=40), before, tz="Europe/Berlin")
    day = next(w for w in p.windows if w.name == "daily_tokens" and w.limit == 40)
    assert day.resets_at == datetime(2026, 12, 3, tzinfo=berlin).timestamp()
    assert day.resets_at - before == 30
    after = _plan(UserConfig(daily_tokens=40), before + 31, tz="Europe/Berlin")
    day_after = next(w for w in after.windows if w.name == "daily_tokens" and w.limit == 40)
    assert day_after.key != day.key  # a new day is a new counter
    assert "20261202" in day.key and "20261203" in day_after.key


def test_dst_day_is_23_hours_long() -> None:
    berlin = ZoneInfo("Europe/Berlin")
    start = datetime(2026, 3, 29, 0, 0, 1, tzinfo=berlin).timestamp()  # clocks go forward
    day = next(w for w in _plan(UserConfig(), start, tz="Europe/Berlin").windows
               if w.name == "daily_tokens")
    assert day.resets_at - start == 23 * 3600 - 1


def test_key_scope_counts_on_its_own_counters_too() -> None:
    key = KeyConfig(key="sk-alice-ci-0123456789", name="ci", daily_tokens=20,
                    max_concurrent_requests=1, max_output_tokens=8)
    user = UserConfig(keys=[key], daily_tokens=1000, max_output_tokens=50)
    p = _plan(user, 0.0, key=key)
    limited = _limited(p)
    assert limited[("u", "daily_tokens")] == 1000
    key_scopes = [s for (s, n) in limited if s != "u"]
    assert key_scopes and all("ci" in s for s in key_scopes)
    assert p.output_cap == 8  # the narrower of user and key
    assert [f.limit for f in p.in_flight] == [None, 1]  # the user's first, always


def test_the_first_matching_model_group_applies() -> None:
    user = UserConfig(model_limits={
        "o1*": Limits(daily_tokens=30, max_output_tokens=8),
        "*": Limits(daily_tokens=999),
    })
    p = _plan(user, 0.0, model="o1-mini")
    groups = {(s, n): v for (s, n), v in _limited(p).items() if s != "u"}
    assert list(groups.values()) == [30]
    assert p.output_cap == 8
    other = _plan(user, 0.0, model="gpt-4o")
    assert [v for (s, _), v in _limited(other).items() if s != "u"] == [999]


def test_in_flight_limit_and_unenforced_plan() -> None:
    p = _plan(UserConfig(max_concurrent_requests=2, daily_tokens=10), 0.0)
    assert [f.limit for f in p.in_flight] == [2]
    assert p.needs_prompt_estimate
    open_plan = p.unenforced()
    assert all(w.limit is None for w in open_plan.windows)
    assert [f.limit for f in open_plan.in_flight] == [None]
    assert open_plan.output_cap is None


def test_amount_by_measure() -> None:
    p = _plan(UserConfig(daily_input_tokens=1, daily_output_tokens=1, requests_per_minute=1), 0.0)
    by_name = {w.name: lim.amount(w, 7, 3) for w in p.windows}
    assert by_name == {"daily_tokens": 10, "daily_input_tokens": 7, "daily_output_tokens": 3,
                       "requests_per_minute": 1}
