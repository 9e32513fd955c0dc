"""The HTML report of `tokenmeter bench --plot FILE.html`: one self-contained page.

Inline CSS and SVG only: no script, no web font, nothing fetched, so the file can be mailed or
attached to a ticket and opens the same offline. Top to bottom:

- headline cards, one per endpoint: requests, errors, peak output tokens/s and, at that load,
  TTFT, ITL and E2E p50/p99 (and goodput when an SLO was given);
- with two endpoints (`--compare`), the added latency: what the base endpoint (`--base-url`,
  the gateway in the README's run) adds over the `--compare` one (direct), per load level. The
  sign is the terminal table's and `Comparison.deltas`' (base - compare), so the page and the
  table never disagree. A bar for the medians' difference with a whisker from the p10s'
  difference to the p90s' (the quantiles LevelStats keeps), then the same figures as a table;
- a full-width grid of charts against the load (and the prompt size when that was swept);
- the answers side by side (`answers`, see `render_answers`), only when given;
- the terminal report, folded.

Every piece of user text (model name, endpoint labels, prompts, answers) goes through
`html.escape`; numbers are formatted here.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from html import escape
from pathlib import Path

from proxy.bench.plot import (
    COLORS,
    METRICS,
    Getter,
    PlotFormatError,
    chart_svg,
    nice_max,
    render_svg,
    sweep_columns,
)
from proxy.bench.stats import Dist, LevelStats

CSS = """
*{box-sizing:border-box}
body{margin:0;padding:16px 24px;font:14px/1.4 system-ui,sans-serif;color:#222;background:#f6f7f9}
h1{font-size:22px;margin:0 0 12px} h2{font-size:17px;margin:24px 0 8px}
.cards,.grid{display:grid;gap:12px;width:100%}
.cards{grid-template-columns:repeat(auto-fit,minmax(300px,1fr))}
.grid{grid-template-columns:repeat(auto-fit,minmax(420px,1fr))}
.card,.chart{background:#fff;border:1px solid #dde;border-radius:6px;padding:10px 14px}
.card h3{margin:0 0 6px;font-size:15px;border-left:6px solid var(--c);padding-left:8px}
.card dl{display:grid;grid-template-columns:auto 1fr;gap:2px 12px;margin:0}
.card dt{color:#666} .card dd{margin:0;font-weight:600;font-variant-numeric:tabular-nums}
.chart svg{width:100%;height:auto;display:block}
table{border-collapse:collapse;background:#fff;font-variant-numeric:tabular-nums}
td,th{border:1px solid #dde;padding:3px 8px;text-align:right;vertical-align:top}
td.text{text-align:left;white-space:pre-wrap;max-width:40vw}
ins{background:#cfc;text-decoration:none} del{background:#fcc}
.legend span{display:inline-block;margin-right:16px}
.legend i{display:inline-block;width:14px;height:10px;margin-right:4px;background:var(--c)}
.note{color:#666;font-size:12px} .warn{color:#a00;font-weight:600}
pre{background:#fff;padding:8px;overflow-x:auto}
"""

# The page has the room for all three latencies (the .svg keeps its three rows).
PAGE_METRICS: tuple[tuple[str, Getter], ...] = (
    METRICS[0],
    ("ITL (ms), p50 and p10-p90", lambda s: (s.itl.p10 * 1e3, s.itl.p50 * 1e3, s.itl.p90 * 1e3)),
    ("E2E (ms), p50 and p10-p90", lambda s: (s.e2e.p10 * 1e3, s.e2e.p50 * 1e3, s.e2e.p90 * 1e3)),
    *METRICS[1:],
)

DELTA_METRICS: tuple[tuple[str, str], ...] = (
    ("ttft", "TTFT"), ("itl", "ITL"), ("e2e", "E2E"))


@dataclass(frozen=True, slots=True)
class Delta:
    """Base - compare of one latency at one (load, prompt size), milliseconds: the medians'
    difference and the p10s' and p90s' differences ordered into a low..high spread."""

    load: float
    prompt_tokens: int
    median: float
    low: float
    high: float


def _ms(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "-"
    ms = seconds * 1e3
    return f"{ms:.3f}" if abs(ms) < 1 else f"{ms:.2f}" if abs(ms) < 100 else f"{ms:,.0f}"


def _num(x: float | None, digits: int = 1) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:,.{digits}f}"


def _load_name(st: LevelStats) -> str:
    return f"{st.load:g} req/s" if st.mode == "rate" else f"concurrency {st.load:g}"


def endpoints_of(levels: Sequence[LevelStats]) -> list[str]:
    return list(dict.fromkeys(s.endpoint for s in levels))


def _card(endpoint: str, color: str, levels: Sequence[LevelStats]) -> str:
    """One endpoint's headline: totals, and the latencies at its peak-throughput level."""
    mine = [s for s in levels if s.endpoint == endpoint]
    peak = max(mine, key=lambda s: s.output_tokens_per_s
               if math.isfinite(s.output_tokens_per_s) else -1.0)
    where = _load_name(peak) + (f", prompt {peak.prompt_tokens}" if peak.prompt_tokens else "")
    rows = [
        ("requests", f"{sum(s.requests for s in mine):,}"),
        ("errors", f"{sum(s.errors for s in mine):,}"),
        ("throughput", f"{_num(peak.output_tokens_per_s, 0)} tok/s"),
        ("TTFT p50 / p99", f"{_ms(peak.ttft.p50)} / {_ms(peak.ttft.p99)} ms"),
        ("ITL p50 / p99", f"{_ms(peak.itl.p50)} / {_ms(peak.itl.p99)} ms"),
        ("E2E p50 / p99", f"{_ms(peak.e2e.p50)} / {_ms(peak.e2e.p99)} ms"),
    ]
    if peak.slo and peak.goodput is not None:
        frac = peak.goodput_fraction
        rows.append(("goodput", f"{_num(peak.goodput, 2)} req/s"
                     + ("" if frac is None or math.isnan(frac) else f" ({frac:.0%})")))
    dl = "".join(f"<dt>{escape(k)}</dt><dd>{escape(v)}</dd>" for k, v in rows)
    return (f'<div class="card" style="--c:{color}"><h3>{escape(endpoint)}</h3>'
            f'<dl>{dl}</dl><p class="note">peak throughput at {escape(where)}; the '
            f"latencies at that level</p></div>")


def render_headline(levels: Sequence[LevelStats]) -> str:
    """The cards, then the run's warnings (event-loop lag: TTFT and ITL unreliable)."""
    cards = "".join(_card(ep, COLORS[i % len(COLORS)], levels)
                    for i, ep in enumerate(endpoints_of(levels)))
    warnings = sorted({w for s in levels for w in s.warnings})
    items = "".join(f"<li>{escape(w)}</li>" for w in warnings)
    return (f'<section id="headline"><div class="cards">{cards}</div>'
            + (f'<ul class="warn">{items}</ul>' if items else "") + "</section>")


def deltas(levels: Sequence[LevelStats], metric: str) -> list[Delta]:
    """Base - compare of `metric` ("ttft", "itl", "e2e") at each (load, prompt) both ran."""
    eps = endpoints_of(levels)
    if len(eps) != 2:
        return []
    index = {(s.endpoint, s.load, s.prompt_tokens): s for s in levels}
    out = []
    for a in (s for s in levels if s.endpoint == eps[0]):
        b = index.get((eps[1], a.load, a.prompt_tokens))
        if b is None:
            continue
        da: Dist = getattr(a, metric)
        db: Dist = getattr(b, metric)
        lo, hi = (da.p10 - db.p10) * 1e3, (da.p90 - db.p90) * 1e3
        out.append(Delta(a.load, a.prompt_tokens, (da.p50 - db.p50) * 1e3,
                         min(lo, hi), max(lo, hi)))
    return out


def _delta_svg(title: str, rows: Sequence[Delta], color: str) -> str:
    """Bars of the median difference from a zero line, whiskers low..high; x: the levels."""
    w, h, left, top, bottom = 420, 250, 70, 44, 46
    pw, ph = w - left - 20, h - top - bottom
    finite = [v for d in rows for v in (d.median, d.low, d.high) if math.isfinite(v)]
    hi, lo = max([0.0, *finite]), min([0.0, *finite])
    vmax = nice_max(hi) if hi > 0 else 0.0
    vmin = -nice_max(-lo) if lo < 0 else 0.0
    if vmax == vmin:  # all zero (or nothing measured): any scale will do
        vmax = 1.0

    def py(v: float) -> float:
        return top + ph * (vmax - v) / (vmax - vmin)

    out = [f'<text x="{w / 2}" y="20" text-anchor="middle" font-weight="bold">'
           f"{escape(title)}</text>",
           f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>']
    for k in range(5):
        v = vmin + (vmax - vmin) * k / 4
        out.append(f'<line x1="{left}" y1="{py(v):.1f}" x2="{left + pw}" y2="{py(v):.1f}" '
                   f'stroke="#eee"/><text x="{left - 6}" y="{py(v) + 4:.1f}" '
                   f'text-anchor="end">{v:+.3g}</text>')
    out.append(f'<line x1="{left}" y1="{py(0):.1f}" x2="{left + pw}" y2="{py(0):.1f}" '
               f'stroke="#333"/>')
    sizes = {d.prompt_tokens for d in rows}
    step = pw / max(len(rows), 1)
    for i, d in enumerate(rows):
        cx = left + step * (i + 0.5)
        label = f"{d.load:g}" + (f" / {d.prompt_tokens}" if len(sizes) > 1 else "")
        out.append(f'<text x="{cx:.1f}" y="{top + ph + 16}" text-anchor="middle">'
                   f"{escape(label)}</text>")
        if not math.isfinite(d.median):
            continue
        y0, y1 = sorted((py(0), py(d.median)))
        bw = min(step * 0.5, 60)
        out.append(f'<rect x="{cx - bw / 2:.1f}" y="{y0:.1f}" width="{bw:.1f}" '
                   f'height="{max(y1 - y0, 1):.1f}" fill="{color}" fill-opacity="0.75">'
                   f"<title>{d.median:+.3f} ms</title></rect>")
        if math.isfinite(d.low) and math.isfinite(d.high):
            out.append(f'<path d="M{cx:.1f},{py(d.low):.1f}V{py(d.high):.1f}'
                       f'M{cx - 8:.1f},{py(d.low):.1f}h16M{cx - 8:.1f},{py(d.high):.1f}h16" '
                       f'stroke="#222" stroke-width="1.5" fill="none"/>')
        # The value at the bar's far end from zero: above a rise, below a drop.
        ty = y0 - 4 if d.median >= 0 else y1 + 13
        out.append(f'<text x="{cx + bw / 2 + 3:.1f}" y="{ty:.1f}" font-weight="bold">'
                   f"{d.median:+.3g}</text>")
    out.append(f'<text x="{left + pw / 2}" y="{h - 8}" text-anchor="middle">load'
               + (" / prompt tokens" if len(sizes) > 1 else "") + "</text>")
    return (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {h}" '
            f'font-family="sans-serif" font-size="11">{"".join(out)}</svg>')


def _delta_table(levels: Sequence[LevelStats], a: str, b: str) -> str:
    head = "".join(f"<th>{escape(n)} {escape(a)} p50</th><th>{escape(n)} {escape(b)} p50</th>"
                   f"<th>{escape(n)} +ms p50</th><th>{escape(n)} +ms p10..p90</th>"
                   for _, n in DELTA_METRICS)
    index = {(s.endpoint, s.load, s.prompt_tokens): s for s in levels}
    per_metric = [deltas(levels, m) for m, _ in DELTA_METRICS]
    body = []
    for i, d0 in enumerate(per_metric[0]):
        sa, sb = index[(a, d0.load, d0.prompt_tokens)], index[(b, d0.load, d0.prompt_tokens)]
        cells = [f"<td>{d0.load:g}</td><td>{d0.prompt_tokens or 'file'}</td>"]
        for (m, _), ds in zip(DELTA_METRICS, per_metric, strict=True):
            d = ds[i]
            cells.append(f"<td>{_ms(getattr(sa, m).p50)}</td><td>{_ms(getattr(sb, m).p50)}</td>"
                         f"<td>{d.median:+.3f}</td><td>{d.low:+.3f} .. {d.high:+.3f}</td>")
        body.append(f"<tr>{''.join(cells)}</tr>")
    return (f'<table id="delta-table"><tr><th>load</th><th>prompt</th>{head}</tr>'
            f"{''.join(body)}</table>")


def render_deltas(levels: Sequence[LevelStats]) -> str:
    """The added-latency section; empty unless exactly two endpoints ran."""
    eps = endpoints_of(levels)
    if len(eps) != 2:
        return ""
    base, other = eps
    charts = "".join(
        f'<div class="chart">{_delta_svg(f"{name}: {base} - {other}, ms", deltas(levels, m), c)}'
        "</div>"
        for (m, name), c in zip(DELTA_METRICS, COLORS[2:], strict=False))
    return (f'<section id="deltas"><h2>Added latency: {escape(base)} over {escape(other)}</h2>'
            f'<p class="note">{escape(base)} (--base-url) minus {escape(other)} (--compare), '
            "as in the terminal table. Bar: difference of the medians per load level; whisker: "
            "from the difference of the p10s to that of the p90s. Below zero: "
            f"{escape(base)} is faster.</p>"
            f'<div class="grid">{charts}</div><h2>Added latency, figures</h2>'
            f"{_delta_table(levels, base, other)}</section>")


def render_charts(levels: Sequence[LevelStats]) -> str:
    """One chart per metric and swept quantity, in a grid as wide as the window."""
    eps = endpoints_of(levels)
    legend = "".join(f'<span style="--c:{COLORS[i % len(COLORS)]}"><i></i>{escape(ep)}</span>'
                     for i, ep in enumerate(eps))
    cells = []
    for mtitle, get in PAGE_METRICS:
        for kind, xlabel in sweep_columns(levels):
            cells.append(f'<div class="chart">{chart_svg(levels, (mtitle, get), kind, xlabel)}'
                         "</div>")
    return (f'<section id="charts"><h2>Per load level</h2><div class="legend">{legend}</div>'
            f'<div class="grid">{"".join(cells)}</div></section>')


def _word_diff(a: str, b: str) -> tuple[str, str]:
    """`a` and `b` escaped, the words only in `a` in <del>, those only in `b` in <ins>."""
    wa, wb = a.split(), b.split()
    out_a: list[str] = []
    out_b: list[str] = []
    matcher = difflib.SequenceMatcher(a=wa, b=wb, autojunk=False)
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        ta, tb = escape(" ".join(wa[i1:i2])), escape(" ".join(wb[j1:j2]))
        if op == "equal":
            out_a.append(ta)
            out_b.append(tb)
            continue
        if ta:
            out_a.append(f"<del>{ta}</del>")
        if tb:
            out_b.append(f"<ins>{tb}</ins>")
    return " ".join(out_a), " ".join(out_b)


def render_answers(answers: Sequence[Mapping[str, str]] | None, a: str, b: str) -> str:
    """Hook for a sample of the two endpoints' answers to the same requests, side by side.

    `answers`: a list of {"request": ..., "a": ..., "b": ...} texts (A is the first endpoint,
    B the `--compare` one). Nothing in the bench collects them yet; whatever does passes them
    to `write_plot(..., answers=...)`. Rendered only when non-empty; every text escaped, the
    words that differ marked (difflib, word by word).
    """
    if not answers:
        return ""
    rows = []
    for item in answers:
        da, db = _word_diff(str(item.get("a", "")), str(item.get("b", "")))
        rows.append(f'<tr><td class="text">{escape(str(item.get("request", "")))}</td>'
                    f'<td class="text">{da}</td><td class="text">{db}</td></tr>')
    return (f'<section id="answers"><h2>Answers side by side</h2><table><tr><th>request</th>'
            f"<th>{escape(a)} (A)</th><th>{escape(b)} (B)</th></tr>{''.join(rows)}</table>"
            "</section>")


def render_page(
    levels: Sequence[LevelStats], title: str, table: str,
    answers: Sequence[Mapping[str, str]] | None = None,
) -> str:
    """The whole page; `table` is the terminal report, shown folded at the end."""
    if not levels:
        raise ValueError("nothing to plot: no levels")
    eps = endpoints_of(levels)
    a, b = [*eps, ""][:2]
    parts = [
        f"<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f'<meta name="viewport" content="width=device-width,initial-scale=1">'
        f"<title>{escape(title)}</title><style>{CSS}</style></head>\n<body>",
        f"<h1>{escape(title)}</h1>",
        render_headline(levels),
        render_deltas(levels),
        render_charts(levels),
        render_answers(answers, a, b),
        f"<details><summary>terminal report</summary><pre>{escape(table)}</pre></details>",
        "</body></html>\n",
    ]
    return "\n".join(p for p in parts if p)


def write_plot(
    path: str | Path, levels: Sequence[LevelStats], title: str, table: str,
    answers: Sequence[Mapping[str, str]] | None = None,
) -> None:
    """`--plot FILE`: the SVG charts for .svg, the page above for .html/.htm."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in (".svg", ".html", ".htm"):
        raise PlotFormatError(f"--plot {p}: only .svg or .html are supported (no PNG: that "
                              "would need a plotting library); open the .svg or .html in a "
                              "browser, or convert the .svg")
    text = (render_svg(levels, title) if suffix == ".svg"
            else render_page(levels, title, table, answers))
    p.write_text(text, encoding="utf-8")
