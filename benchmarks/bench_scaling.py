#!/usr/bin/env python3
"""Scaling curve: requests/s and streams/s of tokenmeter with 1 and 2 workers, nginx with 1 and 2
worker processes and the bare aiohttp pass-through, in one run, with CPU per request of each.

    .venv/bin/python benchmarks/bench_scaling.py [--seconds 6] [--rounds 2] [--connections 16]

The upstream is nginx serving two static answers (so it costs next to nothing and is the same for
every hop): a non-streamed chat completion of 8 tokens (355 bytes), and, when the request carries
`x-mock-stream: 1` (every hop forwards it), a 256-token chat stream with its usage chunk and
`[DONE]` (260 SSE events, 69 KB), both byte for byte what `tokenmeter mock-upstream` answers. The
whole stream is one `return`, so its events reach the hop coalesced, many per read: the case
where per-event Python costs most. The load generator is wrk (`apt-get install wrk`: C, one
thread, `--connections` keep-alive connections), far cheaper per request than any hop here; its
own CPU per request is printed too.

Targets, all started at once on free 127.0.0.1 ports and driven one at a time:

| target | command |
| --- | --- |
| `direct` | wrk -> the static upstream: what the load generator and upstream cost alone |
| `bare` | `benchmarks/bare_proxy.py` |
| `nginx-1`, `nginx-2` | nginx pass-through (`worker_processes 1` / `2`, upstream keepalive) |
| `tm-1`, `tm-2` | `tokenmeter serve --upstream URL [--workers 2]` (*) |
| `tm-2-redis` | `tokenmeter serve --workers 2 --config` (**); small requests only |

(*) shipped defaults: INFO access log (to a file), the ledger on (SQLite in a temp state dir).
(**) 8 users with keys and daily token limits, the budget store a private redis-server: the
reserve and settle Lua scripts run on it for every request.

Each round drives every target for `--seconds` per workload (small, stream), the order of the
targets reversed every other round. CPU is utime + stime from /proc summed over the target's
process group (supervisor, workers and the ledger shipper process; nginx master and workers),
read around each block, so CPU per request = CPU / requests answered in the block; for
tokenmeter the serving processes' share (the one process, or the workers) and the shipper's
are given apart too; redis-server's CPU per request is given
for `tm-2-redis`. Throughput on this 2-core VM is shared with the load generator and the
upstream (and whatever else runs on the box): read the CPU per request as the cost, and
requests/s as what two cores give with everything on them. Ratios are to `bare` in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from procs import free_port, wait_port

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
HERE = Path(__file__).resolve().parent
WORKLOADS = ("small", "stream")
USERS = 8

SMALL_BODY = (
    '{"id":"chatcmpl-64214031838f4f6882ea4b9a","object":"chat.completion","created":1796311507,'
    '"model":"mock-gpt","system_fingerprint":"fp_tokenmeter_mock","choices":[{"index":0,'
    '"message":{"role":"assistant","content":" the of and to in is that it","refusal":null,'
    '"annotations":[]},"logprobs":null,"finish_reason":"length"}],"usage":{"prompt_tokens":9,'
    '"completion_tokens":8,"total_tokens":17,"prompt_tokens_details":{"cached_tokens":0},'
    '"completion_tokens_details":{"reasoning_tokens":0}}}'
)
WORDS = ("the", "of", "and", "to", "in", "is", "that", "it")


def stream_body(tokens: int = 256) -> str:
    """The mock's 256-token chat stream with include_usage (words are one token each)."""
    base = ('{"id":"chatcmpl-fb5ffbe0e1b4435fadf3c442","object":"chat.completion.chunk",'
            '"created":1796311507,"model":"mock-gpt","system_fingerprint":"fp_tokenmeter_mock",')

    def event(choices: str, usage: str = "null") -> str:
        return f"data: {base}\"choices\":{choices},\"usage\":{usage}}}\n\n"

    def choice(delta: str, finish: str = "null") -> str:
        return f'[{{"index":0,"delta":{delta},"logprobs":null,"finish_reason":{finish}}}]'

    out = [event(choice('{"role":"assistant","content":""}'))]
    out += [event(choice(f'{{"content":" {WORDS[i % len(WORDS)]}"}}')) for i in range(tokens)]
    out.append(event(choice("{}", '"length"')))
    usage = (f'{{"prompt_tokens":9,"completion_tokens":{tokens},"total_tokens":{tokens + 9},'
             '"prompt_tokens_details":{"cached_tokens":0},'
             '"completion_tokens_details":{"reasoning_tokens":0}}')
    out.append(event("[]", usage))
    out.append("data: [DONE]\n\n")
    return "".join(out)


NGINX_HEAD = """\
daemon off;
master_process on;
worker_processes {workers};
{user}pid {d}/nginx.pid;
lock_file {d}/nginx.lock;
error_log {d}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {d}/client_body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    keepalive_requests 1000000;
    keepalive_timeout 300s;
"""

STATIC_SERVER = """\
    server {{
        listen 127.0.0.1:{port};
        root {d};
        if ($http_x_mock_stream = "1") {{ rewrite ^ /stream.txt last; }}
        rewrite ^ /small.json last;
        # The static module answers GET only: a POST's 405 becomes this file as a 200.
        location = /stream.txt {{
            default_type "text/event-stream; charset=utf-8";
            error_page 405 =200 $uri;
        }}
        location = /small.json {{
            default_type application/json;
            error_page 405 =200 $uri;
        }}
    }}
}}
"""

PASS_SERVER = """\
    upstream origin {{
        server 127.0.0.1:{upstream};
        keepalive 256;
        keepalive_requests 1000000;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://origin;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 60s;
        }}
    }}
}}
"""


def nginx_conf(d: Path, workers: int, server: str) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    user = "user root;\n" if os.geteuid() == 0 else ""
    conf = d / "nginx.conf"
    conf.write_text(NGINX_HEAD.format(workers=workers, user=user, d=d) + server)
    return conf


def static_conf(d: Path, port: int) -> Path:
    """The static upstream in directory `d` (its two answers and an nginx.conf, one worker,
    listening on `port`); returns the conf's path."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "stream.txt").write_text(stream_body())
    (d / "small.json").write_text(SMALL_BODY)
    return nginx_conf(d, 1, STATIC_SERVER.format(port=port, d=d))


def group_cpu_s(pgid: int) -> float:
    """utime + stime of every live process in process group `pgid` (supervisor and workers).
    Children that exited are counted in their parent's cutime; none should exit mid-run."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2:].split()
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def group_cpu_parts(pgid: int, supervisor: bool) -> tuple[float, float]:
    """(serving, shipper) CPU seconds in process group `pgid`: the processes that serve
    requests (the one process, or the workers: not the supervisor, the group's leader), and
    the ledger shipper process (proxy.ledger.shipper_process)."""
    serving = shipper = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2:].split()
        if int(fields[2]) != pgid:
            continue
        ticks = int(fields[11]) + int(fields[12])
        if b"proxy.ledger.shipper_process" in cmdline:
            shipper += ticks
        elif not (supervisor and int(entry) == pgid):
            serving += ticks
    tck = os.sysconf("SC_CLK_TCK")
    return serving / tck, shipper / tck


def group_size(pgid: int) -> int:
    n = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                raw = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            n += int(raw[raw.rindex(")") + 2:].split()[2]) == pgid
    return n


@dataclass
class Target:
    name: str
    port: int
    pgid: int
    workloads: tuple[str, ...] = WORKLOADS
    auth: bool = False
    samples: dict[str, list[dict[str, float]]] = field(default_factory=dict)


class Procs:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None,
              cwd: Path | None = None) -> int:
        with (self.tmp / f"{name}.log").open("wb") as log:
            p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True, env=env, cwd=cwd)
        self.procs.append(p)
        return p.pid

    def stop_all(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)


def wrk_script(tmp: Path, workload: str, key: str | None) -> Path:
    path = tmp / f"wrk-{workload}-{'auth' if key else 'anon'}.lua"
    body: dict[str, Any] = {"model": "mock-gpt",
                            "messages": [{"role": "user", "content": "hi there"}]}
    if workload == "stream":
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    else:
        body["max_tokens"] = 8
    lines = ['wrk.method = "POST"', f"wrk.body = '{json.dumps(body)}'",
             'wrk.headers["Content-Type"] = "application/json"']
    if workload == "stream":
        lines.append('wrk.headers["x-mock-stream"] = "1"')
    if key:
        lines.append(f'wrk.headers["Authorization"] = "Bearer {key}"')
    path.write_text("\n".join(lines) + "\n")
    return path


def run_wrk(wrk: str, script: Path, port: int, seconds: float, connections: int
            ) -> tuple[int, int, float]:
    """(responses, non-2xx or errors, wrk's own CPU seconds)."""
    start = os.times()
    out = subprocess.run(
        [wrk, "-t1", f"-c{connections}", f"-d{seconds:g}s", "-s", str(script),
         f"http://127.0.0.1:{port}/v1/chat/completions"],
        capture_output=True, text=True, timeout=seconds + 60, check=True).stdout
    end = os.times()
    m = re.search(r"(\d+) requests in", out)
    if m is None:
        raise RuntimeError(f"wrk said: {out}")
    bad = sum(int(x) for x in re.findall(r"Non-2xx or 3xx responses: (\d+)", out))
    errs = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if errs:
        bad += sum(int(x) for x in errs.groups())
    wrk_cpu = (end.children_user - start.children_user) + (end.children_system
                                                           - start.children_system)
    return int(m.group(1)), bad, wrk_cpu


def drive(wrk: str, script: Path, t: Target, seconds: float, connections: int,  # noqa: PLR0913, PLR0917
          upstream_pid: int, redis_pid: int = 0, supervisor: bool = False) -> dict[str, float]:
    """One block: wrk against `t` for `seconds`, and around it the CPU of t's process group
    (its serving processes' and ledger shipper's parts apart; `supervisor`: the group's leader
    is a supervisor, counted in the whole but not as serving), of the upstream and of
    redis-server (`redis_pid`, 0 for none), each per request answered."""
    c0 = group_cpu_s(t.pgid)
    p0 = group_cpu_parts(t.pgid, supervisor)
    r0 = group_cpu_s(redis_pid) if redis_pid else 0.0
    u0 = group_cpu_s(upstream_pid)
    t0 = time.monotonic()
    n, bad, wrk_cpu = run_wrk(wrk, script, t.port, seconds, connections)
    time.sleep(0.2)  # settle work after the last byte is counted
    wall = time.monotonic() - t0 - 0.2
    cpu = group_cpu_s(t.pgid) - c0
    p1 = group_cpu_parts(t.pgid, supervisor)
    s = {"requests": n, "bad": bad, "per_s": n / wall,
         "cpu_ms": 1000 * cpu / max(1, n),
         "cores": cpu / wall,
         "wrk_cpu_ms": 1000 * wrk_cpu / max(1, n),
         "upstream_cpu_ms": 1000 * (group_cpu_s(upstream_pid) - u0) / max(1, n),
         "procs": group_size(t.pgid),
         # tokenmeter's parts: the serving processes, the ledger shipper
         "serving_cpu_ms": 1000 * (p1[0] - p0[0]) / max(1, n),
         "shipper_cpu_ms": 1000 * (p1[1] - p0[1]) / max(1, n)}
    if t.pgid == upstream_pid:
        s["cpu_ms"] = 0.0  # direct: the upstream's cost is upstream_cpu_ms
    if redis_pid:
        s["redis_cpu_ms"] = 1000 * (group_cpu_s(redis_pid) - r0) / max(1, n)
    return s


def block_line(head: str, name: str, s: dict[str, float]) -> str:
    """One block's progress line."""
    return (f"{head} {name:10s} {s['per_s']:8.0f}/s  "
            f"cpu {s['cpu_ms']:.3f} ms/req ({s['cores']:.2f} cores)  "
            + (f"serving {s['serving_cpu_ms']:.3f} shipper "
               f"{s['shipper_cpu_ms']:.3f}  " if name.startswith("tm") else "")
            + f"wrk {s['wrk_cpu_ms']:.3f}  upstream {s['upstream_cpu_ms']:.3f}"
            + (f"  redis {s['redis_cpu_ms']:.3f}" if "redis_cpu_ms" in s else "")
            + (f"  BAD {s['bad']}" if s["bad"] else ""))


def medians(targets: list[Target]) -> dict[str, dict[str, dict[str, float]]]:
    """By workload, by target: the median over blocks of every figure."""
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for t in targets:
        for w, ss in t.samples.items():
            summary.setdefault(w, {})[t.name] = {
                k: statistics.median(s[k] for s in ss)
                for k in ss[0] if isinstance(ss[0][k], (int, float))}
    return summary


def main() -> int:  # noqa: PLR0912, PLR0915  a benchmark script's main, read top to bottom
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=6.0, help="per target per block")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--nginx", default=shutil.which("nginx") or "/usr/sbin/nginx")
    parser.add_argument("--wrk", default=shutil.which("wrk") or "wrk")
    parser.add_argument("--redis-server", default=shutil.which("redis-server") or "redis-server")
    parser.add_argument("--no-workers", action="store_true",
                        help="skip the 2-worker targets (a tokenmeter without --workers)")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="another checkout of tokenmeter: its `serve --upstream` runs as "
                             "target tm-1-base (before/after in one run)")
    parser.add_argument("--output", type=Path,
                        default=ROOT / "benchmarks" / "results" / "scaling-latest.json")
    args = parser.parse_args()
    for tool in (args.nginx, args.wrk, args.redis_server):
        if shutil.which(tool) is None:
            parser.error(f"{tool} not found (apt-get install nginx-light wrk redis-server)")
    help_text = subprocess.run([str(VENV_BIN / "tokenmeter"), "serve", "--help"],
                               capture_output=True, text=True, check=True).stdout
    workers = not args.no_workers and "--workers" in help_text
    notes = [] if workers else ["tokenmeter serve has no --workers here: 2-worker targets skipped"]

    tmp = Path(tempfile.mkdtemp(prefix="bench-scaling-"))
    procs = Procs(tmp)
    tm = str(VENV_BIN / "tokenmeter")
    targets: list[Target] = []
    redis_pid = 0
    try:
        up = free_port()
        sconf = static_conf(tmp / "static", up)
        upstream_pid = procs.start("static", [args.nginx, "-c", str(sconf), "-p", str(tmp)])
        wait_port(up)
        upstream_url = f"http://127.0.0.1:{up}/v1"
        targets.append(Target("direct", up, upstream_pid))
        port = free_port()
        targets.append(Target("bare", port, procs.start("bare", [
            sys.executable, str(HERE / "bare_proxy.py"), "--port", str(port),
            "--upstream", f"http://127.0.0.1:{up}"])))
        for n in (1, 2):
            port = free_port()
            conf = nginx_conf(tmp / f"nginx{n}", n, PASS_SERVER.format(port=port, upstream=up))
            targets.append(Target(f"nginx-{n}", port, procs.start(
                f"nginx{n}", [args.nginx, "-c", str(conf), "-p", str(tmp)])))
        for n in (1, 2) if workers else (1,):
            port = free_port()
            env = dict(os.environ, TOKENMETER_STATE_DIR=str(tmp / f"state-tm{n}"))
            argv = [tm, "serve", "--port", str(port), "--upstream", upstream_url]
            if n > 1:
                argv += ["--workers", str(n)]
            targets.append(Target(f"tm-{n}", port, procs.start(f"tm{n}", argv, env)))
        if args.baseline is not None:
            # The same interpreter and venv, the baseline tree's own `proxy` package first:
            # `python -m` puts the working directory ahead of everything, the editable
            # install's finder included, so it runs in the baseline tree.
            port = free_port()
            base = args.baseline.resolve()
            env = dict(os.environ, TOKENMETER_STATE_DIR=str(tmp / "state-base"),
                       PYTHONPATH=str(base))
            targets.append(Target("tm-1-base", port, procs.start("tm-base", [
                sys.executable, "-m", "proxy", "serve", "--port", str(port),
                "--upstream", upstream_url], env, cwd=base)))
        if workers:
            rport, port = free_port(), free_port()
            redis_pid = procs.start("redis", [args.redis_server, "--port", str(rport), "--bind",
                                              "127.0.0.1", "--save", "", "--appendonly", "no"])
            wait_port(rport)
            conf_path = tmp / "tm-redis.yaml"
            conf_path.write_text(yaml.safe_dump({
                "upstreams": {"static": {"base_url": upstream_url}},
                "metrics": {"discover_models": False}, "timezone": "UTC",
                "store": {"url": f"redis://127.0.0.1:{rport}/0"},
                "users": {f"user{i}": {"keys": [f"sk-scale-user{i}-000000000"],
                                       "daily_tokens": 10**12} for i in range(USERS)},
            }))
            env = dict(os.environ, TOKENMETER_STATE_DIR=str(tmp / "state-tmr"))
            targets.append(Target("tm-2-redis", port, procs.start("tmr", [
                tm, "serve", "--port", str(port), "--workers", "2", "--config", str(conf_path)],
                env), workloads=("small",), auth=True))
        for t in targets:
            wait_port(t.port)
        scripts = {(w, a): wrk_script(tmp, w, "sk-scale-user0-000000000" if a else None)
                   for w in WORKLOADS for a in (False, True)}
        # Warm-up: imports, pools, the tokenizer, nginx upstream keepalive.
        for t in targets:
            for w in t.workloads:
                run_wrk(args.wrk, scripts[(w, t.auth)], t.port, 1, 4)
        for r in range(args.rounds):
            order = targets if r % 2 == 0 else list(reversed(targets))
            for w in WORKLOADS:
                for t in order:
                    if w not in t.workloads:
                        continue
                    s = drive(args.wrk, scripts[(w, t.auth)], t, args.seconds,
                              args.connections, upstream_pid,
                              redis_pid if t.name == "tm-2-redis" else 0,
                              supervisor=t.name in ("tm-2", "tm-2-redis"))
                    t.samples.setdefault(w, []).append(s)
                    print(block_line(f"round {r + 1} {w:6s}", t.name, s), flush=True)
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)

    summary = medians(targets)
    print()
    for w in WORKLOADS:
        bare = summary[w]["bare"]
        print(f"{w}: {'target':10s} {'per s':>8s} {'x bare':>7s} {'cpu ms/req':>10s} "
              f"{'x bare':>7s} {'cores':>5s}  serving (x bare) / shipper, ms/req")
        for name, s in summary[w].items():
            pad = " " * (len(w) + 2)
            print(f"{pad}{name:10s} {s['per_s']:8.0f} {s['per_s'] / bare['per_s']:7.2f} "
                  f"{s['cpu_ms']:10.3f} {s['cpu_ms'] / bare['cpu_ms']:7.2f} {s['cores']:5.2f}"
                  + (f"  {s['serving_cpu_ms']:.3f} ({s['serving_cpu_ms'] / bare['cpu_ms']:.2f})"
                     f" / {s['shipper_cpu_ms']:.3f}" if name.startswith("tm") else "")
                  + (f"   redis {s['redis_cpu_ms']:.3f} ms/req" if "redis_cpu_ms" in s else ""))
    for note in notes:
        print("note:", note)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpus": os.cpu_count(), "seconds": args.seconds, "rounds": args.rounds,
        "connections": args.connections, "notes": notes, "summary": summary,
        "samples": {t.name: t.samples for t in targets},
    }, indent=1) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
