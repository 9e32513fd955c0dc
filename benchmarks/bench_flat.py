#!/usr/bin/env python3
"""Flat cost: CPU per request and RSS of one proxy process, per 20,000 requests, for 200,000.

    .venv/bin/python benchmarks/bench_flat.py [--requests 200000] [--segment 20000]
        [--modes upstream,memory-users,redis-users]

For each mode a fresh mock upstream (non-streamed answers of 8 tokens, no delay) and a fresh
`tokenmeter serve` (one process; the ledger on, as shipped: an SQLite file in a temp state
directory) are started on free 127.0.0.1 ports:

| mode | proxy |
| --- | --- |
| `upstream` | `serve --upstream URL`: no users, the in-process store |
| `memory-users` | a config with 8 users with keys and daily token limits, the in-process store |
| `redis-users` | the same users, `store.url` a private redis-server (reserve + settle in Lua) |

A closed-loop aiohttp client in this process (a different process from the proxy) sends small
non-streamed chat requests at concurrency 16 (keys rotated over the users) until `--requests`
have been answered 200, and after every `--segment` requests reads from /proc the proxy's
utime + stime and VmRSS (and redis-server's, in `redis-users`). Reported per segment: CPU ms per
request, RSS MB, requests/s; and the verdict per mode: the median of the last three segments over
the median of segments 2-4 (segment 1 is warm-up), for CPU per request and for RSS. "Flat"
means within noise on this shared 2-core VM: a CPU ratio up to 1.25 and RSS growth under 10 MB.

A growth found here is chased with py-spy (CPU) or tracemalloc snapshots (memory) on a proxy
started by hand; this benchmark only measures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from procs import cpu_s, free_port, wait_port

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
MODES = ("upstream", "memory-users", "redis-users")
USERS = 8
CONCURRENCY = 16
BODY = json.dumps({"model": "mock-gpt", "messages": [{"role": "user", "content": "hi there"}],
                   "max_tokens": 8}).encode()


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def key(i: int) -> str:
    return f"sk-flat-user{i}-0000000000"


def config(mock_port: int, redis_port: int | None) -> dict[str, Any]:
    conf: dict[str, Any] = {
        "upstreams": {"mock": {"base_url": f"http://127.0.0.1:{mock_port}/v1"}},
        "metrics": {"discover_models": False},
        "timezone": "UTC",
        "users": {f"user{i}": {"keys": [key(i)], "daily_tokens": 10**12} for i in range(USERS)},
    }
    if redis_port is not None:
        conf["store"] = {"url": f"redis://127.0.0.1:{redis_port}/0"}
    return conf


class Procs:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None
              ) -> subprocess.Popen[bytes]:
        with (self.tmp / f"{name}.log").open("wb") as log:
            p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True, env=env)
        self.procs.append(p)
        return p

    def stop_all(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(5)
        self.procs.clear()


async def drive(url: str, headers: list[dict[str, str]], total: int, segment: int,
                on_segment: Any) -> None:
    sent = [0]
    done = [0]
    failures = [0]
    mark = asyncio.Event()

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def worker(w: int) -> None:
            while sent[0] < total:
                sent[0] += 1
                i = sent[0]
                async with session.post(url, data=BODY, headers=headers[i % len(headers)]) as r:
                    await r.read()
                    if r.status != 200:
                        failures[0] += 1
                        if failures[0] > 100:
                            raise RuntimeError(f"answer {r.status}: {await r.text()}")
                done[0] += 1
                if done[0] % segment == 0:
                    mark.set()

        async def watcher() -> None:
            seen = 0
            while seen < total // segment:
                await mark.wait()
                mark.clear()
                while done[0] // segment > seen:
                    seen += 1
                    on_segment(seen, failures[0])

        await asyncio.gather(watcher(), *(worker(w) for w in range(CONCURRENCY)))


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix=f"bench-flat-{mode}-"))
    procs = Procs(tmp)
    tm = str(VENV_BIN / "tokenmeter")
    try:
        mock_port, proxy_port = free_port(), free_port()
        procs.start("mock", [tm, "mock-upstream", "--port", str(mock_port), "--ttft-ms", "0",
                             "--output-tokens", "8"])
        wait_port(mock_port)
        redis_pid = None
        redis_port = None
        if mode == "redis-users":
            redis_port = free_port()
            redis = procs.start("redis", [args.redis_server, "--port", str(redis_port),
                                          "--bind", "127.0.0.1", "--save", "",
                                          "--appendonly", "no"])
            redis_pid = redis.pid
            wait_port(redis_port)
        env = dict(os.environ, TOKENMETER_STATE_DIR=str(tmp / "state"))
        argv = [tm, "serve", "--port", str(proxy_port), "--log-level", "WARNING"]
        if mode == "upstream":
            argv += ["--upstream", f"http://127.0.0.1:{mock_port}/v1"]
            headers = [{"Content-Type": "application/json"}]
        else:
            conf = tmp / "tokenmeter.yaml"
            conf.write_text(yaml.safe_dump(config(mock_port, redis_port)))
            argv += ["--config", str(conf)]
            headers = [{"Content-Type": "application/json", "Authorization": f"Bearer {key(i)}"}
                       for i in range(USERS)]
        proxy = procs.start("proxy", argv, env)
        wait_port(proxy_port)
        rows: list[dict[str, Any]] = []
        last = {"t": time.monotonic(), "cpu": cpu_s(proxy.pid),
                "rcpu": cpu_s(redis_pid) if redis_pid else 0.0}

        def on_segment(n: int, failures: int) -> None:
            now, cpu = time.monotonic(), cpu_s(proxy.pid)
            rcpu = cpu_s(redis_pid) if redis_pid else 0.0
            row = {"requests": n * args.segment,
                   "cpu_ms_per_req": (cpu - last["cpu"]) / args.segment * 1000,
                   "rss_mb": rss_mb(proxy.pid),
                   "req_per_s": args.segment / (now - last["t"]),
                   "failures": failures}
            if redis_pid:
                row["redis_cpu_ms_per_req"] = (rcpu - last["rcpu"]) / args.segment * 1000
                row["redis_rss_mb"] = rss_mb(redis_pid)
            last.update(t=now, cpu=cpu, rcpu=rcpu)
            rows.append(row)
            extra = (f"  redis {row['redis_cpu_ms_per_req']:.3f} ms/req "
                     f"{row['redis_rss_mb']:.1f} MB") if redis_pid else ""
            print(f"{mode:13s} {row['requests']:>8,}  cpu {row['cpu_ms_per_req']:.3f} ms/req  "
                  f"rss {row['rss_mb']:6.1f} MB  {row['req_per_s']:6.0f} req/s{extra}",
                  flush=True)

        url = f"http://127.0.0.1:{proxy_port}/v1/chat/completions"
        asyncio.run(drive(url, headers, args.requests, args.segment, on_segment))
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)
    return {"mode": mode, "segments": rows, **verdict(rows)}


def verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    if len(rows) < 7:
        return {}
    early = rows[1:4]
    late = rows[-3:]
    cpu_ratio = (statistics.median(r["cpu_ms_per_req"] for r in late)
                 / statistics.median(r["cpu_ms_per_req"] for r in early))
    rss_growth = (statistics.median(r["rss_mb"] for r in late)
                  - statistics.median(r["rss_mb"] for r in early))
    flat = cpu_ratio <= 1.25 and rss_growth < 10
    return {"cpu_ratio_late_early": cpu_ratio, "rss_growth_mb": rss_growth, "flat": flat}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200_000)
    parser.add_argument("--segment", type=int, default=20_000)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--redis-server", default=shutil.which("redis-server") or "redis-server")
    parser.add_argument("--output", type=Path,
                        default=ROOT / "benchmarks" / "results" / "flat-latest.json")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            parser.error(f"unknown mode {m}; modes: {', '.join(MODES)}")
    results = [run_mode(m, args) for m in modes]
    print()
    ok = True
    for r in results:
        if "flat" in r:
            ok &= r["flat"]
            print(f"{r['mode']:13s} CPU/request last 3 / segments 2-4: "
                  f"{r['cpu_ratio_late_early']:.2f} x   RSS growth {r['rss_growth_mb']:+.1f} MB"
                  f"   {'FLAT' if r['flat'] else 'GROWS'}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "requests": args.requests, "segment": args.segment, "concurrency": CONCURRENCY,
        "results": results}, indent=1) + "\n")
    print(f"wrote {args.output}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
