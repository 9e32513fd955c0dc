"""Retries do not multiply: once the proxy's own retries are spent, its failing answer says
`x-should-retry: false`, which the openai and anthropic SDKs honour (issue 32, item 4).

The real SDKs, with their default `max_retries` (2), against a proxy whose simulated upstream
always answers 500: the upstream sees the proxy's attempts only (3, not 3 x 3), the books one
request (one ledger row). An answer after a single upstream call is left to the SDK.
"""

from __future__ import annotations

import socket
import sqlite3
from contextlib import closing

import aiohttp
import anthropic
import openai
import pytest
from aiohttp.test_utils import TestServer

from proxy.ledger.schema import TABLE
from proxy.pipeline.relay import REQUEST_ID_HEADER, SHOULD_RETRY_HEADER
from proxy.server.app import create_app
from proxy.testing.mock_upstream import MOCK_STATE
from tests.helpers import MESSAGES, ServerFactory, make_config, sample, scrape, settled
from tests.pipeline.test_cost_answer import _ledger, ledger_row

FAIL = {"x-mock-status": "500"}
THREE_TRIES = {"max_attempts": 3, "initial_backoff_ms": 1, "max_backoff_ms": 5}


def _rows() -> int:
    with closing(sqlite3.connect(f"file:{_ledger()}?mode=ro", uri=True)) as db:
        return int(db.execute(f"SELECT count(*) FROM {TABLE}").fetchone()[0])


async def _books_one_request(proxy: TestServer, request_id: str) -> None:
    await settled(proxy.app, 1)
    assert sample(await scrape(proxy), "tokenmeter_requests_total") == 1
    await ledger_row(request_id)
    assert _rows() == 1


async def test_openai_sdk_does_not_retry_the_proxys_spent_500(
    aiohttp_server: ServerFactory, upstream: TestServer
) -> None:
    proxy = await aiohttp_server(create_app(make_config(str(upstream.make_url("/v1")),
                                                        retry=THREE_TRIES)))
    # The SDK's defaults: max_retries=2.
    async with openai.AsyncOpenAI(base_url=str(proxy.make_url("/v1")), api_key="sk-unused",
                                  default_headers=FAIL) as client:
        assert client.max_retries == 2
        with pytest.raises(openai.InternalServerError) as err:
            await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
    assert err.value.response.headers[SHOULD_RETRY_HEADER] == "false"
    assert len(upstream.app[MOCK_STATE].requests) == 3  # the proxy's attempts, not 9
    await _books_one_request(proxy, err.value.response.headers[REQUEST_ID_HEADER])


async def test_anthropic_sdk_does_not_retry_the_proxys_spent_500(
    aiohttp_server: ServerFactory, upstream: TestServer
) -> None:
    proxy = await aiohttp_server(create_app(make_config(
        str(upstream.make_url("/v1")), retry=THREE_TRIES, api="anthropic")))
    async with anthropic.AsyncAnthropic(base_url=str(proxy.make_url("")), api_key="sk-unused",
                                        default_headers=FAIL) as client:
        assert client.max_retries == 2
        with pytest.raises(anthropic.InternalServerError) as err:
            await client.messages.create(model="claude-mock", max_tokens=16,
                                         messages=[{"role": "user", "content": "hi"}])
    assert err.value.response.headers[SHOULD_RETRY_HEADER] == "false"
    assert len(upstream.app[MOCK_STATE].requests) == 3
    await _books_one_request(proxy, err.value.response.headers[REQUEST_ID_HEADER])


async def test_unreachable_upstream_after_the_proxys_retries_is_final(
    aiohttp_server: ServerFactory,
) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proxy = await aiohttp_server(create_app(make_config(f"http://127.0.0.1:{port}/v1",
                                                        retry=THREE_TRIES)))
    async with openai.AsyncOpenAI(base_url=str(proxy.make_url("/v1")),
                                  api_key="sk-unused") as client:
        with pytest.raises(openai.APIStatusError) as err:
            await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
    assert err.value.status_code == 502 and err.value.code == "upstream_unreachable"
    assert err.value.response.headers[SHOULD_RETRY_HEADER] == "false"
    await settled(proxy.app, 1)
    m = await scrape(proxy)
    assert sample(m, "tokenmeter_requests_total") == 1
    assert sample(m, "tokenmeter_upstream_retries_total") == 2


async def test_an_answer_after_one_call_is_left_to_the_sdk(
    aiohttp_server: ServerFactory, upstream: TestServer
) -> None:
    """Retries off (`max_attempts: 1`): the SDK's retries are the only ones, so the proxy does
    not forbid them."""
    proxy = await aiohttp_server(create_app(make_config(str(upstream.make_url("/v1")),
                                                        retry={"max_attempts": 1})))
    async with aiohttp.ClientSession() as s, s.post(
        proxy.make_url("/v1/chat/completions"), headers=FAIL,
        json={"model": "mock-gpt", "messages": MESSAGES},
        timeout=aiohttp.ClientTimeout(total=20),
    ) as r:
        assert r.status == 500
        assert SHOULD_RETRY_HEADER not in r.headers
    assert len(upstream.app[MOCK_STATE].requests) == 1
