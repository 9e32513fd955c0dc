"""The books end to end: real proxies, a real redis-server, a real PostgreSQL, the openai SDK.

- Two replicas sharing Redis and PostgreSQL under a mixed load (streams, plain answers, client
  disconnects, upstream resets): one row per request, and the ledger, the store's counters, the
  Prometheus counters and what the upstream reported agree to the token.
- A proxy killed with SIGKILL under load: after a restart, every request whose answer the client
  read to its end has exactly one row.
- PostgreSQL stopped for 10 s under load: no request fails, and every row lands exactly once.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import time
from collections.abc import Iterator
from datetime import date
from pathlib import Path

import aiohttp
import asyncpg
import openai
import pytest
from aiohttp.test_utils import TestServer

from proxy.budget.store_redis import RedisStore
from proxy.budget.usage_report import read_usage
from proxy.config.load import Config
from proxy.ledger.schema import TABLE
from proxy.pipeline import services as st
from proxy.pipeline.relay import REQUEST_ID_HEADER
from proxy.server.app import create_app
from proxy.testing.mock_upstream import MOCK_STATE, MockSettings, create_mock_app
from tests.helpers import (
    ALICE_KEY,
    BOB_KEY,
    MESSAGES,
    ServerFactory,
    make_config,
    sample,
    scrape,
    settled,
    until,
)
from tests.servers import PostgresServer, ServedProxy, ledger_shippers

USERS = {
    "alice": {"keys": [ALICE_KEY], "daily_tokens": 50_000_000},
    "bob": {"keys": [BOB_KEY], "daily_tokens": 50_000_000, "team": "blue"},
}
# The client hangs up mid-stream; the upstream stalls after 20 tokens so that it never finishes
# (and reports usage) behind the proxy's back however late the hang-up is seen on a busy box.
PACED = {"x-mock-tokens-per-second": "400", "x-mock-output-tokens": "200",
         "x-mock-stall-after": "20"}


async def _served(app_server: TestServer, count: int) -> None:
    await settled(app_server.app, count, deadline=30)


async def _flush(app_server: TestServer) -> None:
    ledger = app_server.app[st.SERVICES].ledger
    assert ledger is not None
    assert await ledger.flush(30), ledger.health()


async def _one(client: openai.AsyncOpenAI, kind: str) -> None:
    """One request of a kind; failures the kind provokes are expected, anything else is not."""
    if kind == "plain":
        await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
    elif kind == "stream":
        stream = await client.chat.completions.create(
            model="mock-gpt", messages=MESSAGES, stream=True,
            stream_options={"include_usage": True},
        )
        async for _ in stream:
            pass
    elif kind == "reset":
        with pytest.raises(openai.APIError):
            stream = await client.chat.completions.create(
                model="mock-gpt", messages=MESSAGES, stream=True,
                extra_headers={"x-mock-reset-after": "5"},
            )
            async for _ in stream:
                pass
    else:  # the client reads two chunks of a long stream and hangs up
        stream = await client.chat.completions.create(
            model="mock-gpt", messages=MESSAGES, stream=True, extra_headers=PACED,
        )
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 2:
                break
        await stream.close()


async def test_books_balance_across_two_replicas(
    aiohttp_server: ServerFactory, upstream: TestServer, redis_url: str, pg_url: str
) -> None:
    def replica(n: int) -> Config:
        # Two replicas in one test process: named apart, as their host names would be.
        return make_config(str(upstream.make_url("/v1")), store=redis_url, users=USERS,
                           extra={"ledger": {"url": pg_url, "replica_id": f"replica-{n}"}})

    config = replica(0)
    replicas = [await aiohttp_server(create_app(replica(n))) for n in range(2)]
    clients = {
        (r, user): openai.AsyncOpenAI(base_url=str(replicas[r].make_url("/v1")), api_key=key,
                                      max_retries=0)
        for r in range(2) for user, key in (("alice", ALICE_KEY), ("bob", BOB_KEY))
    }
    kinds = ("plain", "stream", "reset", "disconnect")
    plan = [(i % 2, ("alice", "bob")[i // 2 % 2], kinds[i // 4 % 4]) for i in range(48)]
    await asyncio.gather(*(_one(clients[(r, user)], kind) for r, user, kind in plan))
    for r in range(2):
        await _served(replicas[r], sum(1 for rr, _, _ in plan if rr == r))
        await _flush(replicas[r])

    db = await asyncpg.connect(pg_url)
    try:
        assert await db.fetchval(f"SELECT count(*) FROM {TABLE}") == len(plan)
        assert await db.fetchval(f"SELECT count(DISTINCT request_id) FROM {TABLE}") == len(plan)
        assert await db.fetchval(f"SELECT count(DISTINCT replica) FROM {TABLE}") == 2
        ledger = {
            row["user_name"]: row
            for row in await db.fetch(
                f"SELECT user_name, sum(input_tokens) AS i, sum(output_tokens) AS o, "
                f"count(*) AS n FROM {TABLE} GROUP BY user_name")
        }
        reported = await db.fetchrow(
            f"SELECT sum(input_tokens) AS i, sum(output_tokens) AS o, count(*) AS n "
            f"FROM {TABLE} WHERE token_source = 'reported' AND status = 200")
        cut = await db.fetchval(
            f"SELECT count(*) FROM {TABLE} WHERE error_class IN "
            f"('client_disconnect', 'upstream_reset')")
        assert await db.fetchval(f"SELECT count(*) FROM {TABLE} WHERE team = 'blue'") == 24
    finally:
        await db.close()
    assert reported is not None
    assert cut == 24  # the disconnects and the resets are in the books too

    store = RedisStore(redis_url, 5000)
    try:
        counters = {u.user: u for u in await read_usage(config, store, date.today())}
    finally:
        await store.close()
    scraped = [await scrape(r) for r in replicas]
    for user in ("alice", "bob"):
        booked = ledger[user]["i"] + ledger[user]["o"]
        assert ledger[user]["n"] == 24
        assert counters[user].tokens == booked
        assert counters[user].input_tokens == ledger[user]["i"]
        assert counters[user].output_tokens == ledger[user]["o"]
        exported = sum(sample(s, "tokenmeter_tokens_total", user=user, type=t)
                       for s in scraped for t in ("input", "output"))
        assert exported == booked
    mock = upstream.app[MOCK_STATE].reported
    assert (reported["n"], reported["i"], reported["o"]) == (
        mock["requests"], mock["prompt_tokens"], mock["completion_tokens"])


# --- a proxy killed with SIGKILL ----------------------------------------------------------------


@pytest.fixture
async def paced_upstream(aiohttp_server: ServerFactory) -> TestServer:
    return await aiohttp_server(
        create_mock_app(MockSettings(tokens_per_second=2000, ttft_ms=0, output_tokens=40)))


async def _read_whole(session: aiohttp.ClientSession, url: str, stream: bool) -> str | None:
    """A request whose answer is read to its very end (EOF): its ledger id, else None."""
    body = {"model": "mock-gpt", "messages": MESSAGES, "stream": stream}
    try:
        async with session.post(url, json=body) as resp:
            await resp.read()
            if resp.status != 200:
                return None
            return resp.headers[REQUEST_ID_HEADER]
    except (aiohttp.ClientError, OSError):
        return None


async def test_a_killed_proxy_loses_no_row_of_an_answer_read(
    paced_upstream: TestServer, tmp_path: Path
) -> None:
    config = tmp_path / "tokenmeter.yaml"
    config.write_text(f"""
upstreams:
  mock: {{base_url: "{paced_upstream.make_url('/v1')}"}}
metrics: {{discover_models: false}}
""")
    proxy = await ServedProxy(config, tmp_path / "proxy.log").started()
    url = f"{proxy.url}/v1/chat/completions"
    read: list[str] = []
    killed = asyncio.Event()

    async def client(n: int) -> None:
        async with aiohttp.ClientSession() as session:
            while not killed.is_set():
                request_id = await _read_whole(session, url, stream=n % 2 == 0)
                if request_id is not None and not killed.is_set():
                    read.append(request_id)

    workers = [asyncio.create_task(client(n)) for n in range(6)]
    try:
        await until(lambda: len(read) >= 60, deadline=60)
        proxy.kill()
        killed.set()
        await asyncio.gather(*workers)
        # Only answers read to their end before the kill count; later ones cannot have been.
        await proxy.started()  # again, on the same port
        ledger = Path(os.environ["TOKENMETER_STATE_DIR"]) / "ledger.sqlite3"

        def booked() -> dict[str, int]:
            with sqlite3.connect(f"file:{ledger}?mode=ro", uri=True) as db:
                rows = db.execute(f"SELECT request_id, count(*) FROM {TABLE} "
                                  "GROUP BY request_id").fetchall()
            return {r: n for r, n in rows}

        await until(lambda: set(read) <= set(booked()), deadline=60, every=0.1)
        counts = booked()
        assert all(counts[r] == 1 for r in read)
    finally:
        proxy.kill()


async def test_sigterm_ships_every_row_before_the_process_exits(
    paced_upstream: TestServer, tmp_path: Path
) -> None:
    config = tmp_path / "tokenmeter.yaml"
    config.write_text(f"""
upstreams:
  mock: {{base_url: "{paced_upstream.make_url('/v1')}"}}
metrics: {{discover_models: false}}
""")
    proxy = await ServedProxy(config, tmp_path / "proxy.log").started()
    url = f"{proxy.url}/v1/chat/completions"
    try:
        async with aiohttp.ClientSession() as session:
            ids = await asyncio.gather(*(_read_whole(session, url, stream=i % 2 == 0)
                                         for i in range(40)))
        assert await proxy.stopped(signal.SIGTERM) == 0, proxy.log_text()
    finally:
        proxy.kill()
    # No restart: the exiting process itself stored them (drain within server.drain_seconds).
    ledger = Path(os.environ["TOKENMETER_STATE_DIR"]) / "ledger.sqlite3"
    with sqlite3.connect(f"file:{ledger}?mode=ro", uri=True) as db:
        stored = {r for (r,) in db.execute(f"SELECT request_id FROM {TABLE}")}
    assert None not in ids
    assert stored == set(ids)
    leftovers = [p for p in ledger.parent.glob("ledger-*.jsonl")]
    assert leftovers == []  # nothing left waiting in the spool
    # A clean stop loses nothing, so the books raise no warning of their own: the shipper
    # taking over the exited writer's last rows is routine.
    books = [json.loads(line) for line in proxy.log_text().splitlines()
             if line.startswith("{") and '"tokenmeter.ledger"' in line]
    assert not [b for b in books if b.get("level") in ("warning", "error")], books


async def test_a_killed_shipper_is_started_again_and_books_every_row_once(
    paced_upstream: TestServer, tmp_path: Path
) -> None:
    """`serve` ships through a child process of its own; SIGKILLed while rows flow, it is
    started again, and every answered request has exactly one row."""
    config = tmp_path / "tokenmeter.yaml"
    config.write_text(f"""
upstreams:
  mock: {{base_url: "{paced_upstream.make_url('/v1')}"}}
metrics: {{discover_models: false}}
""")
    proxy = await ServedProxy(config, tmp_path / "proxy.log").started()
    assert proxy.proc is not None
    url = f"{proxy.url}/v1/chat/completions"
    try:
        async with aiohttp.ClientSession() as session:

            async def load(n: int) -> list[str | None]:
                return list(await asyncio.gather(*(
                    _read_whole(session, url, stream=i % 2 == 0) for i in range(n))))

            def children() -> set[int]:
                assert proxy.proc is not None
                return {p for p, parent in ledger_shippers().items()
                        if parent == proxy.proc.pid}

            (first,) = children()  # one, this process's child
            ids = await load(20)
            flowing = asyncio.create_task(load(60))
            os.kill(first, signal.SIGKILL)
            ids += await flowing
            await until(lambda: len(children()) == 1 and first not in children(), deadline=30)
            ids += await load(20)
        assert await proxy.stopped(signal.SIGTERM) == 0, proxy.log_text()
    finally:
        proxy.kill()
    assert f"the ledger shipper (pid {first}) died (signal SIGKILL)" in proxy.log_text()
    ledger = Path(os.environ["TOKENMETER_STATE_DIR"]) / "ledger.sqlite3"
    with sqlite3.connect(f"file:{ledger}?mode=ro", uri=True) as db:
        stored = [r for (r,) in db.execute(f"SELECT request_id FROM {TABLE}")]
    assert None not in ids and len(ids) == 100
    assert sorted(stored) == sorted(str(i) for i in ids)  # none lost, none twice


# --- PostgreSQL stopped under load --------------------------------------------------------------


@pytest.fixture
def postgres() -> Iterator[PostgresServer]:
    server = PostgresServer()
    server.start()
    yield server
    server.destroy()


async def test_postgres_down_for_ten_seconds_fails_no_request_and_loses_no_row(
    aiohttp_server: ServerFactory, upstream: TestServer, postgres: PostgresServer
) -> None:
    config = make_config(str(upstream.make_url("/v1")),
                         extra={"ledger": {"url": postgres.url}})
    proxy = await aiohttp_server(create_app(config))
    ledger = proxy.app[st.SERVICES].ledger
    assert ledger is not None
    client = openai.AsyncOpenAI(base_url=str(proxy.make_url("/v1")), api_key="sk-any-12345678",
                                max_retries=0)
    ids: list[str] = []

    async def load(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            raw = await client.chat.completions.with_raw_response.create(
                model="mock-gpt", messages=MESSAGES)
            assert raw.status_code == 200
            ids.append(raw.headers[REQUEST_ID_HEADER])

    await load(0.5)
    postgres.stop("immediate")
    outage = asyncio.gather(*(load(10.0) for _ in range(3)))
    await until(lambda: not ledger.health().ok, deadline=20)
    # Still ready (a broken ledger fails no request), and saying what is wrong.
    async with aiohttp.ClientSession() as session, session.get(proxy.make_url("/readyz")) as r:
        assert r.status == 200
        ready = await r.json()
    assert ready["status"] == "degraded" and ready["ledger"] != "ok"
    assert sample(await scrape(proxy), "tokenmeter_ledger_up") == 0
    await outage
    during = len(ids)
    postgres.start()
    await load(0.5)
    assert await ledger.flush(60), ledger.health()
    await until(lambda: ledger.health().ok)  # the shipper process's word
    assert sample(await scrape(proxy), "tokenmeter_ledger_up") == 1
    db = await asyncpg.connect(postgres.url)
    try:
        rows = await db.fetch(f"SELECT request_id, count(*) AS n FROM {TABLE} "
                              "GROUP BY request_id")
    finally:
        await db.close()
    counts = {r["request_id"]: r["n"] for r in rows}
    assert during > 10
    assert set(counts) == set(ids)
    assert all(n == 1 for n in counts.values())
