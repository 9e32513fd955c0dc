"""A budget refusal rendered as the client sees it: OpenAI's 429 shape, prose and headers.

`Budget` decides and returns a `Refusal` value; this is the one place that turns one into a
response, and where the `x-ratelimit-*` headers of admitted requests are written too.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from zoneinfo import ZoneInfo

from proxy.budget import limits as lim
from proxy.budget.store import InFlightLimit, Scope, ScopeKind
from proxy.errors import BudgetExceeded


class RefusalKind(enum.Enum):
    CONCURRENCY = "concurrency"  # an in-flight set is full: retry in a moment
    # A day, week or month is spent: not before it resets (x-should-retry: false).
    QUOTA = "quota"
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
    # `needed` is the least the request could be admitted with (the `clamp` policy: its
    # prompt and min_output_tokens), not its worst case.
    at_least: bool = False

    @property
    def kind(self) -> RefusalKind:
        if self.in_flight is not None:
            return RefusalKind.CONCURRENCY
        assert self.window is not None
        return RefusalKind.QUOTA if self.window.name.calendar else RefusalKind.RATE


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
    lim.WindowName.WEEKLY_TOKENS: "tokens-week",
    lim.WindowName.MONTHLY_TOKENS: "tokens-month",
    lim.WindowName.DAILY_USD: "usd-day",  # in US dollars, not nano-dollars
    lim.WindowName.MONTHLY_USD: "usd-month",
}

# The wire `code` of a spent calendar window: daily tokens keep the code clients know.
_QUOTA_CODES = {
    lim.WindowName.DAILY_TOKENS: "daily_quota_exceeded",
    lim.WindowName.DAILY_INPUT_TOKENS: "daily_quota_exceeded",
    lim.WindowName.DAILY_OUTPUT_TOKENS: "daily_quota_exceeded",
    lim.WindowName.WEEKLY_TOKENS: "weekly_quota_exceeded",
    lim.WindowName.MONTHLY_TOKENS: "monthly_quota_exceeded",
    lim.WindowName.DAILY_USD: "daily_budget_exceeded",
    lim.WindowName.MONTHLY_USD: "monthly_budget_exceeded",
}

_PERIOD_WORDS = {lim.Period.DAY: "Daily", lim.Period.WEEK: "Weekly", lim.Period.MONTH: "Monthly",
                 lim.Period.MINUTE: "Per-minute"}


def usd(nanos: int) -> str:
    """Nano-dollars as dollars, exact and short: 1.5, 0.000123, 2 (no trailing zeros)."""
    return format(Decimal(nanos).scaleb(-9).normalize(), "f")


def _amount(window: lim.Window, value: int) -> str:
    return f"${usd(value)}" if window.measure is lim.Measure.COST else f"{value:,}"


def rate_limit_headers(windows: tuple[lim.Window, ...], used: tuple[int, ...],
                       now: float) -> dict[str, str]:
    """`x-ratelimit-*` in OpenAI's style for every limited window (the tightest per name)."""
    out: dict[str, str] = {}
    best: dict[str, int] = {}
    for w, u in zip(windows, used, strict=True):
        limit = w.limit
        if limit is None:
            continue
        name = _HEADER_NAMES[w.name]
        remaining = max(0, limit - u)
        if name in best and best[name] <= remaining:
            continue
        best[name] = remaining
        if w.measure is lim.Measure.COST:
            out[f"x-ratelimit-limit-{name}"] = usd(limit)
            out[f"x-ratelimit-remaining-{name}"] = usd(remaining)
        else:
            out[f"x-ratelimit-limit-{name}"] = str(limit)
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
    outputs = "min_output_tokens" if refusal.at_least else "max output tokens"
    if window.measure is lim.Measure.COST:
        what = f"{_PERIOD_WORDS[window.name.period]} cost budget"
        needs = f"the prompt plus {outputs}, at the model's price"
    else:
        what = f"{window.name.replace('_', ' ').capitalize()} limit"
        needs = f"the prompt plus {outputs}"
    msg = (
        f"{what} reached for user '{user}'{scope}: "
        f"{_amount(window, left)} of {_amount(window, window.limit)} left, and this request "
        f"needs {'at least' if refusal.at_least else 'up to'} "
        f"{_amount(window, refusal.needed)} ({needs}). It resets at {reset_at} "
        f"(in {_duration(window.resets_at - now)})."
    )
    quota = kind is RefusalKind.QUOTA
    never = refusal.needed > window.limit  # would not fit even in an empty window
    if quota or never:
        if never and refusal.at_least:
            msg += (" This request can never fit this limit: its prompt plus "
                    "min_output_tokens is larger.")
        elif never:
            msg += " Lower max_tokens: this request can never fit this limit."
        return BudgetExceeded(
            msg, type_="insufficient_quota" if quota else "tokens",
            code=_QUOTA_CODES[window.name] if quota else "rate_limit_exceeded",
            limit=window.name,
            # The openai SDKs retry every 429 unless told not to; a spent day, week or month
            # will not come back within any retry budget.
            headers={**headers, "Retry-After": str(retry_after), "x-should-retry": "false"},
        )
    return BudgetExceeded(
        msg, type_="requests" if window.measure is lim.Measure.REQUESTS else "tokens",
        code="rate_limit_exceeded", limit=window.name,
        headers={**headers, "Retry-After": str(retry_after)},
    )


def unpriced(user: str, model: str, window: lim.Window) -> BudgetExceeded:
    """A cost budget applies but the model has no price: refused rather than counted as free,
    which would let the budget be overspent without bound. Not worth a retry: the price table
    changes with the configuration, not with time."""
    scope = _scope_words(window.scope)
    return BudgetExceeded(
        f"The model `{model}` has no price in this proxy's price table, so the "
        f"{window.name.replace('_', ' ')} cost budget of user '{user}'{scope} cannot be "
        "enforced for it. Use a priced model, or ask the operator to add its price.",
        type_="insufficient_quota", code="model_not_priced", limit=window.name,
        headers={"x-should-retry": "false"},
    )


def _scope_words(scope: Scope) -> str:
    if scope.kind is ScopeKind.KEY:
        return f" (key '{scope.name}')"
    if scope.kind is ScopeKind.MODELS:
        return f" (models '{scope.name}')"
    if scope.kind is ScopeKind.TEAM:
        return f" (the budget of team '{scope.name}', shared by its users)"
    return ""


class QuotaEnded(BudgetExceeded):
    """The error event that ends a stream under `admission: estimate` whose reservation could
    not be topped up: OpenAI's shape, the window's quota code, so the SDKs raise it naming the
    quota. Its error class is `budget_exceeded`, as a refusal's; the status (200) and
    `tokenmeter_budget_streams_ended_total` tell the two apart."""


def ended(user: str, window: lim.Window, output_tokens: int, now: float,
          tz: str) -> QuotaEnded:
    """The stream ended by its quota after `output_tokens` (about, as counted). (One ended
    because the store failed is not: proxy.pipeline.topup.)"""
    reset_at = datetime.fromtimestamp(window.resets_at, ZoneInfo(tz)).isoformat()
    if window.measure is lim.Measure.COST:
        what = f"{_PERIOD_WORDS[window.name.period]} cost budget"
    else:
        what = f"{window.name.replace('_', ' ').capitalize()} limit"
    quota = window.name in _QUOTA_CODES
    return QuotaEnded(
        f"{what} reached for user '{user}'{_scope_words(window.scope)} while this response "
        f"streamed: it was ended after {output_tokens} output tokens (admission: estimate). "
        f"It resets at {reset_at} (in {_duration(window.resets_at - now)}).",
        type_="insufficient_quota" if quota else "tokens",
        code=_QUOTA_CODES[window.name] if quota else "rate_limit_exceeded",
        limit=window.name, headers={},
    )
