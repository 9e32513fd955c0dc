#!/usr/bin/env python3
"""Benchmark: the proxy's own cost per request, this checkout against another, interleaved.

    .venv/bin/python benchmarks/bench_request_cost.py --baseline DIR [--rounds 3]

DIR is another checkout of tokenmeter (e.g. `git worktree add /tmp/base <commit>`); both run
on this venv's interpreter, each tree's own `proxy` package first on the path. For each tree,
round after round, it starts the simulated upstream and `tokenmeter serve --upstream` on free
ports and measures:

1. added latency: median client-side time of a small streamed request (16 tokens, no delay)
   through the proxy minus straight to the upstream, sequential, after a warm-up;
2. CPU per stream: utime+stime of the proxy process (from /proc) per 256-token stream at
   3,000 tokens/s, 16 at a time.

The machine is noisy: read the rounds side by side, not one figure.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from procs import cpu_s, free_port, wait_port

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}








class Stack:
    def __init__(self, tree: Path, *mock_args: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(tree),
               "TOKENMETER_STATE_DIR": tempfile.mkdtemp(prefix="tm-cost-")}
        self.mock_port, self.proxy_port = free_port(), free_port()
        cli = [sys.executable, "-m", "proxy.cli"]
        self.mock = subprocess.Popen(
            [*cli, "mock-upstream", "--port", str(self.mock_port), *mock_args],
            env=env, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.proxy = subprocess.Popen(
            [*cli, "serve", "--upstream", f"http://127.0.0.1:{self.mock_port}/v1",
             "--port", str(self.proxy_port), "--log-level", "WARNING"], env=env, cwd=tree,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.mock_port)
        wait_port(self.proxy_port)

    def stop(self) -> None:
        for p in (self.proxy, self.mock):
            p.terminate()
            p.wait(timeout=30)


async def _stream(session: aiohttp.ClientSession, port: int) -> None:
    async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=BODY) as r:
        async for _ in r.content.iter_any():
            pass


async def added_latency_ms(tree: Path, requests: int = 1000) -> float:
    stack = Stack(tree, "--tokens-per-second", "0", "--ttft-ms", "0", "--output-tokens", "16")
    times: dict[int, list[float]] = {stack.mock_port: [], stack.proxy_port: []}
    try:
        async with aiohttp.ClientSession() as s:
            for i in range(requests + 200):
                for port, samples in times.items():
                    started = time.perf_counter()
                    await _stream(s, port)
                    if i >= 200:
                        samples.append(time.perf_counter() - started)
    finally:
        stack.stop()
    return 1000 * (statistics.median(times[stack.proxy_port])
                   - statistics.median(times[stack.mock_port]))


async def cpu_ms_per_stream(tree: Path, streams: int = 1200, concurrency: int = 16) -> float:
    stack = Stack(tree, "--tokens-per-second", "3000", "--ttft-ms", "5",
                  "--output-tokens", "256")
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(50):
                await _stream(s, stack.proxy_port)
            gate = asyncio.Semaphore(concurrency)

            async def one() -> None:
                async with gate:
                    await _stream(s, stack.proxy_port)

            before = cpu_s(stack.proxy.pid)
            await asyncio.gather(*(one() for _ in range(streams)))
            return 1000 * (cpu_s(stack.proxy.pid) - before) / streams
    finally:
        stack.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    trees = {"baseline": args.baseline.resolve(), "this": Path(__file__).resolve().parents[1]}
    print(f"{'round':>5} {'tree':<9} {'added latency ms':>17} {'CPU ms/stream':>14}")
    for r in range(1, args.rounds + 1):
        for name, tree in trees.items():
            lat = asyncio.run(added_latency_ms(tree))
            cpu = asyncio.run(cpu_ms_per_stream(tree))
            print(f"{r:>5} {name:<9} {lat:>17.3f} {cpu:>14.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
