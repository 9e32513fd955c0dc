"""Hostile intake (issue 20, items 2, 3, 5, 15 and 21's two keys): what a client without a valid
key, or with a compressed body, can make the proxy do before it is refused, and what every other
client of the same replica notices meanwhile.

The proxy runs as production runs it: the CLI in a subprocess (its own event loop, its own
memory, read from /proc), in front of the simulated upstream; hostile clients are raw sockets in
threads from 127.0.0.2, the legitimate client is aiohttp from 127.0.0.1, all over loopback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import threading
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from proxy.testing.mock_upstream import MOCK_STATE
from tests.helpers import (
    ALICE_KEY,
    BOB_KEY,
    Latencies,
    StackFactory,
    make_config,
    timed_client,
    until,
)
from tests.servers import free_port

pytestmark = pytest.mark.timeout(150)

HOSTILE = "127.0.0.2"  # every address of 127/8 is loopback: a second client address
LEGIT = "127.0.0.1"
WAIT_S = 20.0
SMALL = json.dumps({"model": "mock-gpt", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4}).encode()


# --- the proxy as a subprocess ------------------------------------------------------------------


@dataclass
class Proxy:
    port: int
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://{LEGIT}:{self.port}"

    def kb(self, field: str) -> int:
        """A figure of /proc/<pid>/status in kB (VmRSS: now; VmHWM: the peak so far)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
        raise AssertionError(f"no {field} in /proc/{self.proc.pid}/status")


StartProxy = Callable[..., Awaitable[Proxy]]


@pytest.fixture
async def start_proxy(upstream: TestServer, tmp_path: Path) -> AsyncIterator[StartProxy]:
    procs: list[Proxy] = []

    async def start(server: str = "") -> Proxy:
        n = len(procs)
        cfg = tmp_path / f"tm{n}.yaml"
        cfg.write_text(f"""
server:
  max_body_mb: 32
{server}
store: {{url: memory}}
upstreams:
  mock: {{base_url: "{upstream.make_url('/v1')}"}}
  claude: {{base_url: "{upstream.make_url('/v1')}", api: anthropic}}
models:
  - {{match: "claude-*", upstream: claude}}
  - {{match: "*", upstream: mock}}
metrics: {{model_labels: [mock-gpt], discover_models: false}}
users:
  alice: {{keys: ["{ALICE_KEY}"]}}
  bob: {{keys: ["{BOB_KEY}"]}}
""")
        port = free_port()
        log = tmp_path / f"proxy{n}.log"
        # The log goes to a file: a pipe nobody drains would block the proxy once it is full.
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "proxy", "serve", "--config", str(cfg), "--port",
                 str(port)], stdout=out, stderr=subprocess.STDOUT,
            )
        proxy = Proxy(port, proc, log)
        procs.append(proxy)

        def listening() -> bool:
            assert proc.poll() is None, "the proxy exited:\n" + log.read_text()
            return "tokenmeter listening on" in log.read_text()

        await until(listening, deadline=WAIT_S, every=0.05)
        return proxy

    yield start
    for p in procs:
        p.proc.terminate()
        try:
            await asyncio.to_thread(p.proc.wait, WAIT_S)
        except subprocess.TimeoutExpired:
            p.proc.kill()
            await asyncio.to_thread(p.proc.wait, WAIT_S)


# --- clients ------------------------------------------------------------------------------------


def _read_to_end(s: socket.socket, timeout: float = WAIT_S) -> bytes:
    """Everything the proxy sends until it closes the connection; a reset counts as closed."""
    s.settimeout(timeout)
    out = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


def _parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def _head(path: str, length: int, key: str | None = None, extra: str = "") -> bytes:
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{auth}{extra}"
            f"Content-Length: {length}\r\n\r\n").encode()


def _post_raw(port: int, head: bytes, body: bytes) -> bytes:
    """One request from the hostile address; the whole answer, read until the proxy closes."""
    with socket.create_connection((LEGIT, port), timeout=WAIT_S,
                                  source_address=(HOSTILE, 0)) as s:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(head)
            view = memoryview(body)
            for i in range(0, len(body), 1 << 20):
                s.sendall(view[i : i + (1 << 20)])
        return _read_to_end(s)


def _assert_openai_error(raw: bytes, status: int, code: str) -> dict[str, str]:
    got, headers, body = _parse(raw)
    assert got == status, raw[:500]
    assert json.loads(body)["error"]["code"] == code
    assert headers["x-tokenmeter-request-id"]
    return headers


async def _legit_while(port: int, hostile: Callable[[], object]) -> Latencies:
    """Small requests from the legitimate address, one after another, for as long as
    `hostile` runs (in a thread), each timed (`tests.helpers.timed_client`)."""
    connector = aiohttp.TCPConnector(local_addr=(LEGIT, 0))
    headers = {"Authorization": f"Bearer {ALICE_KEY}", "Content-Type": "application/json"}
    url = f"http://{LEGIT}:{port}/v1/chat/completions"
    async with aiohttp.ClientSession(connector=connector) as http:

        async def one() -> int:
            async with http.post(url, data=SMALL, headers=headers) as r:
                await r.read()
                return r.status

        for _ in range(5):  # warm: the first requests pay for imports and pools
            assert await one() == 200
        async with timed_client(one) as latencies:
            await asyncio.to_thread(hostile)  # its assertion errors, if any
    return latencies


def _in_threads(count: int, work: Callable[[int], object]) -> list[object]:
    """`work(i)` for i in range(count), each in a thread; an exception is its result (the
    answers' assertions then name it)."""
    results: list[object] = [None] * count

    def run(i: int) -> None:
        try:
            results[i] = work(i)
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S * 3)
    assert all(r is not None for r in results), results
    return results


# --- item 2: gzip request bodies ----------------------------------------------------------------


def _bomb(inflated_mb: int) -> bytes:
    """A gzip body of `inflated_mb` MB of zeros (about 4.5 KB per MB at level 1)."""
    packer = zlib.compressobj(1, zlib.DEFLATED, 31)
    zeros = b"\0" * (1 << 20)
    return b"".join([*(packer.compress(zeros) for _ in range(inflated_mb)), packer.flush()])


async def test_gzip_bombs_are_refused_unread_memory_stays_flat_and_others_are_served(
    start_proxy: StartProxy,
) -> None:
    """Six concurrent 128 MB gzip bombs (768 MB inflated), four times, half with a valid key:
    415 for those, 401 for the others, each answered from its headers; the proxy's peak RSS
    does not grow by more than 64 MB, and a legitimate client is answered within 300 ms
    throughout."""
    proxy = await start_proxy()
    bomb = await asyncio.to_thread(_bomb, 128)
    rss_before, peak_before = proxy.kb("VmRSS"), proxy.kb("VmHWM")
    sampled: list[int] = []
    stop = threading.Event()

    def sample() -> None:  # RSS every 5 ms: a peak the kernel's VmHWM would hide under startup's
        while not stop.wait(0.005):
            sampled.append(proxy.kb("VmRSS"))

    sampler = threading.Thread(target=sample)
    sampler.start()
    answers: list[object] = []

    def bombs() -> None:
        for _ in range(4):  # rounds, so the legitimate client asks during each
            answers.extend(_in_threads(6, lambda i: _post_raw(
                proxy.port,
                _head("/v1/chat/completions", len(bomb), ALICE_KEY if i % 2 else None,
                      "Content-Encoding: gzip\r\n"),
                bomb,
            )))

    try:
        latencies = await _legit_while(proxy.port, bombs)
    finally:
        stop.set()
        sampler.join()
    peak_after = proxy.kb("VmHWM")
    growth_mb = (max([*sampled, peak_after if peak_after > peak_before else 0]) - rss_before) / 1024
    print(f"RSS growth {growth_mb:.1f} MB; legitimate latencies (s): max "
          f"{max(latencies.seen):.3f}, n {len(latencies.seen)}")
    assert growth_mb < 64, f"the proxy's RSS grew by {growth_mb:.0f} MB"
    latencies.check(at_least=3)
    for i, raw in enumerate(answers):
        assert isinstance(raw, bytes), raw
        if i % 2:
            headers = _assert_openai_error(raw, 415, "unsupported_content_encoding")
            assert headers["accept-encoding"] == "identity"
        else:
            headers = _assert_openai_error(raw, 401, "invalid_api_key")
        assert headers["connection"] == "close"


async def test_a_valid_gzip_request_is_refused_415_in_each_apis_shape_never_forwarded(
    start_proxy: StartProxy, upstream: TestServer,
) -> None:
    proxy = await start_proxy()
    mock = upstream.app[MOCK_STATE]
    openai_body = zlib.compress(SMALL, wbits=31)
    anthropic_body = zlib.compress(json.dumps({
        "model": "claude-x", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
    }).encode(), wbits=31)
    async with aiohttp.ClientSession() as http:
        async with http.post(proxy.url + "/v1/chat/completions", data=openai_body, headers={
            "Authorization": f"Bearer {ALICE_KEY}", "Content-Type": "application/json",
            "Content-Encoding": "gzip",
        }) as r:
            assert r.status == 415
            assert (await r.json())["error"]["code"] == "unsupported_content_encoding"
            assert r.headers["Accept-Encoding"] == "identity"
            assert r.headers["x-tokenmeter-request-id"]
        async with http.post(proxy.url + "/v1/messages", data=anthropic_body, headers={
            "x-api-key": ALICE_KEY, "Content-Type": "application/json",
            "Content-Encoding": "gzip", "anthropic-version": "2023-06-01",
        }) as r:
            assert r.status == 415
            body = await r.json()
            assert body["type"] == "error"
            assert body["error"]["type"] == "invalid_request_error"
            assert r.headers["x-tokenmeter-request-id"]
        # identity is no compression: served as usual
        async with http.post(proxy.url + "/v1/chat/completions", data=SMALL, headers={
            "Authorization": f"Bearer {ALICE_KEY}", "Content-Type": "application/json",
            "Content-Encoding": "identity",
        }) as r:
            assert r.status == 200, await r.text()
    assert len(mock.requests) == 1
    # (what goes upstream is never labelled with a coding it does not have)
    assert mock.requests[0].headers.get("Content-Encoding", "identity") == "identity"


# --- item 3: authenticate from the headers; large bodies --------------------------------------


async def test_a_body_without_a_key_is_refused_from_the_headers_alone(
    start_proxy: StartProxy,
) -> None:
    """Only the head of a 28 MB request is sent: the 401 must come without the body (old: the
    proxy waited for the whole body before looking at the key)."""
    proxy = await start_proxy()
    for key in (None, "sk-wrong-key-000"):
        def ask(key: str | None = key) -> bytes:
            with socket.create_connection((LEGIT, proxy.port), timeout=5,
                                          source_address=(HOSTILE, 0)) as s:
                s.sendall(_head("/v1/chat/completions", 28 << 20, key))
                s.settimeout(5)
                head = b""
                while b"\r\n\r\n" not in head:
                    chunk = s.recv(65536)
                    assert chunk, "closed without an answer"
                    head += chunk
                return head

        raw = await asyncio.to_thread(ask)
        status, headers, _ = _parse(raw)
        assert status == 401
        assert headers["connection"] == "close"
        assert headers["x-tokenmeter-request-id"]


async def test_a_body_without_a_key_is_not_drained_the_connection_is_closed(
    start_proxy: StartProxy,
) -> None:
    """Issue 31, item 8: after its 401, the rest of a keyless body used to be read and thrown
    away (aiohttp's lingering close: up to 10 s of reading, CPU for every byte). Now the proxy
    stops reading once the 401 is out: a client that sent the head and 1 MB of a 30 MB body
    gets the 401 (`Connection: close`) and the end of the connection, and what it tries to send
    after that stays in the kernel's buffers, unread, until the proxy closes (old: the proxy
    took all 29 MB of the rest at once)."""
    proxy = await start_proxy()
    length = 30 << 20

    def hostile() -> tuple[bytes, int, bytes]:
        with socket.create_connection((LEGIT, proxy.port), timeout=WAIT_S,
                                      source_address=(HOSTILE, 0)) as s:
            s.sendall(_head("/v1/chat/completions", length))
            s.sendall(b"0" * (1 << 20))
            answer = b""
            while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
                chunk = s.recv(65536)
                assert chunk, "closed without an answer"
                answer += chunk
            sent = 1 << 20
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                while sent < length:  # blocks once the buffers are full: nobody reads
                    sent += s.send(b"0" * 65536)
            return answer, sent, _read_to_end(s)

    answer, sent, rest = await asyncio.to_thread(hostile)
    assert _assert_openai_error(answer, 401, "invalid_api_key")["connection"] == "close"
    assert rest == b""  # nothing after the answer: the proxy ended the connection
    # What the client got into the kernel's buffers before the proxy closed: a few MB (here
    # about 3), never the whole body.
    assert sent < length // 2, sent


def _big_body(mb: int) -> bytes:
    """A JSON chat body of `mb` MB made of many small values: costly to parse (a long list)."""
    head = b'{"model": "mock-gpt", "messages": [{"role": "user", "content": "hi"}], "pad": ['
    count = (mb << 20) // 2
    return head + b"0," * (count - 1) + b"0]}"


async def test_two_28mb_bodies_without_a_key_do_not_slow_other_clients(
    start_proxy: StartProxy,
) -> None:
    proxy = await start_proxy()
    body = _big_body(28)
    answers: list[object] = []

    def hostile() -> None:
        for _ in range(2):
            answers.extend(_in_threads(2, lambda i: _post_raw(
                proxy.port, _head("/v1/chat/completions", len(body), None if i else "sk-wrong"),
                body,
            )))

    latencies = await _legit_while(proxy.port, hostile)
    print(f"legitimate latencies (s): max {max(latencies.seen):.3f}, n {len(latencies.seen)}")
    latencies.check(at_least=3)
    for raw in answers:
        assert isinstance(raw, bytes), raw
        assert _assert_openai_error(raw, 401, "invalid_api_key")["connection"] == "close"


# --- item 5: connection slots ------------------------------------------------------------------


async def test_unauthenticated_connections_are_closed_after_their_401_and_others_are_served(
    start_proxy: StartProxy,
) -> None:
    """300 wrong-key connections that would stay open (old: each held a slot for
    keepalive_timeout_s, and with max_connections 200 the legitimate client got 503s)."""
    proxy = await start_proxy("  max_connections: 200")
    request = _head("/v1/chat/completions", len(SMALL), "sk-wrong-key-000") + SMALL
    answers: list[object] = []

    def flood() -> None:
        held: list[socket.socket] = []
        try:
            for _ in range(300):
                s = socket.create_connection((LEGIT, proxy.port), timeout=WAIT_S,
                                             source_address=(HOSTILE, 0))
                held.append(s)  # never closed by this client until the end
                s.sendall(request)
                # The proxy, not the client, ends the connection after its answer (old: it
                # stayed open for keepalive_timeout_s; this read's 5 s bound then fails).
                answers.append(_read_to_end(s, 5))
        finally:
            for s in held:
                s.close()

    latencies = await _legit_while(proxy.port, flood)
    print(f"legitimate latencies (s): max {max(latencies.seen):.3f}, n {len(latencies.seen)}")
    latencies.check(at_least=3)
    assert len(answers) == 300
    for raw in answers:
        assert isinstance(raw, bytes)
        assert _assert_openai_error(raw, 401, "invalid_api_key")["connection"] == "close"


async def test_one_address_cannot_take_every_connection(start_proxy: StartProxy) -> None:
    proxy = await start_proxy("  max_connections: 40\n  max_connections_per_source: 10")
    held: list[socket.socket] = []
    refused: list[bytes] = []
    try:
        for _ in range(40):  # idle connections: each would hold a slot for header_timeout_s
            s = await asyncio.to_thread(socket.create_connection, (LEGIT, proxy.port), WAIT_S,
                                        (HOSTILE, 0))
            held.append(s)
        for s in held[10:]:  # past the tenth, each is answered at once and closed
            refused.append(await asyncio.to_thread(_read_to_end, s))
        # Another address is served meanwhile (old: 503 too_many_connections).
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(local_addr=(LEGIT, 0))
        ) as http, http.post(
            proxy.url + "/v1/chat/completions", data=SMALL,
            headers={"Authorization": f"Bearer {ALICE_KEY}", "Content-Type": "application/json"},
        ) as r:
            assert r.status == 200, await r.text()
        async with aiohttp.ClientSession() as http, http.get(proxy.url + "/metrics") as r:
            metrics = await r.text()
    finally:
        for s in held:
            s.close()
    for raw in refused:
        status, headers, body = _parse(raw)
        assert status == 429 and headers["connection"] == "close"
        assert json.loads(body)["error"]["code"] == "too_many_connections"
    assert 'tokenmeter_client_connections_closed_total{reason="source_limit"} 30.0' in metrics


def test_the_per_source_limit_has_a_default() -> None:
    from proxy.config.load import parse_config
    from proxy.server.listener import ListenerLimits

    config = parse_config("upstreams: {u: {base_url: http://x}}")
    assert config.server.max_connections_per_source == 256
    assert ListenerLimits.from_config(config.server).max_connections_per_source == 256
    off = parse_config("server: {max_connections_per_source: null}\n"
                       "upstreams: {u: {base_url: http://x}}")
    assert ListenerLimits.from_config(off.server).max_connections_per_source is None


# --- item 15: the proxy's own errors name their row ----------------------------------------------


async def test_the_proxys_own_errors_carry_the_request_id(
    make_stack: StackFactory, upstream: TestServer,
) -> None:
    url = str(upstream.make_url("/v1"))
    config = make_config(url, store="memory", users={
        "alice": {"keys": [ALICE_KEY], "daily_tokens": 1},
    }, extra={
        "upstreams": {"mock": {"base_url": url}, "claude": {"base_url": url, "api": "anthropic"}},
        "models": [{"match": "claude-*", "upstream": "claude"},
                   {"match": "mock-*", "upstream": "mock"}],
        "server": {"max_body_mb": 0.01},
    })
    stack = await make_stack(config)
    oa = {"Authorization": f"Bearer {ALICE_KEY}"}
    an = {"x-api-key": ALICE_KEY, "anthropic-version": "2023-06-01"}
    claude = {"model": "claude-x", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    cases: list[tuple[str, dict[str, str], bytes, int]] = [
        ("/v1/chat/completions", {}, SMALL, 401),
        ("/v1/chat/completions", oa, b"{not json", 400),
        ("/v1/chat/completions", oa, SMALL.replace(b"mock-gpt", b"other"), 404),
        ("/v1/chat/completions", oa, b" " * 20_000, 413),
        ("/v1/chat/completions", oa, SMALL, 429),
        ("/v1/messages", {"x-api-key": "sk-wrong-000"}, json.dumps(claude).encode(), 401),
        ("/v1/messages", an, b"[]", 400),
        ("/v1/messages", an, json.dumps(claude).encode(), 429),
    ]
    seen: list[str] = []
    async with aiohttp.ClientSession() as http:
        for path, headers, body, status in cases:
            async with http.post(stack.proxy.make_url(path), data=body, headers={
                "Content-Type": "application/json", **headers,
            }) as r:
                assert r.status == status, (path, status, await r.text())
                request_id = r.headers.get("x-tokenmeter-request-id")
                assert request_id, (path, status)
                seen.append(request_id)
    assert len(set(seen)) == len(seen)
    # The id is the one the request is booked under (the access log carries the row's id).
    await stack.settled(len(cases))
    logged = {line["request_id"] for line in stack.access_lines()}
    assert set(seen[1:5] + seen[6:]) <= logged


# --- item 21: two different keys ------------------------------------------------------------------


async def test_two_different_keys_in_one_request_are_refused(
    make_stack: StackFactory, upstream: TestServer,
) -> None:
    """Bearer used to win silently over x-api-key (and api-key): the request was billed to a
    principal its client may not have meant. Now a 401 in the route's shape; the same key in
    two headers is fine."""
    url = str(upstream.make_url("/v1"))
    stack = await make_stack(make_config(url, store="memory", users={
        "alice": {"keys": [ALICE_KEY]}, "bob": {"keys": [BOB_KEY]},
    }, extra={
        "upstreams": {"mock": {"base_url": url}, "claude": {"base_url": url, "api": "anthropic"}},
        "models": [{"match": "claude-*", "upstream": "claude"}, {"match": "*", "upstream": "mock"}],
    }))
    claude = json.dumps({"model": "claude-x", "max_tokens": 4,
                         "messages": [{"role": "user", "content": "x"}]}).encode()
    async with aiohttp.ClientSession() as http:
        async with http.post(stack.proxy.make_url("/v1/messages"), data=claude, headers={
            "Authorization": f"Bearer {ALICE_KEY}", "x-api-key": BOB_KEY,
            "anthropic-version": "2023-06-01", "Content-Type": "application/json",
        }) as r:
            assert r.status == 401
            body = await r.json()
            assert body["type"] == "error"
            assert body["error"]["type"] == "authentication_error"
            assert ALICE_KEY not in body["error"]["message"]
            assert BOB_KEY not in body["error"]["message"]
            assert r.headers["Connection"] == "close"
        async with http.post(stack.proxy.make_url("/v1/chat/completions"), data=SMALL, headers={
            "Authorization": f"Bearer {ALICE_KEY}", "api-key": BOB_KEY,
            "Content-Type": "application/json",
        }) as r:
            assert r.status == 401
            assert (await r.json())["error"]["code"] == "invalid_api_key"
        async with http.post(stack.proxy.make_url("/v1/messages"), data=claude, headers={
            "Authorization": f"Bearer {ALICE_KEY}", "x-api-key": ALICE_KEY,
            "anthropic-version": "2023-06-01", "Content-Type": "application/json",
        }) as r:
            assert r.status == 200, await r.text()
    assert len(stack.mock.requests) == 1


async def test_two_lines_of_one_key_header_with_different_keys_are_refused(
    make_stack: StackFactory, upstream: TestServer,
) -> None:
    """Issue 31, item 16: two `Authorization` (or two `x-api-key`) lines with different keys
    used to be accepted and the first one billed. Now a 401 in the route's shape, as for two
    different key headers; the same key on two lines is fine. Raw HTTP: no client library
    sends a header twice."""
    url = str(upstream.make_url("/v1"))
    stack = await make_stack(make_config(url, store="memory", users={
        "alice": {"keys": [ALICE_KEY]}, "bob": {"keys": [BOB_KEY]},
    }, extra={
        "upstreams": {"mock": {"base_url": url}, "claude": {"base_url": url, "api": "anthropic"}},
        "models": [{"match": "claude-*", "upstream": "claude"}, {"match": "*", "upstream": "mock"}],
    }))
    claude = json.dumps({"model": "claude-x", "max_tokens": 4,
                         "messages": [{"role": "user", "content": "x"}]}).encode()

    def ask(path: str, lines: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"anthropic-version: 2023-06-01\r\n{lines}Content-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n").encode()
        with socket.create_connection(("127.0.0.1", stack.proxy.port), timeout=WAIT_S) as s:
            s.sendall(head + body)
            return _parse(_read_to_end(s))

    bearer = f"Authorization: Bearer {ALICE_KEY}\r\nAuthorization: Bearer {BOB_KEY}\r\n"
    status, headers, body = await asyncio.to_thread(ask, "/v1/chat/completions", bearer, SMALL)
    assert status == 401, body
    assert json.loads(body)["error"]["code"] == "invalid_api_key"
    assert headers["connection"] == "close"
    assert ALICE_KEY.encode() not in body and BOB_KEY.encode() not in body
    two = f"x-api-key: {BOB_KEY}\r\nx-api-key: {ALICE_KEY}\r\n"
    status, _, body = await asyncio.to_thread(ask, "/v1/messages", two, claude)
    assert status == 401, body
    error = json.loads(body)
    assert error["type"] == "error" and error["error"]["type"] == "authentication_error"
    assert ALICE_KEY.encode() not in body and BOB_KEY.encode() not in body
    # The same key on two lines is one key.
    same = f"x-api-key: {ALICE_KEY}\r\nx-api-key: {ALICE_KEY}\r\n"
    status, _, body = await asyncio.to_thread(ask, "/v1/messages", same, claude)
    assert status == 200, body
    assert len(stack.mock.requests) == 1


async def test_a_large_body_is_parsed_in_a_thread_with_the_same_answers(
    make_stack: StackFactory, upstream: TestServer,
) -> None:
    """Bodies over 256 KB go through the thread: a valid one is served, a malformed one gets the
    same clean 400 as on the loop."""
    stack = await make_stack(make_config(str(upstream.make_url("/v1")), store="memory",
                                         users={"alice": {"keys": [ALICE_KEY]}}))
    prompt = "word " * 80_000  # 400 KB
    good = json.dumps({"model": "mock-gpt", "max_tokens": 4,
                       "messages": [{"role": "user", "content": prompt}]}).encode()
    headers = {"Authorization": f"Bearer {ALICE_KEY}", "Content-Type": "application/json"}
    async with aiohttp.ClientSession() as http:
        async with http.post(stack.proxy.make_url("/v1/chat/completions"), data=good,
                             headers=headers) as r:
            assert r.status == 200, await r.text()
        async with http.post(stack.proxy.make_url("/v1/chat/completions"), data=good[:-1],
                             headers=headers) as r:
            assert r.status == 400
            assert (await r.json())["error"]["code"] == "invalid_request"
    assert len(stack.mock.requests) == 1
