"""The `--plot FILE.html` page of `tokenmeter bench`, loaded in a real headless Chromium.

The pages come from real runs (the CLI in a subprocess against simulated upstreams, or replay
upstreams serving a capture export, over loopback); Chromium renders each to a screenshot (kept
in pytest's tmp_path) and dumps the DOM it built, in which the headline figures, the settings,
the verdicts, a legend entry for every series of every chart, round axis ticks and the escaped
user text must be.
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from proxy.bench import BenchConfig, Endpoint, RequestSpec, run_bench
from proxy.bench.page import RunInfo, write_plot
from proxy.bench.report import render
from proxy.testing.mock_upstream import MockSettings, create_mock_app
from proxy.testing.replay import create_replay_app, load_recordings
from tests.helpers import ServerFactory

HOSTILE_MODEL = "mock<script>alert(1)</script>"


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail("chromium is missing: `apt-get install -y chromium` (.ci/run installs it); "
                    "the bench page is checked in a real browser")
    return path


async def browse(page: Path, out: Path) -> str:
    """Chromium's screenshot of `page` to out/page.png, and the DOM it built: one browser
    does both (a browser's start is most of the cost)."""
    shot = out / "page.png"
    dump = await asyncio.create_subprocess_exec(
        chromium(), "--headless", "--no-sandbox", "--disable-gpu",
        f"--user-data-dir={out / 'chromium-profile'}", "--window-size=1400,1000",
        f"--screenshot={shot}", "--dump-dom", page.resolve().as_uri(),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    dom, err = await asyncio.wait_for(dump.communicate(), 120)
    assert dump.returncode == 0, err.decode()
    assert shot.stat().st_size > 0, err.decode()
    return dom.decode()


async def mock(aiohttp_server: ServerFactory, ttft_ms: int) -> str:
    settings = MockSettings(ttft_ms=ttft_ms, tokens_per_second=2000, output_tokens=16)
    return str((await aiohttp_server(create_mock_app(settings))).make_url("/v1"))


async def run_cli(*args: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy.cli", "bench", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, stderr = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, stderr.decode()


class Chart:
    def __init__(self) -> None:
        self.legend: list[str] = []  # the legend's entries, in order
        self.drawn: set[str] = set()  # the series the SVG draws
        self.ticks: dict[str, list[str]] = {"x": [], "y": []}


class Charts(HTMLParser):
    """Every `<div class="chart">` of a page: its legend, the series it draws, its ticks."""

    def __init__(self) -> None:
        super().__init__()
        self.charts: list[Chart] = []
        self._depth = 0  # <div> nesting inside the current chart (0: outside any)
        self._tick: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "div" and self._depth:
            self._depth += 1
        elif tag == "div" and a.get("class") == "chart":
            self.charts.append(Chart())
            self._depth = 1
        if not self._depth:
            return
        chart = self.charts[-1]
        if (name := a.get("data-series")) is not None:
            (chart.legend.append(name) if tag == "span" else chart.drawn.add(name))
        if tag == "text" and (a.get("class") or "").startswith("tick "):
            self._tick = (a.get("class") or "").split()[1]

    def handle_endtag(self, tag: str) -> None:
        if tag == "div" and self._depth:
            self._depth -= 1
        if tag == "text":
            self._tick = None

    def handle_data(self, data: str) -> None:
        if self._tick is not None:
            self.charts[-1].ticks[self._tick].append(data)


def charts_of(dom: str) -> list[Chart]:
    parser = Charts()
    parser.feed(dom)
    return parser.charts


def assert_round_ticks(labels: list[str]) -> None:
    """Evenly spaced multiples of one step of 1, 2, 2.5 or 5 times a power of ten."""
    values = [float(v.replace(",", "")) for v in labels]
    assert len(values) >= 3, labels
    step = values[1] - values[0]
    exp = math.floor(math.log10(step))
    assert round(step / 10**exp, 9) in (1, 2, 2.5, 5), labels
    for k, v in enumerate(values):
        assert v == pytest.approx(values[0] + k * step, abs=step * 1e-6), labels
        assert round(v / step, 6) == round(v / step), labels


def assert_charts_readable(dom: str, count: int) -> list[Chart]:
    """Every chart has a legend naming each series it draws (and only those), and round
    ticks on each numeric axis."""
    charts = charts_of(dom)
    assert len(charts) == count
    for chart in charts:
        assert chart.drawn, "a chart that draws no named series"
        assert set(chart.legend) == chart.drawn and len(chart.legend) == len(chart.drawn)
        for labels in chart.ticks.values():
            if labels:
                assert_round_ticks(labels)
        assert chart.ticks["y"]
    return charts


def section(dom: str, name: str) -> str:
    start = dom.index(f'<section id="{name}"')
    return dom[start:dom.index("</section>", start)]


async def test_compare_page_in_chromium(aiohttp_server: ServerFactory, tmp_path: Path) -> None:
    # The gateway's upstream answers 40 ms later than direct's: the page must show the TTFT
    # the gateway (--base-url) adds over direct (--compare).
    url_gw, url_direct = await mock(aiohttp_server, 45), await mock(aiohttp_server, 5)
    await run_cli("--base-url", url_gw, "--label", "gate<b>way</b>", "--compare", url_direct,
                  "--compare-label", "direct", "--model", HOSTILE_MODEL,
                  "--concurrency", "1,2", "--requests", "4", "--prompt-tokens", "8",
                  "--warmup", "0", "--slo", "ttft=1s", "--json", str(tmp_path / "r.json"),
                  "--plot", str(tmp_path / "report.html"))
    data = json.loads((tmp_path / "r.json").read_text())
    dom = await browse(tmp_path / "report.html", tmp_path)

    assert (tmp_path / "page.png").stat().st_size > 20_000  # a rendered page, not a blank one
    # Headline: both endpoints, their request counts, latency and goodput rows.
    headline = dom[dom.index('id="headline"'):dom.index('id="deltas"')]
    gw = "gate&lt;b&gt;way&lt;/b&gt;"
    for ep in (gw, "direct"):
        assert f"<h3>{ep}</h3>" in headline
    assert headline.count("<dd>8</dd>") == 2  # requests: 2 levels x 4
    for row in ("throughput", "TTFT p50 / p99", "ITL per token p50 / p99",
                "ITL chunk gaps p50 / p99", "E2E p50 / p99", "goodput"):
        assert headline.count(f"<dt>{row}</dt>") == 2
    # Added latency: the three charts, and the table's TTFT median difference, which is the
    # run's own comparison (the terminal table's sign: base - compare).
    deltas = dom[dom.index('id="deltas"'):dom.index('id="charts"')]
    assert f"Added latency: {gw} over direct" in deltas
    for name in ("TTFT", "ITL", "E2E"):
        assert f"{name}: {gw} - direct, ms" in deltas
    assert [c["load"] for c in data["comparisons"]] == [1, 2]
    for c in data["comparisons"]:
        # The figure, not this machine's timing (a loaded box can blur the 40 ms apart).
        assert f"<td>{c['deltas']['ttft_p50'] * 1e3:+.3f}</td>" in deltas
    # User text is text: no script element came from the model name.
    assert "<script>" not in dom and "mock&lt;script&gt;alert(1)&lt;/script&gt;" in dom


async def test_answers_side_by_side_escaped_and_diffed(
    aiohttp_server: ServerFactory, tmp_path: Path,
) -> None:
    url = await mock(aiohttp_server, 5)
    cfg = BenchConfig(endpoints=[Endpoint(url, "a"), Endpoint(url, "b")],
                      spec=RequestSpec(model="mock"), concurrency=[1], prompt_tokens=[8],
                      requests=2, warmup=0)
    result = await run_bench(cfg)
    answers = [{"request": "say <hi>", "a": "the quick fox <x>", "b": "the slow fox <x>"}]
    write_plot(tmp_path / "p.html", result.levels, "answers", render(result),
               RunInfo(answers=answers))
    dom = await browse(tmp_path / "p.html", tmp_path)
    section = dom[dom.index('id="answers"'):]
    assert "say &lt;hi&gt;" in section
    assert "<del>quick</del>" in section and "<ins>slow</ins>" in section
    assert "fox &lt;x&gt;" in section and "<x>" not in section


async def test_single_endpoint_no_deltas_and_warnings_shown(
    aiohttp_server: ServerFactory, tmp_path: Path,
) -> None:
    url = await mock(aiohttp_server, 5)
    cfg = BenchConfig(endpoints=[Endpoint(url, "only")], spec=RequestSpec(model="mock"),
                      concurrency=[1, 2], prompt_tokens=[8], requests=2, warmup=0,
                      lag_warn_ms=-1.0)  # any lag is over it: the page must carry the warning
    result = await run_bench(cfg)
    write_plot(tmp_path / "p.html", result.levels, "one", render(result))
    html = (tmp_path / "p.html").read_text()
    assert 'id="headline"' in html and 'id="charts"' in html
    assert 'id="deltas"' not in html and 'id="answers"' not in html
    assert '<ul class="warn"><li>' in html and "unreliable" in html
    # Self-contained: nothing to fetch, no script.
    assert "http" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "<script" not in html


async def test_sweep_page_legends_settings_distributions_over_time(
    aiohttp_server: ServerFactory, tmp_path: Path,
) -> None:
    # An open-loop sweep compared against a second upstream, with a secret header: the page
    # must say how it was run (without the secret), and carry the CDFs and the latency over
    # time, every chart with a legend and round ticks.
    url_gw, url_direct = await mock(aiohttp_server, 30), await mock(aiohttp_server, 5)
    page = tmp_path / "sweep.html"
    await run_cli("--base-url", url_gw, "--label", "gateway", "--compare", url_direct,
                  "--compare-label", "direct", "--model", "mock", "--rate", "40,80",
                  "--requests", "6", "--prompt-tokens", "8", "--warmup", "0",
                  "--header", "Authorization: Bearer sk-secret", "--plot", str(page))
    dom = await browse(page, tmp_path)

    assert "sk-secret" not in dom and "sk-secret" not in page.read_text()
    settings = section(dom, "settings")
    assert "Authorization: &lt;redacted&gt;" in settings  # the command, its value hidden
    assert "tokenmeter bench --base-url" in settings and "--rate 40,80" in settings
    for key in ("date", "tokenmeter", "mode", "loads", "requests_per_level", "headers"):
        assert f"<dt>{key}</dt>" in settings
    assert " UTC</dd>" in settings
    charts = assert_charts_readable(dom, count=3 + 2 + 2 + 6)
    # The CDFs: a series per endpoint and level; latency over time: one chart per level.
    cdf = charts_of(section(dom, "distributions"))
    assert len(cdf) == 2
    assert set(cdf[0].legend) == {f"{ep}, {r} req/s" for ep in ("gateway", "direct")
                                  for r in (40, 80)}
    over = charts_of(section(dom, "over-time"))
    assert len(over) == 2
    assert set(over[0].legend) == {"gateway E2E", "gateway TTFT", "direct E2E", "direct TTFT"}
    # The delta charts' ticks were raw quarters of the range; now round on every axis.
    assert all(c.ticks["y"] for c in charts)
    assert "Added latency: gateway over direct" in dom  # a load test's wording
    assert 'id="scatter"' not in dom  # pairs by recorded request: a replay's only


def _export_line(i: int, answer: str) -> dict[str, Any]:
    """A recorded request as `captures export` writes it; even ones streamed."""
    messages = [{"role": "user", "content": f"question {i}"}]
    usage = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    stream = i % 2 == 0
    request = {"model": "recorded-model", "messages": messages, "max_tokens": 50,
               **({"stream": True} if stream else {})}
    head, _, tail = answer.partition(" ")
    if stream:
        events = [{"at_ms": 0.0, "text": "data: " + json.dumps(
                      {"choices": [{"delta": {"content": head}}]})},
                  {"at_ms": 40.0 * i, "text": "data: " + json.dumps(
                      {"choices": [{"delta": {"content": " " + tail}, "finish_reason": "stop"}]})},
                  {"at_ms": 40.0 * i, "text": "data: " + json.dumps(
                      {"choices": [], "usage": usage})},
                  {"at_ms": 40.0 * i, "text": "data: [DONE]"}]
        response: dict[str, Any] = {"status": 200, "body": None, "events": events}
    else:
        body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": answer},
                             "finish_reason": "stop"}], "usage": usage}
        response = {"status": 200, "body": body, "events": []}
    return {"request_id": f"r{i}", "api": "openai", "path": "/v1/chat/completions",
            "model": "recorded-model", "messages": messages, "max_tokens": 50,
            "stream": stream, "request": request, "response": response}


async def test_replay_page_verdicts_scatter_and_wording(
    aiohttp_server: ServerFactory, tmp_path: Path,
) -> None:
    # 8 recorded requests; B answers the last 2 differently and longer: exact match 75%.
    answers_a = {i: f"answer {i}" for i in range(1, 9)}
    answers_b = {i: a if i <= 6 else f"another longer answer {i}" for i, a in answers_a.items()}
    # Line 9 was refused (429) when recorded, and B answers it; line 10 is an embeddings
    # request, which bench does not send.
    refused = {"status": 429, "events": [], "body": {"error": {
        "message": "Rate limit reached", "type": "rate_limit_error", "code": "rate_limit"}}}
    embedding = {"request_id": "r10", "api": "openai", "path": "/v1/embeddings",
                 "model": "recorded-model", "messages": None, "stream": False,
                 "response": {"status": 200, "body": {"data": []}, "events": []}}
    files = []
    for name, answers in (("a", answers_a), ("b", answers_b)):
        path = tmp_path / f"{name}.jsonl"
        ninth = _export_line(9, "answer 9")
        if name == "a":
            ninth["response"] = refused
        lines = [*(_export_line(i, t) for i, t in answers.items()), ninth, embedding]
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        files.append(path)
    server_a = await aiohttp_server(create_replay_app(load_recordings(files[0]), speed=1))
    server_b = await aiohttp_server(create_replay_app(load_recordings(files[1]), speed=4))
    prices = tmp_path / "prices.yaml"
    prices.write_text("prices:\n  recorded-model: {input: 1.0, output: 2.0}\n")
    page = tmp_path / "replay.html"
    await run_cli("--base-url", str(server_a.make_url("/v1")), "--label", "A-target",
                  "--compare", str(server_b.make_url("/v1")), "--compare-label", "B-target",
                  "--replay", str(files[0]), "--prices", str(prices),
                  "--json", str(tmp_path / "r.json"), "--plot", str(page))
    replay = json.loads((tmp_path / "r.json").read_text())["replay"]
    dom = await browse(page, tmp_path)

    headline = section(dom, "headline")
    # The verdicts in the cards: the cost per endpoint, the answers' exact-match rate and
    # length ratio, the figures of the run's own report.
    assert [cost["requests"] for cost in replay["cost"]] == [8, 9]  # A's 9th: the 429
    for cost in replay["cost"]:
        assert f"<dd>${cost['cost_usd']:,.6f} ({cost['requests']} answers)</dd>" in headline
        assert f"<dd>${cost['cost_per_1k_requests_usd']:,.4f}</dd>" in headline
    assert headline.count("<dt>cost</dt>") == 2
    assert "<dt>exact match</dt><dd>75.0%</dd>" in headline
    ratio = replay["answers"]["length_ratio"]
    assert f"<dt>length ratio B/A</dt><dd>{ratio:,.3f}</dd>" in headline
    assert "answers: A-target (A) vs B-target (B)" in headline
    # What was sent and skipped, and each endpoint's outcomes beside the recorded ones.
    assert "<dt>requests replayed</dt><dd>9 of 10 lines</dd>" in headline
    assert "<dt>/v1/embeddings (not replayed by bench)</dt><dd>1</dd>" in headline
    assert headline.count("<dt>same outcome as recorded</dt><dd>9 / 9</dd>") == 1  # A
    assert headline.count("<dt>same outcome as recorded</dt><dd>8 / 9</dd>") == 1  # B
    outcomes = section(dom, "outcomes")
    assert ("<tr><td>9</td><td>openai</td><td>429 rate_limit</td><td>429 rate_limit</td>"
            "<td>200 ok</td></tr>") in outcomes
    assert outcomes.count("<tr><td>") == 1
    # A replay compares two targets: a difference, not what a gateway adds.
    assert "added latency" not in dom.lower()
    assert "Latency difference: A-target (A) - B-target (B)" in dom
    # A vs B per request: one dot per request both answered, and the y = x reference.
    scatter = section(dom, "scatter")
    assert scatter.count("<circle") == 2 * 8  # E2E and TTFT charts
    assert "8 recorded requests both answered" in scatter
    assert {n for c in charts_of(scatter) for n in c.legend} == {
        "E2E of one request", "TTFT of one request", "equal (y = x)"}
    assert_charts_readable(dom, count=3 + 2 + 2 + 6)
    assert 'id="over-time"' not in dom  # a closed-loop run
    assert "replay_file" in section(dom, "settings")
