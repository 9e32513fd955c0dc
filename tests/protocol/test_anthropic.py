"""The Anthropic Messages API through the proxy, with the real `anthropic` SDK as the client."""

from __future__ import annotations

import os
import sqlite3
from collections.abc import AsyncIterator
from contextlib import closing
from pathlib import Path

import aiohttp
import anthropic
import pytest
from aiohttp.test_utils import TestServer
from anthropic.types import MessageParam, ThinkingConfigEnabledParam, ToolParam

from proxy.budget import limits as lim
from proxy.ledger.schema import TABLE
from proxy.pipeline import services as st
from proxy.pipeline.relay import REQUEST_ID_HEADER
from proxy.testing import mock_tokens
from proxy.testing.mock_upstream import generated_text
from tests.helpers import (
    ALICE_KEY,
    UPSTREAM_KEY,
    Stack,
    StackFactory,
    make_config,
    sample,
    until,
)

MESSAGES: list[MessageParam] = [{"role": "user", "content": "count to three"}]
MODEL = "mock-gpt"  # the label the test config lists: metrics name it rather than its route
CACHE = {"x-mock-cache-read-tokens": "7", "x-mock-cache-creation-tokens": "3"}


@pytest.fixture
async def stack(make_stack: StackFactory, upstream_url: str) -> Stack:
    users = {"alice": {"keys": [ALICE_KEY], "daily_tokens": 1000}}
    return await make_stack(make_config(upstream_url, store="memory", users=users,
                                        api_key=UPSTREAM_KEY, api="anthropic"))


@pytest.fixture
def upstream_url(upstream: TestServer) -> str:
    return str(upstream.make_url("/v1"))


def client(base: str, key: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=base.removesuffix("/v1"), api_key=key,
                                    max_retries=0)


@pytest.fixture
async def clients(stack: Stack) -> AsyncIterator[tuple[anthropic.AsyncAnthropic,
                                                       anthropic.AsyncAnthropic]]:
    via, direct = client(stack.base_url, ALICE_KEY), client(stack.upstream_url, "x")
    async with via, direct:
        yield via, direct


async def test_non_streamed_equals_direct(
    stack: Stack, clients: tuple[anthropic.AsyncAnthropic, anthropic.AsyncAnthropic]
) -> None:
    via, direct = clients
    through, plain = [
        await c.messages.create(model=MODEL, max_tokens=9, messages=MESSAGES, extra_headers=CACHE)
        for c in (via, direct)
    ]
    ignore = {"id"}
    assert through.model_dump(exclude=ignore) == plain.model_dump(exclude=ignore)
    assert through.content[0].type == "text" and through.content[0].text == generated_text(9)
    sent = stack.mock.requests[0].headers
    assert sent["x-api-key"] == UPSTREAM_KEY and "authorization" not in sent
    assert ALICE_KEY not in str(sent)
    await stack.settled(1)
    metrics = await stack.metrics()
    usage = through.usage
    prompt = usage.input_tokens + 3 + 7
    tokens = "tokenmeter_tokens_total"
    assert sample(metrics, tokens, type="input", model=MODEL, user="alice") == prompt
    assert sample(metrics, tokens, type="output", model=MODEL, user="alice") == 9
    assert sample(metrics, tokens, type="cached_input", model=MODEL, user="alice") == 7
    assert sample(metrics, tokens, type="cache_read_input", model=MODEL, user="alice") == 7
    assert sample(metrics, tokens, type="cache_creation_input", model=MODEL, user="alice") == 3


async def test_streamed_equals_direct(
    stack: Stack, clients: tuple[anthropic.AsyncAnthropic, anthropic.AsyncAnthropic]
) -> None:
    via, direct = clients
    finals = []
    for c in (via, direct):
        async with c.messages.stream(model=MODEL, max_tokens=12, messages=MESSAGES,
                                     extra_headers=CACHE) as stream:
            text = "".join([t async for t in stream.text_stream])
            final = await stream.get_final_message()
        assert text == generated_text(12)
        finals.append(final.model_dump(exclude={"id"}))
    assert finals[0] == finals[1]
    await stack.settled(1)
    metrics = await stack.metrics()
    usage = finals[0]["usage"]
    for kind, value in (("output", 12), ("cache_read_input", 7), ("cache_creation_input", 3),
                        ("input", usage["input_tokens"] + 10)):
        assert sample(metrics, "tokenmeter_tokens_total", type=kind, model=MODEL,
                      user="alice", source="reported") == value


async def test_budget_refusal_is_a_rate_limit_error(
    stack: Stack, clients: tuple[anthropic.AsyncAnthropic, anthropic.AsyncAnthropic]
) -> None:
    via, _ = clients
    with pytest.raises(anthropic.RateLimitError) as caught:
        await via.messages.create(model=MODEL, max_tokens=5000, messages=MESSAGES)
    assert caught.value.status_code == 429
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "rate_limit_error"
    assert not stack.mock.requests


async def test_errors_in_anthropic_shape(
    stack: Stack, clients: tuple[anthropic.AsyncAnthropic, anthropic.AsyncAnthropic]
) -> None:
    async with client(stack.base_url, "sk-wrong") as wrong:
        with pytest.raises(anthropic.AuthenticationError) as caught:
            await wrong.messages.create(model=MODEL, max_tokens=5, messages=MESSAGES)
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["error"]["type"] == "authentication_error"
    via, _ = clients
    # The SDK will not send a request without max_tokens; other clients may.
    async with aiohttp.ClientSession() as session, session.post(
        stack.proxy.make_url("/v1/messages"), json={"model": MODEL, "messages": MESSAGES},
        headers={"x-api-key": ALICE_KEY},
    ) as response:
        assert response.status == 400
        body = await response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    assert not stack.mock.requests
    # Upstream errors pass through as the upstream sent them.
    with pytest.raises(anthropic.APIStatusError) as up:
        await via.messages.create(model=MODEL, max_tokens=5, messages=MESSAGES,
                                  extra_headers={"x-mock-status": "529"})
    assert up.value.status_code == 529
    assert isinstance(up.value.body, dict)
    assert up.value.body["error"]["type"] == "overloaded_error"


async def test_x_api_key_authenticates(stack: Stack) -> None:
    async with anthropic.AsyncAnthropic(
        base_url=stack.base_url.removesuffix("/v1"), api_key=None, max_retries=0,
        default_headers={"x-api-key": ALICE_KEY},
    ) as c:
        message = await c.messages.create(model=MODEL, max_tokens=3, messages=MESSAGES)
    assert message.usage.output_tokens == 3
    assert stack.mock.requests[-1].headers["x-api-key"] == UPSTREAM_KEY


async def test_count_tokens_is_authenticated_and_free(
    stack: Stack, clients: tuple[anthropic.AsyncAnthropic, anthropic.AsyncAnthropic]
) -> None:
    via, direct = clients
    counted = await via.messages.count_tokens(model=MODEL, messages=MESSAGES)
    assert counted.input_tokens == (await direct.messages.count_tokens(
        model=MODEL, messages=MESSAGES)).input_tokens
    async with client(stack.base_url, "sk-wrong") as wrong:
        with pytest.raises(anthropic.AuthenticationError):
            await wrong.messages.count_tokens(model=MODEL, messages=MESSAGES)
    await stack.settled(1)
    metrics = await stack.metrics()
    assert not [k for k in metrics if k[0] == "tokenmeter_tokens_total"]


async def test_ledger_keeps_every_token_type(
    stack: Stack, clients: tuple[anthropic.AsyncAnthropic, anthropic.AsyncAnthropic]
) -> None:
    via, _ = clients
    headers = {"x-mock-cache-read-tokens": "17", "x-mock-cache-creation-tokens": "13"}
    async with via.messages.with_streaming_response.create(
        model=MODEL, max_tokens=6, messages=MESSAGES, stream=True, extra_headers=headers
    ) as response:
        request_id = response.headers[REQUEST_ID_HEADER]
        await response.read()
    found = await ledger_row(request_id, "input_tokens, output_tokens, cached_input_tokens, "
                             "cache_creation_input_tokens, token_source")
    # The mock takes the cache tokens out of its input_tokens (down to 0); the proxy's input is
    # the whole prompt: what it reported plus the cache writes and reads.
    fresh = max(0, mock_tokens.count_anthropic({"messages": MESSAGES}) - 30)
    assert found == (fresh + 30, 6, 17, 13, "reported")


async def ledger_row(request_id: str, columns: str) -> tuple[object, ...]:
    """The ledger's row of `request_id` (SQLite in the state dir), once it is written."""
    ledger = Path(os.environ["TOKENMETER_STATE_DIR"]) / "ledger.sqlite3"
    query = f"SELECT {columns} FROM {TABLE} WHERE request_id = ?"

    def row() -> tuple[object, ...] | None:
        if not ledger.exists():
            return None
        with closing(sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)) as db:
            found: tuple[object, ...] | None = db.execute(query, (request_id,)).fetchone()
        return found

    await until(lambda: row() is not None, deadline=20, every=0.05)
    found = row()
    assert found is not None
    return found


async def test_a_reset_mid_stream_is_charged_as_estimated(
    stack: Stack, clients: tuple[anthropic.AsyncAnthropic, anthropic.AsyncAnthropic]
) -> None:
    via, _ = clients
    text = ""
    # The proxy ends the stream with an `error` event in Anthropic's shape: the SDK raises it.
    with pytest.raises(anthropic.APIStatusError) as caught:
        async with via.messages.stream(
            model=MODEL, max_tokens=50, messages=MESSAGES,
            extra_headers={"x-mock-reset-after": "4", **CACHE},
        ) as stream:
            async for chunk in stream.text_stream:
                text += chunk
    assert text == generated_text(4)
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["error"]["type"] == "api_error"
    await stack.settled(1)
    metrics = await stack.metrics()
    tokens = "tokenmeter_tokens_total"
    # The prompt as message_start reported it; the output counted here (4 one-token words).
    fresh = max(0, mock_tokens.count_anthropic({"messages": MESSAGES}) - 10)
    assert sample(metrics, tokens, type="input", model=MODEL, user="alice",
                  source="estimated") == fresh + 10
    assert sample(metrics, tokens, type="output", model=MODEL, user="alice",
                  source="estimated") == 4
    assert sample(metrics, tokens, type="cache_read_input", model=MODEL, user="alice",
                  source="estimated") == 7


async def test_tool_use_equals_direct(
    stack: Stack, clients: tuple[anthropic.AsyncAnthropic, anthropic.AsyncAnthropic]
) -> None:
    tools: list[ToolParam] = [{"name": "search", "description": "Search the docs.",
                               "input_schema": {"type": "object",
                                                "properties": {"q": {"type": "string"}}}}]
    answers = []
    for c in clients:
        async with c.messages.stream(model=MODEL, max_tokens=20, messages=MESSAGES, tools=tools,
                                     tool_choice={"type": "tool", "name": "search"}) as stream:
            final = await stream.get_final_message()
        assert final.stop_reason == "tool_use"
        block = final.content[0]
        n = final.usage.output_tokens
        assert block.type == "tool_use" and block.input == {"q": generated_text(n)}
        answers.append(final.model_dump(exclude={"id"}))
        answers[-1]["content"][0].pop("id")
    assert answers[0] == answers[1]
    await stack.settled(1)
    metrics = await stack.metrics()
    # Content counted per input_json_delta; the output as the upstream reported it.
    assert sample(metrics, "tokenmeter_tokens_total", type="output", model=MODEL,
                  user="alice", source="reported") == answers[0]["usage"]["output_tokens"]


# Claude Sonnet 4's list prices, cache writes and reads included (USD per million tokens).
SONNET = {"input": 3.0, "output": 15.0, "cached_input": 0.30, "cache_write_5m": 3.75,
          "cache_write_1h": 6.0}
LONG: list[MessageParam] = [{"role": "user", "content": " ".join(["tokens"] * 120)}]


@pytest.fixture
async def priced(make_stack: StackFactory, upstream_url: str) -> Stack:
    users = {"alice": {"keys": [ALICE_KEY], "daily_usd": 100}}
    return await make_stack(make_config(upstream_url, store="memory", users=users,
                                        api_key=UPSTREAM_KEY, api="anthropic",
                                        extra={"prices": {"mock-*": SONNET}}))


async def cached_requests(stack: Stack) -> list[tuple[str, int]]:
    """A cached prompt (reads, 5-minute and 1-hour writes), non-streamed then streamed: each
    request's id and its cost in nano-dollars computed by hand from the usage the SDK parsed."""
    cache = {"x-mock-cache-read-tokens": "40", "x-mock-cache-creation-tokens": "30",
             "x-mock-cache-creation-1h-tokens": "12"}
    async with client(stack.base_url, ALICE_KEY) as via:
        async with via.messages.with_streaming_response.create(
            model=MODEL, max_tokens=9, messages=LONG, extra_headers=cache
        ) as raw:
            message = await raw.parse()
            ids = [raw.headers[REQUEST_ID_HEADER]]
        usages = [message.usage]
        async with via.messages.stream(model=MODEL, max_tokens=11, messages=LONG,
                                       extra_headers=cache) as stream:
            final = await stream.get_final_message()
            ids.append(stream.response.headers[REQUEST_ID_HEADER])
        usages.append(final.usage)
    assert [u.output_tokens for u in usages] == [9, 11]
    expected = []
    for usage in usages:
        assert usage.cache_creation is not None
        assert usage.cache_creation.ephemeral_1h_input_tokens == 12
        assert usage.cache_creation.ephemeral_5m_input_tokens == 18
        assert usage.cache_read_input_tokens == 40 and usage.input_tokens > 0
        # USD per million x 1,000 per token: fresh input, reads, 5-minute and 1-hour writes.
        expected.append(usage.input_tokens * 3_000 + 40 * 300 + 18 * 3_750 + 12 * 6_000
                        + usage.output_tokens * 15_000)
    await stack.settled(2)
    return list(zip(ids, expected, strict=True))


async def test_cached_prompt_cost_in_ledger_and_budget(priced: Stack) -> None:
    """Each row's cost and the day's cost counter are the figure computed by hand: every
    prompt token billed once, at its own price (no cache write also billed as input; streamed
    reads at the cache-read price)."""
    costs = await cached_requests(priced)
    for request_id, cost in costs:
        assert await ledger_row(request_id, "cost_nanousd, cache_creation_input_tokens") == (
            cost, 30)
    budget = priced.app[st.SERVICES].budget
    config = priced.app[st.SERVICES].runtime.current.config
    (window,) = [w for w in lim.windows_at(config, "alice", budget.clock())
                 if w.name == "daily_usd"]
    assert tuple(await budget.store.read([window.key])) == (sum(c for _, c in costs),)


THINKING: ThinkingConfigEnabledParam = {"type": "enabled", "budget_tokens": 10}


async def test_thinking_equals_direct(
    stack: Stack, clients: tuple[anthropic.AsyncAnthropic, anthropic.AsyncAnthropic]
) -> None:
    finals = []
    for c in clients:
        async with c.messages.stream(model=MODEL, max_tokens=30, messages=MESSAGES,
                                     thinking=THINKING) as stream:
            final = await stream.get_final_message()
        assert [b.type for b in final.content] == ["thinking", "text"]
        finals.append(final.model_dump(exclude={"id"}))
    assert finals[0] == finals[1]
    assert finals[0]["usage"]["output_tokens"] == 10 + 16  # thinking, then the mock's answer
    await stack.settled(1)
    assert sample(await stack.metrics(), "tokenmeter_tokens_total", type="output", model=MODEL,
                  user="alice", source="reported") == 26


async def test_ttft_on_the_first_thinking_delta(
    stack: Stack, clients: tuple[anthropic.AsyncAnthropic, anthropic.AsyncAnthropic]
) -> None:
    """A stream cut while it is still thinking has a first token (its first thinking delta)
    and its thinking as output, counted here."""
    via, _ = clients
    thought = ""
    with pytest.raises(anthropic.APIStatusError):
        async with via.messages.stream(model=MODEL, max_tokens=30, messages=MESSAGES,
                                       thinking=THINKING,
                                       extra_headers={"x-mock-reset-after": "5"}) as stream:
            request_id = stream.response.headers[REQUEST_ID_HEADER]
            async for event in stream:
                if event.type == "thinking":
                    thought += event.thinking
    assert thought == generated_text(5)
    ttft, output, source = await ledger_row(request_id, "ttft_ms, output_tokens, token_source")
    assert isinstance(ttft, float) and ttft > 0
    assert (output, source) == (5, "estimated")
    metrics = await stack.metrics()
    assert sample(metrics, "gen_ai_server_time_to_first_token_seconds_count", model=MODEL) == 1


async def test_cached_prompt_cost_in_metrics(priced: Stack) -> None:
    """tokenmeter_cost_usd agrees with the ledger: cache writes at their write prices."""
    costs = await cached_requests(priced)
    metrics = await priced.metrics()
    cost = "tokenmeter_cost_usd_total"
    assert sample(metrics, cost, model=MODEL, user="alice") == pytest.approx(
        sum(c for _, c in costs) / 1e9, rel=1e-12)
    for kind, usd in (("cache_write_1h", 2 * 12 * 6.0), ("cache_write_5m", 2 * 18 * 3.75),
                      ("cached_input", 2 * 40 * 0.30)):
        assert sample(metrics, cost, model=MODEL, user="alice", type=kind) == pytest.approx(
            usd / 1e6, rel=1e-12)
