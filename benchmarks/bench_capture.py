#!/usr/bin/env python3
"""Benchmark: what capture costs a request, off and with `sample: 1.0`, on SQLite and on
PostgreSQL, and what a capture takes on disk.

    .venv/bin/python benchmarks/bench_capture.py [--rounds 3] [--requests 2000]

Each round starts the simulated upstream and, one variant after another (so the machine's noise
falls on all of them alike), `tokenmeter serve` with capture off (`enabled: false`, the
default), with `sample: 1.0` into the default SQLite file (the ledger's database), and with
`sample: 1.0` into a fresh PostgreSQL database. Requests carry a 1 KB prompt; half are streamed.
For each variant it measures CPU per request (utime+stime of the proxy process, from /proc, 16
requests at a time; the capture writer runs in the same process, so its cost is in it), and
afterwards counts the captures stored (a variant that dropped captures cannot look cheap) and
their size on disk.

Targets (issue 22): capture off costs nothing (the same as before capture existed, within
noise: compare with benchmarks/bench_request_cost.py); `sample: 1.0` at most 1.15x off for 1 KB
prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import aiohttp
import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from procs import Served, cpu_s, free_port, wait_port

PG = "postgresql://postgres@127.0.0.1:5432"
PROMPT = ("The quick brown fox jumps over the lazy dog. " * 23)[:1024]  # 1 KB
BODIES = ({"model": "m", "messages": [{"role": "user", "content": PROMPT}]},
          {"model": "m", "messages": [{"role": "user", "content": PROMPT}], "stream": True})
VARIANTS = ("off", "sqlite", "postgresql")
TABLE = "tokenmeter_captures"


class Proxy:
    def __init__(self, variant: str, mock_port: int, pg_db: str | None) -> None:
        self.variant = variant
        self.pg_db = pg_db
        capture = {"off": "{enabled: false}", "sqlite": "{enabled: true, sample: 1.0}",
                   "postgresql": f'{{enabled: true, sample: 1.0, url: "{PG}/{pg_db}"}}'}[variant]
        self.served = Served(
            f"upstreams:\n  mock: {{base_url: 'http://127.0.0.1:{mock_port}/v1'}}\n"
            f"metrics: {{discover_models: false}}\ncapture: {capture}\n",
            f"tm-capture-{variant}-")
        self.state, self.port, self.proc = self.served.state, self.served.port, self.served.proc

    def stop(self) -> None:
        self.served.stop()  # SIGTERM: what it queued is written before it exits

    async def stored(self) -> tuple[int, int]:
        """(captures, bytes of their compressed data)."""
        query = f"SELECT count(*), coalesce(sum(length(data)), 0) FROM {TABLE}"
        if self.variant == "off":
            return 0, 0
        if self.variant == "sqlite":
            with sqlite3.connect(self.state / "ledger.sqlite3") as db:
                n, size = db.execute(query).fetchone()
                return int(n), int(size)
        conn = await asyncpg.connect(f"{PG}/{self.pg_db}")
        try:
            row = await conn.fetchrow(query)
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


async def _variant(variant: str, mock_port: int, requests: int) -> tuple[float, int, int]:
    db = f"tm_bench_{uuid.uuid4().hex[:10]}" if variant == "postgresql" else None
    if db is not None:
        await _admin(f"CREATE DATABASE {db}")
    proxy = Proxy(variant, mock_port, db)
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


async def run(rounds: int, requests: int) -> int:
    mock, port = _start_mock()
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    ok = True
    try:
        for r in range(rounds):
            for variant in VARIANTS:
                started = time.perf_counter()
                ms, stored, size = await _variant(variant, port, requests)
                cpu[variant].append(ms)
                expected = 0 if variant == "off" else requests + 200
                ok = ok and stored == expected
                per = f", {size / stored:.0f} B each on disk" if stored else ""
                print(f"round {r + 1} {variant:10s}: {ms:.3f} ms CPU/request, {stored} captures "
                      f"(expected {expected}){per}, {time.perf_counter() - started:.1f} s",
                      flush=True)
    finally:
        mock.terminate()
        mock.wait(timeout=30)
    base = statistics.median(cpu["off"])
    print(f"\nmedian over {rounds} rounds ({requests} requests each, 1 KB prompts, 16 at a time):")
    for variant in VARIANTS:
        ratio = statistics.median(cpu[variant]) / base
        verdict = "" if variant == "off" else ("  OK" if ratio <= 1.15 else "  OVER TARGET")
        ok = ok and (variant == "off" or ratio <= 1.15)
        print(f"  {variant:10s}: CPU/request {statistics.median(cpu[variant]):.3f} ms "
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
