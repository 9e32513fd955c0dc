"""The ground floor of a request's facts: the one record of a finished request, made once by
settle and read by every projection of it (the metrics, the access-log line, the ledger row, the
spans and the cost headers), with the two values it is made of that other layers produce: what
the response cache did (`CacheOutcome`, handed to settle by the cache) and the request's
timings (`Figures`, computed by `proxy.telemetry.meter`).

Below telemetry, the cache and the ledger, so each of them reads the same types: the cache's
result is one enum here, not a string each reader compares with its own copy."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from proxy.config.tags import NO_TAGS, Tags
from proxy.cost import CostLines
from proxy.errors import ErrorClass
from proxy.protocol.usage import ZERO, Usage


class CacheResult(StrEnum):
    """What the response cache did for one request (the `cache` label, the ledger's `cache`
    column, the access log's `cache`)."""

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
    """What the response cache did for one request: the one value the handler hands settle,
    from which the ledger row, the metrics and the budget charge read the cache's part (see
    docs/cache.md)."""

    result: CacheResult
    # On a hit: the usage of the answer the entry holds (what the hit saved, priced at the
    # prices of the day of the hit by settle); None otherwise.
    saved: Usage | None = None
    age_s: float | None = None  # on a hit: how old the entry is
    reason: BypassReason | None = None  # on a bypass: why


NOT_CONSULTED = CacheOutcome(CacheResult.NONE)


@dataclass(frozen=True, slots=True)
class Figures:
    """A request's timings, in seconds (`proxy.telemetry.meter.RequestMeter.figures`)."""

    duration: float
    overhead: float | None  # proxy's own time before the upstream call
    ttft: float | None  # request received -> first content token forwarded to the client
    upstream_ttft: float | None  # upstream call started -> first content token received
    time_per_output_token: float | None  # decode phase: after the first token
    output_tokens_per_second: float | None
    content_chunks: int
    mean_inter_chunk: float | None


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """Everything known about one finished request, made once by settle: the metrics, the
    access-log line (`proxy.telemetry.accesslog`) and the ledger row (`LedgerRow.of`) each
    read their part of it. Never prompt or response text, never a key."""

    request_id: str
    operation: str
    requested_model: str  # what the client asked for
    sent_model: str | None  # sent upstream (a fallback's when one served); None: never sent
    model_label: str
    upstream: str | None  # None: no upstream was tried
    user: str  # "anonymous" when no key was accepted
    key: str | None  # a key's configured name, else the first 12 hex digits of its hash
    team: str | None
    status: int
    error_class: ErrorClass
    stream: bool
    usage: Usage
    figures: Figures
    fallback_from: str | None  # the model asked for, when a fallback served instead
    response_model: str | None  # the model the upstream's answer names (logged and booked)
    attempts: int  # upstream calls made: retries and fallbacks included
    cost: CostLines | None  # None: the model has no price
    price_version: str | None  # of the price table that priced `cost`
    windows: str  # budget windows charged, space-separated `scope:window:stamp`
    ended_at: float  # epoch seconds, UTC
    # What the response cache did. On a hit `usage` is ZERO (no upstream call) and these are
    # what the stored answer used and its cost at the price of the day of the hit (None: no
    # price).
    cache: CacheResult = CacheResult.NONE
    cache_reason: BypassReason | None = None  # a bypass's
    saved_usage: Usage = ZERO
    saved_cost: CostLines | None = None
    tags: Tags = NO_TAGS  # what the request was for (proxy.config.tags)
    # The upstream's own id of the answer (its `x-request-id` / `request-id`; None: no
    # upstream answered, or it sent none): what the SDKs show as `request_id`.
    upstream_request_id: str | None = None

    @property
    def started_at(self) -> float:
        """Epoch seconds, UTC: when the request was received (its end less its duration)."""
        return self.ended_at - self.figures.duration

    @property
    def model(self) -> str:
        """The model that served (or was last tried), else the one asked for (logged, never a
        label)."""
        return self.requested_model if self.sent_model is None else self.sent_model

    @property
    def upstream_label(self) -> str:
        return "none" if self.upstream is None else self.upstream

    @property
    def hit(self) -> bool:
        """Answered by the response cache: no upstream call."""
        return self.cache is CacheResult.HIT
