"""Whether and how one request may be answered from the cache: the `cache:` section's fields
resolved for its principal and model (key > user > team > route > the section), and the body
checks (sampling) that make a request uncacheable."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

from proxy.budget.principal import Principal
from proxy.config.cache import CacheConfig, CacheOverride, CacheScope

_FIELDS = tuple(CacheOverride.model_fields)


@dataclass(frozen=True, slots=True)
class CacheRule:
    enabled: bool
    ttl_s: float
    max_entry_bytes: int
    scope: CacheScope
    cache_sampled: bool


def rule_for(config: CacheConfig, principal: Principal, model: str) -> CacheRule:
    """The section's fields, each taken from the most specific level that sets it."""
    if not (config.keys or config.users or config.teams or config.routes):
        return _section_rule(config, model)  # no overrides: no per-request merging
    levels = (
        _key_override(config, principal) if config.keys else None,
        config.users.get(principal.user) if config.users else None,
        config.teams.get(principal.team or "") if config.teams else None,
        config.route_override(model) if config.routes else None,
    )
    values: dict[str, Any] = {}
    for level in levels:
        if level is None:
            continue
        for name in level.model_fields_set:
            value = getattr(level, name)
            if value is not None:
                values.setdefault(name, value)
    for name in _FIELDS:
        values.setdefault(name, getattr(config, name))
    return _rule(config, model, values)


def _key_override(config: CacheConfig, principal: Principal) -> CacheOverride | None:
    """The key's own override: by `user/name`, by its bare name (an older config's, which
    the config's load checks names one key only), or by its id."""
    keys, name = config.keys, principal.key_name
    found = (keys.get(f"{principal.user}/{name}") or keys.get(name)) if name else None
    if found is None and principal.key_id:
        found = keys.get(principal.key_id)
    return found


def _rule(config: CacheConfig, model: str, values: dict[str, Any]) -> CacheRule:
    enabled = bool(values["enabled"]) and (
        config.models is None or any(fnmatch.fnmatchcase(model, g) for g in config.models)
    )
    return CacheRule(enabled=enabled, ttl_s=float(values["ttl_s"]),
                     max_entry_bytes=int(values["max_entry_kb"]) * 1024,
                     scope=CacheScope(values["scope"]),
                     cache_sampled=bool(values["cache_sampled"]))


# The rule of a section without overrides, per model, for the one config in force (a reload
# makes a new config object, and so a new slot): every request of the common case reads it.
_SECTION: list[tuple[CacheConfig, dict[str, CacheRule]]] = []


def _section_rule(config: CacheConfig, model: str) -> CacheRule:
    if not _SECTION or _SECTION[0][0] is not config:
        _SECTION[:] = [(config, {})]
    rules = _SECTION[0][1]
    rule = rules.get(model)
    if rule is None:
        if len(rules) >= 1024:  # models are the clients' to name: the slot stays bounded
            rules.clear()
        rule = rules[model] = _rule(config, model, {n: getattr(config, n) for n in _FIELDS})
    return rule


def samples(body: dict[str, Any]) -> bool:
    """Whether the request draws at random: temperature above 0 (or left to the API's default,
    1 in both APIs), or more than one choice. Such a request's answers differ from call to
    call; a hit would repeat one draw."""
    temperature = body.get("temperature", 1)
    if not isinstance(temperature, int | float) or isinstance(temperature, bool):
        return True
    if temperature > 0:
        return True
    n = body.get("n", 1)
    return not (isinstance(n, int) and n <= 1)


def scope_id(scope: CacheScope, principal: Principal) -> str:
    """Whose entries a request reads and writes: part of its key."""
    if scope is CacheScope.KEY:
        return "key:" + (principal.key_id or principal.user)
    if scope is CacheScope.USER:
        return "user:" + principal.user
    if scope is CacheScope.TEAM:
        return "team:" + principal.team if principal.team else "user:" + principal.user
    return "global"


def hits_impossible(cache: CacheConfig, mode: str) -> str | None:
    """Why no request can be a hit under this configuration (warned at start), or None."""
    if not cache.maybe_enabled:
        return None
    if mode == "passthrough":
        # `ResponseCache.consult`: a pass-through request is never looked up.
        return ("the response cache is enabled but no request can be a hit: mode: passthrough "
                "forwards the clients' own keys, and the proxy cannot tell a valid key from "
                "another, so it never answers from the cache (use mode: keys)")
    if cache.models == []:
        return "cache: `models: []` makes no model cacheable: the cache never hits"
    return None
