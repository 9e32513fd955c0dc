#!/usr/bin/env python3
"""Added TTFT as two clients see it: NVIDIA AIPerf 0.13 and `tokenmeter bench`, direct and
through the proxy, interleaved in one run.

    .venv/bin/python benchmarks/bench_aiperf.py [--rounds 3] [--requests 200]

Starts on free 127.0.0.1 ports the paced mock (`mock-upstream --tokens-per-second 750 --ttft-ms
50`, 64-token streams) and `tokenmeter serve --upstream`. Each round runs four blocks of
`--requests` streams at concurrency 4: AIPerf direct, AIPerf proxy, bench direct, bench proxy,
the order of each pair swapped every other round (A B B A), so that a drift of the shared
machine's speed hits both paths alike. Added TTFT = proxy minus direct of the adjacent blocks
(p50 minus p50, p99 minus p99); the report gives each round's figure and their median.

AIPerf runs from its own venv (default /tmp/aiperf-venv, created with `pip install
'aiperf==0.13.*'` when missing: not a project dependency, and not run in CI). Offline it needs
tiktoken's o200k_base file: the one `bpe_openai` ships is unpacked into a cache dir under the
name tiktoken looks for. AIPerf's per-request TTFTs come from its `profile_export.jsonl`; the
first `--skip` of each block are dropped (AIPerf has no warm-up by default, so its first
requests open connections). The bench's come from its JSON (it warms up itself).

Both clients define TTFT alike: from just before the request is handed to aiohttp to the first
network read holding a non-empty content delta (AIPerf: `content_responses[0]`; the role-only
first chunk, content "", counts for neither). Both keep connections alive (AIPerf's default
`--connection-reuse-strategy pooled`). AIPerf costs ~48 ms of CPU a request (~1.3 cores at
concurrency 4) against ~0.1 core for the bench: on a 2-core box it competes with the proxy it
measures, which shows as a worse AIPerf tail through the proxy; see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from procs import free_port, wait_port

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
TIKTOKEN_NAME = "fb374d419588a4632f3f557e76b4b70aebbca790"  # sha1 of the o200k_base URL


@dataclass(frozen=True)
class Block:
    client: str  # "aiperf" or "bench"
    path: str  # "direct" or "proxy"
    p50_ms: float
    p99_ms: float
    n: int


def ensure_aiperf(venv: Path) -> Path:
    exe = venv / "bin" / "aiperf"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "aiperf==0.13.*"],
                       check=True)
    return exe


def tiktoken_cache(directory: Path) -> Path:
    target = directory / TIKTOKEN_NAME
    if not target.exists():
        spec = importlib.util.find_spec("bpe_openai")
        assert spec is not None and spec.origin is not None, "bpe_openai is not installed"
        src = Path(spec.origin).parent / "data" / "o200k_base.tiktoken.gz"
        directory.mkdir(parents=True, exist_ok=True)
        target.write_bytes(gzip.decompress(src.read_bytes()))
    return directory


def start(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    # tokenmeter's state (ledger, spools) beside the log, never in the user's state directory.
    env = {**os.environ, "TOKENMETER_STATE_DIR": str(log.with_suffix(".state"))}
    with log.open("wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def run_aiperf(  # noqa: PLR0913, PLR0917  one aiperf run: each argument is one of its flags
    exe: Path, cache: Path, port: int, requests: int, skip: int, out: Path, path: str,
) -> Block:
    env = dict(os.environ, TIKTOKEN_CACHE_DIR=str(cache))
    argv = [str(exe), "profile", "--model", "mock-gpt", "--url", f"http://127.0.0.1:{port}",
            "--endpoint-type", "chat", "--streaming", "--concurrency", "4",
            "--request-count", str(requests + skip), "--tokenizer", "o200k_base",
            "--ui-type", "none", "--artifact-dir", str(out), "--export-level", "records"]
    with (out.parent / (out.name + ".log")).open("wb") as log:
        subprocess.run(argv, env=env, stdout=log, stderr=subprocess.STDOUT, check=True,
                       timeout=600)
    rows = [json.loads(line) for line in (out / "profile_export.jsonl").read_text().splitlines()]
    rows.sort(key=lambda r: r["metadata"]["request_start_ns"])
    ttft = [r["metrics"]["time_to_first_token"]["value"] for r in rows[skip:]
            if "time_to_first_token" in r.get("metrics", {})]
    return Block("aiperf", path, statistics.median(ttft), pct(ttft, 0.99), len(ttft))


def run_bench(port: int, requests: int, out: Path, path: str) -> Block:
    argv = [str(VENV_BIN / "tokenmeter"), "bench", "--base-url", f"http://127.0.0.1:{port}/v1",
            "--model", "mock-gpt", "--concurrency", "4", "--requests", str(requests),
            "--warmup", "8", "--no-progress", "--json", str(out)]
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, check=True,
                   timeout=600)
    level = json.loads(out.read_text())["levels"][0]
    return Block("bench", path, level["ttft"]["p50"] * 1000, level["ttft"]["p99"] * 1000,
                 level["ok"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=200, help="measured per block")
    parser.add_argument("--skip", type=int, default=20, help="AIPerf's first N per block")
    parser.add_argument("--aiperf-venv", type=Path, default=Path("/tmp/aiperf-venv"))
    parser.add_argument("--output", type=Path,
                        default=ROOT / "benchmarks" / "results" / "aiperf-latest.json")
    args = parser.parse_args()
    exe = ensure_aiperf(args.aiperf_venv)
    tmp = Path(tempfile.mkdtemp(prefix="bench-aiperf-"))
    cache = tiktoken_cache(tmp / "tiktoken")
    mock_port, proxy_port = free_port(), free_port()
    tm = str(VENV_BIN / "tokenmeter")
    procs = [start([tm, "mock-upstream", "--port", str(mock_port), "--tokens-per-second", "750",
                    "--ttft-ms", "50"], tmp / "mock.log")]
    try:
        wait_port(mock_port)
        procs.append(start([tm, "serve", "--port", str(proxy_port), "--log-level", "WARNING",
                            "--upstream", f"http://127.0.0.1:{mock_port}/v1"], tmp / "proxy.log"))
        wait_port(proxy_port)
        ports = {"direct": mock_port, "proxy": proxy_port}
        blocks: list[list[Block]] = []
        for r in range(args.rounds):
            order = ["direct", "proxy"] if r % 2 == 0 else ["proxy", "direct"]
            round_blocks: list[Block] = []
            for client in ("aiperf", "bench"):
                for path in order:
                    out = tmp / f"{client}-{path}-{r}"
                    if client == "aiperf":
                        b = run_aiperf(exe, cache, ports[path], args.requests, args.skip, out, path)
                    else:
                        b = run_bench(ports[path], args.requests, out.with_suffix(".json"), path)
                    print(f"round {r + 1} {client:6s} {path:6s} TTFT p50 {b.p50_ms:6.2f} ms  "
                          f"p99 {b.p99_ms:6.2f} ms  (n={b.n})", flush=True)
                    round_blocks.append(b)
            blocks.append(round_blocks)
    finally:
        for p in reversed(procs):
            stop(p)
    summary: dict[str, Any] = {}
    print("\nadded TTFT (proxy - direct, adjacent blocks), per round and median:")
    for client in ("aiperf", "bench"):
        p50s, p99s = [], []
        for rb in blocks:
            by = {b.path: b for b in rb if b.client == client}
            p50s.append(by["proxy"].p50_ms - by["direct"].p50_ms)
            p99s.append(by["proxy"].p99_ms - by["direct"].p99_ms)
        summary[client] = {"added_p50_ms": p50s, "added_p99_ms": p99s,
                           "median_added_p50_ms": statistics.median(p50s),
                           "median_added_p99_ms": statistics.median(p99s)}
        print(f"  {client:6s} p50 {' '.join(f'{x:+.2f}' for x in p50s)}  median "
              f"{statistics.median(p50s):+.2f} ms | p99 {' '.join(f'{x:+.2f}' for x in p99s)}  "
              f"median {statistics.median(p99s):+.2f} ms")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rounds": args.rounds, "requests_per_block": args.requests,
        "blocks": [[b.__dict__ for b in rb] for rb in blocks], "added": summary,
    }, indent=1) + "\n")
    print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
