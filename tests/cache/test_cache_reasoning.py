"""A cache entry of a reasoning model's answer keeps the reasoning: a hit replays the answer
that was stored, `reasoning_content` included, whatever form the entry and the hit take (a
stream stored as it came, or assembled and redacted into JSON). Through the whole proxy: the
openai SDK as the client, the simulated upstream as a reasoning model (DeepSeek's, vLLM's and
llama.cpp's `reasoning_content`)."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from aiohttp.test_utils import TestServer
from openai.types.chat import ChatCompletionMessageParam

from proxy.server.app import create_app
from proxy.testing.mock_settings import MOCK_STATE, MockSettings
from tests.helpers import ServerFactory, make_config

ALICE = "sk-alice-reasoning-001"
ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": "think, then answer"}]
THINKS = {"extra_headers": {"x-mock-reasoning-content-tokens": "6"}}


@pytest.fixture
def mock_settings() -> MockSettings:
    return MockSettings(tokens_per_second=0, ttft_ms=0, output_tokens=16)


async def _proxy(aiohttp_server: ServerFactory, upstream: TestServer,
                 **cache: Any) -> TestServer:
    config = make_config(str(upstream.make_url("/v1")), store="memory",
                         users={"alice": {"keys": [ALICE]}},
                         extra={"cache": {"enabled": True, **cache}})
    return await aiohttp_server(create_app(config))


def _reasoning(part: Any) -> str:
    return str((part.model_extra or {}).get("reasoning_content") or "")


async def _stream(client: openai.AsyncOpenAI) -> tuple[str, str, str]:
    """(reasoning, content, the cache header) of a streamed request."""
    raw = await client.chat.completions.with_raw_response.create(
        model="mock-gpt", messages=ASK, temperature=0, max_tokens=50, stream=True,
        **THINKS)  # type: ignore[call-overload]
    reasoning, content = "", ""
    async for chunk in raw.parse():
        for choice in chunk.choices:
            reasoning += _reasoning(choice.delta)
            content += choice.delta.content or ""
    return reasoning, content, raw.headers["x-tokenmeter-cache"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("redact", [[], ["sk-[A-Za-z0-9]{20,}"]], ids=["as-streamed", "redacted"])
async def test_a_hit_of_a_reasoning_models_stream_replays_its_reasoning(
    aiohttp_server: ServerFactory, upstream: TestServer, redact: list[str]
) -> None:
    proxy = await _proxy(aiohttp_server, upstream, redact=redact)
    client = openai.AsyncOpenAI(base_url=str(proxy.make_url("/v1")), api_key=ALICE,
                                max_retries=0)
    reasoning, content, cache = await _stream(client)
    assert cache == "miss" and reasoning and content
    # Streamed again: the stored stream replayed, its reasoning before its content.
    again = await _stream(client)
    assert again == (reasoning, content, "hit")
    # Asked as JSON: the message has the reasoning too.
    raw = await client.chat.completions.with_raw_response.create(
        model="mock-gpt", messages=ASK, temperature=0, max_tokens=50,
        **THINKS)  # type: ignore[call-overload]
    answer = raw.parse()
    assert raw.headers["x-tokenmeter-cache"] == "hit"
    assert _reasoning(answer.choices[0].message) == reasoning
    assert answer.choices[0].message.content == content
    assert len(upstream.app[MOCK_STATE].requests) == 1
