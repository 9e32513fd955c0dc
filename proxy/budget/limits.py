"""Which budget windows apply to a request, and how much it reserves in each. Pure functions.

A window is one counter in the store with an optional limit: a fixed clock minute, or a
calendar day, week or month in the configured time zone (weeks start on Monday at 00:00, as in
ISO 8601), for one scope: the user, a key with its own limits, the user's use of a group of
models, or the user's team. It counts tokens (all, input or output), requests, or cost in whole
nano-dollars.

Storage keys and Redis Cluster: one request's windows and its reservation records must live in
one hash slot, so one script call can check and update them all atomically.
- A user without a team: everything under `prefix:{alice}` (the slot): `prefix:{alice}:u:...`,
  `prefix:{alice}:k.<key>:...`, `prefix:{alice}:m.<glob>:...`.
- A team's user: the slot is the team's, `prefix:{t:platform}` (a colon, which no user name
  has, so a team's hash tag is never a user's): the user's counters are under
  `prefix:{t:platform}:alice:...` and the team's under `prefix:{t:platform}:t.platform:...`.
  The team's slot holds the reservations of all its users, so a reservation left by a dead
  proxy is reaped off the shared team counters by the next request of any of them.
Moving a user into, out of or between teams moves their counters to another slot: the user's
own windows start afresh there (the old counters expire with their windows); the team's are
the team's. Reservations made before the move settle in the slot they were made in.
A whole team is one slot, so one cluster node serves it: a team's traffic does not spread
across shards (users without a team do).
"""

from __future__ import annotations

import dataclasses
import enum
import fnmatch
import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any
from zoneinfo import ZoneInfo

from proxy.budget.store import USER, InFlightLimit, Scope, ScopeKind
from proxy.config.policy import KeyConfig, Limits, Policy, Price, UserConfig
from proxy.cost import NANOS_PER_USD, worst_case_nanousd
from proxy.identity import key_id, key_label


class Period(enum.IntEnum):
    """How long a window lasts; the value indexes the per-call table in `plan`."""

    MINUTE = 0
    DAY = 1
    WEEK = 2
    MONTH = 3


class Measure(enum.Enum):
    TOTAL = "total"
    INPUT = "input"
    OUTPUT = "output"
    REQUESTS = "requests"
    COST = "cost"  # nano-dollars (1e-9 USD), from the price table


class WindowName(enum.StrEnum):
    """The windows a limit can be set on; the values are the config fields and metric labels."""

    DAILY_TOKENS = "daily_tokens"
    DAILY_INPUT_TOKENS = "daily_input_tokens"
    DAILY_OUTPUT_TOKENS = "daily_output_tokens"
    WEEKLY_TOKENS = "weekly_tokens"
    MONTHLY_TOKENS = "monthly_tokens"
    DAILY_USD = "daily_usd"
    MONTHLY_USD = "monthly_usd"
    TOKENS_PER_MINUTE = "tokens_per_minute"
    REQUESTS_PER_MINUTE = "requests_per_minute"

    @property
    def period(self) -> Period:
        return _PERIOD[self]

    @property
    def measure(self) -> Measure:
        return _MEASURE[self]

    @property
    def calendar(self) -> bool:
        """A day, week or month: spent until it resets, not worth a retry before."""
        return _PERIOD[self] is not Period.MINUTE


_PERIOD: dict[WindowName, Period] = {
    WindowName.DAILY_TOKENS: Period.DAY,
    WindowName.DAILY_INPUT_TOKENS: Period.DAY,
    WindowName.DAILY_OUTPUT_TOKENS: Period.DAY,
    WindowName.WEEKLY_TOKENS: Period.WEEK,
    WindowName.MONTHLY_TOKENS: Period.MONTH,
    WindowName.DAILY_USD: Period.DAY,
    WindowName.MONTHLY_USD: Period.MONTH,
    WindowName.TOKENS_PER_MINUTE: Period.MINUTE,
    WindowName.REQUESTS_PER_MINUTE: Period.MINUTE,
}
_MEASURE: dict[WindowName, Measure] = {
    WindowName.DAILY_TOKENS: Measure.TOTAL,
    WindowName.DAILY_INPUT_TOKENS: Measure.INPUT,
    WindowName.DAILY_OUTPUT_TOKENS: Measure.OUTPUT,
    WindowName.WEEKLY_TOKENS: Measure.TOTAL,
    WindowName.MONTHLY_TOKENS: Measure.TOTAL,
    WindowName.DAILY_USD: Measure.COST,
    WindowName.MONTHLY_USD: Measure.COST,
    WindowName.TOKENS_PER_MINUTE: Measure.TOTAL,
    WindowName.REQUESTS_PER_MINUTE: Measure.REQUESTS,
}
# (name, its config field, what it counts, its period): `plan` runs per request, and enum
# property lookups there cost more than the rest of it, so the plain values are spelled out once.
_WINDOWS: tuple[tuple[WindowName, str, Measure, Period], ...] = tuple(
    (name, name.value, _MEASURE[name], _PERIOD[name]) for name in WindowName
)
# Counted for the user (and the team) even without a limit: `tokenmeter usage` reads them.
_ALWAYS = tuple(w for w in _WINDOWS if w[3] is Period.DAY and w[2] is not Measure.COST)
_USD_FIELDS = frozenset(n.value for n in WindowName if n.measure is Measure.COST)
# How long a counter outlives its window: `tokenmeter usage --date` and `reconcile` look back.
_RETENTION_S = {Period.MINUTE: 60, Period.DAY: 8 * 86400, Period.WEEK: 15 * 86400,
                Period.MONTH: 40 * 86400}

Counts = dict[str, int | None]  # a limit per config field; USD ones in nano-dollars


def usd_to_nanos(usd: float) -> int:
    """A budget in whole nano-dollars, rounded down: never a nano-dollar more than configured.
    `str()`: the amount as written in the YAML, not its binary approximation."""
    return int(Decimal(str(usd)) * NANOS_PER_USD)


# The field names, read once: pydantic's `model_fields` is a computed class property, and
# reading it per call was most of building the key index of 30,000 keys.
_LIMIT_FIELDS: tuple[str, ...] = tuple(Limits.model_fields)


def counts(limits: Limits | None) -> Counts:
    """A `Limits` as plain numbers, cost budgets in nano-dollars: what `plan` reads."""
    if limits is None:
        return dict.fromkeys(_LIMIT_FIELDS)
    # The model's own field values (its __dict__): built 80,000 times for 30,000 keys.
    values = vars(limits)
    out: Counts = {name: values[name] for name in _LIMIT_FIELDS}
    for name in _USD_FIELDS:
        if (usd := out[name]) is not None:
            out[name] = usd_to_nanos(usd)
    return out


@dataclass(frozen=True, slots=True)
class EffectiveLimits:
    """A user's limits as seen through one of their keys. The user's limits are the ceiling for
    all of its keys together; a key with limits of its own is counted on its own counters too,
    so its limits can only narrow the user's, never widen them. A team's limits are shared by
    all its users, on the team's counters."""

    user: Counts  # the user's own limits (or the defaults)
    key: Counts  # the key's own limits (those it sets); empty when it has none
    key_scope: Scope | None  # the key's, when it has limits of its own
    model_limits: tuple[tuple[str, Counts], ...]
    team_scope: Scope | None = None  # the user's team, limited or not
    team: Counts = dataclasses.field(default_factory=dict)  # the team's limits; empty when none

    @property
    def output_cap(self) -> int | None:
        caps = [c for c in (self.user.get("max_output_tokens"), self.key.get("max_output_tokens"),
                            self.team.get("max_output_tokens"))
                if c is not None]
        return min(caps) if caps else None


@dataclass(frozen=True, slots=True)
class Window:
    name: WindowName
    scope: Scope
    key: str  # the storage key
    limit: int | None
    measure: Measure
    resets_at: float  # epoch seconds
    ttl_s: int
    # `<scope>:<window>:<stamp>`, e.g. `u:daily_tokens:20261202`, `t.platform:monthly_usd:
    # M202612`: the key without its slot, as the ledger's `windows` column records it.
    label: str = ""

    @property
    def is_users_daily_quota(self) -> bool:
        """The user's own limited daily_tokens: the one quota notices are about."""
        return (self.name is WindowName.DAILY_TOKENS and self.scope == USER
                and bool(self.limit))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name.value, "scope": [self.scope.kind.value, self.scope.name],
                "key": self.key, "limit": self.limit, "measure": self.measure.value,
                "resets_at": self.resets_at, "ttl_s": self.ttl_s, "label": self.label}

    @staticmethod
    def from_json(obj: dict[str, Any]) -> Window:
        kind, name = obj["scope"]
        # Spooled before labels were recorded: no teams then, so the slot ends at the tag.
        label = obj.get("label") or obj["key"].partition("}:")[2]
        return Window(WindowName(obj["name"]), Scope(ScopeKind(kind), name), obj["key"],
                      obj["limit"], Measure(obj["measure"]), obj["resets_at"], obj["ttl_s"],
                      label)


@dataclass(frozen=True, slots=True)
class Plan:
    slot: str  # the hash-tagged prefix the store keeps this request's reservation under
    windows: tuple[Window, ...]
    # The slot's set first, always: it holds every reservation of the slot (the user's own
    # set, or for a team's user the team's).
    in_flight: tuple[InFlightLimit, ...]
    output_cap: int | None
    costed: bool = False  # a cost window applies: the request needs a price
    price: Price | None = None  # the model's, set at admission when `costed`

    @property
    def needs_prompt_estimate(self) -> bool:
        return any(w.limit is not None and w.measure in _PROMPT_MEASURES for w in self.windows)

    def unenforced(self) -> Plan:
        """Metered without limits (open and pass-through modes): nothing for the budget store
        to hold or count. Such a request is metered by the books and the metrics; a store
        whose counters no limit reads would only cost it a reservation and a settlement."""
        return Plan(self.slot, (), (), None)

    @property
    def holds_nothing(self) -> bool:
        """No window and no in-flight set: the store is not asked (`Budget.reserve`)."""
        return not self.windows and not self.in_flight


_PROMPT_MEASURES = (Measure.TOTAL, Measure.INPUT, Measure.COST)


@dataclass(frozen=True, slots=True)
class KeyOf:
    """The key a request came with, and the scope its own limits are counted in."""

    config: KeyConfig
    scope: str


@dataclass(frozen=True, slots=True)
class TeamOf:
    """The user's team (counted even without limits) and its `teams.<name>` limits."""

    name: str
    limits: Limits | None


def effective_limits(user: UserConfig | None, defaults: Limits, key: KeyOf | None = None,
                     team: TeamOf | None = None) -> EffectiveLimits:
    """A user's limits (each field the user does not set, the defaults'), through `key`."""
    default_counts = counts(defaults)
    user_counts = counts(user)
    own: Counts = {}
    for name in _LIMIT_FIELDS:
        u = user_counts[name]
        own[name] = u if u is not None else default_counts[name]
    key_values: Counts = {}
    if key is not None:
        key_values = {f: v for f, v in counts(key.config).items() if v is not None}
    models = (tuple((glob, counts(ml)) for glob, ml in user.model_limits.items())
              if user is not None else ())
    scope = Scope(ScopeKind.KEY, key.scope) if key is not None and key_values else None
    team_values: Counts = {}
    if team is not None and team.limits is not None:
        team_values = {f: v for f, v in counts(team.limits).items() if v is not None}
    team_scope = Scope(ScopeKind.TEAM, team.name) if team is not None else None
    return EffectiveLimits(own, key_values, scope, models, team_scope, team_values)


def limits_for(policy: Policy, user: str, key: KeyConfig | None = None,
               key_scope: str | None = None) -> EffectiveLimits:
    """A user's limits, their team's included, and through `key` when it is given with the
    `key_scope` its counters go by (a key without one adds nothing). A user not in `users` has
    the defaults' limits, no team and no model groups."""
    cfg = policy.users.get(user)
    team = cfg.team if cfg is not None else None
    return effective_limits(
        cfg, policy.defaults,
        KeyOf(key, key_scope) if key is not None and key_scope is not None else None,
        TeamOf(team, policy.teams.get(team)) if team is not None else None,
    )


def unlimited(defaults: Limits) -> EffectiveLimits:
    """Open and pass-through modes: metered, never limited. The defaults' output cap is carried,
    but these principals are not enforced and `Plan.unenforced` drops it: their requests go
    upstream uncapped."""
    values: Counts = dict.fromkeys(_LIMIT_FIELDS)
    values["max_output_tokens"] = defaults.max_output_tokens
    return EffectiveLimits(values, {}, None, ())


# --- the calendar ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Calendar:
    """The day, week and month around an instant, in one zone: valid for the whole day, so
    `plan` works them out once a day rather than once a request."""

    start: float  # local midnight that began the day
    end: float  # the next local midnight
    day: str  # 20261202
    week: str  # W2026-49: ISO 8601 year and week (the year the week's Thursday is in)
    week_end: float  # the next Monday's local midnight
    month: str  # M202612
    month_end: float  # the next 1st's local midnight


_CALENDARS: dict[str, _Calendar] = {}


def _make_calendar(tz: ZoneInfo, now: float) -> _Calendar:
    local = datetime.fromtimestamp(now, tz)
    # Wall-clock arithmetic on aware datetimes: local midnights, DST days included.
    midnight = datetime(local.year, local.month, local.day, tzinfo=tz)
    iso_year, iso_week, weekday = local.isocalendar()
    if local.month == 12:
        next_month = datetime(local.year + 1, 1, 1, tzinfo=tz)
    else:
        next_month = datetime(local.year, local.month + 1, 1, tzinfo=tz)
    return _Calendar(
        start=midnight.timestamp(),
        end=(midnight + timedelta(days=1)).timestamp(),
        day=local.strftime("%Y%m%d"),
        week=f"W{iso_year}-{iso_week:02d}",
        week_end=(midnight + timedelta(days=8 - weekday)).timestamp(),
        month=f"M{local.year}{local.month:02d}",
        month_end=next_month.timestamp(),
    )


def _calendar(timezone: str, now: float) -> _Calendar:
    cal = _CALENDARS.get(timezone)
    if cal is None or not cal.start <= now < cal.end:
        cal = _make_calendar(ZoneInfo(timezone), now)
        _CALENDARS[timezone] = cal
    return cal


def _times(timezone: str, now: float) -> tuple[tuple[str, float, int], ...]:
    """(stamp, reset, ttl) per Period, at `now`."""
    cal = _calendar(timezone, now)
    minute = math.floor(now / 60)
    minute_end = (minute + 1) * 60.0
    return (
        (str(minute), minute_end, int(minute_end - now) + _RETENTION_S[Period.MINUTE]),
        (cal.day, cal.end, int(cal.end - now) + _RETENTION_S[Period.DAY]),
        (cal.week, cal.week_end, int(cal.week_end - now) + _RETENTION_S[Period.WEEK]),
        (cal.month, cal.month_end, int(cal.month_end - now) + _RETENTION_S[Period.MONTH]),
    )


# --- storage keys ------------------------------------------------------------------------------


def slot_for(prefix: str, user: str, team: str | None = None) -> str:
    """Where a user's reservation records live: their own slot, or their team's."""
    return f"{prefix}:{{{user}}}" if team is None else f"{prefix}:{{t:{team}}}"


def user_base(prefix: str, user: str, team: str | None = None) -> str:
    """The prefix of a user's own counters (user, key and model scopes)."""
    return f"{prefix}:{{{user}}}" if team is None else f"{prefix}:{{t:{team}}}:{user}"


def daily_key(prefix: str, user: str, name: str, day: str, team: str | None = None) -> str:
    """The user's own counter of a daily window (`name`, e.g. daily_tokens) on `day`."""
    return f"{user_base(prefix, user, team)}:u:{name}:{day}"


def team_of(policy: Policy, user: str) -> str | None:
    cfg = policy.users.get(user)
    return cfg.team if cfg is not None else None


# --- plans -------------------------------------------------------------------------------------


_Spec = tuple[WindowName, str, Measure, Period]  # one of _WINDOWS


class _Windows:
    """The windows of one plan as they are added, by (scope part, field): plain, fast keys."""

    __slots__ = ("costed", "times", "windows")

    def __init__(self, times: tuple[tuple[str, float, int], ...]) -> None:
        self.times = times
        self.windows: dict[tuple[str, str], Window] = {}
        self.costed = False

    def add(self, spec: _Spec, scope: Scope, at: str, limit: int | None) -> None:
        name, field, measure, period = spec
        stamp, resets, ttl = self.times[period]
        label = f"{scope.part}:{field}:{stamp}"
        self.windows[(scope.part, field)] = Window(
            name, scope, f"{at}:{label}", limit, measure, resets, ttl, label
        )
        if limit is not None and measure is Measure.COST:
            self.costed = True

    def limited(self, scope: Scope, at: str, limits: Mapping[str, int | None]) -> None:
        """A window for every limit `limits` sets, counted in `scope`."""
        for spec in _WINDOWS:
            limit = limits.get(spec[1])
            if limit is not None:
                self.add(spec, scope, at, limit)

    def always(self, scope: Scope, at: str) -> None:
        """The daily totals, counted limited or not: what `usage` reports."""
        for spec in _ALWAYS:
            self.add(spec, scope, at, None)


def plan(
    policy: Policy, user: str, limits: EffectiveLimits, model: str, now: float
) -> Plan:
    team_scope = limits.team_scope
    slot = slot_for(policy.store.prefix, user,
                    team_scope.name if team_scope is not None else None)
    base = slot if team_scope is None else f"{slot}:{user}"
    windows = _Windows(_times(policy.timezone, now))
    windows.always(USER, base)
    key_scope = limits.key_scope
    for spec in _WINDOWS:  # the user's and the key's, interleaved: the order counters are read
        if (limit := limits.user[spec[1]]) is not None:
            windows.add(spec, USER, base, limit)
        if key_scope is not None and (key_limit := limits.key.get(spec[1])) is not None:
            windows.add(spec, key_scope, base, key_limit)
    caps = [c for c in (limits.output_cap, _model_group(windows, limits, model, base))
            if c is not None]
    if team_scope is not None:
        windows.always(team_scope, slot)
        windows.limited(team_scope, slot, limits.team)
    return Plan(slot, tuple(windows.windows.values()), _in_flight(user, limits),
                min(caps) if caps else None, windows.costed)


def _model_group(windows: _Windows, limits: EffectiveLimits, model: str,
                 base: str) -> int | None:
    """The windows of the first model group `model` is in (like routes, the first that
    matches), added to `windows`; the group's output cap."""
    for pattern, group_limits in limits.model_limits:
        # The glob itself stands for its group too (`windows_at` asks for each by its glob).
        if model != pattern and not fnmatch.fnmatchcase(model, pattern):
            continue
        windows.limited(Scope(ScopeKind.MODELS, pattern), base, group_limits)
        return group_limits["max_output_tokens"]
    return None


def _in_flight(user: str, limits: EffectiveLimits) -> tuple[InFlightLimit, ...]:
    """The slot's set first (the user's own, or for a team's user the team's, which holds
    every reservation of the team's slot); the user's and the key's of a team's user are named
    for the user, whose key names other users may share."""
    user_conc = limits.user["max_concurrent_requests"]
    key_conc = limits.key.get("max_concurrent_requests")
    key_scope, team_scope = limits.key_scope, limits.team_scope
    if team_scope is None:
        in_flight = [InFlightLimit(USER, user_conc)]
        if key_conc is not None and key_scope is not None:
            in_flight.append(InFlightLimit(key_scope, key_conc))
        return tuple(in_flight)
    in_flight = [InFlightLimit(team_scope, limits.team.get("max_concurrent_requests"))]
    if user_conc is not None:
        in_flight.append(InFlightLimit(USER, user_conc, user))
    if key_conc is not None and key_scope is not None:
        in_flight.append(InFlightLimit(key_scope, key_conc, user))
    return tuple(in_flight)


def windows_at(policy: Policy, user: str, now: float) -> tuple[Window, ...]:
    """The calendar windows (day, week, month; tokens and cost) a configured user's requests
    count in at `now`, and so the counters the store holds for them: the user's own (the
    daily totals, always; the others when limited), their team's (likewise), each key's with
    limits of its own, and each model group's (every group, as if each had been asked for).
    Per-minute windows are left out. A team's windows come with each of its users: the same
    keys. For `tokenmeter reconcile`: the window's `key` to read, its `name`, `scope` and
    `label` to match the ledger's rows against."""
    cfg = policy.users.get(user)
    found: dict[str, Window] = {}
    variants: list[EffectiveLimits] = [limits_for(policy, user)]
    if cfg is not None:
        for key in cfg.key_configs():
            variants.append(limits_for(policy, user, key, key_label(key.name, key_id(key.key))))
    for limits in variants:
        models = limits.model_limits
        for pattern, _ in models or (("", {}),):
            # One group at a time: each plan counts the first group that matches the model.
            alone = EffectiveLimits(limits.user, limits.key, limits.key_scope,
                                    tuple(m for m in models if m[0] == pattern),
                                    limits.team_scope, limits.team)
            for w in plan(policy, user, alone, pattern, now).windows:
                if w.name.calendar:
                    found.setdefault(w.key, w)
    return tuple(found.values())


def reserve_cost(price: Price, prompt_tokens: int, output_tokens: int) -> int:
    """The most a request can cost: every prompt token at its dearest price (uncached, cached,
    or a cache write) plus every output token it may produce, in nano-dollars."""
    return worst_case_nanousd(price, prompt_tokens, output_tokens)


def amount(window: Window, input_tokens: int, output_tokens: int, cost_nanousd: int = 0) -> int:
    measure = window.measure
    if measure is Measure.TOTAL:
        return input_tokens + output_tokens
    if measure is Measure.INPUT:
        return input_tokens
    if measure is Measure.OUTPUT:
        return output_tokens
    if measure is Measure.COST:
        return cost_nanousd
    return 1
