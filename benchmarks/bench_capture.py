#!/usr/bin/env python3
"""Benchmark: what capture costs a request, off and with `sample: 1.0`, on SQLite and on
PostgreSQL, and what a capture takes on disk.

    .venv/bin/python benchmarks/bench_capture.py [--rounds 3] [--requests 2000] [--before DIR]

Each round starts the simulated upstream and, one variant after another (so the machine's noise
falls on all of them alike), `tokenmeter serve` with capture off (`enabled: false`, the
default), with `sample: 1.0` into the default SQLite file (the ledger's database), and with
`sample: 1.0` into a fresh PostgreSQL database. Requests carry a 1 KB prompt; half are streamed.
For each variant it measures CPU per request (utime+stime of the proxy process, from /proc, 16
requests at a time; the capture writer runs in the same process, so its cost is in it), and
afterwards counts the captures stored (a variant that dropped captures cannot look cheap) and
their size on disk.

With `--before DIR` (a checkout of the commit before capture existed, e.g.
`git worktree add --detach /tmp/tm-before-capture 2cf3d75~1`), each round also serves that
code (its `proxy` package, run from DIR, with the same configuration minus `capture:`) under
the same load, interleaved with the others: "capture off" against "no capture at all".

Then the store's write throughput: captures made from a representative request (the same 1 KB
prompt, half of them streams of 64 events) written through the store's API in the writer's
batches (`CaptureStore.write`, 64 at a time), into SQLite and PostgreSQL: rows/s, and what
making a capture (redaction, bounding) costs beside it.

Targets (issue 22): capture off costs nothing (the same as before capture existed, within
noise); `sample: 1.0` at most 1.15x off for 1 KB prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp
import asyncpg

from proxy.capture.collect import Collector, Meta, Pending, redactor
from proxy.capture.store import PG_TABLE, TABLE, CaptureStore
from proxy.capture.writer import BATCH
from proxy.config.capture import DEFAULT_REDACT

sys.path.insert(0, str(Path(__file__).resolve().parent))
from procs import Served, cpu_s, free_port, wait_port

PG = "postgresql://postgres@127.0.0.1:5432"
PROMPT = ("The quick brown fox jumps over the lazy dog. " * 23)[:1024]  # 1 KB
BODIES = ({"model": "m", "messages": [{"role": "user", "content": PROMPT}]},
          {"model": "m", "messages": [{"role": "user", "content": PROMPT}], "stream": True})
VARIANTS = ("off", "sqlite", "postgresql")
BEFORE = "before"  # the code of the commit before capture existed (--before DIR)


class Proxy:
    def __init__(self, variant: str, mock_port: int, pg_db: str | None,
                 before: Path | None = None) -> None:
        self.variant = variant
        self.pg_db = pg_db
        capture = {"off": "{enabled: false}", "sqlite": "{enabled: true, sample: 1.0}",
                   "postgresql": f'{{enabled: true, sample: 1.0, url: "{PG}/{pg_db}"}}',
                   BEFORE: None}[variant]
        config = (f"upstreams:\n  mock: {{base_url: 'http://127.0.0.1:{mock_port}/v1'}}\n"
                  f"metrics: {{discover_models: false}}\n")
        if capture is not None:
            config += f"capture: {capture}\n"
        # `python -m proxy.cli` run from `before` imports that checkout's package first.
        self.served = Served(config, f"tm-capture-{variant}-", cwd=before)
        self.state, self.port, self.proc = self.served.state, self.served.port, self.served.proc

    def stop(self) -> None:
        self.served.stop()  # SIGTERM: what it queued is written before it exits

    async def stored(self) -> tuple[int, int]:
        """(captures, bytes of their compressed data)."""
        query = "SELECT count(*), coalesce(sum(length(data)), 0) FROM {}"
        if self.variant in ("off", BEFORE):
            return 0, 0
        if self.variant == "sqlite":
            with sqlite3.connect(self.state / "ledger.sqlite3") as db:
                n, size = db.execute(query.format(TABLE)).fetchone()
                return int(n), int(size)
        conn = await asyncpg.connect(f"{PG}/{self.pg_db}")
        try:
            row = await conn.fetchrow(query.format(PG_TABLE))
            assert row is not None  # an aggregate always has its one row
            return int(row[0]), int(row[1])
        finally:
            await conn.close()


async def _one(session: aiohttp.ClientSession, port: int, i: int) -> None:
    body = BODIES[i % 2]
    async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
        await r.read()
        assert r.status == 200, r.status


async def cpu_ms_per_request(proxy: Proxy, requests: int, concurrency: int = 16) -> float:
    async with aiohttp.ClientSession() as session:
        for i in range(200):  # warm-up: connections, caches, the store opened
            await _one(session, proxy.port, i)
        before = cpu_s(proxy.proc.pid)
        queue = iter(range(requests))

        async def worker() -> None:
            for i in queue:
                await _one(session, proxy.port, i)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return (cpu_s(proxy.proc.pid) - before) / requests * 1000


async def _admin(statement: str) -> None:
    conn = await asyncpg.connect(f"{PG}/postgres")
    try:
        await conn.execute(statement)
    finally:
        await conn.close()


async def _variant(variant: str, mock_port: int, requests: int,
                   before: Path | None) -> tuple[float, int, int]:
    db = f"tm_bench_{uuid.uuid4().hex[:10]}" if variant == "postgresql" else None
    if db is not None:
        await _admin(f"CREATE DATABASE {db}")
    proxy = Proxy(variant, mock_port, db, before if variant == BEFORE else None)
    try:
        cpu = await cpu_ms_per_request(proxy, requests)
    finally:
        proxy.stop()
    stored, size = await proxy.stored()
    if db is not None:
        await _admin(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
    return cpu, stored, size


def _start_mock() -> tuple[subprocess.Popen[bytes], int]:
    # Started between measurements, never during one: a blocking start is fine.
    port = free_port()
    mock = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "mock-upstream", "--port", str(port),
         "--ttft-ms", "0", "--tokens-per-second", "0", "--output-tokens", "64"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port)
    return mock, port


async def run(rounds: int, requests: int, before: Path | None, writes: int) -> int:
    mock, port = _start_mock()
    variants = ((BEFORE,) if before is not None else ()) + VARIANTS
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    sizes: dict[str, list[float]] = {v: [] for v in variants}
    ok = True
    try:
        for r in range(rounds):
            for variant in variants:
                started = time.perf_counter()
                ms, stored, size = await _variant(variant, port, requests, before)
                cpu[variant].append(ms)
                expected = 0 if variant in ("off", BEFORE) else requests + 200
                ok = ok and stored == expected
                per = f", {size / stored:.0f} B each on disk" if stored else ""
                if stored:
                    sizes[variant].append(size / stored)
                print(f"round {r + 1} {variant:10s}: {ms:.3f} ms CPU/request, {stored} captures "
                      f"(expected {expected}){per}, {time.perf_counter() - started:.1f} s",
                      flush=True)
    finally:
        mock.terminate()
        mock.wait(timeout=30)
    base = statistics.median(cpu["off"])
    print(f"\nmedian over {rounds} rounds ({requests} requests each, 1 KB prompts, 16 at a time):")
    for variant in variants:
        ratio = statistics.median(cpu[variant]) / base
        if variant == BEFORE:
            verdict = "  (the code before capture: capture off should be within noise of it)"
        else:
            verdict = "" if variant == "off" else ("  OK" if ratio <= 1.15 else "  OVER TARGET")
        ok = ok and (variant in ("off", BEFORE) or ratio <= 1.15)
        each = (f", {statistics.median(sizes[variant]):.0f} B per captured request"
                if sizes[variant] else "")
        print(f"  {variant:10s}: CPU/request {statistics.median(cpu[variant]):.3f} ms "
              f"({ratio:.3f}x off{'' if variant in ('off', BEFORE) else '; target <= 1.15x'})"
              f"{each}{verdict}")
    if writes:
        await write_throughput(writes)
    return 0 if ok else 1


def _pending(i: int) -> Pending:
    """A capture to make, as the proxy keeps one of the benchmark's requests."""
    stream = i % 2 == 1
    c = Collector(64 * 1024, "openai", "/v1/chat/completions")
    body = json.dumps({**BODIES[i % 2], "max_tokens": 64}).encode()
    c.sent(body)
    c.forwarded(body)
    if stream:
        for n in range(64):
            delta = {"id": "chatcmpl-b", "object": "chat.completion.chunk", "created": 1,
                     "model": "m", "choices": [{"index": 0, "delta": {"content": f" w{n}"},
                                                "finish_reason": None}]}
            c.streamed(b"data: " + json.dumps(delta).encode() + b"\n\n", n * 2.5)
        c.streamed(b"data: [DONE]\n\n", 161.0)
    else:
        c.answered(json.dumps({"choices": [{"index": 0, "message": {
            "role": "assistant", "content": " ".join(f"w{n}" for n in range(64))}}]}).encode())
    meta = Meta(request_id=f"w{i}-{uuid.uuid4().hex}", started_at=time.time(), api="openai",
                path="/v1/chat/completions", operation="chat", user="bench", key_name=None,
                team=None, requested_model="m", model="m", stream=stream, status=200,
                error_class="none")
    return Pending(c, meta, redactor(list(DEFAULT_REDACT)))


async def write_throughput(n: int) -> None:
    """Rows/s through `CaptureStore.write` in the writer's batches, into both databases."""
    pending = [_pending(i) for i in range(n)]
    started = time.process_time()
    captures = [p.capture() for p in pending]
    made_us = (time.process_time() - started) / n * 1e6
    print(f"\nstore write throughput ({n} captures, {BATCH} a batch; making one: "
          f"{made_us:.0f} us CPU):")
    db = f"tm_bench_{uuid.uuid4().hex[:10]}"
    await _admin(f"CREATE DATABASE {db}")
    tmp = Path(tempfile.mkdtemp(prefix="tm-capture-writes-"))
    try:
        for name, url in (("sqlite", f"sqlite://{tmp / 'captures.sqlite3'}"),
                          ("postgresql", f"{PG}/{db}")):
            store = await CaptureStore.open(url)
            try:
                wall, cpu, stored = time.perf_counter(), time.process_time(), 0
                for at in range(0, n, BATCH):
                    stored += await store.write(captures[at:at + BATCH])
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            finally:
                await store.close()
            print(f"  {name:10s}: {n / wall:,.0f} rows/s ({wall * 1e6 / n:.0f} us each, "
                  f"{cpu * 1e6 / n:.0f} us of it this process's CPU), {stored / n:.0f} B "
                  "per capture stored")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        await _admin(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--before", type=Path, metavar="DIR",
                        help="a checkout of the commit before capture existed, served too")
    parser.add_argument("--writes", type=int, default=5000,
                        help="captures written through the store API per database (0: skip)")
    args = parser.parse_args()
    return asyncio.run(run(args.rounds, args.requests, args.before, args.writes))


if __name__ == "__main__":
    raise SystemExit(main())
