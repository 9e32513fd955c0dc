"""The `estimate` admission policy's learned output estimate, and the size of its top-ups.

A stream under `estimate` reserves its prompt plus an estimate of its output instead of its
output cap, and the relay tops the reservation up while the stream runs (`proxy.pipeline.topup`).
The estimate is learned per user, key and model from the output lengths of their recent
requests that completed: the last `SAMPLES` lengths are kept in the store, in the user's slot,
so every replica sharing the store shares them (a Redis hash written as a ring; the in-process
store keeps the same ring). The estimate is their `PERCENTILE`, so one stream in ten or so needs
a top-up, bounded by the request's cap; before any history, `admission.initial_estimate`.

Only completed requests teach it: a stream cut short (by its client, an upstream failure or the
quota) says nothing about how long its answer would have been, and would drag the estimate down.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

SAMPLES = 32  # output lengths kept per (user, key, model): enough for a stable p90
PERCENTILE = 0.9
ESTIMATE_TTL_S = 14 * 86_400  # a key unused this long starts afresh
MIN_STEP = 256  # the smallest top-up asked for: fewer calls on streams far past the estimate


def estimate(samples: Sequence[int], cap: int, initial: int) -> int:
    """The output tokens to reserve for a request whose output may reach `cap` (> 0)."""
    if not samples:
        return max(1, min(cap, initial))
    ordered = sorted(samples)
    at = max(0, math.ceil(PERCENTILE * len(ordered)) - 1)
    return max(1, min(cap, ordered[at]))


def step(estimate: int, left: int) -> int:
    """The next top-up: half the estimate, at least `MIN_STEP`, never past the cap (`left`:
    the output tokens the cap allows beyond what is reserved)."""
    return max(0, min(left, max(estimate // 2, MIN_STEP)))


def sample_key(slot: str, user: str, key_id: str, model: str) -> str:
    """The store key of a (user, key, model)'s samples: in the user's slot (a Redis Cluster
    keeps it with their counters). The key's id is a hash prefix, never the key itself."""
    return f"{slot}:est:{user}:{key_id}:{model}"
