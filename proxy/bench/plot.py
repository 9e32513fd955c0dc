"""Charts as plain SVG (no plotting library), and an HTML page embedding the SVG.

Rows: TTFT, per-stream output tokens/s (1/TPOT), total output tokens/s. Columns: against the
load (concurrency or rate) and against the prompt size, whichever the run swept (the load
column alone when it swept neither). Distributions are drawn as the p50 line with a shaded
p10-p90 band; the total is one number per level, a line. The x axes are categorical: the swept
values evenly spaced, labelled with their values; the y axes run from zero to a round number,
ticked every 1, 2, 2.5 or 5 times a power of ten. `xy_svg` draws the page's numeric x-y charts
(CDFs, scatters) on the same ticks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from html import escape

from proxy.bench.stats import LevelStats

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")
PANEL_W, PANEL_H = 420, 240
MARGIN_L, MARGIN_R, MARGIN_T, MARGIN_B = 70, 20, 34, 46

Band = tuple[float, float, float]  # low, mid, high
Getter = Callable[[LevelStats], Band]

METRICS: tuple[tuple[str, Getter], ...] = (
    ("TTFT (ms), p50 and p10-p90", lambda s: (s.ttft.p10 * 1e3, s.ttft.p50 * 1e3,
                                              s.ttft.p90 * 1e3)),
    ("tokens/s per stream (1/TPOT), p50 and p10-p90",
     lambda s: (s.stream_tokens_per_s.p10, s.stream_tokens_per_s.p50,
                s.stream_tokens_per_s.p90)),
    ("output tokens/s, all streams",
     lambda s: (s.output_tokens_per_s, s.output_tokens_per_s, s.output_tokens_per_s)),
)


class PlotFormatError(ValueError):
    pass


def nice_step(span: float, target: int = 4) -> float:
    """The 1, 2, 2.5 or 5 x 10^k step that cuts `span` into about `target` parts."""
    raw = span / target
    if not math.isfinite(raw) or raw <= 0:
        return 1.0
    exp = 10.0 ** math.floor(math.log10(raw))
    return next(m * exp for m in (1, 2, 2.5, 5, 10) if m * exp >= raw * (1 - 1e-9))


def nice_ticks(lo: float, hi: float, target: int = 4) -> list[float]:
    """Round ticks covering lo..hi: multiples of one nice step, the axis their first..last."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        lo, hi = 0.0, 1.0
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    step = nice_step(hi - lo, target)
    first = math.floor(lo / step + 1e-9)
    last = math.ceil(hi / step - 1e-9)
    return [round(k * step, 12) + 0.0 for k in range(first, last + 1)]


def tick_label(v: float, ticks: Sequence[float]) -> str:
    """`v` with as many decimals as the ticks' step needs (0.25 -> 2, 2.5 -> 1, 50 -> 0)."""
    step = ticks[1] - ticks[0] if len(ticks) > 1 else 1.0
    exp = math.floor(math.log10(step) + 1e-9)
    mantissa = round(step / 10.0 ** exp, 6)
    decimals = max(0, -exp + (1 if mantissa == 2.5 else 0))
    return f"{v + 0.0:,.{decimals}f}"


def legend_html(series: Sequence[tuple[str, str]]) -> str:
    """A chart's legend as HTML: each series' colour and name (`data-series` names it for
    whoever checks the legend against the chart)."""
    items = "".join(f'<span data-series="{escape(name)}" style="--c:{color}"><i></i>'
                    f"{escape(name)}</span>" for name, color in series)
    return f'<div class="legend">{items}</div>'


def _panel(
    origin: tuple[float, float], title: str, xlabel: str, xs: Sequence[float],
    series: list[tuple[str, str, list[Band | None]]],
) -> list[str]:
    """One chart, its top left corner at `origin`."""
    x0, y0 = origin
    w, h = PANEL_W - MARGIN_L - MARGIN_R, PANEL_H - MARGIN_T - MARGIN_B
    left, top = x0 + MARGIN_L, y0 + MARGIN_T
    values = [v for _, _, pts in series for p in pts if p for v in p if math.isfinite(v)]
    ticks = nice_ticks(0.0, max(values, default=1.0))
    ymax = ticks[-1]
    n = len(xs)

    def px(i: int) -> float:
        return left + (w * (i + 0.5) / n)

    def py(v: float) -> float:
        return top + h - h * min(max(v, 0.0), ymax) / ymax

    out = [f'<text x="{x0 + PANEL_W / 2}" y="{y0 + 20}" text-anchor="middle" '
           f'font-weight="bold">{escape(title)}</text>',
           f'<rect x="{left}" y="{top}" width="{w}" height="{h}" fill="none" stroke="#999"/>']
    for v in ticks:
        y = py(v)
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + w}" y2="{y:.1f}" stroke="#eee"/>')
        out.append(f'<text class="tick y" x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">'
                   f"{tick_label(v, ticks)}</text>")
    for i, x in enumerate(xs):
        out.append(f'<text x="{px(i):.1f}" y="{top + h + 16}" text-anchor="middle">{x:g}</text>')
    out.append(f'<text x="{left + w / 2}" y="{top + h + 36}" text-anchor="middle">'
               f'{escape(xlabel)}</text>')
    for name, color, pts in series:
        tag = f'data-series="{escape(name)}"'
        idx = [i for i, p in enumerate(pts) if p and all(map(math.isfinite, p))]
        if not idx:
            continue
        band = [pts[i] for i in idx]
        if any(b[0] != b[2] for b in band if b):
            upper = [f"{px(i):.1f},{py(b[2]):.1f}" for i, b in zip(idx, band, strict=True) if b]
            lower = [f"{px(i):.1f},{py(b[0]):.1f}" for i, b in zip(idx, band, strict=True) if b]
            if len(idx) == 1:  # one point: a vertical bar for its band
                out.append(f'<line x1="{px(idx[0]):.1f}" y1="{py(band[0][0]):.1f}" '  # type: ignore[index]
                           f'x2="{px(idx[0]):.1f}" y2="{py(band[0][2]):.1f}" '  # type: ignore[index]
                           f'stroke="{color}" stroke-width="8" stroke-opacity="0.25" {tag}/>')
            else:
                poly = " ".join(upper + lower[::-1])
                out.append(f'<polygon points="{poly}" fill="{color}" fill-opacity="0.18" {tag}/>')
        mids = " ".join(f"{px(i):.1f},{py(b[1]):.1f}" for i, b in zip(idx, band, strict=True) if b)
        out.append(f'<polyline points="{mids}" fill="none" stroke="{color}" stroke-width="2" '
                   f"{tag}/>")
        for i, b in zip(idx, band, strict=True):
            if b:
                out.append(f'<circle cx="{px(i):.1f}" cy="{py(b[1]):.1f}" r="3" '
                           f'fill="{color}" {tag}/>')
    return out


Series = tuple[str, str, list[Band | None]]  # name, colour, one band per x (None: no data)


def sweep_columns(levels: Sequence[LevelStats]) -> list[tuple[str, str]]:
    """The x axes to draw: ("load", label) and/or ("prompt", label), as the run swept."""
    loads = {s.load for s in levels}
    sizes = {s.prompt_tokens for s in levels}
    load_label = "requests/s (open loop)" if levels[0].mode == "rate" else "concurrency"
    columns: list[tuple[str, str]] = []
    if len(loads) > 1 or len(sizes) == 1:
        columns.append(("load", load_label))
    if len(sizes) > 1:
        columns.append(("prompt", "prompt tokens"))
    return columns


def _series(levels: Sequence[LevelStats], get: Getter, kind: str
            ) -> tuple[list[float], list[Series]]:
    """The x values of one axis and a series per endpoint (and value of the other axis)."""
    endpoints = list(dict.fromkeys(s.endpoint for s in levels))
    loads: list[float] = sorted({s.load for s in levels})
    sizes: list[float] = sorted({float(s.prompt_tokens) for s in levels})
    index: dict[tuple[str, float, float], LevelStats] = {
        (s.endpoint, s.load, s.prompt_tokens): s for s in levels}
    xs, others = (loads, sizes) if kind == "load" else (sizes, loads)
    series: list[Series] = []
    for ep in endpoints:
        for other in others:
            name = ep if len(others) == 1 else (
                f"{ep}, prompt {other:g}" if kind == "load" else f"{ep}, load {other:g}")
            pts: list[Band | None] = []
            for x in xs:
                st = index.get((ep, x, other) if kind == "load" else (ep, other, x))
                pts.append(get(st) if st is not None and st.ok else None)
            series.append((name, COLORS[len(series) % len(COLORS)], pts))
    return xs, series


def chart_svg(levels: Sequence[LevelStats], metric: tuple[str, Getter], kind: str,
              xlabel: str) -> tuple[str, list[tuple[str, str]]]:
    """One chart as a standalone, scalable <svg> (the HTML page's grid cells), and its
    series' names and colours for the legend."""
    xs, series = _series(levels, metric[1], kind)
    body = _panel((0, 0), metric[0], xlabel, xs, series)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {PANEL_W} {PANEL_H}" '
            f'font-family="sans-serif" font-size="11">{"".join(body)}</svg>',
            [(name, color) for name, color, _ in series])


class Style(Enum):
    """How an x-y series is drawn."""

    STEP = "step"  # a staircase through the points (an empirical CDF)
    DOTS = "dots"  # a dot per point (a scatter)
    DASHED = "dashed"  # a dashed line through the points (a reference such as y = x)


@dataclass(frozen=True, slots=True)
class XYSeries:
    name: str
    color: str
    points: Sequence[tuple[float, float]]
    style: Style


@dataclass(frozen=True, slots=True)
class Axes:
    title: str
    xlabel: str
    ylabel: str
    square: bool = False  # one scale for x and y (a scatter of A against B)


def _xy_mark(s: XYSeries, px: Callable[[float], float], py: Callable[[float], float]) -> str:
    tag = f'data-series="{escape(s.name)}"'
    pts = [(x, y) for x, y in s.points if math.isfinite(x) and math.isfinite(y)]
    if not pts:
        return ""
    if s.style is Style.DOTS:
        dots = "".join(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5"/>' for x, y in pts)
        return f'<g fill="{s.color}" fill-opacity="0.6" {tag}>{dots}</g>'
    if s.style is Style.STEP:
        d = f"M{px(pts[0][0]):.1f},{py(0):.1f}"
        for x, y in pts:
            d += f"H{px(x):.1f}V{py(y):.1f}"
        return f'<path d="{d}" fill="none" stroke="{s.color}" stroke-width="2" {tag}/>'
    line = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
    return (f'<polyline points="{line}" fill="none" stroke="{s.color}" stroke-width="1.5" '
            f'stroke-dasharray="5,4" {tag}/>')


def xy_svg(axes: Axes, series: Sequence[XYSeries]) -> str:
    """A chart of numeric x against numeric y, both from zero, with round ticks."""
    w, h = PANEL_W - MARGIN_L - MARGIN_R, PANEL_H - MARGIN_T - MARGIN_B
    left, top = MARGIN_L, MARGIN_T
    xs = [x for s in series for x, _ in s.points if math.isfinite(x)]
    ys = [y for s in series for _, y in s.points if math.isfinite(y)]
    xmax, ymax = max(xs, default=1.0), max(ys, default=1.0)
    if axes.square:
        xmax = ymax = max(xmax, ymax)
    xt, yt = nice_ticks(min([0.0, *xs]), xmax), nice_ticks(min([0.0, *ys]), ymax)

    def px(x: float) -> float:
        return left + w * (x - xt[0]) / (xt[-1] - xt[0])

    def py(y: float) -> float:
        return top + h - h * (y - yt[0]) / (yt[-1] - yt[0])

    out = [f'<text x="{PANEL_W / 2}" y="20" text-anchor="middle" font-weight="bold">'
           f"{escape(axes.title)}</text>",
           f'<rect x="{left}" y="{top}" width="{w}" height="{h}" fill="none" stroke="#999"/>']
    for v in yt:
        out.append(f'<line x1="{left}" y1="{py(v):.1f}" x2="{left + w}" y2="{py(v):.1f}" '
                   f'stroke="#eee"/><text class="tick y" x="{left - 6}" y="{py(v) + 4:.1f}" '
                   f'text-anchor="end">{tick_label(v, yt)}</text>')
    for v in xt:
        out.append(f'<line x1="{px(v):.1f}" y1="{top}" x2="{px(v):.1f}" y2="{top + h}" '
                   f'stroke="#f2f2f2"/><text class="tick x" x="{px(v):.1f}" y="{top + h + 16}" '
                   f'text-anchor="middle">{tick_label(v, xt)}</text>')
    out.append(f'<text x="{left + w / 2}" y="{top + h + 36}" text-anchor="middle">'
               f"{escape(axes.xlabel)}</text>")
    out.append(f'<text transform="translate(14,{top + h / 2}) rotate(-90)" '
               f'text-anchor="middle">{escape(axes.ylabel)}</text>')
    out += [_xy_mark(s, px, py) for s in series]
    return (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {PANEL_W} {PANEL_H}" '
            f'font-family="sans-serif" font-size="11">{"".join(out)}</svg>')


def render_svg(levels: Sequence[LevelStats], title: str = "tokenmeter bench") -> str:
    if not levels:
        raise ValueError("nothing to plot: no levels")
    columns = sweep_columns(levels)
    legends: list[list[tuple[str, str]]] = [[] for _ in columns]
    body: list[str] = []
    for row, (mtitle, get) in enumerate(METRICS):
        for col, (kind, xlabel) in enumerate(columns):
            xs, series = _series(levels, get, kind)
            if row == 0:
                legends[col] = [(name, color) for name, color, _ in series]
            body += _panel((col * PANEL_W, 40 + row * PANEL_H), mtitle, xlabel, xs, series)
    width = PANEL_W * len(columns)
    height = 40 + PANEL_H * len(METRICS) + 20 * (max(map(len, legends)) + 1)
    ly = 40 + PANEL_H * len(METRICS) + 10
    for col, legend in enumerate(legends):
        lx = col * PANEL_W + MARGIN_L
        for i, (name, color) in enumerate(legend):
            y = ly + 20 * i
            body.append(f'<rect x="{lx}" y="{y}" width="14" height="10" fill="{color}"/>')
            body.append(f'<text x="{lx + 20}" y="{y + 10}">{escape(name)}</text>')
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">'
            f'<rect width="100%" height="100%" fill="white"/>'
            f'<text x="{width / 2}" y="22" text-anchor="middle" font-size="15" '
            f'font-weight="bold">{escape(title)}</text>')
    return head + "".join(body) + "</svg>\n"
