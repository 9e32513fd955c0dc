"""Property test: thousands of malformed, hostile or merely odd requests, over real HTTP, against
a proxy in front of the mock upstream whose answers are cut at random byte offsets, salted with
garbage or reset mid-stream.

After every single request it checks what must always hold:
- the proxy itself never answers 5xx, and every JSON error has OpenAI's four fields;
- what the proxy refused never reached the upstream;
- every request that reached an endpoint was settled once and counted once;
- the usage the proxy recorded as `reported` is exactly the usage the upstream reported;
- the budget store holds exactly the tokens the metrics recorded;
- nothing was logged at error level (no unhandled exception anywhere).

The servers run on their own event loop in a thread so that hypothesis drives a plain
synchronous test, with a stdlib HTTP client on a raw socket: it can send anything, split anywhere.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import socket
import threading
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from proxy.budget.store import Store
from proxy.budget.usage_report import read_usage, today
from proxy.cli import ClientErrorFilter
from proxy.config.load import Config, parse_config
from proxy.pipeline import services as pst
from proxy.server.app import create_app
from proxy.testing.mock_upstream import MOCK_STATE, MockSettings, create_mock_app
from tests.helpers import settled, settled_count

T = TypeVar("T")
KEY = "sk-fuzz-alice-0001"
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings")
# Codes of the errors the proxy itself originates, before or instead of calling the upstream.
PROXY_CODES = {"invalid_request", "unknown_url", "method_not_allowed", "invalid_api_key",
               "request_too_large", "model_not_found", "daily_quota_exceeded",
               "rate_limit_exceeded", "concurrency_limit_exceeded"}


class ErrorRecords(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class Servers:
    """Mock upstream and proxy on one loop in a background thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.runners: list[web.AppRunner] = []
        self.port = 0

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _site(self, app: web.Application) -> int:
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.runners.append(runner)
        return int(runner.addresses[0][1])

    async def _start(self) -> None:
        self.mock = create_mock_app(MockSettings(tokens_per_second=0, ttft_ms=0, output_tokens=8))
        mock_port = await self._site(self.mock)
        self.config: Config = parse_config(f"""
server: {{max_body_mb: 0.002}}
store: {{url: memory}}
upstreams:
  mock:
    base_url: http://127.0.0.1:{mock_port}/v1
    idle_timeout_s: 5
    retry: {{initial_backoff_ms: 1, max_attempts: 2}}
metrics: {{model_labels: [mock-gpt], discover_models: false}}
users:
  alice: {{keys: ["{KEY}"], daily_tokens: 100000000, max_output_tokens: 64}}
""")
        self.app = create_app(self.config)
        self.port = await self._site(self.app)

    def start(self) -> None:
        self.thread.start()
        self.run(self._start())

    def stop(self) -> None:
        async def stop() -> None:
            for runner in reversed(self.runners):
                await runner.cleanup()

        self.run(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _snapshot(self) -> Snapshot:
        metrics = self.app[pst.SERVICES].metrics.registry
        reported = requests = total = 0.0
        for family in metrics.collect():
            for s in family.samples:
                if s.name == "tokenmeter_tokens_total" and s.labels["type"] in ("input", "output"):
                    total += s.value
                    if s.labels["source"] == "reported":
                        reported += s.value
                elif s.name == "tokenmeter_requests_total":
                    requests += s.value
        store: Store = self.app[pst.SERVICES].budget.store
        (alice,) = await read_usage(
            self.config, store, today(self.config, self.app[pst.SERVICES].budget.clock())
        )
        mock = self.mock[MOCK_STATE]
        return Snapshot(
            settled=settled_count(self.app),
            upstream_requests=len(mock.requests),
            upstream_usage=mock.reported["prompt_tokens"] + mock.reported["completion_tokens"],
            recorded_reported=int(reported),
            recorded_total=int(total),
            requests=int(requests),
            store_tokens=alice.tokens,
        )

    def snapshot(self) -> Snapshot:
        return self.run(self._snapshot())

    def wait_settled(self, count: int) -> None:
        self.run(settled(self.app, count, deadline=5))


@dataclass(frozen=True)
class Snapshot:
    settled: int
    upstream_requests: int
    upstream_usage: int
    recorded_reported: int
    recorded_total: int
    requests: int
    store_tokens: int


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Servers, ErrorRecords]]:
    # A state directory of its own (the autouse one is per test, made after this): the default
    # one is shared with every other run on the machine, whose ledger file may be at another
    # schema.
    state = pytest.MonkeyPatch()
    state.setenv("TOKENMETER_STATE_DIR", str(tmp_path_factory.mktemp("fuzz-state")))
    errors = ErrorRecords()
    root = logging.getLogger()
    demote = ClientErrorFilter()
    logging.getLogger("aiohttp.server").addFilter(demote)
    root.addHandler(errors)
    s = Servers()
    s.start()
    try:
        yield s, errors
    finally:
        s.stop()
        root.removeHandler(errors)
        logging.getLogger("aiohttp.server").removeFilter(demote)
        state.undo()


# --- what to send ----------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
messages = st.one_of(
    st.just([{"role": "user", "content": "hi"}]),
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "bogus"]),
                                    "content": st.one_of(st.text(max_size=30), json_values)}),
             max_size=3),
    json_values,
)
body_dicts = st.fixed_dictionaries(
    {"model": st.one_of(st.just("mock-gpt"), st.just("mock-gpt"), st.text(max_size=12),
                        json_values)},
    optional={
        "messages": messages,
        "prompt": st.one_of(st.text(max_size=30), json_values),
        "input": st.one_of(st.text(max_size=30), st.lists(st.text(max_size=10), max_size=3),
                           json_values),
        "stream": st.one_of(st.booleans(), st.booleans(), json_values),
        "stream_options": st.one_of(st.just({"include_usage": True}), json_values),
        "max_tokens": st.one_of(st.integers(-3, 100), json_values),
        "max_output_tokens": st.one_of(st.integers(-3, 100), json_values),
        "n": st.integers(0, 3),
    },
)
bodies = st.one_of(
    body_dicts.map(lambda d: json.dumps(d).encode()),
    body_dicts.map(lambda d: json.dumps(d).encode()),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=200),
    st.just(b"x" * 3000),  # over server.max_body_mb
)
header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=16)
mock_faults = st.fixed_dictionaries({}, optional={
    "x-mock-chunk-seed": st.integers(0, 10**6).map(str),
    "x-mock-garbage-after": st.integers(0, 10).map(str),
    "x-mock-reset-after": st.integers(0, 10).map(str),
    "x-mock-output-tokens": st.one_of(st.integers(0, 40).map(str), header_text),
    "x-mock-usage": st.sampled_from(["on", "off", "maybe"]),
    "x-mock-cached-tokens": st.one_of(st.integers(0, 5).map(str), header_text),
})
odd_headers = st.dictionaries(
    st.sampled_from(["X-Custom", "Accept-Encoding", "Expect", "Content-Encoding", "Api-Key",
                     "X-Api-Key", "OpenAI-Organization", "Cookie", "Upgrade", "TE"]),
    header_text, max_size=3,
)
raw_header_bytes = st.sampled_from([b"", b"", b"", b"X-Bad: a\x00b\r\n", b"X-Bad: \xff\xfe\r\n",
                                    b"Transfer-Encoding: chunked\r\n", b"X Bad: 1\r\n"])


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    auth: str | None
    content_type: str | None
    headers: dict[str, str]
    raw_header: bytes
    body: bytes
    cuts: tuple[int, ...]

    def encode(self) -> bytes:
        lines = [f"{self.method} {self.path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close",
                 f"Content-Length: {len(self.body)}"]
        if self.auth is not None:
            lines.append(f"Authorization: {self.auth}")
        if self.content_type is not None:
            lines.append(f"Content-Type: {self.content_type}")
        lines.extend(f"{k}: {v}" for k, v in self.headers.items())
        head = "\r\n".join(lines).encode() + b"\r\n" + self.raw_header + b"\r\n"
        return head + self.body

    def pieces(self) -> Iterator[bytes]:
        data, start = self.encode(), 0
        for cut in self.cuts:
            if start < cut < len(data):
                yield data[start:cut]
                start = cut
        yield data[start:]


requests = st.builds(
    Request,
    method=st.sampled_from(["POST"] * 6 + ["GET", "PUT", "DELETE", "OPTIONS"]),
    path=st.one_of(
        st.sampled_from(ENDPOINTS), st.sampled_from(ENDPOINTS), st.sampled_from(ENDPOINTS),
        st.sampled_from(["/v1/models", "/v1/chat/completions/", "/v1//chat/completions",
                         "/V1/chat/completions", "/v1/chat/completions?stream=true", "/metrics",
                         "/v1/../metrics", "/healthz"]),
        st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=20).map(
            lambda p: "/" + p.replace("#", "")),
    ),
    auth=st.sampled_from([f"Bearer {KEY}"] * 4 + [None, "Bearer wrong", "Bearer ", "Basic eDp5",
                                                  f"bearer {KEY}", f"Bearer {KEY} extra"]),
    content_type=st.sampled_from(["application/json", "application/json", None, "text/plain"]),
    headers=st.builds(lambda a, b: {**a, **b}, mock_faults, odd_headers),
    raw_header=raw_header_bytes,
    body=bodies,
    cuts=st.lists(st.integers(1, 400), max_size=4).map(lambda c: tuple(sorted(c))),
)


def send(port: int, req: Request) -> tuple[int, str, bytes, bool]:
    """Status, content type, body, and whether the body arrived whole. Status 0: the server
    refused the request before it was fully sent and reset the connection (as it may, for a
    body over the size limit or a malformed head) so no response could be read."""
    with socket.create_connection(("127.0.0.1", port), timeout=15) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            for piece in req.pieces():
                sock.sendall(piece)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the answer, if any, is already on its way
        response = http.client.HTTPResponse(sock)
        try:
            response.begin()
        except (ConnectionError, http.client.RemoteDisconnected):
            return 0, "", b"", False
        try:
            body, whole = response.read(), True
        except (http.client.IncompleteRead, ConnectionError) as exc:
            body, whole = getattr(exc, "partial", b""), False
        return response.status, response.getheader("Content-Type") or "", body, whole


# --- the property ----------------------------------------------------------------------------


# How many examples, the seed and the deadline come from the profile conftest.py loads
# (HYPOTHESIS_PROFILE: "ci" by default, "thorough" on demand).
@given(req=requests)
def test_no_input_breaks_the_proxy_or_its_books(
    servers: tuple[Servers, ErrorRecords], req: Request
) -> None:
    s, errors = servers
    before = s.snapshot()
    status, content_type, body, whole = send(s.port, req)
    protocol_error = status == 0 or (status == 400 and content_type.startswith("text/plain"))
    # aiohttp answers an `Expect` it does not support with 417 itself, before any handler.
    routed = (req.method == "POST" and req.path.split("?")[0] in ENDPOINTS and not protocol_error
              and status != 417)
    if routed:
        s.wait_settled(before.settled + 1)
    after = s.snapshot()

    assert status < 500, (status, body[:300])
    if content_type.startswith("application/json") and status >= 400:
        err = json.loads(body)["error"]
        assert set(err) == {"message", "type", "param", "code"}
        if err["code"] in PROXY_CODES:
            assert after.upstream_requests == before.upstream_requests
    if protocol_error or not routed:
        assert after.upstream_requests == before.upstream_requests or req.path == "/v1/models"
    if status == 0:  # refused mid-send: only ever before the request reached a handler
        assert after.settled == before.settled
    elif not whole:  # only a stream the upstream itself broke mid-event may end like this
        assert "x-mock-reset-after" in req.headers or "x-mock-garbage-after" in req.headers
    # Settled once, counted once.
    assert after.settled - before.settled == (1 if routed else 0)
    assert after.requests - before.requests == after.settled - before.settled
    # Exact books: what the upstream reported is what was recorded as reported...
    assert (after.recorded_reported - before.recorded_reported
            == after.upstream_usage - before.upstream_usage)
    # ...and the budget store holds everything recorded, reported and estimated.
    assert after.store_tokens == after.recorded_total
    assert errors.records == [], [r.getMessage() for r in errors.records]
