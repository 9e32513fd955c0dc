"""What the tests share that is not a fixture: keys, clients, config builders, metric scraping,
and reads and polls that always end (a deadline, and EOF is a failure, not a spin)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import re
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import openai
import pytest
import redis.asyncio as aioredis
import yaml
from aiohttp import web
from aiohttp.test_utils import TestServer
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families
from redis.typing import KeyT

from proxy.budget.limits import daily_key
from proxy.cli import main
from proxy.config.load import Config, parse_config
from proxy.pipeline import services as st
from proxy.protocol.translators import ChatTranslator, parse_body
from proxy.testing.mock_upstream import MOCK_STATE, MockState

ROOT = Path(__file__).resolve().parents[1]  # the repository: deploy/, grafana/, config/, docs/

ServerFactory = Callable[..., Coroutine[Any, Any, TestServer]]

ALICE_KEY = "sk-alice-0123456789"
BOB_KEY = "sk-bob-0123456789"
CI_KEY = "sk-alice-ci-0123456789"
CLIENT_KEY = "sk-client-secret-1234"
UPSTREAM_KEY = "sk-upstream-secret-5678"
# Typed as the SDK's message params, so `create(..., stream=True)` picks its streaming overload.
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "count to three"}]


def sdk(server: TestServer, key: str = CLIENT_KEY) -> openai.AsyncOpenAI:
    """The real OpenAI SDK pointed at `server`, without its own retries (tests count requests)."""
    return openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key=key, max_retries=0)


class FakeClock:
    """A wall clock the test moves by hand (`clock.now += 60`)."""

    def __init__(self, when: datetime | float) -> None:
        self.now = when.timestamp() if isinstance(when, datetime) else float(when)

    def __call__(self) -> float:
        return self.now


# --- configuration ------------------------------------------------------------------------------

# The whole test (client, proxies, mock) shares one event loop on a 2-core box: give the store
# room, so budget tests measure atomicity, not timeouts (test_store_failures does those).
STORE_DEFAULTS: Mapping[str, Any] = {"lease_seconds": 30, "timeout_ms": 5000}
# Retries are the subject of their own tests; elsewhere a 5xx should not wait out real backoff.
FAST_RETRY: Mapping[str, Any] = {"initial_backoff_ms": 1, "max_backoff_ms": 5}


def config_data(
    upstream_url: str,
    *,
    store: str | Mapping[str, Any] | None = None,
    users: Mapping[str, Mapping[str, Any]] | None = None,
    api_key: str | None = None,
    extra: Mapping[str, Any] | None = None,
    **upstream_opts: Any,
) -> dict[str, Any]:
    """The tests' one config builder: one upstream `mock` at `upstream_url` serving every
    model, as data (`make_config` validates it, `budget_yaml` writes it as a file's text).

    store: a URL ("memory", "redis://...") or a mapping of store options (its `url` included);
    STORE_DEFAULTS fill what it leaves out. users: the `users:` section as Python data.
    extra: further top-level sections (server, alerts, timezone, mode...). upstream_opts: the
    upstream's own options (idle_timeout_s, retry, cap_fields...); retries default to FAST_RETRY.
    """
    upstream: dict[str, Any] = {"base_url": upstream_url, "retry": dict(FAST_RETRY)}
    if api_key is not None:
        upstream["api_key"] = api_key
    upstream.update(upstream_opts)
    data: dict[str, Any] = {
        "upstreams": {"mock": upstream},
        "models": [{"match": "*", "upstream": "mock"}],
        "metrics": {"model_labels": ["mock-gpt"], "discover_models": False},
    }
    if store is not None:
        opts = {"url": store} if isinstance(store, str) else dict(store)
        data["store"] = {**STORE_DEFAULTS, **opts}
    if users is not None:
        data["users"] = {name: dict(u) for name, u in users.items()}
    data.update(extra or {})
    return data


def make_config(upstream_url: str, **options: Any) -> Config:
    """`config_data(upstream_url, **options)` as a validated Config."""
    return Config.model_validate(config_data(upstream_url, **options))


def config_for(upstream_url: str, **upstream_opts: Any) -> Config:
    """The plain stack's config: no users, an upstream key the proxy must add and never leak."""
    extra = {
        # Two routes, as a real config has: metrics label unknown models by route pattern.
        "models": [{"match": "mock-*", "upstream": "mock"}, {"match": "*", "upstream": "mock"}],
        **upstream_opts.pop("extra", {}),
    }
    return make_config(upstream_url, api_key=UPSTREAM_KEY, extra=extra, **upstream_opts)


def budget_yaml(
    upstream_url: str, store: str, users: str, extra: str = "", **store_opts: Any
) -> str:
    """`config_data`'s config as YAML text, for the tests about files (load, reload, `usage
    --config`, a subprocess's `--config`) and `${ENV}` keys; `users` is the indented body of the
    `users:` section and `extra` more top-level YAML, both as text; `store_opts` override
    STORE_DEFAULTS (on_error=..., timeout_ms=...)."""
    data = config_data(upstream_url, store={"url": store, **store_opts})
    return f"{yaml.safe_dump(data, sort_keys=False)}{extra}\nusers:\n{users}\n"


def budget_config(upstream_url: str, store: str, users: str, extra: str = "") -> Config:
    return parse_config(budget_yaml(upstream_url, store, users, extra), "test-budget.yaml")


# --- metrics ------------------------------------------------------------------------------------

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def ask_usage(client: openai.AsyncOpenAI, stream: bool) -> tuple[int, int, int]:
    """One chat request (streamed or not): the usage the SDK parsed, as (prompt, cached prompt,
    completion) tokens."""
    if stream:
        chunks = await client.chat.completions.create(
            model="mock-gpt", messages=MESSAGES, stream=True,
            stream_options={"include_usage": True},
        )
        usage = None
        async for chunk in chunks:
            usage = chunk.usage or usage
    else:
        usage = (await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)).usage
    assert usage is not None
    details = usage.prompt_tokens_details
    cached = details.cached_tokens or 0 if details is not None else 0
    return usage.prompt_tokens, cached, usage.completion_tokens


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


# --- streams -----------------------------------------------------------------------------------

_COST_COMMENT = re.compile(rb": tokenmeter [^\n]*\n\n\Z")


def relayed(stream: bytes) -> bytes:
    """A stream the proxy relayed whole, less the SSE comment line it ends with (the request's
    cost: README "Cost in the answer"), which must be there: the upstream's bytes."""
    found = _COST_COMMENT.search(stream)
    assert found is not None, f"no closing cost comment: {stream[-200:]!r}"
    return stream[:found.start()]


# --- reads and polls that end -------------------------------------------------------------------


class ByteStream(Protocol):
    """aiohttp's StreamReader (`resp.content`) has readany(); asyncio's has read(n)."""

    async def read(self, n: int = ...) -> bytes: ...


async def read_until(
    stream: aiohttp.StreamReader | asyncio.StreamReader | ByteStream,
    done: Callable[[bytes], bool],
    deadline: float = 10.0,
    initial: bytes = b"",
) -> bytes:
    """Read `stream` until `done(everything read so far)`; return what was read.

    An early EOF fails at once with what arrived (a bare `while not done: data += readany()`
    would spin forever on b""), and the whole read has a deadline of `deadline` seconds.
    """
    data = initial
    async with asyncio.timeout(deadline):
        while not done(data):
            if isinstance(stream, aiohttp.StreamReader):
                chunk = await stream.readany()
            else:
                chunk = await stream.read(65536)
            if not chunk:
                raise AssertionError(f"EOF before the expected data; got {data[-300:]!r}")
            data += chunk
    return data


def tokenmeter(*args: str) -> subprocess.CompletedProcess[str]:
    """`tokenmeter ARGS` run by the CLI's `main` in this process, as a subprocess's result: a
    process's interpreter and imports cost more than most commands (a test runs one command as
    a process of its own at least once). Its event loops are its own: from a test's loop, call
    it in a thread (`asyncio.to_thread`). The logging `main` sets up is undone after it."""
    out, err = io.StringIO(), io.StringIO()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exc:  # argparse's refusals: the process's exit status
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    return subprocess.CompletedProcess(["tokenmeter", *args], code, out.getvalue(),
                                       err.getvalue())


async def until(
    check: Callable[[], Awaitable[bool] | bool], deadline: float = 10.0, every: float = 0.01
) -> None:
    """Poll `check` (sync or async) until it holds; fail past `deadline` seconds. For state
    that lives in another process or server, where there is no event to wait on."""
    async with asyncio.timeout(deadline):
        while True:
            result = check()
            if not isinstance(result, bool):
                result = await result
            if result:
                return
            await asyncio.sleep(every)


def settled_count(app: web.Application) -> int:
    """Requests the app has settled since it started, as its own metrics count them: settle
    records each in tokenmeter_requests_total as its last step (nothing is awaited after it),
    or, when it fails, counts the failure (tokenmeter_metering_errors_total{stage="settle"})."""
    count = 0.0
    for family in app[st.SERVICES].metrics.registry.collect():
        for smp in family.samples:
            if smp.name == "tokenmeter_requests_total" or (
                    smp.name == "tokenmeter_metering_errors_total"
                    and smp.labels.get("stage") == "settle"):
                count += smp.value
    return int(count)


async def settled(app: web.Application, count: int, deadline: float = 10.0) -> None:
    """Until `count` requests have settled since the app started. A client can be ahead of
    its request's settle: a stream's last event reaches it before the proxy settles, and a
    client that left early is gone before the proxy has noticed."""
    await until(lambda: settled_count(app) >= count, deadline)


# --- redis -------------------------------------------------------------------------------------


async def redis_int(r: aioredis.Redis, key: KeyT) -> int:
    """The integer a Redis string key holds; a missing key fails (it must exist by then)."""
    value = await r.get(key)
    assert value is not None, f"no value at {key!r}"
    return int(value)


# --- the plain stack ----------------------------------------------------------------------------


@dataclass
class Stack:  # made by the `stack` and `make_stack` fixtures (conftest.py)
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

    def client(self, api_key: str = CLIENT_KEY, **kw: Any) -> openai.AsyncOpenAI:
        c = openai.AsyncOpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, **kw)
        self.clients.append(c)
        return c

    def direct(self, **kw: Any) -> openai.AsyncOpenAI:
        c = openai.AsyncOpenAI(base_url=self.upstream_url, api_key="x", max_retries=0, **kw)
        self.clients.append(c)
        return c

    async def settled(self, count: int) -> None:
        await settled(self.app, count)

    async def metrics(self) -> Samples:
        return await scrape(self.proxy)

    def access_lines(self) -> list[dict[str, Any]]:
        return [
            json.loads(r.getMessage())
            for r in self.caplog.records
            if r.name == "tokenmeter.access"
        ]


StackFactory = Callable[[Config], Awaitable[Stack]]
# `make_proxies` (conftest.py): users (and further top-level sections) -> the replicas made.
ProxiesFactory = Callable[..., Awaitable[list[TestServer]]]


# --- issue 20's latency guard: another client of a replica under attack -------------------

LATENCY_BOUND_S = 0.3  # each of the ordinary client's requests while a hostile one acts


@dataclass
class Latencies:
    """What `timed_client` saw: each request's seconds, when it started, and the statuses that
    were not 200."""

    seen: list[float] = field(default_factory=list)
    at: list[float] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)

    def check(self, at_least: int = 1, bound_s: float = LATENCY_BOUND_S) -> None:
        """Every request a 200, at least `at_least` of them, each within `bound_s`."""
        assert not self.failed, f"statuses other than 200: {self.failed[:5]}"
        assert len(self.seen) >= at_least, (
            f"{len(self.seen)} requests answered while the hostile client ran, fewer than "
            f"{at_least}")
        slowest = sorted(range(len(self.seen)), key=self.seen.__getitem__)[-5:]
        assert self.seen[slowest[-1]] < bound_s, (
            f"{sum(s >= bound_s for s in self.seen)} of {len(self.seen)} requests took "
            f"{bound_s * 1000:.0f} ms or more; slowest: " + ", ".join(
                f"{self.seen[i] * 1000:.0f} ms at +{self.at[i] - self.at[0]:.1f} s"
                for i in reversed(slowest)
            )
        )


@asynccontextmanager
async def timed_client(ask: Callable[[], Awaitable[int]]) -> AsyncIterator[Latencies]:
    """`ask` (one small request; its status) one after another for as long as the block runs,
    each one timed. The request under way when the block ends is waited for and counted."""
    latencies = Latencies()
    stop = asyncio.Event()

    async def client() -> None:
        while not stop.is_set():
            started = time.monotonic()
            status = await ask()
            latencies.seen.append(time.monotonic() - started)
            latencies.at.append(started)
            if status != 200:
                latencies.failed.append(status)

    task = asyncio.create_task(client())
    try:
        yield latencies
    finally:
        stop.set()
        await task


# --- a user's day and a prompt, as the proxy counts them --------------------------------------


async def daily_used(proxy: TestServer, user: str = "alice") -> int:
    """`user`'s daily_tokens counter today (the budget's clock, UTC), read from the store."""
    budget = proxy.app[st.SERVICES].budget
    runtime = proxy.app[st.SERVICES].runtime.current
    key = daily_key(
        runtime.config.store.prefix, user, "daily_tokens",
        datetime.fromtimestamp(budget.clock(), UTC).strftime("%Y%m%d"),
    )
    (used,) = await budget.store.read([key])
    return used


def prompt_estimate(messages: list[ChatCompletionMessageParam] = MESSAGES) -> int:
    """The proxy's own count of a chat request's prompt, as admission reserves it."""
    body = {"model": "mock-gpt", "messages": messages}
    return ChatTranslator(parse_body(json.dumps(body).encode())).estimate_prompt_tokens()


def exported(metrics: Any, name: str, labels: dict[str, str] | None = None) -> float:
    """A sample of `metrics` (a proxy.telemetry.metrics.Metrics) as its /metrics shows it: the
    serving process's own series with those its ledger shipper process keeps (0 when absent)."""
    want = labels or {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for smp in family.samples:
            if smp.name == name and all(smp.labels.get(k) == v for k, v in want.items()):
                return float(smp.value)
    return 0.0
