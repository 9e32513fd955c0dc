"""Which budget windows apply to a request, and how much it reserves in each. Pure functions.

A window is one counter in the store with an optional limit: a day (in the configured time zone)
or a fixed clock minute, for one scope: the user, a key with its own limits, or the user's use of
a group of models. Every storage key of a user carries the user's name as a Redis Cluster hash
tag (`prefix:{alice}:...`), so one request's windows all live in one slot and one script call
can check and update them atomically.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal
from zoneinfo import ZoneInfo

from proxy.userconfig import KeyConfig, Limits, Policy, UserConfig

Measure = Literal["total", "input", "output", "requests"]

_WINDOWS: tuple[tuple[str, Measure, bool], ...] = (
    # name, what it counts, daily (else per minute)
    ("daily_tokens", "total", True),
    ("daily_input_tokens", "input", True),
    ("daily_output_tokens", "output", True),
    ("tokens_per_minute", "total", False),
    ("requests_per_minute", "requests", False),
)
_DAILY_RETENTION_S = 8 * 86400  # `tokenmeter usage --date` can look a week back


@dataclass(frozen=True, slots=True)
class EffectiveLimits:
    """A user's limits as seen through one of their keys."""

    values: dict[str, int | None]
    scopes: dict[str, str]  # field -> "u" (the user) or "k.<key>" (the key overrides it)
    model_limits: tuple[tuple[str, Limits], ...]


@dataclass(frozen=True, slots=True)
class Window:
    name: str
    scope: str
    key: str
    limit: int | None
    measure: Measure
    resets_at: float  # epoch seconds
    ttl_s: int


@dataclass(frozen=True, slots=True)
class Plan:
    slot: str  # the user's hash-tagged key prefix
    windows: tuple[Window, ...]
    max_concurrent: int | None
    output_cap: int | None

    @property
    def needs_prompt_estimate(self) -> bool:
        return any(w.limit is not None and w.measure in ("total", "input") for w in self.windows)


def effective_limits(
    user: UserConfig | None, key: KeyConfig | None, defaults: Limits, key_scope: str | None
) -> EffectiveLimits:
    values: dict[str, int | None] = {}
    scopes: dict[str, str] = {}
    for field in Limits.model_fields:
        k = getattr(key, field) if key is not None else None
        u = getattr(user, field) if user is not None else None
        if k is not None and key_scope is not None:
            values[field], scopes[field] = k, f"k.{key_scope}"
        else:
            values[field] = u if u is not None else getattr(defaults, field)
            scopes[field] = "u"
    models = tuple(user.model_limits.items()) if user is not None else ()
    return EffectiveLimits(values, scopes, models)


def unlimited(defaults: Limits) -> EffectiveLimits:
    """Open and pass-through modes: metered, never limited (but the output cap still applies)."""
    values: dict[str, int | None] = dict.fromkeys(Limits.model_fields)
    values["max_output_tokens"] = defaults.max_output_tokens
    return EffectiveLimits(values, dict.fromkeys(Limits.model_fields, "u"), ())


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
    windows: dict[tuple[str, str], Window] = {}

    def add(name: str, measure: Measure, daily: bool, scope: str, limit: int | None) -> None:
        stamp = day if daily else str(minute)
        resets = day_end if daily else minute_end
        ttl = int(resets - now) + (_DAILY_RETENTION_S if daily else 60)
        windows[(scope, name)] = Window(
            name, scope, f"{slot}:{scope}:{name}:{stamp}", limit, measure, resets, ttl
        )

    # The user's daily totals are always counted, limited or not: they are what `usage` reports.
    for name, measure, daily in _WINDOWS:
        if daily:
            add(name, measure, daily, "u", None)
    for name, measure, daily in _WINDOWS:
        limit = limits.values[name]
        if limit is not None:
            add(name, measure, daily, limits.scopes[name], limit)
    caps = [c for c in (limits.values["max_output_tokens"],) if c is not None]
    for pattern, mlimits in limits.model_limits:
        if not fnmatch.fnmatchcase(model, pattern):
            continue
        for name, measure, daily in _WINDOWS:
            limit = getattr(mlimits, name)
            if limit is not None:
                add(name, measure, daily, f"m.{pattern}", limit)
        if mlimits.max_output_tokens is not None:
            caps.append(mlimits.max_output_tokens)
        break  # the first matching model group applies, like routes
    max_conc = limits.values["max_concurrent_requests"]
    return Plan(slot, tuple(windows.values()), max_conc, min(caps) if caps else None)


def amount(window: Window, input_tokens: int, output_tokens: int) -> int:
    if window.measure == "total":
        return input_tokens + output_tokens
    if window.measure == "input":
        return input_tokens
    if window.measure == "output":
        return output_tokens
    return 1
