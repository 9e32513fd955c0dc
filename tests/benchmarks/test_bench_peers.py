"""benchmarks/bench_peers.py's arithmetic and table, without starting any gateway: the figures
the README quotes are added TTFT over direct, CPU ratios to bare and tokens/s ratios to direct,
and a gateway that could not start shows why instead of figures."""

from __future__ import annotations

from typing import Any

import pytest

from tests.bench_modules import load_bench

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def peers() -> Any:
    return load_bench("bench_peers")


def batches(peers: Any, cpu_s: float, ttft_ms: float, tokens_per_s: float,
            redis_s: float = 0.0) -> dict[str, list[Any]]:
    """Two batches of every phase: 10 requests each, TTFTs ttft_ms and ttft_ms + 10."""
    def s(ttft: list[float]) -> Any:
        return peers.Sample(ok=10, errors=[], cpu_s=cpu_s, wall_s=1.0,
                            ttft_s=[t / 1000 for t in ttft], window_tokens=int(tokens_per_s),
                            window_s=1.0, redis_cpu_s=redis_s)
    ttfts = [ttft_ms] * 5 + [ttft_ms + 10] * 5
    return {"small": [s([]), s([])], "c1": [s(ttfts), s(ttfts)], "c16": [s(ttfts), s(ttfts)],
            "c64": [s([]), s([])]}


def test_summary_takes_added_ttft_from_direct_and_cpu_ratios_from_bare(peers: Any) -> None:
    summary = peers.summarize({
        "direct": batches(peers, 0.0, 20.0, 1000.0),
        "bare": batches(peers, 0.004, 21.0, 950.0),
        "tokenmeter+budgets": batches(peers, 0.010, 22.5, 800.0, redis_s=0.002),
    }, {"litellm+budgets": "no database here"})

    tm = summary["tokenmeter+budgets"]
    assert tm["cpu_ms_small"] == pytest.approx(1.0)  # 2 x 10 ms over 20 requests
    assert tm["cpu_ms_small_x_bare"] == pytest.approx(2.5)
    assert tm["added_ttft_p50_c16"] == pytest.approx(2.5)
    assert tm["added_ttft_p99_c1"] == pytest.approx(2.5)
    assert tm["tokens_per_s_c64_x_direct"] == pytest.approx(0.8)
    assert tm["redis_cpu_ms_small"] == pytest.approx(0.2)
    assert summary["bare"]["redis_cpu_ms_small"] is None
    assert summary["direct"]["cpu_ms_small"] is None  # the mock's CPU is nobody's overhead
    assert summary["direct"]["added_ttft_p50_c1"] is None
    assert summary["litellm+budgets"] == {"skipped": "no database here"}


def test_table_has_a_row_per_gateway_and_the_reason_for_one_that_did_not_run(peers: Any) -> None:
    summary = peers.summarize({
        "direct": batches(peers, 0.0, 20.0, 1000.0),
        "bare": batches(peers, 0.004, 21.0, 950.0),
    }, {"litellm+budgets": "no database here"})
    lines = peers.markdown_table(summary, {"bare": "bare aiohttp"}).splitlines()

    assert len(lines) == 2 + 3
    widths = {line.count("|") for line in lines}
    assert widths == {len(peers.COLUMNS) + 3}, lines  # every row has every column
    bare = lines[3].split(" | ")
    assert bare[0] == "| bare aiohttp"
    assert bare[1] == "0.400 (1.00x)"
    assert bare[3] == "+1.00"
    assert bare[7] == "950 (0.95x)"
    assert lines[2].split(" | ")[1] == "-"  # direct: no gateway CPU
    assert "not run: no database here" in lines[4]


def test_failure_reason_names_no_address_and_drops_colour(peers: Any) -> None:
    log = ("\x1b[1;31mLiteLLM Proxy: Database migration cannot proceed.\nPrisma error:\n"
           "Error: request to https://example.invalid/engine.gz failed, reason: getaddrinfo "
           "ENOTFOUND example.invalid\x1b[0m\n")
    reason = peers.failure_reason(log)
    assert "Prisma" in reason
    assert "example.invalid" not in reason
    assert peers.failure_reason("boot\nValueError: bad port http://127.0.0.1:1/x\n") == (
        "ValueError: bad port <url>")
