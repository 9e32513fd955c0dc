"""In-flight cache fills are bounded in total, per process (issue 31, item 7): past
`cache.fills_mb`, an answer on its way keeps nothing for its entry and is not stored (counted
in `tokenmeter_cache_errors_total{stage="bound"}`); what a fill held is given back when its
request ends. The proxy over loopback, the simulated upstream, the openai SDK and a raw aiohttp
client holding a stream in flight."""

from __future__ import annotations

from typing import Any

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestServer

from proxy.pipeline.services import SERVICES
from proxy.server.app import create_app
from proxy.testing.mock_settings import MOCK_STATE, MockSettings
from tests.helpers import ServerFactory, make_config, sample, scrape, until

ALICE = "sk-alice-fill-bound-01"
# Some 265 bytes of events per token: a stream of 40 tokens is some 11 KB, two are over 16 KB.
BOUND_MB = 16 / 1024


@pytest.fixture
def mock_settings() -> MockSettings:
    return MockSettings(tokens_per_second=0, ttft_ms=0, output_tokens=40)


async def _stream(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, str]:
    raw = await client.chat.completions.with_raw_response.create(
        model="mock-gpt", messages=[{"role": "user", "content": prompt}], temperature=0,
        max_tokens=100, stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in raw.parse() if c.choices])
    return raw.headers["x-tokenmeter-cache"], text


@pytest.mark.timeout(60)
async def test_fills_past_the_process_bound_are_not_stored(
    aiohttp_server: ServerFactory, upstream: TestServer
) -> None:
    config = make_config(str(upstream.make_url("/v1")), store="memory",
                         users={"alice": {"keys": [ALICE]}},
                         extra={"cache": {"enabled": True, "fills_mb": BOUND_MB}})
    proxy = await aiohttp_server(create_app(config))
    cache = proxy.app[SERVICES].cache
    assert cache is not None
    client = openai.AsyncOpenAI(base_url=str(proxy.make_url("/v1")), api_key=ALICE,
                                max_retries=0)
    body: dict[str, Any] = {"model": "mock-gpt", "temperature": 0, "max_tokens": 100,
                            "stream": True, "messages": [{"role": "user", "content": "held"}]}
    async with aiohttp.ClientSession() as s, s.post(
        proxy.make_url("/v1/chat/completions"),
        headers={"Authorization": f"Bearer {ALICE}", "x-mock-stall-after": "39"}, json=body,
    ) as held:
        # A fill in flight: 39 tokens of its stream kept, its upstream silent after them.
        await until(lambda: len(upstream.app[MOCK_STATE].requests) == 1)
        await until(lambda: cache.fill_bytes.held > 8 * 1024)
        first = await _stream(client, "second")  # alone it fits; with the one held, not
        assert first[0] == "miss"
        assert sample(await scrape(proxy), "tokenmeter_cache_errors_total", stage="bound") == 1
        assert await _stream(client, "second") == first  # not stored: a miss again
        assert len(upstream.app[MOCK_STATE].requests) == 3
        held.close()
    # The held stream's request ends: what its fill held is given back, and fills keep again.
    await until(lambda: cache.fill_bytes.held == 0)
    assert (await _stream(client, "second"))[0] == "miss"
    assert await _stream(client, "second") == ("hit", first[1])
    assert len(upstream.app[MOCK_STATE].requests) == 4
