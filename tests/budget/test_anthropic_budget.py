"""Budgets on the Anthropic Messages API, with the real `anthropic` SDK as the client: a stream
the client hangs up on and one the upstream resets are charged (ledger row, budget counters,
metrics), and a race of many requests over two replicas sharing one Redis spends no more than
the quota, in tokens or in dollars. Each test runs on the in-process store and on Redis."""

from __future__ import annotations

import asyncio
import os
import sqlite3
from collections.abc import Awaitable, Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import anthropic
import pytest
from aiohttp.test_utils import TestServer
from anthropic.types import MessageParam, Usage

from proxy.budget import limits as lim
from proxy.budget.store import ScopeKind
from proxy.ledger.schema import TABLE
from proxy.pipeline import services as st
from proxy.pipeline.relay import REQUEST_ID_HEADER
from proxy.server.app import create_app
from proxy.testing import mock_tokens
from proxy.testing.mock_upstream import MOCK_STATE, MockSettings, generated_text
from tests.helpers import (
    ALICE_KEY,
    UPSTREAM_KEY,
    ServerFactory,
    make_config,
    sample,
    scrape,
    settled,
    until,
)

MODEL = "mock-gpt"
LONG: list[MessageParam] = [{"role": "user", "content": " ".join(["tokens"] * 120)}]
SHORT: list[MessageParam] = [{"role": "user", "content": "count to three"}]
# USD per million tokens: cache writes above input, as Anthropic's are (1.25x and 2x).
PRICE = {"input": 3.0, "output": 15.0, "cached_input": 0.30, "cache_write_5m": 3.75,
         "cache_write_1h": 6.0}
# Reads 40, writes 30 (12 of them to the 1-hour cache): part of LONG's 127 prompt tokens.
CACHE = {"x-mock-cache-read-tokens": "40", "x-mock-cache-creation-tokens": "30",
         "x-mock-cache-creation-1h-tokens": "12"}
PROMPT = mock_tokens.count_anthropic({"messages": LONG})
TOKENS = "tokenmeter_tokens_total"


@pytest.fixture
def mock_settings() -> MockSettings:
    return MockSettings(tokens_per_second=0, ttft_ms=5, output_tokens=16)


Replicas = Callable[[dict[str, Any]], Awaitable[list[TestServer]]]


@pytest.fixture
def replicas(aiohttp_server: ServerFactory, upstream: TestServer, store_url: str) -> Replicas:
    """Proxies in front of the Anthropic-speaking mock: two sharing one budget through Redis,
    or one on the in-process store."""

    async def make(users: dict[str, Any]) -> list[TestServer]:
        config = make_config(str(upstream.make_url("/v1")), store=store_url, users=users,
                             api_key=UPSTREAM_KEY, api="anthropic",
                             extra={"prices": {"mock-*": PRICE}})
        count = 1 if store_url == "memory" else 2
        return [await aiohttp_server(create_app(config)) for _ in range(count)]

    return make


def client(proxy: TestServer) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=str(proxy.make_url("")).rstrip("/"),
                                    api_key=ALICE_KEY, max_retries=0)


def hand_cost(fresh: int, reads: int, writes_5m: int, writes_1h: int, output: int) -> int:
    """Nano-dollars at PRICE, computed here: USD per million x 1,000 per token."""
    return fresh * 3_000 + reads * 300 + writes_5m * 3_750 + writes_1h * 6_000 + output * 15_000


async def counters(proxy: TestServer) -> dict[str, int]:
    """alice's own calendar counters in the store, by window name."""
    budget = proxy.app[st.SERVICES].budget
    config = proxy.app[st.SERVICES].runtime.current.config
    windows = [w for w in lim.windows_at(config, "alice", budget.clock())
               if w.scope.kind is ScopeKind.USER]
    values = await budget.store.read([w.key for w in windows])
    return {str(w.name): v for w, v in zip(windows, values, strict=True)}


async def ledger_row(request_id: str) -> dict[str, Any]:
    """The request's ledger row (SQLite in the state dir), once written."""
    ledger = Path(os.environ["TOKENMETER_STATE_DIR"]) / "ledger.sqlite3"
    query = (f"SELECT input_tokens, output_tokens, cached_input_tokens, "
             f"cache_creation_input_tokens, token_source, error_class, cost_nanousd "
             f"FROM {TABLE} WHERE request_id = ?")

    def row() -> sqlite3.Row | None:
        if not ledger.exists():
            return None
        with closing(sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)) as db:
            db.row_factory = sqlite3.Row
            found: sqlite3.Row | None = db.execute(query, (request_id,)).fetchone()
        return found

    await until(lambda: row() is not None, deadline=20, every=0.05)
    found = row()
    assert found is not None
    return dict(found)


async def assert_charged_estimated(proxy: TestServer, request_id: str, error_class: str,
                                   min_output: int, max_output: int) -> None:
    """The cut stream's charge, the same in the ledger, the store and the metrics: the prompt
    as message_start reported it (cache split included), the output counted by the proxy."""
    await settled(proxy.app, 1)
    row = await ledger_row(request_id)
    output = row["output_tokens"]
    assert min_output <= output <= max_output
    assert row["token_source"] == "estimated"
    assert row["error_class"] == error_class
    assert (row["input_tokens"], row["cached_input_tokens"],
            row["cache_creation_input_tokens"]) == (PROMPT, 40, 30)
    cost = hand_cost(PROMPT - 70, 40, 18, 12, output)
    assert row["cost_nanousd"] == cost
    assert await counters(proxy) == {"daily_tokens": PROMPT + output, "daily_usd": cost,
                                     "daily_input_tokens": PROMPT, "daily_output_tokens": output}
    metrics = await scrape(proxy)
    for kind, value in (("input", PROMPT), ("output", output), ("cache_read_input", 40),
                        ("cache_creation_input", 30)):
        assert sample(metrics, TOKENS, type=kind, model=MODEL, user="alice",
                      source="estimated") == value
    assert sample(metrics, TOKENS, source="reported") == 0


async def test_a_client_hanging_up_mid_stream_is_charged(
    replicas: Replicas, upstream: TestServer
) -> None:
    users = {"alice": {"keys": [ALICE_KEY], "daily_tokens": 100_000, "daily_usd": 10}}
    proxy = (await replicas(users))[0]
    # A stream long enough to be cut: 400 tokens at 50 per second.
    slow = {"x-mock-tokens-per-second": "50", "x-mock-output-tokens": "400", **CACHE}
    text = ""
    # Leaving the block closes the response mid-stream: the SDK hangs up.
    async with client(proxy) as via, via.messages.stream(
        model=MODEL, max_tokens=400, messages=LONG, extra_headers=slow
    ) as stream:
        request_id = stream.response.headers[REQUEST_ID_HEADER]
        async for chunk in stream.text_stream:
            text += chunk
            if len(text) >= len(generated_text(3)):
                break
    assert text.startswith(generated_text(3))
    # The proxy closed its upstream request in turn: the mock stopped generating.
    received = upstream.app[MOCK_STATE].requests[-1]
    await asyncio.wait_for(received.closed.wait(), timeout=20)
    await assert_charged_estimated(proxy, request_id, "client_disconnect", 3, 399)


async def test_an_upstream_reset_mid_stream_is_charged(replicas: Replicas) -> None:
    users = {"alice": {"keys": [ALICE_KEY], "daily_tokens": 100_000, "daily_usd": 10}}
    proxy = (await replicas(users))[0]
    text = ""
    async with client(proxy) as via:
        with pytest.raises(anthropic.APIStatusError) as caught:
            async with via.messages.stream(
                model=MODEL, max_tokens=50, messages=LONG,
                extra_headers={"x-mock-reset-after": "5", **CACHE},
            ) as stream:
                request_id = stream.response.headers[REQUEST_ID_HEADER]
                async for chunk in stream.text_stream:
                    text += chunk
    assert text == generated_text(5)
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["error"]["type"] == "api_error"
    row_class = (await ledger_row(request_id))["error_class"]
    assert row_class not in ("none", "client_disconnect")
    # Exactly the 5 words the client got: the proxy counted what it forwarded.
    await assert_charged_estimated(proxy, request_id, row_class, 5, 5)


async def ask(via: anthropic.AsyncAnthropic, j: int, max_tokens: int,
              headers: dict[str, str]) -> Usage:
    """Request j: streamed two times in three, the usage as the SDK parsed it."""
    if j % 3 == 0:
        message = await via.messages.create(model=MODEL, max_tokens=max_tokens, messages=SHORT,
                                            extra_headers=headers)
        return message.usage
    async with via.messages.stream(model=MODEL, max_tokens=max_tokens, messages=SHORT,
                                   extra_headers=headers) as stream:
        return (await stream.get_final_message()).usage


@pytest.mark.parametrize("window", ["daily_tokens", "daily_usd"])
async def test_a_budget_race_over_replicas_overspends_nothing(
    replicas: Replicas, window: str
) -> None:
    """Many requests at once over the replicas: what is served never passes the quota, and the
    store's counter is exactly what the SDK was told was used. In dollars, every prompt token is
    a 1-hour cache write (twice the input price) and the output is its whole cap, so the
    reservation must price the prompt at the write price for the quota to hold."""
    prompt = mock_tokens.count_anthropic({"messages": SHORT})
    if window == "daily_tokens":
        limits: dict[str, Any] = {"daily_tokens": 1500}
        headers = {"x-mock-cache-read-tokens": "3", "x-mock-cache-creation-tokens": "2"}
        quota, max_tokens = 1500, 20
    else:
        limits = {"daily_usd": 0.01}
        headers = {"x-mock-cache-creation-tokens": str(prompt),
                   "x-mock-cache-creation-1h-tokens": str(prompt)}
        quota, max_tokens = 10_000_000, 16  # the mock's whole answer
    proxies = await replicas({"alice": {"keys": [ALICE_KEY], **limits}})
    clients = [client(p) for p in proxies]
    n = 160
    results = await asyncio.gather(
        *(ask(clients[j % len(clients)], j, max_tokens, headers) for j in range(n)),
        return_exceptions=True,
    )
    for c in clients:
        await c.close()
    served = [r for r in results if isinstance(r, Usage)]
    refused = [r for r in results if not isinstance(r, Usage)]
    assert served and refused, (len(served), len(refused))
    for exc in refused:
        assert isinstance(exc, anthropic.RateLimitError), repr(exc)
        assert isinstance(exc.body, dict)
        assert exc.body["error"]["type"] == "rate_limit_error"
        assert exc.response.headers["x-should-retry"] == "false"
    if window == "daily_tokens":
        spent = [u.input_tokens + (u.cache_creation_input_tokens or 0)
                 + (u.cache_read_input_tokens or 0) + u.output_tokens for u in served]
    else:
        assert {(u.input_tokens, u.cache_creation_input_tokens, u.output_tokens)
                for u in served} == {(0, prompt, 16)}
        spent = [hand_cost(0, 0, 0, prompt, 16)] * len(served)
    assert sum(spent) <= quota
    for p in proxies:
        assert sample(await scrape(p), "tokenmeter_store_errors_total") == 0
    # Every response has ended and settling precedes a response's end: the counter is exact.
    assert (await counters(proxies[0]))[window] == sum(spent)
