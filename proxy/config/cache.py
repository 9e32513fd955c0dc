"""Configuration of the response cache (docs/cache.md): off by default; when on, which requests
are answered from stored answers, shared how widely, for how long.

Overrides live in this section (`routes`, `teams`, `users`, `keys`), field by field like
`admission:`: a key's setting wins over its user's, a user's over their team's, a team's over
the model route's, the route's over the section's own; a field set nowhere keeps the section's.
They are kept here rather than in `users.<name>` so the user table stays the budget's."""

from __future__ import annotations

import enum
import fnmatch
import re

from pydantic import Field, field_validator

from proxy.config.policy import NAME, ConfigModel


class CacheScope(enum.StrEnum):
    """Who shares an entry: those whose requests are answered from each other's answers."""

    KEY = "key"  # one API key
    USER = "user"  # one user (all their keys): the default
    TEAM = "team"  # one team (a user without a team: their own)
    GLOBAL = "global"  # everyone: only for answers that are no one's secret


class ChargeHits(enum.StrEnum):
    """What a budget is charged for a hit (the ledger books what it saved either way)."""

    NONE = "none"
    FULL = "full"  # as if the model had run: the stored answer's usage


class CacheOverride(ConfigModel):
    """The fields a route, team, user or key may set for its requests."""

    enabled: bool | None = None
    ttl_s: float | None = Field(default=None, gt=0)
    max_entry_kb: int | None = Field(default=None, ge=1, le=64 * 1024)
    scope: CacheScope | None = None
    cache_sampled: bool | None = None


class CacheConfig(ConfigModel):
    enabled: bool = False
    ttl_s: float = Field(default=3600.0, gt=0)
    # An answer larger than this (as stored) is not stored.
    max_entry_kb: int = Field(default=256, ge=1, le=64 * 1024)
    scope: CacheScope = CacheScope.USER
    # Models whose requests may be cached (globs on the model asked for); None: every model.
    models: list[str] | None = None
    # Whether requests that sample (temperature > 0, or n > 1) are cacheable: a hit then
    # repeats one draw instead of drawing anew.
    cache_sampled: bool = False
    charge_hits: ChargeHits = ChargeHits.NONE
    # Patterns removed from the answers before they are stored (capture.redact's rule: each
    # match becomes `[REDACTED]`); none by default: an entry is the answer as the client got it.
    redact: list[str] = Field(default_factory=list)
    # The in-process store's bound (the store when the budget store is `memory`).
    memory_mb: float = Field(default=64.0, gt=0)
    # A lookup that takes longer is a miss (counted): a slow store never slows a request much.
    lookup_timeout_ms: float = Field(default=50.0, gt=0)
    # How long identical requests wait for the one already upstream before going themselves
    # (never longer than their upstream's first-byte timeout).
    lock_timeout_s: float = Field(default=60.0, gt=0)
    # The bytes all answers on their way to becoming entries may hold together, per process:
    # past it, an answer is not kept for an entry (counted).
    fills_mb: float = Field(default=64.0, gt=0)
    routes: dict[str, CacheOverride] = Field(default_factory=dict)  # model glob -> override
    teams: dict[str, CacheOverride] = Field(default_factory=dict)
    users: dict[str, CacheOverride] = Field(default_factory=dict)
    # By `user/name` (`users.<user>.keys[].name`), or a key's id: the first 12 hex digits of
    # its sha256 (as the logs show it). A bare name, as older configs wrote it, still names
    # the one key of that name; it is refused at load when several users have one.
    keys: dict[str, CacheOverride] = Field(default_factory=dict)

    @field_validator("redact")
    @classmethod
    def _compiles(cls, v: list[str]) -> list[str]:
        for pattern in v:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"redact pattern {pattern!r} does not compile: {exc}") from None
        return v

    @field_validator("teams", "users")
    @classmethod
    def _names(cls, v: dict[str, CacheOverride]) -> dict[str, CacheOverride]:
        for name in v:
            if not re.match(NAME, name):
                raise ValueError(f"name {name!r} must match {NAME}")
        return v

    @field_validator("keys")
    @classmethod
    def _key_names(cls, v: dict[str, CacheOverride]) -> dict[str, CacheOverride]:
        for name in v:
            if not all(re.match(NAME, part) for part in name.split("/", 1)):
                raise ValueError(f"key {name!r} must be `user/name` or a key's id, each part "
                                 f"matching {NAME}")
        return v

    @property
    def maybe_enabled(self) -> bool:
        """Whether any request may be cached: on, or an override may turn it on."""
        return self.enabled or bool(self.routes or self.teams or self.users or self.keys)

    def route_override(self, model: str) -> CacheOverride | None:
        """The first `routes` glob (in the file's order) that matches the model."""
        for glob, override in self.routes.items():
            if fnmatch.fnmatchcase(model, glob):
                return override
        return None
