"""The books under hostile input and at the worst moments (issue 20, items 6, 9 and 10): a value
no database can store never costs a row, a wrong-key flood never fills the ledger, and a stream
read to its end has its row even when the proxy is killed while the budget store is slow.

Real parts only: the machine's PostgreSQL and SQLite files for the ledger, real redis-servers,
`tokenmeter serve` subprocesses for the kills, aiohttp and the openai SDK as clients.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from pathlib import Path
from typing import Any

import asyncpg
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.ledger.schema import TABLE
from proxy.server import state as st
from tests.helpers import MESSAGES, ServerFactory, StackFactory, make_config

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
