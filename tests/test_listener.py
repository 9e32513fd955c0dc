"""The listener against clients that hold connections open: header and body deadlines, the
connection limit, the open-file limit. Real sockets over loopback against a proxy started as
production starts it (`_start_site`, and the CLI for the uvloop and rlimit paths)."""

from __future__ import annotations

import asyncio
import json
import re
import resource
import select
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from openai.types.chat import ChatCompletionMessageParam

from proxy.cli import _start_site
from proxy.config.load import parse_config
from proxy.pipeline.services import BODY_TIMED_OUT
from proxy.server.app import create_app
from proxy.server.listener import (
    ConnectionGuard,
    ListenerEvent,
    ListenerLimits,
    connection_budget,
)
from proxy.testing.mock_upstream import MOCK_STATE
from tests.helpers import config_for
from tests.servers import free_port

pytestmark = pytest.mark.timeout(60)

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
# A request head that never ends (no blank line): what a slowloris client sends.
PARTIAL_HEAD = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b"Authorization: Bearer sk-client-secret-1234\r\nX-Padding: " + b"a" * 40
)
# Every wait on the proxy is bounded by this; the passing tests need a fraction of it.
WAIT_S = 10.0

Start = Callable[[ListenerLimits], Awaitable[tuple[int, ConnectionGuard]]]


@pytest.fixture
async def start(upstream: TestServer) -> AsyncIterator[Start]:
    runners: list[web.AppRunner] = []

    async def go(limits: ListenerLimits) -> tuple[int, ConnectionGuard]:
        guard = ConnectionGuard(limits)
        app = create_app(config_for(str(upstream.make_url("/v1"))))
        runner, port = await _start_site(app, ("127.0.0.1", 0), drain_seconds=1.0, guard=guard)
        runners.append(runner)
        return port, guard

    yield go
    for r in runners:
        await r.cleanup()


def _read_to_end(s: socket.socket) -> bytes:
    """Everything the proxy sends until it closes the connection (a reset counts as closed)."""
    s.settimeout(WAIT_S)
    out = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


def _drip(port: int, data: bytes, every: float = 0.05, prefix: bytes = b"") -> bytes:
    """Send `prefix`, then `data` one byte at a time `every` seconds apart, until the proxy
    answers or closes; return what it sent. Fails if all of `data` went out first."""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as s:
        s.sendall(prefix)
        for i in range(len(data)):
            # Waiting for readability before each byte: once the proxy has answered we stop
            # sending, so no byte of ours meets a closed socket (which would reset it).
            readable, _, _ = select.select([s], [], [], every)
            if readable:
                return _read_to_end(s)
            s.sendall(data[i : i + 1])
        raise AssertionError("the whole slow head went out: the proxy never cut the connection")


def _exchange(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as s:
        s.sendall(request)
        return _read_to_end(s)


def _parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:])}
    return status, headers, body


def _assert_error(raw: bytes, status: int, code: str, type_: str) -> None:
    got, headers, body = _parse(raw)
    assert got == status
    assert headers["connection"] == "close"
    assert headers["content-type"] == "application/json"
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["code"], err["type"], err["param"]) == (code, type_, None)


async def _legit(port: int) -> str:
    async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1",
                                  api_key="sk-client-secret-1234", max_retries=0) as client:
        r = await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
    content = r.choices[0].message.content
    assert content
    return content


async def test_a_head_sent_a_byte_at_a_time_is_cut(start: Start, upstream: TestServer) -> None:
    port, guard = await start(ListenerLimits(header_timeout_s=0.5))
    async with asyncio.timeout(WAIT_S * 2):
        raw = await asyncio.to_thread(_drip, port, PARTIAL_HEAD)
    _assert_error(raw, 408, "request_timeout", "invalid_request_error")
    assert guard.events[ListenerEvent.HEADER_TIMEOUT] == 1
    assert guard.open == 0
    assert upstream.app[MOCK_STATE].requests == []


async def test_a_kept_alive_connection_idles_freely_then_its_next_head_is_timed(
    start: Start,
) -> None:
    """The idle wait between two requests is keepalive_timeout's, not the header deadline's;
    the next head's deadline starts at its first byte."""
    port, guard = await start(ListenerLimits(header_timeout_s=0.5))
    get = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"

    def run() -> tuple[bytes, bytes, bytes]:
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as s:
            s.sendall(get)
            first = s.recv(65536)
            # Idle past the header deadline: the connection must survive this.
            readable, _, _ = select.select([s], [], [], 1.0)
            assert not readable, "the proxy closed an idle kept-alive connection"
            s.sendall(get)
            second = s.recv(65536)
            # Now a next head sent a byte at a time: cut.
            for byte in PARTIAL_HEAD:
                readable, _, _ = select.select([s], [], [], 0.05)
                if readable:
                    return first, second, _read_to_end(s)
                s.sendall(bytes([byte]))
        raise AssertionError("the slow next head was never cut")

    async with asyncio.timeout(WAIT_S * 2):
        first, second, third = await asyncio.to_thread(run)
    assert _parse(first)[0] == 200 and _parse(second)[0] == 200
    _assert_error(third, 408, "request_timeout", "invalid_request_error")
    assert guard.events[ListenerEvent.HEADER_TIMEOUT] == 1


async def test_a_stalled_body_is_answered_408_and_cut(start: Start, upstream: TestServer) -> None:
    port, guard = await start(ListenerLimits(header_timeout_s=5.0, body_timeout_s=0.5))
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nAuthorization: Bearer sk-client-secret-1234\r\n"
            b"Content-Length: 500\r\n\r\n")
    async with asyncio.timeout(WAIT_S * 2):
        # The head at once, then the body a byte at a time: only the body deadline can end it.
        raw = await asyncio.to_thread(_drip, port, b'{"model": "mock-gpt", ' + b" " * 400,
                                      0.05, head)
    _assert_error(raw, 408, "request_timeout", "invalid_request_error")
    assert guard.events[ListenerEvent.BODY_TIMEOUT] == 1
    assert guard.events[ListenerEvent.HEADER_TIMEOUT] == 0
    assert upstream.app[MOCK_STATE].requests == []
    await _legit(port)  # and the proxy serves on
    # And the request is on the books as what it was, not as a client that went away.
    async with asyncio.timeout(WAIT_S), aiohttp.ClientSession() as http:
        while True:
            async with http.get(f"http://127.0.0.1:{port}/metrics") as resp:
                text = await resp.text()
            lines = [x for x in text.splitlines() if x.startswith("tokenmeter_requests_total{")]
            if len(lines) == 2:
                break
            await asyncio.sleep(0.02)
    assert any('error_class="body_timeout"' in x and 'status="408"' in x for x in lines), lines


async def test_a_handler_cancelled_by_the_body_deadline_can_tell() -> None:
    """The relay sees only a cancellation; the request says it was the body deadline."""
    seen: asyncio.Future[bool | None] = asyncio.get_running_loop().create_future()

    async def read_body(request: web.Request) -> web.Response:
        try:
            await request.read()
        except asyncio.CancelledError:
            seen.set_result(request.get(BODY_TIMED_OUT))
            raise
        return web.Response(text="read")

    app = web.Application()
    app.router.add_post("/upload", read_body)
    guard = ConnectionGuard(ListenerLimits(body_timeout_s=0.3))
    runner, port = await _start_site(app, ("127.0.0.1", 0), drain_seconds=1.0, guard=guard)
    try:
        async with asyncio.timeout(WAIT_S * 2):
            head = b"POST /upload HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 10\r\n\r\n"
            raw = await asyncio.to_thread(_exchange, port, head + b"12345")
            assert _parse(raw)[0] == 408
            assert await seen is True
    finally:
        await runner.cleanup()


async def test_over_the_connection_limit_a_503_then_service_once_slow_clients_are_cut(
    start: Start,
) -> None:
    port, guard = await start(ListenerLimits(header_timeout_s=2.0, max_connections=3))
    async with asyncio.timeout(WAIT_S * 2):
        slow = []
        for _ in range(3):
            s = await asyncio.to_thread(socket.create_connection, ("127.0.0.1", port), WAIT_S)
            s.sendall(PARTIAL_HEAD)  # and nothing more
            slow.append(s)
        try:
            # Connections are accepted in the order they were made: these three are counted
            # before this one arrives.
            raw = await asyncio.to_thread(
                _exchange, port, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
            )
            _assert_error(raw, 503, "too_many_connections", "server_error")
            assert guard.events[ListenerEvent.REFUSED] == 1
            for s in slow:  # the header deadline frees the slots
                assert _parse(await asyncio.to_thread(_read_to_end, s))[0] == 408
        finally:
            for s in slow:
                s.close()
        assert guard.open == 0
        assert await _legit(port)


def test_the_open_file_budget_caps_max_connections() -> None:
    server = parse_config("server: {max_connections: 4096}\nupstreams: {u: {base_url: http://x}}")
    assert ListenerLimits.from_config(server.server, 1024).max_connections == (
        connection_budget(1024)
    ) < 512
    assert ListenerLimits.from_config(server.server, 1 << 20).max_connections == 4096
    assert ListenerLimits.from_config(server.server, None).max_connections == 4096


# The CLI's main() in a process whose soft open-file limit starts low (as under a default
# `ulimit -n`), the hard one untouched.
LOW_FD_CLI = (
    "import resource, sys\n"
    "_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
    "resource.setrlimit(resource.RLIMIT_NOFILE, (min(512, hard), hard))\n"
    "from proxy.cli import main\n"
    "raise SystemExit(main(sys.argv[1:]))\n"
)


async def test_the_cli_raises_its_fd_limit_and_guards_its_port(
    upstream: TestServer, tmp_path: Path
) -> None:
    """Production's own start (CLI, uvloop): a low soft fd limit is raised to the hard one, a
    connection over server.max_connections gets the 503, slow heads are cut."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    cfg = tmp_path / "tm.yaml"
    cfg.write_text(
        "server:\n  header_timeout_s: 2.0\n  max_connections: 2\n"
        f"upstreams:\n  mock:\n    base_url: {upstream.make_url('/v1')}\n"
        "metrics:\n  discover_models: false\n"
    )
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", LOW_FD_CLI, "serve", "--config", str(cfg), "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )

    def wait_listening() -> list[str]:
        # Not a probe connection: it would count against max_connections for a moment.
        assert proc.stderr is not None
        lines = []
        for line in iter(proc.stderr.readline, ""):
            lines.append(line)
            if "tokenmeter listening on" in line:
                return lines
        raise AssertionError("the proxy exited: " + "".join(lines))

    try:
        async with asyncio.timeout(WAIT_S * 2):
            lines = await asyncio.to_thread(wait_listening)
            limits = Path(f"/proc/{proc.pid}/limits")
            if hard > 512 and limits.exists():
                m = re.search(r"Max open files\s+(\d+)\s+(\d+)", limits.read_text())
                assert m and int(m.group(1)) == hard
                assert any(f"raised the open-file limit from 512 to {hard}" in x for x in lines)
            slow = []
            for _ in range(2):
                s = await asyncio.to_thread(socket.create_connection, ("127.0.0.1", port), WAIT_S)
                s.sendall(PARTIAL_HEAD)
                slow.append(s)
            try:
                raw = await asyncio.to_thread(
                    _exchange, port, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
                )
                _assert_error(raw, 503, "too_many_connections", "server_error")
                for s in slow:
                    _assert_error(await asyncio.to_thread(_read_to_end, s), 408,
                                  "request_timeout", "invalid_request_error")
            finally:
                for s in slow:
                    s.close()
            assert await _legit(port)
            async with aiohttp.ClientSession() as http, http.get(
                f"http://127.0.0.1:{port}/metrics"
            ) as resp:
                text = await resp.text()
            assert 'tokenmeter_client_connections_closed_total{reason="refused"} 1.0' in text
            assert 'tokenmeter_client_connections_closed_total{reason="header_timeout"} 2.0' in text
            assert "tokenmeter_client_connections_open 1.0" in text  # this scrape's own
    finally:
        proc.terminate()
        await asyncio.to_thread(proc.communicate, timeout=WAIT_S)
    assert proc.returncode == 0
