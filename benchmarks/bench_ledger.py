#!/usr/bin/env python3
"""Benchmark: what the ledger costs a request, with the ledger off, on SQLite and on PostgreSQL.

    .venv/bin/python benchmarks/bench_ledger.py [--rounds 3] [--requests 3000] [--quick]

Each round starts the simulated upstream and, one variant after another (so the machine's noise
falls on all of them alike), `tokenmeter serve` with `ledger.enabled: false`, with the default
SQLite ledger, and with `ledger.url` on a fresh database of the PostgreSQL at 127.0.0.1:5432.
For each it measures:

1. CPU per request: utime+stime of the proxy process (from /proc) per small non-streamed
   request, 16 at a time; the proxy's shipper runs in the same process, so its cost is in it;
2. added TTFT: the median time to the first content byte of a small stream through the proxy,
   sequential, minus the same straight to the upstream, measured in the same round.

Targets (issue 12): CPU per request with the ledger on at most 1.10x the ledger off; added TTFT
no different beyond noise. The rows every variant wrote are counted in its database afterwards,
so a variant that silently dropped its books cannot look cheap.
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
PLAIN = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
STREAM = {**PLAIN, "stream": True}
VARIANTS = ("off", "sqlite", "postgresql")








class Proxy:
    def __init__(self, variant: str, mock_port: int, pg_db: str | None) -> None:
        self.variant = variant
        self.pg_db = pg_db
        ledger = {"off": "{enabled: false}", "sqlite": "{}",
                  "postgresql": f'{{url: "{PG}/{pg_db}"}}'}[variant]
        self.served = Served(
            f"upstreams:\n  mock: {{base_url: 'http://127.0.0.1:{mock_port}/v1'}}\n"
            f"metrics: {{discover_models: false}}\nledger: {ledger}\n",
            f"tm-ledger-{variant}-")
        self.state, self.port, self.proc = self.served.state, self.served.port, self.served.proc

    def stop(self) -> None:
        self.served.stop()  # SIGTERM: what it queued is written before it exits

    async def rows(self) -> int:
        if self.variant == "off":
            return 0
        if self.variant == "sqlite":
            with sqlite3.connect(self.state / "ledger.sqlite3") as db:
                return int(db.execute("SELECT count(*) FROM tokenmeter_requests").fetchone()[0])
        conn = await asyncpg.connect(f"{PG}/{self.pg_db}")
        try:
            return int(await conn.fetchval("SELECT count(*) FROM tokenmeter_requests"))
        finally:
            await conn.close()


async def _plain(session: aiohttp.ClientSession, port: int) -> None:
    async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=PLAIN) as r:
        await r.read()
        assert r.status == 200, r.status


async def cpu_ms_per_request(proxy: Proxy, requests: int, concurrency: int = 16) -> float:
    async with aiohttp.ClientSession() as session:
        for _ in range(200):  # warm-up: connections, caches, the first batch shipped
            await _plain(session, proxy.port)
        before = cpu_s(proxy.proc.pid)
        queue = iter(range(requests))

        async def worker() -> None:
            for _ in queue:
                await _plain(session, proxy.port)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return (cpu_s(proxy.proc.pid) - before) / requests * 1000


async def _ttft(session: aiohttp.ClientSession, port: int) -> float:
    started = time.perf_counter()
    async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=STREAM) as r:
        await r.content.readany()
        first = time.perf_counter() - started
        await r.read()
    return first


async def median_ttft_ms(port: int, requests: int) -> float:
    async with aiohttp.ClientSession() as session:
        for _ in range(50):
            await _ttft(session, port)
        return statistics.median([await _ttft(session, port) for _ in range(requests)]) * 1000


async def _create_db() -> str:
    name = f"tm_bench_{uuid.uuid4().hex[:10]}"
    conn = await asyncpg.connect(f"{PG}/postgres")
    try:
        await conn.execute(f"CREATE DATABASE {name}")
    finally:
        await conn.close()
    return name


async def _drop_db(name: str) -> None:
    conn = await asyncpg.connect(f"{PG}/postgres")
    try:
        await conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    finally:
        await conn.close()


def _start_mock() -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    mock = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "mock-upstream", "--port", str(port),
         "--ttft-ms", "0", "--tokens-per-second", "0", "--output-tokens", "16"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port)
    return mock, port


async def run(rounds: int, requests: int, ttft_requests: int) -> int:
    # The processes start between measurements, never during one: a blocking start is fine.
    mock, mock_port = _start_mock()
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    added: dict[str, list[float]] = {v: [] for v in VARIANTS}
    try:
        for r in range(rounds):
            direct = await median_ttft_ms(mock_port, ttft_requests)
            for variant in VARIANTS:
                db = await _create_db() if variant == "postgresql" else None
                proxy = Proxy(variant, mock_port, db)
                try:
                    cpu[variant].append(await cpu_ms_per_request(proxy, requests))
                    added[variant].append(await median_ttft_ms(proxy.port, ttft_requests)
                                          - direct)
                finally:
                    proxy.stop()
                expected = requests + 200 + ttft_requests + 50
                rows = await proxy.rows()
                if variant != "off" and rows != expected:
                    print(f"round {r + 1} {variant}: {rows} rows, expected {expected}",
                          file=sys.stderr)
                    return 1
                if db is not None:
                    await _drop_db(db)
                print(f"round {r + 1} {variant:10s}: {cpu[variant][-1]:.3f} ms CPU/request, "
                      f"added TTFT p50 {added[variant][-1]:.3f} ms, rows {rows}", flush=True)
    finally:
        mock.terminate()
        mock.wait(timeout=30)
    base = statistics.median(cpu["off"])
    print(f"\nmedian over {rounds} rounds ({requests} requests each, 16 at a time):")
    ok = True
    for variant in VARIANTS:
        ratio = statistics.median(cpu[variant]) / base
        ttft = statistics.median(added[variant])
        verdict = "" if variant == "off" else ("  OK" if ratio <= 1.10 else "  OVER TARGET")
        ok = ok and (variant == "off" or ratio <= 1.10)
        print(f"  {variant:10s}: CPU/request {statistics.median(cpu[variant]):.3f} ms "
              f"({ratio:.3f}x off; target <= 1.10x){verdict}; added TTFT p50 {ttft:.3f} ms")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--ttft-requests", type=int, default=300)
    parser.add_argument("--quick", action="store_true", help="1 round, 800 requests")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.requests, args.ttft_requests = 1, 800, 100
    return asyncio.run(run(args.rounds, args.requests, args.ttft_requests))


if __name__ == "__main__":
    raise SystemExit(main())
