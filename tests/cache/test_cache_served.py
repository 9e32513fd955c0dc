"""The response cache in the books, end to end as deployed: `tokenmeter serve` in its own
process, a real redis-server as the budget store (and so the cache's), the SQLite ledger it
writes, the real openai and anthropic SDKs, the simulated upstream counting what it was sent.

A hit's ledger row says `cache=hit` with 0 tokens and what the first answer used (tokens and
cost) as saved; the user's daily counter in Redis does not move on a hit (`charge_hits: none`)
and moves by the saved usage under `charge_hits: full`; /metrics agrees with the ledger."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, closing
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
import redis.asyncio as aioredis
import yaml
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families

from proxy.ledger.schema import TABLE
from proxy.pipeline.relay import REQUEST_ID_HEADER
from proxy.testing.mock_settings import MOCK_STATE
from tests.helpers import FAST_RETRY, Samples, sample, until
from tests.servers import RedisServer, ServedProxy

ALICE = "sk-alice-served-cache-01"
PRICE = {"input": 3.0, "output": 15.0}
SAVED = ("input_tokens", "output_tokens", "cached_input_tokens", "reasoning_tokens",
         "cache_creation_input_tokens")


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _config(upstream: TestServer, redis_url: str, ledger: Path, charge_hits: str) -> str:
    url = str(upstream.make_url("/v1"))
    return yaml.safe_dump({
        "upstreams": {
            "mock": {"base_url": url, "retry": dict(FAST_RETRY)},
            "claude": {"base_url": url, "retry": dict(FAST_RETRY), "api": "anthropic"},
        },
        "models": [{"match": "claude-*", "upstream": "claude"}, {"match": "*", "upstream": "mock"}],
        "metrics": {"model_labels": ["mock-gpt", "claude-mock"], "discover_models": False},
        "prices": {"*": PRICE},
        "store": {"url": redis_url},
        "ledger": {"url": f"sqlite:///{ledger}"},
        "users": {"alice": {"keys": [ALICE], "daily_tokens": 1_000_000}},
        "cache": {"enabled": True, "charge_hits": charge_hits},
    })


@asynccontextmanager
async def _served(upstream: TestServer, redis: RedisServer, tmp_path: Path,
                  charge_hits: str) -> AsyncIterator[ServedProxy]:
    config = tmp_path / "tokenmeter.yaml"
    config.write_text(_config(upstream, redis.url, tmp_path / "ledger.sqlite3", charge_hits))
    config.chmod(0o600)
    proxy = ServedProxy(config, tmp_path / "serve.log")
    await proxy.started(90)  # a loaded box starts slowly
    try:
        yield proxy
    finally:
        proxy.kill()


def _seen(upstream: TestServer) -> int:
    return len(upstream.app[MOCK_STATE].requests)


async def _row(tmp_path: Path, request_id: str) -> dict[str, Any]:
    """The request's ledger row, once the proxy's shipper has written it."""
    path = tmp_path / "ledger.sqlite3"

    def read() -> dict[str, Any] | None:
        if not path.exists():
            return None
        with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
            db.row_factory = sqlite3.Row
            try:
                found = db.execute(f"SELECT * FROM {TABLE} WHERE request_id = ?",
                                   (request_id,)).fetchone()
            except sqlite3.OperationalError:  # the table is not there yet
                return None
        return None if found is None else dict(found)

    await until(lambda: read() is not None, deadline=30, every=0.05)
    row = read()
    assert row is not None
    return row


async def _used(redis: RedisServer) -> int:
    """alice's daily_tokens counter (today's, whichever day the proxy's clock says)."""
    r = aioredis.Redis.from_url(redis.url)
    try:
        keys = [k async for k in r.scan_iter(match="*alice*:u:daily_tokens:*")]
        assert len(keys) <= 1, keys
        return int(await r.get(keys[0]) or 0) if keys else 0
    finally:
        await r.aclose()


async def _settled(redis: RedisServer, expected: int) -> None:
    """The counter reaches `expected` (settling runs after the answer is sent), and is exact."""
    async def reached() -> bool:
        return await _used(redis) >= expected

    await until(reached, deadline=30, every=0.05)
    assert await _used(redis) == expected


async def _metrics(proxy: ServedProxy) -> Samples:
    async with ClientSession() as s, s.get(proxy.url + "/metrics") as r:
        assert r.status == 200
        text = await r.text()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for smp in family.samples:
            out[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value
    return out


def _tokens(row: dict[str, Any], prefix: str = "") -> int:
    return int(row[f"{prefix}input_tokens"]) + int(row[f"{prefix}output_tokens"])


def _assert_hit_row(hit: dict[str, Any], first: dict[str, Any]) -> None:
    assert hit["cache"] == "hit" and first["cache"] == "miss"
    assert all(hit[f] == 0 for f in SAVED)  # no upstream call
    assert all(hit[f"saved_{f}"] == first[f] for f in SAVED)
    assert first["cost_nanousd"] > 0 and hit["saved_cost_nanousd"] == first["cost_nanousd"]
    assert not hit["cost_nanousd"]


async def _chat(client: openai.AsyncOpenAI, prompt: str) -> tuple[Any, dict[str, str]]:
    raw = await client.chat.completions.with_raw_response.create(
        model="mock-gpt", messages=[{"role": "user", "content": prompt}], temperature=0,
        max_tokens=50)
    return raw.parse(), dict(raw.headers)


async def _stream(client: openai.AsyncOpenAI, prompt: str,
                  include_usage: bool) -> tuple[str, str | None, Any, int, dict[str, str]]:
    options = {"stream_options": {"include_usage": True}} if include_usage else {}
    raw = await client.chat.completions.with_raw_response.create(
        model="mock-gpt", messages=[{"role": "user", "content": prompt}], temperature=0,
        max_tokens=50, stream=True, **options)  # type: ignore[call-overload]
    text, finish, usage, usage_chunks = "", None, None, 0
    async for chunk in raw.parse():
        if chunk.usage is not None:
            usage, usage_chunks = chunk.usage, usage_chunks + 1
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish, usage, usage_chunks, dict(raw.headers)


@pytest.mark.timeout(180)
async def test_hits_are_booked_as_saved_charged_nothing_and_counted(
    upstream: TestServer, own_redis: RedisServer, tmp_path: Path
) -> None:
    async with _served(upstream, own_redis, tmp_path, "none") as proxy:
        client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key=ALICE, max_retries=0)
        # JSON: a miss, then a hit equal to it.
        first, h1 = await _chat(client, "json first")
        second, h2 = await _chat(client, "json first")
        assert (h1["x-tokenmeter-cache"], h2["x-tokenmeter-cache"]) == ("miss", "hit")
        assert second.model_dump() == first.model_dump()
        assert _seen(upstream) == 1
        miss = await _row(tmp_path, h1[REQUEST_ID_HEADER])
        hit = await _row(tmp_path, h2[REQUEST_ID_HEADER])
        _assert_hit_row(hit, miss)
        await _settled(own_redis, _tokens(miss))  # the miss charged what it used; the hit 0

        # A stream's entry: streamed back with the usage chunk only when asked, and as JSON.
        text, finish, usage, chunks, h3 = await _stream(client, "stream first", False)
        assert h3["x-tokenmeter-cache"] == "miss" and usage is None and chunks == 0
        streamed = await _row(tmp_path, h3[REQUEST_ID_HEADER])
        again = await _stream(client, "stream first", True)
        assert again[:2] == (text, finish) and again[3] == 1
        assert again[4]["x-tokenmeter-cache"] == "hit"
        assert (again[2].prompt_tokens, again[2].completion_tokens) == (
            streamed["input_tokens"], streamed["output_tokens"])
        bare = await _stream(client, "stream first", False)
        assert bare[:4] == (text, finish, None, 0)
        as_json, h4 = await _chat(client, "stream first")
        assert h4["x-tokenmeter-cache"] == "hit"
        assert (as_json.choices[0].message.content, as_json.choices[0].finish_reason) == (
            text, finish)
        _assert_hit_row(await _row(tmp_path, h4[REQUEST_ID_HEADER]), streamed)
        # A JSON entry streamed (the usage chunk equal to the JSON's usage).
        json_streamed = await _stream(client, "json first", True)
        assert json_streamed[:2] == (first.choices[0].message.content,
                                     first.choices[0].finish_reason)
        assert json_streamed[2].model_dump() == first.usage.model_dump()

        # Anthropic: a JSON entry replayed as a stream (the other way is in test_cache_e2e).
        claude = anthropic.AsyncAnthropic(base_url=proxy.url, api_key=ALICE, max_retries=0)
        ask: dict[str, Any] = {"model": "claude-mock", "max_tokens": 64,
                               "extra_body": {"temperature": 0},
                               "messages": [{"role": "user", "content": "hello there"}]}
        raw = await claude.messages.with_raw_response.create(**ask)
        answer = await raw.parse()
        async with claude.messages.stream(**ask) as stream:
            replayed = await stream.get_final_message()
        assert replayed.model_dump() == answer.model_dump()
        assert _seen(upstream) == 3
        claude_miss = await _row(tmp_path, raw.headers[REQUEST_ID_HEADER])

        # The counter holds the three misses' usage, nothing of the hits: a last miss settles
        # after every hit did, so the counter read is not early.
        _, h5 = await _chat(client, "last")
        last = await _row(tmp_path, h5[REQUEST_ID_HEADER])
        await _settled(own_redis, sum(_tokens(r) for r in (miss, streamed, claude_miss, last)))

        # /metrics agrees with the ledger.
        with closing(sqlite3.connect(tmp_path / "ledger.sqlite3")) as db:
            hits, saved_in, saved_out, saved_nanos = db.execute(
                f"SELECT count(*), sum(saved_input_tokens), sum(saved_output_tokens), "
                f"sum(saved_cost_nanousd) FROM {TABLE} WHERE cache = 'hit'").fetchone()
        assert hits == 6
        metrics = await _metrics(proxy)
        assert sample(metrics, "tokenmeter_cache_requests_total", result="hit") == hits
        assert sample(metrics, "tokenmeter_cache_requests_total", result="miss") == 4
        assert sample(metrics, "tokenmeter_cache_saved_tokens_total", type="input") == saved_in
        assert sample(metrics, "tokenmeter_cache_saved_tokens_total", type="output") == saved_out
        assert sample(metrics, "tokenmeter_cache_saved_cost_usd_total") == pytest.approx(
            saved_nanos / 1e9)


@pytest.mark.timeout(180)
async def test_charge_hits_full_charges_a_hit_what_it_saved(
    upstream: TestServer, own_redis: RedisServer, tmp_path: Path
) -> None:
    async with _served(upstream, own_redis, tmp_path, "full") as proxy:
        client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key=ALICE, max_retries=0)
        _, h1 = await _chat(client, "charged")
        miss = await _row(tmp_path, h1[REQUEST_ID_HEADER])
        await _settled(own_redis, _tokens(miss))
        _, h2 = await _chat(client, "charged")
        assert h2["x-tokenmeter-cache"] == "hit"
        hit = await _row(tmp_path, h2[REQUEST_ID_HEADER])
        _assert_hit_row(hit, miss)
        await _settled(own_redis, 2 * _tokens(miss))
        streamed = await _stream(client, "charged", True)
        assert streamed[4]["x-tokenmeter-cache"] == "hit"
        await _settled(own_redis, 3 * _tokens(miss))
        assert _seen(upstream) == 1
