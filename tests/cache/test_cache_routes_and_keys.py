"""Whose entry a request reads (issue 31, item 16): a cache override for a key applies to that
one key (`user/name`, or its id), not to every user's key of that name; and the cache key names
the upstream the model is routed to, so after a reload routes the model elsewhere the old
upstream's answers are not served. The proxy over loopback, two simulated upstreams, the
openai SDK."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from aiohttp.test_utils import TestServer

from proxy.config.load import Config
from proxy.pipeline.services import SERVICES
from proxy.server.app import build_runtime, create_app
from proxy.testing.mock_settings import MOCK_STATE, MockSettings
from proxy.testing.mock_upstream import create_mock_app
from tests.helpers import FAST_RETRY, ServerFactory, make_config

ALICE_CI = "sk-alice-ci-key-00001"
BOB_CI = "sk-bob-ci-key-000001"
USERS = {"alice": {"keys": [{"key": ALICE_CI, "name": "ci"}]},
         "bob": {"keys": [{"key": BOB_CI, "name": "ci"}]}}


async def _chat(proxy: TestServer, key: str = ALICE_CI) -> tuple[Any, str | None]:
    client = openai.AsyncOpenAI(base_url=str(proxy.make_url("/v1")), api_key=key,
                                max_retries=0)
    raw = await client.chat.completions.with_raw_response.create(
        model="mock-gpt", messages=[{"role": "user", "content": "hi"}], temperature=0,
        max_tokens=50)
    return raw.parse(), raw.headers.get("x-tokenmeter-cache")


@pytest.mark.timeout(60)
async def test_a_key_override_by_user_and_name_is_that_keys_alone(
    aiohttp_server: ServerFactory, upstream: TestServer
) -> None:
    url = str(upstream.make_url("/v1"))
    config = make_config(url, store="memory", users=USERS, extra={
        "cache": {"enabled": True, "keys": {"alice/ci": {"enabled": False}}}})
    proxy = await aiohttp_server(create_app(config))
    for _ in range(2):
        assert (await _chat(proxy))[1] is None  # alice's ci key: not cached
    assert [(await _chat(proxy, BOB_CI))[1] for _ in range(2)] == ["miss", "hit"]
    # An older config's bare name still names the one key of that name, and is refused when
    # two users have one.
    alone = make_config(url, store="memory", users={"alice": USERS["alice"]},
                        extra={"cache": {"enabled": True, "keys": {"ci": {"enabled": False}}}})
    assert alone.cache.keys["ci"].enabled is False
    with pytest.raises(ValueError, match="write `alice/ci`"):
        make_config(url, store="memory", users=USERS,
                    extra={"cache": {"enabled": True, "keys": {"ci": {"enabled": False}}}})


def _routed(a: TestServer, b: TestServer, to: str) -> Config:
    upstreams = {name: {"base_url": str(s.make_url("/v1")), "retry": dict(FAST_RETRY)}
                 for name, s in (("a", a), ("b", b))}
    return make_config(str(a.make_url("/v1")), store="memory", users=USERS, extra={
        "upstreams": upstreams, "models": [{"match": "*", "upstream": to}],
        "cache": {"enabled": True}})


@pytest.mark.timeout(60)
async def test_after_a_reload_reroutes_a_model_the_old_upstreams_answers_are_not_served(
    aiohttp_server: ServerFactory
) -> None:
    a = await aiohttp_server(create_mock_app(MockSettings(ttft_ms=0, output_tokens=10)))
    b = await aiohttp_server(create_mock_app(MockSettings(ttft_ms=0, output_tokens=20)))
    proxy = await aiohttp_server(create_app(_routed(a, b, "a")))
    first, result = await _chat(proxy)
    assert (result, first.usage.completion_tokens) == ("miss", 10)
    assert (await _chat(proxy))[1] == "hit"
    proxy.app[SERVICES].runtime.current = build_runtime(_routed(a, b, "b"))
    moved, result = await _chat(proxy)
    assert (result, moved.usage.completion_tokens) == ("miss", 20)
    again, result = await _chat(proxy)
    assert (result, again.usage.completion_tokens) == ("hit", 20)
    assert [len(s.app[MOCK_STATE].requests) for s in (a, b)] == [1, 1]
