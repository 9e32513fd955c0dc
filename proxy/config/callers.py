"""What the configuration says of each caller beyond its limits: whether its requests may be
captured (a user's or a key's `capture: false`) and its default tags (a user's `tags:`, its
key's over them, each checked against the `tags:` section's rules).

Built once per configuration version beside the key index (proxy.auth), and read by the wing
that needs it: capture's observer and the request's tags. `Principal` carries only what
admission needs, so a new per-caller setting is added here, not to every principal.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.config.policy import KeyConfig, Policy
from proxy.config.tags import NO_TAGS, TagRules, Tags
from proxy.identity import key_id


@dataclass(frozen=True, slots=True)
class CallerSettings:
    capture: bool = True  # False: the user or the key is marked never-capture
    tags: Tags = NO_TAGS  # default tags (user's, key's over them); the request's win per key


DEFAULT_CALLER = CallerSettings()


class CallerIndex:
    """(user, key id) -> its settings; a caller the configuration says nothing special of (and
    every caller of the open and pass-through modes) gets `DEFAULT_CALLER`."""

    __slots__ = ("_by_key",)

    def __init__(self, policy: Policy, rules: TagRules) -> None:
        # Only the callers with a setting of their own are held: 30,000 plain keys hold none.
        self._by_key: dict[tuple[str, str], CallerSettings] = {}
        for user, cfg in policy.users.items():
            for entry in cfg.keys:
                key = entry if isinstance(entry, KeyConfig) else None
                hashed = entry if isinstance(entry, str) else entry.key
                settings = CallerSettings(
                    capture=cfg.capture and (key is None or key.capture),
                    tags=rules.defaults(cfg.tags, key.tags if key is not None else None),
                )
                if settings != DEFAULT_CALLER:
                    self._by_key[(user, key_id(hashed))] = settings

    def of(self, user: str, key: str | None) -> CallerSettings:
        """The settings of `user` calling with the key whose id is `key`."""
        if key is None or not self._by_key:
            return DEFAULT_CALLER
        return self._by_key.get((user, key), DEFAULT_CALLER)
