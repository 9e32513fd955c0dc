#!/usr/bin/env python3
"""Benchmark: the admission policies against each other, in one run.

    .venv/bin/python benchmarks/bench_admission.py [--rounds 3] [--streams 48] [--quick]

Each round starts the simulated upstream (750 tokens/s, 20 ms TTFT, 600-token answers) and, one
policy after another, `tokenmeter serve` with one user whose daily quota is far from spent and
`defaults.admission.policy` set to `worst_case`, `clamp` or `estimate` (initial estimate 128, so
every stream is topped up several times). Streams ask for `max_tokens: 4096`. For each policy:

1. added TTFT p50: the median time to the first content byte through the proxy minus the same
   straight to the upstream (sequential streams);
2. ITL p99: the 99th percentile of the gaps between content chunks the client receives, 8
   streams at a time (top-ups must not show here);
3. CPU per stream: utime+stime of the proxy process (from /proc) per stream.

The machine is noisy: compare the policies within a round, and the rounds with each other.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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

KEY = "sk-bench-admission-0123456789"
POLICIES = ("worst_case", "clamp", "estimate")
BODY = {"model": "m", "messages": [{"role": "user", "content": "write"}], "stream": True,
        "max_tokens": 4096}








def _start(argv: list[str], env: dict[str, str], port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-m", "proxy.cli", *argv], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port)
    return proc


def _proxy(policy: str, mock_port: int) -> tuple[subprocess.Popen[bytes], int]:
    state = Path(tempfile.mkdtemp(prefix=f"tm-admission-{policy}-"))
    config = state / "tokenmeter.yaml"
    config.write_text(
        f"upstreams:\n  mock: {{base_url: 'http://127.0.0.1:{mock_port}/v1'}}\n"
        "metrics: {discover_models: false}\nledger: {enabled: false}\n"
        "defaults:\n  max_output_tokens: 4096\n"
        f"  admission: {{policy: {policy}, initial_estimate: 128}}\n"
        f"users:\n  bench:\n    keys: ['{KEY}']\n    daily_tokens: 1000000000\n")
    port = free_port()
    env = {**os.environ, "TOKENMETER_STATE_DIR": str(state)}
    return _start(["serve", "--config", str(config), "--port", str(port),
                   "--log-level", "WARNING"], env, port), port


async def _stream(session: aiohttp.ClientSession, port: int) -> tuple[float, list[float]]:
    """(time to the first content byte, gaps between content chunks), in seconds."""
    started = time.perf_counter()
    first, last, gaps = 0.0, 0.0, []
    async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=BODY,
                            headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status == 200, r.status
        async for chunk in r.content.iter_any():
            now = time.perf_counter()
            if b'"content":"' not in chunk:
                continue
            if not first:
                first = now - started
            else:
                gaps.append(now - last)
            last = now
        assert b"error" not in chunk, chunk[-300:]
    return first, gaps


async def _ttft_ms(port: int, n: int) -> float:
    async with aiohttp.ClientSession() as session:
        await _stream(session, port)
        return statistics.median([(await _stream(session, port))[0] for _ in range(n)]) * 1000


async def _load(port: int, pid: int, streams: int) -> tuple[float, float]:
    """(ITL p99 in ms, CPU ms per stream) with 8 streams at a time."""
    gaps: list[float] = []
    async with aiohttp.ClientSession() as session:
        await _stream(session, port)
        before = cpu_s(pid)
        queue = iter(range(streams))

        async def worker() -> None:
            for _ in queue:
                gaps.extend((await _stream(session, port))[1])

        await asyncio.gather(*(worker() for _ in range(8)))
        cpu = (cpu_s(pid) - before) / streams * 1000
    return statistics.quantiles(gaps, n=100)[98] * 1000, cpu


async def _topups(port: int) -> float:
    """Top-ups granted so far (0 unless the policy is `estimate`): proof the path ran."""
    async with aiohttp.ClientSession() as session, session.get(
            f"http://127.0.0.1:{port}/metrics") as r:
        text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("tokenmeter_budget_topups_total{")
               and 'outcome="granted"' in line)


async def run(rounds: int, streams: int, ttft_n: int) -> dict[str, dict[str, list[float]]]:
    mock_port = free_port()
    # Processes start between measurements, never during one: a blocking start is fine.
    mock = _start(["mock-upstream", "--port", str(mock_port), "--ttft-ms", "20",
                   "--tokens-per-second", "750", "--output-tokens", "600"],
                  dict(os.environ), mock_port)
    out: dict[str, dict[str, list[float]]] = {
        p: {"added_ttft_ms": [], "itl_p99_ms": [], "cpu_ms_per_stream": [], "topups": []}
        for p in POLICIES}
    try:
        for r in range(rounds):
            direct = await _ttft_ms(mock_port, ttft_n)
            for policy in POLICIES:
                proc, port = _proxy(policy, mock_port)
                try:
                    added = await _ttft_ms(port, ttft_n) - direct
                    itl, cpu = await _load(port, proc.pid, streams)
                    topups = await _topups(port)
                finally:
                    proc.terminate()
                    proc.wait(timeout=60)
                for name, value in (("added_ttft_ms", added), ("itl_p99_ms", itl),
                                    ("cpu_ms_per_stream", cpu), ("topups", topups)):
                    out[policy][name].append(value)
                print(f"round {r + 1} {policy:10s}: added TTFT p50 {added:.2f} ms, "
                      f"ITL p99 {itl:.2f} ms, CPU {cpu:.2f} ms/stream, top-ups {topups:.0f}",
                      flush=True)
    finally:
        mock.terminate()
        mock.wait(timeout=30)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=48)
    parser.add_argument("--ttft-streams", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="1 round, 16 streams")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.streams, args.ttft_streams = 1, 16, 10
    out = asyncio.run(run(args.rounds, args.streams, args.ttft_streams))
    base = {k: statistics.median(v) for k, v in out["worst_case"].items()}
    print(f"\nmedians over {args.rounds} rounds; ratios to worst_case:")
    for policy in POLICIES:
        med = {k: statistics.median(v) for k, v in out[policy].items()}
        print(f"  {policy:10s}: added TTFT p50 {med['added_ttft_ms']:.2f} ms, "
              f"ITL p99 {med['itl_p99_ms']:.2f} ms "
              f"({med['itl_p99_ms'] / base['itl_p99_ms']:.2f}x), "
              f"CPU {med['cpu_ms_per_stream']:.2f} ms/stream "
              f"({med['cpu_ms_per_stream'] / base['cpu_ms_per_stream']:.2f}x)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
