#!/usr/bin/env python3
"""Soak benchmark: minutes of mixed load on two replicas sharing one Redis, nothing may be lost,
not even through a store outage longer than any queue and a rolling restart in the middle of it.

    .venv/bin/python benchmarks/bench_soak.py [--duration 300 | --quick] [--outage S]

Starts on free 127.0.0.1 ports a private redis-server, the simulated upstream and two
`tokenmeter serve --config` replicas sharing the Redis budget (users alice with two keys, bob,
and carol whose small daily quota runs out early, so her later requests are 429 refusals), each
replica with a settlement spool directory of its own (`store.spool_dir`, `on_error: fail_open`).
A cheap aiohttp client then runs closed-loop workers against the replicas in turn for the
duration: chat, completions and responses, streamed (with and without
`stream_options.include_usage`) or not, embeddings, and slices with faults injected by the mock
(`x-mock-*`): resets mid-stream, upstream 500 and 429, a 500 that goes away on retry, garbage
bytes, random chunk cuts, and client disconnects after three content chunks of a 2 s stream.
RSS of every process is sampled from /proc all along.

The outage drill (unless `--outage 0`): at `--outage-at` the redis-server is stalled with
SIGSTOP (`--outage-mode stall`: its data stays in memory, the commands the proxies sent meanwhile
run when it gets SIGCONT) or killed with SIGKILL and later restarted from its append-only file
(`--outage-mode restart`, `appendfsync always`), for `--outage` seconds, while the load goes on.
Halfway through, replica 0 gets a rolling restart: the client stops sending it new requests (as
a load balancer would), waits until each request it sent has its response status, sends SIGTERM
(streams still running are drained by the proxy), waits for the exit, and starts it again with
the same config and spool directory; the client sends to it again once it is ready. What it owed
the store must then be on disk, adopted by the new process and replayed once Redis is back. After
the store returns the drill waits (with a deadline) until every replica reports the store up and
`tokenmeter_settle_backlog` 0; the load goes on meanwhile.

At the end it checks, exactly:

1. Reported usage. Three views of the same set of requests must agree token for token:
   C, what the client saw complete, with the usage object it read (JSON `usage`, the usage chunk
   of an include_usage stream, `response.completed`) or, for a stream without include_usage
   (whose usage chunk the proxy strips), derived: the content chunks it counted (each is one
   token: the mock's words are one token each) plus the prompt tokens the mock reported for the
   same prompt in a calibration request; R, the proxy's `tokenmeter_tokens_total{source=
   "reported"}` (input, output) over all replicas; M, the mock's `/_mock/stats`, which sums the
   usage of the responses whose last byte it handed to the socket. Why C = R = M: the proxy
   records `reported` exactly when it read the upstream's usage, and always asks streams for it;
   the mock sends usage only in a response's tail, so a reset, an error status or a disconnect
   leaves no trace in M, and those requests are `estimated` (or zero) in R and not complete in C.
   A client disconnect comes ~1.9 s before the mock's tail, so the mock cannot have finished
   it (if a stall let the whole stream reach the client first, the client counts it complete);
   retried attempts that failed sent no usage. So a request in M but not R is usage the
   upstream reported and the proxy lost; in R but not C, usage recorded for an answer the client
   never got whole (or a phantom). Checked per direction, per user, and as request counts (C vs M).
   The restarted replica's first process cannot be scraped after its drain, so its counters are
   summed from its access log (one JSON line per request, written by the same code from the same
   record as the metrics; check 7 shows the two agree).
2. Budget counters. `tokenmeter usage --json` (the Redis daily counters) per user equals the
   proxies' recorded tokens, reported + estimated, per user and direction; no reservation is
   left in Redis; carol stays within her quota but for what the store could not check: the usage
   of her requests started while it was down (admitted by `fail_open`). Refusals cost nothing
   (a refused request settles nothing, so any cost shows here). The outage goes through this
   check: usage spooled, adopted after the restart and replayed must be in Redis exactly once.
3. Requests. `tokenmeter_requests_total` over all replicas equals what the client sent, also
   per HTTP status (a stream cut after its headers is counted with its 200, as the client saw
   it); `tokenmeter_budget_refusals_total` equals the 429 daily_quota_exceeded the client got.
4. Nothing pending or failed: settle backlog and active requests are 0; metering errors, lost
   settlements (`tokenmeter_settlements_lost_total`) are 0; store errors happened only during
   the outage (0 before it, none after the proxies saw the store back); every service is alive,
   the restarted replica's first process exited 0; no proxy logged at error level but the
   store-down lines (`tokenmeter.budget`: "budget store unreachable ..." once, "budget store
   still unreachable ..." every 30 s and at shutdown).
5. Client consistency (usage = counted tokens, prompt = calibration, usage chunk iff asked for,
   no request without a response: the rolling restart must not cost a request).
6. The outage (with `--outage`): every process saw the store go down, the ones alive at the end
   saw it come back; the first process of replica 0 exited 0 within its drain, left on disk the
   usage it owed (its file in the spool directory, read by the benchmark), and the second process
   adopted exactly that; the spools drained within the deadline and are empty on disk at the end.
7. Access log = metrics, per series (user x type x source tokens, user x status x error class
   requests) for every process alive at the end; for the first process of replica 0, its access
   log holds at least what its last scrape before SIGTERM showed (plus the drained requests).

With the hostile client, the cache phase (`soak_cache.py`) runs once the outage drill is over
(else after the warm-up), against the last replica: a rate-limited user's hits of a large entry,
a stalled single-flight leader, long fills at once; its requests join the tally like the rest,
and check 9 asks its own checks (hits within the rate limit, the leader's team-mate answered,
every fill answered) and that the probe's p50 while it ran stayed under 300 ms.

Memory: RSS start (after the warm-up, the first 10% of the run), end, peak, growth, growth per
10k requests, and a verdict from the second half of the run against the first (replica 0 after
a restart: from its second process only).
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
import re
import shutil
import signal
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
    ends_with_done,
    execute,
    fmt,
    free_ports,
    process_tree,
    tokenmeter_argv,
    wait_ready,
)
from soak_cache import CACHE_MODEL, DAVE_KEY, ERIN_KEYS, FULL, QUICK, CachePhase, cache_config
from soak_cache import users as cache_users
from soak_hostile import HOSTILE_MODEL, MALLORY_KEY, Hostile, HostileTally, probe_argv

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
        "carol": ("sk-soak-carol-000",), "mallory": (MALLORY_KEY,),
        "dave": (DAVE_KEY,), "erin": ERIN_KEYS}  # dave and erin: the cache phase's
CAROL_DAILY = 4000
DISCONNECT_AFTER = 3  # content chunks, of a 400-token stream at 200 tokens/s
# 2 s from its first token to its tail: a stall of the client, proxy or mock (the mock keeps every
# request, so its garbage collections grow with the run: 0.7 s seen at 1 GB) cannot let the
# stream finish before the client hangs up. 800 tokens/s (0.5 s) did, twice in 206k requests.
DISCONNECT_RATE = 200


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
    tokens, rate = (400, DISCONNECT_RATE) if kind.fault == "disconnect" else (tokens, 3000)
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
    # Requests started while the store may have been down (monotonic times; `down_to` None: not
    # back yet): `fail_open` admits them unchecked, so their usage may go past a quota.
    down_from: float | None = None
    down_to: float | None = None
    usage_down: dict[str, list[int]] = field(default_factory=dict)

    def add(  # noqa: PLR0913, PLR0917  one tally entry: the fields of a request's outcome
        self, kind: Kind, user: str, status: int | None, result: str, usage: tuple[int, int] | None,
        started: float = 0.0,
    ) -> None:
        self.sent += 1
        self.statuses[str(status)] += 1
        self.no_response += status is None
        self.results.setdefault(kind.name, Counter())[result] += 1
        if usage is not None:
            accs = [self.usage.setdefault(user, [0, 0, 0])]
            if self.down_from is not None and started >= self.down_from and (
                    self.down_to is None or started <= self.down_to):
                accs.append(self.usage_down.setdefault(user, [0, 0, 0]))
            for acc in accs:
                for i, v in enumerate((*usage, 1)):
                    acc[i] += v

    def anomaly(self, what: str, detail: str) -> None:
        self.anomalies[what] += 1
        if len(self.samples) < 20:
            self.samples.append(f"{what}: {detail}"[:300])


@dataclass
class Router:
    """Which replica the next request goes to, and the client's requests in flight to each:
    `waiting` for their response status, or reading a `body`. A replica in `out` gets no new
    requests (a load balancer that took it out before a rolling restart)."""

    n: int
    out: set[int] = field(default_factory=set)
    waiting: list[int] = field(default_factory=list)
    body: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.waiting, self.body = [0] * self.n, [0] * self.n

    def pick(self, seq: int) -> int:
        live = [i for i in range(self.n) if i not in self.out]
        return live[seq % len(live)]


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
    # tokenmeter ends a clean stream with an SSE comment after `[DONE]` (its cost): not an event.
    done = data.rfind(DONE)
    if done < 0 or not ends_with_done(data[done:]):
        return None, count
    data = data[: done + len(DONE)]
    for event in reversed(data[: -len(DONE)].split(b"\n\n")[-4:]):
        if event.startswith(b"data: {") and b'"usage":{' in event:
            return _usage_of(json.loads(event[6:])), count
    return (-1, count), count


async def one(  # noqa: PLR0912, PLR0913, PLR0915, PLR0917  one request, every outcome told
    session: aiohttp.ClientSession, url: str, key: str, kind: Kind, user: str, rng: random.Random,
    seq: int, tally: Tally, prompt: int | None = None, router: Router | None = None,
    replica: int = 0,
) -> int | None:
    p, body, headers = request_for(kind, rng, seq, prompt)
    headers.update({"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    status: int | None = None
    usage: tuple[int, int] | None = None
    result = "broken"
    mark = MARKS.get(kind.endpoint, b"")
    started = time.monotonic()
    if router is not None:
        router.waiting[replica] += 1
    try:
        async with session.post(url + PATHS[kind.endpoint], data=json.dumps(body).encode(),
                                headers=headers, timeout=TIMEOUT) as resp:
            status = resp.status
            if router is not None:
                router.waiting[replica] -= 1
                router.body[replica] += 1
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
                usage, counted = stream_usage(kind, b"".join(parts))
                if result == "disconnected" and usage is not None:
                    # The whole answer was in hand before the client hung up (a stall let it
                    # arrive in one read): the client saw it complete, as did proxy and mock.
                    result = "complete_before_disconnect"
                elif result != "disconnected":
                    result = "broken" if usage is None else "complete"
                if result != "disconnected":
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
    finally:
        if router is not None:
            if status is None:
                router.waiting[replica] -= 1
            else:
                router.body[replica] -= 1
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
    tally.add(kind, user, status, result, usage, started)
    return status


async def load(  # noqa: PLR0913, PLR0917  the load loop: the run's shared state and its bounds
    session: aiohttp.ClientSession, urls: list[str], router: Router, tally: Tally, stop_at: float,
    concurrency: int, seed: int,
) -> None:
    seq = itertools.count()

    async def worker(w: int) -> None:
        rng = random.Random(seed * 1000 + w)
        while time.monotonic() < stop_at:
            n = next(seq)
            kind = rng.choices(KINDS, WEIGHTS)[0]
            user = kind.user or rng.choice(("alice", "alice", "bob"))
            i = router.pick(n)
            await one(session, urls[i], rng.choice(KEYS[user]), kind, user, rng, n, tally,
                      router=router, replica=i)

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


def memory_summary(samples: list[dict[str, Any]], names: list[str], warm_t: float,
                   starts: dict[str, float] | None = None) -> dict[str, Any]:
    """Per process; `starts` overrides the warm-up end for a process that began later (the
    second process of a restarted replica)."""
    out: dict[str, Any] = {}
    for n in names:
        begin = (starts or {}).get(n, warm_t)
        run = [s for s in samples if s["t"] >= begin and n in s] or samples[-1:]
        mid_i = min(range(len(run)),
                    key=lambda i: abs(run[i]["t"] - (run[0]["t"] + run[-1]["t"]) / 2))

        def at(i: int, name: str = n, run: list[dict[str, Any]] = run) -> float:
            # median of the sample and its neighbours: less noise
            return float(statistics.median(s[name] for s in run[max(0, i - 1): i + 2]))

        reqs = max(1, run[-1]["requests"] - run[0]["requests"])
        reqs2 = max(1, run[-1]["requests"] - run[mid_i]["requests"])
        start, mid, end = at(0), at(mid_i), at(len(run) - 1)
        first, second = mid - start, end - mid
        out[n] = {
            "from_t": begin,
            "start_mb": round(start, 2), "end_mb": round(end, 2),
            "peak_mb": round(max(s.get(n, 0.0) for s in samples), 2),
            "growth_mb": round(end - start, 2),
            "growth_mb_per_10k_requests": round((end - start) / reqs * 1e4, 3),
            "first_half_mb": round(first, 2), "second_half_mb": round(second, 2),
            "second_half_mb_per_10k_requests": round(second / reqs2 * 1e4, 3),
            "verdict": "growing" if second > max(2.0, 0.5 * first) else "flat",
        }
    return out


# --------------------------------------------------------------------------------------------
# What the proxies wrote: access lines, store and spool lines, errors

# Error lines an outage is expected to cause: (logger, message prefix). The last one only from a
# process that started while the store was down.
STORE_DOWN_ERRORS = (("tokenmeter.budget", "budget store unreachable"),
                     ("tokenmeter.budget", "budget store still unreachable"))
_RE = {
    "replayed": re.compile(r"^replayed a settlement of (\d+) tokens"),
    "adopted": re.compile(r"^adopted (\d+) settlements \((\d+) tokens\)"),
    "owed": re.compile(r"^(\d+) settlements \((\d+) tokens\) are owed"),
    "back": re.compile(r"^budget store answers again after ([\d.]+) s"),
    "spooled": re.compile(r"(\d+) requests spooled"),
    "admitted": re.compile(r"(\d+) requests admitted"),
}


@dataclass
class ProcLog:
    """One proxy process's log, read after the fact."""

    name: str
    tokens: Counter[tuple[str, str, str]] = field(default_factory=Counter)  # user, type, source
    requests: Counter[tuple[str, str, str]] = field(default_factory=Counter)  # user, status, class
    retries: int = 0  # attempts beyond the first, from the access lines
    errors_expected: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)  # any other error or critical line
    warnings: Counter[str] = field(default_factory=Counter)
    replayed: int = 0
    replayed_tokens: int = 0
    adopted: list[int] | None = None  # [settlements, tokens] taken over from a previous run
    owed_at_exit: list[int] | None = None  # [settlements, tokens] left on disk at shutdown
    saw_down: bool = False
    back_after_s: float | None = None
    spooled_in_summaries: int = 0  # "N requests spooled" over the summary and "answers again"
    admitted_in_summaries: int = 0
    served_while_down: int = 0  # access lines between the store-down line and the back line

    def as_metrics(self) -> str:
        """Its counters as Prometheus text, the way `tokenmeter_*_total` would have shown them
        (refusals: requests of error class budget_exceeded; here only daily quotas refuse)."""
        lines, refusals = [], Counter[str]()
        for (user, typ, source), n in sorted(self.tokens.items()):
            lines.append(f'tokenmeter_tokens_total{{type="{typ}",user="{user}",'
                         f'source="{source}"}} {n}')
        for (user, status, cls), n in sorted(self.requests.items()):
            lines.append(f'tokenmeter_requests_total{{user="{user}",status="{status}",'
                         f'error_class="{cls}"}} {n}')
            if cls == "budget_exceeded":
                refusals[user] += n
        lines += [f'tokenmeter_budget_refusals_total{{user="{u}"}} {n}'
                  for u, n in sorted(refusals.items())]
        lines.append(f"tokenmeter_upstream_retries_total {self.retries}")
        return "\n".join(lines) + "\n"

    def summary(self) -> dict[str, Any]:
        return {"requests": sum(self.requests.values()), "saw_store_down": self.saw_down,
                "store_back_after_s": self.back_after_s,
                "served_while_store_down": self.served_while_down,
                "spooled_per_summary_lines": self.spooled_in_summaries,
                "admitted_per_summary_lines": self.admitted_in_summaries,
                "replayed_settlements": self.replayed, "replayed_tokens": self.replayed_tokens,
                "adopted": self.adopted, "owed_at_exit": self.owed_at_exit,
                "expected_error_lines": dict(self.errors_expected),
                "other_error_lines": len(self.errors), "error_samples": self.errors[:10],
                "warning_lines": dict(self.warnings)}


def read_log(  # noqa: PLR0912  one branch per kind of log line the soak judges
    svc: Service, started_in_outage: bool = False,
) -> ProcLog:
    out = ProcLog(svc.name)
    down = False
    allowed = STORE_DOWN_ERRORS
    with svc.log.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith('{"event":"request"'):
                r = json.loads(line)
                user = r["user"]
                for typ in ("input", "output", "cached_input", "reasoning"):
                    if r[f"{typ}_tokens"]:
                        out.tokens[(user, typ, r["token_source"])] += r[f"{typ}_tokens"]
                out.requests[(user, str(r["status"]), r["error_class"])] += 1
                out.retries += max(0, r["attempts"] - 1)
                out.served_while_down += down
                continue
            if not line.startswith('{"level"'):
                continue
            rec = json.loads(line)
            level, logger, msg = rec["level"], rec.get("logger", ""), rec.get("message", "")
            if level in ("error", "critical"):
                hit = next((p for lg, p in allowed if logger == lg and msg.startswith(p)), None)
                if hit is None:
                    out.errors.append(line.strip()[:300])
                else:
                    out.errors_expected[f"{logger}: {hit}"] += 1
                if logger == "tokenmeter.budget" and msg.startswith("budget store unreachable"):
                    out.saw_down = down = True
            elif level == "warning":
                out.warnings[" ".join(msg.split()[:5])] += 1
            if m := _RE["replayed"].match(msg):
                out.replayed += 1
                out.replayed_tokens += int(m.group(1))
            elif m := _RE["adopted"].match(msg):
                out.adopted = [int(m.group(1)), int(m.group(2))]
            elif m := _RE["owed"].match(msg):
                out.owed_at_exit = [int(m.group(1)), int(m.group(2))]
            elif m := _RE["back"].match(msg):
                out.back_after_s, down = float(m.group(1)), False
            if msg.startswith(("budget store still unreachable", "budget store answers again")):
                out.spooled_in_summaries += sum(int(x) for x in _RE["spooled"].findall(msg))
                out.admitted_in_summaries += sum(int(x) for x in _RE["admitted"].findall(msg))
    return out


def spool_on_disk(directory: Path) -> dict[str, Any]:
    """What the spool files in `directory` still owe, read independently of proxy/spool.py:
    JSON lines of owed settlements {"o","i","t","e"}, plain sums {"a","t","e"} and done ids
    {"d"}; a torn last line is skipped, as the proxy does."""
    owed: dict[str, int] = {}
    summed, records, files = 0, 0, []
    for path in sorted(directory.glob("spool-*.jsonl")):
        files.append(path.name)
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            records += 1
            if "o" in rec:
                owed[rec["i"]] = int(rec.get("t", 0))
            elif "a" in rec:
                summed += int(rec.get("t", 0))
            elif "d" in rec:
                owed.pop(rec["d"], None)
    return {"files": files, "records": records, "owed_settlements": len(owed),
            "tokens": sum(owed.values()) + summed}


_SCALARS = ("tokenmeter_settle_backlog", "tokenmeter_settle_backlog_tokens",
            "tokenmeter_store_up", "tokenmeter_store_errors_total",
            "tokenmeter_settlements_lost_total", "tokenmeter_settlement_tokens_lost_total",
            "tokenmeter_metering_errors_total", "tokenmeter_active_requests")


def scalars(text: str) -> dict[str, float]:
    """A few series summed over their labels, by a line scan (cheaper than the parser, so the
    drill can poll every second without loading the client)."""
    out = dict.fromkeys(_SCALARS, 0.0)
    for line in text.splitlines():
        if line.startswith("tokenmeter_"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in out:
                out[name] += float(line.rsplit(" ", 1)[1])
    return out


def counters_of(text: str) -> tuple[Counter[tuple[str, str, str]], Counter[tuple[str, str, str]]]:
    """A scrape's tokens (user, type, source) and requests (user, status, class), as ProcLog."""
    tokens, requests = Counter[tuple[str, str, str]](), Counter[tuple[str, str, str]]()
    for labels, v in series(text, "tokenmeter_tokens_total"):
        if v:
            tokens[(labels["user"], labels["type"], labels["source"])] += round(v)
    for labels, v in series(text, "tokenmeter_requests_total"):
        # A failed authentication has no access-log line (it is sampled): not compared here.
        if v and labels["error_class"] != AUTH_FAILED:
            requests[(labels["user"], labels["status"], labels["error_class"])] += round(v)
    return tokens, requests


AUTH_FAILED = "invalid_api_key"


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


def accounting(  # noqa: PLR0913, PLR0917  the final check: every source of evidence, compared
    tally: Tally, texts: list[str], finals: dict[str, str], mock: dict[str, int],
    redis: dict[str, dict[str, int]], leftovers: dict[str, int], logs: dict[str, ProcLog],
    alive: bool, drill: Drill | None, spools_end: dict[str, dict[str, Any]], hostile: HostileTally,
) -> list[dict[str, Any]]:
    """`texts`: every process's counters (scrapes, and the first process of a restarted replica
    from its access log); `finals`: the scrapes of the processes alive at the end."""
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
    carol_down = sum(tally.usage_down.get("carol", [0, 0])[:2])
    out.append(check("2. Redis budget counters = proxy recorded (reported + estimated)",
                     all(v["redis"] == v["proxy_recorded"] for v in budget.values())
                     and carol - carol_down <= CAROL_DAILY and not any(leftovers.values()),
                     per_user=budget, reservations_left_in_redis=leftovers,
                     carol={"used": carol, "daily_limit": CAROL_DAILY,
                            "admitted_while_store_down": carol_down,
                            "checked_by_the_store": carol - carol_down}))
    # Failed authentications (only the hostile client's) are compared with their own counter,
    # which every process's scrape has (the first process of a restarted replica: its last
    # one, taken when nothing of anyone's was in flight to it); the rest per status.
    proxy_status = dict(Counter(by_label(texts, "tokenmeter_requests_total", "status"))
                        - Counter({"401": msum(texts, "tokenmeter_requests_total",
                                               error_class=AUTH_FAILED)}))
    auth_scrapes = [*finals.values(), *([drill.pre_term_scrape] if drill is not None
                                        and drill.pre_term_scrape else [])]
    proxy_auth = msum(auth_scrapes, "tokenmeter_auth_failures_total")
    client_status = {s: n for s, n in sorted(tally.statuses.items()) if s != "None"}
    hostile_status = hostile.by_status()
    hostile_auth = hostile_status.pop("401", 0)
    # The hostile client's requests the proxy answered count too; one whose client got no
    # status (its write of a large body cut by the proxy's early answer) may or may not have
    # been counted: at most that many more, never fewer.
    expected = Counter(client_status) + hostile_status
    more, fewer = Counter(proxy_status) - expected, expected - Counter(proxy_status)
    refusals = msum(texts, "tokenmeter_budget_refusals_total")
    out.append(check("3. requests: proxy counted = client sent (+ the hostile client's), per "
                     "status; failed authentications = tokenmeter_auth_failures_total; refusals",
                     not fewer and hostile_auth <= proxy_auth
                     and sum(more.values()) + proxy_auth - hostile_auth <= hostile.no_status
                     and refusals == tally.refused,
                     hostile_auth_failures=hostile_auth, proxy_auth_failures=proxy_auth,
                     client_sent=tally.sent, client_no_response=tally.no_response,
                     proxy_counted=sum(proxy_status.values()), client_status=client_status,
                     hostile_status=dict(sorted(hostile_status.items())),
                     hostile_no_status=hostile.no_status,
                     proxy_status=proxy_status, client_refused=tally.refused,
                     proxy_refusals=refusals))
    fin = {n: scalars(t) for n, t in finals.items()}
    every = list(fin.values()) + ([scalars(drill.pre_term_scrape)]
                                  if drill is not None and drill.pre_term_scrape else [])
    pending = {k: round(sum(v["tokenmeter_" + k] for v in fin.values()))
               for k in ("settle_backlog", "settle_backlog_tokens", "active_requests")}
    failed = {k: round(sum(v["tokenmeter_" + k] for v in every))
              for k in ("metering_errors_total", "settlements_lost_total",
                        "settlement_tokens_lost_total")}
    store_errors = {n: round(v["tokenmeter_store_errors_total"]) for n, v in fin.items()}
    if drill is None:
        errors_ok = not any(store_errors.values())
    else:
        errors_ok = drill.store_errors_before == 0 and store_errors == drill.store_errors_after
    other_errors = {n: len(lg.errors) for n, lg in logs.items()}
    expected_errors = {n: dict(lg.errors_expected) for n, lg in logs.items() if lg.errors_expected}
    first_exit = drill.restart.get("exit_code", 0) if drill is not None else 0
    out.append(check("4. nothing pending or lost; metering errors 0; store errors only during "
                     "the outage; no error logs but the store-down lines",
                     not any(pending.values()) and not any(failed.values()) and errors_ok
                     and not any(other_errors.values()) and alive and first_exit == 0,
                     **pending, **failed, store_errors_at_end=store_errors,
                     store_errors_before_outage=None if drill is None
                     else drill.store_errors_before,
                     store_errors_when_spools_empty=None if drill is None
                     else drill.store_errors_after,
                     unexpected_error_log_lines=other_errors,
                     expected_error_log_lines=expected_errors,
                     warning_log_lines={n: sum(lg.warnings.values()) for n, lg in logs.items()},
                     services_alive=alive, restarted_process_exit_code=first_exit))
    out.append(check("5. client saw consistent answers (usage = counted tokens, prompt = "
                     "calibration, usage chunk iff asked for, every request answered)",
                     not tally.anomalies, anomalies=dict(tally.anomalies)))
    if drill is not None:
        out.append(outage_check(drill, finals, logs, spools_end))
    out.append(access_check(drill, finals, logs))
    return out


def outage_check(d: Drill, finals: dict[str, str], logs: dict[str, ProcLog],
                 spools_end: dict[str, dict[str, Any]]) -> dict[str, Any]:
    rs = d.restart
    first = logs.get(d.first_life.name) if d.first_life is not None else None
    second = logs.get(d.first_life.name + "-restarted") if d.first_life is not None else None
    disk = rs.get("spool_on_disk_after_exit", {}).get("tokens", 0)
    handover = {"on_disk_tokens": disk,
                "owed_at_exit_tokens": (first.owed_at_exit or [0, 0])[1] if first else None,
                "adopted_tokens": (second.adopted or [0, 0])[1] if second else None}
    handover_ok = first is None or (
        disk > 0 and handover["on_disk_tokens"] == handover["owed_at_exit_tokens"]
        == handover["adopted_tokens"])
    ok = (all(lg.saw_down for lg in logs.values())
          and all(logs[n].back_after_s is not None for n in finals)
          and (first is None or (rs["exit_code"] == 0 and rs["exit_s"] <= 35)) and handover_ok
          and d.noticed_at is not None and d.drained_at is not None
          and not any(s["tokens"] or s["owed_settlements"] for s in spools_end.values()))
    return check("6. outage: every process saw the store down and (if alive) back; the restarted "
                 "process left its debt on disk and its successor adopted exactly that; spools "
                 "drained and empty on disk",
                 ok, saw_down={n: lg.saw_down for n, lg in logs.items()},
                 back_after_s={n: logs[n].back_after_s for n in finals},
                 restart=rs, handover=handover,
                 spools_drained_s_after_outage=None if d.drained_at is None or d.up_at is None
                 else round(d.drained_at - d.up_at, 2), spools_at_end=spools_end)


def access_check(d: Drill | None, finals: dict[str, str],
                 logs: dict[str, ProcLog]) -> dict[str, Any]:
    same = {}
    for name, text in finals.items():
        tokens, requests = counters_of(text)
        same[name] = tokens == +logs[name].tokens and requests == +logs[name].requests
    figures: dict[str, Any] = {"equal_per_series": same}
    ok = all(same.values())
    if d is not None and d.first_life is not None and d.pre_term_scrape:
        first = logs[d.first_life.name]
        tokens, requests = counters_of(d.pre_term_scrape)
        covers = (all(first.tokens[k] >= v for k, v in tokens.items())
                  and all(first.requests[k] >= v for k, v in requests.items()))
        ok = ok and covers
        figures["first_process"] = {
            "access_log_covers_last_scrape": covers,
            "requests_in_last_scrape": sum(requests.values()),
            "requests_in_access_log": sum(first.requests.values())}
    return check("7. access log = metrics (the restarted replica's first process: access log "
                 ">= its last scrape)", ok, **figures)


def report(results: dict[str, Any]) -> str:
    meta, load_ = results["meta"], results["load"]
    lines = [f"tokenmeter soak ({meta['plan']}): {meta['duration_s']:.0f} s, "
             f"concurrency {meta['concurrency']}, {meta['replicas']} replicas on one Redis, "
             f"{meta['cpus']} CPUs",
             f"{load_['sent']} requests, {load_['requests_per_second']:.1f}/s; "
             f"estimated tokens (cut/failed requests): {load_['proxy_estimated_tokens']}; "
             f"upstream retries: {load_['proxy_retries']}",
             "proxy error classes: " + json.dumps(load_["proxy_error_classes"]),
             "redis at the end: " + json.dumps(load_["redis_at_end"])]
    o = results.get("outage")
    if o:
        lines += ["", f"Outage ({o['mode']}): redis down {o['length_s']:.1f} s from "
                  f"t={o['down_at_s']:.1f} s; {o['requests_during']} requests meanwhile "
                  f"({o['requests_per_second_during']:.0f}/s); store seen up "
                  f"{o['seen_up_s_after']} s and spools empty {o['drained_s_after']} s after it",
                  f"  old in-memory queue bound: {o['old_queue_bound']:,} entries per replica; "
                  f"settlements spooled (requests settled while the store was down): "
                  + json.dumps(o["spooled_per_process"]),
                  "  peak settle backlog [entries, tokens] per process: "
                  + json.dumps({n: [round(p["settle_backlog"]), round(p["settle_backlog_tokens"])]
                                for n, p in o["peak_backlog"].items()}),
                  "  replayed [settlements, tokens] per process: "
                  + json.dumps(o["replayed"])]
        rs = o.get("restart")
        if rs:
            lines.append(f"  rolling restart of replica {rs['replica']} at t={rs['sigterm_at_s']}"
                         f" s: exit {rs['exit_code']} {rs['exit_s']} s after SIGTERM with "
                         f"{rs['responses_in_flight']} responses in flight; spool on disk "
                         f"{json.dumps(rs['spool_on_disk_after_exit'])}; ready again after "
                         f"{rs['restart_ready_s']} s")
        lines.append(f"  settlements lost: {o['settlements_lost']}")
    lines += ["", f"{'slice':<28} {'n':>6}  outcomes"]
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
    lines += ["", f"Memory (RSS MB; start = after the {meta['warmup_s']:.0f} s warm-up, or from "
              "`from` s for a restarted process; halves split the rest of the run)",
              f"{'process':<12} {'from':>6} {'start':>7} {'end':>7} {'peak':>7} {'growth':>7} "
              f"{'/10k req':>8} {'1st half':>8} {'2nd half':>8}  verdict"]
    for name, m in results["memory"]["summary"].items():
        lines.append(f"{name:<12} {fmt(m['from_t'], '6.0f')} {fmt(m['start_mb'], '7.1f')} "
                     f"{fmt(m['end_mb'], '7.1f')} "
                     f"{fmt(m['peak_mb'], '7.1f')} {fmt(m['growth_mb'], '+7.2f')} "
                     f"{fmt(m['growth_mb_per_10k_requests'], '+8.3f')} "
                     f"{fmt(m['first_half_mb'], '+8.2f')} {fmt(m['second_half_mb'], '+8.2f')}"
                     f"  {m['verdict']}")
    ok = all(c["pass"] for c in results["checks"])
    lines += ["", f"accounting: {'ALL PASS' if ok else 'FAILED'}; elapsed {meta['elapsed_s']:.0f}"
              f" s; JSON: {meta['output']}"]
    return "\n".join(lines)


def proxy_config(mock_port: int, redis_port: int, spool_dir: Path,
                 side_mocks: dict[str, int]) -> dict[str, Any]:
    big = {"daily_tokens": 10**12}
    return {
        # The hostile client's huge prompts and the probe each have a simulated upstream of
        # their own (soak_hostile): a mock counts a huge prompt on its loop, which would stall
        # the ordinary load's upstream and the probe's timings.
        "upstreams": {"mock": {"base_url": f"http://{HOST}:{mock_port}/v1"},
                      **{f"{m}-mock": {"base_url": f"http://{HOST}:{port}/v1"}
                         for m, port in side_mocks.items()}},
        "models": [*({"match": m, "upstream": f"{m}-mock"} for m in side_mocks),
                   {"match": "*", "upstream": "mock"}],
        "metrics": {"discover_models": False},
        "store": {"url": f"redis://{HOST}:{redis_port}/0", "on_error": "fail_open",
                  "spool_dir": str(spool_dir)},
        "timezone": "UTC",
        "users": {
            "alice": {"keys": [KEYS["alice"][0], {"key": KEYS["alice"][1], "name": "ci",
                                                  "daily_tokens": 10**11}], **big},
            "bob": {"keys": list(KEYS["bob"]), **big},
            "carol": {"keys": list(KEYS["carol"]), "daily_tokens": CAROL_DAILY,
                      "max_output_tokens": 64},
            # The hostile client's valid key (soak_hostile): huge prompts, gzip bombs.
            "mallory": {"keys": list(KEYS["mallory"]), **big},
            **cache_users(),  # the cache phase's (soak_cache)
        },
        # On for the cache phase's model only: the rest of the load is never cached.
        "cache": cache_config(),
    }


def utc_day() -> str:
    return datetime.now(UTC).date().isoformat()


@dataclass
class Replica:
    index: int
    port: int
    conf: Path
    spool_dir: Path
    argv: list[str]
    svc: Service
    lives: list[Service] = field(default_factory=list)  # every process that served it, in order

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"


@dataclass
class Drill:
    """The outage and the rolling restart: plan, timestamps (monotonic, relative to the load's
    start in the results) and what was seen."""

    at: float
    length: float
    mode: str  # stall | restart
    down_at: float | None = None
    up_at: float | None = None
    noticed_at: float | None = None  # every replica reports the store up
    drained_at: float | None = None  # ... and a settle backlog of 0
    sent_at_down: int = 0
    sent_at_up: int = 0
    store_errors_before: int = 0
    store_errors_after: dict[str, int] = field(default_factory=dict)  # per process, once drained
    peaks: dict[str, dict[str, float]] = field(default_factory=dict)  # per process
    at_resume: dict[str, dict[str, float]] = field(default_factory=dict)  # last scrape before it
    restart: dict[str, Any] = field(default_factory=dict)
    pre_term_scrape: str = ""  # the first process's /metrics just before its SIGTERM
    first_life: Service | None = None


class Cluster:
    """The services of one run and the drill's moves on them."""

    def __init__(  # noqa: PLR0913, PLR0917  the drill's handles on the run's services
        self, services: Services, redis: Service, redis_argv: list[str], redis_port: int,
        replicas: list[Replica], router: Router, tally: Tally, pids: dict[str, int],
        ctl: aiohttp.ClientSession, progress: Callable[[str], None],
    ) -> None:
        self.services, self.redis, self.redis_argv = services, redis, redis_argv
        self.redis_port, self.replicas, self.router = redis_port, replicas, router
        self.tally, self.pids, self.ctl, self.progress = tally, pids, ctl, progress
        self.redis_stopped = False
        self.t_load = 0.0
        # The hostile client's requests in flight to a replica (soak_hostile.Hostile.busy).
        self.hostile_busy: Callable[[str], int] = lambda url: 0

    def rel(self, t: float | None) -> float | None:
        return None if t is None else round(t - self.t_load, 2)

    async def scrape_live(self) -> dict[str, str]:
        """/metrics of every replica now serving, by process name."""
        out = {}
        for rep in self.replicas:
            if rep.index in self.router.out or rep.svc.proc.poll() is not None:
                continue
            try:
                out[rep.svc.name] = await fetch(self.ctl, rep.url + "/metrics")
            except BenchError:
                continue
        return out

    async def monitor(self, drill: Drill) -> None:
        """Once a second: each process's peak settle backlog (count and tokens)."""
        while True:
            for name, text in (await self.scrape_live()).items():
                v = scalars(text)
                peak = drill.peaks.setdefault(name, {"settle_backlog": 0.0,
                                                     "settle_backlog_tokens": 0.0})
                for k in peak:
                    peak[k] = max(peak[k], v["tokenmeter_" + k])
            await asyncio.sleep(1.0)

    def redis_down(self, mode: str) -> None:
        if mode == "stall":
            os.kill(self.redis.proc.pid, signal.SIGSTOP)
            self.redis_stopped = True
        else:
            os.kill(self.redis.proc.pid, signal.SIGKILL)
            self.redis.proc.wait(timeout=10)

    async def redis_up(self, mode: str) -> None:
        if mode == "stall":
            os.kill(self.redis.proc.pid, signal.SIGCONT)
            self.redis_stopped = False
        else:
            self.redis = self.services.start("redis-restarted", self.redis_argv)
            self.pids["redis"] = self.redis.proc.pid
            await wait_redis(self.redis, self.redis_port)

    def resume_redis(self) -> None:
        """Cleanup: never leave our redis-server stopped (Services.stop must be able to end it)."""
        if self.redis_stopped:
            os.kill(self.redis.proc.pid, signal.SIGCONT)
            self.redis_stopped = False

    async def rolling_restart(self, rep: Replica, drill: Drill) -> None:
        r, i = self.router, rep.index
        r.out.add(i)
        for _ in range(4000):  # 20 s
            if not r.waiting[i] and not self.hostile_busy(rep.url):
                break
            await asyncio.sleep(0.005)
        if r.waiting[i] or self.hostile_busy(rep.url):
            raise BenchError(f"{r.waiting[i]} requests (and {self.hostile_busy(rep.url)} of the "
                             f"hostile client's) to {rep.svc.name} got no status in 20 s")
        drill.pre_term_scrape = await fetch(self.ctl, rep.url + "/metrics")
        old = drill.first_life = rep.svc
        in_flight = r.body[i]
        t_term = time.monotonic()
        os.kill(old.proc.pid, signal.SIGTERM)
        for _ in range(6000):  # 60 s
            if old.proc.poll() is not None:
                break
            await asyncio.sleep(0.01)
        exit_s = time.monotonic() - t_term
        if old.proc.poll() is None:
            raise BenchError(f"{old.name} did not exit within 60 s of SIGTERM:\n{old.tail()}")
        on_disk = spool_on_disk(rep.spool_dir)
        self.progress(f"{old.name} exited {old.proc.returncode} {exit_s:.2f} s after SIGTERM "
                      f"({in_flight} responses in flight); its spool on disk: "
                      f"{on_disk['owed_settlements']} settlements, {on_disk['tokens']} tokens")
        t_start = time.monotonic()
        new = self.services.start(f"{old.name}-restarted", rep.argv)
        await wait_ready(new, rep.url + "/readyz", timeout_s=40)
        ready_s = time.monotonic() - t_start
        rep.svc = new
        rep.lives.append(new)
        self.pids[f"tokenmeter-{i}"] = new.proc.pid
        r.out.discard(i)
        drill.restart = {
            "replica": i, "sigterm_at_s": self.rel(t_term), "responses_in_flight": in_flight,
            "exit_s": round(exit_s, 3), "exit_code": old.proc.returncode,
            "spool_on_disk_after_exit": on_disk, "restart_ready_s": round(ready_s, 2),
            "out_of_rotation_s": round(time.monotonic() - t_term, 2),
        }

    async def wait_all(self, what: str, ok: Callable[[dict[str, float]], bool],
                       timeout_s: float) -> float | None:
        """Poll every live replica until `ok` holds for all; the time it did, or None."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            texts = await self.scrape_live()
            if len(texts) == len(self.replicas) and all(ok(scalars(t)) for t in texts.values()):
                return time.monotonic()
            await asyncio.sleep(0.2)
        self.progress(f"not every replica reported {what} within {timeout_s:.0f} s")
        return None

    async def drill(self, d: Drill) -> None:
        await asyncio.sleep(max(0.0, self.t_load + d.at - time.monotonic()))
        before = await self.scrape_live()
        d.store_errors_before = round(sum(scalars(t)["tokenmeter_store_errors_total"]
                                          for t in before.values()))
        d.sent_at_down = self.tally.sent
        self.redis_down(d.mode)
        d.down_at = time.monotonic()
        # A reserve sent just before the stop can still fail into an unchecked admission.
        self.tally.down_from = d.down_at - 1.0
        how = "stalled (SIGSTOP)" if d.mode == "stall" else "killed (SIGKILL)"
        self.progress(f"outage: redis-server {how} for {d.length:g} s")
        if len(self.replicas) >= 2:
            await asyncio.sleep(max(0.0, d.down_at + d.length / 2 - time.monotonic()))
            await self.rolling_restart(self.replicas[0], d)
        await asyncio.sleep(max(0.0, d.down_at + d.length - time.monotonic()))
        for name, text in (await self.scrape_live()).items():
            d.at_resume[name] = {k: scalars(text)["tokenmeter_" + k]
                                 for k in ("settle_backlog", "settle_backlog_tokens")}
        await self.redis_up(d.mode)
        d.up_at, d.sent_at_up = time.monotonic(), self.tally.sent
        self.progress(f"outage over after {d.up_at - d.down_at:.1f} s "
                      f"({d.sent_at_up - d.sent_at_down} requests meanwhile); waiting for the "
                      "replicas to see the store and replay their spools")
        d.noticed_at = await self.wait_all("the store up", lambda v: v["tokenmeter_store_up"] == 1,
                                           60)
        self.tally.down_to = d.noticed_at or time.monotonic()
        d.drained_at = await self.wait_all(
            "an empty spool", lambda v: v["tokenmeter_store_up"] == 1
            and v["tokenmeter_settle_backlog"] == 0, 120)
        d.store_errors_after = {n: round(scalars(t)["tokenmeter_store_errors_total"])
                                for n, t in (await self.scrape_live()).items()}
        if d.drained_at is not None and d.noticed_at is not None:
            self.progress(f"store seen up {d.noticed_at - d.up_at:.1f} s and spools empty "
                          f"{d.drained_at - d.up_at:.1f} s after the outage")
async def run(  # noqa: PLR0912, PLR0915  the soak's script: start, load, drill, collect, in order
    args: argparse.Namespace, plan: str, services: Services, workdir: Path, t_start: float,
) -> dict[str, Any]:
    progress = progress_printer(t_start)
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    mock_port, probe_port, hostile_port, cache_port, redis_port, *ports = free_ports(
        5 + args.replicas)
    side_ports = {PROBE_MODEL: probe_port, HOSTILE_MODEL: hostile_port, CACHE_MODEL: cache_port}
    tm = tokenmeter_argv()
    mock = services.start("mock", [*tm, "mock-upstream", "--host", HOST, "--port",
                                   str(mock_port)])
    side_mocks = [services.start(f"{m}-mock", [*tm, "mock-upstream", "--host", HOST, "--port",
                                               str(port)]) for m, port in side_ports.items()]
    # A Redis killed mid-run must come back with its counters: append-only, fsync per write.
    aof = (["--appendonly", "yes", "--appendfsync", "always"]
           if args.outage and args.outage_mode == "restart" else ["--appendonly", "no"])
    redis_argv = [args.redis_server, "--port", str(redis_port), "--bind", HOST, "--save", "",
                  *aof, "--dir", str(workdir)]
    redis = services.start("redis", redis_argv)
    await wait_redis(redis, redis_port)
    await wait_ready(mock, f"http://{HOST}:{mock_port}/v1/models")
    for side, port in zip(side_mocks, side_ports.values(), strict=True):
        await wait_ready(side, f"http://{HOST}:{port}/v1/models")
    replicas: list[Replica] = []
    for i, port in enumerate(ports):
        spool, conf = workdir / f"spool-{i}", workdir / f"soak-{i}.yaml"
        conf.write_text(yaml.safe_dump(proxy_config(mock_port, redis_port, spool,
                                                    side_ports)))
        argv = [*tm, "serve", "--config", str(conf), "--host", HOST, "--port", str(port),
                "--log-level", args.proxy_log_level]
        svc = services.start(f"tokenmeter-{i}", argv)
        replicas.append(Replica(i, port, conf, spool, argv, svc, [svc]))
    for rep in replicas:
        await wait_ready(rep.svc, rep.url + "/readyz")
    urls = [rep.url for rep in replicas]
    days = [utc_day()]
    pids = {**{rep.svc.name: rep.svc.proc.pid for rep in replicas}, "mock": mock.proc.pid,
            "redis": redis.proc.pid}
    tally, samples, router = Tally(), list[dict[str, Any]](), Router(len(urls))
    hostile_tally = HostileTally()
    drill = Drill(args.outage_at, args.outage, args.outage_mode) if args.outage else None
    warm_s = max(5.0, args.duration * 0.1)
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    async with (aiohttp.ClientSession(connector=connector, auto_decompress=False) as session,
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as ctl):
        cluster = Cluster(services, redis, redis_argv, redis_port, replicas, router, tally, pids,
                          ctl, progress)
        try:
            progress(f"services up (mock :{mock_port}, redis :{redis_port}, proxies "
                     f"{', '.join(map(str, ports))}); calibrating prompts")
            for i, (ep, p) in enumerate(itertools.product(("chat", "completions", "responses"),
                                                          range(len(PROMPTS)))):
                kind = Kind("calibration", ep, 0)
                await one(session, urls[i % len(urls)], KEYS["alice"][0], kind, "alice",
                          random.Random(i), -1, tally, prompt=p)
            if len(tally.calib) != 3 * len(PROMPTS):
                raise BenchError(f"calibration failed: {tally.calib}; {tally.samples}")
            hostile, phase = None, None
            if args.hostile:
                hostile = Hostile(
                    urls=lambda: [urls[i] for i in range(len(urls)) if i not in router.out],
                    pids=lambda: [r.svc.proc.pid for r in replicas
                                  if r.index not in router.out],
                    configs=[r.conf for r in replicas], tally=hostile_tally,
                    record=lambda name, status, usage: tally.add(
                        Kind(name, "chat", 0, user="mallory"), "mallory", status,
                        "complete" if usage is not None else f"http_{status}", usage))
                phase = CachePhase(urls[-1], cache_record(tally, hostile_tally),
                                   QUICK if args.quick else FULL)
                progress("building the hostile client's bodies (gzip bombs, 28 MB JSON)")
                await hostile.prepare()
                cluster.hostile_busy = hostile.busy.__getitem__
            t_load = cluster.t_load = time.monotonic()
            sampler = asyncio.ensure_future(sample_memory(pids, tally, samples, args.sample_s,
                                                          t_load))
            progress(f"load for {args.duration:g} s at concurrency {args.concurrency} "
                     f"(warm-up: first {warm_s:.0f} s)"
                     + (f"; outage ({args.outage_mode}) from {drill.at:g} s for "
                        f"{drill.length:g} s" if drill else ""))
            background = [asyncio.ensure_future(_ticker(tally, progress))]
            tasks = [asyncio.ensure_future(load(session, urls, router, tally,
                                                t_load + args.duration, args.concurrency,
                                                args.seed))]
            if hostile is not None:
                every = 8.0 if args.quick else 30.0
                tasks.append(asyncio.ensure_future(hostile.run(
                    session, t_load + warm_s, t_load + args.duration - every, every)))
                probe = await asyncio.create_subprocess_exec(
                    *probe_argv(urls[-1], KEYS["bob"][0], t_load + args.duration),
                    stdout=asyncio.subprocess.PIPE)
                tasks.append(asyncio.ensure_future(collect_probe(probe, tally, hostile_tally)))
            drilled: asyncio.Future[None] | None = None
            if drill is not None:
                background.append(asyncio.ensure_future(cluster.monitor(drill)))
                drilled = asyncio.ensure_future(cluster.drill(drill))
                tasks.append(drilled)
            if phase is not None:
                tasks.append(asyncio.ensure_future(cache_phase(
                    phase, session, drilled, t_load + warm_s, hostile_tally, progress)))
            try:
                await asyncio.wait_for(asyncio.gather(*tasks), args.duration + 240)
            except TimeoutError:
                raise BenchError("the load (or the outage drill) did not end 240 s after the "
                                 "duration") from None
            finally:
                for task in (*tasks, *background):
                    task.cancel()
            elapsed = time.monotonic() - t_load
            # The first process of a restarted replica is gone: its counters come from its log.
            first = (read_log(drill.first_life) if drill is not None
                     and drill.first_life is not None else None)
            counted_before = sum(first.requests.values()) if first is not None else 0
            progress(f"load done: {tally.sent} requests; waiting for the proxies to settle")
            final_texts = await quiesce(ctl, urls, tally.sent - tally.no_response
                                        - counted_before)
            sampler.cancel()
            mock_stats = json.loads(await fetch(ctl, f"http://{HOST}:{mock_port}/_mock/stats"))
            # Every simulated upstream is "the mock" of check 1: their usage is summed.
            for port in side_ports.values():
                side_stats = json.loads(await fetch(ctl, f"http://{HOST}:{port}/_mock/stats"))
                mock_stats = {k: v + side_stats.get(k, 0) if isinstance(v, int) else v
                              for k, v in mock_stats.items()}
        finally:
            cluster.resume_redis()
    days = sorted({*days, utc_day()})
    redis_usage = await tokenmeter_usage(replicas[0].conf, days)
    redis = cluster.redis
    # Settle markers (`done:<id>`, 600 s TTL, so a retried settle counts once) are most keys.
    info = (await redis_command(redis_port, "INFO", "memory")).decode()
    redis_keys = {"dbsize": int(await redis_command(redis_port, "DBSIZE")),
                  "used_memory_mb": round(int(info.split("used_memory:")[1].split()[0]) / 2**20,
                                          2)}
    leftovers = {u: int(await redis_command(redis_port, "HLEN", f"tokenmeter:{{{u}}}:reserved"))
                 for u in KEYS}
    alive = all(s.proc.poll() is None
                for s in (mock, *side_mocks, redis, *(r.svc for r in replicas)))
    logs: dict[str, ProcLog] = {}
    if first is not None:
        logs[first.name] = first
    for rep in replicas:
        for n, life in enumerate(rep.lives):
            if life.name not in logs:
                logs[life.name] = read_log(life, started_in_outage=n > 0)
    finals = {rep.svc.name: text for rep, text in zip(replicas, final_texts, strict=True)}
    texts = [*([first.as_metrics()] if first is not None else []), *final_texts]
    spools_end = {f"replica-{rep.index}": spool_on_disk(rep.spool_dir) for rep in replicas}
    checks = accounting(tally, texts, finals, mock_stats, redis_usage, leftovers, logs, alive,
                        drill, spools_end, hostile_tally)
    peaks = {n: max((s.get(n, 0.0) for s in samples), default=0.0) for n in pids
             if n.startswith("tokenmeter")}
    checks.append(check(f"8. every replica's RSS stayed under the shipped pod's "
                        f"{POD_MEMORY_MB} MB limit (gzip bombs, huge prompts, large bodies)",
                        all(v < POD_MEMORY_MB for v in peaks.values()),
                        peak_rss_mb={n: round(v, 1) for n, v in peaks.items()}))
    if phase is not None:
        checks.append(cache_check(phase, hostile_tally))
    names = [*(f"tokenmeter-{rep.index}" for rep in replicas), "mock", "redis"]
    starts = {}
    if drill is not None and drill.restart:
        rs = drill.restart
        starts[f"tokenmeter-{rs['replica']}"] = round(
            rs["sigterm_at_s"] + rs["out_of_rotation_s"] + 5.0, 1)
    results: dict[str, Any] = {
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
        "outage": outage_results(drill, cluster, logs, tally, finals) if drill else None,
        "hostile": hostile_tally.summary() if args.hostile else None,
        "cache_phase": phase.tally.summary(phase.sizes) if phase is not None else None,
        "logs": {n: lg.summary() for n, lg in logs.items()},
        "checks": checks,
        "memory": {"summary": memory_summary(samples, names, warm_s, starts),
                   "samples": samples},
    }
    return results


async def collect_probe(proc: asyncio.subprocess.Process, tally: Tally,
                        hostile: HostileTally) -> None:
    """The probe process's requests (soak_hostile): timed, and tallied like the rest."""
    out, _ = await proc.communicate()
    for line in out.decode().splitlines():
        r = json.loads(line)
        usage = tuple(r["usage"]) if r["usage"] is not None else None
        status = r["status"]
        result = "complete" if usage is not None else (
            "no_response" if status is None else f"http_{status}")
        if status is None:
            tally.anomaly("no_response", "probe")
        tally.add(PROBE, "bob", status, result, usage)
        hostile.probed(r["t0"], r["took"], status == 200)


def cache_record(tally: Tally, hostile: HostileTally) -> Callable[
        [str, str, int | None, tuple[int, int] | None], None]:
    """How the cache phase's requests join the soak's tally: a miss with the usage its client
    read, a hit (no upstream call) and a refusal as requests without usage (a refusal counted
    with the budget's refusals), the stalled leader as a hostile request without a status."""
    def record(kind: str, user: str, status: int | None, usage: tuple[int, int] | None) -> None:
        if status is None:
            hostile.add(f"cache-{kind}", None)
            return
        tally.refused += status == 429
        result = ("complete" if usage is not None else "refused" if status == 429
                  else "hit" if status == 200 else f"http_{status}")
        tally.add(Kind(f"cache-{kind}", "chat", 0, user=user), user, status, result, usage)
    return record


async def cache_phase(  # noqa: PLR0913, PLR0917  the phase, when: after the drill or the warm-up
    phase: CachePhase, session: aiohttp.ClientSession, drilled: asyncio.Future[None] | None,
    after: float, hostile: HostileTally, progress: Callable[[str], None],
) -> None:
    """The cache phase (soak_cache), once the outage drill is over (a store down would admit
    its rate-limited user unchecked, `fail_open`), else after the warm-up."""
    if drilled is not None:
        await asyncio.shield(drilled)
    await asyncio.sleep(max(0.0, after - time.monotonic()))
    progress(f"cache phase: {phase.sizes}")
    try:
        await phase.run(session)
    finally:
        hostile.cache_window = phase.tally.window
    progress(f"cache phase done: {phase.tally.summary(phase.sizes)}")


def cache_check(phase: CachePhase, hostile: HostileTally) -> dict[str, Any]:
    """9. The cache phase: its own checks (soak_cache) and the probe's latency during it."""
    during = sorted(hostile.probe_cache)
    p50 = during[len(during) // 2] if during else None
    problems = phase.tally.problems(phase.sizes)
    return check(f"9. cache phase: hits within the rate limit, a stalled leader's team-mate "
                 f"answered, every fill answered; the probe's p50 during it under "
                 f"{PROBE_BOUND_MS} ms",
                 not problems and p50 is not None and p50 * 1000 < PROBE_BOUND_MS,
                 probe_during_ms={
                     "n": len(during), "p50": None if p50 is None else round(p50 * 1000, 1),
                     "p99": round(during[int(0.99 * (len(during) - 1))] * 1000, 1)
                     if during else None,
                     "max": round(during[-1] * 1000, 1) if during else None},
                 **phase.tally.summary(phase.sizes))


PROBE_BOUND_MS = 300  # another client's p50 while one client works the cache against it
PROBE = Kind("probe", "chat", 0)
PROBE_MODEL = "probe-gpt"  # soak_hostile's probe asks for it
POD_MEMORY_MB = 1024  # deploy/kubernetes/deployment.yaml's memory limit

OLD_QUEUE_BOUND = 100_000  # entries: the in-memory settle queue before the spool


def outage_results(d: Drill, c: Cluster, logs: dict[str, ProcLog], tally: Tally,
                   finals: dict[str, str]) -> dict[str, Any]:
    assert d.down_at is not None and d.up_at is not None
    length = d.up_at - d.down_at
    lost = sum(scalars(t)["tokenmeter_settlements_lost_total"] for t in
               [*finals.values(), *([d.pre_term_scrape] if d.pre_term_scrape else [])])

    def after(t: float | None) -> float | None:
        return None if t is None or d.up_at is None else round(t - d.up_at, 2)

    return {
        "mode": d.mode, "down_at_s": c.rel(d.down_at), "up_at_s": c.rel(d.up_at),
        "length_s": round(length, 2), "requests_during": d.sent_at_up - d.sent_at_down,
        "requests_per_second_during": round((d.sent_at_up - d.sent_at_down) / length, 1),
        "seen_up_s_after": after(d.noticed_at), "drained_s_after": after(d.drained_at),
        "old_queue_bound": OLD_QUEUE_BOUND,
        "spooled_per_process": {n: lg.served_while_down for n, lg in logs.items()},
        "spooled_total": sum(lg.served_while_down for lg in logs.values()),
        "peak_backlog": d.peaks, "backlog_at_resume": d.at_resume,
        "replayed": {n: [lg.replayed, lg.replayed_tokens] for n, lg in logs.items()},
        "usage_admitted_while_down": {u: v[0] + v[1] for u, v in tally.usage_down.items()},
        "restart": d.restart, "settlements_lost": round(lost),
        "store_errors_before": d.store_errors_before,
        "store_errors_when_drained": d.store_errors_after,
    }


async def fetch(session: aiohttp.ClientSession, url: str) -> str:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
            return await resp.text()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise BenchError(f"GET {url}: {type(exc).__name__}: {exc}") from None


async def quiesce(session: aiohttp.ClientSession, urls: list[str], expected: int) -> list[str]:
    """/metrics of every replica once all `expected` requests are counted, none is active and
    no settlement waits in a spool (at most ~60 s), plus 1.5 s for the last settle tasks and a
    lease/retry tick."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        texts = [await fetch(session, u + "/metrics") for u in urls]
        if msum(texts, "tokenmeter_requests_total") >= expected and not msum(
                texts, "tokenmeter_active_requests") and not msum(
                texts, "tokenmeter_settle_backlog"):
            break
        await asyncio.sleep(0.2)
    await asyncio.sleep(1.5)
    return [await fetch(session, u + "/metrics") for u in urls]


async def _ticker(tally: Tally, progress: Callable[[str], None]) -> None:
    while True:
        await asyncio.sleep(30)
        progress(f"{tally.sent} requests so far")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    parser.add_argument("--quick", action="store_true",
                        help="30 s of load with a 12 s outage (smoke run)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--replicas", type=int, default=2, choices=(1, 2, 3, 4))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--sample-s", type=float, default=2.0, help="RSS sampling interval")
    parser.add_argument("--outage", type=float, default=None,
                        help="seconds without Redis mid-run (default: 60%% of the duration, "
                             "12 with --quick; 0: no outage drill)")
    parser.add_argument("--outage-at", type=float, default=None,
                        help="start of the outage, seconds into the load (default: 15%% of "
                             "the duration, at least the warm-up; 8 with --quick)")
    parser.add_argument("--outage-mode", choices=("stall", "restart"), default="stall",
                        help="stall: SIGSTOP/SIGCONT the redis-server; restart: SIGKILL it and "
                             "start it again from its append-only file")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON results file")
    parser.add_argument("--redis-server", default=shutil.which("redis-server")
                        or "/usr/bin/redis-server", help="redis-server binary")
    parser.add_argument("--proxy-log-level", default="INFO",
                        help="INFO or DEBUG: the access lines are needed with --outage")
    parser.add_argument("--keep-tmp", action="store_true", help="keep configs and service logs")
    parser.add_argument("--no-hostile", dest="hostile", action="store_false",
                        help="without the hostile client's bursts (soak_hostile.py)")
    args = parser.parse_args()
    if args.quick:
        args.duration, args.sample_s = 30.0, 1.0
        args.outage = 12.0 if args.outage is None else args.outage
        args.outage_at = 8.0 if args.outage_at is None else args.outage_at
    if args.outage is None:
        args.outage = round(0.6 * args.duration, 1)
    if args.outage_at is None:
        args.outage_at = round(max(5.0, 0.1 * args.duration, 0.15 * args.duration), 1)
    if args.outage and args.outage_at + args.outage > args.duration - 5:
        parser.error("the outage must end at least 5 s before the load does")
    if args.outage and args.proxy_log_level.upper() not in ("INFO", "DEBUG"):
        parser.error("--outage needs the access lines: --proxy-log-level INFO or DEBUG")
    passed: list[bool] = []
    code = execute(args, "quick" if args.quick else "full", run, report, "tokenmeter-soak-",
                   finish=lambda r: passed.append(all(c["pass"] for c in r["checks"])))
    return code or (0 if passed and passed[0] else 1)


if __name__ == "__main__":
    raise SystemExit(main())
