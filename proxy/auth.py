"""Who is making a request: the key a client sends, looked up by its sha256 hash."""

from __future__ import annotations

from aiohttp import web

from proxy.budget.clamp import resolve
from proxy.budget.limits import EffectiveLimits, limits_for, unlimited
from proxy.budget.principal import Principal
from proxy.config.policy import KeyConfig, Policy
from proxy.errors import AuthenticationFailed
from proxy.identity import key_hash, key_id, key_label

DEFAULT_USER = "default"
# A key's own limits: a key that sets any is counted on counters of its own too.
_KEY_LIMITS = tuple(f for f in KeyConfig.model_fields
                    if f not in ("key", "name", "admission", "capture", "tags"))
PASSTHROUGH_LABEL_LIMIT = 1000


class UserIndex:
    """Key hash -> principal, built once per configuration version."""

    def __init__(self, policy: Policy) -> None:
        self.mode = policy.effective_mode
        self._defaults = policy.defaults
        self._open = Principal(DEFAULT_USER, unlimited(policy.defaults), enforce=False)
        self._by_hash: dict[str, Principal] = {}
        for user, cfg in policy.users.items():
            team = policy.teams.get(cfg.team) if cfg.team is not None else None
            # Worked out once per user, not per key: the limits of keys without their own, and
            # the admission rule of keys that set none (30,000 keys: seconds otherwise).
            user_limits: EffectiveLimits | None = None
            user_admission = (cfg.admission, team.admission if team is not None else None,
                              policy.defaults.admission)
            for entry in cfg.keys:
                # A plain key string: no limits, name or admission of its own.
                key = entry if isinstance(entry, KeyConfig) else None
                hashed = entry if isinstance(entry, str) else entry.key
                kid = key_id(hashed)
                if key is not None and any(getattr(key, f) is not None for f in _KEY_LIMITS):
                    limits = limits_for(policy, user, key, key_label(key.name, kid))
                else:
                    if user_limits is None:
                        user_limits = limits_for(policy, user)
                    limits = user_limits
                self._by_hash[hashed] = Principal(
                    user=user,
                    limits=limits,
                    key_id=kid,
                    key_name=key.name if key is not None else None,
                    team=cfg.team,
                    admission=resolve(key.admission if key is not None else None,
                                      *user_admission),
                )
        self._passthrough_labels: set[str] = set()

    def release(self) -> None:
        """Empty the index entry by entry (a replaced version's, which no request holds)."""
        while self._by_hash:
            self._by_hash.popitem()

    def authenticate(self, request: web.Request) -> Principal:
        if self.mode == "open":
            return self._open
        raw = client_key(request)
        if raw is None:
            raise AuthenticationFailed(
                "You didn't provide an API key. Send the key this proxy issued you as "
                "'Authorization: Bearer <key>'."
            )
        hashed = key_hash(raw)
        if self.mode == "passthrough":
            return self._passthrough(hashed)
        principal = self._by_hash.get(hashed)
        if principal is None:
            raise AuthenticationFailed("Incorrect API key provided.")
        return principal

    def _passthrough(self, hashed: str) -> Principal:
        label = "key-" + key_id(hashed)
        # The user label comes from client keys here; cap how many distinct ones get a series.
        if label not in self._passthrough_labels:
            if len(self._passthrough_labels) >= PASSTHROUGH_LABEL_LIMIT:
                label = "key-other"
            else:
                self._passthrough_labels.add(label)
        return Principal(
            user=label, limits=unlimited(self._defaults), key_id=label[4:], enforce=False,
            forward_client_key=True,
        )


# Where clients send their key: OpenAI's SDKs as a bearer token, Azure-style SDKs in `api-key`,
# Anthropic's in `x-api-key` (or as a bearer token with `auth_token`).
KEY_HEADERS = ("Authorization", "api-key", "x-api-key")


def client_key(request: web.Request) -> str | None:
    """The client's key, from whichever of KEY_HEADERS carries it.

    Two headers (or two lines of one header) carrying different keys are refused (401), not
    settled by a precedence rule: a client (or a gateway in front of it that adds a header)
    that sends two keys cannot know which one is billed, and a silent choice would bill the
    other principal. The same key twice is accepted. The message never names a key."""
    found: dict[str, set[str]] = {}
    # Every line of each header, not the first: two `Authorization` lines with different keys
    # are two keys as much as a bearer and an `x-api-key` are.
    for name in KEY_HEADERS:
        for line in request.headers.getall(name, ()):
            value = line.strip()
            if name == "Authorization":
                scheme, _, value = value.partition(" ")
                value = value.strip() if scheme.lower() == "bearer" else ""
            if value:
                found.setdefault(name, set()).add(value)
    keys = set().union(*found.values())
    if len(keys) > 1:
        where = " and ".join(found) if len(found) > 1 else f"two {next(iter(found))} lines"
        raise AuthenticationFailed(
            f"The request carries different API keys in {where}; send one key, in one header."
        )
    return keys.pop() if keys else None
