#!/usr/bin/env python3
"""Governed overhead (issue 25): every target of the issue measured in one run, with a verdict.

    .venv/bin/python benchmarks/bench_governed.py            # about 10 minutes
    .venv/bin/python benchmarks/bench_governed.py --quick    # about 2-3 minutes

It prints `target | goal | measured | met?`, then the detail tables, and writes
benchmarks/results/governed-latest.json. tokenmeter runs with its shipped defaults everywhere:
the INFO access log (to a file) and the ledger (SQLite in a temp state dir, rows shipped by its
shipper process) on.

Two halves, one run, their blocks interleaved round by round (every round drives each target
once per workload, the order rotated from round to round, as bench_scaling.py and
bench_peers.py do):

**CPU** (targets 1-3; bench_scaling.py's pieces): wrk (C, one thread, 16 keep-alive
connections) against a static nginx upstream that answers byte for byte what the mock does: an
8-token chat completion (small) and a 256-token stream sent in one go, so its events reach the
hop coalesced (stream). Targets: `direct` (wrk -> upstream), `bare` (benchmarks/bare_proxy.py),
`nginx` (pass-through, 1 worker), `tm` (`tokenmeter serve --upstream URL`: one serving process
and its ledger shipper), `tm-2` (the same with `--workers 2`: supervisor, 2 workers, one
shipper), `tm+budgets` (`tokenmeter serve --config`, one process: one user with one key and a
day's token window and a minute's token and request windows, limits that never refuse, the
budget store a private redis-server; small requests only). CPU is utime + stime from /proc
summed over the target's process group (every process tokenmeter runs), read around each block:
CPU per request = CPU / requests answered; the serving processes' share (the one process, or
the two workers), the shipper's and the supervisor's are given apart; redis-server's CPU per
request for `tm+budgets`. Figures are medians over the rounds' blocks.

**Paced** (targets 4-5; bench_peers.py's pieces): the aiohttp client in this process against
`tokenmeter mock-upstream` (256-token streams at 750 tokens/s after a 20 ms TTFT, so a read
holds about one event), at concurrency 16 (TTFT p50/p99; added = minus direct's) and 64
(tokens/s received by all clients while all 64 are busy). Gateways: `direct` (client -> mock),
`nginx-2` (pass-through, `worker_processes 2`), `bare` (benchmarks/bare_proxy.py: what an aiohttp
pass-through adds with no code of ours, the floor target 4 is read against), `tm` (one process)
and `tm-2` (`--workers 2`).
Target 5 compares `tm-2` with `nginx-2`: the same number of serving processes, the fair match
(a second nginx worker can only raise the bar tokenmeter is held to, never lower it).

**The cores.** Nothing is pinned (no taskset): the load generator (wrk, or this process's
aiohttp client), the upstream (static nginx, or the mock: one Python process), the gateway
and whatever else runs on the machine share both cores under the kernel's scheduler, the same
way for every target. Pinning the load and the upstream to one core would leave one core to a
two-worker gateway and measure the pinning, not the gateway. So the run reports where the
cores went instead: at concurrency 64 the cores used by the gateway, the client and the mock
during each gateway's batches (detail table), and the direct path's tokens/s is the ceiling of
client + mock alone. If nginx-2 reaches that ceiling, the client or the mock, not nginx, was
the limit, and the ratio says only that tokenmeter kept up with it. CPU per request is the cost
regardless of sharing; throughput is what two shared cores give. Read ratios within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

# benchmarks/ is not a package: make its siblings importable however this file is started.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_peers import (
    API_KEY,
    CONCURRENCY,
    HERE,
    HOST,
    ROOT,
    Gateway,
    Sample,
    cell,
    envs,
    run_batch,
    summarize,
    tokenmeter_budget_config,
    tree_cpu,
)
from bench_proxy import (
    BenchError,
    Service,
    Services,
    ensure_alive,
    execute,
    free_ports,
    nginx_version,
    run_meta,
    tokenmeter_argv,
    wait_ready,
)
from bench_scaling import (
    PASS_SERVER,
    WORKLOADS,
    Target,
    block_line,
    drive,
    medians,
    nginx_conf,
    run_wrk,
    static_conf,
    wrk_script,
)
from procs import wait_port

DEFAULT_OUTPUT = ROOT / "benchmarks" / "results" / "governed-latest.json"
PACED_PHASES = ("c16", "c64")
TOKENMETER = ("tm", "tm-2", "tm+budgets")
SUPERVISED = ("tm-2",)
LABELS = {
    "direct": "direct (load generator -> upstream)",
    "bare": "bare aiohttp pass-through",
    "nginx": "nginx, 1 worker",
    "nginx-2": "nginx, 2 workers",
    "tm": "tokenmeter, 1 process",
    "tm-2": "tokenmeter --workers 2",
    "tm+budgets": "tokenmeter, budgets on Redis",
}


@dataclass(frozen=True)
class Plan:
    name: str
    rounds: int
    wrk_s: float  # per CPU target per workload per round
    connections: int  # wrk's
    per_client: dict[str, int]  # paced streams per client per batch, by phase
    warmup: int  # paced streams per gateway before the first round


# c64: 4 streams per client give about a second in which all 64 are busy (the tokens/s window).
FULL = Plan("full", rounds=5, wrk_s=6.0, connections=16, per_client={"c16": 6, "c64": 4},
            warmup=16)
QUICK = Plan("quick", rounds=2, wrk_s=3.0, connections=16, per_client={"c16": 3, "c64": 2},
             warmup=8)


# --------------------------------------------------------------------------------------------
# Verdict (pure: tests/benchmarks/test_bench_governed.py)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# A goal: (comparison, limit, unit); None for a figure the issue asks to be reported only.
Goal = tuple[str, float, str] | None
COMPARE: dict[str, Callable[[float, float], bool]] = {
    "<=": lambda v, lim: v <= lim, "<": lambda v, lim: v < lim, ">=": lambda v, lim: v >= lim}


def verdict(cpu: dict[str, dict[str, dict[str, float]]], paced: dict[str, dict[str, Any]]
            ) -> list[dict[str, Any]]:
    """One row per issue-25 target (and per figure it asks to be reported): what, the goal,
    the value, a readable measurement and whether it is met (None: reported, no goal). A target
    whose requests failed is not met, whatever its figure."""
    rows: list[dict[str, Any]] = []

    def add(target: str, goal: Goal, value: float | None, measured: str,
            failed: float = 0) -> None:
        met = None
        if goal is not None:
            met = value is not None and COMPARE[goal[0]](value, goal[1]) and not failed
        if failed:
            measured += f"; {failed:g} failed"
        rows.append({"target": target,
                     "goal": "reported" if goal is None else f"{goal[0]} {goal[1]:g}{goal[2]}",
                     "value": value, "measured": measured if value is not None else
                     "not measured", "met": met})

    for w, what, limit in (("small", "small request", 2.0),
                           ("stream", "coalesced 256-tok stream", 1.5)):
        bare, tm = cpu.get(w, {}).get("bare", {}), cpu.get(w, {}).get("tm", {})
        x = _ratio(tm.get("cpu_ms"), bare.get("cpu_ms"))
        add(f"CPU per {what}, all tokenmeter processes, x bare", ("<=", limit, "x"), x,
            f"{x:.2f}x ({tm['cpu_ms']:.3f} vs {bare['cpu_ms']:.3f} ms)" if x is not None else "",
            tm.get("bad", 0) + bare.get("bad", 0))
        xs = _ratio(tm.get("serving_cpu_ms"), bare.get("cpu_ms"))
        add("  of which the serving process, x bare", None, xs,
            f"{xs:.2f}x ({tm['serving_cpu_ms']:.3f} ms; shipper {tm['shipper_cpu_ms']:.3f})"
            if xs is not None else "")
    bare, tmb = cpu.get("small", {}).get("bare", {}), cpu.get("small", {}).get("tm+budgets", {})
    x = _ratio(tmb.get("cpu_ms"), bare.get("cpu_ms"))
    add("CPU per small request, budgets on Redis (day + minute windows), x bare",
        ("<=", 2.5, "x"), x,
        f"{x:.2f}x ({tmb['cpu_ms']:.3f} vs {bare['cpu_ms']:.3f} ms; serving "
        f"{tmb['serving_cpu_ms']:.3f})" if x is not None else "",
        tmb.get("bad", 0) + bare.get("bad", 0))
    redis = tmb.get("redis_cpu_ms")
    add("  redis-server CPU per budgeted request", None, redis,
        f"{redis:.3f} ms" if redis is not None else "")
    tm = paced.get("tm", {})
    errors = tm.get("c16_errors", 0) + paced.get("direct", {}).get("c16_errors", 0)
    for q, limit in (("p50", 1.0), ("p99", 5.0)):
        v = tm.get(f"added_ttft_{q}_c16")
        add(f"added TTFT {q} at concurrency 16 (tokenmeter, 1 process)", ("<", limit, " ms"), v,
            f"{v:+.2f} ms ({tm[f'ttft_{q}_c16']:.2f} vs direct "
            f"{paced['direct'][f'ttft_{q}_c16']:.2f})" if v is not None else "", errors)
        b = paced.get("bare", {}).get(f"added_ttft_{q}_c16")
        add("  the same for the bare aiohttp pass-through (the framework's floor)", None, b,
            f"{b:+.2f} ms" if b is not None else "")
    tm2, ngx = paced.get("tm-2", {}), paced.get("nginx-2", {})
    x = _ratio(tm2.get("tokens_per_s_c64"), ngx.get("tokens_per_s_c64"))
    add("tokens/s at concurrency 64, --workers 2, x nginx (2 workers)", (">=", 0.95, "x"), x,
        f"{x:.2f}x ({tm2['tokens_per_s_c64']:.0f} vs {ngx['tokens_per_s_c64']:.0f} tok/s)"
        if x is not None else "", tm2.get("c64_errors", 0) + ngx.get("c64_errors", 0))
    return rows


def verdict_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| target | goal | measured | met? |", "| --- | --- | --- | --- |"]
    for r in rows:
        met = "-" if r["met"] is None else ("yes" if r["met"] else "**no**")
        lines.append(f"| {r['target']} | {r['goal']} | {r['measured']} | {met} |")
    return "\n".join(lines)


def cpu_table(cpu: dict[str, dict[str, dict[str, float]]]) -> str:
    """Per CPU target: requests/s and CPU ms per request (x bare) for both workloads, the
    tokenmeter parts (serving / shipper / supervisor, ms per request), Redis, failures."""
    head = ("target", "small req/s", "CPU ms/small", "serving/shipper/supervisor",
            "streams/s", "CPU ms/stream", "serving/shipper/supervisor", "Redis ms/req",
            "wrk ms/req", "failed")
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    names = list(dict.fromkeys([*cpu.get("small", {}), *cpu.get("stream", {})]))
    for name in names:
        cells = [LABELS.get(name, name)]
        failed = 0.0
        for w in WORKLOADS:
            s, bare = cpu.get(w, {}).get(name), cpu.get(w, {}).get("bare", {})
            if s is None:
                cells += ["", "", ""]
                continue
            failed += s["bad"]
            cells.append(f"{s['per_s']:.0f}")
            cells.append("-" if name == "direct" else
                         cell(s["cpu_ms"], ".3f", _ratio(s["cpu_ms"], bare.get("cpu_ms"))))
            parts = ""
            if name in TOKENMETER:
                sup = max(0.0, s["cpu_ms"] - s["serving_cpu_ms"] - s["shipper_cpu_ms"])
                parts = (f"{s['serving_cpu_ms']:.3f} / {s['shipper_cpu_ms']:.3f} / "
                         + (f"{sup:.3f}" if name in SUPERVISED else "-"))
            cells.append(parts)
        redis = cpu.get("small", {}).get(name, {}).get("redis_cpu_ms")
        cells.append(cell(redis, ".3f"))
        cells.append(cell(cpu.get("small", {}).get(name, {}).get("wrk_cpu_ms"), ".3f"))
        cells.append(f"{failed:g}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def paced_table(paced: dict[str, dict[str, Any]]) -> str:
    """Per paced gateway: TTFT at c16 (and added over direct), CPU per paced stream at c16,
    tokens/s at c64 (x nginx-2, x direct) and the cores the gateway, the client and the mock
    used during its c64 batches."""
    head = ("gateway", "TTFT p50 c16", "+p50", "TTFT p99 c16", "+p99", "CPU ms/stream c16",
            "tok/s c64", "x nginx-2", "x direct", "cores c64: gateway/client/mock", "errors")
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    ngx = paced.get("nginx-2", {}).get("tokens_per_s_c64")
    for name, row in paced.items():
        tps = row.get("tokens_per_s_c64")
        cores = "/".join(cell(row.get(f"{k}_cores_c64"), ".2f")
                         for k in ("gateway", "client", "mock"))
        errors = sum(v for k, v in row.items() if k.endswith("_errors"))
        lines.append("| " + " | ".join([
            LABELS.get(name, name), cell(row.get("ttft_p50_c16"), ".2f"),
            cell(row.get("added_ttft_p50_c16"), "+.2f"), cell(row.get("ttft_p99_c16"), ".2f"),
            cell(row.get("added_ttft_p99_c16"), "+.2f"), cell(row.get("cpu_ms_stream"), ".2f"),
            cell(tps, ".0f"), cell(_ratio(tps, ngx), ".2f"),
            cell(row.get("tokens_per_s_c64_x_direct"), ".2f"), cores, f"{errors:g}"]) + " |")
    return "\n".join(lines)


def report(results: dict[str, Any]) -> str:
    meta = results["meta"]
    return "\n".join([
        f"Governed overhead, issue 25 ({meta['plan']}: {meta['rounds']} rounds, {meta['cpus']} "
        "CPUs shared by load generator, upstream, gateway and anything else on the machine, "
        "nothing pinned). tokenmeter: shipped defaults (access log + ledger on).",
        "",
        verdict_table(results["verdict"]),
        "",
        f"CPU (wrk, {meta['connections']} connections, static nginx upstream, coalesced "
        f"256-token streams; medians of {meta['rounds']} blocks of {meta['wrk_s']:g} s; ms per "
        "request, x = ratio to bare; serving/shipper/supervisor = tokenmeter's processes):",
        "",
        cpu_table(results["cpu"]),
        "",
        "Paced (aiohttp client in the benchmark process, tokenmeter mock-upstream: 256 tokens "
        "at 750 tok/s after 20 ms; TTFT in ms, + = added over direct; tok/s c64 = received by "
        "64 clients while all are busy; cores = CPU seconds / wall seconds over the c64 "
        "batches, ramp-up and -down included):",
        "",
        paced_table(results["paced"]),
        "",
        f"elapsed: {meta['elapsed_s']:.0f}s; JSON: {meta['output']}",
    ])


# --------------------------------------------------------------------------------------------
# Run


@dataclass
class Started:
    cpu_targets: list[Target]
    gateways: list[Gateway]
    static_pid: int
    mock_pid: int
    redis_pid: int
    nginx: str


async def start_all(args: argparse.Namespace, services: Services, workdir: Path) -> Started:
    (static_port, mock_port, redis_port, bare_port, nginx_port, tm_port, tm2_port, tmb_port,
     pn2_port, ptm_port, ptm2_port, pbare_port) = free_ports(12)
    tm = tokenmeter_argv()
    static = services.start("static", [args.nginx, "-c", str(static_conf(
        workdir / "static", static_port)), "-p", str(workdir)])
    mock = services.start("mock", [
        *tm, "mock-upstream", "--host", HOST, "--port", str(mock_port),
        "--tokens-per-second", "750", "--ttft-ms", "20", "--output-tokens", "256"])
    redis = services.start("redis", [args.redis_server, "--port", str(redis_port), "--bind",
                                     HOST, "--save", "", "--appendonly", "no"])
    static_url, mock_url = f"http://{HOST}:{static_port}/v1", f"http://{HOST}:{mock_port}/v1"

    ready: list[tuple[Service, str]] = [(mock, f"{mock_url}/models")]

    def tokenmeter(name: str, port: int, *extra: str) -> int:
        state = {"TOKENMETER_STATE_DIR": str(workdir / f"state-{name}")}
        svc = services.start(name, ["env", *envs(state), *tm, "serve", "--host", HOST,
                                    "--port", str(port), "--log-level", "INFO", *extra])
        ready.append((svc, f"http://{HOST}:{port}/healthz"))
        return svc.proc.pid

    def nginx(name: str, port: int, workers: int, upstream: int) -> int:
        conf = nginx_conf(workdir / name, workers, PASS_SERVER.format(port=port,
                                                                       upstream=upstream))
        return services.start(name, [args.nginx, "-c", str(conf), "-p", str(workdir)]).proc.pid

    wait_port(redis_port)
    tmb_conf = workdir / "tm-budgets.yaml"
    # One user, one key: a day's token window and a minute's token and request windows, all
    # far above what a run sends, so every request reserves and settles on Redis and none is
    # refused.
    tmb_conf.write_text(yaml.safe_dump(tokenmeter_budget_config(static_port, redis_port)))
    cpu_targets = [
        Target("direct", static_port, static.proc.pid),
        Target("bare", bare_port, services.start("bare", [
            sys.executable, str(HERE / "bare_proxy.py"), "--host", HOST, "--port",
            str(bare_port), "--upstream", f"http://{HOST}:{static_port}"]).proc.pid),
        Target("nginx", nginx_port, nginx("nginx", nginx_port, 1, static_port)),
        Target("tm", tm_port, tokenmeter("tm", tm_port, "--upstream", static_url)),
        Target("tm-2", tm2_port, tokenmeter("tm-2", tm2_port, "--upstream", static_url,
                                            "--workers", "2")),
        Target("tm+budgets", tmb_port, tokenmeter("tm+budgets", tmb_port, "--config",
                                                  str(tmb_conf)),
               workloads=("small",), auth=True),
    ]
    gateways = [
        Gateway("direct", LABELS["direct"], False, mock_url, 0),
        Gateway("nginx-2", LABELS["nginx-2"], False, f"http://{HOST}:{pn2_port}/v1",
                nginx("nginx-2", pn2_port, 2, mock_port)),
        # The framework's own floor: what an aiohttp pass-through adds to TTFT with no code
        # of ours in it (target 4 is read against it).
        Gateway("bare", LABELS["bare"], False, f"http://{HOST}:{pbare_port}/v1",
                services.start("paced-bare", [
                    sys.executable, str(HERE / "bare_proxy.py"), "--host", HOST, "--port",
                    str(pbare_port), "--upstream", f"http://{HOST}:{mock_port}"]).proc.pid),
        Gateway("tm", LABELS["tm"], False, f"http://{HOST}:{ptm_port}/v1",
                tokenmeter("paced-tm", ptm_port, "--upstream", mock_url)),
        Gateway("tm-2", LABELS["tm-2"], False, f"http://{HOST}:{ptm2_port}/v1",
                tokenmeter("paced-tm-2", ptm2_port, "--upstream", mock_url, "--workers", "2")),
    ]
    for svc, url in ready:  # tokenmeter answers /healthz once its workers serve
        await wait_ready(svc, url, 60.0)
    for port in (static_port, bare_port, nginx_port, pn2_port, pbare_port):
        await asyncio.to_thread(wait_port, port, 60.0)
    return Started(cpu_targets, gateways, static.proc.pid, mock.proc.pid, redis.proc.pid,
                   nginx_version(args.nginx))


def rotated(items: Sequence[Any], r: int) -> list[Any]:
    k = r % len(items)
    return [*items[k:], *items[:k]]


async def paced_batch(session: aiohttp.ClientSession, gw: Gateway, phase: str, total: int,
                      mock_pid: int) -> tuple[Sample, float, float]:
    """bench_peers' batch, with the CPU seconds this process (the client) and the mock spent."""
    t0, m0 = os.times(), tree_cpu(mock_pid)
    sample = await run_batch(session, gw, phase, total, 0)
    t1 = os.times()
    return sample, (t1.user - t0.user) + (t1.system - t0.system), tree_cpu(mock_pid) - m0


async def one_round(  # noqa: PLR0913, PLR0917  one round of the run, told where
        r: int, args: argparse.Namespace, plan: Plan, st: Started,
        session: aiohttp.ClientSession, scripts: dict[tuple[str, bool], Path],
        samples: dict[str, dict[str, list[Sample]]], shares: dict[str, dict[str, list[float]]],
        progress: Callable[[str], None]) -> None:
    """Every CPU target for each workload, then every paced gateway for each phase, in the
    order rotated by `r`."""
    for w in WORKLOADS:
        for t in rotated(st.cpu_targets, r):
            if w not in t.workloads:
                continue
            s = await asyncio.to_thread(
                drive, args.wrk, scripts[(w, t.auth)], t, plan.wrk_s, plan.connections,
                st.static_pid, st.redis_pid if t.name == "tm+budgets" else 0,
                t.name in SUPERVISED)
            t.samples.setdefault(w, []).append(s)
            progress(block_line(f"round {r + 1} {w:6s}", t.name, s))
    for phase in PACED_PHASES:
        total = CONCURRENCY[phase] * plan.per_client[phase]
        for gw in rotated(st.gateways, r):
            sample, client_s, mock_s = await paced_batch(session, gw, phase, total,
                                                         st.mock_pid)
            samples[gw.name].setdefault(phase, []).append(sample)
            if phase == "c64":
                sh = shares[gw.name]
                sh["client"].append(client_s)
                sh["mock"].append(mock_s)
                sh["wall"].append(sample.wall_s)
                sh["gateway"].append(sample.cpu_s)
            await asyncio.sleep(0.05)
        progress(f"round {r + 1} {phase}: {total} streams per gateway")


async def run(args: argparse.Namespace, plan: Plan, services: Services, workdir: Path,
              t_start: float) -> dict[str, Any]:
    def progress(msg: str) -> None:
        print(f"[{time.monotonic() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    st = await start_all(args, services, workdir)
    progress("up: CPU targets " + ", ".join(t.name for t in st.cpu_targets) + "; paced "
             + ", ".join(g.name for g in st.gateways))
    scripts = {(w, a): wrk_script(workdir, w, API_KEY if a else None)
               for w in WORKLOADS for a in (False, True)}
    for t in st.cpu_targets:  # imports, pools, the tokenizer, nginx's upstream keepalive
        for w in t.workloads:
            await asyncio.to_thread(run_wrk, args.wrk, scripts[(w, t.auth)], t.port, 1, 4)
    samples: dict[str, dict[str, list[Sample]]] = {g.name: {} for g in st.gateways}
    shares: dict[str, dict[str, list[float]]] = {
        g.name: {"gateway": [], "client": [], "mock": [], "wall": []} for g in st.gateways}
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
        for gw in st.gateways:
            warm = await run_batch(session, gw, "c16", plan.warmup, 0)
            if not warm.ok:
                raise BenchError(f"warm-up: every stream on {gw.name} failed: {warm.errors[:2]}")
        progress("warmed up")
        for r in range(plan.rounds):
            await one_round(r, args, plan, st, session, scripts, samples, shares, progress)
    ensure_alive(*services.items)
    cpu = medians(st.cpu_targets)
    for t in st.cpu_targets:  # a failure in any block counts, not the median block's
        for w, ss in t.samples.items():
            cpu[w][t.name]["bad"] = sum(s["bad"] for s in ss)
    paced = summarize(samples, {})
    for name, sh in shares.items():
        wall = sum(sh["wall"])
        for k in ("gateway", "client", "mock"):
            paced[name][f"{k}_cores_c64"] = (sum(sh[k]) / wall
                                              if wall and (k != "gateway" or name != "direct")
                                              else None)
    return {
        "meta": {**run_meta(plan.name, t_start), "nginx": st.nginx, "rounds": plan.rounds,
                 "wrk_s": plan.wrk_s, "connections": plan.connections,
                 "paced_streams_per_client": plan.per_client, "labels": LABELS,
                 "pinning": "none: every process floats over all cores"},
        "verdict": verdict(cpu, paced),
        "cpu": cpu,
        "paced": paced,
        "samples": {"cpu": {t.name: t.samples for t in st.cpu_targets}},
        "errors": {g: [e for ss in p.values() for s in ss for e in s.errors][:5]
                   for g, p in samples.items()},
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds, shorter blocks")
    parser.add_argument("--rounds", type=int, default=None, help="override the plan's rounds")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--nginx", default=shutil.which("nginx") or "/usr/sbin/nginx")
    parser.add_argument("--wrk", default=shutil.which("wrk") or "wrk")
    parser.add_argument("--redis-server", default=shutil.which("redis-server") or "redis-server")
    parser.add_argument("--keep-tmp", action="store_true")
    args = parser.parse_args(argv)
    for tool in (args.nginx, args.wrk, args.redis_server):
        if shutil.which(tool) is None:
            parser.error(f"{tool} not found (apt-get install nginx-light wrk redis-server)")
    plan = QUICK if args.quick else FULL
    if args.rounds is not None:
        plan = Plan(plan.name, args.rounds, plan.wrk_s, plan.connections, plan.per_client,
                    plan.warmup)
    return execute(args, plan, run, report, "tokenmeter-governed-")


if __name__ == "__main__":
    raise SystemExit(main())
