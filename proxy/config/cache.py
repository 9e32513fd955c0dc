"""Configuration of the response cache (issue 23): the part the books read.

This file holds only what settle needs, `enabled` and `charge_hits`; the cache core's branch
extends it (ttl_s, max_entry_kb, scope, models, the store, per-route and per-principal
overrides). The two branches are merged by the lead: keep the fields below as they are.
"""

from __future__ import annotations

import enum

from proxy.config.policy import ConfigModel


class ChargeHits(enum.StrEnum):
    """What a budget is charged for an answer the cache served."""

    NONE = "none"  # nothing: the user's counters do not move (the default)
    FULL = "full"  # the saved usage and its cost, as if the model had run


class CacheConfig(ConfigModel):
    enabled: bool = False
    charge_hits: ChargeHits = ChargeHits.NONE
