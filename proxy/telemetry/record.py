"""The one record of a finished request, made once by settle and read by every projection of it:
the metrics, the access-log line, the ledger row, the spans and the cost headers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from proxy.config.tags import NO_TAGS, Tags
from proxy.cost import CostLines
from proxy.errors import ErrorClass
from proxy.protocol.usage import ZERO, Usage

if TYPE_CHECKING:
    from proxy.telemetry.meter import Figures


# CacheResult's values that the metrics tell apart (tests/telemetry/test_cache_dashboard.py
# checks they are CacheResult's).
CACHE_NOT_CONSULTED = "none"  # not counted in tokenmeter_cache_requests_total
CACHE_HIT = "hit"


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
    # What the response cache did: a `proxy.cache.outcome.CacheResult` value (none, hit, miss,
    # bypass; the cache is a layer above this one). On a hit `usage` is ZERO (no upstream
    # call) and these are what the stored answer used and its cost at the price of the day of
    # the hit (None: no price).
    cache: str = CACHE_NOT_CONSULTED
    cache_reason: str | None = None  # a bypass's: a `proxy.cache.outcome.BypassReason` value
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
        return self.cache == CACHE_HIT
