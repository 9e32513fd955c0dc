#!/usr/bin/env python3
"""Soak benchmark: minutes of mixed load on two replicas sharing one Redis, nothing may be lost.

    .venv/bin/python benchmarks/bench_soak.py [--duration 300 | --quick]

Starts on free 127.0.0.1 ports a private redis-server, the simulated upstream and two
`tokenmeter serve --config` replicas sharing the Redis budget (users alice with two keys, bob,
and carol whose small daily quota runs out early, so her later requests are 429 refusals). A
cheap aiohttp client then runs closed-loop workers against both replicas in turn for the
duration: chat, completions and responses, streamed (with and without
`stream_options.include_usage`) or not, embeddings, and slices with faults injected by the mock
(`x-mock-*`): resets mid-stream, upstream 500 and 429, a 500 that goes away on retry, garbage
bytes, random chunk cuts, and client disconnects after three content chunks of a 0.5 s stream.
RSS of every process is sampled from /proc all along. At the end it checks, exactly:

1. Reported usage. Three views of the same set of requests must agree token for token:
   C, what the client saw complete, with the usage object it read (JSON `usage`, the usage chunk
   of an include_usage stream, `response.completed`) or, for a stream without include_usage
   (whose usage chunk the proxy strips), derived: the content chunks it counted (each is one
   token: the mock's words are one token each) plus the prompt tokens the mock reported for the
   same prompt in a calibration request; R, the proxy's `tokenmeter_tokens_total{source=
   "reported"}` (input, output) over both replicas; M, the mock's `/_mock/stats`, which sums the
   usage of the responses whose last byte it handed to the socket. Why C = R = M: the proxy
   records `reported` exactly when it read the upstream's usage, and always asks streams for it;
   the mock sends usage only in a response's tail, so a reset, an error status or a disconnect
   leaves no trace in M, and those requests are `estimated` (or zero) in R and not complete in C.
   A client disconnect comes >= 0.4 s before the mock's tail, so the mock cannot have finished
   it; retried attempts that failed sent no usage. So a request in M but not R is usage the
   upstream reported and the proxy lost; in R but not C, usage recorded for an answer the client
   never got whole (or a phantom). Checked per direction, per user, and as request counts (C vs M).
2. Budget counters. `tokenmeter usage --json` (the Redis daily counters) per user equals the
   proxies' recorded tokens, reported + estimated, per user and direction; carol stays within
   her quota. Refusals cost nothing (a refused request settles nothing, so any cost shows here).
3. Requests. `tokenmeter_requests_total` over both replicas equals what the client sent, also
   per HTTP status (a stream cut after its headers is counted with its 200, as the client saw
   it); `tokenmeter_budget_refusals_total` equals the 429 daily_quota_exceeded the client got.
4. Nothing pending or failed: settle backlog, metering errors, store errors and active requests
   are all 0, every service is alive, and no proxy logged at error level.

Memory: RSS start (after the warm-up, the first 10% of the run), end, peak, growth, growth per
10k requests, and a verdict from the second half of the run against the first.
Prints a table, writes benchmarks/results/soak-latest.json, exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import random
import shutil
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_budget import progress_printer, redis_command, redis_version, wait_redis
from bench_proxy import (
    BenchError,
    Service,
    Services,
    execute,
    fmt,
    free_ports,
    process_tree,
    tokenmeter_argv,
    wait_ready,
)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = ROOT / "benchmarks" / "results" / "soak-latest.json"
HOST = "127.0.0.1"
MODEL, EMBED_MODEL = "mock-gpt", "text-embedding-3-small"
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
         "responses": "/v1/responses", "embeddings": "/v1/embeddings"}
# One marker per content token (the mock's words all start with a space; role and finish
# chunks carry "" and do not match); see bench_proxy.py for why the client counts bytes.
MARKS = {"chat": b'"content":" ', "completions": b'"text":" ',
         "responses": b"event: response.output_text.delta\n"}
DONE = b"data: [DONE]\n\n"
TIMEOUT = aiohttp.ClientTimeout(total=30, sock_connect=10, sock_read=15)
PROMPTS = ("Say hi.", "Write a short paragraph about soak tests and memory leaks.",
           "Summarise: " + "the proxy meters every token it relays, " * 12,
           "List three reasons why accounting must be exact, and explain each one briefly.")
KEYS = {"alice": ("sk-soak-alice-000", "sk-soak-alice-ci0"), "bob": ("sk-soak-bob-000",),
        "carol": ("sk-soak-carol-000",)}
CAROL_DAILY = 4000
DISCONNECT_AFTER = 3  # content chunks, of a 400-token stream at 800 tokens/s


@dataclass(frozen=True)
class Kind:
    name: str
    endpoint: str
    weight: int
    stream: bool = False
    include_usage: bool = False  # chat/completions streams; responses streams always end in usage
    fault: str = ""
    user: str = ""  # "": alice (2/3) or bob


KINDS = (
    Kind("chat-stream-usage", "chat", 16, True, True),
    Kind("chat-stream", "chat", 10, True),
    Kind("chat-json", "chat", 8),
    Kind("completions-stream-usage", "completions", 5, True, True),
    Kind("completions-stream", "completions", 4, True),
    Kind("completions-json", "completions", 4),
    Kind("responses-stream", "responses", 8, True),
    Kind("responses-json", "responses", 4),
    Kind("embeddings", "embeddings", 8),
    Kind("fault-reset", "chat", 3, True, True, "reset"),
    Kind("fault-reset-responses", "responses", 1, True, fault="reset"),
    Kind("fault-500", "chat", 2, fault="status500"),
    Kind("fault-429", "chat", 2, True, True, "status429"),
    Kind("fault-500-then-ok", "chat", 2, True, True, "retry_ok"),
    Kind("fault-garbage", "chat", 3, True, False, "garbage"),
    Kind("fault-chunk-cuts", "chat", 3, True, True, "chunks"),
    Kind("fault-chunk-cuts-responses", "responses", 1, True, fault="chunks"),
    Kind("disconnect", "chat", 4, True, True, "disconnect"),
    Kind("disconnect-no-usage", "chat", 1, True, False, "disconnect"),
    Kind("disconnect-responses", "responses", 1, True, fault="disconnect"),
    Kind("budget-carol", "chat", 3, True, True, user="carol"),
)
WEIGHTS = [k.weight for k in KINDS]
FAULTS = {"status500": {"x-mock-status": "500", "x-mock-retry-after-ms": "10"},
          "status429": {"x-mock-status": "429", "x-mock-retry-after-ms": "10"},
          "retry_ok": {"x-mock-status": "500", "x-mock-retry-after-ms": "10",
                       "x-mock-fail-first": "1"}}


def request_for(kind: Kind, rng: random.Random, seq: int, prompt: int | None = None
                ) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(prompt index, JSON body, x-mock-* headers) of one request of this kind."""
    p = rng.randrange(len(PROMPTS)) if prompt is None else prompt
    tokens = 32 if kind.user == "carol" else rng.choice((8, 32, 64, 128, 256))
    tokens = max(tokens, 32) if kind.fault == "reset" else tokens
    tokens, rate = (400, 800) if kind.fault == "disconnect" else (tokens, 3000)
    h = {"x-mock-output-tokens": str(tokens), "x-mock-tokens-per-second": str(rate),
         "x-mock-ttft-ms": "10", **FAULTS.get(kind.fault, {})}
    if kind.fault == "reset":
        h["x-mock-reset-after"] = str(rng.randint(1, tokens - 1))
    elif kind.fault == "retry_ok":
        h["x-mock-scenario"] = f"soak-{seq}"  # fail_first counts per scenario: one per request
    elif kind.fault == "garbage":
        h["x-mock-garbage-after"] = str(rng.randint(0, tokens))
    elif kind.fault == "chunks":
        h["x-mock-chunk-seed"] = str(seq)
    text = PROMPTS[p]
    body: dict[str, Any] = {"model": MODEL}
    if kind.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    elif kind.endpoint == "completions":
        body.update(prompt=text, max_tokens=1024)
    elif kind.endpoint == "responses":
        body["input"] = text
    else:
        body = {"model": EMBED_MODEL, "input": [text, PROMPTS[(p + 1) % len(PROMPTS)]]}
    if kind.stream:
        body["stream"] = True
        if kind.include_usage:
            body["stream_options"] = {"include_usage": True}
    return p, body, h



@dataclass
class Tally:
    """Everything the client saw, aggregated (no per-request list: the client stays flat)."""

    sent: int = 0
    no_response: int = 0  # transport failures before any status: the proxy may not have seen them
    statuses: Counter[str] = field(default_factory=Counter)
    results: dict[str, Counter[str]] = field(default_factory=dict)
    usage: dict[str, list[int]] = field(default_factory=dict)  # user -> [prompt, completion, n]
    refused: int = 0
    anomalies: Counter[str] = field(default_factory=Counter)
    samples: list[str] = field(default_factory=list)
    calib: dict[tuple[str, int], int] = field(default_factory=dict)  # prompt tokens

    def add(self, kind: Kind, user: str, status: int | None, result: str,
            usage: tuple[int, int] | None) -> None:
        self.sent += 1
        self.statuses[str(status)] += 1
        self.no_response += status is None
        self.results.setdefault(kind.name, Counter())[result] += 1
        if usage is not None:
            acc = self.usage.setdefault(user, [0, 0, 0])
            for i, v in enumerate((*usage, 1)):
                acc[i] += v

    def anomaly(self, what: str, detail: str) -> None:
        self.anomalies[what] += 1
        if len(self.samples) < 20:
            self.samples.append(f"{what}: {detail}"[:300])


def _usage_of(obj: Any) -> tuple[int, int]:
    u = obj["usage"] if "usage" in obj else obj["response"]["usage"]
    return (int(u.get("prompt_tokens", u.get("input_tokens", 0))),
            int(u.get("completion_tokens", u.get("output_tokens", 0))))


def stream_usage(kind: Kind, data: bytes) -> tuple[tuple[int, int] | None, int]:
    """(the usage a complete stream showed the client, content tokens counted). Usage is None
    if the stream did not end cleanly, (-1, counted) if it ended without a usage chunk."""
    count = data.count(MARKS[kind.endpoint])
    if kind.endpoint == "responses":
        at = data.rfind(b"event: response.completed\ndata: ")
        if at < 0 or not data.endswith(b"\n\n"):
            return None, count
        return _usage_of(json.loads(data[at:].split(b"\n", 2)[1][6:])), count
    if not data.endswith(DONE):
        return None, count
    for event in reversed(data[: -len(DONE)].split(b"\n\n")[-4:]):
        if event.startswith(b"data: {") and b'"usage":{' in event:
            return _usage_of(json.loads(event[6:])), count
    return (-1, count), count


async def one(session: aiohttp.ClientSession, url: str, key: str, kind: Kind, user: str,
              rng: random.Random, seq: int, tally: Tally, prompt: int | None = None) -> None:
    p, body, headers = request_for(kind, rng, seq, prompt)
    headers.update({"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    status: int | None = None
    usage: tuple[int, int] | None = None
    result = "broken"
    mark = MARKS.get(kind.endpoint, b"")
    try:
        async with session.post(url + PATHS[kind.endpoint], data=json.dumps(body).encode(),
                                headers=headers, timeout=TIMEOUT) as resp:
            status = resp.status
            if status != 200 or not kind.stream:
                raw = await resp.read()
                if status == 429 and b"daily_quota_exceeded" in raw:
                    result = "refused"
                    tally.refused += 1
                elif status != 200:
                    result = f"http_{status}"
                else:
                    usage, result = _usage_of(json.loads(raw)), "complete"
            else:
                parts, seen = [], 0
                async for chunk in resp.content.iter_any():
                    parts.append(chunk)
                    if kind.fault == "disconnect":
                        seen += chunk.count(mark)
                        if seen >= DISCONNECT_AFTER:
                            resp.close()
                            result = "disconnected"
                            break
                if result != "disconnected":
                    usage, counted = stream_usage(kind, b"".join(parts))
                    result = "broken" if usage is None else "complete"
                    if usage is not None and kind.endpoint != "responses" and (
                            (usage[0] == -1) == kind.include_usage):
                        tally.anomaly("usage_chunk_" + ("missing" if kind.include_usage
                                                        else "leaked"), kind.name)
                    if usage is not None and usage[1] != counted:
                        tally.anomaly("completion_tokens_differ",
                                      f"{kind.name}: usage {usage[1]}, counted {counted}")
    except (aiohttp.ClientError, TimeoutError) as exc:
        result = "broken" if status is not None else "no_response"
        if status is None:
            tally.anomaly("no_response", f"{kind.name}: {type(exc).__name__}: {exc}")
    except (ValueError, KeyError, IndexError) as exc:
        tally.anomaly("unparsable", f"{kind.name}: {type(exc).__name__}: {exc}")
    if usage is not None and kind.endpoint != "embeddings":
        calib = tally.calib.get((kind.endpoint, p))
        if kind.name == "calibration":
            tally.calib[(kind.endpoint, p)] = usage[0]
        elif usage[0] == -1:  # a stream without include_usage: derive its usage
            if calib is None:
                tally.anomaly("uncalibrated", f"{kind.endpoint} prompt {p}")
            usage = (calib or 0, usage[1])
        elif calib is not None and usage[0] != calib:
            tally.anomaly("prompt_tokens_differ", f"{kind.name}: {usage[0]} != {calib}")
    tally.add(kind, user, status, result, usage)


async def load(session: aiohttp.ClientSession, urls: list[str], tally: Tally, stop_at: float,
               concurrency: int, seed: int) -> None:
    seq = itertools.count()

    async def worker(w: int) -> None:
        rng = random.Random(seed * 1000 + w)
        while time.monotonic() < stop_at:
            n = next(seq)
            kind = rng.choices(KINDS, WEIGHTS)[0]
            user = kind.user or rng.choice(("alice", "alice", "bob"))
            await one(session, urls[n % len(urls)], rng.choice(KEYS[user]), kind, user, rng, n,
                      tally)

    await asyncio.gather(*(worker(i) for i in range(concurrency)))



def series(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [(s.labels, s.value) for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == name]


def msum(texts: list[str], name: str, **match: str | tuple[str, ...]) -> int:
    total = 0.0
    for text in texts:
        for labels, value in series(text, name):
            if all(labels.get(k) in ((v,) if isinstance(v, str) else v) for k, v in match.items()):
                total += value
    return round(total)


def by_label(texts: list[str], name: str, label: str) -> dict[str, int]:
    out: Counter[str] = Counter()
    for text in texts:
        for labels, value in series(text, name):
            out[labels[label]] += round(value)
    return {k: n for k, n in sorted(out.items()) if n}


def rss_mb(pid: int) -> float:
    kb = 0
    for p in process_tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    kb += int(line.split()[1])
        except (FileNotFoundError, ProcessLookupError):
            pass
    return kb / 1024


async def sample_memory(pids: dict[str, int], tally: Tally, out: list[dict[str, Any]],
                        interval: float, t0: float) -> None:
    while True:
        out.append({"t": round(time.monotonic() - t0, 1), "requests": tally.sent,
                    **{n: round(rss_mb(p), 2) for n, p in pids.items()}})
        await asyncio.sleep(interval)


def memory_summary(samples: list[dict[str, Any]], names: list[str], warm_t: float
                   ) -> dict[str, Any]:
    run = [s for s in samples if s["t"] >= warm_t] or samples[-1:]
    mid_i = min(range(len(run)), key=lambda i: abs(run[i]["t"] - (run[0]["t"] + run[-1]["t"]) / 2))

    def at(i: int, n: str) -> float:  # median of the sample and its neighbours: less noise
        return float(statistics.median(s[n] for s in run[max(0, i - 1): i + 2]))

    reqs = max(1, run[-1]["requests"] - run[0]["requests"])
    reqs2 = max(1, run[-1]["requests"] - run[mid_i]["requests"])
    out: dict[str, Any] = {}
    for n in names:
        start, mid, end = at(0, n), at(mid_i, n), at(len(run) - 1, n)
        first, second = mid - start, end - mid
        out[n] = {
            "start_mb": round(start, 2), "end_mb": round(end, 2),
            "peak_mb": round(max(s[n] for s in samples), 2),
            "growth_mb": round(end - start, 2),
            "growth_mb_per_10k_requests": round((end - start) / reqs * 1e4, 3),
            "first_half_mb": round(first, 2), "second_half_mb": round(second, 2),
            "second_half_mb_per_10k_requests": round(second / reqs2 * 1e4, 3),
            "verdict": "growing" if second > max(2.0, 0.5 * first) else "flat",
        }
    return out


async def tokenmeter_usage(conf: Path, days: list[str]) -> dict[str, dict[str, int]]:
    """Per user, the Redis daily counters summed over the days the run touched."""
    out: dict[str, dict[str, int]] = {}
    for day in days:
        proc = await asyncio.create_subprocess_exec(
            *tokenmeter_argv(), "usage", "--config", str(conf), "--json", "--date", day,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        stdout, stderr = await asyncio.wait_for(proc.communicate(), 60)
        if proc.returncode != 0:
            raise BenchError(f"tokenmeter usage failed ({proc.returncode}): {stderr.decode()}")
        for row in json.loads(stdout):
            acc = out.setdefault(row["user"], {"tokens": 0, "input": 0, "output": 0})
            for name, col in (("tokens", "tokens"), ("input", "input_tokens"),
                              ("output", "output_tokens")):
                acc[name] += row[col]
    return out



def check(name: str, ok: bool, **figures: Any) -> dict[str, Any]:
    return {"check": name, "pass": bool(ok), **figures}


def accounting(tally: Tally, texts: list[str], mock: dict[str, int],
               redis: dict[str, dict[str, int]], logs: dict[str, int], alive: bool
               ) -> list[dict[str, Any]]:
    tok = "tokenmeter_tokens_total"
    c_in, c_out, c_n = (sum(u[i] for u in tally.usage.values()) for i in range(3))
    r_in = msum(texts, tok, source="reported", type="input")
    r_out = msum(texts, tok, source="reported", type="output")
    per_user = {u: {"client": v[0] + v[1],
                    "proxy": msum(texts, tok, source="reported", type=("input", "output"),
                                  user=u)} for u, v in sorted(tally.usage.items())}
    out = [check("1. reported usage: client = proxy (reported) = mock",
                 c_in == r_in == mock["prompt_tokens"] and c_out == r_out ==
                 mock["completion_tokens"] and c_n == mock["requests"]
                 and all(v["client"] == v["proxy"] for v in per_user.values()),
                 client={"input": c_in, "output": c_out, "requests": c_n},
                 proxy_reported={"input": r_in, "output": r_out},
                 mock={"input": mock["prompt_tokens"], "output": mock["completion_tokens"],
                       "requests": mock["requests"]}, per_user=per_user)]
    budget: dict[str, Any] = {}
    for user, row in sorted(redis.items()):
        got = {d: msum(texts, tok, type=d, user=user) for d in ("input", "output")}
        budget[user] = {"redis": row, "proxy_recorded": {**got, "tokens": sum(got.values())}}
    carol = redis.get("carol", {}).get("tokens", 0)
    out.append(check("2. Redis budget counters = proxy recorded (reported + estimated)",
                     all(v["redis"] == v["proxy_recorded"] for v in budget.values())
                     and carol <= CAROL_DAILY, per_user=budget,
                     carol={"used": carol, "daily_limit": CAROL_DAILY}))
    proxy_status = by_label(texts, "tokenmeter_requests_total", "status")
    client_status = {s: n for s, n in sorted(tally.statuses.items()) if s != "None"}
    refusals = msum(texts, "tokenmeter_budget_refusals_total")
    out.append(check("3. requests: proxy counted = client sent, per status; refusals",
                     sum(proxy_status.values()) == tally.sent - tally.no_response
                     and proxy_status == client_status and refusals == tally.refused,
                     client_sent=tally.sent, client_no_response=tally.no_response,
                     proxy_counted=sum(proxy_status.values()), client_status=client_status,
                     proxy_status=proxy_status, client_refused=tally.refused,
                     proxy_refusals=refusals))
    pending = {n: msum(texts, n) for n in ("tokenmeter_settle_backlog",
                                           "tokenmeter_metering_errors_total",
                                           "tokenmeter_store_errors_total",
                                           "tokenmeter_active_requests")}
    out.append(check("4. nothing pending, no metering/store errors, no error logs",
                     not any(pending.values()) and not logs["error"] and alive,
                     **pending, error_log_lines=logs["error"],
                     warning_log_lines=logs["warning"], services_alive=alive))
    out.append(check("5. client saw consistent answers (usage = counted tokens, prompt = "
                     "calibration, usage chunk iff asked for)", not tally.anomalies,
                     anomalies=dict(tally.anomalies)))
    return out


def report(results: dict[str, Any]) -> str:
    meta, load_ = results["meta"], results["load"]
    lines = [f"tokenmeter soak ({meta['plan']}): {meta['duration_s']:.0f} s, "
             f"concurrency {meta['concurrency']}, {meta['replicas']} replicas on one Redis, "
             f"{meta['cpus']} CPUs",
             f"{load_['sent']} requests, {load_['requests_per_second']:.1f}/s; "
             f"estimated tokens (cut/failed requests): {load_['proxy_estimated_tokens']}; "
             f"upstream retries: {load_['proxy_retries']}",
             "proxy error classes: " + json.dumps(load_["proxy_error_classes"]),
             "redis at the end: " + json.dumps(load_["redis_at_end"]), "",
             f"{'slice':<28} {'n':>6}  outcomes"]
    for kind, res in load_["by_kind"].items():
        lines.append(f"{kind:<28} {sum(res.values()):>6}  "
                     + ", ".join(f"{r} {n}" for r, n in sorted(res.items())))
    if load_["anomalies"]:
        lines += ["", "client anomalies: " + json.dumps(load_["anomalies"]),
                  *("  " + s for s in load_["anomaly_samples"])]
    lines += ["", "Accounting (exact)"]
    for c in results["checks"]:
        figs = {k: v for k, v in c.items() if k not in ("check", "pass", "per_user")}
        lines.append(f"  {'PASS' if c['pass'] else 'FAIL'}  {c['check']}")
        lines += [f"        {k}: {json.dumps(v)}" for k, v in figs.items()]
        if "per_user" in c:
            lines.append(f"        per_user: {json.dumps(c['per_user'])}")
    lines += ["", f"Memory (RSS MB; start = after the {meta['warmup_s']:.0f} s warm-up; "
              "halves split the rest of the run)",
              f"{'process':<12} {'start':>7} {'end':>7} {'peak':>7} {'growth':>7} "
              f"{'/10k req':>8} {'1st half':>8} {'2nd half':>8}  verdict"]
    for name, m in results["memory"]["summary"].items():
        lines.append(f"{name:<12} {fmt(m['start_mb'], '7.1f')} {fmt(m['end_mb'], '7.1f')} "
                     f"{fmt(m['peak_mb'], '7.1f')} {fmt(m['growth_mb'], '+7.2f')} "
                     f"{fmt(m['growth_mb_per_10k_requests'], '+8.3f')} "
                     f"{fmt(m['first_half_mb'], '+8.2f')} {fmt(m['second_half_mb'], '+8.2f')}"
                     f"  {m['verdict']}")
    ok = all(c["pass"] for c in results["checks"])
    lines += ["", f"accounting: {'ALL PASS' if ok else 'FAILED'}; elapsed {meta['elapsed_s']:.0f}"
              f" s; JSON: {meta['output']}"]
    return "\n".join(lines)



def proxy_config(mock_port: int, redis_port: int) -> dict[str, Any]:
    big = {"daily_tokens": 10**12}
    return {
        "upstreams": {"mock": {"base_url": f"http://{HOST}:{mock_port}/v1"}},
        "metrics": {"discover_models": False},
        "store": {"url": f"redis://{HOST}:{redis_port}/0", "on_error": "fail_open"},
        "timezone": "UTC",
        "users": {
            "alice": {"keys": [KEYS["alice"][0], {"key": KEYS["alice"][1], "name": "ci",
                                                  "daily_tokens": 10**11}], **big},
            "bob": {"keys": list(KEYS["bob"]), **big},
            "carol": {"keys": list(KEYS["carol"]), "daily_tokens": CAROL_DAILY,
                      "max_output_tokens": 64},
        },
    }


def utc_day() -> str:
    return datetime.now(UTC).date().isoformat()


async def run(args: argparse.Namespace, plan: str, services: Services, workdir: Path,
              t_start: float) -> dict[str, Any]:
    progress = progress_printer(t_start)
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    mock_port, redis_port, *ports = free_ports(2 + args.replicas)
    tm = tokenmeter_argv()
    mock = services.start("mock", [*tm, "mock-upstream", "--host", HOST, "--port",
                                   str(mock_port)])
    redis = services.start("redis", [args.redis_server, "--port", str(redis_port), "--bind", HOST,
                                     "--save", "", "--appendonly", "no", "--dir", str(workdir)])
    await wait_redis(redis, redis_port)
    await wait_ready(mock, f"http://{HOST}:{mock_port}/v1/models")
    conf = workdir / "soak.yaml"
    conf.write_text(yaml.safe_dump(proxy_config(mock_port, redis_port)))
    proxies: list[Service] = [
        services.start(f"tokenmeter-{i}", [*tm, "serve", "--config", str(conf), "--host", HOST,
                                           "--port", str(port), "--log-level",
                                           args.proxy_log_level])
        for i, port in enumerate(ports)]
    for svc, port in zip(proxies, ports, strict=True):
        await wait_ready(svc, f"http://{HOST}:{port}/readyz")
    urls = [f"http://{HOST}:{p}" for p in ports]
    days = [utc_day()]
    pids = {**{s.name: s.proc.pid for s in proxies}, "mock": mock.proc.pid,
            "redis": redis.proc.pid}
    tally, samples = Tally(), list[dict[str, Any]]()
    warm_s = max(5.0, args.duration * 0.1)
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
        progress(f"services up (mock :{mock_port}, redis :{redis_port}, proxies "
                 f"{', '.join(map(str, ports))}); calibrating prompts")
        for i, (ep, p) in enumerate(itertools.product(("chat", "completions", "responses"),
                                                      range(len(PROMPTS)))):
            kind = Kind("calibration", ep, 0)
            await one(session, urls[i % len(urls)], KEYS["alice"][0], kind, "alice",
                      random.Random(i), -1, tally, prompt=p)
        if len(tally.calib) != 3 * len(PROMPTS):
            raise BenchError(f"calibration failed: {tally.calib}; {tally.samples}")
        t_load = time.monotonic()
        sampler = asyncio.ensure_future(sample_memory(pids, tally, samples, args.sample_s,
                                                      t_load))
        progress(f"load for {args.duration:g} s at concurrency {args.concurrency} "
                 f"(warm-up: first {warm_s:.0f} s)")
        ticker = asyncio.ensure_future(_ticker(tally, progress))
        try:
            await asyncio.wait_for(load(session, urls, tally, t_load + args.duration,
                                        args.concurrency, args.seed), args.duration + 90)
        except TimeoutError:
            raise BenchError("the load did not end 90 s after its duration") from None
        finally:
            ticker.cancel()
        elapsed = time.monotonic() - t_load
        progress(f"load done: {tally.sent} requests; waiting for the proxies to settle")
        texts = await quiesce(session, urls, tally.sent - tally.no_response)
        sampler.cancel()
        mock_stats = json.loads(await fetch(session, f"http://{HOST}:{mock_port}/_mock/stats"))
    days = sorted({*days, utc_day()})
    redis_usage = await tokenmeter_usage(conf, days)
    # Settle markers (`done:<id>`, 600 s TTL, so a retried settle counts once) are most keys.
    info = (await redis_command(redis_port, "INFO", "memory")).decode()
    redis_keys = {"dbsize": int(await redis_command(redis_port, "DBSIZE")),
                  "used_memory_mb": round(int(info.split("used_memory:")[1].split()[0]) / 2**20,
                                          2)}
    alive = all(s.proc.poll() is None for s in (mock, redis, *proxies))
    logs = scan_logs(proxies, tally)
    checks = accounting(tally, texts, mock_stats, redis_usage, logs, alive)
    names = [*(s.name for s in proxies), "mock", "redis"]
    return {
        "meta": {"plan": plan, "duration_s": round(elapsed, 1), "warmup_s": warm_s,
                 "concurrency": args.concurrency, "replicas": args.replicas, "seed": args.seed,
                 "cpus": os.cpu_count(), "python": platform.python_version(),
                 "aiohttp": aiohttp.__version__, "redis": redis_version(args.redis_server),
                 "platform": platform.platform(), "days": days,
                 "proxy_log_level": args.proxy_log_level,
                 "started_at": started_at, "weights": {k.name: k.weight for k in KINDS}},
        "load": {"sent": tally.sent, "requests_per_second": round(tally.sent / elapsed, 1),
                 "by_kind": {k: dict(v) for k, v in sorted(tally.results.items())},
                 "proxy_estimated_tokens": msum(texts, "tokenmeter_tokens_total",
                                                source="estimated", type=("input", "output")),
                 "proxy_error_classes": by_label(texts, "tokenmeter_requests_total",
                                                 "error_class"),
                 "proxy_retries": msum(texts, "tokenmeter_upstream_retries_total"),
                 "mock_stats": mock_stats, "redis_at_end": redis_keys,
                 "anomalies": dict(tally.anomalies),
                 "anomaly_samples": tally.samples, "prompt_tokens_by_template":
                     {f"{e}/{p}": n for (e, p), n in sorted(tally.calib.items())}},
        "checks": checks,
        "memory": {"summary": memory_summary(samples, names, warm_s), "samples": samples},
    }


async def fetch(session: aiohttp.ClientSession, url: str) -> str:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
            return await resp.text()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise BenchError(f"GET {url}: {type(exc).__name__}: {exc}") from None


async def quiesce(session: aiohttp.ClientSession, urls: list[str], expected: int) -> list[str]:
    """/metrics of every replica once all `expected` requests are counted and none is active
    (at most ~20 s), plus 1.5 s for the last settle tasks and a lease/retry tick."""
    for _ in range(100):
        texts = [await fetch(session, u + "/metrics") for u in urls]
        if msum(texts, "tokenmeter_requests_total") >= expected and not msum(
                texts, "tokenmeter_active_requests"):
            break
        await asyncio.sleep(0.2)
    await asyncio.sleep(1.5)
    return [await fetch(session, u + "/metrics") for u in urls]


def scan_logs(proxies: list[Service], tally: Tally) -> Counter[str]:
    logs: Counter[str] = Counter()
    for svc in proxies:
        for line in svc.log.read_text(errors="replace").splitlines():
            if '"level":"warning"' in line:
                logs["warning"] += 1
            elif '"level":"error"' in line or '"level":"critical"' in line:
                logs["error"] += 1
                if len(tally.samples) < 30:
                    tally.samples.append(f"{svc.name} log: {line[:300]}")
    return logs


async def _ticker(tally: Tally, progress: Callable[[str], None]) -> None:
    while True:
        await asyncio.sleep(30)
        progress(f"{tally.sent} requests so far")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    parser.add_argument("--quick", action="store_true", help="30 s of load (smoke run)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--replicas", type=int, default=2, choices=(1, 2, 3, 4))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--sample-s", type=float, default=2.0, help="RSS sampling interval")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON results file")
    parser.add_argument("--redis-server", default=shutil.which("redis-server")
                        or "/usr/bin/redis-server", help="redis-server binary")
    parser.add_argument("--proxy-log-level", default="INFO")
    parser.add_argument("--keep-tmp", action="store_true", help="keep configs and service logs")
    args = parser.parse_args()
    if args.quick:
        args.duration, args.sample_s = 30.0, 1.0
    passed: list[bool] = []
    code = execute(args, "quick" if args.quick else "full", run, report, "tokenmeter-soak-",
                   finish=lambda r: passed.append(all(c["pass"] for c in r["checks"])))
    return code or (0 if passed and passed[0] else 1)


if __name__ == "__main__":
    raise SystemExit(main())
