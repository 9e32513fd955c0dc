"""Per-request records and their aggregation into per-level figures.

Pure code, no I/O: percentiles, TPOT, per-stream speed, goodput against SLOs, the difference
between the server's reported output tokens and our own tiktoken count.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

PERCENTILES = (10, 50, 90, 95, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between closest ranks (numpy's
    default, "type 7"). `values` need not be sorted; empty input gives NaN."""
    if not values:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError("percentile must be within 0..100")
    data = sorted(values)
    pos = (len(data) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


@dataclass(frozen=True, slots=True)
class Dist:
    """Summary of one quantity over the requests of a level (seconds, or tokens/s)."""

    n: int
    mean: float
    min: float
    p10: float
    p50: float
    p90: float
    p95: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Dist:
        data = sorted(v for v in values if not math.isnan(v))
        if not data:
            nan = math.nan
            return cls(0, nan, nan, nan, nan, nan, nan, nan, nan)
        p10, p50, p90, p95, p99 = (percentile(data, q) for q in PERCENTILES)
        return cls(len(data), math.fsum(data) / len(data), data[0], p10, p50, p90, p95, p99,
                   data[-1])


@dataclass(frozen=True, slots=True)
class RequestResult:
    """One request as the load generator saw it. Times are seconds from sending the request.

    ttft: first chunk with non-empty content (= e2e when not streaming); itl: every gap between
    consecutive content chunks; usage_output_tokens: the server's `usage.completion_tokens`
    (None when it reported none); local_output_tokens: tiktoken's count of the received text.
    """

    endpoint: str
    load: float
    prompt_tokens: int
    start: float
    ok: bool
    status: int | None = None
    error_class: str | None = None
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    itl: tuple[float, ...] = ()
    usage_output_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    local_output_tokens: int = 0
    stream: bool = True
    line: int = 0  # `bench --replay`: the request's line in the file (0: not a replay)
    answer: str | None = None  # `bench --replay`: the output text, cut at ANSWER_CHARS

    @property
    def output_tokens(self) -> int:
        """The server's figure when reported, else ours."""
        if self.usage_output_tokens is not None:
            return self.usage_output_tokens
        return self.local_output_tokens

    @property
    def tpot(self) -> float | None:
        return tpot(self.e2e, self.ttft, self.output_tokens) if self.stream else None


def tpot(e2e: float | None, ttft: float | None, output_tokens: int) -> float | None:
    """Time per output token: (e2e latency - TTFT) / (output tokens - 1); undefined below 2."""
    if e2e is None or ttft is None or output_tokens < 2:
        return None
    return (e2e - ttft) / (output_tokens - 1)


SLO_METRICS = ("ttft", "tpot", "e2e")
_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def parse_slo(text: str) -> dict[str, float]:
    """`ttft=200ms,tpot=5ms,e2e=2s` -> seconds per metric. A bare number is milliseconds."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        name = name.strip().lower()
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"bad SLO {part!r}: expected NAME=VALUE with NAME in "
                             f"{', '.join(SLO_METRICS)}, e.g. ttft=200ms")
        value = value.strip().lower()
        unit = next((u for u in ("us", "ms", "s") if value.endswith(u)), "")
        try:
            number = float(value.removesuffix(unit) if unit else value)
        except ValueError:
            raise ValueError(f"bad SLO value {value!r} in {part!r} (e.g. 200ms, 0.2s)") from None
        if not math.isfinite(number) or number <= 0:
            raise ValueError(f"SLO {part!r} must be a positive time")
        out[name] = number * _UNITS[unit or "ms"]
    return out


def meets_slo(r: RequestResult, slo: Mapping[str, float]) -> bool:
    """A successful request whose every SLO'd metric is defined and within its bound."""
    if not r.ok:
        return False
    values = {"ttft": r.ttft, "tpot": r.tpot, "e2e": r.e2e}
    return all((v := values[k]) is not None and v <= bound for k, bound in slo.items())


@dataclass(frozen=True, slots=True)
class LevelStats:
    """The figures of one (endpoint, load, prompt size) level.

    Rates are over `duration_s`, the wall time this endpoint was under load at this level (the
    sum of its blocks when endpoints are interleaved).
    """

    endpoint: str
    mode: str  # "concurrency" or "rate"
    load: float
    prompt_tokens: int
    requests: int
    ok: int
    errors: int
    errors_by_status: dict[str, int]
    errors_by_class: dict[str, int]
    duration_s: float
    request_throughput: float
    output_tokens_per_s: float
    ttft: Dist
    tpot: Dist
    itl: Dist
    e2e: Dist
    stream_tokens_per_s: Dist  # per stream: 1 / TPOT
    output_tokens: Dist
    usage_output_tokens: int  # over the requests that reported usage
    local_output_tokens: int  # our count, over the same requests
    usage_reported: int
    usage_diff_tokens: int  # local - usage
    usage_diff_pct: float
    slo: dict[str, float] = field(default_factory=dict)
    goodput: float | None = None  # requests/s meeting every SLO
    goodput_fraction: float | None = None
    lag_p99_ms: float = math.nan
    lag_max_ms: float = math.nan
    cpu_fraction: float = math.nan  # bench process CPU time / wall time
    warnings: tuple[str, ...] = ()


def aggregate(  # noqa: PLR0913  keyword-only, one per LevelStats figure it passes on
    results: Sequence[RequestResult],
    *,
    endpoint: str,
    mode: str,
    load: float,
    prompt_tokens: int,
    duration_s: float,
    slo: Mapping[str, float] | None = None,
    lag_p99_ms: float = math.nan,
    lag_max_ms: float = math.nan,
    cpu_fraction: float = math.nan,
    warnings: Sequence[str] = (),
) -> LevelStats:
    good = [r for r in results if r.ok]
    bad = [r for r in results if not r.ok]
    by_status = Counter("none" if r.status is None else str(r.status) for r in bad)
    by_class = Counter(r.error_class or "unknown" for r in bad)
    per = duration_s if duration_s > 0 else math.nan
    tpots = [t for r in good if (t := r.tpot) is not None]
    reported = [r for r in good if r.usage_output_tokens is not None]
    usage_total = sum(r.usage_output_tokens or 0 for r in reported)
    local_total = sum(r.local_output_tokens for r in reported)
    diff = local_total - usage_total
    goodput = fraction = None
    if slo:
        met = sum(meets_slo(r, slo) for r in results)
        goodput = met / per
        fraction = met / len(results) if results else math.nan
    return LevelStats(
        endpoint=endpoint,
        mode=mode,
        load=load,
        prompt_tokens=prompt_tokens,
        requests=len(results),
        ok=len(good),
        errors=len(bad),
        errors_by_status=dict(sorted(by_status.items())),
        errors_by_class=dict(sorted(by_class.items())),
        duration_s=duration_s,
        request_throughput=len(good) / per,
        output_tokens_per_s=sum(r.output_tokens for r in good) / per,
        ttft=Dist.of(r.ttft for r in good if r.ttft is not None),
        tpot=Dist.of(tpots),
        itl=Dist.of(g for r in good for g in r.itl),
        e2e=Dist.of(r.e2e for r in good if r.e2e is not None),
        stream_tokens_per_s=Dist.of(1 / t if t > 0 else math.inf for t in tpots),
        output_tokens=Dist.of(float(r.output_tokens) for r in good),
        usage_output_tokens=usage_total,
        local_output_tokens=local_total,
        usage_reported=len(reported),
        usage_diff_tokens=diff,
        usage_diff_pct=100 * diff / usage_total if usage_total else math.nan,
        slo=dict(slo or {}),
        goodput=goodput,
        goodput_fraction=fraction,
        lag_p99_ms=lag_p99_ms,
        lag_max_ms=lag_max_ms,
        cpu_fraction=cpu_fraction,
        warnings=tuple(warnings),
    )


@dataclass(frozen=True, slots=True)
class Comparison:
    """`base` against `other` at one (load, prompt size): ratios base / other, and for
    latencies the difference base - other in seconds."""

    base: str
    other: str
    load: float
    prompt_tokens: int
    ratios: dict[str, float]
    deltas: dict[str, float]


def _ratio(a: float, b: float) -> float:
    return a / b if b and math.isfinite(a) and math.isfinite(b) else math.nan


COMPARED: tuple[tuple[str, str, str], ...] = (
    # (name, field, percentile attribute or "" for a plain number)
    ("ttft_p50", "ttft", "p50"),
    ("ttft_p99", "ttft", "p99"),
    ("tpot_p50", "tpot", "p50"),
    ("itl_p99", "itl", "p99"),
    ("e2e_p50", "e2e", "p50"),
    ("stream_tokens_per_s_p50", "stream_tokens_per_s", "p50"),
    ("output_tokens_per_s", "output_tokens_per_s", ""),
    ("request_throughput", "request_throughput", ""),
)


def compare(base: LevelStats, other: LevelStats) -> Comparison:
    ratios: dict[str, float] = {}
    deltas: dict[str, float] = {}
    for name, attr, pct in COMPARED:
        a, b = getattr(base, attr), getattr(other, attr)
        if pct:
            a, b = getattr(a, pct), getattr(b, pct)
            if attr != "stream_tokens_per_s":
                deltas[name] = a - b
        ratios[name] = _ratio(a, b)
    return Comparison(base.endpoint, other.endpoint, base.load, base.prompt_tokens, ratios, deltas)
