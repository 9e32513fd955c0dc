#!/usr/bin/env python3
"""Benchmark: what OpenTelemetry tracing costs a request, off and on with every trace sampled.

    .venv/bin/python benchmarks/bench_tracing.py [--rounds 3] [--requests 2000]

The simulated upstream runs throughout; each round starts, side by side, `tokenmeter serve`
with tracing off (the default: no OTEL_* variables), on (`OTEL_TRACES_EXPORTER=otlp`,
`OTEL_TRACES_SAMPLER=always_on`, OTLP over HTTP/protobuf to a collector this script runs) and
on with 10% of traces sampled (`traceidratio`, 0.1: what a busy deployment would run). The
proxies are sent 100 requests each in turn (so the noise of a shared machine falls on all of
them alike), 16 at a time, with a 1 KB prompt and a client `traceparent`; half are streamed.
For each variant it measures CPU per request (utime+stime of the proxy process, from /proc,
over its share; the batch span processor's thread and its exports run in that process, so
their cost is in it), and afterwards, once the proxies have stopped (SIGTERM flushes the
queue), counts the spans each collector decoded: two per request (a server span and the
attempt's client span; about a tenth of that at 10%); a variant that dropped spans cannot
look cheap.

Target (issue 24): off costs nothing (compare with benchmarks/bench_request_cost.py); on at
sampling 1.0 at most 1.15x off (the 10% variant is reported, not judged).
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from procs import Served, cpu_s, free_port, wait_port

PROMPT = ("The quick brown fox jumps over the lazy dog. " * 23)[:1024]  # 1 KB
BODIES = ({"model": "m", "messages": [{"role": "user", "content": PROMPT}]},
          {"model": "m", "messages": [{"role": "user", "content": PROMPT}], "stream": True})
VARIANTS = ("off", "on", "10%")
WARM_UP = 200


class Collector:
    """An OTLP/HTTP collector that decodes every export and counts its spans."""

    def __init__(self) -> None:
        self.spans = 0
        self.port = free_port()
        self._runner: web.AppRunner | None = None

    async def _traces(self, request: web.Request) -> web.Response:
        export = ExportTraceServiceRequest.FromString(await request.read())
        self.spans += sum(len(ss.spans) for rs in export.resource_spans for ss in rs.scope_spans)
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


async def _one(session: aiohttp.ClientSession, port: int, i: int) -> None:
    headers = {"traceparent": f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"}
    async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=BODIES[i % 2],
                            headers=headers) as r:
        await r.read()
        assert r.status == 200, r.status


def _env(variant: str, collector: Collector) -> dict[str, str]:
    if variant == "off":
        return {}
    return {
        "OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector.port}",
        # 10%: by trace id, whatever the client's traceparent says (the server and client
        # spans of a request share its id, so both are kept or neither).
        **({"OTEL_TRACES_SAMPLER": "always_on"} if variant == "on" else
           {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"}),
    }


async def _load(session: aiohttp.ClientSession, port: int, requests: int,
                concurrency: int = 16) -> None:
    queue = iter(range(requests))

    async def worker() -> None:
        for i in queue:
            await _one(session, port, i)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _round(mock_port: int, requests: int, chunk: int = 100) -> dict[str, tuple[float, int]]:
    """Every variant's proxy at once, sent `chunk` requests in turn until each has had
    `requests`: the machine's noise (it is shared) falls on all of them alike. CPU per request
    of each over its share, and the spans its collector decoded once it stopped."""
    collectors = {v: Collector() for v in VARIANTS}
    for collector in collectors.values():
        await collector.start()
    config = (f"upstreams:\n  mock: {{base_url: 'http://127.0.0.1:{mock_port}/v1'}}\n"
              "metrics: {discover_models: false}\n")
    proxies = {v: Served(config, f"tm-tracing-{v}-", env=_env(v, collectors[v])) for v in VARIANTS}
    try:
        async with aiohttp.ClientSession() as session:
            for served in proxies.values():  # warm-up: connections, caches, the exporter
                await _load(session, served.port, WARM_UP)
            before = {v: cpu_s(p.proc.pid) for v, p in proxies.items()}
            for _ in range(requests // chunk):
                for served in proxies.values():
                    await _load(session, served.port, chunk)
            cpu = {v: (cpu_s(p.proc.pid) - before[v]) / requests * 1000
                   for v, p in proxies.items()}
    finally:
        for served in proxies.values():
            await asyncio.to_thread(served.stop)  # SIGTERM: queued spans are exported first
    for collector in collectors.values():
        await collector.stop()
    return {v: (cpu[v], collectors[v].spans) for v in VARIANTS}


def _start_mock() -> tuple[subprocess.Popen[bytes], int]:
    # Started between measurements, never during one: a blocking start is fine.
    port = free_port()
    mock = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "mock-upstream", "--port", str(port),
         "--ttft-ms", "0", "--tokens-per-second", "0", "--output-tokens", "64"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port)
    return mock, port


async def run(rounds: int, requests: int) -> int:
    mock, port = _start_mock()
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    ok = True
    every = 2 * (requests + WARM_UP)  # a server and a client span per request
    try:
        for r in range(rounds):
            started = time.perf_counter()
            for variant, (ms, spans) in (await _round(port, requests)).items():
                cpu[variant].append(ms)
                expected = {"off": "0", "on": str(every), "10%": f"about {every // 10}"}[variant]
                ok = ok and {"off": spans == 0, "on": spans == every,
                             "10%": 0 < spans < every // 5 and spans % 2 == 0}[variant]
                print(f"round {r + 1} {variant:4s}: {ms:.3f} ms CPU/request, {spans} spans "
                      f"(expected {expected})", flush=True)
            print(f"round {r + 1}: {time.perf_counter() - started:.1f} s", flush=True)
    finally:
        mock.terminate()
        mock.wait(timeout=30)
    base = statistics.median(cpu["off"])
    print(f"\nmedian over {rounds} rounds ({requests} requests each, 1 KB prompts, half "
          "streamed, 16 at a time):")
    for variant in VARIANTS:
        ratio = statistics.median(cpu[variant]) / base
        verdict = "" if variant != "on" else ("  OK" if ratio <= 1.15 else "  OVER TARGET")
        ok = ok and (variant != "on" or ratio <= 1.15)
        print(f"  tracing {variant:4s}: CPU/request {statistics.median(cpu[variant]):.3f} ms "
              f"({ratio:.3f}x off; target <= 1.15x){verdict}")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    return asyncio.run(run(args.rounds, args.requests))


if __name__ == "__main__":
    raise SystemExit(main())
