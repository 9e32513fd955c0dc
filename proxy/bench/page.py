"""The HTML report of `tokenmeter bench --plot FILE.html`: one self-contained page.

Inline CSS and SVG only: no script, no web font, nothing fetched, so the file can be mailed or
attached to a ticket and opens the same offline. Top to bottom:

- how the run was made (`RunInfo`): the command (secrets redacted by the caller), the date, the
  tokenmeter version and the settings;
- headline cards, one per endpoint: requests, errors, peak output tokens/s and, at that load,
  TTFT, ITL (per token, AIPerf's, and the chunk gaps) and E2E p50/p99 (and goodput when an SLO
  was given); for a replay, each endpoint's cost, and a card for the answers' verdict
  (exact-match rate, length ratio B/A);
- with two endpoints (`--compare`), the latency difference base - compare per load level
  ("added latency" in a load test: what the gateway at `--base-url` adds over direct; "A - B"
  in a replay, which compares two targets). The sign is the terminal table's and
  `Comparison.deltas`', so the page and the table never disagree. A bar for the medians'
  difference with a whisker from the p10s' difference to the p90s' (the quantiles LevelStats
  keeps), then the same figures as a table;
- a replay to two targets: each recorded request's E2E and TTFT at A against B, paired by the
  request's line in the file;
- the CDFs of TTFT and E2E over the measured requests;
- an open-loop run (`--rate`): each request's TTFT and E2E against when it was sent, per level;
- a full-width grid of charts against the load (and the prompt size when that was swept);
- the answers side by side (`answers`, see `render_answers`), only when given;
- the terminal report, folded.

Every chart has its legend (each series' colour and name) and round ticks (`plot.nice_ticks`).
Every piece of user text (model name, endpoint labels, prompts, answers) goes through
`html.escape`; numbers are formatted here.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any

from proxy.bench.plot import (
    COLORS,
    METRICS,
    Axes,
    Getter,
    PlotFormatError,
    Style,
    XYSeries,
    chart_svg,
    legend_html,
    nice_ticks,
    render_svg,
    sweep_columns,
    tick_label,
    xy_svg,
)
from proxy.bench.replay import ReplayReport
from proxy.bench.stats import Dist, LevelStats, RequestResult

PAGE_OUTCOMES = 50  # replayed requests whose outcome differs, listed on the page

CSS = """
*{box-sizing:border-box}
body{margin:0;padding:16px 24px;font:14px/1.4 system-ui,sans-serif;color:#222;background:#f6f7f9}
h1{font-size:22px;margin:0 0 12px} h2{font-size:17px;margin:24px 0 8px}
.cards,.grid{display:grid;gap:12px;width:100%}
.cards{grid-template-columns:repeat(auto-fit,minmax(300px,1fr))}
.grid{grid-template-columns:repeat(auto-fill,minmax(420px,1fr))}
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
.legend{font-size:12px;margin:4px 0 0}
#settings{margin-bottom:12px}
#settings dl{display:grid;grid-template-columns:repeat(3,max-content minmax(0,1fr));gap:1px 12px;
margin:0;
font-size:12px} #settings dt{color:#666} #settings dd{margin:0;word-break:break-all}
#settings dt.wide{grid-column:1} #settings dd.wide{grid-column:span 5}
#settings code{font-size:12px;white-space:pre-wrap;word-break:break-all}
.note{color:#666;font-size:12px} .warn{color:#a00;font-weight:600}
pre{background:#fff;padding:8px;overflow-x:auto}
"""

@dataclass(frozen=True)
class RunInfo:
    """What the page says about the run besides its levels: its settings (build_config's
    printable summary, no secrets), command line (secrets redacted), date and version, every
    measured request (the distributions, the latency over time, the A-vs-B scatter), the
    replay's verdicts, and a sample of answers side by side."""

    settings: Mapping[str, Any] = field(default_factory=dict)
    command: str = ""
    date: str = ""
    version: str = ""
    results: Sequence[RequestResult] = ()
    replay: ReplayReport | None = None
    answers: Sequence[Mapping[str, str]] | None = None


# The page has the room for all three latencies (the .svg keeps its three rows).
PAGE_METRICS: tuple[tuple[str, Getter], ...] = (
    METRICS[0],
    ("ITL, chunk gaps (ms), p50 and p10-p90",
     lambda s: (s.itl.p10 * 1e3, s.itl.p50 * 1e3, s.itl.p90 * 1e3)),
    ("TPOT = ITL per token, AIPerf's (ms), p50 and p10-p90",
     lambda s: (s.tpot.p10 * 1e3, s.tpot.p50 * 1e3, s.tpot.p90 * 1e3)),
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


def _signed(ms: float) -> str:
    """A difference in ms, to the digits that matter at its size."""
    digits = 2 if abs(ms) < 10 else 1 if abs(ms) < 100 else 0
    return f"{ms:+,.{digits}f}"


def _num(x: float | None, digits: int = 1) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:,.{digits}f}"


def _load_name(st: LevelStats) -> str:
    return f"{st.load:g} req/s" if st.mode == "rate" else f"concurrency {st.load:g}"


def endpoints_of(levels: Sequence[LevelStats]) -> list[str]:
    return list(dict.fromkeys(s.endpoint for s in levels))


def _usd(x: float | None, digits: int = 6) -> str:
    return "-" if x is None or not math.isfinite(x) else f"${x:,.{digits}f}"


def _card(endpoint: str, color: str, levels: Sequence[LevelStats],
          replay: ReplayReport | None) -> str:
    """One endpoint's headline: totals, and the latencies at its peak-throughput level; for a
    replay, its cost."""
    mine = [s for s in levels if s.endpoint == endpoint]
    peak = max(mine, key=lambda s: s.output_tokens_per_s
               if math.isfinite(s.output_tokens_per_s) else -1.0)
    where = _load_name(peak) + (f", prompt {peak.prompt_tokens}" if peak.prompt_tokens else "")
    rows = [
        ("requests", f"{sum(s.requests for s in mine):,}"),
        ("errors", f"{sum(s.errors for s in mine):,}"),
        ("throughput", f"{_num(peak.output_tokens_per_s, 0)} tok/s"),
        ("TTFT p50 / p99", f"{_ms(peak.ttft.p50)} / {_ms(peak.ttft.p99)} ms"),
        ("ITL per token p50 / p99", f"{_ms(peak.tpot.p50)} / {_ms(peak.tpot.p99)} ms"),
        ("ITL chunk gaps p50 / p99", f"{_ms(peak.itl.p50)} / {_ms(peak.itl.p99)} ms"),
        ("E2E p50 / p99", f"{_ms(peak.e2e.p50)} / {_ms(peak.e2e.p99)} ms"),
    ]
    if peak.slo and peak.goodput is not None:
        frac = peak.goodput_fraction
        rows.append(("goodput", f"{_num(peak.goodput, 2)} req/s"
                     + ("" if frac is None or math.isnan(frac) else f" ({frac:.0%})")))
    for label, same, of in replay.same_outcome() if replay else ():
        if label == endpoint:
            rows.append(("same outcome as recorded", f"{same:,} / {of:,}"))
    for c in replay.costs if replay else ():
        if c.endpoint == endpoint:
            rows.append(("cost", "no price table" if c.cost_usd is None
                         else f"{_usd(c.cost_usd)} ({c.requests} answers)"))
            rows.append(("cost per 1k requests", _usd(c.cost_per_1k_requests_usd, 4)))
            if c.unpriced_models:
                rows.append(("no price for", ", ".join(c.unpriced_models)))
    dl = "".join(f"<dt>{escape(k)}</dt><dd>{escape(v)}</dd>" for k, v in rows)
    return (f'<div class="card" style="--c:{color}"><h3>{escape(endpoint)}</h3>'
            f'<dl>{dl}</dl><p class="note">peak throughput at {escape(where)}; the '
            f"latencies at that level. ITL per token = TPOT, AIPerf's inter-token latency: "
            "(E2E - TTFT) / (output tokens - 1); chunk gaps: between content chunks</p></div>")


def _replay_card(replay: ReplayReport, eps: Sequence[str]) -> str:
    """The replay's verdicts beside the endpoints' cards: the lines sent and skipped, and with
    two endpoints, how their answers compare (how many match exactly, how long B's are)."""
    skipped = sum(s.count for s in replay.skipped)
    rows = [("requests replayed", f"{replay.requests:,} of {replay.lines:,} lines"),
            ("lines skipped", f"{skipped:,}"),
            *((s.text.split(" ", 1)[1], f"{s.count:,}") for s in replay.skipped if s.count)]
    ans = replay.answers
    title = f"replay of {replay.file}"
    note = "skipped: lines bench does not send (their route, --api), or cannot read"
    if ans is not None and len(eps) == 2:
        rate, ratio = ans.exact_match_rate, ans.length_ratio
        rows += [("answer pairs", f"{len(ans.pairs):,}"),
                 ("exact match", "-" if rate is None else f"{rate * 100:.1f}%"),
                 ("length ratio B/A", _num(ratio, 3))]
        title = f"answers: {eps[0]} (A) vs {eps[1]} (B)"
        note += ("; exact match: the answers to the same recorded request are equal; "
                 "length ratio: B's characters over A's, all pairs together")
    dl = "".join(f"<dt>{escape(k)}</dt><dd>{escape(v)}</dd>" for k, v in rows)
    return (f'<div class="card verdict" id="answers-verdict" style="--c:#555">'
            f"<h3>{escape(title)}</h3><dl>{dl}</dl>"
            f'<p class="note">{escape(note)}</p></div>')


def render_outcomes(replay: ReplayReport | None) -> str:
    """The replayed requests whose outcome (status, error class) differs from the recorded
    one at either endpoint, the recorded outcome beside each endpoint's; empty when none."""
    if replay is None:
        return ""
    differ = [o for o in replay.outcomes if o.differs]
    if not differ:
        return ""
    shown = differ[:PAGE_OUTCOMES]
    head = "".join(f"<th>{escape(e)}</th>" for e in replay.endpoints)
    rows = "".join(
        f"<tr><td>{o.line}</td><td>{escape(o.api)}</td><td>{escape(o.recorded.text)}</td>"
        + "".join(f"<td>{'(not sent)' if x is None else escape(x.text)}</td>"
                  for x in o.endpoints) + "</tr>" for o in shown)
    more = f" (the first {len(shown)})" if len(differ) > len(shown) else ""
    return (f'<section id="outcomes"><h2>Outcomes that differ from the recording</h2>'
            f'<p class="note">{len(differ)} of {len(replay.outcomes)} requests{more}: status '
            "and error class as recorded, and each endpoint's first answer</p>"
            f"<table><tr><th>line</th><th>api</th><th>recorded</th>{head}</tr>{rows}</table>"
            "</section>")


def render_headline(levels: Sequence[LevelStats], replay: ReplayReport | None = None) -> str:
    """The cards (and a replay's verdicts), then the run's warnings (event-loop lag: TTFT and
    ITL unreliable)."""
    eps = endpoints_of(levels)
    cards = "".join(_card(ep, COLORS[i % len(COLORS)], levels, replay)
                    for i, ep in enumerate(eps))
    if replay is not None:
        cards += _replay_card(replay, eps)
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


DELTA_SERIES = ("difference of the medians (bar)", "p10s' to p90s' difference (whisker)")


def _delta_svg(title: str, rows: Sequence[Delta], color: str) -> str:
    """Bars of the median difference from a zero line, whiskers low..high; x: the levels."""
    w, h, left, top, bottom = 420, 250, 70, 44, 46
    pw, ph = w - left - 20, h - top - bottom
    finite = [v for d in rows for v in (d.median, d.low, d.high) if math.isfinite(v)]
    ticks = nice_ticks(min([0.0, *finite]), max([0.0, *finite]))
    vmin, vmax = ticks[0], ticks[-1]
    bar_tag, whisker_tag = (f'data-series="{escape(n)}"' for n in DELTA_SERIES)

    def py(v: float) -> float:
        return top + ph * (vmax - v) / (vmax - vmin)

    out = [f'<text x="{w / 2}" y="20" text-anchor="middle" font-weight="bold">'
           f"{escape(title)}</text>",
           f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>']
    for v in ticks:
        out.append(f'<line x1="{left}" y1="{py(v):.1f}" x2="{left + pw}" y2="{py(v):.1f}" '
                   f'stroke="#eee"/><text class="tick y" x="{left - 6}" y="{py(v) + 4:.1f}" '
                   f'text-anchor="end">{tick_label(v, ticks)}</text>')
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
                   f'height="{max(y1 - y0, 1):.1f}" fill="{color}" fill-opacity="0.75" '
                   f"{bar_tag}><title>{d.median:+.3f} ms</title></rect>")
        if math.isfinite(d.low) and math.isfinite(d.high):
            out.append(f'<path d="M{cx:.1f},{py(d.low):.1f}V{py(d.high):.1f}'
                       f'M{cx - 8:.1f},{py(d.low):.1f}h16M{cx - 8:.1f},{py(d.high):.1f}h16" '
                       f'stroke="#222" stroke-width="1.5" fill="none" {whisker_tag}/>')
        # The value beyond the bar's (and its whisker's) far end from zero: above a rise,
        # below a drop, centred on the bar so that the last one is not cut at the edge.
        ends = [v for v in (d.low, d.high) if math.isfinite(v)]
        # Kept inside the plot (over the bar's end when it reaches the edge), clear of the
        # title and the x labels.
        if d.median >= 0:
            ty = max(min(y0, *(py(v) for v in ends)) - 5, top + 11)
        else:
            ty = min(max(y1, *(py(v) for v in ends)) + 13, top + ph - 4)
        out.append(f'<text x="{cx:.1f}" y="{ty:.1f}" text-anchor="middle" '
                   f'font-weight="bold">{_signed(d.median)}</text>')
    out.append(f'<text x="{left + pw / 2}" y="{h - 8}" text-anchor="middle">load'
               + (" / prompt tokens" if len(sizes) > 1 else "") + "</text>")
    return (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {h}" '
            f'font-family="sans-serif" font-size="11">{"".join(out)}</svg>')


def _delta_table(levels: Sequence[LevelStats], a: str, b: str) -> str:
    head = "".join(f"<th>{escape(n)} {escape(a)} p50</th><th>{escape(n)} {escape(b)} p50</th>"
                   f"<th>{escape(n)} A - B ms p50</th><th>{escape(n)} A - B ms p10..p90</th>"
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


def render_deltas(levels: Sequence[LevelStats], replay: bool = False) -> str:
    """The latency difference base - compare; empty unless exactly two endpoints ran. A load
    test reads it as what the base (the gateway) adds; a replay compares two targets, so it
    is worded as a difference, A - B."""
    eps = endpoints_of(levels)
    if len(eps) != 2:
        return ""
    base, other = eps
    charts = "".join(
        f'<div class="chart">{_delta_svg(f"{name}: {base} - {other}, ms", deltas(levels, m), c)}'
        f'{legend_html([(DELTA_SERIES[0], c), (DELTA_SERIES[1], "#222")])}</div>'
        for (m, name), c in zip(DELTA_METRICS, COLORS[2:], strict=False))
    if replay:
        heading = (f"Latency difference: {escape(base)} (A) - {escape(other)} (B), "
                   "same recorded requests")
        figures = "Latency difference, figures"
    else:
        heading = f"Added latency: {escape(base)} over {escape(other)}"
        figures = "Added latency, figures"
    return (f'<section id="deltas"><h2>{heading}</h2>'
            f'<p class="note">{escape(base)} (--base-url, A) minus {escape(other)} (--compare, '
            "B), as in the terminal table. Bar: difference of the medians per load level; "
            "whisker: from the difference of the p10s to that of the p90s. Below zero: "
            f"{escape(base)} is faster.</p>"
            f'<div class="grid">{charts}</div><h2>{figures}</h2>'
            f"{_delta_table(levels, base, other)}</section>")


def render_charts(levels: Sequence[LevelStats]) -> str:
    """One chart per metric and swept quantity, in a grid as wide as the window, each with
    its legend."""
    cells = []
    for mtitle, get in PAGE_METRICS:
        for kind, xlabel in sweep_columns(levels):
            svg, series = chart_svg(levels, (mtitle, get), kind, xlabel)
            cells.append(f'<div class="chart">{svg}{legend_html(series)}</div>')
    return (f'<section id="charts"><h2>Per load level</h2>'
            '<p class="note">line: the median; band: p10 to p90</p>'
            f'<div class="grid">{"".join(cells)}</div></section>')


def _groups(results: Sequence[RequestResult], levels: Sequence[LevelStats]
            ) -> list[tuple[str, list[RequestResult]]]:
    """The successful requests by endpoint and level when that makes few enough series for
    the colours, else by endpoint alone (the levels pooled)."""
    eps = endpoints_of(levels)
    keys = list(dict.fromkeys((s.endpoint, s.load, s.prompt_tokens) for s in levels))
    ok = [r for r in results if r.ok]
    if len(keys) <= len(COLORS) and len(keys) > len(eps):
        sizes = {k[2] for k in keys}
        unit = " req/s" if levels[0].mode == "rate" else " in flight"
        return [(f"{ep}, {load:g}{unit}" + (f", prompt {size}" if len(sizes) > 1 else ""),
                 [r for r in ok if (r.endpoint, r.load, r.prompt_tokens) == (ep, load, size)])
                for ep, load, size in keys]
    return [(ep, [r for r in ok if r.endpoint == ep]) for ep in eps]


def _cdf(values: Sequence[float]) -> list[tuple[float, float]]:
    data = sorted(values)
    return [(v, (i + 1) / len(data)) for i, v in enumerate(data)]


def render_distributions(results: Sequence[RequestResult], levels: Sequence[LevelStats]) -> str:
    """The empirical CDF of TTFT and of E2E, a step line per endpoint (and level)."""
    groups = _groups(results, levels)
    cells = []
    for metric, name in (("ttft", "TTFT"), ("e2e", "E2E")):
        series = [XYSeries(label, COLORS[i % len(COLORS)],
                           _cdf([v * 1e3 for r in rs if (v := getattr(r, metric)) is not None]),
                           Style.STEP)
                  for i, (label, rs) in enumerate(groups)]
        series = [s for s in series if s.points]
        if not series:
            continue
        svg = xy_svg(Axes(f"{name}: share of requests at or below", f"{name} (ms)",
                          "fraction of requests"), series)
        cells.append(f'<div class="chart">{svg}'
                     f"{legend_html([(s.name, s.color) for s in series])}</div>")
    if not cells:
        return ""
    return ('<section id="distributions"><h2>Distributions (CDF)</h2><p class="note">every '
            "successful measured request; read across at 0.5 for the median, at 0.99 for the "
            f'p99</p><div class="grid">{"".join(cells)}</div></section>')


def render_over_time(results: Sequence[RequestResult], levels: Sequence[LevelStats]) -> str:
    """Open loop: each request's TTFT and E2E against when it was sent, one chart per level,
    so a queue building up (latency climbing through the level) shows."""
    if not levels or levels[0].mode != "rate":
        return ""
    eps = endpoints_of(levels)
    cells = []
    for load, size in dict.fromkeys((s.load, s.prompt_tokens) for s in levels):
        mine = [r for r in results if r.ok and (r.load, r.prompt_tokens) == (load, size)]
        series: list[XYSeries] = []
        for ep in eps:
            for metric, name in (("e2e", "E2E"), ("ttft", "TTFT")):
                pts = [(r.start, v * 1e3) for r in mine
                       if r.endpoint == ep and (v := getattr(r, metric)) is not None]
                if pts:
                    series.append(XYSeries(f"{ep} {name}", COLORS[len(series) % len(COLORS)],
                                           pts, Style.DOTS))
        if not series:
            continue
        title = f"latency over time at {load:g} req/s" + (f", prompt {size}" if size else "")
        svg = xy_svg(Axes(title, "request sent at (s since the level started)",
                          "latency (ms)"), series)
        cells.append(f'<div class="chart">{svg}'
                     f"{legend_html([(s.name, s.color) for s in series])}</div>")
    if not cells:
        return ""
    return ('<section id="over-time"><h2>Latency over time (open loop)</h2><div class="grid">'
            f'{"".join(cells)}</div></section>')


def _first_ok(results: Sequence[RequestResult], endpoint: str) -> dict[int, RequestResult]:
    out: dict[int, RequestResult] = {}
    for r in results:
        if r.endpoint == endpoint and r.ok and r.line and r.line not in out:
            out[r.line] = r
    return out


def render_scatter(results: Sequence[RequestResult], levels: Sequence[LevelStats]) -> str:
    """A replay to two targets: each recorded request's latency at A against B's, paired by
    the request's line (its first answer from each); above the diagonal B was slower."""
    eps = endpoints_of(levels)
    if len(eps) != 2:
        return ""
    a, b = (_first_ok(results, ep) for ep in eps)
    lines = [n for n in a if n in b]
    if not lines:
        return ""
    cells = []
    for metric, name in (("e2e", "E2E"), ("ttft", "TTFT")):
        pts = [(va * 1e3, vb * 1e3) for n in lines
               if (va := getattr(a[n], metric)) is not None
               and (vb := getattr(b[n], metric)) is not None]
        if not pts:
            continue
        top = nice_ticks(0.0, max(max(p) for p in pts))[-1]  # the diagonal across the chart
        series = [XYSeries(f"{name} of one request", COLORS[0], pts, Style.DOTS),
                  XYSeries("equal (y = x)", "#888", [(0.0, 0.0), (top, top)], Style.DASHED)]
        svg = xy_svg(Axes(f"{name} per request: A vs B", f"{eps[0]} (A), ms",
                          f"{eps[1]} (B), ms", square=True), series)
        cells.append(f'<div class="chart">{svg}'
                     f"{legend_html([(s.name, s.color) for s in series])}</div>")
    return (f'<section id="scatter"><h2>A vs B per request</h2><p class="note">{len(lines)} '
            f"recorded requests both answered, paired by their line in the file; above the "
            f"diagonal {escape(eps[1])} (B) took longer, below it {escape(eps[0])} (A) did</p>"
            f'<div class="grid">{"".join(cells)}</div></section>')


WIDE_SETTING = 40  # characters


def _setting(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


def render_settings(run: RunInfo) -> str:
    """When, with what and how the run was made: date, version, command, settings."""
    rows = [("date", run.date), ("tokenmeter", run.version)]
    rows += [(str(k), _setting(v)) for k, v in run.settings.items()
             if v is not None and v not in ({}, [])]
    # Three settings a line; a long one (the endpoints' URLs) gets a line of its own, last.
    rows.sort(key=lambda kv: len(kv[1]) > WIDE_SETTING)
    dl = "".join(f"<dt{w}>{escape(k)}</dt><dd{w}>{escape(v)}</dd>" for k, v in rows if v
                 for w in [' class="wide"' if len(v) > WIDE_SETTING else ""])
    command = (f'<p><b>command</b> <code id="command">{escape(run.command)}</code></p>'
               if run.command else "")
    return (f'<section id="settings">{command}<details open><summary>settings</summary>'
            f"<dl>{dl}</dl></details></section>")


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


def render_page(levels: Sequence[LevelStats], title: str, table: str,
                run: RunInfo | None = None) -> str:
    """The whole page; `table` is the terminal report, shown folded at the end."""
    if not levels:
        raise ValueError("nothing to plot: no levels")
    run = run or RunInfo()
    eps = endpoints_of(levels)
    a, b = [*eps, ""][:2]
    answers = run.answers if run.answers is not None else (
        run.replay.page_answers() if run.replay else None)
    parts = [
        f"<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f'<meta name="viewport" content="width=device-width,initial-scale=1">'
        f"<title>{escape(title)}</title><style>{CSS}</style></head>\n<body>",
        f"<h1>{escape(title)}</h1>",
        render_settings(run),
        render_headline(levels, run.replay),
        render_outcomes(run.replay),
        render_deltas(levels, replay=run.replay is not None),
        render_scatter(run.results, levels) if run.replay is not None else "",
        render_distributions(run.results, levels),
        render_over_time(run.results, levels),
        render_charts(levels),
        render_answers(answers, a, b),
        f"<details><summary>terminal report</summary><pre>{escape(table)}</pre></details>",
        "</body></html>\n",
    ]
    return "\n".join(p for p in parts if p)


def write_plot(path: str | Path, levels: Sequence[LevelStats], title: str, table: str,
               run: RunInfo | None = None) -> None:
    """`--plot FILE`: the SVG charts for .svg, the page above for .html/.htm."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in (".svg", ".html", ".htm"):
        raise PlotFormatError(f"--plot {p}: only .svg or .html are supported (no PNG: that "
                              "would need a plotting library); open the .svg or .html in a "
                              "browser, or convert the .svg")
    text = (render_svg(levels, title) if suffix == ".svg"
            else render_page(levels, title, table, run))
    p.write_text(text, encoding="utf-8")
