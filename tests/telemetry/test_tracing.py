"""OpenTelemetry traces, end to end: `tokenmeter serve` configured by the standard OTEL_*
variables exports to an OTLP/HTTP receiver in the test, which decodes the real protobuf
(`ExportTraceServiceRequest`, from opentelemetry-proto); the client is the openai SDK sending a
W3C `traceparent`, the upstreams are mock upstreams (and, for the stream's end, one the test
holds mid-stream)."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import (
    TraceServiceServicer,
    add_TraceServiceServicer_to_server,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan
from opentelemetry.proto.trace.v1.trace_pb2 import Status

from proxy.config.load import parse_config
from proxy.config.tracing import TracingConfig
from proxy.server.app import create_app
from proxy.telemetry.tracing import Tracing
from proxy.testing.mock_upstream import MOCK_STATE, MockSettings, create_mock_app, generated_text
from tests.helpers import ROOT, ServerFactory
from tests.servers import ServedProxy

ALICE = "sk-alice-tracing-0123456789"
UPSTREAM_SECRET = "sk-upstream-tracing-5678"
PROMPT = "the zebra-7731 passphrase is periwinkle"  # must appear in no span
MESSAGES: list[Any] = [{"role": "user", "content": PROMPT}]
SERVER, CLIENT = ProtoSpan.SPAN_KIND_SERVER, ProtoSpan.SPAN_KIND_CLIENT


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind is not None else None


@dataclass(frozen=True)
class Span:
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    error: bool
    service: str


@dataclass
class Receiver:
    """An OTLP/HTTP collector: POST /v1/traces, protobuf in and out."""

    spans: list[Span] = field(default_factory=list)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def handle(self, request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        await self.received(ExportTraceServiceRequest.FromString(await request.read()))
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    async def received(self, export: ExportTraceServiceRequest) -> None:
        got: list[Span] = []
        for rs in export.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                got.extend(Span(
                    name=s.name, kind=s.kind, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                    parent=s.parent_span_id.hex(), start_ns=s.start_time_unix_nano,
                    end_ns=s.end_time_unix_nano,
                    attributes={a.key: _value(a.value) for a in s.attributes},
                    error=s.status.code == Status.STATUS_CODE_ERROR,
                    service=str(resource.get("service.name")),
                ) for s in ss.spans)
        async with self.changed:
            self.spans.extend(got)
            self.changed.notify_all()

    async def wait_for(self, count: int, within_s: float = 30.0) -> list[Span]:
        async with asyncio.timeout(within_s), self.changed:
            await self.changed.wait_for(lambda: len(self.spans) >= count)
        return list(self.spans)


@pytest.fixture
async def receiver(aiohttp_server: ServerFactory) -> AsyncIterator[tuple[Receiver, TestServer]]:
    rec = Receiver()
    app = web.Application()
    app.router.add_post("/v1/traces", rec.handle)
    yield rec, await aiohttp_server(app)


def _traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def _config(tmp_path: Path, upstreams: dict[str, str], models: str) -> Path:
    lines = ["upstreams:"]
    for name, url in upstreams.items():
        lines.append(f"  {name}: {{base_url: '{url}', api_key: {UPSTREAM_SECRET}, "
                     "retry: {max_attempts: 2, initial_backoff_ms: 1, max_backoff_ms: 2}}")
    text = "\n".join(lines) + f"""
models:
{models}
metrics: {{discover_models: false}}
prices:
  "*": {{input: 2.5, output: 10}}
tags:
  feature: {{values: [faq, search]}}
  customer: {{free: true}}
users:
  alice:
    team: research
    keys: [{{key: "{ALICE}", name: laptop}}]
"""
    path = tmp_path / "tokenmeter.yaml"
    path.write_text(text)
    return path


def _otel_env(collector: TestServer, **more: str) -> dict[str, str]:
    return {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_ENDPOINT": str(collector.make_url("")).rstrip("/"),
            "OTEL_SERVICE_NAME": "tokenmeter-under-test", "OTEL_BSP_SCHEDULE_DELAY": "50",
            **more}


def _parent_of(traceparent: str) -> tuple[str, str]:
    version, trace_id, parent, flags = traceparent.split("-")
    # Sampled; a trace begun by the proxy also says its id is random (W3C level 2: 0x02).
    assert version == "00" and int(flags, 16) & 1, traceparent
    return trace_id, parent


def _no_secret_text(spans: list[Span], *texts: str) -> None:
    for span in spans:
        values = [span.name, *(json.dumps(v) for v in span.attributes.values())]
        for text in texts:
            assert not any(text in value for value in values), (span.name, text)


async def test_retry_and_fallback_are_client_spans_under_the_clients_trace(
    aiohttp_server: ServerFactory, receiver: tuple[Receiver, TestServer], tmp_path: Path,
) -> None:
    rec, collector = receiver
    failing = await aiohttp_server(create_mock_app(MockSettings(status=500)))
    backup = await aiohttp_server(create_mock_app(MockSettings(
        tokens_per_second=0, ttft_ms=0, output_tokens=7, reasoning_tokens=2)))
    config = _config(tmp_path, {"main": str(failing.make_url("/v1")),
                                "spare": str(backup.make_url("/v1"))},
                     "  - {match: primary-model, upstream: main, fallbacks: [backup-model]}\n"
                     "  - {match: 'backup-*', upstream: spare}")
    proxy = ServedProxy(config, tmp_path / "proxy.log", env=_otel_env(collector))
    await proxy.started()
    trace_id, client_span, traceparent = _traceparent()
    try:
        async with openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key=ALICE,
                                      max_retries=0) as client:
            raw = await client.chat.completions.with_raw_response.create(
                model="primary-model", messages=MESSAGES, max_tokens=50,
                extra_headers={"traceparent": traceparent,
                               "x-tokenmeter-tags": "feature=faq, customer=acme-7731"})
        answer = raw.parse()
        assert answer.usage is not None and answer.model == "backup-model"
        spans = await rec.wait_for(4)
    finally:
        await proxy.stopped()
    assert len(spans) == 4, spans  # nothing else arrived while the proxy drained
    (server,) = [s for s in spans if s.kind == SERVER]
    clients = sorted((s for s in spans if s.kind == CLIENT), key=lambda s: s.start_ns)
    assert len(clients) == 3

    # The server span continues the client's trace; the attempts are its children.
    assert server.service == "tokenmeter-under-test"
    assert (server.trace_id, server.parent) == (trace_id, client_span)
    assert all(c.trace_id == trace_id and c.parent == server.span_id for c in clients)
    assert server.name == "chat primary-model"
    usage = answer.usage
    cost_nanos = usage.prompt_tokens * 2500 + usage.completion_tokens * 10_000
    assert server.attributes == server.attributes | {
        "gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai",
        "gen_ai.request.model": "primary-model", "gen_ai.response.model": "backup-model",
        "gen_ai.request.max_tokens": 50,
        "gen_ai.usage.input_tokens": usage.prompt_tokens,
        "gen_ai.usage.output_tokens": usage.completion_tokens,
        "gen_ai.usage.reasoning.output_tokens": 2,
        "http.response.status_code": 200,
        "tokenmeter.user": "alice", "tokenmeter.key": "laptop", "tokenmeter.team": "research",
        "tokenmeter.error_class": "none", "tokenmeter.budget.decision": "admitted",
        "tokenmeter.attempts": 3, "tokenmeter.fallback_from": "primary-model",
        "tokenmeter.cost_usd": cost_nanos / 1e9,
        "tokenmeter.request_id": raw.headers["x-tokenmeter-request-id"],
        "tokenmeter.tags.feature": "faq",
    }
    assert "error.type" not in server.attributes and not server.error
    # A closed-list tag is an attribute; a free one's value is the client's text, kept out of
    # every span (issue 31, item 16: it used to be `tokenmeter.tags.customer`).
    assert "tokenmeter.tags.customer" not in server.attributes
    # Cache figures only when there are some (this upstream reports none).
    assert not any("cache" in name for name in server.attributes)
    # A JSON answer has no chunks: time to first chunk is a stream's figure.
    assert "gen_ai.response.time_to_first_chunk" not in server.attributes

    # Two tries of the primary (one retry), each a 500, then the fallback that answered.
    for attempt, port in zip(clients, (failing.port, failing.port, backup.port), strict=True):
        assert attempt.attributes["server.address"] == "127.0.0.1"
        assert attempt.attributes["server.port"] == port
        assert attempt.attributes["gen_ai.request.max_tokens"] == 50
        assert attempt.start_ns >= server.start_ns and attempt.end_ns <= server.end_ns
    for attempt in clients[:2]:
        assert attempt.name == "chat primary-model"
        assert attempt.attributes["tokenmeter.upstream"] == "main"
        assert attempt.attributes["http.response.status_code"] == 500
        assert attempt.attributes["error.type"] == "upstream_5xx" and attempt.error
        assert "gen_ai.usage.output_tokens" not in attempt.attributes
    served = clients[2]
    assert served.name == "chat backup-model" and not served.error
    assert served.attributes["tokenmeter.upstream"] == "spare"
    assert served.attributes["http.response.status_code"] == 200
    assert served.attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert served.attributes["gen_ai.response.model"] == "backup-model"

    # Each upstream request carried a traceparent naming its own client span.
    sent = [r.headers["traceparent"] for r in failing.app[MOCK_STATE].requests]
    sent += [r.headers["traceparent"] for r in backup.app[MOCK_STATE].requests]
    assert [_parent_of(tp) for tp in sent] == [(trace_id, c.span_id) for c in clients]

    # No prompt, no answer, no key in any span.
    _no_secret_text(spans, PROMPT, "zebra", generated_text(7).strip(), ALICE, UPSTREAM_SECRET,
                    "acme-7731")


@dataclass
class Gated:
    """An OpenAI-shaped upstream whose stream stops after its first chunk until `go` is set:
    the test decides when the stream can end."""

    go: asyncio.Event = field(default_factory=asyncio.Event)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()

        def event(obj: dict[str, Any]) -> bytes:
            chunk = {"id": "chatcmpl-gated", "object": "chat.completion.chunk", "created": 0,
                     "model": body["model"], **obj}
            return b"data: " + json.dumps(chunk).encode() + b"\n\n"

        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(event({"choices": [{"index": 0, "finish_reason": None,
                                             "delta": {"role": "assistant", "content": " one"}}]}))
        await self.go.wait()
        await resp.write(event({"choices": [{"index": 0, "delta": {"content": " two"},
                                             "finish_reason": "stop"}]}))
        await resp.write(event({"choices": [], "usage": {
            "prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}}))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def test_a_streams_span_ends_with_the_stream_and_shutdown_flushes_it(
    aiohttp_server: ServerFactory, receiver: tuple[Receiver, TestServer], tmp_path: Path,
) -> None:
    rec, collector = receiver
    gated = Gated()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", gated.chat)
    upstream = await aiohttp_server(app)
    config = _config(tmp_path, {"gated": str(upstream.make_url("/v1"))},
                     "  - {match: '*', upstream: gated}")
    # A schedule delay far past the test: the spans can only come from the flush at shutdown.
    env = _otel_env(collector, OTEL_BSP_SCHEDULE_DELAY="600000")
    proxy = ServedProxy(config, tmp_path / "proxy.log", env=env)
    await proxy.started()
    trace_id, client_span, traceparent = _traceparent()
    try:
        async with openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key=ALICE,
                                      max_retries=0) as client:
            sent_ns = time.time_ns()
            stream = await client.chat.completions.create(
                model="gated-model", messages=MESSAGES, stream=True,
                extra_headers={"traceparent": traceparent})
            text = []
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    text.append(chunk.choices[0].delta.content)
                    if len(text) == 1:  # the stream is held here until the test lets it go
                        released_ns = time.time_ns()
                        gated.go.set()
        assert "".join(text) == " one two"
        assert not rec.spans  # nothing exported yet: the batch waits for its schedule
    finally:
        assert await proxy.stopped() == 0
    spans = await rec.wait_for(2)
    (server,) = [s for s in spans if s.kind == SERVER]
    (attempt,) = [s for s in spans if s.kind == CLIENT]
    assert (server.trace_id, server.parent) == (trace_id, client_span)
    assert server.name == "chat gated-model"
    # Both ended after the upstream was let go: with the stream, not with its headers.
    assert server.end_ns >= attempt.end_ns >= released_ns > server.start_ns
    assert server.attributes["gen_ai.usage.output_tokens"] == 2
    assert attempt.attributes["gen_ai.usage.input_tokens"] == 9
    # The first chunk came before the test let the stream go on: its time is before that.
    # Measured from the client's send (the proxy's own clock starts later, and the span's
    # start is not the instant its TTFT is measured from).
    for span in (server, attempt):
        ttft_ns = span.attributes["gen_ai.response.time_to_first_chunk"] * 1e9
        assert 0 < ttft_ns <= released_ns - sent_ns
    _no_secret_text(spans, PROMPT, " one two", ALICE, UPSTREAM_SECRET)


def test_tracing_is_off_unless_asked_for_and_then_loads_nothing() -> None:
    assert Tracing.of(TracingConfig(), {}) is None
    assert Tracing.of(TracingConfig(), {"OTEL_TRACES_EXPORTER": "none"}) is None
    assert Tracing.of(TracingConfig(), {"OTEL_TRACES_EXPORTER": "otlp"}) is not None
    assert Tracing.of(TracingConfig(enabled=True), {}) is not None
    assert Tracing.of(TracingConfig(enabled=False), {"OTEL_TRACES_EXPORTER": "otlp"}) is None
    assert Tracing.of(TracingConfig(enabled=True), {"OTEL_SDK_DISABLED": "true"}) is None
    # A queue smaller than the SDK's default batch (512) makes a smaller batch, not an error.
    small = Tracing(TracingConfig(enabled=True, queue_size=10), {})
    small.start()
    assert small.request({}, "chat") is not None
    small.stop()
    assert small.request({}, "chat") is None  # stopped: no more spans
    # A protocol tokenmeter cannot export with is refused when tracing starts.
    with pytest.raises(ValueError, match="http/protobuf or grpc"):
        Tracing(TracingConfig(), {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}).start()
    # A proxy with tracing off never loads the trace SDK, its exporters or its propagator
    # (redis-py loads the OpenTelemetry API and metrics SDK for itself, traces or not).
    script = (
        "import sys\n"
        "from proxy.config.load import parse_config\n"
        "from proxy.server.app import create_app\n"
        "create_app(parse_config(\"upstreams: {m: {base_url: 'http://127.0.0.1:9/v1'}}\", 'x'))\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk.trace',\n"
        "    'opentelemetry.exporter', 'opentelemetry.trace.propagation.tracecontext')))\n"
        "assert not loaded, loaded\n"
        "print('checked', len([m for m in sys.modules if m.startswith('proxy.')]))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "-c", script], check=False, cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("checked "), done.stderr



class _GrpcService(TraceServiceServicer):  # generated code, untyped
    def __init__(self, receiver: Receiver) -> None:
        self.receiver = receiver

    async def Export(self, request: ExportTraceServiceRequest,  # gRPC names it
                     context: grpc.aio.ServicerContext[Any, Any]) -> ExportTraceServiceResponse:
        await self.receiver.received(request)
        return ExportTraceServiceResponse()


async def test_the_tracing_section_exports_over_grpc(
    aiohttp_server: ServerFactory, upstream: TestServer, tmp_path: Path,
) -> None:
    """The `tracing:` keys alone (no OTEL_TRACES_EXPORTER), to a gRPC collector."""
    rec = Receiver()
    server = grpc.aio.server()
    add_TraceServiceServicer_to_server(_GrpcService(rec), server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    config = _config(tmp_path, {"mock": str(upstream.make_url("/v1"))},
                     "  - {match: '*', upstream: mock}")
    config.write_text(config.read_text() + f"""
tracing:
  enabled: true
  protocol: grpc
  endpoint: http://127.0.0.1:{port}
  service_name: tokenmeter-grpc
  sample_ratio: 1.0
""")
    proxy = ServedProxy(config, tmp_path / "proxy.log", env={"OTEL_BSP_SCHEDULE_DELAY": "50"})
    await proxy.started()
    try:
        async with openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key=ALICE,
                                      max_retries=0) as client:
            answer = await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
        spans = await rec.wait_for(2)
    finally:
        await proxy.stopped()
        await server.stop(None)
    (srv,) = [s for s in spans if s.kind == SERVER]
    (attempt,) = [s for s in spans if s.kind == CLIENT]
    assert srv.service == "tokenmeter-grpc" and srv.name == "chat mock-gpt"
    assert attempt.parent == srv.span_id and attempt.trace_id == srv.trace_id
    assert srv.parent == ""  # no traceparent from the client: the trace starts here
    assert answer.usage is not None
    assert srv.attributes["gen_ai.usage.output_tokens"] == answer.usage.completion_tokens
    (sent,) = upstream.app[MOCK_STATE].requests
    assert _parent_of(sent.headers["traceparent"]) == (srv.trace_id, attempt.span_id)


async def test_refusals_and_unreachable_upstreams_in_spans(
    aiohttp_server: ServerFactory, upstream: TestServer, receiver: tuple[Receiver, TestServer],
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In process, from the `tracing:` section: an unreachable primary's attempt is a failed
    client span (no status: nothing answered) before its fallback's; a request the budget
    refuses is a server span alone, `refused`."""
    rec, collector = receiver
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    config = _config(tmp_path, {"dead": dead, "mock": str(upstream.make_url("/v1"))},
                     "  - {match: primary-model, upstream: dead, fallbacks: [mock-gpt]}\n"
                     "  - {match: 'mock-*', upstream: mock}")
    text = config.read_text().replace("    team: research\n",
                                      "    team: research\n    requests_per_minute: 1\n")
    text += f"tracing: {{enabled: true, endpoint: '{collector.make_url('')}'}}\n"
    proxy = await aiohttp_server(create_app(parse_config(text, str(config))))
    async with openai.AsyncOpenAI(base_url=str(proxy.make_url("/v1")), api_key=ALICE,
                                  max_retries=0) as client:
        await client.chat.completions.create(model="primary-model", messages=MESSAGES)
        with pytest.raises(openai.RateLimitError):
            await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
    spans = await rec.wait_for(5)  # the primary is tried twice (a retry), then its fallback
    servers = sorted((s for s in spans if s.kind == SERVER), key=lambda s: s.start_ns)
    clients = sorted((s for s in spans if s.kind == CLIENT), key=lambda s: s.start_ns)
    assert [s.name for s in servers] == ["chat primary-model", "chat mock-gpt"]
    served, refused = servers
    assert [c.parent for c in clients] == [served.span_id] * 3
    *unreachable, fallback = clients
    for attempt in unreachable:
        assert attempt.attributes["error.type"] == "upstream_unreachable" and attempt.error
        assert "http.response.status_code" not in attempt.attributes
    assert fallback.attributes["http.response.status_code"] == 200 and not fallback.error
    assert served.attributes["tokenmeter.budget.decision"] == "admitted"
    assert refused.attributes | {"tokenmeter.budget.decision": "refused",
                                 "error.type": "budget_exceeded",
                                 "http.response.status_code": 429} == refused.attributes
    assert refused.error and refused.trace_id != served.trace_id  # no traceparent: new traces


async def test_an_unsampled_client_trace_exports_nothing_but_carries_on(
    receiver: tuple[Receiver, TestServer], upstream: TestServer, tmp_path: Path,
) -> None:
    """With `parent_based: true` the client's flag is followed: its unsampled `traceparent`
    (flags 00) gets no spans, and the upstream is sent the same trace, unsampled; a trace
    begun by the proxy is sampled and says its id is random (flags 03, as the SDK's Tracer
    sets them)."""
    rec, collector = receiver
    config = _config(tmp_path, {"mock": str(upstream.make_url("/v1"))},
                     "  - {match: '*', upstream: mock}")
    config.write_text(config.read_text() + "tracing: {parent_based: true}\n")
    proxy = ServedProxy(config, tmp_path / "proxy.log", env=_otel_env(collector))
    await proxy.started()
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    try:
        async with openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key=ALICE,
                                      max_retries=0) as client:
            await client.chat.completions.create(
                model="mock-gpt", messages=MESSAGES,
                extra_headers={"traceparent": f"00-{trace_id}-{client_span}-00"})
            await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)
    finally:
        await proxy.stopped()  # SIGTERM: everything queued is exported first
    unsampled, sampled = (r.headers["traceparent"].split("-")
                          for r in upstream.app[MOCK_STATE].requests)
    assert unsampled[1] == trace_id and unsampled[2] != client_span and unsampled[3] == "00"
    assert sampled[3] == "03"
    spans = rec.spans
    assert len(spans) == 2 and {s.trace_id for s in spans} == {sampled[1]}, spans
    (srv,) = [s for s in spans if s.kind == SERVER]
    (attempt,) = [s for s in spans if s.kind == CLIENT]
    assert attempt.span_id == sampled[2] and attempt.parent == srv.span_id and srv.parent == ""


async def _traced_requests(proxy: ServedProxy, flags: list[str]) -> tuple[list[str], float]:
    """One request per entry of `flags`, each with a `traceparent` of its own carrying those
    flags: their trace ids, and the seconds from the first request's start to the last's end."""
    ids: list[str] = []
    async with openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key=ALICE,
                                  max_retries=0) as client:
        start = time.monotonic()
        for flag in flags:
            trace_id = secrets.token_hex(16)
            ids.append(trace_id)
            await client.chat.completions.create(
                model="mock-gpt", messages=MESSAGES,
                extra_headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-{flag}"})
        return ids, time.monotonic() - start


async def test_a_clients_sampled_flag_forces_no_trace_unless_followed_and_then_bounded(
    receiver: tuple[Receiver, TestServer], upstream: TestServer, tmp_path: Path,
) -> None:
    """Issue 31, item 9: with `sample_ratio: 0`, requests whose `traceparent` says sampled
    (-01) were all traced (1,500 requests made 2,865 spans). By default a client's flag now
    decides nothing: none is traced. With `parent_based: true` it is followed, but the traces
    only it made are at most `client_traces_per_s` (a bucket of one second's worth): of 20
    requests sent in `elapsed` seconds, at most 1 + elapsed are traced, each under its
    client's trace; an unsampled flag (-00) is followed too."""
    rec, collector = receiver
    config = _config(tmp_path, {"mock": str(upstream.make_url("/v1"))},
                     "  - {match: '*', upstream: mock}")
    base = config.read_text()
    config.write_text(base + "tracing: {sample_ratio: 0}\n")
    proxy = ServedProxy(config, tmp_path / "proxy.log", env=_otel_env(collector))
    await proxy.started()
    try:
        await _traced_requests(proxy, ["01"] * 20)
    finally:
        assert await proxy.stopped() == 0  # SIGTERM: everything queued is exported first
    assert rec.spans == []
    assert len(upstream.app[MOCK_STATE].requests) == 20

    config.write_text(base + "tracing: {sample_ratio: 0, parent_based: true, "
                             "client_traces_per_s: 1}\n")
    proxy = ServedProxy(config, tmp_path / "proxy2.log", env=_otel_env(collector))
    await proxy.started()
    try:
        ids, elapsed = await _traced_requests(proxy, ["00"] + ["01"] * 20)
    finally:
        assert await proxy.stopped() == 0
    servers = [s for s in rec.spans if s.kind == SERVER]
    assert 1 <= len(servers) <= 1 + int(elapsed) + 1, (len(servers), elapsed)
    assert len(servers) < 20
    assert {s.trace_id for s in servers} <= set(ids[1:])  # the -00 one is never traced
    assert len(rec.spans) == 2 * len(servers)  # each with its attempt's client span
