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

    .venv/bin/python benchmarks/bench_request_cost.py --baseline DIR --budget [--rounds 3]

`--budget` measures instead the CPU per small request (non-streamed, `max_tokens: 8`, 16 at a
time) with budgets on Redis against without and against the bare aiohttp pass-through
(benchmarks/bare_proxy.py), on one simulated upstream and one private redis-server: per round,
in rotated order, bare, then each tree's `serve --upstream` (shipped defaults: access log and
ledger on) and `serve --config` with one user, a key and daily and per-minute windows on the
redis-server. CPU is utime+stime of each gateway's whole process tree; redis-server's CPU is
given per budgeted request.

    .venv/bin/python benchmarks/bench_request_cost.py --baseline DIR --store [--rounds 3]

`--capture` measures the default figures with capture on (`sample: 1`: every request captured).

`--store` measures the Redis store alone, in a process of its own per tree: CPU time of
`RedisStore.reserve` + `settle` of one request (a user's daily and per-minute windows, its
in-flight set), 16 at a time, on one private redis-server.
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
from bench_proxy import cpu_times, process_tree
from procs import cpu_s, free_port, wait_port

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
SMALL = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi there"}]}
KEY = "sk-cost-bench-user-000000"








# `--capture`: every request captured (capture on, `sample: 1`), one upstream, as `--upstream`.
CAPTURE = False


def _capture_config(mock_port: int) -> str:
    return (f"upstreams:\n  mock: {{base_url: 'http://127.0.0.1:{mock_port}/v1'}}\n"
            "metrics: {discover_models: false}\ntimezone: UTC\n"
            "capture: {enabled: true, sample: 1.0}\n")


class Stack:
    def __init__(self, tree: Path, *mock_args: str) -> None:
        state = tempfile.mkdtemp(prefix="tm-cost-")
        env = {**os.environ, "PYTHONPATH": str(tree), "TOKENMETER_STATE_DIR": state}
        self.mock_port, self.proxy_port = free_port(), free_port()
        cli = [sys.executable, "-m", "proxy.cli"]
        self.mock = subprocess.Popen(
            [*cli, "mock-upstream", "--port", str(self.mock_port), *mock_args],
            env=env, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        upstream = ["--upstream", f"http://127.0.0.1:{self.mock_port}/v1"]
        if CAPTURE:
            config = Path(state) / "capture.yaml"
            config.write_text(_capture_config(self.mock_port))
            upstream = ["--config", str(config)]
        self.proxy = subprocess.Popen(
            [*cli, "serve", *upstream,
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


def _tree_cpu(pid: int) -> float:
    return sum(cpu_times(process_tree(pid)))


def _budget_config(mock_port: int, redis_port: int) -> str:
    return (f"upstreams:\n  mock: {{base_url: 'http://127.0.0.1:{mock_port}/v1'}}\n"
            "metrics: {discover_models: false}\ntimezone: UTC\n"
            f"store: {{url: 'redis://127.0.0.1:{redis_port}/0'}}\n"
            f"users:\n  bench:\n    keys: ['{KEY}']\n    daily_tokens: 1000000000000\n"
            "    tokens_per_minute: 1000000000000\n    requests_per_minute: 1000000000\n")


class BudgetStack:
    """One mock, one redis-server and the bare pass-through; per tree `serve --upstream`
    (`off`) and `serve --config` with budgets on the redis-server (`redis`)."""

    def __init__(self, trees: dict[str, Path]) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.mock_port, self.redis_port, bare_port = free_port(), free_port(), free_port()
        here = Path(__file__).resolve()
        env = {**os.environ, "PYTHONPATH": str(here.parents[1])}
        self._start([sys.executable, "-m", "proxy.cli", "mock-upstream", "--port",
                     str(self.mock_port), "--tokens-per-second", "0", "--ttft-ms", "0"], env)
        self.redis = self._start(["redis-server", "--port", str(self.redis_port), "--bind",
                                  "127.0.0.1", "--save", "", "--appendonly", "no"], env)
        bare = self._start([sys.executable, str(here.parent / "bare_proxy.py"), "--port",
                            str(bare_port), "--upstream", f"http://127.0.0.1:{self.mock_port}"],
                           env)
        self.gateways: dict[str, tuple[int, int]] = {"bare": (bare_port, bare.pid)}
        for name, tree in trees.items():
            conf = Path(tempfile.mkdtemp(prefix="tm-cost-")) / "budget.yaml"
            conf.write_text(_budget_config(self.mock_port, self.redis_port))
            for mode, how in (("off", ["--upstream", f"http://127.0.0.1:{self.mock_port}/v1"]),
                              ("redis", ["--config", str(conf)])):
                port = free_port()
                tenv = {**os.environ, "PYTHONPATH": str(tree),
                        "TOKENMETER_STATE_DIR": tempfile.mkdtemp(prefix="tm-cost-")}
                proc = self._start([sys.executable, "-m", "proxy.cli", "serve", *how, "--port",
                                    str(port)], tenv, cwd=tree)
                self.gateways[f"{name}-{mode}"] = (port, proc.pid)
        for port, _ in [(self.mock_port, 0), (self.redis_port, 0), *self.gateways.values()]:
            wait_port(port)

    def _start(self, argv: list[str], env: dict[str, str], cwd: Path | None = None
               ) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.terminate()
            p.wait(timeout=60)


async def small_batch(port: int, requests: int, concurrency: int = 16) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    left = [requests]
    async with aiohttp.ClientSession() as s:
        async def client() -> None:
            while left[0] > 0:
                left[0] -= 1
                async with s.post(url, json=SMALL, headers=headers) as r:
                    body = await r.read()
                    if r.status != 200 or b'"choices"' not in body:
                        raise RuntimeError(f"HTTP {r.status}: {body[:200]!r}")

        await asyncio.gather(*(client() for _ in range(concurrency)))


def budget_rounds(trees: dict[str, Path], rounds: int, requests: int) -> None:
    stack = BudgetStack(trees)
    try:
        names = list(stack.gateways)
        for name in names:  # warm-up
            asyncio.run(small_batch(stack.gateways[name][0], 200))
        print("CPU ms per small request (x = ratio to bare in the same round); "
              "redis = redis-server CPU ms per budgeted request")
        print(f"{'round':>5} " + " ".join(f"{n:>16}" for n in names)
              + "".join(f" {'redis ' + t:>14}" for t in trees))
        for r in range(1, rounds + 1):
            cpu: dict[str, float] = {}
            redis: dict[str, float] = {}
            for name in names[r % len(names):] + names[:r % len(names)]:
                port, pid = stack.gateways[name]
                before, rbefore = _tree_cpu(pid), _tree_cpu(stack.redis.pid)
                asyncio.run(small_batch(port, requests))
                time.sleep(0.2)  # what the gateway does after the last byte (ledger, log)
                cpu[name] = 1000 * (_tree_cpu(pid) - before) / requests
                redis[name] = 1000 * (_tree_cpu(stack.redis.pid) - rbefore) / requests
            bare = cpu["bare"]
            print(f"{r:>5} " + " ".join(f"{cpu[n]:>8.3f} ({cpu[n] / bare:4.2f}x)" for n in names)
                  + "".join(f" {redis[f'{t}-redis']:>14.3f}" for t in trees), flush=True)
    finally:
        stack.stop()


async def _store_pairs(port: int, pairs: int, concurrency: int = 16) -> float:
    """In the child: CPU ms per reserve + settle on this tree's RedisStore."""
    from proxy.budget import store as store_module
    from proxy.budget.store import USER, InFlightLimit, ReserveRequest
    from proxy.budget.store_redis import RedisStore

    store = RedisStore(f"redis://127.0.0.1:{port}/0", 5000)
    slot, now = "tm:{bench}", time.time()
    # The baseline tree may name a window's amount by its former name, `Entry`.
    window_amount = getattr(store_module, "WindowAmount", None) or store_module.Entry  # type: ignore[attr-defined]
    entries = (window_amount(f"{slot}:u:daily_tokens:{int(now // 86400)}", 10**12, 30, 86400),
               window_amount(f"{slot}:u:tokens_per_minute:{int(now // 60)}", 10**12, 30, 120),
               window_amount(f"{slot}:u:requests_per_minute:{int(now // 60)}", 10**9, 1, 120))
    request = ReserveRequest(entries, (InFlightLimit(USER, 1000),))
    done = [0]

    async def client(n: int) -> None:
        while done[0] < n:
            done[0] += 1
            res_id = f"r{done[0]:020d}-{time.monotonic_ns()}"
            if not (await store.reserve(slot, res_id, request, 60)).ok:
                raise RuntimeError("refused")
            await store.settle(slot, res_id, entries)

    await asyncio.gather(*(client(pairs // 5) for _ in range(concurrency)))  # warm-up
    done[0] = 0
    started = time.process_time()
    await asyncio.gather(*(client(pairs) for _ in range(concurrency)))
    spent = time.process_time() - started
    await store.close()
    return 1000 * spent / pairs


def store_rounds(trees: dict[str, Path], rounds: int, pairs: int) -> None:
    port = free_port()
    redis = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                              "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        wait_port(port)
        print("CPU ms per reserve + settle in the serving process (RedisStore alone)")
        print(f"{'round':>5} " + " ".join(f"{t:>10}" for t in trees))
        for r in range(1, rounds + 1):
            cells = []
            for tree in trees.values():
                out = subprocess.run(
                    [sys.executable, __file__, "--baseline", str(tree), "--store-child",
                     str(port), "--requests", str(pairs)],
                    env={**os.environ, "PYTHONPATH": str(tree)}, cwd=tree, check=True,
                    capture_output=True, text=True)
                cells.append(float(out.stdout))
            print(f"{r:>5} " + " ".join(f"{c:>10.4f}" for c in cells), flush=True)
    finally:
        redis.terminate()
        redis.wait(timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget", action="store_true",
                        help="CPU per small request, budgets on Redis vs off vs bare")
    parser.add_argument("--requests", type=int, default=2000,
                        help="--budget: small requests per gateway per round")
    parser.add_argument("--store", action="store_true",
                        help="CPU per reserve + settle of the Redis store alone")
    parser.add_argument("--store-child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--capture", action="store_true",
                        help="the default figures with every request captured")
    args = parser.parse_args()
    if args.capture:
        global CAPTURE  # noqa: PLW0603 -- one switch for every Stack of this run
        CAPTURE = True
    if args.store_child:
        print(asyncio.run(_store_pairs(args.store_child, args.requests)))
        return 0
    trees = {"baseline": args.baseline.resolve(), "this": Path(__file__).resolve().parents[1]}
    if args.store:
        store_rounds(trees, args.rounds, args.requests)
        return 0
    if args.budget:
        budget_rounds(trees, args.rounds, args.requests)
        return 0
    print(f"{'round':>5} {'tree':<9} {'added latency ms':>17} {'CPU ms/stream':>14}")
    for r in range(1, args.rounds + 1):
        for name, tree in trees.items():
            lat = asyncio.run(added_latency_ms(tree))
            cpu = asyncio.run(cpu_ms_per_stream(tree))
            print(f"{r:>5} {name:<9} {lat:>17.3f} {cpu:>14.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
