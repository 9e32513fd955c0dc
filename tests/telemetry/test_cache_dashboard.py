"""The overview dashboard's Cache row (issue 23), its queries run by a real Prometheus scraping
the real metrics of settled requests: hits, misses, bypasses and requests the cache was not
consulted for, as settle records them (`Metrics.record_request` of a `RequestRecord`). The
served-proxy version of this comes with the cache core (the hits then come from real SDK
requests); the panels and the metrics are the same.

Also: a hit's latency stays out of the upstream's panels (the TTFT p95 is the misses' alone).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.config.policy import Price
from proxy.cost import CostLines
from proxy.errors import ErrorClass
from proxy.protocol.usage import ZERO, Usage
from proxy.record import CacheResult, Figures, RequestRecord
from proxy.telemetry.metrics import Metrics
from tests.helpers import ROOT, ServerFactory
from tests.servers import running_prometheus

OVERVIEW = ROOT / "grafana" / "dashboards" / "tokenmeter-overview.json"
PRICE = Price(input=2.5, output=10.0, cached_input=1.25)
SAVED = Usage(input_tokens=1200, output_tokens=300, cached_input_tokens=200)
USED = Usage(input_tokens=1200, output_tokens=300)
HIT_TTFT = 0.004  # in TTFT_BUCKETS' (0.003, 0.005]
UPSTREAM_TTFT = 0.8  # in (0.75, 1.0]


def panel_expr(title: str) -> str:
    """The Cache row panel's query as Grafana sends it with every variable at All."""
    dash = json.loads(OVERVIEW.read_text(encoding="utf-8"))
    (panel,) = [p for p in dash["panels"] if p.get("title") == title]
    (target,) = panel["targets"]
    expr = str(target["expr"]).replace("$__rate_interval", "1m").replace("$__range", "1h")
    for name in ("instance", "model", "team", "user"):
        expr = expr.replace(f'=~"${name}"', '=~".*"')
    assert "$" not in expr, expr
    return expr


def record(result: CacheResult, n: int) -> RequestRecord:
    hit = result is CacheResult.HIT
    usage = ZERO if hit else USED
    ttft = HIT_TTFT if hit else UPSTREAM_TTFT
    figures = Figures(duration=ttft + 0.01, overhead=None if hit else 0.001, ttft=ttft,
                      upstream_ttft=None if hit else ttft - 0.001,
                      time_per_output_token=None, output_tokens_per_second=None,
                      content_chunks=3, mean_inter_chunk=None)
    return RequestRecord(
        request_id=f"r{n}", operation="chat", requested_model="mock-gpt",
        sent_model=None if hit else "mock-gpt", model_label="mock-gpt",
        upstream=None if hit else "mock", user="alice", key=None, team=None, status=200,
        error_class=ErrorClass.NONE, stream=True, usage=usage, figures=figures,
        fallback_from=None, response_model=None, attempts=0 if hit else 1,
        cost=CostLines.of(PRICE, usage), price_version="p1", windows="", ended_at=time.time(),
        cache=result, saved_usage=SAVED if hit else ZERO,
        saved_cost=CostLines.of(PRICE, SAVED) if hit else None)


# Per round: 3 hits, 1 miss, 1 bypass, 2 requests the cache was not consulted for.
ROUND = (*[CacheResult.HIT] * 3, CacheResult.MISS, CacheResult.BYPASS, *[CacheResult.NONE] * 2)


def a_round(metrics: Metrics, start: int) -> None:
    for i, result in enumerate(ROUND):
        metrics.record_request(record(result, start + i), [0] * 40)


async def test_the_cache_row_against_real_prometheus(aiohttp_server: ServerFactory,
                                                     tmp_path: Path) -> None:
    metrics = Metrics()

    async def exposition(_: web.Request) -> web.Response:
        return web.Response(body=metrics.exposition(), content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", exposition)
    server: TestServer = await aiohttp_server(app)
    scrape: dict[str, Any] = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "tokenmeter",
                            "static_configs": [{"targets": [f"127.0.0.1:{server.port}"]}]}],
    }
    async with running_prometheus(scrape, tmp_path) as prom:
        await prom.wait_for('up{job="tokenmeter"} == 1')
        # The first round creates the series; Prometheus must see them before the next ones or
        # every rate() would be 0 (a counter's first sample is not an increase).
        a_round(metrics, 0)
        await prom.wait_for('tokenmeter_cache_requests_total{result="hit"} == 3')
        for r in range(1, 4):
            a_round(metrics, r * 100)
        await prom.wait_for('sum(tokenmeter_cache_requests_total{result="hit"}) >= 12')
        await prom.wait_for('sum(rate(tokenmeter_cache_hit_ttft_seconds_count[1m])) > 0')
        await prom.wait_for('sum(rate(gen_ai_server_time_to_first_token_seconds_count[1m])) > 0')
        # Every panel at one evaluation time: a rate moves as its window slides.
        at = f"{time.time():.3f}"
        answers: dict[str, list[dict[str, Any]]] = {}
        for title in ("Cache hit ratio", "Tokens saved per minute by type",
                      "Dollars saved (time range)", "Tokens saved (time range)",
                      "Cache hits / s", "Cache hit TTFT p95", "TTFT p95"):
            body = await prom.api("/api/v1/query", query=panel_expr(title), time=at)
            assert body["status"] == "success", body
            answers[title] = body["data"]["result"]

    def one(title: str) -> float:
        (series,) = answers[title]
        return float(series["value"][1])

    # Hits over all requests: 3 of 7 (bypasses and requests the cache does not apply to are
    # traffic it did not answer).
    assert one("Cache hit ratio") == pytest.approx(3 / 7)
    saved = {s["metric"]["type"]: float(s["value"][1])
             for s in answers["Tokens saved per minute by type"]}
    assert set(saved) == {"input", "output", "cached_input"}
    assert saved["input"] / saved["output"] == pytest.approx(1200 / 300)
    assert saved["cached_input"] / saved["input"] == pytest.approx(200 / 1200)
    # Dollars over tokens saved: every hit saved the same usage, so the two (extrapolated
    # alike) are in the ratio of one hit's cost to its tokens.
    per_hit = CostLines.of(PRICE, SAVED).nanousd / 1e9
    assert one("Dollars saved (time range)") / one("Tokens saved (time range)") == (
        pytest.approx(per_hit / SAVED.total_tokens))
    assert one("Cache hits / s") > 0
    # A hit's TTFT is in its own series; the upstream TTFT panel sees only the misses and
    # bypasses (their bucket is (0.75, 1.0]; a hit's would pull the p95 under 5 ms).
    assert 0.003 < one("Cache hit TTFT p95") <= 0.005
    assert 0.75 < one("TTFT p95") <= 1.0

