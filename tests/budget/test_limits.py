"""proxy.budget.limits.plan: which windows a request counts in, with explicit timestamps."""

from __future__ import annotations

import hashlib
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from proxy.budget import limits as lim
from proxy.budget.store import Scope, ScopeKind
from proxy.config.policy import KeyConfig, Limits, Policy, UserConfig

pytestmark = pytest.mark.unit

UTC = ZoneInfo("UTC")


def _plan(user: UserConfig, now: float, model: str = "gpt-4o", tz: str = "UTC",
          key: KeyConfig | None = None) -> lim.Plan:
    policy = Policy(timezone=tz, users={"alice": user})
    limits = lim.effective_limits(user, policy.defaults, lim.KeyOf(key, "ci") if key else None)
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
    assert not p.holds_nothing
    open_plan = p.unenforced()  # metered only: nothing for the store to hold or count
    assert open_plan.windows == () and open_plan.in_flight == ()
    assert open_plan.holds_nothing
    assert open_plan.output_cap is None


def test_amount_by_measure() -> None:
    p = _plan(UserConfig(daily_input_tokens=1, daily_output_tokens=1, requests_per_minute=1), 0.0)
    by_name = {w.name: lim.amount(w, 7, 3) for w in p.windows}
    assert by_name == {"daily_tokens": 10, "daily_input_tokens": 7, "daily_output_tokens": 3,
                       "requests_per_minute": 1}


# --- what reaches `plan`: defaults, keys, model groups, teams ----------------------------------

def _policy(tz: str = "UTC", **data: Any) -> Policy:
    return Policy.model_validate({"timezone": tz, **data})


def _windows(p: lim.Plan) -> dict[str, lim.Window]:
    """The windows by label's scope and name (`u:daily_tokens`, `k.ci:daily_usd`, ...)."""
    return {w.label.rpartition(":")[0]: w for w in p.windows}


def test_the_defaults_limit_every_user_who_sets_nothing_of_their_own() -> None:
    policy = _policy(defaults={"daily_tokens": 500, "requests_per_minute": 9,
                               "max_output_tokens": 32},
                     users={"alice": {"daily_tokens": 70}, "bob": {}})
    for user, daily in (("alice", 70), ("bob", 500), ("nobody", 500)):
        limits = lim.limits_for(policy, user)
        assert limits.user["daily_tokens"] == daily, user
        assert limits.user["requests_per_minute"] == 9 and limits.output_cap == 32
        p = lim.plan(policy, user, limits, "gpt-4o", 0.0)
        assert _limited(p) == {("u", "daily_tokens"): daily, ("u", "requests_per_minute"): 9}
        assert p.output_cap == 32
    # A user outside `users` has no team and no model groups: only the defaults.
    nobody = lim.limits_for(policy, "nobody")
    assert (nobody.team_scope, nobody.model_limits, nobody.key, nobody.key_scope) == (
        None, (), {}, None)
    assert lim.team_of(policy, "nobody") is None
    teams = _policy(users={"alice": {"team": "platform"}, "bob": {}})
    assert [lim.team_of(teams, u) for u in ("alice", "bob", "nobody")] == ["platform", None, None]


def test_every_scopes_window_counts_what_its_name_says() -> None:
    """A key's, a model group's and a team's windows measure tokens, input, output, requests
    or cost as the user's do: a measure lost on the way counts 1 per request."""
    every = {"daily_tokens": 1, "daily_input_tokens": 1, "daily_output_tokens": 1,
             "weekly_tokens": 1, "monthly_tokens": 1, "daily_usd": 1, "monthly_usd": 1,
             "tokens_per_minute": 1, "requests_per_minute": 1}
    policy = _policy(teams={"platform": every},
                     users={"alice": {"team": "platform", "model_limits": {"o1*": every},
                                      "keys": [{"key": "sk-alice-ci-0123456789", "name": "ci",
                                                **every}]}})
    key = policy.users["alice"].key_configs()[0]
    p = lim.plan(policy, "alice", lim.limits_for(policy, "alice", key, "ci"), "o1-mini", 0.0)
    by_scope: dict[str, set[str]] = {}
    for w in p.windows:
        assert w.measure is w.name.measure, w.label
        by_scope.setdefault(w.scope.part, set()).add(w.name.value)
        expected = {lim.Measure.TOTAL: 10, lim.Measure.INPUT: 7, lim.Measure.OUTPUT: 3,
                    lim.Measure.REQUESTS: 1, lim.Measure.COST: 555}[w.name.measure]
        assert lim.amount(w, 7, 3, 555) == expected, w.label
    assert by_scope == {"u": {"daily_tokens", "daily_input_tokens", "daily_output_tokens"},
                        "k.ci": set(every), "m.o1*": set(every), "t.platform": set(every)}


def test_a_team_counts_its_daily_totals_by_measure_even_unlimited() -> None:
    policy = _policy(users={"bob": {"team": "unlisted"}})
    p = lim.plan(policy, "bob", lim.limits_for(policy, "bob"), "gpt-4o", 0.0)
    team = {w.name: w for w in p.windows if w.scope.kind is ScopeKind.TEAM}
    assert set(team) == {"daily_tokens", "daily_input_tokens", "daily_output_tokens"}
    assert [lim.amount(team[n], 7, 3) for n in sorted(team)] == [7, 3, 10]


@pytest.mark.parametrize("where", ["user", "key", "model", "team"])
def test_a_dollar_budget_anywhere_needs_a_price(where: str) -> None:
    """`costed` makes admission look the model's price up; without it a dollar budget of a
    key, a model group or a team would reserve nothing and never refuse."""
    usd = {"daily_usd": 0.5}
    user: dict[str, Any] = {"team": "platform",
                            "keys": [{"key": "sk-alice-ci-0123456789", "name": "ci"}]}
    teams: dict[str, Any] = {"platform": {"daily_tokens": 100}}
    if where == "user":
        user.update(usd)
    elif where == "key":
        user["keys"][0].update(usd)
    elif where == "model":
        user["model_limits"] = {"o1*": usd}
    else:
        teams["platform"].update(usd)
    policy = _policy(teams=teams, users={"alice": user})
    key = policy.users["alice"].key_configs()[0]
    limits = lim.limits_for(policy, "alice", key, "ci")
    p = lim.plan(policy, "alice", limits, "o1-mini", 0.0)
    assert p.costed is True
    assert p.needs_prompt_estimate
    dollars = [w for w in p.windows if w.name is lim.WindowName.DAILY_USD]
    assert [(w.limit, w.measure) for w in dollars] == [(500_000_000, lim.Measure.COST)]
    # Token limits alone, anywhere (and a model that is not in the group): no price needed.
    assert lim.plan(policy, "alice", limits, "gpt-4o", 0.0).costed is (where != "model")
    tokens_only = _policy(teams={"platform": {"daily_tokens": 100}},
                          users={"alice": {"team": "platform", "daily_tokens": 5,
                                           "model_limits": {"o1*": {"weekly_tokens": 5}},
                                           "keys": [{"key": "sk-alice-ci-0123456789",
                                                     "name": "ci", "monthly_tokens": 9}]}})
    key = tokens_only.users["alice"].key_configs()[0]
    plain = lim.plan(tokens_only, "alice", lim.limits_for(tokens_only, "alice", key, "ci"),
                     "o1-mini", 0.0)
    assert plain.costed is False
    assert len(_limited(plain)) == 4


@pytest.mark.parametrize(
    ("limits", "needs"),
    [({}, False), ({"requests_per_minute": 3}, False), ({"daily_output_tokens": 3}, False),
     ({"max_concurrent_requests": 2, "max_output_tokens": 9}, False),
     ({"daily_input_tokens": 3}, True), ({"tokens_per_minute": 3}, True),
     ({"weekly_tokens": 3}, True), ({"monthly_usd": 3}, True),
     ({"requests_per_minute": 3, "daily_tokens": 4}, True)],
)
def test_a_prompt_estimate_only_for_limits_the_prompt_counts_in(
    limits: dict[str, int], needs: bool,
) -> None:
    p = lim.plan(_policy(), "alice", lim.effective_limits(None, Limits(**limits)),
                 "gpt-4o", 0.0)
    assert p.needs_prompt_estimate is needs


def test_a_key_without_limits_of_its_own_has_no_counters() -> None:
    policy = _policy(users={"alice": {"daily_tokens": 9, "keys": [
        {"key": "sk-alice-ci-0123456789", "name": "ci"},
        {"key": "sk-alice-ro-0123456789", "name": "ro", "daily_tokens": 3}]}})
    plain, own = policy.users["alice"].key_configs()
    limits = lim.limits_for(policy, "alice", plain, "ci")
    assert limits.key == {} and limits.key_scope is None
    # A key's limits need the name its counters go by: without one they are not applied.
    nameless = lim.limits_for(policy, "alice", own, None)
    assert nameless.key == {} and nameless.key_scope is None
    named = lim.limits_for(policy, "alice", own, "ro")
    assert named.key == {"daily_tokens": 3} and named.key_scope == Scope(ScopeKind.KEY, "ro")


@pytest.mark.parametrize("team", [None, "platform"])
def test_a_key_without_a_concurrency_limit_adds_no_in_flight_set(team: str | None) -> None:
    policy = _policy(defaults={}, users={"alice": {"team": team, "keys": [
        {"key": "sk-alice-ci-0123456789", "name": "ci", "daily_tokens": 3}]}})
    key = policy.users["alice"].key_configs()[0]
    p = lim.plan(policy, "alice", lim.limits_for(policy, "alice", key, "ci"), "gpt-4o", 0.0)
    assert [(f.part, f.limit) for f in p.in_flight] == (
        [("u", None)] if team is None else [("t.platform", None)])
    assert p.output_cap is None  # no cap anywhere (not even in the defaults): none


def test_open_modes_are_metered_without_limits_or_an_output_cap() -> None:
    policy = _policy(defaults={"daily_tokens": 5, "max_output_tokens": 77})
    limits = lim.unlimited(policy.defaults)
    assert limits.output_cap == 77 and limits.key == {} and limits.model_limits == ()
    p = lim.plan(policy, "anyone", limits, "gpt-4o", 0.0)
    assert _limited(p) == {}
    assert p.output_cap == 77 and p.costed is False
    assert [(f.part, f.limit) for f in p.in_flight] == [("u", None)]
    # Such a principal is not enforced: its plan is `unenforced()`, which drops the cap too.
    assert p.unenforced().output_cap is None
    limited = lim.plan(policy, "anyone", lim.limits_for(policy, "anyone"), "gpt-4o", 0.0)
    opened = limited.unenforced()
    assert opened.slot == limited.slot == "tokenmeter:{anyone}"
    # ... and every window and in-flight set: the store holds and counts nothing for it.
    assert opened.windows == () and opened.in_flight == () and opened.holds_nothing


# --- the calendar: explicit instants, every zone --------------------------------------------

ZONES = ["UTC", "Europe/Berlin", "America/Los_Angeles", "Pacific/Auckland", "Asia/Kolkata",
         "Pacific/Kiritimati", "Pacific/Pago_Pago"]


@pytest.mark.parametrize("tz", ZONES)
def test_december_rolls_over_into_january_of_the_next_year(tz: str) -> None:
    zone = ZoneInfo(tz)
    policy = _policy(tz, users={"alice": {"monthly_tokens": 9, "monthly_usd": 1,
                                          "weekly_tokens": 9}})
    limits = lim.limits_for(policy, "alice")
    new_year = datetime(2027, 1, 1, tzinfo=zone).timestamp()
    for now in (datetime(2026, 12, 1, tzinfo=zone).timestamp(),
                datetime(2026, 12, 15, 12, tzinfo=zone).timestamp(), new_year - 1):
        w = _windows(lim.plan(policy, "alice", limits, "gpt-4o", now))
        month = w["u:monthly_tokens"]
        assert month.label == "u:monthly_tokens:M202612"
        assert month.resets_at == new_year == w["u:monthly_usd"].resets_at
        assert month.ttl_s == int(new_year - now) + 40 * 86400
    after = _windows(lim.plan(policy, "alice", limits, "gpt-4o", new_year))
    assert after["u:monthly_tokens"].label == "u:monthly_tokens:M202701"
    assert after["u:monthly_tokens"].resets_at == datetime(2027, 2, 1, tzinfo=zone).timestamp()
    # The week of New Year's Day 2027 (a Friday) is 2026's 53rd: it ends on Monday 4 January.
    assert after["u:weekly_tokens"].label == "u:weekly_tokens:W2026-53"
    assert after["u:weekly_tokens"].resets_at == datetime(2027, 1, 4, tzinfo=zone).timestamp()


@pytest.mark.parametrize("tz", ZONES)
@pytest.mark.parametrize("month", range(1, 13))
def test_each_month_ends_at_the_next_firsts_local_midnight(tz: str, month: int) -> None:
    zone = ZoneInfo(tz)
    policy = _policy(tz, users={"alice": {"monthly_tokens": 9}})
    start = datetime(2026, month, 1, tzinfo=zone)
    end = datetime(2026 + month // 12, month % 12 + 1, 1, tzinfo=zone)
    for now in (start.timestamp(), end.timestamp() - 1):
        w = _windows(lim.plan(policy, "alice", lim.limits_for(policy, "alice"), "gpt-4o", now))
        assert w["u:monthly_tokens"].label == f"u:monthly_tokens:M2026{month:02d}"
        assert w["u:monthly_tokens"].resets_at == end.timestamp()


@pytest.mark.parametrize("tz", ZONES)
def test_minute_and_day_windows_their_stamps_resets_and_lifetimes(tz: str) -> None:
    zone = ZoneInfo(tz)
    policy = _policy(tz, users={"alice": {"tokens_per_minute": 9, "daily_tokens": 9}})
    limits = lim.limits_for(policy, "alice")
    for now in (datetime(2026, 12, 31, 23, 59, 45, tzinfo=zone).timestamp(),
                datetime(2027, 1, 1, tzinfo=zone).timestamp() + 0.25):
        w = _windows(lim.plan(policy, "alice", limits, "gpt-4o", now))
        minute, day = w["u:tokens_per_minute"], w["u:daily_tokens"]
        assert minute.label == f"u:tokens_per_minute:{int(now // 60)}"
        assert minute.resets_at == (now // 60 + 1) * 60
        assert minute.ttl_s == int(minute.resets_at - now) + 60
        local = datetime.fromtimestamp(now, zone)
        midnight = datetime(local.year, local.month, local.day, tzinfo=zone)
        next_day = datetime.fromordinal(midnight.toordinal() + 1).replace(tzinfo=zone)
        assert day.label == f"u:daily_tokens:{local:%Y%m%d}"
        assert day.resets_at == next_day.timestamp()
        assert day.ttl_s == int(day.resets_at - now) + 8 * 86400


def test_one_instant_seen_from_two_zones_in_turn() -> None:
    """The calendar of one zone is kept for the day; another zone's, or the same zone's next
    day, is worked out afresh, whichever was asked for before."""
    berlin = _policy("Europe/Berlin", users={"alice": {"daily_tokens": 9}})
    tokyo = _policy("Asia/Tokyo", users={"alice": {"daily_tokens": 9}})
    now = datetime(2026, 12, 31, 20, tzinfo=UTC).timestamp()  # 21:00 Berlin, 05:00 Tokyo
    labels = []
    for policy, at in ((berlin, now), (tokyo, now), (berlin, now), (berlin, now + 3 * 3600),
                       (tokyo, now - 86400), (tokyo, now)):
        p = lim.plan(policy, "alice", lim.limits_for(policy, "alice"), "gpt-4o", at)
        labels.append(_windows(p)["u:daily_tokens"].label[-8:])
    assert labels == ["20261231", "20270101", "20261231", "20270101", "20261231", "20270101"]


# --- the books' view: windows_at and spooled windows -------------------------------------------

def test_windows_at_names_each_key_and_reads_the_users_own_limits() -> None:
    digest = "sha256:" + "0123456789abcdef" * 4
    policy = _policy(users={
        "alice": {"team": "platform", "monthly_tokens": 90,
                  "keys": [{"key": digest, "weekly_tokens": 5},
                           {"key": "sk-alice-plain-0123456789", "daily_usd": 1},
                           {"key": "sk-alice-ci-0123456789", "name": "ci", "monthly_usd": 2}]}})
    now = datetime(2026, 12, 2, 10, tzinfo=UTC).timestamp()
    found = {w.label: w for w in lim.windows_at(policy, "alice", now)}
    assert {label: w.limit for label, w in found.items() if w.limit is not None} == {
        "u:monthly_tokens:M202612": 90,
        "k.0123456789ab:weekly_tokens:W2026-49": 5,  # a hashed key: its digest's start
        # A plain one is kept as its digest too.
        f"k.{hashlib.sha256(b'sk-alice-plain-0123456789').hexdigest()[:12]}:daily_usd:20261202":
            1_000_000_000,
        "k.ci:monthly_usd:M202612": 2_000_000_000,
    }
    assert all(w.key == f"tokenmeter:{{t:platform}}:alice:{w.label}" for w in found.values()
               if w.scope.kind is not ScopeKind.TEAM)
    # A user without keys: their own limits, in their team's slot.
    bob = _policy(users={"bob": {"team": "platform", "monthly_tokens": 7}})
    assert {w.key: w.limit for w in lim.windows_at(bob, "bob", now)
            if w.name is lim.WindowName.MONTHLY_TOKENS} == {
        "tokenmeter:{t:platform}:bob:u:monthly_tokens:M202612": 7}


def test_a_spooled_window_keeps_its_label_and_scope() -> None:
    policy = _policy(users={"alice": {"team": "platform", "keys": [
        {"key": "sk-alice-ci-0123456789", "name": "ci", "daily_tokens": 5}]}})
    key = policy.users["alice"].key_configs()[0]
    p = lim.plan(policy, "alice", lim.limits_for(policy, "alice", key, "ci"), "gpt-4o", 0.0)
    for w in p.windows:
        obj = w.to_json()
        assert lim.Window.from_json(obj) == w
        assert lim.Window.from_json(dict(obj)).scope.name == w.scope.name
    # A window spooled before labels: its key after the slot, up to the first `}:` only.
    old = {"name": "daily_tokens", "scope": ["m", "x}:y"], "key": "tm:{alice}:m.x}:y:d:1",
           "limit": 5, "measure": "total", "resets_at": 1.0, "ttl_s": 2}
    assert lim.Window.from_json(old).label == "m.x}:y:d:1"
    assert lim.Window.from_json(old).scope == Scope(ScopeKind.MODELS, "x}:y")
