"""`tokenmeter bench` against the simulated upstream (and the proxy), over real loopback HTTP."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from proxy.bench import BenchConfig, Endpoint, RequestSpec, run_bench
from proxy.bench.cli import command_line
from proxy.bench.client import Api
from proxy.bench.page import write_plot
from proxy.bench.report import ProgressBar, render, to_csv, to_json
from proxy.bench.runner import Tick
from proxy.bench.stats import parse_slo
from proxy.bench.workload import PromptsFileError, load_prompts
from proxy.cli import main
from proxy.testing import mock_tokens
from proxy.testing.mock_upstream import MockSettings, create_mock_app
from tests.helpers import (
    ALICE_KEY,
    ServerFactory,
    Stack,
    StackFactory,
    make_config,
    sample,
)
from tests.servers import free_port

MODEL = "mock-gpt"


@pytest.fixture
def mock_settings() -> MockSettings:
    # For the `stack` fixture (proxy in front of the mock): a paced stream with a known TTFT.
    return MockSettings(tokens_per_second=750, ttft_ms=20, output_tokens=32)


async def mock_url(aiohttp_server: ServerFactory, **settings: Any) -> str:
    server = await aiohttp_server(create_mock_app(MockSettings(**settings)))
    return str(server.make_url("/v1"))


def config(url: str, **kw: Any) -> BenchConfig:
    headers = kw.pop("headers", {})
    spec = kw.pop("spec", RequestSpec(model=MODEL, max_tokens=None))
    base = dict(endpoints=[Endpoint(url, "mock", None, headers)], spec=spec, warmup=1)
    return BenchConfig(**{**base, **kw})


async def test_reports_the_known_ttft_speed_and_output_length(
    aiohttp_server: ServerFactory,
) -> None:
    url = await mock_url(aiohttp_server, ttft_ms=50, tokens_per_second=750, output_tokens=64)
    # The lag warning is tested on its own below: here it would only say how busy the box is.
    result = await run_bench(config(url, concurrency=[1], requests=6, prompt_tokens=[32],
                                    lag_warn_ms=1e9))
    (st,) = result.levels
    assert (st.ok, st.errors, st.requests) == (6, 0, 6)
    # Times a loaded machine can only lengthen: bounded below by the mock's pace (a little slack
    # for the event loop's clock resolution), above only loosely (a unit slip or a hang).
    assert 0.049 <= st.ttft.p50 < 1.0
    assert 1 / 750 * 0.9 <= st.tpot.p50 < 0.1
    assert st.stream_tokens_per_s.p50 == pytest.approx(1 / st.tpot.p50, rel=0.2)
    assert st.output_tokens.min == st.output_tokens.max == 64
    assert st.usage_output_tokens == st.local_output_tokens == 6 * 64
    assert st.usage_diff_tokens == 0 and st.usage_diff_pct == 0
    assert st.itl.n == 6 * 63
    # e2e = ttft + 63 gaps of at least about 1/750 s
    assert st.ttft.p50 + 63 / 750 * 0.9 <= st.e2e.p50 < 2.0
    # The mock reports its own count: the prompt's words, one token each, and its framing.
    assert all(r.usage_prompt_tokens == 32 + mock_tokens.count_messages([{"role": "user",
                                                                         "content": ""}])
               for r in result.results)
    assert not any("event-loop lag" in w for w in st.warnings)
    assert result.loop in ("asyncio", "uvloop")


async def test_event_loop_lag_over_the_threshold_is_flagged(
    aiohttp_server: ServerFactory,
) -> None:
    """The flag's logic, not this machine's lag: any lag at all is over a negative threshold."""
    url = await mock_url(aiohttp_server, ttft_ms=30, tokens_per_second=0, output_tokens=4)
    result = await run_bench(config(url, concurrency=[1], requests=2, prompt_tokens=[8],
                                    lag_warn_ms=-1.0))
    (st,) = result.levels
    assert st.lag_p99_ms >= 0
    assert any("event-loop lag" in w and "unreliable" in w for w in st.warnings), st.warnings


async def test_sweep_gives_one_level_per_load_and_prompt_size(
    aiohttp_server: ServerFactory,
) -> None:
    url = await mock_url(aiohttp_server, ttft_ms=0, tokens_per_second=0, output_tokens=8)
    result = await run_bench(config(url, concurrency=[1, 3], prompt_tokens=[16, 200],
                                    requests=6))
    keys = [(st.load, st.prompt_tokens) for st in result.levels]
    assert keys == [(1, 16), (3, 16), (1, 200), (3, 200)]
    assert all(st.ok == 6 and st.output_tokens.p50 == 8 for st in result.levels)
    framing = mock_tokens.count_messages([{"role": "user", "content": ""}])  # the mock's
    for r in result.results:
        assert r.usage_prompt_tokens == r.prompt_tokens + framing
    table = render(result)
    assert table.count("\n  mock") == 0 and len(table.splitlines()) >= 6


async def test_open_loop_sends_at_poisson_times(aiohttp_server: ServerFactory) -> None:
    url = await mock_url(aiohttp_server, ttft_ms=0, tokens_per_second=0, output_tokens=4)
    result = await run_bench(config(url, rates=[40.0], requests=12, prompt_tokens=[8]))
    (st,) = result.levels
    assert st.mode == "rate" and st.load == 40 and st.ok == 12
    starts = sorted(r.start for r in result.results)
    # 12 arrivals at 40/s: the last one is due at the sum of 11 exponential gaps (mean 25 ms).
    assert 0.05 < starts[-1] - starts[0] < 1.5


async def test_compare_proxy_and_direct_interleaved(stack: Stack) -> None:
    cfg = BenchConfig(
        endpoints=[Endpoint(stack.base_url, "proxy", "sk-any"),
                   Endpoint(stack.upstream_url, "direct")],
        spec=RequestSpec(model=MODEL), concurrency=[1, 2], requests=8, prompt_tokens=[16],
        warmup=1, rounds=2)
    result = await run_bench(cfg)
    assert [(s.endpoint, s.load) for s in result.levels] == [
        ("proxy", 1), ("direct", 1), ("proxy", 2), ("direct", 2)]
    assert all(s.ok == 8 and s.usage_diff_tokens == 0 for s in result.levels)
    assert [(c.base, c.other, c.load) for c in result.comparisons] == [
        ("proxy", "direct", 1), ("proxy", "direct", 2)]
    for c in result.comparisons:
        # The comparison is arithmetic on the two levels (how much TTFT the proxy adds is
        # benchmarks/bench_proxy.py's business, not a correctness test's on a shared box).
        base, other = (next(s for s in result.levels if s.endpoint == e and s.load == c.load)
                       for e in ("proxy", "direct"))
        assert c.ratios["ttft_p50"] == pytest.approx(base.ttft.p50 / other.ttft.p50)
        assert c.deltas["ttft_p50"] == pytest.approx(base.ttft.p50 - other.ttft.p50)
        assert c.ratios["stream_tokens_per_s_p50"] == pytest.approx(
            base.stream_tokens_per_s.p50 / other.stream_tokens_per_s.p50)
    # Interleaved in blocks A B B A: each endpoint's requests come in two separate runs.
    proxy_starts = sorted(r.start for r in result.results if r.endpoint == "proxy"
                          and r.load == 1)
    direct_starts = sorted(r.start for r in result.results if r.endpoint == "direct"
                           and r.load == 1)
    assert proxy_starts[0] < direct_starts[0] < direct_starts[-1] < proxy_starts[-1]
    assert "proxy vs direct" in render(result)


async def test_slo_goodput_half_all_none(aiohttp_server: ServerFactory, tmp_path: Path) -> None:
    url = await mock_url(aiohttp_server, ttft_ms=10, tokens_per_second=750, output_tokens=64)
    prompts = tmp_path / "prompts.jsonl"
    short = {"messages": [{"role": "user", "content": "short"}], "max_tokens": 4}
    long = [{"role": "user", "content": "long"}]  # the mock's 64 tokens: ~95 ms
    prompts.write_text(json.dumps(short) + "\n\n" + json.dumps(long) + "\n")
    loaded = load_prompts(prompts, MODEL)
    for slo, fraction in (("e2e=50ms", 0.5), ("ttft=1s", 1.0), ("ttft=1ms", 0.0)):
        result = await run_bench(config(url, prompts=loaded, requests=4, slo=parse_slo(slo)))
        (st,) = result.levels
        assert st.prompt_tokens == 0 and st.ok == 4
        assert st.goodput_fraction == fraction, slo
        assert st.goodput == pytest.approx(4 * fraction / st.duration_s)
    assert sorted(r.output_tokens for r in result.results) == [4, 4, 64, 64]


def test_prompts_file_errors_name_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    for text, message in (
        ('{"messages": [{"role": "user", "content": "x"}]}\nnot json\n', "bad.jsonl:2: not JSON"),
        ('{"messages": []}\n', "bad.jsonl:1: expected"),
        ('[{"content": "x"}]\n', "needs a 'role'"),
        ('{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}\n', "max_tokens"),
        ("\n\n", "no prompts"),
    ):
        bad.write_text(text)
        with pytest.raises(PromptsFileError, match=message):
            load_prompts(bad, MODEL)
    with pytest.raises(PromptsFileError, match="cannot read"):
        load_prompts(tmp_path / "missing.jsonl", MODEL)


async def test_endpoint_errors_are_counted_by_status_and_class(
    aiohttp_server: ServerFactory,
) -> None:
    url = await mock_url(aiohttp_server, ttft_ms=0, tokens_per_second=0, output_tokens=16)
    cases = [
        ({"x-mock-status": "500"}, "500", "server_error"),
        ({"x-mock-status": "429"}, "429", "rate_limit"),
        ({"x-mock-status": "401"}, "401", "auth"),
        ({"x-mock-status": "400", "x-mock-error-code": "context_length_exceeded"}, "400",
         "context_length"),
        ({"x-mock-reset-after": "3"}, "200", "stream_reset"),
    ]
    for headers, status, cls in cases:
        result = await run_bench(config(url, headers=headers, requests=3, warmup=0))
        (st,) = result.levels
        assert (st.ok, st.errors) == (0, 3), headers
        assert st.errors_by_status == {status: 3} and st.errors_by_class == {cls: 3}
        assert cls in render(result)
    # A stalled stream hits the per-request timeout.
    spec = RequestSpec(model=MODEL, timeout_s=0.3)
    result = await run_bench(config(url, headers={"x-mock-stall-after": "2"}, spec=spec,
                                    requests=2, warmup=0, concurrency=[2]))
    assert result.levels[0].errors_by_class == {"timeout": 2}
    # Nothing listens: connection errors, no status.
    closed = f"http://127.0.0.1:{free_port()}/v1"
    result = await run_bench(config(closed, requests=3))
    (st,) = result.levels
    assert st.errors_by_status == {"none": 3} and st.errors_by_class == {"connection": 3}
    assert json.loads(to_json(result, {}))["levels"][0]["errors_by_class"] == {"connection": 3}


async def test_outputs_json_csv_svg_html(aiohttp_server: ServerFactory, tmp_path: Path) -> None:
    url = await mock_url(aiohttp_server, ttft_ms=5, tokens_per_second=0, output_tokens=8)
    cfg = BenchConfig(endpoints=[Endpoint(url, "a"), Endpoint(url, "b")],
                      spec=RequestSpec(model=MODEL), concurrency=[1, 2], prompt_tokens=[8, 64],
                      requests=4, warmup=0, slo=parse_slo("ttft=1s"))
    result = await run_bench(cfg)
    data = json.loads(to_json(result, {"model": MODEL}))
    assert len(data["levels"]) == 8 and len(data["comparisons"]) == 4
    assert data["levels"][0]["ttft"]["p99"] > 0 and data["levels"][0]["goodput_fraction"] == 1
    rows = list(csv.DictReader(to_csv(result).splitlines()))
    assert len(rows) == 8 and float(rows[0]["ttft.p50"]) > 0 and rows[0]["endpoint"] == "a"
    # ITL per token as AIPerf defines it ((E2E - TTFT) / (tokens - 1)) is TPOT, under the name
    # an AIPerf user looks for; `itl` stays the chunk gaps.
    for level, row in zip(data["levels"], rows, strict=True):
        assert level["itl_per_token"] == level["tpot"] and level["tpot"]["n"] == 4
        assert row["itl_per_token.p50"] == row["tpot.p50"] != ""
    assert "TPOT = ITL per token as AIPerf defines it" in render(result)
    for name in ("plot.svg", "plot.html"):
        write_plot(tmp_path / name, result.levels, "test", render(result))
    svg = ET.parse(tmp_path / "plot.svg").getroot()
    ns = "{http://www.w3.org/2000/svg}"
    # 3 metrics x 2 columns (load, prompt size), one line per series (2 endpoints x 2 others).
    assert len(svg.findall(f"{ns}polyline")) == 3 * 2 * 4
    assert len(svg.findall(f"{ns}polygon")) > 0  # percentile bands
    html = (tmp_path / "plot.html").read_text()
    assert html.startswith("<!doctype html>") and "<svg" in html and "TTFT" in html


async def test_cli_end_to_end(aiohttp_server: ServerFactory, tmp_path: Path) -> None:
    url = await mock_url(aiohttp_server, ttft_ms=20, tokens_per_second=2000, output_tokens=16)
    out = tmp_path / "r"
    env = {**os.environ, "BENCH_TEST_KEY": "sk-secret-never-printed"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy.cli", "bench", "--base-url", url, "--model", MODEL,
        "--compare", url, "--concurrency", "1,2", "--requests", "4", "--prompt-tokens", "8",
        "--warmup", "1", "--slo", "ttft=500ms", "--api-key-env", "BENCH_TEST_KEY",
        "--header", "x-mock-output-tokens: 12", "--json", f"{out}.json", "--csv", f"{out}.csv",
        "--plot", f"{out}.svg",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env)
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, stderr.decode()
    text = stdout.decode()
    assert "TTFT ms p50/p90/p95/p99" in text and "vs" in text
    assert "sk-secret" not in text + stderr.decode() + Path(f"{out}.json").read_text()
    data = json.loads(Path(f"{out}.json").read_text())
    assert data["config"]["api_key_set"] is True
    assert [lv["output_tokens"]["p50"] for lv in data["levels"]] == [12] * 4
    assert len(data["comparisons"]) == 2
    assert len(list(csv.DictReader(Path(f"{out}.csv").read_text().splitlines()))) == 4
    ET.parse(f"{out}.svg")


def test_cli_usage_errors_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    base = ["bench", "--base-url", "http://127.0.0.1:9/v1", "--model", MODEL]
    assert main([*base, "--plot", str(tmp_path / "x.png")]) == 2
    assert ".svg or .html" in capsys.readouterr().err
    assert main([*base, "--slo", "speed=1"]) == 2
    assert main([*base, "--prompts", str(tmp_path / "none.jsonl")]) == 2
    assert main([*base, "--header", "novalue"]) == 2
    with pytest.raises(SystemExit) as exc:
        main([*base, "--concurrency", "0"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    help_text = capsys.readouterr().out
    for definition in (
        "time from sending the request to the first chunk with non-empty content",
        "every gap between consecutive content chunks",
        "(latency - TTFT) / (output tokens - 1)",
        "1 / TPOT",
        "ITL per token, as AIPerf reports",
        "1 when no measured request succeeded",
    ):
        assert definition in help_text


def test_progress_bar_draws_one_line_and_clears_it() -> None:
    out = io.StringIO()
    bar = ProgressBar(out, width=10)
    bar(Tick("mock c=1", 2, 3, 5, 10, 1, 0.5, None))
    bar(Tick("mock c=1", 2, 3, 6, 10, 1, 0.6, None))  # within 0.1 s of the last: skipped
    bar(Tick("mock c=1", 2, 3, 10, 10, 1, 0.9, None))  # the last one always drawn
    bar.close()
    text = out.getvalue()
    assert "level 2/3 mock c=1" in text
    assert "[#####.....] 5/10, 1 errors" in text and "6/10" not in text
    assert "[##########] 10/10" in text and text.endswith("\r\033[K")


def test_command_line_on_the_page_hides_secrets() -> None:
    argv = ["/x/proxy/__main__.py", "bench", "--base-url", "http://u:pw1@h:8080/v1",
            "--header", "Authorization: Bearer sk-1", "--header=X-Api-Key: sk-2",
            "--header", "x-mock-status: 500", "--model", "m"]
    shown = command_line(argv)
    assert "pw1" not in shown and "sk-1" not in shown and "sk-2" not in shown
    assert shown == ("tokenmeter bench --base-url 'http://u:<redacted>@h:8080/v1' --header "
                     "'Authorization: <redacted>' '--header=X-Api-Key: <redacted>' --header "
                     "'x-mock-status: 500' --model m")


def test_duration_progress_shows_elapsed_of_total_seconds() -> None:
    out = io.StringIO()
    bar = ProgressBar(out, width=10)
    bar(Tick("mock rate=4/s", 0, 4, 3, 0, 0, 0.2, 8.0))
    bar(Tick("mock rate=8/s", 3, 4, 17, 0, 2, 6.0, 8.0))
    text = out.getvalue()
    assert "warm-up mock rate=4/s" in text and "0.2/8 s, 3 requests" in text
    assert "level 3/4 mock rate=8/s" in text
    assert "[#######...] 6.0/8 s, 17 requests, 2 errors" in text


async def test_runner_reports_the_level_and_seconds_of_a_duration_run(
    aiohttp_server: ServerFactory,
) -> None:
    url = await mock_url(aiohttp_server, ttft_ms=0, tokens_per_second=0, output_tokens=4)
    ticks: list[Tick] = []
    cfg = config(url, concurrency=[1, 2], prompt_tokens=[8], requests=None, duration_s=0.2,
                 endpoints=[Endpoint(url, "a"), Endpoint(url, "b")], rounds=2)
    await run_bench(cfg, ticks.append)
    warm = [t for t in ticks if t.level == 0]
    measured = [t for t in ticks if t.level]
    assert warm and all(t.duration_s is None for t in warm)
    assert {t.level for t in measured} == {1, 2} and {t.levels for t in ticks} == {2}
    # Each level runs --duration per endpoint: 2 x 0.2 s in all, the total shown.
    assert {t.duration_s for t in measured} == {0.4} and {t.total for t in measured} == {0}
    assert all(t.elapsed_s >= 0 for t in measured)
    assert [t.level for t in measured] == sorted(t.level for t in measured)


async def test_duration_progress_counts_on_while_no_request_ends(
    aiohttp_server: ServerFactory,
) -> None:
    # One request that answers after 2 s in a 0.2 s level: the seconds are reported while it
    # is still out (nothing done yet), not only when it ends.
    url = await mock_url(aiohttp_server, ttft_ms=2000, tokens_per_second=0, output_tokens=2)
    ticks: list[Tick] = []
    await run_bench(config(url, concurrency=[1], prompt_tokens=[8], requests=None,
                           duration_s=0.2, warmup=0), ticks.append)
    waiting = [t for t in ticks if t.done == 0]
    assert waiting and all(t.level == 1 and t.duration_s == 0.2 for t in waiting)
    assert ticks[-1].done == 1


@pytest.mark.parametrize("broken", ["status", "unreachable"])
async def test_exit_status_1_when_no_request_succeeded(
    aiohttp_server: ServerFactory, tmp_path: Path, broken: str,
) -> None:
    if broken == "status":
        url = await mock_url(aiohttp_server)
        extra = ["--header", "x-mock-status: 500"]
    else:
        url, extra = f"http://127.0.0.1:{free_port()}/v1", []
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy.cli", "bench", "--base-url", url, "--model", MODEL,
        "--requests", "2", "--warmup", "0", "--prompt-tokens", "8", *extra,
        "--json", str(tmp_path / "r.json"),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 1, stderr.decode()
    assert "no request succeeded (2 sent, all failed" in stderr.decode()
    # The report is still written: it says why.
    (level,) = json.loads((tmp_path / "r.json").read_text())["levels"]
    assert (level["ok"], level["errors"]) == (0, 2)
    assert "errors:" in stdout.decode()


# --- --api anthropic: the Messages API ---------------------------------------------------------

ANTHROPIC = RequestSpec(model=MODEL, max_tokens=64, api=Api.ANTHROPIC)


async def test_anthropic_ttft_on_the_first_content_delta(aiohttp_server: ServerFactory) -> None:
    """The mock sends message_start at once and its first text_delta after ttft_ms: the TTFT is
    the delta's. Output tokens from message_delta's usage, the prompt with its cache parts."""
    url = await mock_url(aiohttp_server, ttft_ms=50, tokens_per_second=750, output_tokens=100)
    cache = {"x-mock-cache-read-tokens": "5", "x-mock-cache-creation-tokens": "3"}
    result = await run_bench(config(url, spec=ANTHROPIC, headers=cache, concurrency=[1],
                                    requests=4, prompt_tokens=[32], lag_warn_ms=1e9))
    (st,) = result.levels
    assert (st.ok, st.errors) == (4, 0)
    assert 0.049 <= st.ttft.p50 < 1.0
    assert 1 / 750 * 0.9 <= st.tpot.p50 < 0.1
    # max_tokens 64 of the mock's 100: what message_delta reports, and what arrived.
    assert st.output_tokens.min == st.output_tokens.max == 64
    assert st.usage_output_tokens == st.local_output_tokens == 4 * 64
    assert st.itl.n == 4 * 63
    # The whole prompt (the mock's count), though Anthropic's input_tokens leaves out the 8
    # cache tokens: the bench adds them back.
    framing = mock_tokens.count_anthropic({"messages": [{"role": "user", "content": ""}]})
    assert {r.usage_prompt_tokens for r in result.results} == {32 + framing}
    # Not streamed: TTFT is the whole answer's latency, the output the message's usage.
    spec = RequestSpec(model=MODEL, max_tokens=10, api=Api.ANTHROPIC, stream=False)
    (st,) = (await run_bench(config(url, spec=spec, requests=2, prompt_tokens=[8]))).levels
    assert (st.ok, st.output_tokens.p50, st.usage_diff_tokens) == (2, 10, 0)
    assert st.ttft.p50 == st.e2e.p50


async def test_anthropic_errors_and_cut_streams(aiohttp_server: ServerFactory) -> None:
    url = await mock_url(aiohttp_server, ttft_ms=0, tokens_per_second=0, output_tokens=16)
    for headers, cls in (({"x-mock-status": "529"}, "server_error"),
                         ({"x-mock-status": "429"}, "rate_limit"),
                         ({"x-mock-reset-after": "3"}, "stream_reset"),
                         ({"x-mock-end-after": "3"}, "incomplete")):
        result = await run_bench(config(url, spec=ANTHROPIC, headers=headers, requests=2,
                                        warmup=0))
        assert result.levels[0].errors_by_class == {cls: 2}, headers


async def test_anthropic_proxy_and_direct_interleaved(
    make_stack: StackFactory, upstream: TestServer
) -> None:
    """Through the proxy (its key as x-api-key, as the Anthropic SDKs send it) and direct."""
    users = {"alice": {"keys": [ALICE_KEY]}}
    stack = await make_stack(make_config(str(upstream.make_url("/v1")), store="memory",
                                         users=users, api="anthropic"))
    cfg = BenchConfig(
        endpoints=[Endpoint(stack.base_url, "proxy", ALICE_KEY),
                   Endpoint(stack.upstream_url, "direct")],
        spec=RequestSpec(model=MODEL, max_tokens=20, api=Api.ANTHROPIC), concurrency=[2],
        requests=8, prompt_tokens=[16], warmup=1, rounds=2)
    result = await run_bench(cfg)
    assert [(s.endpoint, s.ok, s.errors) for s in result.levels] == [
        ("proxy", 8, 0), ("direct", 8, 0)]
    assert all(s.output_tokens.p50 == 20 and s.usage_diff_tokens == 0 for s in result.levels)
    sent = [r for r in stack.mock.requests if r.path.endswith("/messages")]
    assert len(sent) == 18 and not any(ALICE_KEY in str(r.headers) for r in sent)
    await stack.settled(9)
    assert sample(await stack.metrics(), "tokenmeter_tokens_total", type="output",
                  user="alice") == 9 * 20


def test_cli_anthropic_needs_max_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["bench", "--base-url", "http://127.0.0.1:9/v1", "--model", MODEL]
    assert main([*base, "--api", "anthropic", "--max-tokens", "0"]) == 2
    assert "requires max_tokens" in capsys.readouterr().err


async def test_anthropic_thinking_is_content(aiohttp_server: ServerFactory) -> None:
    """TTFT on the first thinking delta: thinking deltas are content chunks (each gap an ITL
    sample), and the thinking is output (counted locally as the usage says)."""
    url = await mock_url(aiohttp_server, ttft_ms=0, tokens_per_second=0, output_tokens=12,
                         thinking_tokens=8)
    spec = RequestSpec(model=MODEL, max_tokens=64, api=Api.ANTHROPIC,
                       extra_body={"thinking": {"type": "enabled", "budget_tokens": 32}})
    (st,) = (await run_bench(config(url, spec=spec, requests=3, prompt_tokens=[8]))).levels
    assert (st.ok, st.output_tokens.p50) == (3, 8 + 12)
    assert st.usage_output_tokens == st.local_output_tokens == 3 * 20
    assert st.itl.n == 3 * 19
