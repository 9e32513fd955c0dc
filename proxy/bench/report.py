"""What a run says: a terminal table, a progress bar on stderr, JSON and CSV files."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from proxy.bench.runner import BenchResult, Tick
from proxy.bench.stats import Dist, LevelStats

_PCTS = ("p50", "p90", "p95", "p99")


def _ms(seconds: float) -> str:
    if math.isnan(seconds):
        return "-"
    ms = seconds * 1000
    return f"{ms:.3f}" if ms < 1 else f"{ms:.2f}" if ms < 100 else f"{ms:.0f}"


def _num(x: float | None, digits: int = 1) -> str:
    if x is None or math.isnan(x):
        return "-"
    if math.isinf(x):
        return "inf"
    return f"{x:,.{digits}f}"


def _load(st: LevelStats) -> str:
    return f"{st.load:g}/s" if st.mode == "rate" else f"{st.load:g}"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(out)


def _pcts(d: Dist) -> str:
    return "/".join(_ms(getattr(d, p)) for p in _PCTS)


ITL_NOTE = ("TPOT = ITL per token as AIPerf defines it, (E2E - TTFT) / (output tokens - 1); "
            "ITL here: the gaps between content chunks")


def render(result: BenchResult) -> str:
    """The human-readable report: one row per level, then errors, comparisons, warnings."""
    has_slo = any(st.slo for st in result.levels)
    headers = ["endpoint", "load", "prompt", "ok", "err", "req/s", "out tok/s",
               "tok/s/stream p50", "TTFT ms p50/p90/p95/p99", "TPOT ms p50/p99",
               "ITL ms p50/p99", "E2E ms p50/p99", "usage diff"]
    if has_slo:
        headers.append("goodput")
    headers.append("lag p99 ms")
    rows = []
    for st in result.levels:
        diff = ("-" if not st.usage_reported
                else f"{st.usage_diff_tokens:+d} ({_num(st.usage_diff_pct, 1)}%)")
        row = [
            st.endpoint, _load(st), str(st.prompt_tokens or "file"), str(st.ok), str(st.errors),
            _num(st.request_throughput, 2), _num(st.output_tokens_per_s, 0),
            _num(st.stream_tokens_per_s.p50, 0), _pcts(st.ttft),
            f"{_ms(st.tpot.p50)}/{_ms(st.tpot.p99)}", f"{_ms(st.itl.p50)}/{_ms(st.itl.p99)}",
            f"{_ms(st.e2e.p50)}/{_ms(st.e2e.p99)}", diff,
        ]
        if has_slo:
            frac = st.goodput_fraction
            row.append("-" if st.goodput is None or frac is None
                       else f"{_num(st.goodput, 2)}/s ({frac:.0%})")
        row.append(_num(st.lag_p99_ms, 2) + ("!" if st.warnings else ""))
        rows.append(row)
    parts = [_table(headers, rows), ITL_NOTE]
    errs = [st for st in result.levels if st.errors]
    if errs:
        lines = ["", "errors:"]
        for st in errs:
            by_class = ", ".join(f"{k} {v}" for k, v in st.errors_by_class.items())
            by_status = ", ".join(f"{k} {v}" for k, v in st.errors_by_status.items())
            lines.append(f"  {st.endpoint} load {_load(st)} prompt {st.prompt_tokens or 'file'}: "
                         f"by class: {by_class}; by status: {by_status}")
        parts.append("\n".join(lines))
    if result.comparisons:
        c0 = result.comparisons[0]
        head = ["load", "prompt", "TTFT p50 +ms", "TTFT p99 +ms", "E2E p50 +ms", "TTFT p50 x",
                "tok/s/stream x", "out tok/s x", "req/s x"]
        crow = []
        for c in result.comparisons:
            r, d = c.ratios, c.deltas
            crow.append([
                f"{c.load:g}", str(c.prompt_tokens or "file"),
                f"{d['ttft_p50'] * 1000:+.2f}", f"{d['ttft_p99'] * 1000:+.2f}",
                f"{d['e2e_p50'] * 1000:+.2f}", _num(r["ttft_p50"], 3),
                _num(r["stream_tokens_per_s_p50"], 3), _num(r["output_tokens_per_s"], 3),
                _num(r["request_throughput"], 3),
            ])
        parts.append(f"\n{c0.base} vs {c0.other} (+ms: {c0.base} - {c0.other}; "
                     f"x: {c0.base} / {c0.other}):\n" + _table(head, crow))
    if result.warnings:
        parts.append("\n" + "\n".join(f"WARNING: {w}" for w in result.warnings))
    parts.append(f"\n{len(result.results)} requests in {result.wall_s:.1f} s, event loop: "
                 f"{result.loop}")
    return "\n".join(parts)


def _clean(obj: Any) -> Any:
    """NaN and infinity are not JSON: write them as null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    return obj


def level_dict(st: LevelStats) -> dict[str, Any]:
    """A level's figures, plus `itl_per_token`: TPOT under the name AIPerf gives it (its
    "inter token latency" is (E2E - TTFT) / (output tokens - 1) per request), so a reader
    coming from AIPerf finds it; `itl` stays the gaps between content chunks."""
    out = dataclasses.asdict(st)
    out["itl_per_token"] = out["tpot"]
    return out


def to_json(result: BenchResult, config: Mapping[str, Any],
            extra: Mapping[str, Any] | None = None) -> str:
    """The run as JSON; `extra`: more top-level sections (`bench --replay`'s "replay")."""
    levels = [level_dict(st) for st in result.levels]
    data = {
        "config": dict(config),
        "loop": result.loop,
        "wall_s": result.wall_s,
        "levels": levels,
        "comparisons": [dataclasses.asdict(c) for c in result.comparisons],
        "warnings": result.warnings,
        **(extra or {}),
    }
    return json.dumps(_clean(data), indent=2)


def _flat(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flat(f"{prefix}.{k}" if prefix else str(k), v, out)
    elif isinstance(value, list | tuple):
        out[prefix] = "; ".join(map(str, value))
    else:
        out[prefix] = "" if isinstance(value, float) and not math.isfinite(value) else value


def to_csv(result: BenchResult) -> str:
    """One row per level; nested figures flattened (`ttft.p50`, `errors_by_class.timeout`)."""
    rows = []
    for st in result.levels:
        row: dict[str, Any] = {}
        _flat("", level_dict(st), row)
        rows.append(row)
    names: list[str] = []
    for row in rows:
        names += [k for k in row if k not in names]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=names, restval="")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def write_text(path: str | Path, text: str) -> None:
    Path(path).write_text(text, encoding="utf-8")


class ProgressBar:
    """A one-line bar on a stream (stderr), redrawn at most 10 times a second."""

    def __init__(self, stream: IO[str] | None = None, width: int = 30) -> None:
        self.stream = stream or sys.stderr
        self.width = width
        self._last = 0.0
        self._label = ""

    def _bar(self, done: float, total: float) -> str:
        filled = int(self.width * min(done, total) / total)
        return "[" + "#" * filled + "." * (self.width - filled) + "]"

    def __call__(self, tick: Tick) -> None:
        now = time.monotonic()
        label, done, total = tick.label, tick.done, tick.total
        final = total and done >= total
        if label == self._label and now - self._last < 0.1 and not final:
            return
        self._last, self._label = now, label
        where = f"level {tick.level}/{tick.levels}" if tick.level else "warm-up"
        text = f"\r{where} {label:<36}"
        if tick.duration_s:
            text += (f" {self._bar(tick.elapsed_s, tick.duration_s)} "
                     f"{min(tick.elapsed_s, tick.duration_s):.1f}/{tick.duration_s:g} s, "
                     f"{done} requests")
        elif total:
            text += f" {self._bar(done, total)} {done}/{total}"
        else:
            text += f" {done} requests"
        if errors := tick.errors:
            text += f", {errors} errors"
        self.stream.write(text + "\033[K")
        self.stream.flush()

    def close(self) -> None:
        if self._label:
            self.stream.write("\r\033[K")
            self.stream.flush()
