"""The `--plot FILE.html` page of `tokenmeter bench`, loaded in a real headless Chromium.

The page comes from a real run (the CLI in a subprocess against two simulated upstreams over
loopback); Chromium renders it to a screenshot (kept in pytest's tmp_path) and dumps the DOM it
built, in which the headline figures, the "B over A" section and the escaped user text must be.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from pathlib import Path

import pytest

from proxy.bench import BenchConfig, Endpoint, RequestSpec, run_bench
from proxy.bench.page import write_plot
from proxy.bench.report import render
from proxy.testing.mock_upstream import MockSettings, create_mock_app
from tests.helpers import ServerFactory

HOSTILE_MODEL = "mock<script>alert(1)</script>"


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail("chromium is missing: `apt-get install -y chromium` (.ci/run installs it); "
                    "the bench page is checked in a real browser")
    return path


async def browse(page: Path, out: Path) -> str:
    """Chromium's screenshot of `page` to out/page.png, and the DOM it built."""
    base = [chromium(), "--headless", "--no-sandbox", "--disable-gpu",
            f"--user-data-dir={out / 'chromium-profile'}", "--window-size=1400,1000"]
    url = page.resolve().as_uri()
    shot = await asyncio.create_subprocess_exec(
        *base, f"--screenshot={out / 'page.png'}", url,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(shot.communicate(), 120)
    assert shot.returncode == 0, err.decode()
    dump = await asyncio.create_subprocess_exec(
        *base, "--dump-dom", url, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    dom, err = await asyncio.wait_for(dump.communicate(), 120)
    assert dump.returncode == 0, err.decode()
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
    for row in ("throughput", "TTFT p50 / p99", "ITL p50 / p99", "E2E p50 / p99", "goodput"):
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
    write_plot(tmp_path / "p.html", result.levels, "answers", render(result), answers=answers)
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
