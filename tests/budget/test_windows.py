"""Weekly, monthly, cost and team windows: calendar boundaries in a time zone with a fixed
clock, cost amounts, the Redis Cluster key layout, and the store's side of teams."""

from __future__ import annotations

from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from redis.crc import key_slot

from proxy.budget import limits as lim
from proxy.budget.refusals import Refusal, RefusalKind, render, unpriced, usd
from proxy.budget.store import MemoryStore, ReserveRequest, ScopeKind, WindowAmount
from proxy.config.policy import KeyConfig, Limits, Policy, Price, StoreConfig, UserConfig
from proxy.cost import CostLines
from proxy.protocol.usage import Usage
from proxy.storage.urls import cluster_url
from tests.helpers import FakeClock

pytestmark = pytest.mark.unit

BERLIN = ZoneInfo("Europe/Berlin")
UTC = ZoneInfo("UTC")


def _at(year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0,
        tz: ZoneInfo = BERLIN) -> float:
    return datetime(year, month, day, hour, minute, second, tzinfo=tz).timestamp()


def _policy(tz: str = "Europe/Berlin", **data: Any) -> Policy:
    return Policy.model_validate({"timezone": tz, **data})


def _plan(policy: Policy, user: str, now: float, model: str = "gpt-4o") -> lim.Plan:
    return lim.plan(policy, user, lim.limits_for(policy, user), model, now)


def _window(p: lim.Plan, name: str, kind: ScopeKind = ScopeKind.USER) -> lim.Window:
    return next(w for w in p.windows
                if w.name == name and w.scope.kind is kind and w.limit is not None)


ALICE_WEEK_MONTH: dict[str, Any] = {"users": {"alice": {"weekly_tokens": 700, "monthly_tokens": 3000}}}


# --- weeks ---------------------------------------------------------------------------------------
def test_a_week_starts_on_monday_at_local_midnight() -> None:
    policy = _policy(**ALICE_WEEK_MONTH)
    sunday = _at(2026, 12, 6, 23, 59)
    monday = _at(2026, 12, 7, 0, 0)
    before = _window(_plan(policy, "alice", sunday), "weekly_tokens")
    after = _window(_plan(policy, "alice", monday), "weekly_tokens")
    assert before.key.endswith(":u:weekly_tokens:W2026-49")
    assert after.key.endswith(":u:weekly_tokens:W2026-50")
    assert before.resets_at == monday  # Monday 00:00 in Berlin, i.e. 23:00 UTC on Sunday
    assert after.resets_at == _at(2026, 12, 14)
    assert before.limit == 700 and before.measure is lim.Measure.TOTAL
    # A minute before the Berlin week ends, the UTC week has another hour to go: the zone rules.
    utc = _window(_plan(_policy("UTC", **ALICE_WEEK_MONTH), "alice", sunday), "weekly_tokens")
    assert utc.key.endswith("W2026-49") and utc.resets_at == _at(2026, 12, 7, tz=UTC)


def test_an_iso_week_spans_new_year_with_the_year_of_its_thursday() -> None:
    policy = _policy(**ALICE_WEEK_MONTH)
    new_years_eve = _plan(policy, "alice", _at(2026, 12, 31, 23, 30))
    new_year = _plan(policy, "alice", _at(2027, 1, 1, 0, 30))
    # Same ISO week (2026-W53): one weekly counter runs on; the month is a new one.
    assert (_window(new_years_eve, "weekly_tokens").key
            == _window(new_year, "weekly_tokens").key)
    assert _window(new_year, "weekly_tokens").key.endswith("W2026-53")
    assert _window(new_years_eve, "monthly_tokens").key.endswith("M202612")
    assert _window(new_year, "monthly_tokens").key.endswith("M202701")
    assert _window(new_year, "weekly_tokens").resets_at == _at(2027, 1, 4)


def test_a_dst_week_and_month_are_an_hour_short_or_long() -> None:
    policy = _policy(**ALICE_WEEK_MONTH)
    # Clocks go forward on Sunday 29 March 2026: that week and that month lose an hour.
    spring = _plan(policy, "alice", _at(2026, 3, 23, 0, 0))
    week = _window(spring, "weekly_tokens")
    assert week.resets_at - _at(2026, 3, 23) == 7 * 86400 - 3600
    month = _window(spring, "monthly_tokens")
    assert month.resets_at == _at(2026, 4, 1)
    assert month.resets_at - _at(2026, 3, 1) == 31 * 86400 - 3600
    # They go back on Sunday 25 October: that month gains one.
    autumn = _window(_plan(policy, "alice", _at(2026, 10, 31, 23, 59, 59)), "monthly_tokens")
    assert autumn.key.endswith("M202610")
    assert autumn.resets_at - _at(2026, 10, 1) == 31 * 86400 + 3600


def test_month_boundary_in_the_zone_and_counter_lifetimes() -> None:
    policy = _policy(**ALICE_WEEK_MONTH)
    last = _at(2026, 11, 30, 23, 59, 59)
    before = _window(_plan(policy, "alice", last), "monthly_tokens")
    after = _window(_plan(policy, "alice", last + 1), "monthly_tokens")
    assert before.key.endswith("M202611") and after.key.endswith("M202612")
    assert before.resets_at == last + 1
    # A month's counter outlives its month by 40 days (`reconcile` reads last month's),
    # a week's by 15.
    assert before.ttl_s == 1 + 40 * 86400
    week = _window(_plan(policy, "alice", last), "weekly_tokens")
    assert week.ttl_s == int(week.resets_at - last) + 15 * 86400


def test_the_calendar_follows_a_clock_that_jumps_back_and_forth() -> None:
    policy = _policy(**ALICE_WEEK_MONTH)
    stamps = []
    for when in (_at(2026, 12, 7, 12), _at(2026, 12, 6, 12), _at(2027, 2, 1, 0, 0, 1),
                 _at(2026, 12, 7, 0, 0)):
        p = _plan(policy, "alice", when)
        stamps.append((_window(p, "weekly_tokens").label, _window(p, "monthly_tokens").label))
    assert stamps == [
        ("u:weekly_tokens:W2026-50", "u:monthly_tokens:M202612"),
        ("u:weekly_tokens:W2026-49", "u:monthly_tokens:M202612"),
        ("u:weekly_tokens:W2027-05", "u:monthly_tokens:M202702"),
        ("u:weekly_tokens:W2026-50", "u:monthly_tokens:M202612"),
    ]


# --- cost ---------------------------------------------------------------------------------------
def test_cost_budgets_are_whole_nanodollars_rounded_down() -> None:
    assert lim.usd_to_nanos(0.1) == 100_000_000  # not 100000000.00000001
    assert lim.usd_to_nanos(12.345678901) == 12_345_678_901
    assert lim.usd_to_nanos(1e-10) == 0
    policy = _policy(users={"alice": {"daily_usd": 0.25, "monthly_usd": 5}})
    p = _plan(policy, "alice", _at(2026, 12, 2, 10))
    day, month = _window(p, "daily_usd"), _window(p, "monthly_usd")
    assert (day.limit, month.limit) == (250_000_000, 5_000_000_000)
    assert day.measure is month.measure is lim.Measure.COST
    assert day.label == "u:daily_usd:20261202" and month.label == "u:monthly_usd:M202612"
    assert p.costed and p.needs_prompt_estimate
    assert lim.amount(day, 10, 20, 4321) == 4321
    assert lim.amount(_window(p, "daily_usd"), 10, 20) == 0
    # Without a cost limit, no plan needs a price.
    assert not _plan(_policy(users={"bob": {"daily_tokens": 5}}), "bob", 0.0).costed


def test_the_worst_case_cost_bounds_any_real_one() -> None:
    price = Price(input=2.5, output=10.0, cached_input=1.25)
    worst = lim.reserve_cost(price, 1000, 500)
    assert worst == 1000 * 2500 + 500 * 10_000
    for cached in (0, 10, 1000):
        for out in (0, 1, 500):
            used = Usage(input_tokens=1000, output_tokens=out, cached_input_tokens=cached)
            assert CostLines.of(price, used).nanousd <= worst
    # A cached price above the input price (odd, but configurable): all-cached is the worst.
    odd = Price(input=1.0, output=1.0, cached_input=3.0)
    all_cached = Usage(input_tokens=100, cached_input_tokens=100)
    assert lim.reserve_cost(odd, 100, 0) == CostLines.of(odd, all_cached).nanousd == 300_000


def test_refusals_of_cost_and_longer_windows() -> None:
    policy = _policy(users={"alice": {"daily_usd": 1, "weekly_tokens": 100}})
    now = _at(2026, 12, 6, 22, 0)
    p = _plan(policy, "alice", now)
    used = tuple(999_000_000 if w.measure is lim.Measure.COST else 95 for w in p.windows)
    day = _window(p, "daily_usd")
    err = render(Refusal("alice", p.windows, used, day, 2_500_000, None), now, "Europe/Berlin")
    assert (err.status, err.type, err.code) == (429, "insufficient_quota",
                                                "daily_budget_exceeded")
    assert err.headers["x-should-retry"] == "false"
    assert err.headers["Retry-After"] == "7200"
    assert "Daily cost budget reached for user 'alice'" in err.message
    assert "$0.001 of $1 left" in err.message and "needs up to $0.0025" in err.message
    assert "2026-12-07T00:00:00+01:00" in err.message
    assert err.headers["x-ratelimit-limit-usd-day"] == "1"
    assert err.headers["x-ratelimit-remaining-usd-day"] == "0.001"
    week = _window(p, "weekly_tokens")
    refusal = Refusal("alice", p.windows, used, week, 10, None)
    assert refusal.kind is RefusalKind.QUOTA
    err = render(refusal, now, "Europe/Berlin")
    assert err.code == "weekly_quota_exceeded" and err.headers["x-should-retry"] == "false"
    assert "Weekly tokens limit reached" in err.message and "5 of 100 left" in err.message
    assert err.headers["x-ratelimit-remaining-tokens-week"] == "5"
    assert usd(0) == "0" and usd(1) == "0.000000001" and usd(12_500_000_000) == "12.5"


def test_a_model_without_a_price_is_refused_with_an_openai_error() -> None:
    policy = _policy(users={"alice": {"monthly_usd": 3}})
    window = _window(_plan(policy, "alice", 0.0), "monthly_usd")
    err = unpriced("alice", "gpt-9", window)
    body = err.to_body()["error"]
    assert err.status == 429 and body["code"] == "model_not_priced"
    assert "`gpt-9` has no price" in str(body["message"])
    assert err.headers["x-should-retry"] == "false"


# --- teams --------------------------------------------------------------------------------------
TEAM_POLICY: dict[str, Any] = {
    "teams": {"platform": {"daily_tokens": 1000, "monthly_usd": 2, "max_concurrent_requests": 5,
                           "max_output_tokens": 64}},
    "users": {
        "alice": {"team": "platform", "daily_tokens": 400, "max_concurrent_requests": 2,
                  "keys": [{"key": "sk-alice-ci-0123456789", "name": "ci", "weekly_tokens": 50,
                            "max_concurrent_requests": 1}],
                  "model_limits": {"o1*": {"monthly_tokens": 90}}},
        "bob": {"team": "platform"},
        "carol": {"team": "unlisted"},
        "dave": {},
    },
}


def _all_keys(p: lim.Plan) -> list[str]:
    """Every key one reserve and its settle touch in Redis (store_redis's layout)."""
    sets = [f"{p.slot}:inflight:{f.part}" for f in p.in_flight[1:]]
    return [f"{p.slot}:inflight", f"{p.slot}:reserved", f"{p.slot}:sets", f"{p.slot}:done:x",
            *sets, *(w.key for w in p.windows)]


def test_a_team_users_windows_and_the_teams_share_one_cluster_slot() -> None:
    policy = _policy("UTC", **TEAM_POLICY)
    key = KeyConfig(key="sk-alice-ci-0123456789", name="ci", weekly_tokens=50,
                    max_concurrent_requests=1)
    limits = lim.limits_for(policy, "alice", key, "ci")
    p = lim.plan(policy, "alice", limits, "o1-mini", _at(2026, 12, 2, 10, tz=UTC))
    assert p.slot == "tokenmeter:{t:platform}"
    labels = {w.label: w.limit for w in p.windows}
    assert labels == {
        "u:daily_tokens:20261202": 400, "u:daily_input_tokens:20261202": None,
        "u:daily_output_tokens:20261202": None, "k.ci:weekly_tokens:W2026-49": 50,
        "m.o1*:monthly_tokens:M202612": 90,
        "t.platform:daily_tokens:20261202": 1000, "t.platform:daily_input_tokens:20261202": None,
        "t.platform:daily_output_tokens:20261202": None,
        "t.platform:monthly_usd:M202612": 2_000_000_000,
    }
    for w in p.windows:
        base = p.slot if w.scope.kind is ScopeKind.TEAM else f"{p.slot}:alice"
        assert w.key == f"{base}:{w.label}"
    assert len({key_slot(k.encode()) for k in _all_keys(p)}) == 1
    assert p.costed and p.output_cap == 64  # the team's cap is the narrowest
    # The team's set first (it holds every reservation of the slot), then the user's and the
    # key's, named for the user.
    assert [(f.part, f.limit) for f in p.in_flight] == [
        ("t.platform", 5), ("alice:u", 2), ("alice:k.ci", 1)]
    bob = _plan(policy, "bob", _at(2026, 12, 2, 10, tz=UTC))
    assert bob.slot == p.slot
    shared = {w.key for w in bob.windows if w.scope.kind is ScopeKind.TEAM}
    assert shared == {w.key for w in p.windows if w.scope.kind is ScopeKind.TEAM}
    assert [(f.part, f.limit) for f in bob.in_flight] == [("t.platform", 5)]


def test_an_unlisted_team_is_counted_unlimited_and_no_team_keeps_the_users_slot() -> None:
    policy = _policy("UTC", **TEAM_POLICY)
    carol = _plan(policy, "carol", 0.0)
    assert carol.slot == "tokenmeter:{t:unlisted}"
    team = [w for w in carol.windows if w.scope.kind is ScopeKind.TEAM]
    assert {w.name for w in team} == {"daily_tokens", "daily_input_tokens",
                                      "daily_output_tokens"}
    assert all(w.limit is None for w in team) and not carol.costed
    dave = _plan(policy, "dave", 0.0)
    assert dave.slot == "tokenmeter:{dave}"  # unchanged by teams existing
    assert all(w.key == f"{dave.slot}:{w.label}" for w in dave.windows)
    assert lim.daily_key("tokenmeter", "dave", "daily_tokens", "19700101") == (
        "tokenmeter:{dave}:u:daily_tokens:19700101")
    assert lim.daily_key("tokenmeter", "carol", "daily_tokens", "19700101", "unlisted") == (
        "tokenmeter:{t:unlisted}:carol:u:daily_tokens:19700101")


def test_team_names_are_plain_names() -> None:
    with pytest.raises(ValueError, match="team"):
        _policy(users={"alice": {"team": "a}b"}})
    with pytest.raises(ValueError, match="team name"):
        _policy(teams={"a b": {}})


def test_windows_at_lists_every_calendar_counter_of_a_user_and_team() -> None:
    policy = _policy("UTC", **TEAM_POLICY)
    now = _at(2026, 12, 2, 10, tz=UTC)
    found = {w.label: w for w in lim.windows_at(policy, "alice", now)}
    assert set(found) == {
        "u:daily_tokens:20261202", "u:daily_input_tokens:20261202",
        "u:daily_output_tokens:20261202", "k.ci:weekly_tokens:W2026-49",
        "m.o1*:monthly_tokens:M202612", "t.platform:daily_tokens:20261202",
        "t.platform:daily_input_tokens:20261202", "t.platform:daily_output_tokens:20261202",
        "t.platform:monthly_usd:M202612",
    }
    alice_plan = lim.plan(policy, "alice", lim.limits_for(policy, "alice"), "gpt-4o", now)
    assert found["u:daily_tokens:20261202"].key == _window(alice_plan, "daily_tokens").key
    # Per-minute windows are not the books'; a user without limits still has daily totals.
    minute = _policy("UTC", users={"erin": {"tokens_per_minute": 5}})
    assert [w.label for w in lim.windows_at(minute, "erin", now)] == [
        "u:daily_tokens:20261202", "u:daily_input_tokens:20261202",
        "u:daily_output_tokens:20261202"]


def test_a_spooled_window_without_a_label_gets_one() -> None:
    policy = _policy("UTC", users={"alice": {"daily_tokens": 5}})
    w = _window(_plan(policy, "alice", 0.0), "daily_tokens")
    obj = w.to_json()
    assert lim.Window.from_json(obj) == w
    del obj["label"]
    assert lim.Window.from_json(obj) == w


# --- the store's side of teams ------------------------------------------------------------------
async def test_a_dead_members_reservation_is_reaped_by_another_members_request() -> None:
    """Reservations of a team's users share the team's slot, so a proxy that died holding
    alice's reservation does not keep the team's quota from bob beyond its lease."""
    clock = FakeClock(_at(2026, 12, 2, 10, tz=UTC))
    store = MemoryStore(clock)
    policy = _policy("UTC", teams={"platform": {"daily_tokens": 100}},
                     users={"alice": {"team": "platform"}, "bob": {"team": "platform"}})
    alice = _plan(policy, "alice", clock.now)
    bob = _plan(policy, "bob", clock.now)

    def entries(p: lim.Plan, tokens: int) -> tuple[WindowAmount, ...]:
        return tuple(WindowAmount(w.key, w.limit, lim.amount(w, tokens, 0), w.ttl_s) for w in p.windows)

    assert (await store.reserve(alice.slot, "dead", ReserveRequest(entries(alice, 80), alice.in_flight), 30)).ok
    assert await store.leases(alice.slot) == {"dead": clock.now + 30}
    refused = await store.reserve(bob.slot, "b1", ReserveRequest(entries(bob, 30), bob.in_flight), 30)
    assert not refused.ok
    assert bob.windows[refused.refused_entry or 0].scope.kind is ScopeKind.TEAM
    clock.now += 31  # alice's proxy never settled nor renewed
    assert (await store.reserve(bob.slot, "b1", ReserveRequest(entries(bob, 30), bob.in_flight), 30)).ok
    assert set(await store.leases(bob.slot)) == {"b1"}
    team_key = next(w.key for w in bob.windows
                    if w.scope.kind is ScopeKind.TEAM and w.name == "daily_tokens")
    assert await store.read([team_key]) == (30,)


def test_a_cluster_is_named_by_its_url_scheme() -> None:
    assert cluster_url("redis+cluster://10.0.0.1:7000") == "redis://10.0.0.1:7000"
    assert cluster_url("rediss+cluster://u:p@h:7000/0") == "rediss://u:p@h:7000/0"
    assert cluster_url("redis://h:6379/0") is None
    assert StoreConfig(url="redis+cluster://h:7000").url == "redis+cluster://h:7000"
    with pytest.raises(ValueError, match="redis\\+cluster://"):
        StoreConfig(url="cluster://h:7000")


def test_team_limits_default_nothing() -> None:
    assert lim.counts(None) == dict.fromkeys(Limits.model_fields)
    assert UserConfig(team="x").team == "x"
