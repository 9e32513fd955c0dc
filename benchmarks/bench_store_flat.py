#!/usr/bin/env python3
"""Benchmark: the in-process budget store's cost per request stays flat after many requests.

    .venv/bin/python benchmarks/bench_store_flat.py [--requests 62000]

Reserves and settles requests of 50 users on `MemoryStore` (the default store: `serve
--upstream` and every config without `store.url`), with a clock advancing 10 ms per request, so
the settle markers (alive 600 s) pile up to 60,000 before the first expires. It prints the CPU
time per request over each thousand requests, at the start and at the end, and their ratio: a
cost that grows with the requests served is a bug even if a fresh process is fast. Before the
markers expired in time order, the end cost 4.1 ms a request against 0.54 ms at 11,000 (every
settle rebuilt the marker table once 10,000 were alive). Exits 1 if the ratio is over 2.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from proxy.budget.store import USER, InFlightLimit, MemoryStore, ReserveRequest, WindowAmount


async def run(requests: int) -> list[float]:
    now = [1_796_000_000.0]
    store = MemoryStore(lambda: now[0])
    in_flight = (InFlightLimit(USER, None),)
    per_thousand: list[float] = []
    started = time.process_time()
    for i in range(1, requests + 1):
        slot = f"tm:{{u{i % 50}}}"
        entries = (WindowAmount(f"{slot}:u:daily:{int(now[0] // 86400)}", 10**9, 30, 86400),
                   WindowAmount(f"{slot}:u:tpm:{int(now[0] // 60)}", 10**9, 30, 120))
        await store.reserve(slot, f"r{i}", ReserveRequest(entries, in_flight), 60)
        await store.settle(slot, f"r{i}", entries)
        now[0] += 0.01
        if i % 1000 == 0:
            t = time.process_time()
            per_thousand.append((t - started) / 1000 * 1000)  # ms per request
            started = t
    return per_thousand


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=62_000)
    args = parser.parse_args()
    costs = asyncio.run(run(args.requests))
    first = sorted(costs[1:6])[2]  # the median of thousands 2..6: past the warm-up
    last = sorted(costs[-5:])[2]
    ratio = last / first
    print(f"CPU per request, requests 2,000-6,000: {first:.4f} ms")
    print(f"CPU per request, last 5,000 of {args.requests:,}: {last:.4f} ms")
    verdict = "PASS" if ratio <= 2 else "MISS"
    print(f"ratio end / start: {ratio:.2f} x   (target <= 2 x)   {verdict}")
    return 0 if ratio <= 2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
