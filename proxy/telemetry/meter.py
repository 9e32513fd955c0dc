"""Latency of one request, measured as it streams and computed in one place.

The relay calls `mark_*` at fixed points and `content(now)` for every content chunk; `figures()`
turns those timestamps and the final usage into the numbers the metrics and the log line report.
Inter-chunk gaps go into a small local bucket array (bisect is C code), merged into the shared
histogram once at the end, so the per-chunk cost is one subtraction and one bisect.
"""

from __future__ import annotations

import time
from bisect import bisect_left

from proxy.record import Figures

# The inter-chunk gaps are bucketed here, per request, on the metric's own bounds.
from proxy.telemetry.families import TPOT_BUCKETS

_ZERO_GAP = bisect_left(TPOT_BUCKETS, 0.0)  # the bucket of a gap of 0 s

class RequestMeter:
    __slots__ = (
        "_gaps",
        "_last",
        "attempt_start",
        "chunks",
        "end",
        "first_token_received",
        "first_token_sent",
        "received",
        "upstream_start",
    )

    def __init__(self, received: float | None = None) -> None:
        self.received = time.perf_counter() if received is None else received
        self.upstream_start: float | None = None
        self.attempt_start: float | None = None
        self.first_token_received: float | None = None
        self.first_token_sent: float | None = None
        self._last = 0.0
        self.chunks = 0
        self.end: float | None = None
        self._gaps = [0] * (len(TPOT_BUCKETS) + 1)

    def mark_upstream_start(self) -> None:
        """Each candidate upstream's first call: the proxy's overhead ends at the first one, the
        upstream TTFT is the serving upstream's own (its retries included)."""
        self.attempt_start = time.perf_counter()
        if self.upstream_start is None:
            self.upstream_start = self.attempt_start

    def content(self, now: float) -> None:
        """A content chunk arrived at `now` (and has already been written to the client)."""
        if self.chunks:
            self._gaps[bisect_left(TPOT_BUCKETS, now - self._last)] += 1
        else:
            self.first_token_received = now
            self.first_token_sent = time.perf_counter()
        self._last = now
        self.chunks += 1

    def content_run(self, now: float, count: int) -> None:
        """`count` content chunks arrived together at `now`: exactly `count` calls of
        `content(now)`, in constant time (the gaps between them are 0)."""
        self.content(now)
        if count > 1:
            self._gaps[_ZERO_GAP] += count - 1
            self.chunks += count - 1

    def finish(self) -> None:
        if self.end is None:
            self.end = time.perf_counter()

    def gap_buckets(self) -> list[int]:
        """Per-bucket (non-cumulative) counts of inter-chunk gaps, last slot is +Inf."""
        return self._gaps

    def figures(self, output_tokens: int) -> Figures:
        end = self.end if self.end is not None else time.perf_counter()
        ttft = upstream_ttft = tpot = tps = mean_gap = None
        if self.first_token_sent is not None:
            ttft = self.first_token_sent - self.received
        if self.first_token_received is not None and self.attempt_start is not None:
            upstream_ttft = self.first_token_received - self.attempt_start
        if self.first_token_received is not None and self.chunks > 1:
            decode = self._last - self.first_token_received
            mean_gap = decode / (self.chunks - 1)
            # Tokens after the first one over the decode phase; a chunk may hold several tokens,
            # so the token count (reported or estimated) is the numerator, not the chunk count.
            if output_tokens > 1 and decode > 0:
                tpot = decode / (output_tokens - 1)
                tps = (output_tokens - 1) / decode
        overhead = None
        if self.upstream_start is not None:
            overhead = self.upstream_start - self.received
        return Figures(
            duration=end - self.received,
            overhead=overhead,
            ttft=ttft,
            upstream_ttft=upstream_ttft,
            time_per_output_token=tpot,
            output_tokens_per_second=tps,
            content_chunks=self.chunks,
            mean_inter_chunk=mean_gap,
        )
