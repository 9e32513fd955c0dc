#!/usr/bin/env python3
"""Benchmark: what the budget check (auth + reserve + settle) adds to TTFT, memory vs Redis.

    .venv/bin/python benchmarks/bench_budget.py [--quick] [--profile SECONDS]

Starts, on free 127.0.0.1 ports, one simulated upstream (`tokenmeter mock-upstream`), a private
redis-server (`--save "" --appendonly no`) and three `tokenmeter serve` processes in front of the
same mock:

  open    no `users`: open mode, no keys, no limits (usage still counted in the memory store)
  memory  user alice with a key and every limit set, `store.url: memory`
  redis   the same user and limits, `store.url: redis://127.0.0.1:<private port>/0`

A cheap aiohttp client (raw POST of a streaming chat request with include_usage, incremental
read of the SSE body) measures TTFT (request sent -> first content chunk received) at
concurrency 1 and 16, the three configurations interleaved round by round, and reports p50/p99
per configuration and the added TTFT of the budget check (config minus open) for memory and
Redis. It then reads each proxy's /metrics (deltas per phase, warm-up excluded):
`tokenmeter_store_latency_seconds` (op=reserve / op=settle) and
`tokenmeter_proxy_overhead_seconds`, as p50/p99 estimated from the histogram buckets; plus CPU
per request of each proxy (and of redis-server) from /proc, and Redis's own per-call time of the
Lua scripts (INFO commandstats).

It prints a table and writes benchmarks/results/budget-latest.json. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families

# benchmarks/ is not a package: make its sibling importable however this file is started.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_proxy import (
    BenchError,
    Service,
    Services,
    cpu_times,
    ends_with_done,
    ensure_alive,
    execute,
    find_pyspy,
    fmt,
    free_ports,
    is_file,
    percentile,
    run_meta,
    tokenmeter_argv,
    wait_ready,
)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = ROOT / "benchmarks" / "results" / "budget-latest.json"
HOST = "127.0.0.1"
CONFIGS = ("open", "memory", "redis")
LABELS = {"open": "open", "memory": "memory", "redis": "redis"}
CHAT = "/v1/chat/completions"
API_KEY = "sk-alice-bench-key-000"
OUTPUT_TOKENS = 32
TOKENS_PER_SECOND = 5000.0
TTFT_MS = 5.0
NOMINAL_S = TTFT_MS / 1000 + OUTPUT_TOKENS / TOKENS_PER_SECOND
# Content-token chunks of the mock carry this exactly once; the role chunk and the finish and
# usage chunks do not. Counting it counts tokens without parsing JSON (see bench_proxy.py).
MARK = b'"delta":{"content":"'
KEEP = len(MARK) - 1
END_BYTES = 512  # a stream's last bytes: `[DONE]` and the cost comment tokenmeter adds
DONE = b"data: [DONE]\n\n"
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=30, sock_connect=10, sock_read=15)
BODY = json.dumps(
    {
        "model": "mock-gpt",
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "Write a short paragraph about budgets."}],
    },
    separators=(",", ":"),
).encode()
# The same headers on every configuration (open mode ignores the key), so all three proxies
# receive identical requests.
HEADERS = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
LIMITS: dict[str, int] = {
    "daily_tokens": 1_000_000_000,
    "tokens_per_minute": 1_000_000_000,
    "requests_per_minute": 100_000_000,
    "max_concurrent_requests": 1000,
    "max_output_tokens": 64,
}


@dataclass(frozen=True)
class Plan:
    name: str
    warmup: int  # requests per configuration, at concurrency 4
    # concurrency -> (rounds, requests per configuration per round)
    sweep: dict[int, tuple[int, int]]
    deadline_s: float  # measurements, startup included (profiling runs after, own timeouts)


FULL = Plan(name="full", warmup=200, sweep={1: (15, 100), 16: (12, 320)}, deadline_s=170.0)
QUICK = Plan(name="quick", warmup=40, sweep={1: (5, 60), 16: (4, 128)}, deadline_s=36.0)


def rotated(r: int) -> tuple[str, ...]:
    k = r % len(CONFIGS)
    return CONFIGS[k:] + CONFIGS[:k]


def rnd(value: float | None, digits: int = 3) -> float | None:
    return None if value is None or math.isnan(value) else round(value, digits)


def progress_printer(t_start: float) -> Callable[[str], None]:
    def progress(msg: str) -> None:
        print(f"[{time.monotonic() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    return progress


# --------------------------------------------------------------------------------------------
# Services: configs, redis


def proxy_config(name: str, mock_port: int, redis_port: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "upstreams": {"mock": {"base_url": f"http://{HOST}:{mock_port}/v1"}},
        "metrics": {"discover_models": False},
    }
    if name == "open":
        return cfg
    url = "memory" if name == "memory" else f"redis://{HOST}:{redis_port}/0"
    cfg["store"] = {"url": url, "on_error": "fail_open"}
    cfg["users"] = {"alice": {"keys": [API_KEY], **LIMITS}}
    return cfg


async def redis_command(port: int, *args: str, timeout_s: float = 5.0) -> bytes:
    """One RESP command on a fresh connection to our own redis-server; the raw reply payload."""

    async def go() -> bytes:
        reader, writer = await asyncio.open_connection(HOST, port)
        try:
            parts = [f"*{len(args)}\r\n".encode()]
            for a in args:
                b = a.encode()
                parts.append(b"$%d\r\n%s\r\n" % (len(b), b))
            writer.write(b"".join(parts))
            await writer.drain()
            line = await reader.readline()
            if line.startswith(b"$"):
                n = int(line[1:])
                return b"" if n < 0 else (await reader.readexactly(n + 2))[:-2]
            if line.startswith(b"-"):
                raise BenchError(f"redis {args[0]}: {line.decode(errors='replace').strip()}")
            return line[1:].strip()
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    return await asyncio.wait_for(go(), timeout_s)


async def wait_redis(svc: Service, port: int, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if svc.proc.poll() is not None:
            raise BenchError(f"redis-server exited with {svc.proc.returncode}:\n{svc.tail()}")
        try:
            if await redis_command(port, "PING", timeout_s=1.0) == b"PONG":
                return
        except (OSError, TimeoutError, BenchError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        await asyncio.sleep(0.1)
    raise BenchError(f"redis-server not ready on :{port} ({last}):\n{svc.tail()}")


def commandstats(info: bytes) -> dict[str, dict[str, float]]:
    """`INFO commandstats` -> {"evalsha": {"calls": .., "usec_per_call": ..}, ...}."""
    out: dict[str, dict[str, float]] = {}
    for line in info.decode(errors="replace").splitlines():
        m = re.match(r"cmdstat_(\w+):(.*)", line.strip())
        if not m:
            continue
        fields: dict[str, float] = {}
        for kv in m.group(2).split(","):
            k, _, v = kv.partition("=")
            with contextlib.suppress(ValueError):
                fields[k] = float(v)
        out[m.group(1)] = fields
    return out


# --------------------------------------------------------------------------------------------
# Client


async def one_request(session: aiohttp.ClientSession, url: str) -> float:
    """TTFT in seconds: request sent -> first read holding a content token. The whole stream is
    read and checked (HTTP 200, every token, `[DONE]`)."""
    perf = time.perf_counter
    t0 = perf()
    async with session.post(url, data=BODY, headers=HEADERS, timeout=REQUEST_TIMEOUT) as resp:
        if resp.status != 200:
            text = (await resp.read())[:200]
            raise BenchError(f"HTTP {resp.status}: {text!r}")
        tokens = 0
        first = 0.0
        tail = end = b""
        async for chunk in resp.content.iter_any():
            buf = tail + chunk if tail else chunk
            n = buf.count(MARK)
            if n:
                if not tokens:
                    first = perf()
                tokens += n
            tail = buf[-KEEP:]
            end = (end + chunk)[-END_BYTES:]
    if not ends_with_done(end):  # tokenmeter's cost comment may follow `[DONE]`
        raise BenchError(f"stream did not end with [DONE] ({tokens} tokens)")
    if tokens != OUTPUT_TOKENS:
        raise BenchError(f"got {tokens} content tokens, expected {OUTPUT_TOKENS}")
    return first - t0


@dataclass
class Batch:
    ttfts: list[float]
    errors: list[str]
    wall_s: float


async def run_batch(session: aiohttp.ClientSession, url: str, *, concurrency: int, total: int,
                    timeout_s: float) -> Batch:
    """`total` requests by `concurrency` closed-loop workers, starts spread over one nominal
    stream duration so arrivals are steady rather than one burst."""
    ttfts: list[float] = []
    errors: list[str] = []
    remaining = [total]
    stagger = NOMINAL_S / concurrency if concurrency > 1 else 0.0

    async def worker(i: int) -> None:
        await asyncio.sleep(i * stagger)
        while remaining[0] > 0:
            remaining[0] -= 1
            try:
                ttfts.append(await one_request(session, url))
            except (aiohttp.ClientError, TimeoutError, BenchError) as exc:
                errors.append(f"{type(exc).__name__}: {exc}"[:300])

    t0 = time.perf_counter()
    workers = [asyncio.ensure_future(worker(i)) for i in range(min(concurrency, total))]
    try:
        _, pending = await asyncio.wait(workers, timeout=timeout_s)
        if pending:
            errors.append(f"batch timed out after {timeout_s:.0f}s")
    finally:
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    return Batch(ttfts, errors, time.perf_counter() - t0)


def batch_timeout(concurrency: int, total: int) -> float:
    return min(120.0, 20.0 + 20 * math.ceil(total / concurrency) * NOMINAL_S)


# --------------------------------------------------------------------------------------------
# Prometheus text -> histograms


# (series key, upper bound) -> cumulative count; the series' `_sum` is kept under bound -1.
Hist = dict[tuple[str, float], float]
SUM = -1.0


def _is_sum(le: float) -> bool:
    return le == SUM


def scrape_histograms(text: str) -> dict[str, Hist]:
    """Cumulative bucket counts (and sums) of the two histograms we report, summed over other
    labels. Series key: the `op` label for the store latency, "all" for the proxy overhead."""
    wanted = {"tokenmeter_store_latency_seconds": "op",
              "tokenmeter_proxy_overhead_seconds": None}
    out: dict[str, Hist] = {name: {} for name in wanted}
    for family in text_string_to_metric_families(text):
        if family.name not in wanted:
            continue
        label = wanted[family.name]
        hist = out[family.name]
        for s in family.samples:
            series = s.labels.get(label, "") if label else "all"
            if s.name.endswith("_bucket"):
                key = (series, float(s.labels["le"]))
            elif s.name.endswith("_sum"):
                key = (series, SUM)
            else:
                continue
            hist[key] = hist.get(key, 0.0) + s.value
    return out


def counter_total(text: str, name: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(text):
        if family.name == name:
            total += sum(s.value for s in family.samples if s.name in (name, name + "_total"))
    return total


def hist_delta(after: Hist, before: Hist) -> Hist:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def hist_quantile(hist: Hist, series: str, q: float) -> float:
    """Prometheus' histogram_quantile: linear inside the bucket holding rank q*count."""
    buckets = sorted((le, c) for (s, le), c in hist.items() if s == series and not _is_sum(le))
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    rank = q * buckets[-1][1]
    prev_le, prev_c = 0.0, 0.0
    for le, c in buckets:
        if c >= rank:
            if math.isinf(le):
                return prev_le  # above the highest finite bound: report that bound
            if c == prev_c:
                return le
            return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
        prev_le, prev_c = le, c
    return math.nan


def hist_summary(hist: Hist, series: str) -> dict[str, Any]:
    count = max((c for (s, le), c in hist.items() if s == series and math.isinf(le)), default=0)
    total = sum(c for (s, le), c in hist.items() if s == series and _is_sum(le))
    return {
        "count": int(count),
        "mean_ms": rnd(1000 * total / count, 4) if count else None,
        "p50_ms": rnd(1000 * hist_quantile(hist, series, 0.50), 4),
        "p99_ms": rnd(1000 * hist_quantile(hist, series, 0.99), 4),
    }


# --------------------------------------------------------------------------------------------
# The benchmark


@dataclass
class Acc:
    ttfts: list[float] = field(default_factory=list)  # ms
    round_p50: list[float] = field(default_factory=list)  # ms, per round
    errors: list[str] = field(default_factory=list)
    cpu_s: float = 0.0
    redis_cpu_s: float = 0.0
    wall_s: float = 0.0


class Bench:
    def __init__(  # noqa: PLR0913, PLR0917  the run's processes and plan, held for every phase
        self, urls: dict[str, str], pids: dict[str, int], redis_pid: int, redis_port: int,
        plan: Plan, deadline: float,
    ) -> None:
        self.urls = urls
        self.pids = pids
        self.redis_pid = redis_pid
        self.redis_port = redis_port
        self.plan = plan
        self.deadline = deadline

    def check_time(self, what: str) -> None:
        if time.monotonic() > self.deadline:
            raise BenchError(f"run deadline of {self.plan.deadline_s:.0f}s passed before {what}")

    async def metrics(self, session: aiohttp.ClientSession) -> dict[str, str]:
        out = {}
        for name in CONFIGS:
            url = self.urls[name].replace(CHAT, "/metrics")
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
                if resp.status != 200:
                    raise BenchError(f"{name}: /metrics answered HTTP {resp.status}")
                out[name] = await resp.text()
        return out

    async def sanity(self, session: aiohttp.ClientSession) -> dict[str, Any]:
        """One request each: the limited configs must answer with our rate-limit headers and
        the Redis proxy must see its store."""
        out: dict[str, Any] = {}
        for name in CONFIGS:
            async with session.post(self.urls[name], data=BODY, headers=HEADERS,
                                    timeout=REQUEST_TIMEOUT) as resp:
                await resp.read()
                limit = resp.headers.get("x-ratelimit-limit-tokens")
                if resp.status != 200:
                    raise BenchError(f"{name}: HTTP {resp.status} on the first request")
                if name != "open" and limit is None:
                    raise BenchError(f"{name}: no x-ratelimit-limit-tokens header: budget "
                                     "checks are not on the path")
                out[name] = {"x-ratelimit-limit-tokens": limit}
            ready_url = self.urls[name].replace(CHAT, "/readyz")
            async with session.get(ready_url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
                body = await resp.json(content_type=None)
                out[name]["readyz"] = body
                if body.get("store") != "ok":
                    raise BenchError(f"{name}: /readyz says the store is not ok: {body}")
        return out

    async def warmup(self, session: aiohttp.ClientSession) -> dict[str, int]:
        errors = {}
        for name in CONFIGS:
            n = self.plan.warmup
            batch = await run_batch(session, self.urls[name], concurrency=4, total=n,
                                    timeout_s=batch_timeout(4, n))
            errors[name] = len(batch.errors)
            if not batch.ttfts:
                raise BenchError(f"warm-up: every request to {name} failed: {batch.errors[:3]}")
        return errors

    async def sweep(self, session: aiohttp.ClientSession, progress: Callable[[str], None]
                    ) -> tuple[dict[str, Any], dict[str, dict[str, str]]]:
        out: dict[str, Any] = {}
        scrapes: dict[str, dict[str, str]] = {"start": await self.metrics(session)}
        for conc, (rounds, per_round) in self.plan.sweep.items():
            acc = {c: Acc() for c in CONFIGS}
            for r in range(rounds):
                self.check_time(f"concurrency {conc} round {r + 1}")
                for name in rotated(r):
                    pid_cpu = cpu_times([self.pids[name]])
                    redis_cpu = cpu_times([self.redis_pid])
                    batch = await run_batch(
                        session, self.urls[name], concurrency=conc, total=per_round,
                        timeout_s=batch_timeout(conc, per_round),
                    )
                    a = acc[name]
                    a.cpu_s += sum(cpu_times([self.pids[name]])) - sum(pid_cpu)
                    a.redis_cpu_s += sum(cpu_times([self.redis_pid])) - sum(redis_cpu)
                    a.wall_s += batch.wall_s
                    ms = [1000 * t for t in batch.ttfts]
                    a.ttfts.extend(ms)
                    a.errors.extend(batch.errors)
                    if ms:
                        a.round_p50.append(statistics.median(ms))
                    await asyncio.sleep(0.05)
            progress(f"  concurrency {conc}: {rounds} rounds x {per_round} requests per config")
            scrapes[str(conc)] = await self.metrics(session)
            out[str(conc)] = summarize(acc)
        return out, scrapes

    async def profile(  # noqa: PLR0913, PLR0917  one py-spy sample: target, output and load shape
        self, session: aiohttp.ClientSession, pyspy: str, name: str, out: Path, seconds: float,
        concurrency: int,
    ) -> dict[str, Any]:
        """Wall-clock py-spy (`--idle`) of one proxy while it serves requests at `concurrency`.
        The load starts first and is cancelled when py-spy is done; the requests served while
        sampling come from the proxy's own request counter."""
        total = concurrency * (math.ceil((seconds + 5) / NOMINAL_S) + 20)
        out.parent.mkdir(parents=True, exist_ok=True)
        run = asyncio.ensure_future(run_batch(session, self.urls[name], concurrency=concurrency,
                                              total=total, timeout_s=seconds + 40))
        spy: asyncio.subprocess.Process | None = None
        err = b""
        try:
            await asyncio.sleep(0.5)  # load running
            before = await self.request_count(session, name)
            t0 = time.monotonic()
            spy = await asyncio.create_subprocess_exec(
                pyspy, "record", "--pid", str(self.pids[name]), "--duration",
                str(int(seconds)), "--rate", "500", "--function", "--idle", "--nonblocking",
                "--format", "raw", "-o", str(out),
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
            )
            _, err = await asyncio.wait_for(spy.communicate(), seconds + 30)
            wall = time.monotonic() - t0
            served = await self.request_count(session, name) - before
        finally:
            if spy is not None and spy.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    spy.kill()
                await spy.wait()
            run.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await run
        if spy.returncode != 0 or not is_file(out):
            raise BenchError(f"py-spy failed ({spy.returncode}): {err.decode(errors='replace')}")
        # py-spy's own start-up is inside `wall`; it samples for `seconds` of it.
        per_request_s = seconds / served * (seconds / wall) if served else math.nan
        return summarize_loop_profile(out, per_request_s) | {
            "seconds": seconds, "concurrency": concurrency, "requests_while_sampling": served,
        }

    async def request_count(self, session: aiohttp.ClientSession, name: str) -> float:
        url = self.urls[name].replace(CHAT, "/metrics")
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
            return counter_total(await resp.text(), "tokenmeter_requests")


# Functions whose share of the event loop's wall time the profile reports, by substring of
# py-spy's `function (file:line)` frame name.
# "loop, no Python frame" is matched on the leaf frame instead: the loop waiting in epoll, or
# (uvloop) doing its own native I/O, with no Python code of ours running.
LOOP_LEAVES = ("Runner.run (asyncio/runners.py", "select (selectors.py")
PROFILE_FUNCTIONS: tuple[tuple[str, str], ...] = (
    ("loop, no Python frame (idle/native)", ""),
    ("UserIndex.authenticate", "UserIndex.authenticate (proxy/auth.py"),
    ("Budget.reserve (sync part)", "Budget.reserve (proxy/budget/accounting.py"),
    ("  limits.plan", "plan (proxy/budget/limits.py"),
    ("  prompt estimate (tiktoken)", "prompt_tokens (proxy/pipeline/counting.py"),
    ("    tiktoken encode_batch", "Encoding.encode_batch (tiktoken"),
    ("  store.reserve (sync part)", "Store.reserve (proxy/budget/store"),
    ("redis-py (reserve + settle)", "(redis/"),
    ("Budget.settle (sync part)", "Budget.settle (proxy/budget/accounting.py"),
    ("rate_limit_headers", "rate_limit_headers (proxy/budget/refusals.py"),
    ("relay: _relay_stream", "_relay_stream (proxy/pipeline/relay.py"),
    ("settle (metrics, log)", "settle (proxy/pipeline/settle.py"),
)


def summarize_loop_profile(path: Path, per_request_s: float) -> dict[str, Any]:
    """Shares of the main (event loop) thread's samples, which with `--idle` are shares of its
    wall time: a function's share is how long the loop was inside it, i.e. blocked for every
    other stream. Times the share by seconds per request to get loop-ms per request."""
    total = 0
    incl: dict[str, int] = {}
    nested: dict[str, int] = {}  # per PROFILE_FUNCTIONS label, counted once per sample
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit() or not stack.startswith("<module>"):
            continue  # other threads (tiktoken's workers, executors) start in threading.py
        n = int(count)
        total += n
        frames = [f.strip() for f in stack.split(";") if f.strip()]
        for f in set(frames):
            incl[f] = incl.get(f, 0) + n
        for label, needle in PROFILE_FUNCTIONS:
            hit = (any(x in frames[-1] for x in LOOP_LEAVES) if not needle
                   else any(needle in f for f in frames))
            if hit:
                nested[label] = nested.get(label, 0) + n
    if not total:
        raise BenchError(f"py-spy recorded no main-thread samples in {path}")

    def row(samples: int) -> dict[str, Any]:
        share = samples / total
        return {"percent": round(100 * share, 2),
                "loop_ms_per_request": rnd(1000 * share * per_request_s, 4)}

    top = sorted(((c, f) for f, c in incl.items() if "proxy/" in f), reverse=True)[:20]
    return {
        "raw_file": str(path),
        "main_thread_samples": total,
        "wall_ms_per_request": rnd(1000 * per_request_s, 4),
        "functions": {label: row(nested.get(label, 0)) for label, _ in PROFILE_FUNCTIONS},
        "inclusive_proxy_code": [{"function": f, **row(c)} for c, f in top],
    }


def summarize(acc: dict[str, Acc]) -> dict[str, Any]:
    stats = {
        name: {"p50": percentile(a.ttfts, 50), "p99": percentile(a.ttfts, 99)}
        for name, a in acc.items()
    }
    base = stats["open"]
    out: dict[str, Any] = {}
    for name, a in acc.items():
        s = stats[name]
        paired = [x - b for x, b in zip(a.round_p50, acc["open"].round_p50, strict=False)]
        n = len(a.ttfts)
        out[name] = {
            "requests": n,
            "errors": len(a.errors),
            "error_samples": a.errors[:3],
            "ttft_ms": {"p50": rnd(s["p50"]), "p90": rnd(percentile(a.ttfts, 90)),
                        "p99": rnd(s["p99"]), "mean": rnd(statistics.fmean(a.ttfts))
                        if a.ttfts else None},
            "added_ttft_ms": {"p50": rnd(s["p50"] - base["p50"]),
                              "p99": rnd(s["p99"] - base["p99"])},
            # Median over rounds of (this config's round p50 - open's round p50): less sensitive
            # to the machine drifting during the run than the difference of pooled p50s.
            "added_p50_paired_by_round_ms": {
                "median": rnd(statistics.median(paired)) if paired else None,
                "min": rnd(min(paired, default=math.nan)),
                "max": rnd(max(paired, default=math.nan)),
            },
            "requests_per_second": rnd(n / a.wall_s, 1) if a.wall_s else None,
            # Share of one core the proxy process used while its batches ran.
            "proxy_cpu_utilisation": rnd(a.cpu_s / a.wall_s) if a.wall_s else None,
            "proxy_cpu_ms_per_request": rnd(1000 * a.cpu_s / n) if n else None,
            "redis_cpu_ms_per_request": rnd(1000 * a.redis_cpu_s / n) if n else None,
        }
    return out


def metrics_report(scrapes: dict[str, dict[str, str]]) -> dict[str, Any]:
    """Histogram figures per phase (deltas between scrapes, so warm-up is excluded) and over
    the whole measurement, per configuration; plus store errors over the whole process life."""
    phases = [k for k in scrapes if k != "start"]
    parsed = {k: {c: scrape_histograms(t) for c, t in v.items()} for k, v in scrapes.items()}
    out: dict[str, Any] = {}
    for name in CONFIGS:
        per: dict[str, Any] = {}
        spans = [(p, prev_p) for p, prev_p in zip(phases, ["start", *phases], strict=False)]
        spans.append(("all", "start"))
        for phase, since in spans:
            end = phases[-1] if phase == "all" else phase
            store = hist_delta(parsed[end][name]["tokenmeter_store_latency_seconds"],
                               parsed[since][name]["tokenmeter_store_latency_seconds"])
            over = hist_delta(parsed[end][name]["tokenmeter_proxy_overhead_seconds"],
                              parsed[since][name]["tokenmeter_proxy_overhead_seconds"])
            per[phase] = {
                "store_reserve": hist_summary(store, "reserve"),
                "store_settle": hist_summary(store, "settle"),
                "proxy_overhead": hist_summary(over, "all"),
            }
        last = scrapes[phases[-1]][name]
        per["store_errors_total"] = counter_total(last, "tokenmeter_store_errors")
        per["metering_errors_total"] = counter_total(last, "tokenmeter_metering_errors")
        out[name] = per
    return out


# --------------------------------------------------------------------------------------------
# Report


def report(results: dict[str, Any]) -> str:
    meta = results["meta"]
    lines = [
        f"tokenmeter budget-check benchmark ({meta['plan']}) - {meta['cpus']} CPUs, "
        f"Python {meta['python']}, aiohttp {meta['aiohttp']}, redis-server {meta['redis']}",
        f"stream: chat, {OUTPUT_TOKENS} tokens at {TOKENS_PER_SECOND:g} tok/s, upstream TTFT "
        f"{TTFT_MS:g} ms, include_usage; configs interleaved round by round (rotating order)",
        "open = no users (baseline); memory / redis = user alice with key + limits "
        f"({', '.join(f'{k}={v:g}' for k, v in LIMITS.items())})",
        "",
        "1. TTFT (ms, client: request sent -> first content chunk). add = config - open;",
        "   paired = median over rounds of (round p50 - open's round p50) [min..max];",
        "   req/s = completed requests per second of the batches; util = proxy process CPU",
        "   (1.0 = one core busy); cpu = proxy CPU ms per request (redis-server's in brackets).",
        f"{'conc':>4} {'config':<7} {'n':>5} {'p50':>7} {'p99':>7} {'add p50':>8} {'add p99':>8} "
        f"{'paired p50 [min..max]':>24} {'req/s':>6} {'util':>5} {'cpu':>6} {'[redis]':>7} "
        f"{'err':>4}",
    ]
    for conc, per in results["ttft"].items():
        for name in CONFIGS:
            r = per[name]
            base = name == "open"
            pr = r["added_p50_paired_by_round_ms"]
            paired = "" if base else (
                f"{fmt(pr['median'], '+.3f')} [{fmt(pr['min'], '+.2f')}..{fmt(pr['max'], '+.2f')}]"
            )
            redis_cpu = f"[{fmt(r['redis_cpu_ms_per_request'], '.3f')}]" if name == "redis" else ""
            lines.append(
                f"{conc:>4} {LABELS[name]:<7} {r['requests']:>5} {fmt(r['ttft_ms']['p50']):>7} "
                f"{fmt(r['ttft_ms']['p99']):>7} "
                f"{'' if base else fmt(r['added_ttft_ms']['p50'], '+.3f'):>8} "
                f"{'' if base else fmt(r['added_ttft_ms']['p99'], '+.3f'):>8} "
                f"{paired:>24} {fmt(r['requests_per_second'], '.0f'):>6} "
                f"{fmt(r['proxy_cpu_utilisation'], '.2f'):>5} "
                f"{fmt(r['proxy_cpu_ms_per_request'], '.3f'):>6} "
                f"{redis_cpu:>7} {r['errors']:>4}"
            )
    m = results["metrics"]
    lines += [
        "",
        "2. From each proxy's /metrics (ms, p50/p99 estimated from histogram buckets with",
        "   Prometheus' linear interpolation; buckets 0.05 0.1 0.25 0.5 1 2.5 5 ms...: coarse).",
        "   store = Budget's round trip to the store per op; overhead = request received ->",
        "   upstream call started (parse, auth, reserve, rate-limit headers).",
        "   mean = the histogram's _sum / _count (exact, unlike the bucket estimates).",
        f"{'phase':>5} {'config':<7} {'reserve p50':>11} {'p99':>7} {'mean':>6} "
        f"{'settle p50':>10} {'p99':>7} {'mean':>6} {'overhead p50':>12} {'p99':>7} "
        f"{'mean':>6} {'n':>6}",
    ]
    phases = [p for p in next(iter(m.values())) if p not in ("store_errors_total",
                                                               "metering_errors_total")]
    for phase in phases:
        for name in CONFIGS:
            f = m[name][phase]
            label = f"c={phase}" if phase != "all" else "all"
            lines.append(
                f"{label:>5} {LABELS[name]:<7} {fmt(f['store_reserve']['p50_ms'], '.3f'):>11} "
                f"{fmt(f['store_reserve']['p99_ms'], '.3f'):>7} "
                f"{fmt(f['store_reserve']['mean_ms'], '.3f'):>6} "
                f"{fmt(f['store_settle']['p50_ms'], '.3f'):>10} "
                f"{fmt(f['store_settle']['p99_ms'], '.3f'):>7} "
                f"{fmt(f['store_settle']['mean_ms'], '.3f'):>6} "
                f"{fmt(f['proxy_overhead']['p50_ms'], '.3f'):>12} "
                f"{fmt(f['proxy_overhead']['p99_ms'], '.3f'):>7} "
                f"{fmt(f['proxy_overhead']['mean_ms'], '.3f'):>6} "
                f"{f['proxy_overhead']['count']:>6}"
            )
    errs = ", ".join(f"{n} {m[n]['store_errors_total']:g}" for n in CONFIGS)
    lines.append(f"   store errors (must be 0, else fail_open hid an outage): {errs}")
    rs = results.get("redis_commandstats", {})
    if rs:
        lines += ["", "3. redis-server's own time per command during the measurement "
                  "(INFO commandstats):"]
        for cmd, st in sorted(rs.items(), key=lambda x: -x[1].get("calls", 0)):
            lines.append(f"   {cmd:<10} calls {st.get('calls', 0):>8.0f}  "
                         f"usec/call {st.get('usec_per_call', math.nan):7.2f}")
    prof = results.get("profile")
    if prof:
        names = list(prof)
        first = prof[names[0]]
        lines += [
            "",
            f"4. Where the event loop's time goes: py-spy --idle, {first['seconds']:g} s per "
            f"proxy at concurrency {first['concurrency']}. % = share of the loop thread's",
            "   wall time inside the function (the loop is blocked for every stream meanwhile;",
            "   awaits are not counted), ms = that share x wall time per request.",
            f"   {'':<34}" + "".join(f"{n:>16}" for n in names),
            f"   {'requests while sampling':<34}"
            + "".join(f"{prof[n]['requests_while_sampling']:>16.0f}" for n in names),
            f"   {'wall ms per request':<34}"
            + "".join(f"{fmt(prof[n]['wall_ms_per_request'], '.3f'):>16}" for n in names),
        ]
        for label, _ in PROFILE_FUNCTIONS:
            cells = "".join(
                f"{fmt(prof[n]['functions'][label]['percent'], '.1f'):>7}% "
                f"{fmt(prof[n]['functions'][label]['loop_ms_per_request'], '.3f'):>6}ms"
                for n in names
            )
            lines.append(f"   {label:<34}{cells}")
        lines.append("   raw stacks: " + ", ".join(prof[n]["raw_file"] for n in names))
    total_err = sum(r["errors"] for per in results["ttft"].values() for r in per.values())
    lines += ["", f"request errors: {total_err}" + ("  (see JSON samples)" if total_err else ""),
              f"elapsed: {meta['elapsed_s']:.0f}s; JSON: {meta['output']}"]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Main


def redis_version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10,
                         check=False)
    m = re.search(r"v=(\S+)", out.stdout)
    return m.group(1) if m else out.stdout.strip()


async def run(args: argparse.Namespace, plan: Plan, services: Services, workdir: Path,
              t_start: float) -> dict[str, Any]:
    progress = progress_printer(t_start)
    mock_port, redis_port, *proxy_ports = free_ports(2 + len(CONFIGS))
    tm = tokenmeter_argv()
    mock = services.start(
        "mock",
        [*tm, "mock-upstream", "--host", HOST, "--port", str(mock_port),
         "--tokens-per-second", repr(TOKENS_PER_SECOND), "--ttft-ms", repr(TTFT_MS),
         "--output-tokens", str(OUTPUT_TOKENS)],
    )
    redis = services.start(
        "redis",
        [args.redis_server, "--port", str(redis_port), "--bind", HOST, "--save", "",
         "--appendonly", "no", "--dir", str(workdir), "--daemonize", "no",
         "--protected-mode", "yes"],
    )
    await wait_redis(redis, redis_port)
    await wait_ready(mock, f"http://{HOST}:{mock_port}/v1/models")
    proxies: dict[str, Service] = {}
    for name, port in zip(CONFIGS, proxy_ports, strict=True):
        conf = workdir / f"{name}.yaml"
        conf.write_text(yaml.safe_dump(proxy_config(name, mock_port, redis_port)))
        proxies[name] = services.start(
            f"tokenmeter-{name}",
            [*tm, "serve", "--config", str(conf), "--host", HOST, "--port", str(port),
             "--log-level", args.proxy_log_level],
        )
    for name, port in zip(CONFIGS, proxy_ports, strict=True):
        await wait_ready(proxies[name], f"http://{HOST}:{port}/healthz")
    urls = {name: f"http://{HOST}:{port}{CHAT}" for name, port in zip(CONFIGS, proxy_ports,
                                                                        strict=True)}
    pids = {name: svc.proc.pid for name, svc in proxies.items()}
    bench = Bench(urls, pids, redis.proc.pid, redis_port, plan, t_start + plan.deadline_s)
    profile: dict[str, Any] = {}
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
        progress(f"services up (mock :{mock_port}, redis :{redis_port}, proxies "
                 + ", ".join(f"{n} :{p}" for n, p in zip(CONFIGS, proxy_ports, strict=True))
                 + "); checking and warming up")
        sanity = await bench.sanity(session)
        warm_errors = await bench.warmup(session)
        await redis_command(redis_port, "CONFIG", "RESETSTAT")
        progress("measuring TTFT")
        ttft, scrapes = await bench.sweep(session, progress)
        stats = commandstats(await redis_command(redis_port, "INFO", "commandstats"))
        dbsize = int(await redis_command(redis_port, "DBSIZE"))
        if args.profile:
            for name in CONFIGS:
                progress(f"profiling {name} with py-spy for {args.profile:g}s")
                profile[name] = await bench.profile(
                    session, args.pyspy, name,
                    args.output.with_name(f"budget-profile-{name}.txt"), args.profile,
                    args.profile_concurrency,
                )
    ensure_alive(mock, redis, *proxies.values())
    return {
        "meta": {
            **run_meta(plan.name, t_start),
            "redis": redis_version(args.redis_server),
            "proxy_log_level": args.proxy_log_level,
            "profile_concurrency": args.profile_concurrency if args.profile else None,
            "stream": {"output_tokens": OUTPUT_TOKENS, "tokens_per_second": TOKENS_PER_SECOND,
                       "ttft_ms": TTFT_MS, "nominal_s": round(NOMINAL_S, 4)},
            "limits": LIMITS,
            "plan_detail": {"warmup_per_config": plan.warmup,
                            "sweep": {str(c): {"rounds": r, "requests_per_config_per_round": k}
                                      for c, (r, k) in plan.sweep.items()}},
            "warmup_errors": warm_errors,
            "sanity": sanity,
            "redis_dbsize_after": dbsize,
        },
        "ttft": ttft,
        "metrics": metrics_report(scrapes),
        "redis_commandstats": {
            k: {f: v[f] for f in ("calls", "usec", "usec_per_call") if f in v}
            for k, v in stats.items()
        },
        **({"profile": profile} if profile else {}),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small counts: under 40 s")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON results file")
    parser.add_argument("--redis-server", default=shutil.which("redis-server")
                        or "/usr/bin/redis-server", help="redis-server binary")
    parser.add_argument("--proxy-log-level", default="INFO",
                        help="tokenmeter --log-level (INFO, the default, writes the access log)")
    parser.add_argument("--profile", type=float, default=0.0, metavar="SECONDS",
                        help="after measuring, sample each proxy with py-spy for SECONDS")
    parser.add_argument("--profile-concurrency", type=int, default=1, metavar="N",
                        help="client concurrency while profiling (default 1)")
    parser.add_argument("--keep-tmp", action="store_true",
                        help="keep the temp dir (configs and service logs)")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    if not Path(args.redis_server).exists():
        print(f"redis-server not found at {args.redis_server} (use --redis-server PATH)",
              file=sys.stderr)
        return 2
    args.pyspy = find_pyspy()
    if args.profile and args.pyspy is None:
        print("--profile needs py-spy (.venv/bin/pip install py-spy)", file=sys.stderr)
        return 2

    return execute(args, plan, run, report, "tokenmeter-bench-budget-")


if __name__ == "__main__":
    raise SystemExit(main())
