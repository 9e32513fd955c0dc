"""What `serve` would meet with a configuration, told before it does (`check-config`): a summary
of what was read, and warnings for settings that load but cannot work as their author meant.

Here rather than in proxy.config because the warnings ask the budget and the price table the
questions the running proxy asks them (`limits_for`, `price_for`), not copies of their rules."""

from __future__ import annotations

import asyncio
import fnmatch
from dataclasses import dataclass

import asyncpg

from proxy.budget.clamp import AdmissionRule, resolve
from proxy.budget.limits import limits_for
from proxy.budget.store import StoreError
from proxy.budget.store_redis import RedisStore
from proxy.cache.policy import hits_impossible
from proxy.config.load import Config
from proxy.config.policy import DEFAULT_MAX_OUTPUT_TOKENS, KeyConfig, Limits
from proxy.cost import price_for
from proxy.storage.pg import PgConnection
from proxy.storage.urls import Dialect, dialect_of, mask_url

# The windows every request's output counts toward: a quota in one of them below the output
# cap is smaller than the reservation of a single request.
_OUTPUT_COUNTED = ("daily_tokens", "daily_output_tokens", "weekly_tokens", "monthly_tokens",
                   "tokens_per_minute")
_USD = ("daily_usd", "monthly_usd")


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def summary(config: Config) -> str:
    """One line per subject: what the file declares, counted."""
    users = config.users.values()
    keys = sum(len(u.keys) for u in users)
    levels: list[Limits] = [config.defaults, *config.teams.values(), *users]
    levels += [k for u in users for k in u.keys if isinstance(k, KeyConfig)]
    levels += [lim for u in users for lim in u.model_limits.values()]
    limits = sum(getattr(lim, f) is not None for lim in levels for f in Limits.model_fields)
    capture = config.capture
    tags = ", ".join(sorted(config.tags)) or "none declared"
    return "\n".join([
        f"  mode: {config.effective_mode}; {len(config.users)} users, {len(config.teams)} teams, "
        f"{keys} keys, {limits} limits set",
        f"  {len(config.upstreams)} upstreams, {len(config.models)} model routes, "
        f"{len(config.prices)} prices",
        f"  capture: {_on(capture.enabled)}"
        + (f" (sample {capture.sample:g}, errors {capture.errors.value})"
           if capture.enabled else ""),
        f"  cache: {_on(config.cache.maybe_enabled)}; tags: {tags}",
    ])


def warnings(config: Config) -> list[str]:
    return [*_unpriced(config), *_quotas_below_cap(config), *_cache_never_hits(config)]


def _cost_budgets(config: Config) -> list[str]:
    """The fields of the file that set a cost budget."""
    levels: list[tuple[str, Limits]] = [("defaults", config.defaults)]
    levels += [(f"teams.{name}", lim) for name, lim in config.teams.items()]
    for user, cfg in config.users.items():
        levels.append((f"users.{user}", cfg))
        levels += [(f"users.{user}.keys[{i}]", k) for i, k in enumerate(cfg.keys)
                   if isinstance(k, KeyConfig)]
        levels += [(f"users.{user}.model_limits.{glob}", lim)
                   for glob, lim in cfg.model_limits.items()]
    return [f"{where}.{f}" for where, lim in levels for f in _USD if getattr(lim, f) is not None]


def _unpriced(config: Config) -> list[str]:
    """Routed models no price covers while a cost budget applies: their requests are refused
    (`model_not_priced`), since an unpriced model cannot be kept within a cost budget."""
    budgets = _cost_budgets(config)
    if not budgets or config.effective_mode != "keys":
        return []
    shown = ", ".join(budgets[:3]) + (f" and {len(budgets) - 3} more" if len(budgets) > 3 else "")
    out = []
    for i, route in enumerate(config.models):
        if price_for(config.prices, route.match) is not None:
            continue
        # A glob route some prices fall within (`gpt-*` beside `gpt-4o*`): only its others.
        some = any(fnmatch.fnmatchcase(glob, route.match) for glob in config.prices)
        what = "not every model it routes has" if some else "no model it routes has"
        out.append(f"models[{i}] routes `{route.match}`: {what} a price in `prices`, while "
                   f"cost budgets are set ({shown}): requests for an unpriced model under a "
                   "cost budget are refused (model_not_priced)")
    return out


def _quotas_below_cap(config: Config) -> list[str]:
    """Token quotas smaller than the least output one request of theirs reserves: under
    `admission: worst_case` (the default) its output cap, under `clamp`/`estimate` its
    `min_output_tokens`; no request (prompt included) fits such a quota. Reported per field,
    with the smallest such floor among the requests it counts."""
    if config.effective_mode != "keys":
        return []
    found: dict[str, tuple[int, int, str]] = {}  # field path: quota, floor, why (its template)

    def note(where: str, lim: Limits, floor: tuple[int, str]) -> None:
        for f in _OUTPUT_COUNTED:
            quota = getattr(lim, f)
            path = f"{where}.{f}"
            if quota is not None and quota < floor[0] and floor[0] <= found.get(
                    path, (quota, floor[0], ""))[1]:
                found[path] = (quota, *floor)

    teams = config.teams
    defaults = config.defaults
    note("defaults", defaults, _floor(defaults.max_output_tokens, resolve(defaults.admission)))
    for user, cfg in config.users.items():
        team = teams.get(cfg.team) if cfg.team is not None else None
        levels = (cfg.admission, team.admission if team else None, defaults.admission)
        floor = _floor(limits_for(config, user).output_cap, resolve(*levels))
        note(f"users.{user}", cfg, floor)
        if team is not None:
            note(f"teams.{cfg.team}", team, floor)
        for i, key in enumerate(cfg.keys):
            if isinstance(key, KeyConfig):
                note(f"users.{user}.keys[{i}]", key,
                     _floor(limits_for(config, user, key, "k").output_cap,
                            resolve(key.admission, *levels)))
    return [f"{path} ({quota}) is below {why.format(floor)}" for path, (quota, floor, why)
            in found.items()]


def _floor(cap: int | None, rule: AdmissionRule) -> tuple[int, str]:
    """The fewest tokens a request reserves beyond its prompt, and which setting says so."""
    if rule.clamps:
        return rule.min_output_tokens, ("the fewest output tokens a clamped request is sent "
                                         "with ({}, `admission.min_output_tokens`): every "
                                         "request is refused")
    return cap or DEFAULT_MAX_OUTPUT_TOKENS, (
        "the output cap every request reserves ({}, `max_output_tokens`) under "
        "`admission: worst_case`: every request is refused; lower the cap or use "
        "`admission: {{policy: clamp}}`")


def _cache_never_hits(config: Config) -> list[str]:
    cache = config.cache
    if not cache.maybe_enabled:
        return []
    # What makes every hit impossible is the cache's own judgement, the one `serve` warns of
    # at start; what is left here makes hits rare.
    if (never := hits_impossible(cache, config.effective_mode)) is not None:
        return [never]
    overrides = [*cache.routes.values(), *cache.teams.values(), *cache.users.values(),
                 *cache.keys.values()]
    if cache.cache_sampled or any(o.cache_sampled for o in overrides):
        return []
    return ["cache: `cache_sampled: false` bypasses every request that samples, and a request "
            "that leaves out `temperature` samples (the APIs' default is 1): only requests "
            "sending `temperature: 0` can hit; set `cache_sampled: true` to cache the others"]


# `check-config --connect`: long enough for a server across a network, short enough that a
# firewall dropping packets answers within a few seconds.
CONNECT_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class Reach:
    """One server the configuration names, tried: `error` is None when it answered."""

    field: str  # where the file names it, e.g. `store.url`
    location: str  # its URL without the password
    error: str | None


def _servers(config: Config) -> list[tuple[str, str, bool]]:
    """(field, url, is_redis) of every server the configuration names."""
    out: list[tuple[str, str, bool]] = []
    if config.store.url != "memory":
        out.append(("store.url", config.store.url, True))
    for field, url in (("ledger.url", config.ledger.url), ("capture.url", config.capture.url)):
        if url is not None and dialect_of(url) is Dialect.POSTGRESQL:
            out.append((field, url, False))
    return out


async def _try(url: str, is_redis: bool, timeout_s: float) -> str | None:
    """None when the server answered; else why not (never the URL: it may hold a password)."""
    try:
        async with asyncio.timeout(timeout_s):
            if is_redis:
                store = RedisStore(url, timeout_s * 1000)
                try:
                    await store.ping()
                finally:
                    await store.close()
            else:
                conn = PgConnection(url, {"application_name": "tokenmeter check-config"},
                                    connect_timeout_s=timeout_s)
                try:
                    await conn.connect()
                finally:
                    await conn.close()
    except TimeoutError:
        return f"no answer within {timeout_s:g} s"
    except (StoreError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


async def reach(config: Config, timeout_s: float = CONNECT_TIMEOUT_S) -> list[Reach]:
    """Every Redis and PostgreSQL server the configuration names, tried at once."""
    servers = _servers(config)
    errors = await asyncio.gather(*(_try(url, is_redis, timeout_s)
                                    for _, url, is_redis in servers))
    return [Reach(field, mask_url(url), error)
            for (field, url, _), error in zip(servers, errors, strict=True)]
