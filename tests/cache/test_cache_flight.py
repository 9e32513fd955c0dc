"""Single flight cannot be turned against a team (issue 31, item 6): a leader whose client never
reads its socket does not hold a team-mate's identical request; the team-mate goes upstream
itself. The proxy over loopback, the simulated upstream, a raw socket as the leader's client
(it sends its request and reads nothing), the openai SDK as the team-mate's."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import openai
import pytest
from aiohttp.test_utils import TestServer

from proxy.server.app import create_app
from proxy.testing.mock_settings import MOCK_STATE, MockSettings
from tests.helpers import ServerFactory, make_config, until

ALICE = "sk-alice-flight-00001"
BOB = "sk-bob-flight-0000001"
BODY: dict[str, Any] = {"model": "mock-gpt", "temperature": 0, "max_tokens": 100_000,
                        "messages": [{"role": "user", "content": "the same question"}]}


@pytest.fixture
def mock_settings() -> MockSettings:
    return MockSettings(tokens_per_second=0, ttft_ms=0)


@pytest.mark.timeout(120)
async def test_a_leader_that_never_reads_does_not_hold_its_team_mate(
    aiohttp_server: ServerFactory, upstream: TestServer
) -> None:
    config = make_config(
        str(upstream.make_url("/v1")), store="memory",
        users={"alice": {"keys": [ALICE], "team": "research"},
               "bob": {"keys": [BOB], "team": "research"}},
        extra={"teams": {"research": {}}, "defaults": {"max_output_tokens": 100_000},
               # The leader's answer fits an entry, and the lock would hold for an hour.
               "cache": {"enabled": True, "scope": "team", "max_entry_kb": 16384,
                         "lock_timeout_s": 3600}})
    proxy = await aiohttp_server(create_app(config))
    # The leader: a streamed request for a long answer (some 4 MB of events), whose client
    # reads nothing: once the socket's buffers are full, the proxy's writes to it wait.
    payload = json.dumps({**BODY, "stream": True}).encode()
    raw = socket.socket()
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    raw.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(raw, (proxy.host, proxy.port))
    await loop.sock_sendall(raw, (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {proxy.host}\r\n"
        f"Authorization: Bearer {ALICE}\r\nContent-Type: application/json\r\n"
        f"x-mock-output-tokens: 20000\r\nContent-Length: {len(payload)}\r\n\r\n").encode()
        + payload)
    try:
        await until(lambda: len(upstream.app[MOCK_STATE].requests) == 1, deadline=30)
        # Bob's identical request (the team's entry): he is not held by Alice's flight. Its
        # bound here is the test's, far below the lock's hour.
        bob = openai.AsyncOpenAI(base_url=str(proxy.make_url("/v1")), api_key=BOB,
                                 max_retries=0)
        async with asyncio.timeout(60):
            answer = await bob.chat.completions.with_raw_response.create(
                **BODY, extra_headers={"x-mock-output-tokens": "5"})
        assert answer.headers["x-tokenmeter-cache"] == "miss"  # he went upstream himself
        parsed = answer.parse()
        assert parsed.usage is not None and parsed.usage.completion_tokens == 5
        assert parsed.choices[0].finish_reason == "stop"
        assert len(upstream.app[MOCK_STATE].requests) == 2
    finally:
        raw.close()
