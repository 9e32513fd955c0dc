"""The `clamp` admission policy enforced by real proxies over loopback, driven by the real openai
SDK against the mock upstream (which honours max_tokens / max_completion_tokens): on the
in-process store, and on a real redis-server shared by two replicas."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo

import openai
import pytest
from aiohttp.test_utils import TestServer

from proxy.budget import limits as lim
from proxy.config.policy import Price
from proxy.cost import CostLines
from proxy.pipeline import services as st
from proxy.protocol.translators import ResponsesTranslator, parse_body
from proxy.protocol.usage import Usage
from proxy.testing.mock_upstream import MOCK_STATE, MockSettings
from tests.helpers import ALICE_KEY, MESSAGES, daily_used, prompt_estimate, sample, scrape, sdk
from tests.helpers import ProxiesFactory as Factory

QUOTA = 20_000
ASKED = 32_000


@pytest.fixture
def mock_settings() -> MockSettings:
    # An agent's answer: far shorter than the max_tokens it sends.
    return MockSettings(tokens_per_second=0, ttft_ms=0, output_tokens=900)




def _alice(policy: str, daily: int, **more: Any) -> dict[str, Any]:
    return {"alice": {"keys": [ALICE_KEY], "daily_tokens": daily, "max_output_tokens": 64_000,
                      "admission": {"policy": policy}, **more}}


async def test_agent_with_large_max_tokens_is_clamped_not_refused(
    make_proxies: Factory, upstream: TestServer
) -> None:
    proxies = await make_proxies(_alice("clamp", QUOTA))
    client = sdk(proxies[-1], ALICE_KEY)
    prompt = prompt_estimate()
    raw = await client.chat.completions.with_raw_response.create(
        model="mock-gpt", messages=MESSAGES, max_tokens=ASKED,
    )
    completion = raw.parse()
    assert completion.usage is not None and completion.usage.completion_tokens == 900
    granted = QUOTA - prompt
    assert raw.headers["x-tokenmeter-output-clamped"] == f"{ASKED}->{granted}"
    assert raw.headers["x-tokenmeter-clamp-reason"] == "daily_tokens"
    sent = upstream.app[MOCK_STATE].requests[-1].body
    assert sent is not None and sent["max_tokens"] == granted
    assert sent.get("max_completion_tokens", granted) == granted
    assert await daily_used(proxies[0]) == completion.usage.total_tokens <= QUOTA
    metrics = await scrape(proxies[-1])
    assert sample(metrics, "tokenmeter_budget_clamped_requests_total", user="alice",
                  window="daily_tokens") == 1
    assert sample(metrics, "tokenmeter_budget_clamped_tokens_total", user="alice") == (
        ASKED - granted)
    # Reserved and over-reserved are told apart by the policy that admitted the request.
    assert sample(metrics, "tokenmeter_budget_reserved_tokens_total", user="alice",
                  policy="clamp") == prompt + granted
    assert sample(metrics, "tokenmeter_budget_reserved_tokens_total", policy="worst_case") == 0
    # The answer that would run to the cap stops at it, with the upstream's own finish_reason,
    # and the day ends exactly at the quota, never past it.
    long = await client.chat.completions.with_raw_response.create(
        model="mock-gpt", messages=MESSAGES, max_tokens=ASKED,
        extra_headers={"x-mock-output-tokens": "50000"},
    )
    done = long.parse()
    left = QUOTA - completion.usage.total_tokens
    assert long.headers["x-tokenmeter-output-clamped"] == f"{ASKED}->{left - prompt}"
    assert done.choices[0].finish_reason == "length"
    assert await daily_used(proxies[0]) == QUOTA
    with pytest.raises(openai.RateLimitError) as refused:
        await client.chat.completions.create(model="mock-gpt", messages=MESSAGES,
                                             max_tokens=ASKED)
    assert refused.value.code == "daily_quota_exceeded"
    assert "at least" in refused.value.message
    await client.close()


async def test_worst_case_refuses_what_clamp_serves(make_proxies: Factory) -> None:
    proxies = await make_proxies(_alice("worst_case", QUOTA))
    client = sdk(proxies[-1], ALICE_KEY)
    with pytest.raises(openai.RateLimitError) as refused:
        await client.chat.completions.create(model="mock-gpt", messages=MESSAGES,
                                             max_tokens=ASKED)
    assert refused.value.status_code == 429
    assert refused.value.response.headers["x-should-retry"] == "false"
    assert "up to" in refused.value.message
    # What fits is served whole, unclamped, as before.
    raw = await client.chat.completions.with_raw_response.create(
        model="mock-gpt", messages=MESSAGES, max_tokens=1000,
    )
    assert "x-tokenmeter-output-clamped" not in raw.headers
    assert await daily_used(proxies[0]) <= QUOTA
    await client.close()


async def test_key_setting_wins_over_user_and_defaults(make_proxies: Factory) -> None:
    """defaults: clamp; the user: worst_case; the key: clamp with a large minimum."""
    users = {"alice": {"keys": [{"key": ALICE_KEY, "admission": {"min_output_tokens": 25_000}}],
                       "daily_tokens": QUOTA, "max_output_tokens": 64_000,
                       "admission": {"policy": "clamp"}}}
    proxies = await make_proxies(users, defaults={"admission": {"policy": "worst_case"}})
    client = sdk(proxies[-1], ALICE_KEY)
    # clamp (the user's), but the key's minimum does not fit the 20,000 left: refused.
    with pytest.raises(openai.RateLimitError) as refused:
        await client.chat.completions.create(model="mock-gpt", messages=MESSAGES,
                                             max_tokens=ASKED)
    assert "min_output_tokens" in refused.value.message
    await client.close()


async def test_a_minimum_larger_than_the_quota_is_never_admitted(make_proxies: Factory) -> None:
    proxies = await make_proxies(_alice("clamp", 200))
    client = sdk(proxies[-1], ALICE_KEY)
    with pytest.raises(openai.RateLimitError) as refused:
        await client.chat.completions.create(model="mock-gpt", messages=MESSAGES,
                                             max_tokens=ASKED)
    assert "its prompt plus min_output_tokens is larger" in refused.value.message
    # Asking for no more than fits is not clamping: served whole.
    raw = await client.chat.completions.with_raw_response.create(
        model="mock-gpt", messages=MESSAGES, max_tokens=100,
    )
    assert "x-tokenmeter-output-clamped" not in raw.headers
    await client.close()


async def _counter(proxy: TestServer, scope: str, field: str, team: str | None = None) -> int:
    """A counter of today for alice (`scope`: `u`) or her team (`t.<team>`)."""
    budget = proxy.app[st.SERVICES].budget
    prefix = proxy.app[st.SERVICES].runtime.current.config.store.prefix
    day = datetime.fromtimestamp(budget.clock(), ZoneInfo("UTC")).strftime("%Y%m%d")
    base = (lim.slot_for(prefix, "alice", team) if scope != "u"
            else lim.user_base(prefix, "alice", team))
    (value,) = await budget.store.read([f"{base}:{scope}:{field}:{day}"])
    return value


async def test_cost_budget_clamps_at_the_output_price(make_proxies: Factory) -> None:
    """$0.02 a day at $1/M input and $2/M output: room for (20,000,000 - 1,000 * prompt) /
    2,000 output tokens, and a long answer ends within the budget, never past it."""
    prices = {"mock-gpt": {"input": 1.0, "output": 2.0}}
    proxies = await make_proxies(
        {"alice": {"keys": [ALICE_KEY], "daily_usd": 0.02, "max_output_tokens": 64_000,
                   "admission": {"policy": "clamp"}}},
        prices=prices,
    )
    client = sdk(proxies[-1], ALICE_KEY)
    prompt = prompt_estimate()
    raw = await client.chat.completions.with_raw_response.create(
        model="mock-gpt", messages=MESSAGES, max_tokens=ASKED,
        extra_headers={"x-mock-output-tokens": "50000"},
    )
    granted = (20_000_000 - 1_000 * prompt) // 2_000
    assert raw.headers["x-tokenmeter-output-clamped"] == f"{ASKED}->{granted}"
    assert raw.headers["x-tokenmeter-clamp-reason"] == "daily_usd"
    usage = raw.parse().usage
    assert usage is not None and usage.completion_tokens == granted
    spent = CostLines.of(Price(input=1.0, output=2.0),
                         Usage(input_tokens=usage.prompt_tokens, output_tokens=granted)).nanousd
    assert await _counter(proxies[0], "u", "daily_usd") == spent <= 20_000_000
    await client.close()


async def test_team_window_clamps_a_responses_request(
    make_proxies: Factory, upstream: TestServer
) -> None:
    """The Responses API's `max_output_tokens`, lowered for a team's daily window; the header
    names the team's scope, and the answer ends `incomplete` at the granted cap."""
    users = {"alice": {"keys": [ALICE_KEY], "team": "platform", "max_output_tokens": 64_000}}
    proxies = await make_proxies(
        users, teams={"platform": {"daily_tokens": QUOTA, "admission": {"policy": "clamp"}}}
    )
    client = sdk(proxies[-1], ALICE_KEY)
    text = "count to three"
    body = {"model": "mock-gpt", "input": text}
    prompt = ResponsesTranslator(parse_body(json.dumps(body).encode())).estimate_prompt_tokens()
    raw = await client.responses.with_raw_response.create(
        model="mock-gpt", input=text, max_output_tokens=ASKED,
        extra_headers={"x-mock-output-tokens": "50000"},
    )
    granted = QUOTA - prompt
    assert raw.headers["x-tokenmeter-output-clamped"] == f"{ASKED}->{granted}"
    assert raw.headers["x-tokenmeter-clamp-reason"] == "daily_tokens; scope=t.platform"
    response = raw.parse()
    assert response.status == "incomplete"
    sent = upstream.app[MOCK_STATE].requests[-1].body
    assert sent is not None and sent["max_output_tokens"] == granted
    assert await _counter(proxies[0], "t.platform", "daily_tokens", "platform") == QUOTA
    await client.close()


async def _one_stream(client: openai.AsyncOpenAI, max_tokens: int) -> tuple[int, bool]:
    raw = await client.chat.completions.with_raw_response.create(
        model="mock-gpt", messages=MESSAGES, max_tokens=max_tokens, stream=True,
        stream_options={"include_usage": True},
        # A long answer: each stream produces every token it is granted.
        extra_headers={"x-mock-output-tokens": "50000"},
    )
    clamped = "x-tokenmeter-output-clamped" in raw.headers
    usage = None
    async for chunk in raw.parse():
        usage = chunk.usage or usage
    assert usage is not None
    return usage.total_tokens, clamped


async def test_race_for_the_last_tokens(
    make_proxies: Factory, upstream: TestServer
) -> None:
    """200 streams, each asking for 1,500 output tokens and producing as many as it is let,
    race across the replicas for the last 5,000 tokens under `clamp` (min_output_tokens 256).

    Reserve-then-clamp is one atomic step, first come, first served, and every admitted stream
    uses all it is granted, so the counter only grows: the first three get 1,500 (plus the
    prompt) each, the fourth the rest (clamped), and everyone after is refused. Asserted
    exactly: nothing over the quota; every refusal a 429 in OpenAI's shape; exactly one clamped
    answer; and no request refused while its own minimum fitted: after the race the room left
    is below the prompt estimate plus min_output_tokens (the counter never shrinks here, so the
    room each refused request saw was at most this)."""
    last = 5_000
    users = _alice("clamp", last)
    proxies = await make_proxies(users)
    prompt = prompt_estimate()
    clients = [sdk(p, ALICE_KEY) for p in proxies]
    results = await asyncio.gather(
        *(_one_stream(clients[i % len(clients)], 1_500) for i in range(200)),
        return_exceptions=True,
    )
    served = [r for r in results if isinstance(r, tuple)]
    refused = [r for r in results if not isinstance(r, tuple)]
    for exc in refused:
        assert isinstance(exc, openai.RateLimitError), repr(exc)
        assert exc.status_code == 429 and exc.code == "daily_quota_exceeded"
        assert exc.response.headers["x-should-retry"] == "false"
        body = exc.body
        assert isinstance(body, dict) and body["type"] == "insufficient_quota"
    used = sum(tokens for tokens, _ in served)
    assert used <= last
    assert await daily_used(proxies[0]) == used
    full = prompt + 1_500
    assert len(served) == last // full + 1
    assert [c for _, c in served].count(True) == 1
    assert refused and last - used < prompt + 256
    for p in proxies:
        assert sample(await scrape(p), "tokenmeter_store_errors_total") == 0
    assert len(upstream.app[MOCK_STATE].requests) == len(served)
    for c in clients:
        await c.close()


async def test_race_for_the_last_tokens_under_worst_case(
    make_proxies: Factory, upstream: TestServer
) -> None:
    """The same race under `worst_case`: a request is admitted only if its whole worst case
    (prompt + 1,500) fits. Asserted exactly: nothing over the quota; every refusal a 429 in
    OpenAI's shape; as many served as whole worst cases fit, none clamped; and no request refused
    while its own worst case fitted: the room left after the race is below one worst case."""
    last = 5_000
    proxies = await make_proxies(_alice("worst_case", last))
    prompt = prompt_estimate()
    clients = [sdk(p, ALICE_KEY) for p in proxies]
    results = await asyncio.gather(
        *(_one_stream(clients[i % len(clients)], 1_500) for i in range(200)),
        return_exceptions=True,
    )
    served = [r for r in results if isinstance(r, tuple)]
    refused = [r for r in results if not isinstance(r, tuple)]
    for exc in refused:
        assert isinstance(exc, openai.RateLimitError), repr(exc)
        assert exc.status_code == 429 and exc.code == "daily_quota_exceeded"
    used = sum(tokens for tokens, _ in served)
    assert used <= last and await daily_used(proxies[0]) == used
    assert len(served) == last // (prompt + 1_500)
    assert not any(clamped for _, clamped in served)
    assert last - used < prompt + 1_500
    for c in clients:
        await c.close()


