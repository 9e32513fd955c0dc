#!/usr/bin/env python3
"""Flat cost: CPU per request and RSS of one proxy process, every 20,000 requests, for 200,000.

    .venv/bin/python benchmarks/bench_flat.py [--requests 200000] [--segment 16000]
        [--calibrate 2000] [--modes upstream,memory-users,redis-users]

For each mode a fresh mock upstream (non-streamed answers of 8 tokens, no delay) and two
`tokenmeter serve` processes with the same command line (the ledger on, as shipped: an SQLite
file in a temp state directory of each) are started on free 127.0.0.1 ports: the *soaked* one,
which serves the load, and a *fresh* one, which serves only calibration batches:

| mode | proxy |
| --- | --- |
| `upstream` | `serve --upstream URL`: no users, the in-process store |
| `memory-users` | a config with 8 users with keys and daily token limits, the in-process store |
| `redis-users` | the same users, `store.url` a private redis-server (reserve + settle in Lua) |

A closed-loop aiohttp client in this process (not the proxy's) sends small non-streamed chat
requests at concurrency 16 (keys rotated over the users). Each row of the curve is `--segment`
requests to the soaked process, then four calibration batches of `--calibrate` requests, soaked,
fresh, fresh, soaked (20,000 requests to the soaked process per row by default). Per row, from
/proc: the soaked process's CPU ms per request over the segment (utime + stime), requests/s, its
VmRSS, and the calibration ratio: the soaked process's CPU per request over the fresh one's,
measured back to back. On this shared 2-core VM the raw CPU per request moves 2x with what else
runs (a neighbour's test suite), and both processes alike: the ratio does not, so it is the
figure that says whether cost grows with the requests served. Verdict per mode: the median of
the last three rows over that of rows 2-4 (row 1 is warm-up): flat when the calibration ratio
moved at most 1.25x and RSS grew less than 10 MB; exit 1 otherwise. Results:
`benchmarks/results/flat-latest.json`.

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


class Load:
    """Closed-loop load at CONCURRENCY over one keep-alive session; counts non-200 answers."""

    def __init__(self, session: aiohttp.ClientSession, headers: list[dict[str, str]]) -> None:
        self.session, self.headers = session, headers
        self.failures = 0

    async def batch(self, url: str, n: int) -> None:
        left = [n]

        async def worker() -> None:
            while left[0] > 0:
                left[0] -= 1
                h = self.headers[left[0] % len(self.headers)]
                async with self.session.post(url, data=BODY, headers=h) as r:
                    await r.read()
                    if r.status != 200:
                        self.failures += 1
                        if self.failures > 100:
                            raise RuntimeError(f"answer {r.status}: {await r.text()}")

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))


async def measure(load: Load, url: str, pid: int, n: int) -> float:
    """CPU ms per request of `pid` over a batch of `n` requests to `url`."""
    c0 = cpu_s(pid)
    await load.batch(url, n)
    await asyncio.sleep(0.1)  # settle work after the last byte is counted
    return (cpu_s(pid) - c0) / n * 1000


async def soak(  # noqa: PLR0913, PLR0917  one soak phase: the two proxies and the pids it samples
    args: argparse.Namespace, mode: str, headers: list[dict[str, str]], soaked: tuple[str, int],
    fresh: tuple[str, int], redis_pid: int | None, mock_pid: int,
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    served = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        load = Load(session, headers)
        await load.batch(fresh[0], 500)  # the reference's warm-up (the soaked process warms up
        # in its first segment, which the verdict leaves out)
        while served < args.requests:
            t0, c0 = time.monotonic(), cpu_s(soaked[1])
            r0 = cpu_s(redis_pid) if redis_pid else 0.0
            await load.batch(soaked[0], args.segment)
            wall, cpu = time.monotonic() - t0, cpu_s(soaked[1]) - c0
            rcpu = (cpu_s(redis_pid) - r0) if redis_pid else 0.0
            served += args.segment
            # Calibration: the soaked process and a fresh one (it only ever serves these
            # batches) in turn, A B B A, so contention from the rest of the box hits both alike.
            cal: dict[str, list[float]] = {"soaked": [], "fresh": []}
            for which in ("soaked", "fresh", "fresh", "soaked"):
                url, pid = soaked if which == "soaked" else fresh
                cal[which].append(await measure(load, url, pid, args.calibrate))
            served += 2 * args.calibrate
            soaked_ms, fresh_ms = statistics.mean(cal["soaked"]), statistics.mean(cal["fresh"])
            row: dict[str, Any] = {
                "requests": served, "cpu_ms_per_req": cpu / args.segment * 1000,
                "req_per_s": args.segment / wall,
                "calib_soaked_ms": soaked_ms, "calib_fresh_ms": fresh_ms,
                "ratio_to_fresh": soaked_ms / fresh_ms,
                "rss_mb": rss_mb(soaked[1]), "fresh_rss_mb": rss_mb(fresh[1]),
                "mock_rss_mb": rss_mb(mock_pid), "failures": load.failures}
            extra = ""
            if redis_pid:
                row["redis_cpu_ms_per_req"] = rcpu / args.segment * 1000
                row["redis_rss_mb"] = rss_mb(redis_pid)
                extra = (f"  redis {row['redis_cpu_ms_per_req']:.3f} ms/req "
                         f"{row['redis_rss_mb']:.1f} MB")
            rows.append(row)
            print(f"{mode:13s} {served:>8,}  cpu {row['cpu_ms_per_req']:.3f} ms/req  "
                  f"{row['req_per_s']:5.0f} req/s  calib soaked/fresh {soaked_ms:.3f}/"
                  f"{fresh_ms:.3f} = {row['ratio_to_fresh']:.2f}x  rss {row['rss_mb']:6.1f} MB "
                  f"(fresh {row['fresh_rss_mb']:.1f}){extra}", flush=True)
    return rows


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix=f"bench-flat-{mode}-"))
    procs = Procs(tmp)
    tm = str(VENV_BIN / "tokenmeter")
    try:
        mock_port = free_port()
        mock = procs.start("mock", [tm, "mock-upstream", "--port", str(mock_port), "--ttft-ms", "0",
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
        argv = [tm, "serve", "--log-level", "WARNING"]
        if mode == "upstream":
            argv += ["--upstream", f"http://127.0.0.1:{mock_port}/v1"]
            headers = [{"Content-Type": "application/json"}]
        else:
            conf = tmp / "tokenmeter.yaml"
            conf.write_text(yaml.safe_dump(config(mock_port, redis_port)))
            argv += ["--config", str(conf)]
            headers = [{"Content-Type": "application/json", "Authorization": f"Bearer {key(i)}"}
                       for i in range(USERS)]
        proxies: list[tuple[str, int]] = []
        for name in ("soaked", "fresh"):
            port = free_port()
            env = dict(os.environ, TOKENMETER_STATE_DIR=str(tmp / f"state-{name}"))
            pid = procs.start(name, [*argv, "--port", str(port)], env).pid
            wait_port(port)
            proxies.append((f"http://127.0.0.1:{port}/v1/chat/completions", pid))
        rows = asyncio.run(soak(args, mode, headers, proxies[0], proxies[1], redis_pid,
                                mock.pid))
    except BaseException:
        print(f"{mode}: failed; the services' logs are kept in {tmp}", flush=True)
        procs.stop_all()
        raise
    procs.stop_all()
    shutil.rmtree(tmp, ignore_errors=True)
    return {"mode": mode, "segments": rows, **verdict(rows)}


def verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Late (last three rows) against early (rows 2-4; row 1 is warm-up), medians."""
    if len(rows) < 7:
        return {}

    def change(key: str) -> float:
        late: float = statistics.median(r[key] for r in rows[-3:])
        early: float = statistics.median(r[key] for r in rows[1:4])
        return late / early

    rss_growth = (statistics.median(r["rss_mb"] for r in rows[-3:])
                  - statistics.median(r["rss_mb"] for r in rows[1:4]))
    calib = change("ratio_to_fresh")
    flat = calib <= 1.25 and rss_growth < 10
    return {"cpu_ratio_late_early": change("cpu_ms_per_req"), "calib_ratio_late_early": calib,
            "rss_growth_mb": rss_growth, "flat": flat}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200_000)
    parser.add_argument("--segment", type=int, default=16_000,
                        help="requests of the soak load per row (plus 2 x --calibrate)")
    parser.add_argument("--calibrate", type=int, default=2_000,
                        help="requests per calibration block (4 per row: 2 soaked, 2 fresh)")
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
            print(f"{r['mode']:13s} late / early: CPU/request {r['cpu_ratio_late_early']:.2f} x,"
                  f" soaked/fresh {r['calib_ratio_late_early']:.2f} x;"
                  f" RSS growth {r['rss_growth_mb']:+.1f} MB"
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
