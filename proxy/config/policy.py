"""Configuration of who may call the proxy and how much: users, keys, limits, the store.

Keys are hashed the moment they are read: a raw key (from `${ENV}` or written inline) becomes
`sha256:<hex>` in the validated config, so nothing downstream ever holds a client secret.
"""

from __future__ import annotations

import difflib
import enum
import re
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from proxy.identity import HASH_PREFIX, key_hash
from proxy.storage.urls import REDIS_URL

_HASHED = re.compile(rf"^{HASH_PREFIX}[0-9a-f]{{64}}$")
# User and key names end up in Redis keys and metric labels: keep them plain.
NAME = r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$"


def normalise_key(value: str) -> str:
    value = value.strip()
    if value.lower().startswith(HASH_PREFIX):
        value = value.lower()
        if not _HASHED.match(value):
            raise ValueError("a hashed key must be 'sha256:' followed by 64 hex digits")
        return value
    if len(value) < 8:
        raise ValueError("a raw key must be at least 8 characters (or give 'sha256:<hex>')")
    return key_hash(value)


_BOOL_FOR_NUMBER = (
    "must be a number, not a boolean (YAML reads yes/no/on/off/true/false as booleans)"
)


def _union_members(annotation: Any) -> tuple[Any, ...]:
    if get_origin(annotation) in (Union, types.UnionType):
        return get_args(annotation)
    return (annotation,)


def _misplaced_bool(value: object, annotation: Any) -> bool:
    """A boolean where the field wants an int or a float, at any depth of lists and dicts.

    Pydantic's lax mode takes `true` as 1, so `daily_tokens: yes` would mean a one-token quota
    and `no` a zero one; strict mode would also refuse "8080" from `${PORT}`, hence this check.
    """
    members = _union_members(annotation)
    if isinstance(value, bool):
        return bool not in members and any(m in (int, float) for m in members)
    for member in members:
        origin, args = get_origin(member), get_args(member)
        if origin is list and args and isinstance(value, list):
            return any(_misplaced_bool(v, args[0]) for v in value)
        if origin is dict and len(args) == 2 and isinstance(value, dict):
            return any(_misplaced_bool(v, args[1]) for v in value.values())
    return False


_MAY_HOLD_BOOL = (bool, list, dict)


class ConfigModel(BaseModel):
    """Base of every configuration section: unknown fields refused, frozen, no bools as numbers."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value: object, info: ValidationInfo) -> object:
        # Runs for every field given, 100,000 times for 10,000 users: only a boolean, a list or
        # a mapping can be a misplaced boolean, so anything else is passed without a look at
        # the annotation (which cost most of the validation).
        if type(value) not in _MAY_HOLD_BOOL:
            return value
        if info.field_name is not None and _misplaced_bool(
            value, cls.model_fields[info.field_name].annotation
        ):
            raise ValueError(_BOOL_FOR_NUMBER)
        return value


_Model = ConfigModel


class Limits(_Model):
    """Every limit is optional; unset means "no limit" (usage is still counted).

    Days, weeks and months are calendar ones in `timezone` (local midnight to local midnight,
    DST days included); a week starts on Monday at 00:00, as in ISO 8601 (and `date +%V`).
    """

    daily_tokens: int | None = Field(default=None, ge=0)
    daily_input_tokens: int | None = Field(default=None, ge=0)
    daily_output_tokens: int | None = Field(default=None, ge=0)
    weekly_tokens: int | None = Field(default=None, ge=0)  # Monday 00:00 to Monday 00:00
    monthly_tokens: int | None = Field(default=None, ge=0)  # the 1st 00:00 to the next 1st
    # Cost budgets in US dollars, priced from `prices` by the model sent upstream: a request
    # reserves its worst case (the prompt as uncached input plus its max output tokens) and
    # settles its real cost. Counted in whole nano-dollars, so $0.10 is exactly 100,000,000.
    # A request for a model without a price is refused while a cost budget applies to it.
    daily_usd: float | None = Field(default=None, ge=0)
    monthly_usd: float | None = Field(default=None, ge=0)
    tokens_per_minute: int | None = Field(default=None, ge=0)
    requests_per_minute: int | None = Field(default=None, ge=0)
    max_concurrent_requests: int | None = Field(default=None, ge=0)
    max_output_tokens: int | None = Field(default=None, ge=1)


class AdmissionPolicy(enum.StrEnum):
    """How a request whose worst case does not fit the room left in its windows is treated."""

    # Admitted only if the prompt estimate plus the whole output cap fits every window.
    WORST_CASE = "worst_case"
    # Admitted with a lower output cap (what fits), if at least `min_output_tokens` fit.
    CLAMP = "clamp"
    # Streams reserve a learned estimate of their output (not the cap) and are topped up while
    # they run; a stream the quota cannot top up ends there. Non-streamed requests: `clamp`.
    ESTIMATE = "estimate"


class Admission(_Model):
    """`admission:` in `defaults`, a user, a key or `teams.<name>`.

    Precedence, field by field: a key's setting wins over its user's, a user's over their
    team's, a team's over `defaults`; a field set nowhere takes the default below. So
    `defaults: {admission: {policy: clamp}}` with a key's `admission: {min_output_tokens: 1024}`
    clamps that key's requests to no fewer than 1024 output tokens. The key is the most
    specific because it is what one agent holds; the team is the least, a shared floor."""

    policy: AdmissionPolicy = AdmissionPolicy.WORST_CASE
    # Under `clamp`: the fewest output tokens (all choices together) worth sending a request
    # upstream with; a request that cannot get its prompt plus this many is refused (429).
    min_output_tokens: int = Field(default=256, ge=1)
    # Under `estimate`: the output tokens a stream reserves before its key and model have any
    # history (bounded by the request's cap); then a high percentile of recent outputs.
    initial_estimate: int = Field(default=1024, ge=1)


class AdmittedLimits(Limits):
    """Limits with an admission policy: `defaults` and `teams.<name>` (not a model group's:
    admission is about who asks, not which model)."""

    admission: Admission | None = None


class KeyConfig(Limits):
    """A key with a name (shown in logs and usable in Redis keys) and its own limits."""

    key: str
    name: str | None = Field(default=None, pattern=NAME)
    admission: Admission | None = None
    capture: bool = True  # False: never captured, whatever `capture:` says
    # Default tags of the key's requests, over its user's, under the request's own (per key);
    # checked against `tags:` at load.
    tags: dict[str, str] = Field(default_factory=dict)

    @field_validator("key")
    @classmethod
    def _hash(cls, v: str) -> str:
        return normalise_key(v)


def _key_kind(value: object) -> str:
    return "string" if isinstance(value, str) else "mapping"


# A key is its string, or a mapping with a name and limits. Told apart by the YAML's shape, so
# a mistake in a mapping is reported once, not also as "Input should be a valid string".
_KeyEntry = Annotated[
    Annotated[KeyConfig, Tag("mapping")] | Annotated[str, Tag("string")],
    Discriminator(_key_kind),
]


class UserConfig(Limits):
    keys: list[_KeyEntry] = Field(default_factory=list)
    admission: Admission | None = None
    capture: bool = True  # False: none of the user's requests is ever captured
    # Default tags of the user's requests (a key's and the request's own win per key).
    tags: dict[str, str] = Field(default_factory=dict)
    # The team the user's usage is also counted for (and limited by `teams.<team>`, if set).
    # Without a `teams:` section a team need not be listed: it is counted, unlimited, for the
    # books. With one, every user's team must be in it (`name: {}` for one without limits):
    # a misspelt name would silently escape its team's limits (`unknown_teams`).
    # Its counters and the user's share one Redis Cluster slot, so moving a user into, out of
    # or between teams starts the user's own counters afresh (see proxy.budget.limits).
    team: str | None = Field(default=None, pattern=NAME)
    # Limits for models matching a glob, counted separately from the user's overall limits:
    # e.g. {"o1*": {daily_tokens: 20000}} next to daily_tokens: 500000.
    model_limits: dict[str, Limits] = Field(default_factory=dict)

    @field_validator("model_limits")
    @classmethod
    def _globs(cls, v: dict[str, Limits]) -> dict[str, Limits]:
        for glob in v:
            if any(c in glob for c in "{}\n") or not glob:
                raise ValueError(f"model glob {glob!r} may not be empty or contain braces")
        return v

    @field_validator("keys", mode="before")
    @classmethod
    def _keys(cls, v: object) -> object:
        if isinstance(v, list):
            return [normalise_key(k) if isinstance(k, str) else k for k in v]
        return v

    @field_validator("keys")
    @classmethod
    def _key_names(cls, v: list[KeyConfig | str]) -> list[KeyConfig | str]:
        # A key with limits of its own is counted under its name: two keys of one name would
        # share one counter (and be one name in the logs).
        seen: dict[str, int] = {}
        for i, key in enumerate(v):
            if isinstance(key, KeyConfig) and key.name is not None:
                if key.name in seen:
                    raise ValueError(
                        f"keys[{seen[key.name]}] and keys[{i}] are both named {key.name!r}: "
                        "each key of a user needs its own name"
                    )
                seen[key.name] = i
        return v

    def key_hashes(self) -> list[str]:
        """The user's keys' `sha256:` hashes, without a `KeyConfig` made for each."""
        return [k if isinstance(k, str) else k.key for k in self.keys]

    def key_configs(self) -> list[KeyConfig]:
        # A plain key string is already normalised (`_keys`): no second validation of it.
        return [k if isinstance(k, KeyConfig) else KeyConfig.model_construct(key=k)
                for k in self.keys]


class StoreConfig(_Model):
    # "memory", or redis://host:6379/0 (rediss:// for TLS, unix:///path.sock), or a Redis
    # Cluster: redis+cluster://host:port (rediss+cluster:// for TLS), any node of it; the
    # client discovers the others. Every reservation's keys share one hash slot (the user's,
    # or the team's for a team's users), so each budget check is one script call on one node.
    url: str = "memory"
    on_error: Literal["fail_open", "fail_closed"] = "fail_open"
    prefix: str = Field(default="tokenmeter", pattern=r"^[A-Za-z0-9_.:-]+$")
    # A reservation not settled or renewed within this time (its proxy died) is released.
    lease_seconds: float = Field(default=60.0, gt=0)
    # A budget check that takes longer fails into `on_error`; a slow store must not stall traffic.
    timeout_ms: float = Field(default=500.0, gt=0)
    # Where usage owed to the store during an outage is kept until it is back (and across a
    # restart). Default: $TOKENMETER_STATE_DIR, else $XDG_STATE_HOME/tokenmeter, else
    # ~/.local/state/tokenmeter. Replicas may share it: each keeps its own file in it.
    spool_dir: str | None = None

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if v != "memory" and not REDIS_URL.match(v):
            raise ValueError("must be 'memory' or a redis://, rediss://, unix://, "
                             "redis+cluster:// or rediss+cluster:// URL")
        return v


class AlertsConfig(_Model):
    # Fractions of the daily quota at which a user is reported, once per threshold per day.
    thresholds: list[float] = Field(default_factory=lambda: [0.8, 1.0])
    webhook_url: str | None = None

    @field_validator("thresholds")
    @classmethod
    def _fractions(cls, v: list[float]) -> list[float]:
        if any(not 0 < t <= 10 for t in v):
            raise ValueError("thresholds are fractions of the quota, e.g. 0.8 for 80%")
        return sorted(set(v))


class Price(_Model):
    """US dollars per million tokens.

    A price not given is the input price: the table adds no multiplier of its own, so a model
    whose provider bills cache writes at a premium (Anthropic: 1.25x input for the 5-minute
    cache, 2x for the 1-hour one) needs them written out, as its price list gives them."""

    input: float = Field(ge=0)
    output: float = Field(ge=0)
    # Prompt tokens read from the cache (OpenAI's cached_tokens, Anthropic's cache reads).
    cached_input: float | None = Field(default=None, ge=0)
    # Prompt tokens written to the cache (Anthropic's cache_creation_input_tokens), by the
    # cache's lifetime; a write whose lifetime the usage does not give is a 5-minute one,
    # Anthropic's default.
    cache_write_5m: float | None = Field(default=None, ge=0)
    cache_write_1h: float | None = Field(default=None, ge=0)


# The output cap of an enforced request when no level (defaults, team, user, key, model
# group) sets `max_output_tokens`: the default of `defaults`, and what applies when a
# configuration's own `defaults` leaves it out.
DEFAULT_MAX_OUTPUT_TOKENS = 4096


class Policy(_Model):
    """The budget-related part of the top-level config."""

    mode: Literal["open", "keys", "passthrough"] | None = None
    store: StoreConfig = Field(default_factory=StoreConfig)
    timezone: str = "UTC"
    defaults: AdmittedLimits = Field(
        default_factory=lambda: AdmittedLimits(max_output_tokens=DEFAULT_MAX_OUTPUT_TOKENS)
    )
    users: dict[str, UserConfig] = Field(default_factory=dict)
    # Limits a team's users share (the same fields as a user's): `teams.<name>`, where a user
    # has `team: <name>`. Reserved together with the user's and key's windows, all or nothing;
    # a team's max_concurrent_requests counts all its users' requests in flight, and its
    # max_output_tokens caps each of their requests like a user's.
    teams: dict[str, AdmittedLimits] = Field(default_factory=dict)
    alerts: AlertsConfig = Field(default_factory=AlertsConfig)
    prices: dict[str, Price] = Field(default_factory=dict)

    @field_validator("timezone")
    @classmethod
    def _tz(cls, v: str) -> str:
        try:
            ZoneInfo(v)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(
                f"unknown time zone {v!r} (use an IANA name like Europe/Berlin)"
            ) from None
        return v

    @field_validator("users")
    @classmethod
    def _names(cls, v: dict[str, UserConfig]) -> dict[str, UserConfig]:
        for name in v:
            if not re.match(NAME, name):
                raise ValueError(f"user name {name!r} must match {NAME}")
        return v

    @field_validator("teams")
    @classmethod
    def _team_names(cls, v: dict[str, AdmittedLimits]) -> dict[str, AdmittedLimits]:
        for name in v:
            if not re.match(NAME, name):
                raise ValueError(f"team name {name!r} must match {NAME}")
        return v

    @model_validator(mode="after")
    def _unique_keys(self) -> Policy:
        owner: dict[str, str] = {}
        for user, cfg in self.users.items():
            for key in cfg.key_hashes():
                if key in owner:
                    raise ValueError(
                        f"users.{user}.keys: a key is also given to user {owner[key]!r}"
                    )
                owner[key] = user
        return self

    @property
    def effective_mode(self) -> Literal["open", "keys", "passthrough"]:
        if self.mode is not None:
            return self.mode
        return "keys" if self.users else "open"


def unknown_teams(policy: Policy) -> list[tuple[tuple[str | int, ...], str]]:
    """Users whose `team:` names no entry of a non-empty `teams:`, each with its field path
    and a message (suggesting the closest team); the loader adds the file's line."""
    if not policy.teams:
        return []
    problems: list[tuple[tuple[str | int, ...], str]] = []
    for user, cfg in policy.users.items():
        if cfg.team is None or cfg.team in policy.teams:
            continue
        msg = f"no team {cfg.team!r} in `teams:` (a team without limits is `{cfg.team}: {{}}`)"
        if close := difflib.get_close_matches(cfg.team, list(policy.teams), n=1):
            msg = f"no team {cfg.team!r} in `teams:`; did you mean {close[0]!r}?"
        problems.append((("users", user, "team"), msg))
    return problems
