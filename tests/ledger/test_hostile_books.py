"""The books under hostile input and at the worst moments (issue 20, items 6, 9 and 10): a value
no database can store never costs a row, a wrong-key flood never fills the ledger, and a stream
read to its end has its row even when the proxy is killed while the budget store is slow.

Real parts only: the machine's PostgreSQL and SQLite files for the ledger, real redis-servers,
`tokenmeter serve` subprocesses for the kills, aiohttp and the openai SDK as clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sqlite3
import time
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.config.ledger import LedgerConfig
from proxy.ledger.ledger import Ledger
from proxy.ledger.schema import TABLE
from proxy.pipeline import services as st
from proxy.pipeline.relay import REQUEST_ID_HEADER
from proxy.telemetry.accesslog import AUTH_LOG_EVERY_S, AuthFailureLog
from proxy.telemetry.metrics import Metrics
from tests.helpers import (
    ALICE_KEY,
    MESSAGES,
    ServerFactory,
    StackFactory,
    budget_yaml,
    make_config,
    read_until,
    sample,
    until,
)
from tests.servers import RedisServer, ServedProxy, free_port

# --- item 9: a value no database can store -----------------------------------------------------

# What an upstream may echo back as its model (llama.cpp echoes the request's): a NUL, which
# PostgreSQL text cannot hold, and a lone surrogate, which has no UTF-8 form at all.
ECHOED = "gpt-4o\u0000x\ud800y"
STORED = "gpt-4o\ufffdx\ufffdy"


async def _echoing_upstream(request: web.Request) -> web.Response:
    body = await request.json()
    answer = {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": ECHOED,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8},
    }
    assert body["model"] == "mock-gpt"
    return web.Response(body=json.dumps(answer), content_type="application/json")


async def _fetch(url: str, sql: str) -> list[tuple[Any, ...]]:
    if url.startswith("sqlite://"):
        with sqlite3.connect(url.removeprefix("sqlite://")) as db:
            return [tuple(r) for r in db.execute(sql).fetchall()]
    conn = await asyncpg.connect(url)
    try:
        return [tuple(r) for r in await conn.fetch(sql)]
    finally:
        await conn.close()


@pytest.fixture(params=["postgresql", "sqlite"])
def ledger_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite://{tmp_path}/books.sqlite3"
    url: str = request.getfixturevalue("pg_url")
    return url


@pytest.mark.timeout(90)
async def test_a_nul_or_lone_surrogate_never_costs_a_row(
    aiohttp_server: ServerFactory, make_stack: StackFactory, ledger_url: str
) -> None:
    # Before: PostgreSQL refused each such row, and it was dropped as poison (10 requests
    # charged, no row); SQLite could not bind the surrogate and the shipper retried the same
    # batch forever, so no later row was stored either.
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _echoing_upstream)
    upstream: TestServer = await aiohttp_server(app)
    config = make_config(str(upstream.make_url("/v1")), extra={"ledger": {"url": ledger_url}})
    stack = await make_stack(config)
    client = stack.client()
    for _ in range(10):
        answer = await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
        assert answer.model == ECHOED  # the client gets the upstream's bytes untouched
    await stack.settled(10)
    ledger = stack.app[st.SERVICES].ledger
    assert ledger is not None
    assert await ledger.flush(20), ledger.health()
    rows = await _fetch(ledger_url, f"SELECT requested_model, response_model, input_tokens, "
                                    f"output_tokens FROM {TABLE}")
    assert rows == [("mock-gpt", STORED, 7, 1)] * 10
    m = await stack.metrics()
    assert not any(name == "tokenmeter_ledger_rows_dropped_total" and value
                   for (name, _), value in m.items())
    assert not [r for r in stack.caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.timeout(60)
async def test_a_control_character_in_the_model_is_refused_before_the_books(
    make_stack: StackFactory, upstream: TestServer, pg_url: str
) -> None:
    # The model a client sends can no longer carry a NUL into a row: it is refused (400) in
    # admission; the refusal's own row is stored as every refusal's is.
    config = make_config(str(upstream.make_url("/v1")), extra={"ledger": {"url": pg_url}})
    stack = await make_stack(config)
    with pytest.raises(openai.BadRequestError) as refused:
        await stack.client().chat.completions.create(model="gpt-4o\u0000x", messages=MESSAGES)
    assert refused.value.code == "invalid_value"
    await stack.settled(1)
    ledger = stack.app[st.SERVICES].ledger
    assert ledger is not None
    assert await ledger.flush(20), ledger.health()
    rows = await _fetch(pg_url, f"SELECT status, error_class FROM {TABLE}")
    assert rows == [(400, "invalid_value")]


# --- item 6: a wrong-key flood -------------------------------------------------------------------


@pytest.mark.timeout(120)
async def test_a_wrong_key_flood_books_no_row_and_displaces_none(
    make_stack: StackFactory, upstream: TestServer
) -> None:
    # Before: each 401 was a ledger row and an access-log line; with the database unreachable
    # the flood filled the spool (ledger.spool_max_mb) and the real rows after it were dropped.
    unreachable = f"postgresql://postgres@127.0.0.1:{free_port()}/books"
    config = make_config(
        str(upstream.make_url("/v1")),
        users={"alice": {"keys": [ALICE_KEY], "daily_tokens": 1_000_000}},
        # About 110 rows fit the spool; at shutdown nothing waits for the absent database.
        extra={"ledger": {"url": unreachable, "spool_max_mb": 0.05},
               "server": {"drain_seconds": 0}},
    )
    stack = await make_stack(config)
    started = time.monotonic()
    url = stack.base_url + "/chat/completions"
    body = {"model": "mock-gpt", "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as session:

        async def wrong(i: int) -> int:
            headers = {"Authorization": f"Bearer sk-guess-{i:06d}"} if i else {}
            async with session.post(url, json=body, headers=headers) as r:
                await r.read()
                return r.status

        for batch in range(6):
            statuses = await asyncio.gather(*(wrong(batch * 50 + i) for i in range(50)))
            assert statuses == [401] * 50
    client = stack.client(ALICE_KEY)
    for _ in range(5):
        await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
    await stack.settled(305)
    elapsed = time.monotonic() - started

    m = await stack.metrics()
    assert sample(m, "tokenmeter_ledger_rows_dropped_total") == 0
    ledger = stack.app[st.SERVICES].ledger
    assert ledger is not None
    await until(lambda: ledger.health().pending_rows == 5)  # alice's, waiting for the database
    assert sample(m, "tokenmeter_auth_failures_total") == 300
    assert sample(m, "tokenmeter_requests_total", status="401",
                  error_class="invalid_api_key") == 300

    lines = stack.access_lines()
    assert [line["status"] for line in lines if line["event"] == "request"] == [200] * 5
    sampled = [line for line in lines if line["event"] == "auth_failed"]
    assert 1 <= len(sampled) <= 1 + elapsed / AUTH_LOG_EVERY_S
    assert sampled[0]["failures"] == 1  # the first failure is logged at once
    assert sum(line["failures"] for line in sampled) <= 300
    assert all(line["status"] == 401 and line["request_id"] for line in sampled)
    assert not any("sk-guess" in r.getMessage() for r in stack.caplog.records)


def test_failed_authentications_are_logged_once_per_window(
    caplog: pytest.LogCaptureFixture
) -> None:
    # The sampling itself, on a clock the test moves: the first at once, then one line per
    # window, each counting the failures since the line before.
    now = [1000.0]
    log = AuthFailureLog(clock=lambda: now[0])
    caplog.set_level(logging.WARNING, logger="tokenmeter.access")
    for i in range(5):
        log.failed(f"r{i}", "chat")
        now[0] += 1.0
    now[0] += AUTH_LOG_EVERY_S
    log.failed("r5", "messages")
    lines = [json.loads(r.getMessage()) for r in caplog.records]
    assert [(x["request_id"], x["operation"], x["failures"], x["seconds"]) for x in lines] == [
        ("r0", "chat", 1, None), ("r5", "messages", 5, 5.0 + AUTH_LOG_EVERY_S)]
    assert all(r.levelno == logging.WARNING for r in caplog.records)


# --- item 10: a stream read to [DONE], then SIGKILL while the store is slow ---------------------


def _event(delta: dict[str, Any], finish: str | None = None,
           usage: dict[str, int] | None = None) -> bytes:
    chunk: dict[str, Any] = {
        "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
        "choices": [] if usage else [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    if usage is not None:
        chunk["usage"] = usage
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


class HeldStream:
    """An upstream whose stream sends one token, then waits for the test before it ends."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(_event({"role": "assistant", "content": "one"}))
        await self.release.wait()
        await resp.write(_event({"content": " two"}, finish="stop"))
        await resp.write(_event({}, usage={"prompt_tokens": 9, "completion_tokens": 2,
                                           "total_tokens": 11}))
        await resp.write(b"data: [DONE]\n\n")
        return resp


class DoneThenHeld:
    """An upstream that sends its whole answer, `[DONE]` included, in one write, then keeps its
    response open until the test lets it end (a gateway may close its side late)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(_event({"role": "assistant", "content": "one"})
                         + _event({"content": " two"}, finish="stop")
                         + _event({}, usage={"prompt_tokens": 9, "completion_tokens": 2,
                                             "total_tokens": 11})
                         + b"data: [DONE]\n\n")
        await self.release.wait()
        return resp


def _booked(state: Path) -> set[str]:
    """Request ids with a row in the ledger spool or already in the SQLite ledger."""
    ids: set[str] = set()
    for segment in state.glob("ledger-*.jsonl"):
        for line in segment.read_bytes().splitlines():
            with contextlib.suppress(ValueError):
                ids.add(json.loads(line)[0])
    database = state / "ledger.sqlite3"
    with contextlib.suppress(sqlite3.Error), \
            sqlite3.connect(f"file:{database}?mode=ro", uri=True) as db:
        ids |= {r for (r,) in db.execute(f"SELECT request_id FROM {TABLE}")}
    return ids


@pytest.mark.timeout(120)
async def test_a_stream_read_to_done_keeps_its_row_through_a_sigkill_while_redis_stalls(
    aiohttp_server: ServerFactory, tmp_path: Path
) -> None:
    # Before: settle awaited the store's settle and only then appended the row, so with Redis
    # stalled the row waited (here up to the store's 30 s timeout) and a SIGKILL then lost it:
    # the client had its whole answer, the books had nothing.
    held = HeldStream()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", held.handle)
    upstream = await aiohttp_server(app)
    redis_server = RedisServer()
    redis_server.start()
    state = Path(os.environ["TOKENMETER_STATE_DIR"])
    config = tmp_path / "tokenmeter.yaml"
    config.write_text(budget_yaml(str(upstream.make_url("/v1")), redis_server.url,
                                  f"  alice:\n    keys: [{ALICE_KEY}]\n    daily_tokens: 100000",
                                  timeout_ms=30_000))
    proxy = await ServedProxy(config, tmp_path / "proxy.log").started()
    assert redis_server.proc is not None
    redis_pid = redis_server.proc.pid
    try:
        async with aiohttp.ClientSession() as session, session.post(
            f"{proxy.url}/v1/chat/completions",
            json={"model": "mock-gpt", "messages": [{"role": "user", "content": "hi"}],
                  "stream": True, "max_tokens": 50},
            headers={"Authorization": f"Bearer {ALICE_KEY}"},
        ) as resp:
            assert resp.status == 200
            request_id = resp.headers[REQUEST_ID_HEADER]
            await read_until(resp.content, lambda seen: b'"one"' in seen)
            os.kill(redis_pid, signal.SIGSTOP)  # admitted and reserved; now the store stalls
            held.release.set()
            await read_until(resp.content, lambda seen: b"data: [DONE]" in seen)
            # The client has its whole answer. The row must be on disk now, not once the
            # store answers (it will not for 30 s).
            await until(lambda: request_id in _booked(state), deadline=10, every=0.05)
            assert await proxy.stopped(signal.SIGKILL) == -signal.SIGKILL
    finally:
        os.kill(redis_pid, signal.SIGCONT)
        proxy.kill()
        redis_server.stop()
    # The next start adopts the dead process's spool and stores its row, once.
    ledger = Ledger(LedgerConfig(), Metrics(), state_dir=state)
    await ledger.start()
    try:
        assert await ledger.flush(20), ledger.health()
    finally:
        await ledger.stop(5)
    with sqlite3.connect(f"file:{state / 'ledger.sqlite3'}?mode=ro", uri=True) as db:
        rows = db.execute(f"SELECT status, input_tokens, output_tokens, user_name FROM {TABLE} "
                          "WHERE request_id = ?", (request_id,)).fetchall()
    assert rows == [(200, 9, 2, "alice")]


# --- issue 31 item 19: the final event reaches the client only after its row ------------------


@pytest.mark.timeout(120)
async def test_a_stream_final_event_reaches_the_client_only_after_its_row(
    aiohttp_server: ServerFactory, redis_url: str, tmp_path: Path
) -> None:
    """On main the relay forwarded `[DONE]` as it came, and settling (the row) waited for the
    upstream to end its response: a client had its whole answer (the openai SDK returns at
    `[DONE]`) with no row anywhere, for as long as the upstream kept its response open, and a
    SIGKILL then lost the request. Now the final event waits for the row: whenever the client
    has it, the row is in the spool."""
    held = DoneThenHeld()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", held.handle)
    upstream = await aiohttp_server(app)
    state = Path(os.environ["TOKENMETER_STATE_DIR"])
    config = tmp_path / "tokenmeter.yaml"
    config.write_text(budget_yaml(str(upstream.make_url("/v1")), redis_url,
                                  f"  alice:\n    keys: [{ALICE_KEY}]\n    daily_tokens: 100000"))
    proxy = await ServedProxy(config, tmp_path / "proxy.log").started()
    try:
        async with aiohttp.ClientSession() as session, session.post(
            f"{proxy.url}/v1/chat/completions",
            json={"model": "mock-gpt", "messages": [{"role": "user", "content": "hi"}],
                  "stream": True, "max_tokens": 50},
            headers={"Authorization": f"Bearer {ALICE_KEY}"},
        ) as resp:
            assert resp.status == 200
            request_id = resp.headers[REQUEST_ID_HEADER]
            # The answer's content comes as it came (the upstream still holds its response).
            seen = await read_until(resp.content, lambda got: b'" two"' in got)
            assert b"[DONE]" not in seen or request_id in _booked(state)
            held.release.set()
            seen = await read_until(resp.content, lambda got: b"data: [DONE]" in got,
                                    initial=seen)
            assert request_id in _booked(state)  # before the client could have [DONE]
            assert await proxy.stopped(signal.SIGKILL) == -signal.SIGKILL
    finally:
        held.release.set()
        proxy.kill()
    # The next start ships it, once.
    ledger = Ledger(LedgerConfig(), Metrics(), state_dir=state)
    await ledger.start()
    try:
        assert await ledger.flush(20), ledger.health()
    finally:
        await ledger.stop(5)
    with sqlite3.connect(f"file:{state / 'ledger.sqlite3'}?mode=ro", uri=True) as db:
        rows = db.execute(f"SELECT status, input_tokens, output_tokens FROM {TABLE} "
                          "WHERE request_id = ?", (request_id,)).fetchall()
    assert rows == [(200, 9, 2)]


def _anthropic_event(name: str, payload: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(payload)}\n\n".encode()


@pytest.mark.timeout(120)
async def test_an_anthropic_message_stop_reaches_the_client_only_after_its_row(
    aiohttp_server: ServerFactory, tmp_path: Path
) -> None:
    """The same for Anthropic's Messages API, whose stream ends at `event: message_stop`."""
    release = asyncio.Event()

    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"".join([
            _anthropic_event("message_start", {"type": "message_start", "message": {
                "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-test",
                "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": 12, "output_tokens": 1}}}),
            _anthropic_event("content_block_start", {
                "type": "content_block_start", "index": 0,
                "content_block": {"type": "text", "text": ""}}),
            _anthropic_event("content_block_delta", {
                "type": "content_block_delta", "index": 0,
                "delta": {"type": "text_delta", "text": " two"}}),
            _anthropic_event("content_block_stop", {"type": "content_block_stop", "index": 0}),
            _anthropic_event("message_delta", {
                "type": "message_delta", "delta": {"stop_reason": "end_turn"},
                "usage": {"output_tokens": 2}}),
            _anthropic_event("message_stop", {"type": "message_stop"}),
        ]))
        await release.wait()  # the upstream ends its response later
        return resp

    app = web.Application()
    app.router.add_post("/v1/messages", handle)
    upstream = await aiohttp_server(app)
    state = Path(os.environ["TOKENMETER_STATE_DIR"])
    config = tmp_path / "tokenmeter.yaml"
    config.write_text(f"""
upstreams:
  claude:
    base_url: {upstream.make_url("/v1")}
    api: anthropic
    api_key: sk-upstream-0123456789
models:
  - match: "*"
    upstream: claude
metrics:
  discover_models: false
""")
    proxy = await ServedProxy(config, tmp_path / "proxy.log").started()
    try:
        async with aiohttp.ClientSession() as session, session.post(
            f"{proxy.url}/v1/messages",
            json={"model": "claude-test", "max_tokens": 50, "stream": True,
                  "messages": [{"role": "user", "content": "hi"}]},
            headers={"x-api-key": "sk-any", "anthropic-version": "2023-06-01"},
        ) as resp:
            assert resp.status == 200
            request_id = resp.headers[REQUEST_ID_HEADER]
            seen = await read_until(resp.content, lambda got: b'" two"' in got)
            assert b"message_stop" not in seen or request_id in _booked(state)
            release.set()
            await read_until(resp.content, lambda got: b"event: message_stop" in got,
                             initial=seen)
            assert request_id in _booked(state)  # before the client could have message_stop
    finally:
        release.set()
        proxy.kill()
