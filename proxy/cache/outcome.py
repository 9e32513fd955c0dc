"""What the response cache did for one request: the one value the handler hands settle, from
which the ledger row, the metrics and the budget charge read the cache's part (see
docs/cache.md)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from proxy.protocol.usage import Usage


class CacheResult(StrEnum):
    NONE = "none"  # not consulted: the cache is off, or the request is not cacheable
    HIT = "hit"  # answered from an entry: no upstream call
    MISS = "miss"  # looked up, not found (or the store failed): went upstream
    BYPASS = "bypass"  # the cache applies but was passed by: `BypassReason` says why


class BypassReason(StrEnum):
    """Why a request the cache applies to went upstream without a look-up (`x-tokenmeter-
    cache-reason`, the access log's `cache_reason`)."""

    SAMPLED = "sampled"  # a sampling request (temperature > 0...) and `cache_sampled` off
    NO_STORE = "no-store"  # the client's `Cache-Control: no-store`: neither read nor stored
    NO_CACHE = "no-cache"  # the client's `Cache-Control: no-cache`: not read, stored fresh
    NOT_CACHEABLE = "not-cacheable"  # an operation the cache does not keep (embeddings...)
    PASSTHROUGH = "passthrough"  # the client's own upstream key (mode: passthrough)
    # Not a bypass: a miss whose answer passed `max_entry_kb` and was not stored. Said beside
    # `miss` on a JSON answer (its size is known before its headers go out) and in the log
    # line of either form (a stream's headers are gone by then).
    TOO_LARGE = "too-large"


@dataclass(frozen=True, slots=True)
class CacheOutcome:
    result: CacheResult
    # On a hit: the usage of the answer the entry holds (what the hit saved, priced by settle
    # at the prices in force when the hit is served, not those of the call that filled the
    # entry); None otherwise.
    saved: Usage | None = None
    age_s: float | None = None  # on a hit: how old the entry is
    reason: BypassReason | None = None  # on a bypass: why


NOT_CONSULTED = CacheOutcome(CacheResult.NONE)
