"""The `estimate` admission policy enforced by real proxies over loopback, driven by the real
openai SDK against the mock upstream: on the in-process store, and on a real redis-server shared
by two replicas."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from aiohttp.test_utils import TestServer

from proxy.budget import limits as lim
from proxy.budget.clamp import AdmissionRule
from proxy.config.policy import AdmissionPolicy, hash_key
from proxy.protocol.translators import ChatTranslator, parse_body
from proxy.server import state as st
from proxy.server.app import create_app
from proxy.testing.mock_upstream import MOCK_STATE, MockSettings
from tests.helpers import ALICE_KEY, MESSAGES, ServerFactory, make_config, sdk

QUOTA = 20_000
ASKED = 32_000


@pytest.fixture
def mock_settings() -> MockSettings:
    return MockSettings(tokens_per_second=0, ttft_ms=0, output_tokens=900)


Factory = Callable[..., Awaitable[list[TestServer]]]


@pytest.fixture
def make_proxies(aiohttp_server: ServerFactory, upstream: TestServer, store_url: str) -> Factory:
    """Two replicas sharing one budget through Redis; one on the in-process store."""

    async def make(users: dict[str, Any], **extra: Any) -> list[TestServer]:
        config = make_config(str(upstream.make_url("/v1")), store=store_url, users=users,
                             extra=extra)
        count = 1 if store_url == "memory" else 2
        return [await aiohttp_server(create_app(config)) for _ in range(count)]

    return make


def _alice(daily: int) -> dict[str, Any]:
    return {"alice": {"keys": [ALICE_KEY], "daily_tokens": daily, "max_output_tokens": 64_000,
                      "admission": {"policy": "clamp"}}}


def _estimate(proxies: list[TestServer], **rule: Any) -> None:
    """Put alice's key under `estimate` on every replica. (The YAML does not accept the policy
    yet; this sets what `admission: {policy: estimate}` resolves to.)"""
    for proxy in proxies:
        users = proxy.app[st.SERVICES].runtime.current.users
        by_hash = users._by_hash
        principal = by_hash[hash_key(ALICE_KEY)]
        by_hash[hash_key(ALICE_KEY)] = dataclasses.replace(
            principal, admission=AdmissionRule(AdmissionPolicy.ESTIMATE, **rule))


async def _daily_used(proxy: TestServer) -> int:
    budget = proxy.app[st.SERVICES].budget
    runtime = proxy.app[st.SERVICES].runtime.current
    key = lim.daily_key(
        runtime.config.store.prefix, "alice", "daily_tokens",
        datetime.fromtimestamp(budget.clock(), ZoneInfo("UTC")).strftime("%Y%m%d"),
    )
    (used,) = await budget.store.read([key])
    return used


def _prompt_estimate() -> int:
    body = {"model": "mock-gpt", "messages": MESSAGES}
    return ChatTranslator(parse_body(json.dumps(body).encode())).estimate_prompt_tokens()


async def test_non_streamed_request_falls_back_to_clamp(
    make_proxies: Factory, upstream: TestServer
) -> None:
    proxies = await make_proxies(_alice(QUOTA))
    _estimate(proxies)
    client = sdk(proxies[-1], ALICE_KEY)
    raw = await client.chat.completions.with_raw_response.create(
        model="mock-gpt", messages=MESSAGES, max_tokens=ASKED,
    )
    completion = raw.parse()
    granted = QUOTA - _prompt_estimate()
    assert raw.headers["x-tokenmeter-output-clamped"] == f"{ASKED}->{granted}"
    sent = upstream.app[MOCK_STATE].requests[-1].body
    assert sent is not None and sent["max_tokens"] == granted
    assert completion.usage is not None
    assert await _daily_used(proxies[0]) == completion.usage.total_tokens <= QUOTA
    await client.close()
