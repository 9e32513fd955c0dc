"""The overview dashboard's token-type and cost-type panels on Anthropic traffic, their queries
run by a real Prometheus scraping a real proxy that the `anthropic` SDK calls with a cached
prompt (cache reads, 5-minute and 1-hour writes)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import anthropic
import pytest
from aiohttp.test_utils import TestServer
from anthropic.types import MessageParam

from proxy.cost import KINDS
from proxy.server.app import create_app
from tests.helpers import ROOT, UPSTREAM_KEY, ServerFactory, make_config
from tests.servers import running_prometheus

OVERVIEW = ROOT / "grafana" / "dashboards" / "tokenmeter-overview.json"
PRICE = {"input": 3.0, "output": 15.0, "cached_input": 0.30, "cache_write_5m": 3.75,
         "cache_write_1h": 6.0}
CACHE = {"x-mock-cache-read-tokens": "40", "x-mock-cache-creation-tokens": "30",
         "x-mock-cache-creation-1h-tokens": "12"}
PROMPT: list[MessageParam] = [{"role": "user", "content": " ".join(["tokens"] * 120)}]
# What the cost metric's `type` may be: the price each token paid (proxy.cost).
COST_TYPES = set(KINDS)


def panel_expr(title: str) -> str:
    """The panel's query as Grafana sends it with every variable at All."""
    dash = json.loads(OVERVIEW.read_text(encoding="utf-8"))
    (panel,) = [p for p in dash["panels"] if p.get("title") == title]
    (target,) = panel["targets"]
    expr = str(target["expr"]).replace("$__rate_interval", "1m")
    for name in ("instance", "model", "team", "user"):
        expr = expr.replace(f'=~"${name}"', '=~".*"')
    assert "$" not in expr, expr
    return expr


async def ask(client: anthropic.AsyncAnthropic, stream: bool) -> None:
    if not stream:
        await client.messages.create(model="mock-gpt", max_tokens=8, messages=PROMPT,
                                     extra_headers=CACHE)
        return
    async with client.messages.stream(model="mock-gpt", max_tokens=8, messages=PROMPT,
                                      extra_headers=CACHE) as s:
        await s.get_final_message()


async def test_token_and_cost_types(aiohttp_server: ServerFactory, upstream: TestServer,
                                    tmp_path: Path) -> None:
    config = make_config(str(upstream.make_url("/v1")), api_key=UPSTREAM_KEY, api="anthropic",
                         extra={"prices": {"mock-*": PRICE}})
    proxy = await aiohttp_server(create_app(config))
    scrape: dict[str, Any] = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "tokenmeter",
                            "static_configs": [{"targets": [f"127.0.0.1:{proxy.port}"]}]}],
    }
    async with running_prometheus(scrape, tmp_path) as prom, anthropic.AsyncAnthropic(
        base_url=str(proxy.make_url("")).rstrip("/"), api_key="x", max_retries=0
    ) as client:
        await prom.wait_for('up{job="tokenmeter"} == 1')
        # The first request creates the series; Prometheus must see them before the next ones
        # or every rate() would be 0 (a counter's first sample is not an increase).
        await ask(client, stream=True)
        await prom.wait_for('tokenmeter_tokens_total{type="cache_creation_input"} > 0')
        for i in range(3):
            await ask(client, stream=i % 2 == 0)
        await prom.wait_for('sum(tokenmeter_tokens_total{type="cache_creation_input"}) >= 120')
        await prom.wait_for('sum(rate(tokenmeter_tokens_total{type="cache_creation_input"}[1m]))'
                            ' > 0')
        # Both panels at one evaluation time: a rate moves as its window slides.
        at = f"{time.time():.3f}"
        answers = {}
        for title in ("Tokens per minute by type", "Estimated cost per hour by type"):
            body = await prom.api("/api/v1/query", query=panel_expr(title), time=at)
            assert body["status"] == "success", body
            answers[title] = {s["metric"]["type"]: float(s["value"][1])
                              for s in body["data"]["result"]}
    tokens = answers["Tokens per minute by type"]
    cost = answers["Estimated cost per hour by type"]
    assert set(tokens) == {"input", "output", "cached_input", "cache_read_input",
                           "cache_creation_input"}
    # Every series was born with the first request and grew by the same requests: their
    # rates are in the ratio of the per-request counts, 40 reads to 30 writes.
    assert tokens["cache_read_input"] / tokens["cache_creation_input"] == pytest.approx(40 / 30)
    assert tokens["cached_input"] == pytest.approx(tokens["cache_read_input"])
    # Cost by the price paid: the reads at the cache-read price, streamed or not.
    assert {"input", "cached_input", "output"} <= set(cost) <= COST_TYPES
    per_second_reads = tokens["cache_read_input"] / 60
    assert cost["cached_input"] / 3600 == pytest.approx(per_second_reads * 0.30 / 1e6)
