#!/usr/bin/env python3
"""Benchmark: what the response cache (issue 23) gives and costs: the TTFT a hit adds through the
proxy against a direct upstream call and against a miss, the CPU of a hit, and the CPU the
lookups cost on a workload that never hits.

    .venv/bin/python benchmarks/bench_cache.py [--rounds 3] [--samples 300] [--requests 2000]
                                               [--store redis://127.0.0.1:6379/0]

One simulated upstream (`tokenmeter mock-upstream`, instant by default; the TTFT runs ask it
for a 20 ms first token and 750 tokens/s through its `x-mock-*` headers, which the proxy
forwards and which are not part of the cache key). Each round starts `tokenmeter serve` twice,
side by side: with the cache off (no `cache:` section) and with
`cache: {enabled: true, scope: user, ttl_s: 300}` (an in-process LRU; `--store` puts the
budget store, and so the cache, on Redis). Requests are streamed chat completions with a
1 KB prompt and 64 output tokens, read incrementally.

Measured, with the cache on:
- TTFT (request sent -> first content chunk read), p50 and p99 over `--samples` requests, one
  at a time, of: `direct` (client -> upstream), `miss` (a prompt never seen: a lookup, then the
  upstream, then the store) and `hit` (one prompt asked before: replayed from the entry);
  `added` is each path's figure less direct's (p50 from p50, p99 from p99);
- CPU per hit: utime+stime of the proxy over `--requests` hits, 16 at a time;
- the lookups' cost: CPU per request over `--requests` requests that all miss (each prompt
  unique), cache on against cache off, in alternating batches of 100 to one then the other (so
  the noise of a shared machine falls on both alike). Target: at most 1.05x (+5% CPU per
  request).
Every answer's `x-tokenmeter-cache` header is checked (a hit run served by misses, or a miss run
served by hits, cannot pass as fast or cheap): wrong ones are counted and fail the run.

It runs once the cache core is in (`cache:` with `scope`/`ttl_s` and the header); exit status 0
when the answers were what they should be and the lookups' cost is within its target.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from procs import Served, cpu_s, free_port, wait_port

CACHE_HEADER = "x-tokenmeter-cache"
PROMPT = ("The quick brown fox jumps over the lazy dog. " * 23)[:1000]  # ~1 KB with the nonce
PACED = {"x-mock-ttft-ms": "20", "x-mock-tokens-per-second": "750"}
TARGET = 1.05  # lookups on a 0% hit ratio: at most +5% CPU per request
# A configured user's key: the cache answers only keys the proxy knows (open mode and
# pass-through keys are never consulted), so both runs authenticate alike.
API_KEY = "sk-bench-cache-0123456789"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def body(prompt: str) -> dict[str, object]:
    # temperature 0: a request that samples is not cached by default.
    return {"model": "m", "messages": [{"role": "user", "content": prompt}], "stream": True,
            "temperature": 0,
            "stream_options": {"include_usage": True}, "max_tokens": 64}


@dataclass
class Client:
    """One session, and what the answers' x-tokenmeter-cache said against what was expected."""

    session: aiohttp.ClientSession
    wrong: int = 0
    seen: dict[str, int] = field(default_factory=dict)

    async def ttft(self, url: str, payload: dict[str, object], expect: str | None,
                   headers: dict[str, str] | None = None) -> float:
        """Seconds from sending to the first read holding a content chunk; the stream read to
        its end. `expect`: the x-tokenmeter-cache value the answer must carry (None: any)."""
        started = time.perf_counter()
        first: float | None = None
        async with self.session.post(url, json=payload, headers={**AUTH, **(headers or {})}) as r:
            assert r.status == 200, r.status
            got = r.headers.get(CACHE_HEADER)
            if expect is not None:
                self.seen[str(got)] = self.seen.get(str(got), 0) + 1
                self.wrong += got != expect
            async for chunk in r.content.iter_any():
                if first is None and b'"content"' in chunk:
                    first = time.perf_counter()
        assert first is not None, "no content chunk"
        return first - started


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def ttft_runs(c: Client, proxy_port: int, mock_port: int,
                    samples: int) -> dict[str, list[float]]:
    direct = f"http://127.0.0.1:{mock_port}/v1/chat/completions"
    proxied = f"http://127.0.0.1:{proxy_port}/v1/chat/completions"
    known = body(f"{PROMPT} known")
    out: dict[str, list[float]] = {"direct": [], "miss": [], "hit": []}
    for i in range(20):  # warm-up: connections, tokenizer
        await c.ttft(direct, body(f"{PROMPT} warm {i}"), None, PACED)
        await c.ttft(proxied, body(f"{PROMPT} warm {uuid.uuid4().hex}"), "miss", PACED)
    await c.ttft(proxied, known, None, PACED)  # stored, if it was not yet
    for _ in range(samples):  # interleaved: the same noise on every path
        out["direct"].append(await c.ttft(direct, body(f"{PROMPT} {uuid.uuid4().hex}"), None,
                                          PACED))
        out["miss"].append(await c.ttft(proxied, body(f"{PROMPT} {uuid.uuid4().hex}"), "miss",
                                        PACED))
        out["hit"].append(await c.ttft(proxied, known, "hit", PACED))
    return out


def _payload(expect: str | None) -> dict[str, object]:
    """One known prompt when `expect` is "hit", else a new prompt each."""
    return body(f"{PROMPT} known") if expect == "hit" else body(f"{PROMPT} {uuid.uuid4().hex}")


async def warm(c: Client, served: Served, expect: str | None) -> None:
    url = f"http://127.0.0.1:{served.port}/v1/chat/completions"
    for _ in range(200):  # warm-up (and, for hits, the entry)
        await c.ttft(url, _payload(expect), None)


async def cpu_s_of(c: Client, served: Served, requests: int, expect: str | None) -> float:
    """CPU seconds `served` spends on `requests`, 16 at a time."""
    url = f"http://127.0.0.1:{served.port}/v1/chat/completions"
    await asyncio.sleep(0.2)  # what came before has settled: not counted here
    before = cpu_s(served.proc.pid)
    queue = iter(range(requests))

    async def worker() -> None:
        for _ in queue:
            await c.ttft(url, _payload(expect), expect)

    await asyncio.gather(*(worker() for _ in range(16)))
    await asyncio.sleep(0.2)  # settling after the last byte is counted
    return cpu_s(served.proc.pid) - before


async def paired_ms(c: Client, off: Served, on: Served, requests: int) -> tuple[float, float]:
    """CPU per request of the cache off and of the cache on with every request a miss, in
    alternating batches of 100 (the shared machine's noise falls on both alike)."""
    await warm(c, off, None)
    await warm(c, on, "miss")
    spent = {"off": 0.0, "on": 0.0}
    for _ in range(max(1, requests // 100)):
        spent["off"] += await cpu_s_of(c, off, 100, None)
        spent["on"] += await cpu_s_of(c, on, 100, "miss")
    n = max(1, requests // 100) * 100
    return spent["off"] / n * 1000, spent["on"] / n * 1000


def config(mock_port: int, cache: bool, store: str | None) -> str:
    text = (f"upstreams:\n  mock: {{base_url: 'http://127.0.0.1:{mock_port}/v1'}}\n"
            "metrics: {discover_models: false}\n"
            f"users: {{bench: {{keys: ['{API_KEY}']}}}}\n")
    if store is not None:
        text += f"store: {{url: '{store}'}}\n"
    if cache:
        text += "cache: {enabled: true, scope: user, ttl_s: 300}\n"
    return text


def start_mock() -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    mock = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "mock-upstream", "--port", str(port),
         "--ttft-ms", "0", "--tokens-per-second", "0", "--output-tokens", "64"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port)
    return mock, port


@dataclass
class Round:
    ttft: dict[str, list[float]]
    hit_cpu: float
    off_cpu: float
    miss_cpu: float


async def one_round(c: Client, mock_port: int, samples: int, requests: int,
                    store: str | None) -> Round:
    off = Served(config(mock_port, False, store), "tm-cache-off-")
    on = Served(config(mock_port, True, store), "tm-cache-on-")
    try:
        off_cpu, miss_cpu = await paired_ms(c, off, on, requests)
        off.stop()
        await warm(c, on, "hit")
        hit_cpu = await cpu_s_of(c, on, requests, "hit") / requests * 1000
        figures = await ttft_runs(c, on.port, mock_port, samples)
    finally:
        off.stop()
        on.stop()
    return Round(figures, hit_cpu, off_cpu, miss_cpu)


async def run(rounds: int, samples: int, requests: int, store: str | None) -> int:
    mock, port = start_mock()
    done: list[Round] = []
    try:
        async with aiohttp.ClientSession() as session:
            c = Client(session)
            for r in range(rounds):
                started = time.perf_counter()
                done.append(await one_round(c, port, samples, requests, store))
                last = done[-1]
                print(f"round {r + 1}: hit p50 {pct(last.ttft['hit'], 0.5) * 1000:.2f} ms, "
                      f"CPU/hit {last.hit_cpu:.3f} ms, CPU/request off {last.off_cpu:.3f} ms, "
                      f"all-miss {last.miss_cpu:.3f} ms, {time.perf_counter() - started:.1f} s",
                      flush=True)
    finally:
        mock.terminate()
        mock.wait(timeout=30)
    merged = {path: [v for rnd in done for v in rnd.ttft[path]] for path in done[0].ttft}
    d50, d99 = pct(merged["direct"], 0.5), pct(merged["direct"], 0.99)
    print(f"\nTTFT over {rounds} x {samples} requests each, one at a time (upstream: 20 ms to "
          "first token, 750 tok/s):")
    for path, values in merged.items():
        p50, p99 = pct(values, 0.5), pct(values, 0.99)
        added = "" if path == "direct" else (
            f"  added vs direct p50 {(p50 - d50) * 1000:+.2f} ms p99 {(p99 - d99) * 1000:+.2f} ms")
        print(f"  {path:6s}: p50 {p50 * 1000:7.2f} ms  p99 {p99 * 1000:7.2f} ms{added}")
    m50, m99 = pct(merged["miss"], 0.5), pct(merged["miss"], 0.99)
    h50, h99 = pct(merged["hit"], 0.5), pct(merged["hit"], 0.99)
    print(f"  hit vs miss: p50 {(h50 - m50) * 1000:+.2f} ms, p99 {(h99 - m99) * 1000:+.2f} ms")
    hit_cpu = statistics.median(r.hit_cpu for r in done)
    off_cpu = statistics.median(r.off_cpu for r in done)
    miss_cpu = statistics.median(r.miss_cpu for r in done)
    ratio = miss_cpu / off_cpu
    print(f"\nCPU per request, median of {rounds} rounds ({requests} requests, 16 at a time):")
    print(f"  cache off          : {off_cpu:.3f} ms")
    print(f"  cache on, all miss : {miss_cpu:.3f} ms ({ratio:.3f}x off; target <= {TARGET}x)"
          f"{'  OK' if ratio <= TARGET else '  OVER TARGET'}")
    print(f"  cache on, hits     : {hit_cpu:.3f} ms per hit ({hit_cpu / off_cpu:.3f}x a request "
          "with the cache off)")
    print(f"\nx-tokenmeter-cache seen: {c.seen}; unexpected: {c.wrong}")
    return 0 if c.wrong == 0 and ratio <= TARGET else 1


# --- in process: the cache's own part of a miss and of a hit, without the server's noise -------

_HEAD = '{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m"'
_DELTA = '"logprobs":null,"finish_reason":'
# The mock's 64-token stream's shape: a role chunk, 64 content chunks, the finish, the usage.
STREAM = [f'data: {_HEAD},"choices":[{{"index":0,"delta":{{"role":"assistant","content":""}},'
          f'{_DELTA}null}}]}}\n\n'.encode()]
STREAM += [f'data: {_HEAD},"choices":[{{"index":0,"delta":{{"content":" word{i}"}},'
           f'{_DELTA}null}}]}}\n\n'.encode() for i in range(64)]
STREAM += [f'data: {_HEAD},"choices":[{{"index":0,"delta":{{}},{_DELTA}"stop"}}]}}\n\n'.encode(),
           f'data: {_HEAD},"choices":[],"usage":{{"prompt_tokens":250,"completion_tokens":64,'
           '"total_tokens":314}}\n\n'.encode(), b"data: [DONE]\n\n"]
JSON_ANSWER = (b'{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":'
               b'[{"index":0,"message":{"role":"assistant","content":"' + b" word" * 64
               + b'"},"logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":250,'
               b'"completion_tokens":64,"total_tokens":314}}')


async def in_process_us(stream: bool, n: int) -> tuple[float, float]:
    """CPU (us) of `ResponseCache` per miss (consult, fill, complete: entry made and stored)
    and per hit (consult: lookup, and the answer rendered in the form asked for), 1 KB prompts
    each unique, the in-process store."""
    from proxy.budget.principal import Principal
    from proxy.cache.cache import CacheQuery, Finished, ResponseCache
    from proxy.cache.store import MemoryCacheStore
    from proxy.config.cache import CacheConfig
    from proxy.protocol.usage import Usage

    config = CacheConfig(enabled=True)
    cache = ResponseCache(MemoryCacheStore(lambda: 1 << 30, time.time), lambda _: None,
                          time.time, lambda: config)
    principal = Principal("bench", cast(Any, None), key_id="0123456789ab")  # limits: unread
    finished = Finished(Usage(input_tokens=250, output_tokens=64), capped_ok=False)
    asks = [CacheQuery("chat", "m", "mock",
                       {**body(f"{PROMPT} {uuid.uuid4().hex}"), "stream": stream},
                       principal, "", 1100) for _ in range(n)]
    started = time.process_time()
    for ask in asks:
        fill = (await cache.consult(config, ask)).fill
        assert fill is not None
        for part in STREAM if stream else [JSON_ANSWER]:
            fill.take(part)
        await cache.complete(fill, config, finished)
    miss = (time.process_time() - started) / n * 1e6
    started = time.process_time()
    for ask in asks:
        hit = await cache.consult(config, ask)
        assert await cache.replay(hit, ask.body, stream=stream) is not None
    return miss, (time.process_time() - started) / n * 1e6


async def in_process(rounds: int, n: int) -> int:
    for stream in (False, True):
        figures = [await in_process_us(stream, n) for _ in range(rounds)]
        misses, hits = sorted(f[0] for f in figures), sorted(f[1] for f in figures)
        print(f"{'stream' if stream else 'JSON'}: per miss {misses[0]:.1f}-{misses[-1]:.1f} us, "
              f"per hit {hits[0]:.1f}-{hits[-1]:.1f} us ({rounds} x {n})")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=300, help="TTFT requests per path")
    parser.add_argument("--requests", type=int, default=2000, help="requests per CPU figure")
    parser.add_argument("--store", default=None,
                        help="a redis:// URL: the budget store, and so the cache, on Redis")
    parser.add_argument("--in-process", action="store_true",
                        help="only the cache's own CPU per miss and per hit, without a server")
    args = parser.parse_args()
    if args.in_process:
        return asyncio.run(in_process(args.rounds, args.requests))
    return asyncio.run(run(args.rounds, args.samples, args.requests, args.store))


if __name__ == "__main__":
    raise SystemExit(main())
