"""Shared fixtures: a real mock upstream and a real proxy, each on a loopback port.

Helpers that are not fixtures live in tests/helpers.py: no test module imports another."""

from __future__ import annotations

import logging
import os
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import asyncpg
import pytest
import redis
from aiohttp.test_utils import TestServer
from hypothesis import HealthCheck, settings

from proxy.config.load import Config
from proxy.server.app import create_app
from proxy.testing.mock_upstream import MockSettings, create_mock_app
from tests.helpers import (
    ProxiesFactory,
    ServerFactory,
    Stack,
    StackFactory,
    config_for,
    make_config,
)
from tests.servers import Cluster, RedisServer

# Hypothesis profiles, chosen by HYPOTHESIS_PROFILE (default "ci"). Both check every invariant
# after every example; they differ in how many examples and whether the run is reproducible.
# The property tests run real servers, so neither has a per-example deadline.
_PROPERTY_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large]
# ci: few enough examples for a 2-core CI box, derandomized so a failure reproduces anywhere.
settings.register_profile("ci", max_examples=300, deadline=None, derandomize=True,
                          suppress_health_check=_PROPERTY_HEALTH, print_blob=True)
# thorough: on demand (HYPOTHESIS_PROFILE=thorough), ten times the examples and a fresh random
# seed each run, so repeated runs explore new inputs.
settings.register_profile("thorough", max_examples=3000, deadline=None, derandomize=False,
                          suppress_health_check=_PROPERTY_HEALTH, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


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


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[Cluster]:
    """A Redis Cluster of three primaries, started once per test process (flush it: `flush`)."""
    # Six free ports are picked before six servers bind them: on a busy box (two xdist workers
    # starting servers of their own) one may be taken in between. Fresh ports, up to 3 times.
    for attempt in range(3):
        c = Cluster()
        try:
            c.start()
        except (subprocess.SubprocessError, OSError, AssertionError):
            c.stop()
            if attempt == 2:
                raise
            continue
        try:
            yield c
        finally:
            c.stop()
        return


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


SYSTEM_POSTGRES = "postgresql://postgres@127.0.0.1:5432"


@pytest.fixture
async def pg_url() -> AsyncIterator[str]:
    """A database of this test's own on the machine's PostgreSQL, dropped afterwards."""
    name = f"tm_test_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(f"{SYSTEM_POSTGRES}/postgres")
    try:
        await admin.execute(f"CREATE DATABASE {name}")
    finally:
        await admin.close()
    yield f"{SYSTEM_POSTGRES}/{name}"
    admin = await asyncpg.connect(f"{SYSTEM_POSTGRES}/postgres")
    try:
        await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    finally:
        await admin.close()


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
async def make_stack(
    aiohttp_server: ServerFactory, upstream: TestServer, caplog: pytest.LogCaptureFixture
) -> AsyncIterator[StackFactory]:
    """A proxy with the given config in front of `upstream` (for a module that needs a stack
    configured differently: ask for this under a fixture name of its own, never by overriding
    `proxy_config` half-way down a module, which would change the tests above it too)."""
    caplog.set_level(logging.INFO, logger="tokenmeter")
    made: list[Stack] = []

    async def make(config: Config) -> Stack:
        proxy = await aiohttp_server(create_app(config))
        made.append(Stack(proxy=proxy, upstream=upstream, caplog=caplog))
        return made[-1]

    yield make
    for s in made:
        for c in s.clients:
            await c.close()


@pytest.fixture
def make_proxies(aiohttp_server: ServerFactory, upstream: TestServer,
                 store_url: str) -> ProxiesFactory:
    """Replicas of one configuration in front of `upstream`: two sharing one budget through
    Redis, or one on the in-process store (`store_url` runs each test on both)."""

    async def make(users: dict[str, Any], **extra: Any) -> list[TestServer]:
        config = make_config(str(upstream.make_url("/v1")), store=store_url, users=users,
                             extra=extra)
        count = 1 if store_url == "memory" else 2
        return [await aiohttp_server(create_app(config)) for _ in range(count)]

    return make


@pytest.fixture
async def stack(make_stack: StackFactory, proxy_config: Config) -> Stack:
    return await make_stack(proxy_config)
