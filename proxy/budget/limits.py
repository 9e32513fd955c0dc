"""Which budget windows apply to a request, and how much it reserves in each. Pure functions.

A window is one counter in the store with an optional limit: a day (in the configured time zone)
or a fixed clock minute, for one scope: the user, a key with its own limits, or the user's use of
a group of models. Every storage key of a user carries the user's name as a Redis Cluster hash
tag (`prefix:{alice}:...`), so one request's windows all live in one slot and one script call
can check and update them atomically.
"""

from __future__ import annotations

import enum
import fnmatch
import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

from proxy.budget.store import USER, InFlightLimit, Scope, ScopeKind
from proxy.config.policy import KeyConfig, Limits, Policy, UserConfig


class WindowName(enum.StrEnum):
    """The windows a limit can be set on; the values are the config fields and metric labels."""

    DAILY_TOKENS = "daily_tokens"
    DAILY_INPUT_TOKENS = "daily_input_tokens"
    DAILY_OUTPUT_TOKENS = "daily_output_tokens"
    TOKENS_PER_MINUTE = "tokens_per_minute"
    REQUESTS_PER_MINUTE = "requests_per_minute"

    @property
    def daily(self) -> bool:
        return self.value.startswith("daily")


class Measure(enum.Enum):
    TOTAL = "total"
    INPUT = "input"
    OUTPUT = "output"
    REQUESTS = "requests"


# (name, its config field, what it counts, daily): `plan` runs per request, and enum property
# lookups there cost more than the rest of it, so the plain values are spelled out once.
_WINDOWS: tuple[tuple[WindowName, str, Measure, bool], ...] = tuple(
    (name, name.value, measure, name.daily) for name, measure in (
        (WindowName.DAILY_TOKENS, Measure.TOTAL),
        (WindowName.DAILY_INPUT_TOKENS, Measure.INPUT),
        (WindowName.DAILY_OUTPUT_TOKENS, Measure.OUTPUT),
        (WindowName.TOKENS_PER_MINUTE, Measure.TOTAL),
        (WindowName.REQUESTS_PER_MINUTE, Measure.REQUESTS),
    )
)
_DAILY_RETENTION_S = 8 * 86400  # `tokenmeter usage --date` can look a week back


@dataclass(frozen=True, slots=True)
class EffectiveLimits:
    """A user's limits as seen through one of their keys. The user's limits are the ceiling for
    all of its keys together; a key with limits of its own is counted on its own counters too,
    so its limits can only narrow the user's, never widen them."""

    user: dict[str, int | None]  # the user's own limits (or the defaults)
    key: dict[str, int | None]  # the key's own limits; empty when it has none
    key_scope: Scope | None  # the key's, when it has limits of its own
    model_limits: tuple[tuple[str, Limits], ...]

    @property
    def output_cap(self) -> int | None:
        caps = [c for c in (self.user.get("max_output_tokens"), self.key.get("max_output_tokens"))
                if c is not None]
        return min(caps) if caps else None


@dataclass(frozen=True, slots=True)
class Window:
    name: WindowName
    scope: Scope
    key: str
    limit: int | None
    measure: Measure
    resets_at: float  # epoch seconds
    ttl_s: int

    @property
    def is_users_daily_quota(self) -> bool:
        """The user's own limited daily_tokens: the one quota notices are about."""
        return (self.name is WindowName.DAILY_TOKENS and self.scope == USER
                and bool(self.limit))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name.value, "scope": [self.scope.kind.value, self.scope.name],
                "key": self.key, "limit": self.limit, "measure": self.measure.value,
                "resets_at": self.resets_at, "ttl_s": self.ttl_s}

    @staticmethod
    def from_json(obj: dict[str, Any]) -> Window:
        kind, name = obj["scope"]
        return Window(WindowName(obj["name"]), Scope(ScopeKind(kind), name), obj["key"],
                      obj["limit"], Measure(obj["measure"]), obj["resets_at"], obj["ttl_s"])


@dataclass(frozen=True, slots=True)
class Plan:
    slot: str  # the user's hash-tagged key prefix
    windows: tuple[Window, ...]
    in_flight: tuple[InFlightLimit, ...]  # the user's first, always: it holds every reservation
    output_cap: int | None

    @property
    def needs_prompt_estimate(self) -> bool:
        return any(w.limit is not None and w.measure in (Measure.TOTAL, Measure.INPUT)
                   for w in self.windows)

    def unenforced(self) -> Plan:
        """Metered without limits (open and pass-through modes): only the unlimited windows."""
        return Plan(self.slot, tuple(w for w in self.windows if w.limit is None),
                    (InFlightLimit(USER, None),), None)


def effective_limits(
    user: UserConfig | None, key: KeyConfig | None, defaults: Limits, key_scope: str | None
) -> EffectiveLimits:
    own: dict[str, int | None] = {}
    for field in Limits.model_fields:
        u = getattr(user, field) if user is not None else None
        own[field] = u if u is not None else getattr(defaults, field)
    key_values: dict[str, int | None] = {}
    if key is not None and key_scope is not None:
        key_values = {f: getattr(key, f) for f in Limits.model_fields
                      if getattr(key, f) is not None}
    models = tuple(user.model_limits.items()) if user is not None else ()
    scope = Scope(ScopeKind.KEY, key_scope) if key_values and key_scope is not None else None
    return EffectiveLimits(own, key_values, scope, models)


def unlimited(defaults: Limits) -> EffectiveLimits:
    """Open and pass-through modes: metered, never limited (but the output cap still applies)."""
    values: dict[str, int | None] = dict.fromkeys(Limits.model_fields)
    values["max_output_tokens"] = defaults.max_output_tokens
    return EffectiveLimits(values, {}, None, ())


def _day(now: float, tz: ZoneInfo) -> tuple[str, float]:
    local = datetime.fromtimestamp(now, tz)
    # Wall-clock arithmetic on an aware datetime: next local midnight, DST days included.
    midnight = datetime(local.year, local.month, local.day, tzinfo=tz) + timedelta(days=1)
    return local.strftime("%Y%m%d"), midnight.timestamp()


def slot_for(prefix: str, user: str) -> str:
    return f"{prefix}:{{{user}}}"


def daily_key(prefix: str, user: str, name: str, day: str) -> str:
    return f"{slot_for(prefix, user)}:u:{name}:{day}"


def plan(
    policy: Policy, user: str, limits: EffectiveLimits, model: str, now: float
) -> Plan:
    tz = ZoneInfo(policy.timezone)
    day, day_end = _day(now, tz)
    minute = math.floor(now / 60)
    minute_end = (minute + 1) * 60.0
    slot = slot_for(policy.store.prefix, user)
    windows: dict[tuple[str, str], Window] = {}  # by (scope part, field): plain, fast keys

    minute_stamp = str(minute)
    daily_ttl = int(day_end - now) + _DAILY_RETENTION_S
    minute_ttl = int(minute_end - now) + 60

    def add(name: WindowName, field: str, measure: Measure, daily: bool, scope: Scope,
            limit: int | None) -> None:
        stamp, resets, ttl = ((day, day_end, daily_ttl) if daily
                              else (minute_stamp, minute_end, minute_ttl))
        windows[(scope.part, field)] = Window(
            name, scope, f"{slot}:{scope.part}:{field}:{stamp}", limit, measure, resets, ttl
        )

    # The user's daily totals are always counted, limited or not: they are what `usage` reports.
    for name, field, measure, daily in _WINDOWS:
        if daily:
            add(name, field, measure, daily, USER, None)
    key_scope = limits.key_scope
    for name, field, measure, daily in _WINDOWS:
        limit = limits.user[field]
        if limit is not None:
            add(name, field, measure, daily, USER, limit)
        if key_scope is not None:
            key_limit = limits.key.get(field)
            if key_limit is not None:
                add(name, field, measure, daily, key_scope, key_limit)
    caps = [c for c in (limits.output_cap,) if c is not None]
    for pattern, mlimits in limits.model_limits:
        if not fnmatch.fnmatchcase(model, pattern):
            continue
        group = Scope(ScopeKind.MODELS, pattern)
        for name, field, measure, daily in _WINDOWS:
            limit = getattr(mlimits, field)
            if limit is not None:
                add(name, field, measure, daily, group, limit)
        if mlimits.max_output_tokens is not None:
            caps.append(mlimits.max_output_tokens)
        break  # the first matching model group applies, like routes
    in_flight = [InFlightLimit(USER, limits.user["max_concurrent_requests"])]
    key_conc = limits.key.get("max_concurrent_requests")
    if key_conc is not None and limits.key_scope is not None:
        in_flight.append(InFlightLimit(limits.key_scope, key_conc))
    return Plan(slot, tuple(windows.values()), tuple(in_flight), min(caps) if caps else None)


def amount(window: Window, input_tokens: int, output_tokens: int) -> int:
    if window.measure is Measure.TOTAL:
        return input_tokens + output_tokens
    if window.measure is Measure.INPUT:
        return input_tokens
    if window.measure is Measure.OUTPUT:
        return output_tokens
    return 1
