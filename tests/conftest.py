"""Shared fixtures: a real mock upstream and a real proxy, each on a loopback port."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import openai
import pytest
import redis
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families

from proxy import state as st
from proxy.app import create_app
from proxy.config import Config, parse_config
from proxy.mock_upstream import MOCK_STATE, MockSettings, MockState, create_mock_app
from tests.servers import RedisServer

ServerFactory = Callable[..., Coroutine[Any, Any, TestServer]]


@dataclass
class Stack:
    """A proxy in front of a mock upstream, with handles on both."""

    proxy: TestServer
    upstream: TestServer
    caplog: pytest.LogCaptureFixture
    clients: list[openai.AsyncOpenAI] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return str(self.proxy.make_url("/v1"))

    @property
    def upstream_url(self) -> str:
        return str(self.upstream.make_url("/v1"))

    @property
    def app(self) -> web.Application:
        return self.proxy.app

    @property
    def mock(self) -> MockState:
        return self.upstream.app[MOCK_STATE]

    def client(self, api_key: str = "sk-client-secret-1234", **kw: Any) -> openai.AsyncOpenAI:
        c = openai.AsyncOpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, **kw)
        self.clients.append(c)
        return c

    def direct(self, **kw: Any) -> openai.AsyncOpenAI:
        c = openai.AsyncOpenAI(base_url=self.upstream_url, api_key="x", max_retries=0, **kw)
        self.clients.append(c)
        return c

    async def settled(self, count: int) -> None:
        await self.app[st.SETTLING].wait_for(count)

    async def metrics(self) -> Samples:
        return await scrape(self.proxy)

    def access_lines(self) -> list[dict[str, Any]]:
        return [
            json.loads(r.getMessage())
            for r in self.caplog.records
            if r.name == "tokenmeter.access"
        ]


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(server: TestServer, headers: dict[str, str] | None = None) -> Samples:
    """Every sample of a proxy's /metrics over real HTTP, keyed by (name, sorted labels)."""
    async with aiohttp.ClientSession() as s, s.get(server.make_url("/metrics"),
                                                   headers=headers) as r:
        text = await r.text()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for smp in family.samples:
            out[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value
    return out


def sample(metrics: Samples, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for (n, lab), value in metrics.items():
        if n == name and all((k, v) in lab for k, v in labels.items()):
            total += value
    return total


def config_for(upstream_url: str, extra: str = "", **upstream_opts: Any) -> Config:
    opts = "".join(f"\n    {k}: {v}" for k, v in upstream_opts.items())
    text = f"""
upstreams:
  mock:
    base_url: {upstream_url}
    api_key: sk-upstream-secret-5678{opts}
models:
  - match: "mock-*"
    upstream: mock
  - match: "*"
    upstream: mock
metrics:
  model_labels: [mock-gpt]
  discover_models: false
{extra}
"""
    return parse_config(text, "test-config.yaml")


@pytest.fixture(autouse=True)
def _state_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's proxies keep their settlement spool in a directory of their own, so one
    test never adopts (and replays) what another test's proxy left owed."""
    monkeypatch.setenv("TOKENMETER_STATE_DIR", str(tmp_path_factory.mktemp("state")))


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    if redis_server.proc is None:  # a test stopped it
        redis_server.start()
    with redis.Redis.from_url(redis_server.url) as r:
        r.flushall()
    return redis_server.url


@pytest.fixture(params=["memory", "redis"])
def store_url(request: pytest.FixtureRequest) -> str:
    """Each budget test runs on the in-process store and on a real redis-server."""
    if request.param == "memory":
        return "memory"
    url: str = request.getfixturevalue("redis_url")
    return url


@pytest.fixture
def mock_settings() -> MockSettings:
    # Fast by default; tests that measure timing ask for their own pace.
    return MockSettings(tokens_per_second=0, ttft_ms=0, output_tokens=16)


@pytest.fixture
async def upstream(aiohttp_server: ServerFactory, mock_settings: MockSettings) -> TestServer:
    return await aiohttp_server(create_mock_app(mock_settings))


@pytest.fixture
def proxy_config(upstream: TestServer) -> Config:
    return config_for(str(upstream.make_url("/v1")))


@pytest.fixture
async def stack(
    aiohttp_server: ServerFactory,
    upstream: TestServer,
    proxy_config: Config,
    caplog: pytest.LogCaptureFixture,
) -> AsyncIterator[Stack]:
    caplog.set_level(logging.INFO, logger="tokenmeter")
    proxy = await aiohttp_server(create_app(proxy_config))
    s = Stack(proxy=proxy, upstream=upstream, caplog=caplog)
    yield s
    for c in s.clients:
        await c.close()
