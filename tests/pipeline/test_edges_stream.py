"""Streams and disconnects at the edges, each through the real openai SDK (or raw sockets where
the SDK would hide the wire), a real proxy and a real upstream over loopback:

- a long stream's metering memory is bounded, and its estimate still exact;
- a client that reads slowly is not mistaken for a silent upstream;
- a client that hangs up as its request is answered is a client_disconnect, never an error;
- a 200 stream that ends without its final event is an error the SDK raises, not a success;
- a 500 that blames the request is not retried or handed to a fallback, and a JSON request
  abandoned while the upstream has it is charged its prompt.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import sys
import tracemalloc
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import aiohttp
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from openai.types.chat import ChatCompletionMessageParam

from proxy.config.load import Config, parse_config
from proxy.protocol import tokenizer
from proxy.protocol.tap import StreamTap
from proxy.protocol.translators import (
    HOLD_BYTES,
    ChatTranslator,
    CompletionsTranslator,
    EventFlag,
    ResponsesTranslator,
    Translator,
    parse_body,
)
from proxy.server.app import create_app
from proxy.telemetry.meter import RequestMeter
from proxy.testing.mock_upstream import (
    MOCK_STATE,
    MockSettings,
    MockState,
    create_mock_app,
    generated_text,
)
from tests.helpers import ServerFactory, config_for, relayed, sample, scrape, settled, until

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Count slowly for me."}]


def mock_of(server: TestServer) -> MockState:
    return server.app[MOCK_STATE]


def sdk(server: TestServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="sk-unused",
                              max_retries=0)


async def proxy_for(aiohttp_server: ServerFactory, config: Config) -> TestServer:
    return await aiohttp_server(create_app(config))


def access_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "tokenmeter.access"]


def errors_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [f"{r.name}: {r.getMessage()}" for r in caplog.records
            if r.levelno >= logging.ERROR and r.name.startswith("tokenmeter")]


@pytest.fixture(autouse=True)
def _logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tokenmeter")


@pytest.fixture
async def upstream(aiohttp_server: ServerFactory) -> TestServer:
    return await aiohttp_server(create_mock_app(MockSettings(tokens_per_second=0, ttft_ms=0,
                                                             output_tokens=12)))


# --- 9: a long stream's metering memory is bounded ---------------------------------------------


def _held(tr: Translator) -> int:
    """The memory of the events `tr` holds for its estimate: its list and the events in it."""
    events: list[bytes] = tr.reader.output.events
    return sys.getsizeof(events) + sum(map(sys.getsizeof, events))


class _Recording(ChatTranslator):
    """The real chat translator, also noting the most memory it ever held for its estimate."""

    made: ClassVar[list[_Recording]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.peak = self.events = 0
        _Recording.made.append(self)

    def on_event(self, data: bytes, name: str | None, marked: bool | None = None) -> EventFlag:
        flags = super().on_event(data, name, marked)
        self.events += 1
        if self.events % 16 == 0:  # measuring is O(held): often enough to see any growth
            self.peak = max(self.peak, _held(self))
        return flags

    def take_content_run(self, chunk: bytes, start: int, events: list[bytes],
                         first: int) -> tuple[int, int]:
        count, end = super().take_content_run(chunk, start, events, first)
        if count:  # many events per read: taken in one step
            self.events += count
            self.peak = max(self.peak, _held(self))
        return count, end


@pytest.mark.timeout(120)
@pytest.mark.parametrize("asked", [False, True], ids=["usage-not-asked", "usage-asked-never-sent"])
async def test_long_stream_holds_bounded_memory_and_estimates_exactly(
    aiohttp_server: ServerFactory, upstream: TestServer, monkeypatch: pytest.MonkeyPatch,
    asked: bool,
) -> None:
    """usage-not-asked: the upstream is configured without stream usage, so every event is
    counted exactly. usage-asked-never-sent: the proxy asked, the upstream sent none, so past a
    first exactly counted batch events are rated (the mock's tokens are one per event)."""
    n = 24_000
    monkeypatch.setattr("proxy.server.app.TRANSLATORS", (_Recording,))
    _Recording.made.clear()
    opts = {} if asked else {"stream_usage": False}
    proxy = await proxy_for(aiohttp_server, config_for(str(upstream.make_url("/v1")), **opts))
    async with sdk(proxy) as client:
        stream = await client.chat.completions.create(
            model="mock-gpt", messages=MESSAGES, stream=True,
            extra_headers={"x-mock-output-tokens": str(n), "x-mock-usage": "off"},
        )
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    assert "".join(parts) == generated_text(n)
    await settled(proxy.app, 1)
    (tr,) = _Recording.made
    # Every token came in an event of its own, of 200 bytes or so: the old translator held
    # them all, over 4 MB, many times the bound.
    assert tr.events > n and n * 100 > 8 * HOLD_BYTES
    assert 0 < tr.peak < 2 * HOLD_BYTES
    m = await scrape(proxy)
    assert sample(m, "tokenmeter_tokens_total", type="output", source="estimated") == n
    assert sample(m, "tokenmeter_tokens_total", type="input", source="estimated") == (
        tokenizer.count_messages("mock-gpt", MESSAGES))


def _chat_event(delta: dict[str, Any], finish: str | None = None) -> bytes:
    obj = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
           "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return json.dumps(obj, separators=(",", ":")).encode()


def _texts(count: int) -> list[str]:
    """Texts whose token counts vary (words, numbers, unicode), so a wrong count shows."""
    kinds = [" the", " 1234567", " naïve", "\n\n", " {\"a\": [1, 2]}", " antidisestablishment"]
    return [kinds[i % len(kinds)] + str(i % 7) for i in range(count)]


def _enough(events: list[tuple[bytes, str | None]]) -> list[tuple[bytes, str | None]]:
    """Repeat `events` until they are many times what a translator may hold."""
    size = sum(len(d) for d, _ in events)
    return events * (5 * HOLD_BYTES // size + 1)


def _feed(tr: Translator, events: list[tuple[bytes, str | None]]) -> int:
    """Returns the most memory the process held after an event beyond what it held before the
    first (tracemalloc's count of live allocations, looked at every 16 events): what `tr`
    keeps, and nothing else lives on here. The tokenizer is loaded first: its tables are not
    the translator's."""
    tokenizer.count_texts(tr.model, ["warm"])
    tracemalloc.start()
    try:
        before = peak = tracemalloc.get_traced_memory()[0]
        for i, (data, name) in enumerate(events):
            tr.on_event(data, name)
            if i % 16 == 0:
                peak = max(peak, tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
    return peak - before


def _events(shape: str, texts: list[str]) -> list[tuple[bytes, str | None]]:
    if shape == "chat":
        return [(_chat_event({"content": t}), None) for t in texts]
    if shape == "completions":
        return [(json.dumps({"choices": [{"text": t, "index": 0}]}).encode(), None)
                for t in texts]
    kind = "response.output_text.delta"
    return [(json.dumps({"type": kind, "delta": t}).encode(), kind) for t in texts]


_TRANSLATORS: dict[str, tuple[type[Translator], dict[str, Any]]] = {
    "chat": (ChatTranslator, {"messages": MESSAGES}),
    "completions": (CompletionsTranslator, {"prompt": "p"}),
    "responses": (ResponsesTranslator, {"input": "p"}),
}


def _translator(shape: str, ask_usage: bool) -> Translator:
    make, fields = _TRANSLATORS[shape]
    body = {"model": "gpt-4o", "stream": True, **fields}
    return make(parse_body(json.dumps(body).encode()), ask_usage)


@pytest.mark.parametrize("shape", ["chat", "completions"])
def test_folding_counts_exactly_what_holding_would(
    shape: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The upstream was not asked for usage, so the estimate is the bill: every event dropped
    is counted first, and the estimate is the one an unbounded translator would make."""
    texts = _texts(600)
    events = _events(shape, texts)
    if shape == "chat":
        events.insert(0, (_chat_event({"role": "assistant", "content": ""}), None))
        events.insert(300, (b'{"choices":[{"delta":{"content":"cut', None))  # not JSON alone
    events = _enough(events)
    expected = tokenizer.count_texts("gpt-4o", texts) * (len(events) // len(texts))

    folding = _translator(shape, False)
    peak = _feed(folding, events)
    assert folding.usage().output_tokens == expected
    assert folding.usage().source == "estimated"
    assert 0 < peak < 2 * HOLD_BYTES < sum(len(d) for d, _ in events)

    monkeypatch.setattr("proxy.protocol.output.HOLD_BYTES", 1 << 40)  # never fold: as it was
    holding = _translator(shape, False)
    for data, name in events:
        holding.on_event(data, name)
    # Its output, past what one count tokenises (tokenizer.PROMPT_BUDGET), is rated by a sample.
    assert holding.usage().output_tokens == pytest.approx(expected, rel=0.03)
    assert _held(holding) > 4 * HOLD_BYTES


@pytest.mark.parametrize("shape", ["chat", "responses"])
def test_folding_rates_by_a_sample_when_usage_was_asked(shape: str) -> None:
    """Usage was asked for (Responses always carries it), so the estimate only matters if the
    stream breaks: dropped events are rated by a sample of them. The texts change half-way, from
    several tokens an event to two, and the estimate follows."""
    texts = _texts(600) * 40 + [" and the"] * 60_000
    tr = _translator(shape, True)
    peak = _feed(tr, _events(shape, texts))
    assert peak < 2 * HOLD_BYTES
    assert tr.usage().output_tokens == pytest.approx(tokenizer.count_texts("gpt-4o", texts),
                                                     rel=0.05)


def test_reported_usage_wins_over_a_folded_estimate() -> None:
    request = parse_body(json.dumps({"model": "gpt-4o", "messages": MESSAGES,
                                     "stream": True}).encode())
    tr = ChatTranslator(request)
    _feed(tr, [(_chat_event({"content": t}), None) for t in _texts(5000)])
    tr.on_event(b'{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":5000}}', None)
    usage = tr.usage()
    assert (usage.input_tokens, usage.output_tokens, usage.source) == (7, 5000, "reported")


# --- 10: a slow client is not a silent upstream ------------------------------------------------


def _small_receive_buffer(addr: Any) -> socket.socket:
    """A client socket whose receive buffer stays small (set before connecting, it is not grown
    by the kernel): a client that stops reading stops the proxy's writes within a few KB."""
    sock = socket.socket(addr[0], addr[1], addr[2])
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    return sock


def _sse_events(body: bytes) -> list[bytes]:
    return [e for e in body.split(b"\n\n") if e]


@pytest.mark.timeout(60)
async def test_client_that_pauses_reading_gets_its_whole_stream(
    aiohttp_server: ServerFactory, upstream: TestServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The client reads nothing for 2.5 s with a 1 s idle timeout while the upstream has far
    more to send than the socket buffers hold: the proxy's write waits on the client that long,
    and must not count it as the upstream's silence."""
    n = 30_000  # about 5 MB of events: far beyond what loopback buffers take in
    proxy = await proxy_for(aiohttp_server, config_for(str(upstream.make_url("/v1")),
                                                       idle_timeout_s=1))
    body = {"model": "mock-gpt", "messages": MESSAGES, "stream": True,
            "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(socket_factory=_small_receive_buffer), read_bufsize=4096
    ) as s, s.post(
        proxy.make_url("/v1/chat/completions"), json=body,
        headers={"x-mock-output-tokens": str(n)},
    ) as r:
        assert r.status == 200
        await asyncio.sleep(2.5)  # the scenario itself: a client that stops reading
        # The stream is still being relayed, 2.5 s into a pause of its client, from an
        # unpaced upstream: the proxy is (and, with buffers this small, was all along)
        # waiting on the client, and has not taken that for the upstream's silence.
        assert sample(await scrape(proxy), "tokenmeter_active_requests", upstream="mock") == 1
        raw = await r.read()
    events = _sse_events(relayed(raw))
    assert events[-1] == b"data: [DONE]"
    assert not any(e.startswith(b'data: {"error"') for e in events)
    content = [json.loads(e[6:]) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or ""
                   for c in content if c["choices"])
    assert text == generated_text(n)
    await settled(proxy.app, 1)
    (line,) = access_lines(caplog)
    assert (line["status"], line["error_class"]) == (200, "none")
    assert (line["output_tokens"], line["token_source"]) == (n, "reported")


@pytest.mark.timeout(60)
async def test_client_that_never_reads_is_cut_after_the_client_write_timeout(
    aiohttp_server: ServerFactory, upstream: TestServer, caplog: pytest.LogCaptureFixture
) -> None:
    proxy = await proxy_for(aiohttp_server, config_for(
        str(upstream.make_url("/v1")), extra={"server": {"client_write_timeout_s": 0.5}},
        idle_timeout_s=30))
    body = {"model": "mock-gpt", "messages": MESSAGES, "stream": True}
    async with aiohttp.ClientSession(read_bufsize=4096) as s, s.post(
        proxy.make_url("/v1/chat/completions"), json=body,
        headers={"x-mock-output-tokens": "100000"},
    ) as r:
        assert r.status == 200
        await settled(proxy.app, 1)  # without reading a byte
    await mock_of(upstream).requests[0].closed.wait()  # the upstream request was ended too
    (line,) = access_lines(caplog)
    assert (line["status"], line["error_class"]) == (200, "client_timeout")
    assert errors_logged(caplog) == []


# --- 13: a client that hangs up is a client_disconnect -----------------------------------------


def _raw_request(path: str, body: dict[str, Any]) -> bytes:
    raw = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: tokenmeter\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\n\r\n").encode() + raw


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_hangup_right_after_sending_is_a_client_disconnect(
    aiohttp_server: ServerFactory, upstream: TestServer, caplog: pytest.LogCaptureFixture,
    stream: bool,
) -> None:
    proxy = await proxy_for(aiohttp_server, config_for(str(upstream.make_url("/v1"))))
    request = _raw_request("/v1/chat/completions",
                           {"model": "mock-gpt", "messages": MESSAGES, "stream": stream})

    async def hang_up() -> None:
        _, writer = await asyncio.open_connection(proxy.host, proxy.port)
        writer.write(request)
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    n = 40
    await asyncio.gather(*(hang_up() for _ in range(n)))
    await settled(proxy.app, n)
    assert errors_logged(caplog) == []
    outcomes = {(line["status"], line["error_class"]) for line in access_lines(caplog)}
    # Whoever noticed first: the handler's cancellation, or a write to the closing socket.
    assert outcomes == {(499, "client_disconnect")}
    m = await scrape(proxy)
    assert sample(m, "tokenmeter_requests_total", error_class="client_disconnect") == n


class _HangingUpUpstream:
    """An upstream that, as it sends its response headers, closes the proxy's client's socket.
    The proxy's loop then finds both in one pass, the upstream's bytes first: its handler
    resumes and writes its headers to a client socket that is already closing."""

    def __init__(self) -> None:
        self.client: socket.socket | None = None
        self.hung_up = asyncio.Event()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)  # the headers go out now
        assert self.client is not None
        self.client.close()
        self.hung_up.set()
        await resp.write(b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        return resp


@pytest.mark.timeout(60)
async def test_hangup_as_the_answer_arrives_is_a_client_disconnect(
    aiohttp_server: ServerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    fake = _HangingUpUpstream()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", fake.handle)
    upstream = await aiohttp_server(app)
    proxy = await proxy_for(aiohttp_server, config_for(str(upstream.make_url("/v1"))))
    request = _raw_request("/v1/chat/completions",
                           {"model": "mock-gpt", "messages": MESSAGES, "stream": True})
    n = 10
    for i in range(n):
        fake.hung_up.clear()
        fake.client = socket.create_connection((proxy.host, proxy.port))
        fake.client.sendall(request)  # a few hundred bytes: the kernel takes them at once
        await fake.hung_up.wait()
        await settled(proxy.app, i + 1)
    assert errors_logged(caplog) == []
    outcomes = {(line["status"], line["error_class"]) for line in access_lines(caplog)}
    assert outcomes == {(499, "client_disconnect")}


# --- 14: a stream that ends without its final event ---------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("produced", [0, 5])
async def test_chat_stream_ending_without_done_is_an_error(
    aiohttp_server: ServerFactory, upstream: TestServer, caplog: pytest.LogCaptureFixture,
    produced: int,
) -> None:
    """produced=0: a 200 event-stream with no event at all (llama-cpp-python's answer to a
    streamed prompt longer than its context); 5: one that stops after 5 tokens, no finish,
    no [DONE]."""
    proxy = await proxy_for(aiohttp_server, config_for(str(upstream.make_url("/v1"))))
    got = ""
    async with sdk(proxy) as client:
        stream = await client.chat.completions.create(
            model="mock-gpt", messages=MESSAGES, stream=True,
            extra_headers={"x-mock-end-after": str(produced)},
        )
        with pytest.raises(openai.APIError) as err:
            async for chunk in stream:
                got += chunk.choices[0].delta.content or "" if chunk.choices else ""
    assert err.value.code == "upstream_incomplete"
    assert got == generated_text(produced)
    await settled(proxy.app, 1)
    (line,) = access_lines(caplog)
    assert (line["status"], line["error_class"]) == (200, "upstream_incomplete")
    m = await scrape(proxy)
    assert sample(m, "tokenmeter_requests_total", error_class="upstream_incomplete") == 1
    assert sample(m, "tokenmeter_requests_total", error_class="none") == 0
    if produced:  # charged what was produced, estimated, as after a reset
        assert (line["output_tokens"], line["token_source"]) == (produced, "estimated")
        assert line["input_tokens"] == tokenizer.count_messages("mock-gpt", MESSAGES)
    else:  # nothing produced, nothing says the prompt was read: nothing charged
        assert line["total_tokens"] == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("produced", [0, 3])
async def test_responses_stream_ending_without_completed_is_an_error(
    aiohttp_server: ServerFactory, upstream: TestServer, caplog: pytest.LogCaptureFixture,
    produced: int,
) -> None:
    proxy = await proxy_for(aiohttp_server, config_for(str(upstream.make_url("/v1"))))
    deltas = ""
    async with sdk(proxy) as client:
        stream = await client.responses.create(
            model="mock-gpt", input="hi", stream=True,
            extra_headers={"x-mock-end-after": str(produced)},
        )
        with pytest.raises(openai.APIError) as err:
            async for event in stream:
                if event.type == "response.output_text.delta":
                    deltas += event.delta
    assert "without its final event" in err.value.message
    assert deltas == generated_text(produced)
    await settled(proxy.app, 1)
    (line,) = access_lines(caplog)
    assert (line["status"], line["error_class"]) == (200, "upstream_incomplete")
    assert line["output_tokens"] == produced


@pytest.mark.timeout(60)
async def test_stream_whose_choices_all_finished_needs_no_done(
    aiohttp_server: ServerFactory, upstream: TestServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Decided: a stream that ends after every choice asked for has its finish_reason is whole
    (the SDK ends such a stream quietly too); only `[DONE]` and a finish are final."""
    proxy = await proxy_for(aiohttp_server, config_for(str(upstream.make_url("/v1"))))
    async with sdk(proxy) as client:
        stream = await client.chat.completions.create(
            model="mock-gpt", messages=MESSAGES, stream=True,
            extra_headers={"x-mock-omit-done": "on"},
        )
        chunks = [c async for c in stream]
    assert chunks[-1].choices[0].finish_reason == "stop"
    await settled(proxy.app, 1)
    (line,) = access_lines(caplog)
    assert (line["status"], line["error_class"], line["output_tokens"]) == (200, "none", 12)
    assert line["token_source"] == "reported"


def test_a_broken_meter_never_turns_a_stream_into_an_error() -> None:
    """A metering bug stops metering; the relay must then not judge the stream by the
    translator's half-knowledge (it saw no `[DONE]`) and append an error to a whole stream."""

    class Broken(ChatTranslator):
        def on_event(self, data: bytes, name: str | None,
                     marked: bool | None = None) -> EventFlag:
            raise RuntimeError("bug")

    body = json.dumps({"model": "m", "messages": [], "stream": True}).encode()
    tr = Broken(parse_body(body))
    tap = StreamTap(tr, RequestMeter())
    for part in (b"data: " + _chat_event({"content": "x"}) + b"\n\n", b"data: [DONE]\n\n"):
        tap.feed(part, 0.0)
        tap.look()
    tap.close()
    assert tap.broken and not tr.complete


# --- 17: validation errors in a 500, and abandoned JSON requests ------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("headers", "error_class"), [
    ({"x-mock-error-type": "invalid_request_error", "x-mock-error-code": "invalid_value"},
     "bad_request"),
    ({"x-mock-error-code": "context_length_exceeded"}, "context_length"),
])
async def test_500_blaming_the_request_is_not_retried(
    aiohttp_server: ServerFactory, upstream: TestServer, headers: dict[str, str],
    error_class: str,
) -> None:
    proxy = await proxy_for(aiohttp_server, config_for(
        str(upstream.make_url("/v1")), retry={"initial_backoff_ms": 1, "max_attempts": 3}))
    async with sdk(proxy) as client:
        with pytest.raises(openai.InternalServerError) as err:
            await client.chat.completions.create(
                model="mock-gpt", messages=MESSAGES,
                extra_headers={"x-mock-status": "500", **headers},
            )
        assert err.value.status_code == 500  # the upstream's own answer, forwarded
        # ...while a 500 that does not blame the request is still retried.
        with pytest.raises(openai.InternalServerError):
            await client.chat.completions.create(
                model="mock-gpt", messages=MESSAGES, extra_headers={"x-mock-status": "500"},
            )
    assert len(mock_of(upstream).requests) == 1 + 3
    await settled(proxy.app, 2)
    m = await scrape(proxy)
    assert sample(m, "tokenmeter_requests_total", status="500", error_class=error_class) == 1
    assert sample(m, "tokenmeter_requests_total", status="500", error_class="upstream_5xx") == 1
    assert sample(m, "tokenmeter_upstream_retries_total") == 2


@pytest.mark.timeout(60)
async def test_500_blaming_the_request_is_not_handed_to_a_fallback(
    aiohttp_server: ServerFactory,
) -> None:
    primary = await aiohttp_server(create_mock_app(MockSettings(
        status=500, error_type="invalid_request_error", error_code="invalid_value")))
    backup = await aiohttp_server(create_mock_app(MockSettings(tokens_per_second=0, ttft_ms=0)))
    proxy = await proxy_for(aiohttp_server, parse_config(f"""
upstreams:
  main: {{base_url: "{primary.make_url('/v1')}", retry: {{initial_backoff_ms: 1}}}}
  spare: {{base_url: "{backup.make_url('/v1')}"}}
models:
  - {{match: primary-model, upstream: main, fallbacks: [backup-model]}}
  - {{match: "backup-*", upstream: spare}}
metrics: {{model_labels: [primary-model, backup-model], discover_models: false}}
"""))
    async with sdk(proxy) as client:
        with pytest.raises(openai.InternalServerError) as err:
            await client.chat.completions.create(model="primary-model", messages=MESSAGES)
    assert err.value.code == "invalid_value"
    assert len(mock_of(primary).requests) == 1
    assert mock_of(backup).requests == []
    await settled(proxy.app, 1)
    m = await scrape(proxy)
    assert sample(m, "tokenmeter_fallbacks_total") == 0
    assert sample(m, "tokenmeter_requests_total", model="primary-model",
                  error_class="bad_request") == 1


async def _abandon_when(
    proxy: TestServer, upstream: TestServer, body: dict[str, Any], headers: dict[str, str],
    ready: Callable[[], Awaitable[bool]],
) -> None:
    """Send `body`, and hang up once `ready()` says the proxy is where the test wants it."""
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(s.post(proxy.make_url("/v1/chat/completions"), json=body,
                                          headers=headers))
        await until(ready)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    await mock_of(upstream).requests[0].closed.wait()  # the proxy ended the upstream request


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_request_abandoned_while_upstream_has_it_is_charged_its_prompt(
    aiohttp_server: ServerFactory, upstream: TestServer, caplog: pytest.LogCaptureFixture,
    stream: bool,
) -> None:
    proxy = await proxy_for(aiohttp_server, config_for(str(upstream.make_url("/v1"))))
    async def upstream_has_it() -> bool:  # and answers in 30 s
        return bool(mock_of(upstream).requests)

    await _abandon_when(
        proxy, upstream, {"model": "mock-gpt", "messages": MESSAGES, "stream": stream},
        {"x-mock-delay-ms": "30000"}, upstream_has_it,
    )
    await settled(proxy.app, 1)
    (line,) = access_lines(caplog)
    assert (line["status"], line["error_class"]) == (499, "client_disconnect")
    prompt = tokenizer.count_messages("mock-gpt", MESSAGES)
    assert (line["input_tokens"], line["output_tokens"]) == (prompt, 0)
    assert line["token_source"] == "estimated"
    m = await scrape(proxy)
    assert sample(m, "tokenmeter_tokens_total", type="input", source="estimated") == prompt


@pytest.mark.timeout(60)
async def test_request_abandoned_between_retries_is_charged_nothing(
    aiohttp_server: ServerFactory, upstream: TestServer, caplog: pytest.LogCaptureFixture,
) -> None:
    """The upstream answered 503 and the proxy waits to retry: the upstream does not have the
    request, so the client's leaving costs nothing."""
    proxy = await proxy_for(aiohttp_server, config_for(str(upstream.make_url("/v1"))))
    async def waiting_to_retry() -> bool:
        return sample(await scrape(proxy), "tokenmeter_upstream_retries_total") == 1

    await _abandon_when(
        proxy, upstream, {"model": "mock-gpt", "messages": MESSAGES},
        {"x-mock-status": "503", "x-mock-retry-after-ms": "20000"}, waiting_to_retry,
    )
    await settled(proxy.app, 1)
    (line,) = access_lines(caplog)
    assert (line["status"], line["error_class"], line["total_tokens"]) == (
        499, "client_disconnect", 0)

