"""A budget refusal rendered as the client sees it: OpenAI's 429 shape, prose and headers.

`Budget` decides and returns a `Refusal` value; this is the one place that turns one into a
response, and where the `x-ratelimit-*` headers of admitted requests are written too.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from datetime import datetime
from zoneinfo import ZoneInfo

from proxy.budget import limits as lim
from proxy.budget.store import InFlightLimit, Scope, ScopeKind
from proxy.errors import BudgetExceeded


class RefusalKind(enum.Enum):
    CONCURRENCY = "concurrency"  # an in-flight set is full: retry in a moment
    QUOTA = "quota"  # a daily window is spent: not before it resets (x-should-retry: false)
    RATE = "rate"  # a per-minute window is full: retry after it rolls over


@dataclass(frozen=True, slots=True)
class Refusal:
    """What refused a request: one window that would go over, or one in-flight set full."""

    user: str
    windows: tuple[lim.Window, ...]
    used: tuple[int, ...]  # per window, as the store saw them
    window: lim.Window | None  # the window that refused
    needed: int  # what the request would have added to it
    in_flight: InFlightLimit | None  # or the concurrency limit that refused

    @property
    def kind(self) -> RefusalKind:
        if self.in_flight is not None:
            return RefusalKind.CONCURRENCY
        assert self.window is not None
        return RefusalKind.QUOTA if self.window.name.daily else RefusalKind.RATE


class Refused(Exception):
    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.user)
        self.refusal = refusal


def _duration(seconds: float) -> str:
    """OpenAI's reset format: "1s", "6m0s", "1h2m3s"."""
    s = max(0, math.ceil(seconds))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    if h:
        return f"{h}h{m}m{sec}s"
    if m:
        return f"{m}m{sec}s"
    return f"{sec}s"


_HEADER_NAMES = {
    lim.WindowName.REQUESTS_PER_MINUTE: "requests",
    lim.WindowName.TOKENS_PER_MINUTE: "tokens",
    lim.WindowName.DAILY_TOKENS: "tokens-day",
    lim.WindowName.DAILY_INPUT_TOKENS: "input-tokens-day",
    lim.WindowName.DAILY_OUTPUT_TOKENS: "output-tokens-day",
}


def rate_limit_headers(windows: tuple[lim.Window, ...], used: tuple[int, ...],
                       now: float) -> dict[str, str]:
    """`x-ratelimit-*` in OpenAI's style for every limited window (the tightest per name)."""
    out: dict[str, str] = {}
    best: dict[str, int] = {}
    for w, u in zip(windows, used, strict=True):
        if w.limit is None:
            continue
        name = _HEADER_NAMES[w.name]
        remaining = max(0, w.limit - u)
        if name in best and best[name] <= remaining:
            continue
        best[name] = remaining
        out[f"x-ratelimit-limit-{name}"] = str(w.limit)
        out[f"x-ratelimit-remaining-{name}"] = str(remaining)
        out[f"x-ratelimit-reset-{name}"] = _duration(w.resets_at - now)
    return out


def render(refusal: Refusal, now: float, tz: str) -> BudgetExceeded:
    headers = rate_limit_headers(refusal.windows, refusal.used, now)
    user = refusal.user
    kind = refusal.kind
    if kind is RefusalKind.CONCURRENCY:
        held = refusal.in_flight
        assert held is not None
        return BudgetExceeded(
            f"Too many concurrent requests for user '{user}'"
            f"{_scope_words(held.scope)}: the limit is {held.limit} at a time. Retry when "
            "one of them has finished.",
            type_="requests", code="concurrency_limit_exceeded",
            limit="max_concurrent_requests", headers={**headers, "Retry-After": "1"},
        )
    window = refusal.window
    assert window is not None and window.limit is not None
    used = refusal.used[refusal.windows.index(window)]
    left = max(0, window.limit - used)
    retry_after = max(1, math.ceil(window.resets_at - now))
    reset_at = datetime.fromtimestamp(window.resets_at, ZoneInfo(tz)).isoformat()
    scope = _scope_words(window.scope)
    what = window.name.replace("_", " ")
    msg = (
        f"{what.capitalize()} limit reached for user '{user}'{scope}: "
        f"{left:,} of {window.limit:,} left, and this request needs up to {refusal.needed:,} "
        f"(the prompt plus max output tokens). It resets at {reset_at} "
        f"(in {_duration(window.resets_at - now)})."
    )
    daily = kind is RefusalKind.QUOTA
    never = refusal.needed > window.limit  # would not fit even in an empty window
    if daily or never:
        if never:
            msg += " Lower max_tokens: this request can never fit this limit."
        return BudgetExceeded(
            msg, type_="insufficient_quota" if daily else "tokens",
            code="daily_quota_exceeded" if daily else "rate_limit_exceeded",
            limit=window.name,
            # The openai SDKs retry every 429 unless told not to; a spent daily quota will
            # not come back within any retry budget.
            headers={**headers, "Retry-After": str(retry_after), "x-should-retry": "false"},
        )
    return BudgetExceeded(
        msg, type_="requests" if window.measure is lim.Measure.REQUESTS else "tokens",
        code="rate_limit_exceeded", limit=window.name,
        headers={**headers, "Retry-After": str(retry_after)},
    )


def _scope_words(scope: Scope) -> str:
    if scope.kind is ScopeKind.KEY:
        return f" (key '{scope.name}')"
    if scope.kind is ScopeKind.MODELS:
        return f" (models '{scope.name}')"
    return ""
