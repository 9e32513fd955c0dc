#!/usr/bin/env python3
"""A peer in the benchmark: tokenmeter beside LiteLLM's proxy, nginx and the bare aiohttp
pass-through, on one mock upstream, one load generator, interleaved rounds.

    .venv/bin/python benchmarks/bench_peers.py [--quick] [--no-litellm] [--output FILE]

Gateways, each started on a free 127.0.0.1 port in front of the same `tokenmeter mock-upstream`
(256-token streams at 750 tokens/s after a 20 ms TTFT; `max_tokens: 8` for small requests):

- `direct`: the client straight to the mock, the floor every added figure is taken from;
- `bare`: `benchmarks/bare_proxy.py`, what any aiohttp proxy costs at least;
- `nginx`: nginx pass-through, one worker, upstream keepalive (as in bench_proxy.py);
- `tokenmeter`: `tokenmeter serve --upstream URL`, the shipped defaults: the INFO access log
  (to a file) and the SQLite ledger on; budgets off;
- `tokenmeter+budgets`: `tokenmeter serve --config`, one user with a key and daily and
  per-minute token and request windows on a private redis-server; ledger and access log on;
- `litellm`: `litellm --config` (LiteLLM's proxy, its default single uvicorn worker, pinned
  `LITELLM_SPEC`, installed by this script into a venv of its own under `--litellm-venv`, then
  reused), a master key (it refuses to start without one) and no database: budgets off;
- `litellm+budgets`: the same with `DATABASE_URL` (a fresh PostgreSQL database) and a virtual
  key with a daily budget and per-minute limits: LiteLLM keeps budgets in its database through
  Prisma. When that cannot start here, the row says why and has no figures.

Phases, every gateway driven one at a time, the order rotated every round:
1. **small**: non-streamed 8-token chat completions at concurrency 16;
2. **c1**: 256-token streams one at a time (TTFT p50/p99);
3. **c16**: 256-token streams at concurrency 16 (TTFT p50/p99, and the CPU per stream);
4. **c64**: 256-token streams at concurrency 64 (tokens/s received by all clients together, in
   the window where all 64 are busy).

CPU is utime + stime from /proc summed over the gateway's whole process tree (nginx master and
worker; tokenmeter and any process it starts; LiteLLM and its children), read around each
batch; per request = CPU / requests answered. redis-server's CPU per request is reported for
`tokenmeter+budgets`. The load generator (aiohttp in this process) and the mock share the same
two cores with the gateway and with whatever else runs on the machine: read ratios within one
run, not absolute figures across runs.

It prints a markdown table and writes benchmarks/results/peers-latest.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

# benchmarks/ is not a package: make its sibling importable however this file is started.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_proxy import (
    BIN_S,
    BenchError,
    Bins,
    Service,
    Services,
    cpu_times,
    ends_with_done,
    ensure_alive,
    execute,
    free_ports,
    nginx_version,
    percentile,
    process_tree,
    run_meta,
    tokenmeter_argv,
    wait_ready,
    write_nginx_conf,
)
from procs import wait_port

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
DEFAULT_OUTPUT = ROOT / "benchmarks" / "results" / "peers-latest.json"
HOST = "127.0.0.1"
CHAT = "/v1/chat/completions"
MODEL = "mock-gpt"
API_KEY = "sk-peers-bench-user-0000"
# LiteLLM refuses to start without a master key (and with a weak one): one strong key per run.
LITELLM_MASTER_KEY = "sk-" + secrets.token_hex(32)
# The newest LiteLLM whose `[proxy]` extra resolves from the registry here (1.108.8 and later
# pin a litellm-proxy-extras that is not published).
LITELLM_SPEC = "litellm[proxy]==1.108.7"
LITELLM_VENV = Path.home() / ".cache" / "tokenmeter-bench" / "litellm-1.108.7"
TOKENS = 256
TOKENS_PER_SECOND = 750.0
TTFT_MS = 20.0
NOMINAL_S = TTFT_MS / 1000 + TOKENS / TOKENS_PER_SECOND
SMALL_TOKENS = 8
PHASES = ("small", "c1", "c16", "c64")
CONCURRENCY = {"small": 16, "c1": 1, "c16": 16, "c64": 64}
# A content token's event, whoever serialised it: the mock writes `"delta":{"content":" the"}`,
# LiteLLM re-serialises each chunk with other fields around it. The role chunk's content is ""
# and the finish and usage chunks carry none, so each match is one token, in C.
TOKEN_RE = re.compile(rb'"content": ?"[^"]')
KEEP = 512  # a stream's last bytes: [DONE] and any comment lines after it
TIMEOUT = aiohttp.ClientTimeout(total=120, sock_connect=10, sock_read=60)
STREAM_BODY = json.dumps({
    "model": MODEL, "stream": True, "stream_options": {"include_usage": True},
    "messages": [{"role": "user", "content": "Write a short paragraph about benchmarks."}],
}, separators=(",", ":")).encode()
SMALL_BODY = json.dumps({
    "model": MODEL, "max_tokens": SMALL_TOKENS,
    "messages": [{"role": "user", "content": "hi there"}],
}, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Plan:
    name: str
    warmup: int
    rounds: dict[str, int]  # by phase; each round drives every gateway once
    per_worker: dict[str, int]  # requests per client per batch, by phase
    litellm_ready_s: float


# Sized to finish within 10 minutes on a busy 2-core box: LiteLLM's single worker takes most of
# it (about 0.2 s of CPU a stream, so a round of 128 streams at concurrency 64 is half a minute
# or more). Two streams per client at concurrency 64 give a window where all 64 are busy.
FULL = Plan("full", warmup=16, rounds={"small": 3, "c1": 3, "c16": 3, "c64": 2},
            per_worker={"small": 12, "c1": 10, "c16": 2, "c64": 2}, litellm_ready_s=120)
QUICK = Plan("quick", warmup=8, rounds={"small": 2, "c1": 2, "c16": 2, "c64": 1},
             per_worker={"small": 8, "c1": 6, "c16": 2, "c64": 1}, litellm_ready_s=120)


@dataclass(frozen=True)
class Gateway:
    name: str
    label: str
    budgets: bool
    url: str  # base URL, .../v1
    pid: int  # root of the process tree whose CPU is counted; 0 for direct
    key: str | None = None


@dataclass
class Sample:
    """One batch of one phase on one gateway."""

    ok: int
    errors: list[str]
    cpu_s: float
    wall_s: float
    ttft_s: list[float] = field(default_factory=list)
    window_tokens: int = 0
    window_s: float = 0.0
    redis_cpu_s: float = 0.0


# --------------------------------------------------------------------------------------------
# Client


async def one_stream(session: aiohttp.ClientSession, url: str, headers: dict[str, str],
                     bins: Bins) -> float:
    """TTFT of one 256-token stream; raises BenchError unless it is whole."""
    perf = time.perf_counter
    t0 = perf()
    async with session.post(url, data=STREAM_BODY, headers=headers, timeout=TIMEOUT) as resp:
        if resp.status != 200:
            raise BenchError(f"HTTP {resp.status}: {(await resp.read())[:200]!r}")
        tokens, first, tail, end = 0, 0.0, b"", b""
        async for chunk in resp.content.iter_any():
            now = perf()
            # Count in whole lines only: a token's marker split across two reads is counted
            # once, when its line is complete.
            buf = tail + chunk
            cut = buf.rfind(b"\n") + 1
            n = len(TOKEN_RE.findall(buf, 0, cut)) if cut else 0
            tail = buf[cut:]
            end = (end + chunk)[-KEEP:]
            if n:
                if not tokens:
                    first = now
                tokens += n
                bins.add(now, n)
    if not ends_with_done(end):
        raise BenchError(f"stream did not end with [DONE] ({tokens} tokens)")
    if tokens != TOKENS:
        raise BenchError(f"got {tokens} content tokens, expected {TOKENS}")
    return first - t0


async def one_small(session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> None:
    async with session.post(url, data=SMALL_BODY, headers=headers, timeout=TIMEOUT) as resp:
        body = await resp.read()
        if resp.status != 200 or b'"choices"' not in body:
            raise BenchError(f"HTTP {resp.status}: {body[:200]!r}")


def tree_cpu(pid: int) -> float:
    if not pid:
        return 0.0
    user, system = cpu_times(process_tree(pid))
    return user + system


async def run_batch(session: aiohttp.ClientSession, gw: Gateway, phase: str, total: int,
                    redis_pid: int) -> Sample:
    """`total` requests by CONCURRENCY[phase] closed-loop clients, starts spread over one
    nominal stream so arrivals are steady; CPU of the gateway's tree around the batch."""
    conc = CONCURRENCY[phase]
    url = gw.url + CHAT.removeprefix("/v1")
    headers = {"Content-Type": "application/json"}
    if gw.key:
        headers["Authorization"] = f"Bearer {gw.key}"
    t0 = time.perf_counter()
    bins = Bins(t0, 600)
    remaining = [total]
    ttfts: list[float] = []
    errors: list[str] = []
    starts: list[float] = []
    ends: list[float] = []
    stagger = NOMINAL_S / conc if conc > 1 else 0.0

    async def client(i: int) -> None:
        await asyncio.sleep(i * stagger)
        starts.append(time.perf_counter())
        while remaining[0] > 0:
            remaining[0] -= 1
            try:
                if phase == "small":
                    await one_small(session, url, headers)
                    ttfts.append(0.0)
                else:
                    ttfts.append(await one_stream(session, url, headers, bins))
            except (aiohttp.ClientError, TimeoutError, BenchError) as exc:
                errors.append(f"{type(exc).__name__}: {exc}"[:300])
        ends.append(time.perf_counter())

    cpu0, redis0 = tree_cpu(gw.pid), tree_cpu(redis_pid)
    await asyncio.gather(*(client(i) for i in range(min(conc, total))))
    await asyncio.sleep(0.2)  # work the gateway does after the last byte (ledger, log) counts
    wall = time.perf_counter() - t0 - 0.2
    sample = Sample(ok=len(ttfts), errors=errors, cpu_s=tree_cpu(gw.pid) - cpu0, wall_s=wall,
                    ttft_s=[] if phase == "small" else ttfts,
                    redis_cpu_s=tree_cpu(redis_pid) - redis0 if redis_pid else 0.0)
    if starts and ends:
        sample.window_tokens, sample.window_s = bins.tokens_between(max(starts), min(ends))
    if sample.window_s < 0.3:  # no steady window: the whole batch
        sample.window_tokens, sample.window_s = bins.tokens_between(t0, t0 + wall + BIN_S)
    return sample


# --------------------------------------------------------------------------------------------
# Summary and table (pure: tests/benchmarks/test_bench_peers.py)


def summarize(samples: dict[str, dict[str, list[Sample]]], skipped: dict[str, str]
              ) -> dict[str, dict[str, Any]]:
    """Per gateway: CPU ms per small request and per stream, TTFT p50/p99 at c1/c16 and added
    over direct, tokens/s at c64 and its ratio to direct, Redis ms per small request."""
    out: dict[str, dict[str, Any]] = {}
    for name, phases in samples.items():
        row: dict[str, Any] = {}
        for phase, ss in phases.items():
            ok = sum(s.ok for s in ss)
            row[f"{phase}_requests"] = ok
            row[f"{phase}_errors"] = sum(len(s.errors) for s in ss)
            if phase == "small":
                row["cpu_ms_small"] = cpu_ms(name, ss)
                redis = sum(s.redis_cpu_s for s in ss)
                row["redis_cpu_ms_small"] = 1000 * redis / ok if ok and redis else None
            elif phase in ("c1", "c16"):
                ttft = [t * 1000 for s in ss for t in s.ttft_s]
                row[f"ttft_p50_{phase}"] = percentile(ttft, 50) if ttft else None
                row[f"ttft_p99_{phase}"] = percentile(ttft, 99) if ttft else None
                if phase == "c16":
                    row["cpu_ms_stream"] = cpu_ms(name, ss)
            elif phase == "c64":
                span = sum(s.window_s for s in ss)
                row["tokens_per_s_c64"] = sum(s.window_tokens for s in ss) / span if span else None
        out[name] = row
    direct = out.get("direct", {})
    bare = out.get("bare", {})
    for name, row in out.items():
        for phase in ("c1", "c16"):
            for q in ("p50", "p99"):
                v, d = row.get(f"ttft_{q}_{phase}"), direct.get(f"ttft_{q}_{phase}")
                row[f"added_ttft_{q}_{phase}"] = (v - d if v is not None and d is not None
                                                  and name != "direct" else None)
        for key in ("cpu_ms_small", "cpu_ms_stream"):
            v, b = row.get(key), bare.get(key)
            row[f"{key}_x_bare"] = v / b if v is not None and b else None
        v, d = row.get("tokens_per_s_c64"), direct.get("tokens_per_s_c64")
        row["tokens_per_s_c64_x_direct"] = v / d if v is not None and d else None
    for name, why in skipped.items():
        out[name] = {"skipped": why}
    return out


def cpu_ms(name: str, samples: list[Sample]) -> float | None:
    """CPU ms per answered request; none for direct (no gateway: the mock's is not counted)."""
    ok = sum(s.ok for s in samples)
    if name == "direct" or not ok:
        return None
    return 1000 * sum(s.cpu_s for s in samples) / ok


COLUMNS = (
    ("CPU ms / small req", "cpu_ms_small", "cpu_ms_small_x_bare", ".3f"),
    ("CPU ms / 256-tok stream", "cpu_ms_stream", "cpu_ms_stream_x_bare", ".2f"),
    ("+TTFT p50 c1", "added_ttft_p50_c1", None, "+.2f"),
    ("+TTFT p99 c1", "added_ttft_p99_c1", None, "+.2f"),
    ("+TTFT p50 c16", "added_ttft_p50_c16", None, "+.2f"),
    ("+TTFT p99 c16", "added_ttft_p99_c16", None, "+.2f"),
    ("tok/s c64", "tokens_per_s_c64", "tokens_per_s_c64_x_direct", ".0f"),
    ("Redis ms / req", "redis_cpu_ms_small", None, ".3f"),
)


def cell(value: Any, spec: str, ratio: Any = None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    text = format(value, spec)
    if ratio is not None and not (isinstance(ratio, float) and math.isnan(ratio)):
        text += f" ({ratio:.2f}x)"
    return text


def markdown_table(summary: dict[str, dict[str, Any]], labels: dict[str, str]) -> str:
    """One row per gateway; CPU ratios are to bare, tokens/s ratio to direct, TTFT in ms added
    over direct. A gateway that could not run has its reason in place of figures."""
    head = ["gateway", *(c[0] for c in COLUMNS), "errors"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name, row in summary.items():
        label = labels.get(name, name)
        if "skipped" in row:
            lines.append(f"| {label} | not run: {row['skipped']} |" + " |" * (len(head) - 2))
            continue
        cells = [cell(row.get(key), spec, row.get(rkey) if rkey else None)
                 for _, key, rkey, spec in COLUMNS]
        errors = sum(v for k, v in row.items() if k.endswith("_errors"))
        lines.append("| " + " | ".join([label, *cells, str(errors)]) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Services


def litellm_python(venv: Path, progress: Callable[[str], None]) -> Path:
    """The pinned LiteLLM in a venv of its own (created once, then reused)."""
    py = venv / "bin" / "python"
    marker = venv / ".installed"
    if marker.exists() and marker.read_text() == LITELLM_SPEC:
        return py
    progress(f"installing {LITELLM_SPEC} into {venv} (once; a minute or two)")
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    with (venv.parent / f"{venv.name}-install.log").open("wb") as log:
        subprocess.run([str(py), "-m", "pip", "install", "-q", LITELLM_SPEC, "prisma"],
                       check=True, stdout=log, stderr=subprocess.STDOUT)
    marker.write_text(LITELLM_SPEC)
    return py


def litellm_config(mock_port: int, budgets: bool) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model_list": [{"model_name": MODEL, "litellm_params": {
            "model": f"openai/{MODEL}", "api_base": f"http://{HOST}:{mock_port}/v1",
            "api_key": "sk-mock-upstream"}}],
        "litellm_settings": {"drop_params": True},
        "general_settings": {"master_key": LITELLM_MASTER_KEY},
    }
    if budgets:
        cfg["general_settings"]["database_url"] = "os.environ/DATABASE_URL"
    return cfg


def tokenmeter_budget_config(mock_port: int, redis_port: int) -> dict[str, Any]:
    """One user, one key, a day's and a minute's windows that never run out: every request
    reserves and settles on Redis (Lua), as a governed deployment does."""
    return {
        "upstreams": {"mock": {"base_url": f"http://{HOST}:{mock_port}/v1"}},
        "metrics": {"discover_models": False},
        "timezone": "UTC",
        "store": {"url": f"redis://{HOST}:{redis_port}/0"},
        "users": {"bench": {"keys": [API_KEY], "daily_tokens": 10**12,
                            "tokens_per_minute": 10**12, "requests_per_minute": 10**9}},
    }


def psql(*sql: str) -> None:
    for stmt in sql:
        subprocess.run(["psql", "-h", HOST, "-U", "postgres", "-d", "postgres", "-q", "-c", stmt],
                       check=True, capture_output=True, timeout=30)


async def litellm_up(svc: Service, url: str, timeout_s: float) -> str | None:
    """None when ready; else why not (the end of its log)."""
    try:
        await wait_ready(svc, url, timeout_s)
    except BenchError as exc:
        return failure_reason(str(exc))
    return None


def failure_reason(log: str) -> str:
    """The last error line of a log that ended a start, ANSI colours and addresses taken out."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", ln).strip() for ln in log.splitlines()]
    lines = [ln for ln in lines if ln]
    reason = next((ln for ln in reversed(lines) if "rror" in ln), lines[-1] if lines else "")
    if "ENOTFOUND" in reason or "getaddrinfo" in reason:
        return ("its database setup (Prisma) downloads the Prisma query engine at startup, and "
                "this machine reaches no host but the package registries")
    return re.sub(r"https?://\S+", "<url>", reason)[:300]


async def litellm_budget_key(base: str) -> str:
    """A LiteLLM virtual key with a daily budget and per-minute limits that never run out, as
    tokenmeter+budgets has: every request is checked against it and its spend written."""
    body = {"max_budget": 1e9, "budget_duration": "1d", "tpm_limit": 10**12,
            "rpm_limit": 10**9, "user_id": "bench"}
    headers = {"Authorization": f"Bearer {LITELLM_MASTER_KEY}"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session, \
            session.post(f"{base}/key/generate", json=body, headers=headers) as resp:
        data = await resp.json(content_type=None)
        if resp.status != 200 or not isinstance(data, dict) or "key" not in data:
            raise BenchError(f"HTTP {resp.status}: {str(data)[:200]}")
        return str(data["key"])


def envs(extra: dict[str, str]) -> list[str]:
    return [f"{k}={v}" for k, v in extra.items()]


# --------------------------------------------------------------------------------------------
# Run


async def start_litellm(  # noqa: PLR0913, PLR0917  one run's services, told where
        args: argparse.Namespace, plan: Plan, services: Services, workdir: Path, mock_port: int,
        ports: tuple[int, int], skipped: dict[str, str], meta: dict[str, Any],
        progress: Callable[[str], None]) -> list[Gateway]:
    """LiteLLM without and with its database (both started at once: each takes ~20 s to boot);
    a gateway for each that came up, the reason in `skipped` for each that did not."""
    ll_port, llb_port = ports
    py = await asyncio.to_thread(litellm_python, args.litellm_venv, progress)
    gateways: list[Gateway] = []
    probe = [str(py), "-c", "import importlib.metadata as m; print(m.version('litellm'))"]
    version = (await asyncio.to_thread(subprocess.run, probe, capture_output=True, text=True,
                                       check=True)).stdout.strip()
    meta["litellm"] = version
    ll_env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False"}
    started: list[tuple[str, Service, int]] = []
    for name, port, budgets in (("litellm", ll_port, False), ("litellm+budgets", llb_port,
                                                               True)):
        cfg_path = workdir / f"{name}.yaml"
        cfg_path.write_text(yaml.safe_dump(litellm_config(mock_port, budgets)))
        env = dict(ll_env)
        if budgets:
            db = f"tm_bench_litellm_{uuid.uuid4().hex[:10]}"
            await asyncio.to_thread(psql, f"CREATE DATABASE {db}")
            meta["litellm_db"] = db
            env["DATABASE_URL"] = f"postgresql://postgres@{HOST}:5432/{db}"
        svc = services.start(name, [
            "env", *envs(env), str(py.parent / "litellm"), "--config", str(cfg_path),
            "--host", HOST, "--port", str(port), "--telemetry", "False"])
        started.append((name, svc, port))
    for name, svc, port in started:
        why = await litellm_up(svc, f"http://{HOST}:{port}/health/liveliness",
                               plan.litellm_ready_s)
        if why is not None:
            skipped[name] = why
            with contextlib.suppress(ProcessLookupError):
                os.killpg(svc.proc.pid, 15)
            continue
        budgets = name.endswith("budgets")
        key = LITELLM_MASTER_KEY
        if budgets:
            try:
                key = await litellm_budget_key(f"http://{HOST}:{port}")
            except (aiohttp.ClientError, TimeoutError, BenchError) as exc:
                skipped[name] = f"its /key/generate failed: {exc}"[:300]
                continue
        gateways.append(Gateway(
            name, f"LiteLLM {version}, budgets {'on (Postgres)' if budgets else 'off'}",
            budgets, f"http://{HOST}:{port}/v1", svc.proc.pid, key))
    return gateways


async def start_all(args: argparse.Namespace, plan: Plan, services: Services, workdir: Path,
                    progress: Callable[[str], None]
                    ) -> tuple[list[Gateway], dict[str, str], int, dict[str, Any]]:
    mock_port, bare_port, nginx_port, tm_port, tmb_port, redis_port, ll_port, llb_port = (
        free_ports(8))
    tm = tokenmeter_argv()
    mock = services.start("mock", [
        *tm, "mock-upstream", "--host", HOST, "--port", str(mock_port),
        "--tokens-per-second", repr(TOKENS_PER_SECOND), "--ttft-ms", repr(TTFT_MS),
        "--output-tokens", str(TOKENS)])
    await wait_ready(mock, f"http://{HOST}:{mock_port}/v1/models")
    upstream = f"http://{HOST}:{mock_port}/v1"
    redis = services.start("redis", [args.redis_server, "--port", str(redis_port), "--bind", HOST,
                                     "--save", "", "--appendonly", "no"])
    bare = services.start("bare", [sys.executable, str(HERE / "bare_proxy.py"), "--host", HOST,
                                   "--port", str(bare_port), "--upstream",
                                   f"http://{HOST}:{mock_port}"])
    conf = write_nginx_conf(workdir, nginx_port, mock_port)
    nginx = services.start("nginx", [args.nginx, "-p", str(workdir), "-c", str(conf),
                                     "-e", str(workdir / "nginx-error.log")])
    tm_state = workdir / "state-tm"
    tmb_state = workdir / "state-tmb"
    tmb_conf = workdir / "tokenmeter-budgets.yaml"
    tmb_conf.write_text(yaml.safe_dump(tokenmeter_budget_config(mock_port, redis_port)))
    tmsvc = services.start("tokenmeter", [
        "env", *envs({"TOKENMETER_STATE_DIR": str(tm_state)}), *tm, "serve", "--upstream",
        upstream, "--host", HOST, "--port", str(tm_port)])
    wait_port(redis_port)
    tmbsvc = services.start("tokenmeter-budgets", [
        "env", *envs({"TOKENMETER_STATE_DIR": str(tmb_state)}), *tm, "serve", "--config",
        str(tmb_conf), "--host", HOST, "--port", str(tmb_port)])
    gateways = [Gateway("direct", "direct (client -> mock)", False, upstream, 0),
                Gateway("bare", "bare aiohttp pass-through", False,
                        f"http://{HOST}:{bare_port}/v1", bare.proc.pid),
                Gateway("nginx", f"nginx {nginx_version(args.nginx)}, 1 worker", False,
                        f"http://{HOST}:{nginx_port}/v1", nginx.proc.pid),
                Gateway("tokenmeter", "tokenmeter, budgets off (access log + ledger on)", False,
                        f"http://{HOST}:{tm_port}/v1", tmsvc.proc.pid),
                Gateway("tokenmeter+budgets",
                        "**tokenmeter, budgets on Redis + ledger + access log**", True,
                        f"http://{HOST}:{tmb_port}/v1", tmbsvc.proc.pid, API_KEY)]
    skipped: dict[str, str] = {}
    meta: dict[str, Any] = {"litellm": None}
    if not args.no_litellm:
        gateways += await start_litellm(args, plan, services, workdir, mock_port,
                                        (ll_port, llb_port), skipped, meta, progress)
    await wait_ready(bare, f"http://{HOST}:{bare_port}/v1/models")
    await wait_ready(nginx, f"http://{HOST}:{nginx_port}/v1/models")
    await wait_ready(tmsvc, f"http://{HOST}:{tm_port}/healthz")
    await wait_ready(tmbsvc, f"http://{HOST}:{tmb_port}/healthz")
    return gateways, skipped, redis.proc.pid, meta


async def run(args: argparse.Namespace, plan: Plan, services: Services, workdir: Path,
              t_start: float) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    try:
        return await measure(args, plan, services, workdir, t_start, meta)
    finally:
        if meta.get("litellm_db"):
            with contextlib.suppress(subprocess.SubprocessError):
                services.stop()  # LiteLLM's connections first
                psql(f"DROP DATABASE IF EXISTS {meta['litellm_db']} WITH (FORCE)")


async def measure(  # noqa: PLR0913, PLR0917  the run's services, told where
        args: argparse.Namespace, plan: Plan, services: Services, workdir: Path,
        t_start: float, meta: dict[str, Any]) -> dict[str, Any]:
    def progress(msg: str) -> None:
        print(f"[{time.monotonic() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    gateways, skipped, redis_pid, started = await start_all(args, plan, services, workdir,
                                                            progress)
    meta.update(started)
    progress("up: " + ", ".join(g.name for g in gateways)
             + ("; not run: " + ", ".join(skipped) if skipped else ""))
    samples: dict[str, dict[str, list[Sample]]] = {g.name: {} for g in gateways}
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
        for gw in gateways:
            await run_batch(session, gw, "small", plan.warmup, 0)
            warm = await run_batch(session, gw, "c16", plan.warmup, 0)
            if not warm.ok:
                raise BenchError(f"warm-up: every stream on {gw.name} failed: {warm.errors[:2]}")
        for phase in PHASES:
            total = CONCURRENCY[phase] * plan.per_worker[phase]
            for r in range(plan.rounds[phase]):
                k = r % len(gateways)
                for gw in gateways[k:] + gateways[:k]:
                    s = await run_batch(session, gw, phase, total,
                                        redis_pid if gw.name == "tokenmeter+budgets" else 0)
                    samples[gw.name].setdefault(phase, []).append(s)
                    await asyncio.sleep(0.05)
            progress(f"{phase}: {plan.rounds[phase]} rounds x {total} requests per gateway")
    ensure_alive(*services.items[:1])
    summary = summarize(samples, skipped)
    labels = {g.name: g.label for g in gateways}
    labels |= {"litellm": "LiteLLM, budgets off",
               "litellm+budgets": "LiteLLM, budgets on (Postgres)"} | {
        g.name: g.label for g in gateways if g.name.startswith("litellm")}
    return {
        "meta": {**run_meta(plan.name, t_start), **meta, "nginx": nginx_version(args.nginx),
                 "stream": {"tokens": TOKENS, "tokens_per_second": TOKENS_PER_SECOND,
                            "ttft_ms": TTFT_MS}, "small_tokens": SMALL_TOKENS,
                 "rounds": plan.rounds, "per_worker": plan.per_worker,
                 "concurrency": CONCURRENCY, "labels": labels},
        "summary": summary,
        "errors": {g: [e for ss in p.values() for s in ss for e in s.errors][:5]
                   for g, p in samples.items()},
    }


def governed(summary: dict[str, dict[str, Any]]) -> list[str]:
    """The governed figure: tokenmeter with budgets, ledger and access log on, as a multiple of
    each other gateway's CPU per small request and per stream."""
    tm = summary.get("tokenmeter+budgets", {})
    out = []
    for key, what in (("cpu_ms_small", "a small request"), ("cpu_ms_stream", "a 256-token stream")):
        mine = tm.get(key)
        if mine is None:
            continue
        ratios = [f"{mine / row[key]:.2f}x {name}" for name, row in summary.items()
                  if name not in ("direct", "tokenmeter+budgets") and row.get(key)]
        out.append(f"governed tokenmeter: {mine:.3f} ms of CPU {what} = " + ", ".join(ratios))
    return out


def report(results: dict[str, Any]) -> str:
    meta = results["meta"]
    rounds = "/".join(str(meta["rounds"][p]) for p in PHASES)
    direct = results["summary"].get("direct", {})
    base = ", ".join(
        f"{p} {cell(direct.get(f'ttft_p50_{p}'), '.1f')}/{cell(direct.get(f'ttft_p99_{p}'), '.1f')}"
        for p in ("c1", "c16"))
    lines = [
        f"Gateways side by side ({meta['plan']}): {meta['cpus']} CPUs shared with the load "
        "generator, the mock and anything else on the machine; interleaved rounds "
        f"(small/c1/c16/c64: {rounds}). CPU = utime+stime of the gateway's whole process tree "
        "per request (x = ratio to bare); +TTFT = ms added over direct (256-token streams, "
        f"750 tok/s, 20 ms upstream TTFT; direct p50/p99 ms: {base}); tok/s c64 = received by "
        "64 clients together (x = ratio to direct); Redis = redis-server CPU per small "
        "request; errors = requests that failed (HTTP error, 60 s without a byte, or a stream "
        "not whole), left out of the figures.",
        "",
        markdown_table(results["summary"], meta["labels"]),
        "",
        *governed(results["summary"]),
        f"elapsed: {meta['elapsed_s']:.0f}s; JSON: {meta['output']}",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and requests")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--nginx", default=shutil.which("nginx") or "/usr/sbin/nginx")
    parser.add_argument("--redis-server", default=shutil.which("redis-server") or "redis-server")
    parser.add_argument("--no-litellm", action="store_true", help="leave LiteLLM out")
    parser.add_argument("--litellm-venv", type=Path, default=LITELLM_VENV,
                        help=f"venv for {LITELLM_SPEC} (created once, reused)")
    parser.add_argument("--keep-tmp", action="store_true")
    args = parser.parse_args(argv)
    for tool in (args.nginx, args.redis_server):
        if shutil.which(tool) is None:
            parser.error(f"{tool} not found (apt-get install nginx-light redis-server)")
    return execute(args, QUICK if args.quick else FULL, run, report, "tokenmeter-peers-")


if __name__ == "__main__":
    raise SystemExit(main())
