"""`tokenmeter usage`, and quota notices once per threshold per day (log, metric, webhook)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.cli import main
from proxy.config.load import load_config, parse_config
from proxy.server.app import create_app
from tests.helpers import (
    ALICE_KEY,
    BOB_KEY,
    MESSAGES,
    ServerFactory,
    budget_yaml,
    sample,
    scrape,
    sdk,
)


async def test_usage_command_reads_todays_counters(
    aiohttp_server: ServerFactory, upstream: TestServer, redis_url: str, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    users = f'  alice:\n    keys: ["{ALICE_KEY}"]\n    daily_tokens: 5000\n  bob:\n    keys: ["{BOB_KEY}"]\n'
    path = tmp_path / "tm.yaml"
    path.write_text(budget_yaml(str(upstream.make_url("/v1")), redis_url, users))
    proxy = await aiohttp_server(create_app(load_config(path)))
    total = 0
    for _ in range(3):
        r = await sdk(proxy, ALICE_KEY).chat.completions.create(model="mock-gpt", messages=MESSAGES)
        assert r.usage is not None
        total += r.usage.total_tokens
    assert await asyncio.to_thread(main, ["usage", "--config", str(path), "--json"]) == 0
    rows = {row["user"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["alice"]["tokens"] == total
    assert rows["alice"]["remaining"] == 5000 - total
    assert rows["bob"]["tokens"] == 0 and rows["bob"]["daily_limit"] is None
    assert await asyncio.to_thread(main, ["usage", "--config", str(path), "--date", "2020-01-01"]) == 0
    table = capsys.readouterr().out
    assert "alice" in table and "2020-01-01" in table


async def test_thresholds_notify_once_each(
    aiohttp_server: ServerFactory, upstream: TestServer,
) -> None:
    received: list[dict[str, Any]] = []
    arrived = asyncio.Event()

    async def hook(request: web.Request) -> web.Response:
        received.append(await request.json())
        arrived.set()
        return web.Response()

    hook_app = web.Application()
    hook_app.router.add_post("/hook", hook)
    hook_server = await aiohttp_server(hook_app)
    extra = f"alerts:\n  thresholds: [0.5, 1.0]\n  webhook_url: {hook_server.make_url('/hook')}\n"
    users = f'  alice:\n    keys: ["{ALICE_KEY}"]\n    daily_tokens: 100\n    max_output_tokens: 16\n'
    text = budget_yaml(str(upstream.make_url("/v1")), "memory", users, extra)
    proxy = await aiohttp_server(create_app(parse_config(text)))
    client = sdk(proxy, ALICE_KEY)
    for _ in range(3):  # 26 tokens each: 26, 52 (crosses 50%), 78
        await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
    await asyncio.wait_for(arrived.wait(), 5)
    assert [(e["threshold"], e["user"], e["window"]) for e in received] == [
        (0.5, "alice", "daily_tokens")
    ]
    m = await scrape(proxy)
    assert sample(m, "tokenmeter_budget_threshold_crossings_total", threshold="0.5") == 1
    assert sample(m, "tokenmeter_budget_threshold_crossings_total", threshold="1") == 0
    assert sample(m, "tokenmeter_budget_remaining_tokens", user="alice",
                  window="daily_tokens") == 100 - 78


async def test_cost_from_price_table(aiohttp_server: ServerFactory, upstream: TestServer) -> None:
    extra = 'prices:\n  "mock-*": {input: 2.5, cached_input: 1.25, output: 10}\n'
    users = f'  alice:\n    keys: ["{ALICE_KEY}"]\n'
    text = budget_yaml(str(upstream.make_url("/v1")), "memory", users, extra)
    proxy = await aiohttp_server(create_app(parse_config(text)))
    r = await sdk(proxy, ALICE_KEY).chat.completions.create(
        model="mock-gpt", messages=MESSAGES, extra_headers={"x-mock-cached-tokens": "4"},
    )
    assert r.usage is not None
    m = await scrape(proxy)

    def cost(kind: str) -> float:
        return sample(m, "tokenmeter_cost_usd_total", user="alice", type=kind)

    assert cost("input") == pytest.approx((r.usage.prompt_tokens - 4) * 2.5 / 1e6)
    assert cost("cached_input") == pytest.approx(4 * 1.25 / 1e6)
    assert cost("output") == pytest.approx(r.usage.completion_tokens * 10 / 1e6)
