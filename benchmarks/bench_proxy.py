#!/usr/bin/env python3
"""Benchmark: direct to the mock upstream vs through nginx vs through tokenmeter, in one run.

    .venv/bin/python benchmarks/bench_proxy.py [--quick]

Starts, on free 127.0.0.1 ports, the simulated upstream (`tokenmeter mock-upstream`), the proxy
(`tokenmeter serve --upstream ...`) in front of it and nginx as a plain pass-through hop in front
of the same mock. A cheap aiohttp client (raw POST, incremental read of the SSE body) then
measures, with the three paths interleaved round by round:

1. TTFT (request sent -> first content token received) at p50/p99, and the TTFT added by each
   hop over the direct path, at concurrency 1, 16 and 64 (256-token streams at 750 tokens/s);
2. relayed tokens/s in the same runs: aggregate over all clients and per stream, with the ratio
   to direct;
3. one fast stream (4,000 tokens at 14,000 tokens/s): per-stream tokens/s, median of repeats;
4. CPU time per 256-token stream of the proxy process and of nginx (utime+stime from /proc).

It prints a table with the targets and PASS/MISS and writes benchmarks/results/latest.json.
See benchmarks/README.md for how to read the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import math
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = ROOT / "benchmarks" / "results" / "latest.json"
HOST = "127.0.0.1"
PATHS = ("direct", "nginx", "proxy")
LABELS = {"direct": "direct", "nginx": "nginx", "proxy": "tokenmeter"}
CHAT = "/v1/chat/completions"
# Every content-token chunk of the mock carries exactly this once (the first, role-only chunk
# has `{"role":"assistant","content":""}`, the finish chunk `"delta":{}`): counting it counts
# tokens without parsing JSON, which keeps the client cheap. The hops relay the bytes unchanged.
MARK = b'"delta":{"content":"'
KEEP = len(MARK) - 1  # bytes kept from one read to the next so a split marker is still found
DONE = b"data: [DONE]\n\n"
END_KEEP = 512  # a stream's last bytes: [DONE] and any comment lines after it
BIN_S = 0.01  # width of the bins that record when tokens arrived, for the aggregate rate
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=60, sock_connect=10, sock_read=30)
CLK_TCK = os.sysconf("SC_CLK_TCK")


class BenchError(Exception):
    pass


# --------------------------------------------------------------------------------------------
# Plan and workloads


@dataclass(frozen=True)
class Workload:
    tokens: int
    tokens_per_second: float
    ttft_ms: float

    @property
    def nominal_s(self) -> float:
        return self.ttft_ms / 1000 + self.tokens / self.tokens_per_second

    def headers(self) -> dict[str, str]:
        return {
            "Content-Type": "application/json",
            "x-mock-output-tokens": str(self.tokens),
            "x-mock-tokens-per-second": repr(self.tokens_per_second),
            "x-mock-ttft-ms": repr(self.ttft_ms),
        }


STANDARD = Workload(tokens=256, tokens_per_second=750.0, ttft_ms=20.0)
FAST = Workload(tokens=4000, tokens_per_second=14000.0, ttft_ms=1.0)
BODY = json.dumps(
    {
        "model": "mock-gpt",
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "Write a short paragraph about benchmarks."}],
    },
    separators=(",", ":"),
).encode()


@dataclass(frozen=True)
class Plan:
    name: str
    warmup: int  # requests per path before anything is measured
    # concurrency -> (rounds, requests per worker per round); each round runs every path once
    sweep: dict[int, tuple[int, int]]
    fast_repeats: int
    cpu_requests: int  # per path
    cpu_rounds: int
    cpu_concurrency: int
    deadline_s: float  # the whole run, startup included


FULL = Plan(
    name="full",
    warmup=20,
    sweep={1: (10, 10), 16: (4, 4), 64: (2, 3)},
    fast_repeats=7,
    cpu_requests=200,
    cpu_rounds=4,
    cpu_concurrency=16,
    deadline_s=900.0,
)
QUICK = Plan(
    name="quick",
    warmup=8,
    sweep={1: (3, 4), 16: (2, 2), 64: (1, 2)},
    fast_repeats=3,
    cpu_requests=64,
    cpu_rounds=2,
    cpu_concurrency=16,
    deadline_s=240.0,
)


def rotated(r: int) -> tuple[str, ...]:
    """Path order for round r: each path goes first, second and third in turn."""
    k = r % len(PATHS)
    return PATHS[k:] + PATHS[:k]


# --------------------------------------------------------------------------------------------
# Statistics


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    if not values:
        return math.nan
    data = sorted(values)
    pos = (len(data) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def ratio(value: float, base: float) -> float:
    return value / base if base and not math.isnan(base) else math.nan


def rnd(value: float, digits: int = 3) -> float | None:
    return None if value is None or math.isnan(value) else round(value, digits)


# --------------------------------------------------------------------------------------------
# Processes


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((HOST, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the `(comm)` field, or None if the process is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return raw[raw.rindex(")") + 2 :].split()


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants (nginx: master and workers)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat_fields(int(entry))
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry))
    out: list[int] = []
    todo = [pid]
    while todo and len(out) < 1000:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


def cpu_times(pids: Sequence[int]) -> tuple[float, float]:
    """(utime, stime) of the given processes together, in seconds."""
    user = system = 0
    for pid in pids:
        fields = _stat_fields(pid)
        if fields is not None:
            user += int(fields[11])  # stat field 14
            system += int(fields[12])  # stat field 15
    return user / CLK_TCK, system / CLK_TCK


@dataclass
class Service:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self, n: int = 30) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return ""
        return "\n".join(lines[-n:])


class Services:
    """Subprocesses of this run; `stop()` ends each one (and its process group) it started."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.items: list[Service] = []

    def start(self, name: str, argv: list[str]) -> Service:
        log = self.workdir / f"{name}.log"
        # A tokenmeter of this run keeps its state (ledger, spools) in the run's directory, one
        # per service (`<name>-restarted`, bench_soak's rolling restart, finds its own again),
        # never in the state directory of the machine's user.
        state = self.workdir / f"state-{name.partition('-restarted')[0]}"
        env = {**os.environ, "TOKENMETER_STATE_DIR": str(state)}
        with log.open("wb") as out:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                env=env,
                start_new_session=True,  # own process group: Ctrl-C reaches only us, we clean up
            )
        svc = Service(name, proc, log)
        self.items.append(svc)
        return svc

    def stop(self) -> None:
        for svc in reversed(self.items):
            if svc.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(svc.proc.pid, signal.SIGTERM)
        for svc in reversed(self.items):
            try:
                svc.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(svc.proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    svc.proc.wait(timeout=5)
        self.items.clear()


def tokenmeter_argv() -> list[str]:
    script = Path(sys.executable).with_name("tokenmeter")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "proxy.cli"]


NGINX_CONF = """\
daemon off;
master_process on;
worker_processes 1;
{user}pid {d}/nginx.pid;
lock_file {d}/nginx.lock;
error_log {d}/nginx-error.log warn;

events {{
    worker_connections 4096;
}}

http {{
    access_log off;
    client_body_temp_path {d}/client_body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    keepalive_requests 100000;

    upstream mock {{
        server {host}:{mock_port};
        keepalive 256;
    }}

    server {{
        listen {host}:{port};
        location / {{
            proxy_pass http://mock;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 60s;
        }}
    }}
}}
"""


def write_nginx_conf(workdir: Path, port: int, mock_port: int) -> Path:
    # `user` only matters (and is only allowed to be root) when the master runs as root.
    user = "user root;\n" if os.geteuid() == 0 else ""
    conf = workdir / "nginx.conf"
    conf.write_text(
        NGINX_CONF.format(user=user, d=workdir, host=HOST, port=port, mock_port=mock_port)
    )
    return conf


def nginx_version(nginx: str) -> str:
    out = subprocess.run([nginx, "-v"], capture_output=True, text=True, timeout=10, check=False)
    return (out.stderr or out.stdout).strip().removeprefix("nginx version: nginx/")


async def wait_ready(svc: Service, url: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    last = ""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while time.monotonic() < deadline:
            if svc.proc.poll() is not None:
                raise BenchError(
                    f"{svc.name} exited with {svc.proc.returncode}; log:\n{svc.tail()}"
                )
            try:
                async with session.get(url) as resp:
                    await resp.read()
                    if resp.status == 200:
                        return
                    last = f"HTTP {resp.status}"
            except (aiohttp.ClientError, TimeoutError) as exc:
                last = type(exc).__name__
            await asyncio.sleep(0.1)
    raise BenchError(
        f"{svc.name} not ready at {url} after {timeout_s:.0f}s ({last}):\n{svc.tail()}"
    )


# --------------------------------------------------------------------------------------------
# Client


class Bins:
    """Tokens received per BIN_S slot since t0: the aggregate rate over any window."""

    def __init__(self, t0: float, span_s: float) -> None:
        self.t0 = t0
        self.counts = [0] * (int(span_s / BIN_S) + 2)

    def add(self, now: float, n: int) -> None:
        i = int((now - self.t0) / BIN_S)
        if 0 <= i < len(self.counts):
            self.counts[i] += n

    def tokens_between(self, start: float, end: float) -> tuple[int, float]:
        """Tokens in the whole bins inside [start, end), and the time those bins cover."""
        first = max(0, math.ceil((start - self.t0) / BIN_S))
        last = min(len(self.counts), math.floor((end - self.t0) / BIN_S))
        if last <= first:
            return 0, 0.0
        return sum(self.counts[first:last]), (last - first) * BIN_S


@dataclass(slots=True)
class Stream:
    ttft: float  # seconds, request sent -> first content token received
    tokens: int
    decode_s: float  # first content token -> last content token
    nbytes: int

    @property
    def rate(self) -> float:
        return (self.tokens - 1) / self.decode_s if self.decode_s > 0 else math.nan


def ends_with_done(end: bytes) -> bool:
    """Whether the last event of a stream (its last bytes) is `data: [DONE]`. SSE comment
    lines after it are not events: tokenmeter closes a stream with one that tells its cost."""
    lines = [ln for ln in end.splitlines() if ln.strip() and not ln.startswith(b":")]
    return bool(lines) and lines[-1].rstrip() == DONE.rstrip()


async def one_stream(
    session: aiohttp.ClientSession, url: str, wl: Workload, bins: Bins | None = None
) -> Stream:
    perf = time.perf_counter
    headers = wl.headers()
    t0 = perf()
    async with session.post(url, data=BODY, headers=headers, timeout=REQUEST_TIMEOUT) as resp:
        if resp.status != 200:
            text = (await resp.read())[:200]
            raise BenchError(f"HTTP {resp.status}: {text!r}")
        tokens = nbytes = 0
        first = last = 0.0
        tail = end = b""
        async for chunk in resp.content.iter_any():
            now = perf()
            nbytes += len(chunk)
            end = (end + chunk)[-END_KEEP:]
            buf = tail + chunk if tail else chunk
            n = buf.count(MARK)
            if n:
                if not tokens:
                    first = now
                tokens += n
                last = now
                if bins is not None:
                    bins.add(now, n)
            tail = buf[-KEEP:]
    if not ends_with_done(end):
        raise BenchError(f"stream did not end with [DONE] ({tokens} tokens)")
    if tokens != wl.tokens:
        raise BenchError(f"got {tokens} content tokens, expected {wl.tokens}")
    return Stream(ttft=first - t0, tokens=tokens, decode_s=last - first, nbytes=nbytes)


@dataclass
class Batch:
    streams: list[Stream]
    errors: list[str]
    wall_s: float
    window_tokens: int
    window_s: float


async def run_batch(  # noqa: PLR0913  keyword-only knobs of one batch
    session: aiohttp.ClientSession,
    url: str,
    wl: Workload,
    *,
    concurrency: int,
    total: int,
    timeout_s: float,
) -> Batch:
    """`total` requests by `concurrency` closed-loop workers whose starts are spread over one
    nominal stream duration, so arrivals are steady rather than one burst. The aggregate rate
    is taken over the window in which every worker is busy (last start -> first worker done)."""
    loop_t0 = time.perf_counter()
    bins = Bins(loop_t0, timeout_s + 5)
    streams: list[Stream] = []
    errors: list[str] = []
    remaining = [total]
    starts: list[float] = []
    ends: list[float] = []
    stagger = wl.nominal_s / concurrency if concurrency > 1 else 0.0

    async def worker(i: int) -> None:
        await asyncio.sleep(i * stagger)
        starts.append(time.perf_counter())
        while remaining[0] > 0:
            remaining[0] -= 1
            try:
                streams.append(await one_stream(session, url, wl, bins))
            except (aiohttp.ClientError, TimeoutError, BenchError) as exc:
                errors.append(f"{type(exc).__name__}: {exc}"[:300])
        ends.append(time.perf_counter())

    workers = [asyncio.ensure_future(worker(i)) for i in range(min(concurrency, total))]
    try:
        _, pending = await asyncio.wait(workers, timeout=timeout_s)
        if pending:
            errors.append(f"batch timed out after {timeout_s:.0f}s")
    finally:
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    wall = time.perf_counter() - loop_t0
    tokens, span = 0, 0.0
    if starts and ends:
        tokens, span = bins.tokens_between(max(starts), min(ends))
    if span < 0.3:  # no real steady window (one worker, or one request each): whole batch
        tokens, span = bins.tokens_between(loop_t0, loop_t0 + wall + BIN_S)
    return Batch(streams, errors, wall, tokens, span)


# --------------------------------------------------------------------------------------------
# Phases


@dataclass
class PathAcc:
    streams: list[Stream] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    window_tokens: int = 0
    window_s: float = 0.0

    def add(self, batch: Batch) -> None:
        self.streams.extend(batch.streams)
        self.errors.extend(batch.errors)
        self.window_tokens += batch.window_tokens
        self.window_s += batch.window_s

    @property
    def aggregate(self) -> float:
        return self.window_tokens / self.window_s if self.window_s else math.nan


class Bench:
    def __init__(
        self, urls: dict[str, str], plan: Plan, pids: dict[str, int], deadline: float
    ) -> None:
        self.urls = urls
        self.plan = plan
        self.pids = pids
        self.deadline = deadline

    def check_time(self, what: str) -> None:
        if time.monotonic() > self.deadline:
            raise BenchError(f"run deadline of {self.plan.deadline_s:.0f}s passed before {what}")

    def batch_timeout(self, wl: Workload, concurrency: int, total: int) -> float:
        # Generous (CPU contention at high concurrency), but bounded.
        per_worker = math.ceil(total / concurrency)
        return min(300.0, 30.0 + 10 * per_worker * wl.nominal_s)

    async def warmup(self, session: aiohttp.ClientSession) -> dict[str, int]:
        errors = {}
        for path in PATHS:
            n = self.plan.warmup
            batch = await run_batch(
                session, self.urls[path], STANDARD, concurrency=4, total=n,
                timeout_s=self.batch_timeout(STANDARD, 4, n),
            )
            fast = await run_batch(
                session, self.urls[path], FAST, concurrency=1, total=2, timeout_s=60
            )
            errors[path] = len(batch.errors) + len(fast.errors)
            if len(batch.streams) + len(fast.streams) == 0:
                raise BenchError(f"warm-up: every request on {path} failed: {batch.errors[:3]}")
        return errors

    async def sweep(self, session: aiohttp.ClientSession, progress: Callable[[str], None]
                    ) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for conc, (rounds, per_worker) in self.plan.sweep.items():
            acc = {p: PathAcc() for p in PATHS}
            total = conc * per_worker
            for r in range(rounds):
                self.check_time(f"sweep c={conc} round {r + 1}")
                for path in rotated(r):
                    acc[path].add(
                        await run_batch(
                            session, self.urls[path], STANDARD, concurrency=conc, total=total,
                            timeout_s=self.batch_timeout(STANDARD, conc, total),
                        )
                    )
                    await asyncio.sleep(0.05)
            progress(f"  sweep concurrency {conc}: done ({rounds} rounds x {total} per path)")
            out[str(conc)] = summarize_sweep(acc)
        return out

    async def fast(self, session: aiohttp.ClientSession) -> dict[str, Any]:
        rates: dict[str, list[float]] = {p: [] for p in PATHS}
        errors: dict[str, list[str]] = {p: [] for p in PATHS}
        for r in range(self.plan.fast_repeats):
            self.check_time(f"fast stream repeat {r + 1}")
            for path in rotated(r):
                try:
                    s = await asyncio.wait_for(one_stream(session, self.urls[path], FAST), 60)
                    rates[path].append(s.rate)
                except (aiohttp.ClientError, TimeoutError, BenchError) as exc:
                    errors[path].append(f"{type(exc).__name__}: {exc}"[:300])
                await asyncio.sleep(0.1)
        direct = statistics.median(rates["direct"]) if rates["direct"] else math.nan
        out: dict[str, Any] = {}
        for path in PATHS:
            med = statistics.median(rates[path]) if rates[path] else math.nan
            out[path] = {
                "tokens_per_second_median": rnd(med, 1),
                "tokens_per_second_min": rnd(min(rates[path], default=math.nan), 1),
                "tokens_per_second_max": rnd(max(rates[path], default=math.nan), 1),
                "ratio_to_direct": rnd(ratio(med, direct), 4),
                "runs": len(rates[path]),
                "errors": len(errors[path]),
                "error_samples": errors[path][:3],
            }
        return out

    async def cpu(self, session: aiohttp.ClientSession) -> dict[str, Any]:
        plan = self.plan
        trees = {name: process_tree(pid) for name, pid in self.pids.items()}
        # spent[path][process]: CPU seconds (user+system) of each process while that path was
        # driven; split[path][process]: the same as [user, system]
        spent = {p: dict.fromkeys(trees, 0.0) for p in PATHS}
        split = {p: {name: [0.0, 0.0] for name in trees} for p in PATHS}
        done = dict.fromkeys(PATHS, 0)
        errors = dict.fromkeys(PATHS, 0)
        per_round = [plan.cpu_requests // plan.cpu_rounds] * plan.cpu_rounds
        per_round[-1] += plan.cpu_requests - sum(per_round)
        for r, n in enumerate(per_round):
            self.check_time(f"CPU round {r + 1}")
            for path in rotated(r):
                await asyncio.sleep(0.2)  # let the previous batch's trailing work finish
                before = {name: cpu_times(t) for name, t in trees.items()}
                batch = await run_batch(
                    session, self.urls[path], STANDARD, concurrency=plan.cpu_concurrency,
                    total=n, timeout_s=self.batch_timeout(STANDARD, plan.cpu_concurrency, n),
                )
                await asyncio.sleep(0.2)  # settling (metrics, log line) runs after the stream
                for name, t in trees.items():
                    user, system = cpu_times(t)
                    split[path][name][0] += user - before[name][0]
                    split[path][name][1] += system - before[name][1]
                    spent[path][name] += user + system - sum(before[name])
                done[path] += len(batch.streams)
                errors[path] += len(batch.errors)

        def per_stream(path: str, proc: str) -> float:
            return 1000 * spent[path][proc] / done[path] if done[path] else math.nan

        proxy_ms = per_stream("proxy", "proxy")
        nginx_ms = per_stream("nginx", "nginx")
        return {
            "requests_per_path": dict(done),
            "errors": errors,
            "concurrency": plan.cpu_concurrency,
            "clock_ticks_per_second": CLK_TCK,
            "ms_per_stream": {
                "tokenmeter": rnd(proxy_ms),
                "nginx": rnd(nginx_ms),
                "mock_direct": rnd(per_stream("direct", "mock")),
                "mock_via_nginx": rnd(per_stream("nginx", "mock")),
                "mock_via_tokenmeter": rnd(per_stream("proxy", "mock")),
            },
            "user_system_ms_per_stream": {
                "tokenmeter": [
                    rnd(1000 * v / max(1, done["proxy"])) for v in split["proxy"]["proxy"]
                ],
                "nginx": [
                    rnd(1000 * v / max(1, done["nginx"])) for v in split["nginx"]["nginx"]
                ],
            },
            "us_per_token_chunk": {
                "tokenmeter": rnd(1000 * proxy_ms / STANDARD.tokens, 2),
                "nginx": rnd(1000 * nginx_ms / STANDARD.tokens, 2),
            },
            "ratio_tokenmeter_to_nginx": rnd(ratio(proxy_ms, nginx_ms), 3),
            "idle_ms_per_stream": {  # the hop's own CPU while the other paths ran: ~0 expected
                "tokenmeter": rnd(
                    1000 * sum(spent[p]["proxy"] for p in ("direct", "nginx"))
                    / max(1, done["direct"] + done["nginx"])
                ),
                "nginx": rnd(
                    1000 * sum(spent[p]["nginx"] for p in ("direct", "proxy"))
                    / max(1, done["direct"] + done["proxy"])
                ),
            },
            "cpu_seconds": {p: {k: round(v, 3) for k, v in spent[p].items()} for p in PATHS},
        }

    async def profile(
        self, session: aiohttp.ClientSession, pyspy: str, out: Path, seconds: float
    ) -> dict[str, Any]:
        """Sample the proxy with py-spy while it relays 256-token streams at concurrency 16.
        Runs after every measurement: sampling costs the proxy CPU."""
        conc = self.plan.cpu_concurrency
        total = conc * (math.ceil(seconds / STANDARD.nominal_s) + 2)
        out.parent.mkdir(parents=True, exist_ok=True)
        spy = await asyncio.create_subprocess_exec(
            pyspy, "record", "--pid", str(self.pids["proxy"]), "--duration", str(int(seconds)),
            "--rate", "250", "--function", "--nonblocking", "--format", "raw", "-o", str(out),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            await asyncio.sleep(0.5)  # let py-spy attach
            await run_batch(
                session, self.urls["proxy"], STANDARD, concurrency=conc, total=total,
                timeout_s=seconds + 60,
            )
            _, err = await asyncio.wait_for(spy.communicate(), seconds + 30)
        finally:
            if spy.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    spy.kill()
                await spy.wait()
        if spy.returncode != 0 or not is_file(out):
            raise BenchError(f"py-spy failed ({spy.returncode}): {err.decode(errors='replace')}")
        return summarize_profile(out)


def is_file(path: Path) -> bool:
    return path.is_file()


def find_pyspy() -> str | None:
    found = shutil.which("py-spy")
    if found:
        return found
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else None


def summarize_profile(path: Path, top: int = 15) -> dict[str, Any]:
    """Self and inclusive sample shares per function from py-spy's raw (collapsed) output."""
    self_counts: dict[str, int] = {}
    incl_counts: dict[str, int] = {}
    by_area: dict[str, int] = {}
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [f.strip() for f in stack.split(";") if f.strip()]
        if not frames:
            continue
        self_counts[frames[-1]] = self_counts.get(frames[-1], 0) + n
        for f in set(frames):
            incl_counts[f] = incl_counts.get(f, 0) + n
        # Where the sample's own (leaf) time went: project code, aiohttp, asyncio, other.
        leaf_file = frames[-1].rpartition("(")[2]
        area = next(
            (a for a in ("proxy/", "aiohttp/", "asyncio/", "multidict/", "yarl/", "prometheus")
             if a in leaf_file),
            "other",
        )
        by_area[area.rstrip("/")] = by_area.get(area.rstrip("/"), 0) + n

    def share(counts: dict[str, int], keep: Callable[[str], bool] = lambda _: True
              ) -> list[dict[str, Any]]:
        ranked = sorted(((c, f) for f, c in counts.items() if keep(f)), reverse=True)[:top]
        return [{"function": f, "samples": c, "percent": round(100 * c / total, 1)}
                for c, f in ranked]

    return {
        "samples": total,
        "raw_file": str(path),
        "self": share(self_counts),
        "inclusive_proxy_code": share(incl_counts, lambda f: "proxy/" in f),
        "self_by_area_percent": {
            a: round(100 * c / total, 1) for a, c in sorted(by_area.items(), key=lambda x: -x[1])
        } if total else {},
    }


def summarize_sweep(acc: dict[str, PathAcc]) -> dict[str, Any]:
    stats: dict[str, dict[str, float]] = {}
    for path, a in acc.items():
        ttfts = [1000 * s.ttft for s in a.streams]
        rates = [s.rate for s in a.streams if not math.isnan(s.rate)]
        stats[path] = {
            "p50": percentile(ttfts, 50),
            "p99": percentile(ttfts, 99),
            "agg": a.aggregate,
            "stream": statistics.median(rates) if rates else math.nan,
        }
    d = stats["direct"]
    out: dict[str, Any] = {}
    for path, a in acc.items():
        s = stats[path]
        out[path] = {
            "requests": len(a.streams),
            "errors": len(a.errors),
            "error_samples": a.errors[:3],
            "ttft_ms": {"p50": rnd(s["p50"]), "p99": rnd(s["p99"])},
            "added_ttft_ms": {
                "p50": rnd(s["p50"] - d["p50"]),
                "p99": rnd(s["p99"] - d["p99"]),
            },
            "aggregate_tokens_per_second": rnd(s["agg"], 1),
            "aggregate_ratio_to_direct": rnd(ratio(s["agg"], d["agg"]), 4),
            "per_stream_tokens_per_second_p50": rnd(s["stream"], 1),
            "per_stream_ratio_to_direct": rnd(ratio(s["stream"], d["stream"]), 4),
            "bytes_per_stream": (
                round(statistics.mean(x.nbytes for x in a.streams)) if a.streams else None
            ),
        }
    return out


# --------------------------------------------------------------------------------------------
# Targets and report


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    c16 = results["sweep"].get("16", {}).get("proxy", {})
    fast = results["fast_stream"]["proxy"]
    cpu = results["cpu"]

    def row(name: str, value: float | None, op: str, limit: float, unit: str) -> dict[str, Any]:
        ok = value is not None and (value < limit if op == "<" else
                                    value <= limit if op == "<=" else value >= limit)
        return {"target": name, "value": value, "op": op, "limit": limit, "unit": unit,
                "pass": ok}

    return [
        row("added TTFT p50 at concurrency 16 (tokenmeter - direct)",
            c16.get("added_ttft_ms", {}).get("p50"), "<", 1.0, "ms"),
        row("added TTFT p99 at concurrency 16 (tokenmeter - direct)",
            c16.get("added_ttft_ms", {}).get("p99"), "<", 5.0, "ms"),
        row("14k tok/s stream, tokenmeter / direct", fast["ratio_to_direct"], ">=", 0.95, "x"),
        row("CPU per 256-token stream, tokenmeter", cpu["ms_per_stream"]["tokenmeter"], "<=",
            5.0, "ms"),
        row("CPU per stream, tokenmeter / nginx", cpu["ratio_tokenmeter_to_nginx"], "<=", 3.0,
            "x"),
    ]


def fmt(value: Any, spec: str = ".2f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def report(results: dict[str, Any]) -> str:
    meta = results["meta"]
    lines = [
        f"tokenmeter relay benchmark ({meta['plan']}) - {meta['cpus']} CPUs, "
        f"Python {meta['python']}, aiohttp {meta['aiohttp']}, nginx {meta['nginx']}",
        f"standard stream: {STANDARD.tokens} tokens at {STANDARD.tokens_per_second:g} tok/s, "
        f"upstream TTFT {STANDARD.ttft_ms:g} ms; paths interleaved round by round",
        "",
        "1+2. Concurrency sweep. TTFT = request sent -> first content token received (ms);",
        "     added = path minus direct; agg = tokens/s received by all clients (steady window);",
        "     stream = median per-stream decode rate (tokens/s); ratios are to direct.",
        f"{'conc':>4} {'path':<10} {'n':>4} {'TTFTp50':>8} {'TTFTp99':>8} {'add p50':>8} "
        f"{'add p99':>8} {'agg tok/s':>10} {'ratio':>6} {'stream':>8} {'ratio':>6} {'err':>4}",
    ]
    for conc, per in results["sweep"].items():
        for path in PATHS:
            r = per[path]
            direct = path == "direct"
            lines.append(
                f"{conc:>4} {LABELS[path]:<10} {r['requests']:>4} "
                f"{fmt(r['ttft_ms']['p50']):>8} {fmt(r['ttft_ms']['p99']):>8} "
                f"{'' if direct else fmt(r['added_ttft_ms']['p50'], '+.2f'):>8} "
                f"{'' if direct else fmt(r['added_ttft_ms']['p99'], '+.2f'):>8} "
                f"{fmt(r['aggregate_tokens_per_second'], '.0f'):>10} "
                f"{fmt(r['aggregate_ratio_to_direct'], '.3f'):>6} "
                f"{fmt(r['per_stream_tokens_per_second_p50'], '.0f'):>8} "
                f"{fmt(r['per_stream_ratio_to_direct'], '.3f'):>6} {r['errors']:>4}"
            )
    fast = results["fast_stream"]
    lines += [
        "",
        f"3. One fast stream: {FAST.tokens} tokens at {FAST.tokens_per_second:g} tok/s, "
        f"median of {fast['direct']['runs']} runs per path",
        f"{'path':<10} {'median':>9} {'min':>9} {'max':>9} {'ratio':>6} {'err':>4}",
    ]
    for path in PATHS:
        r = fast[path]
        lines.append(
            f"{LABELS[path]:<10} {fmt(r['tokens_per_second_median'], '.0f'):>9} "
            f"{fmt(r['tokens_per_second_min'], '.0f'):>9} "
            f"{fmt(r['tokens_per_second_max'], '.0f'):>9} "
            f"{fmt(r['ratio_to_direct'], '.3f'):>6} {r['errors']:>4}"
        )
    cpu = results["cpu"]
    ms = cpu["ms_per_stream"]
    lines += [
        "",
        f"4. CPU (utime+stime) per {STANDARD.tokens}-token stream, "
        f"{cpu['requests_per_path']['proxy']} requests per path at concurrency "
        f"{cpu['concurrency']}, after warm-up",
        f"   tokenmeter process  {fmt(ms['tokenmeter'], '7.3f')} ms/stream  "
        f"({fmt(cpu['us_per_token_chunk']['tokenmeter'], '.1f')} us per token chunk)",
        f"   nginx (master+wkr)  {fmt(ms['nginx'], '7.3f')} ms/stream  "
        f"({fmt(cpu['us_per_token_chunk']['nginx'], '.1f')} us per token chunk)",
        f"   tokenmeter / nginx  {fmt(cpu['ratio_tokenmeter_to_nginx'], '7.2f')} x",
        "   user/system ms per stream: tokenmeter "
        + "/".join(fmt(v, ".2f") for v in cpu["user_system_ms_per_stream"]["tokenmeter"])
        + ", nginx "
        + "/".join(fmt(v, ".2f") for v in cpu["user_system_ms_per_stream"]["nginx"]),
        f"   (reference: mock upstream {fmt(ms['mock_direct'], '.3f')} ms/stream direct, "
        f"{fmt(ms['mock_via_nginx'], '.3f')} via nginx, "
        f"{fmt(ms['mock_via_tokenmeter'], '.3f')} via tokenmeter)",
        "",
        "Targets",
    ]
    for t in results["targets"]:
        value = fmt(t["value"], ".3f")
        lines.append(
            f"  {'PASS' if t['pass'] else 'MISS'}  {t['target']:<56} "
            f"{value:>8} {t['unit']:<2}  (target {t['op']} {t['limit']:g} {t['unit']})"
        )
    prof = results.get("profile")
    if prof:
        lines += ["", f"Profile of tokenmeter under load (py-spy, {prof['samples']} samples; "
                  f"raw stacks: {prof['raw_file']})",
                  "  self time by area: " + ", ".join(
                      f"{a} {p:.1f}%" for a, p in prof["self_by_area_percent"].items()),
                  "  top self time:"]
        lines += [f"    {r['percent']:5.1f}%  {r['function']}" for r in prof["self"]]
        lines.append("  proxy/ code, inclusive:")
        lines += [f"    {r['percent']:5.1f}%  {r['function']}"
                  for r in prof["inclusive_proxy_code"]]
    errors = sum(
        r["errors"] for per in results["sweep"].values() for r in per.values()
    ) + sum(r["errors"] for r in fast.values()) + sum(cpu["errors"].values())
    lines.append("")
    lines.append(f"request errors: {errors}" + ("" if not errors else "  (see JSON samples)"))
    lines.append(f"elapsed: {meta['elapsed_s']:.0f}s; JSON: {meta['output']}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Main


def ensure_alive(*services: Service) -> None:
    for svc in services:
        if svc.proc.poll() is not None:
            raise BenchError(f"{svc.name} died during the run:\n{svc.tail()}")


def run_meta(plan: str, t_start: float) -> dict[str, Any]:
    """What every benchmark's JSON records about the run and the machine."""
    return {
        "plan": plan,
        "started_at": time.strftime(
            "%Y-%m-%dT%H:%M:%S%z", time.localtime(time.time() - (time.monotonic() - t_start))
        ),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "aiohttp": aiohttp.__version__,
        "uvloop_importable": importlib.util.find_spec("uvloop") is not None,
        "platform": platform.platform(),
    }


async def run(args: argparse.Namespace, plan: Plan, services: Services, workdir: Path,
              t_start: float) -> dict[str, Any]:
    mock_port, nginx_port, proxy_port = free_ports(3)
    tm = tokenmeter_argv()
    mock = services.start(
        "mock",
        [*tm, "mock-upstream", "--host", HOST, "--port", str(mock_port),
         "--tokens-per-second", repr(STANDARD.tokens_per_second),
         "--ttft-ms", repr(STANDARD.ttft_ms), "--output-tokens", str(STANDARD.tokens)],
    )
    await wait_ready(mock, f"http://{HOST}:{mock_port}/v1/models")
    proxy = services.start(
        "tokenmeter",
        [*tm, "serve", "--upstream", f"http://{HOST}:{mock_port}/v1", "--host", HOST,
         "--port", str(proxy_port), "--log-level", args.proxy_log_level],
    )
    conf = write_nginx_conf(workdir, nginx_port, mock_port)
    nginx = services.start("nginx", [args.nginx, "-p", str(workdir), "-c", str(conf),
                                     "-e", str(workdir / "nginx-error.log")])
    await wait_ready(proxy, f"http://{HOST}:{proxy_port}/healthz")
    await wait_ready(nginx, f"http://{HOST}:{nginx_port}/v1/models")

    urls = {
        "direct": f"http://{HOST}:{mock_port}{CHAT}",
        "nginx": f"http://{HOST}:{nginx_port}{CHAT}",
        "proxy": f"http://{HOST}:{proxy_port}{CHAT}",
    }
    pids = {"proxy": proxy.proc.pid, "nginx": nginx.proc.pid, "mock": mock.proc.pid}
    bench = Bench(urls, plan, pids, t_start + plan.deadline_s)

    def progress(msg: str) -> None:
        print(f"[{time.monotonic() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
        progress(f"services up (mock :{mock_port}, nginx :{nginx_port}, tokenmeter "
                 f":{proxy_port}); warming up")
        warm_errors = await bench.warmup(session)
        progress("sweep (TTFT and tokens/s at each concurrency)")
        sweep = await bench.sweep(session, progress)
        progress("fast stream")
        fast = await bench.fast(session)
        progress("CPU per stream")
        cpu = await bench.cpu(session)
        profile = None
        if args.profile:
            progress(f"profiling tokenmeter with py-spy for {args.profile:g}s")
            profile = await bench.profile(
                session, args.pyspy, args.output.with_name("proxy-profile.txt"), args.profile
            )
    ensure_alive(mock, proxy, nginx)
    return {
        "meta": {
            **run_meta(plan.name, t_start),
            "nginx": nginx_version(args.nginx),
            "proxy_log_level": args.proxy_log_level,
            "standard_stream": vars(STANDARD) | {"nominal_s": round(STANDARD.nominal_s, 4)},
            "fast_stream": vars(FAST),
            "sweep_plan": {str(c): {"rounds": r, "requests_per_worker_per_round": k}
                           for c, (r, k) in plan.sweep.items()},
            "warmup_per_path": plan.warmup,
            "warmup_errors": warm_errors,
        },
        "sweep": sweep,
        "fast_stream": fast,
        "cpu": cpu,
        **({"profile": profile} if profile is not None else {}),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small counts: under a minute")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON results file")
    parser.add_argument("--nginx", default=shutil.which("nginx") or "/usr/sbin/nginx",
                        help="nginx binary")
    parser.add_argument("--proxy-log-level", default="INFO",
                        help="tokenmeter --log-level (INFO, the default, writes the access log)")
    parser.add_argument("--profile", type=float, default=0.0, metavar="SECONDS",
                        help="after measuring, sample the proxy with py-spy for SECONDS")
    parser.add_argument("--keep-tmp", action="store_true",
                        help="keep the temp dir (configs and service logs)")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    if not Path(args.nginx).exists():
        print(f"nginx not found at {args.nginx} (use --nginx PATH)", file=sys.stderr)
        return 2
    args.pyspy = find_pyspy()
    if args.profile and args.pyspy is None:
        print("--profile needs py-spy (.venv/bin/pip install py-spy)", file=sys.stderr)
        return 2

    return execute(args, plan, run, report, "tokenmeter-bench-", finish=_add_targets)


def _add_targets(results: dict[str, Any]) -> None:
    results["targets"] = targets(results)


def execute(  # noqa: PLR0913, PLR0917  each suite passes its own plan, run and report
    args: argparse.Namespace,
    plan: Any,
    run_fn: Callable[..., Coroutine[Any, Any, dict[str, Any]]],
    report_fn: Callable[[dict[str, Any]], str],
    prefix: str,
    finish: Callable[[dict[str, Any]], None] | None = None,
) -> int:
    """Run a benchmark with its services in a temp dir, always stopping them (also on Ctrl-C,
    SIGTERM and SIGHUP), then write the JSON and print the report. Shared by bench_budget."""

    def on_term(_signum: int, _frame: object) -> None:
        # Handled as Ctrl-C: inside asyncio.run that cancels the main task cleanly, outside it
        # raises KeyboardInterrupt; either way the `finally` below stops the services.
        signal.raise_signal(signal.SIGINT)

    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with it ignored
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_term)

    t_start = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    services = Services(workdir)
    code = 0
    try:
        results = asyncio.run(run_fn(args, plan, services, workdir, t_start))
        results["meta"]["elapsed_s"] = round(time.monotonic() - t_start, 1)
        results["meta"]["output"] = str(args.output)
        if finish is not None:
            finish(results)
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(results, indent=2) + "\n")
        print(report_fn(results))
    except BenchError as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        print("interrupted; stopping services", file=sys.stderr)
        code = 130
    finally:
        services.stop()
        if args.keep_tmp:
            print(f"temp dir kept: {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
