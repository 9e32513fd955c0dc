"""The soak's hostile client (`bench_soak.py`, on unless `--no-hostile`): bursts of what one
client can do to every other client of a replica, sent while the ordinary load runs, so the
soak's exact accounting checks hold through them (issue 20, items 1-7).

Each burst sends, at once, to every replica:
- gzip bombs: `Content-Encoding: gzip` bodies of about 1 MB that inflate to 1 GiB, without a
  key and with a valid one;
- large JSON bodies (28 MB, under `server.max_body_mb`) without a key;
- a wrong-key flood: small requests with keys no one has;
- huge prompts with a valid key (user `mallory`, a quota no one reaches), for a model served
  by a simulated upstream of its own (`HOSTILE_MODEL`): prompts of 2 MB of words and of `!`,
  answered whole (the upstream reports their usage: they join the client =
  proxy = mock check), and the same prompts from a client that hangs up while the upstream has
  them (charged their prompt, estimated);
- a reload storm: SIGHUP to every replica, twenty times, with the config file rewritten.

A probe client, a process of its own (so the hostile client's work in this one cannot delay
it), sends one small chat request every 50 ms to the last replica (never restarted by the
drill), for a model served by a simulated upstream of its own (the mock counts a huge
prompt on its event loop; the probe times the proxy, not that), through the whole load and
records how long each took; each is then placed inside a
burst or outside by its start (CLOCK_MONOTONIC is one clock for every process). The figures
are reported, not judged (a shared, noisy machine), but a replica that stalls for a burst
shows at once. Its requests join the soak's tally like any other.

A failed authentication has no access-log line of its own (issue 20, item 6), so the soak
compares the hostile client's 401s with `tokenmeter_auth_failures_total` instead, and leaves
them out of the access log = metrics check. What the hostile client saw is tallied apart
(`HostileTally`) by kind and status: requests the proxy answered are compared with its
counters in the soak's check 3; a request whose client got no status (a server that answers
401 and closes before a 28 MB body is sent may end the client's write with a reset) cannot be
placed there exactly and is counted as `no_status`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import time
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

HOST = "127.0.0.1"
CHAT = "/v1/chat/completions"
MALLORY_KEY = "sk-soak-mallory-000"
# The huge prompts' model, served by a simulated upstream of their own: the mock counts a prompt
# on its event loop (a second or more for 2 MB of `!`), and streams paced by the clock catch up
# after such a stall, which would let the ordinary load's disconnect slice finish upstream.
HOSTILE_MODEL = "hostile-gpt"
BOMB_INFLATED_MB = 1024
BIG_BODY_MB = 28
HUGE_PROMPT_MB = 2
WRONG_KEYS_PER_BURST = 300
SIGHUPS_PER_BURST = 20
PROBE_EVERY_S = 0.05
TIMEOUT = aiohttp.ClientTimeout(total=120, sock_connect=10, sock_read=60)


def gzip_bomb(inflated_mb: int = BOMB_INFLATED_MB) -> bytes:
    """One gzip member of `inflated_mb` MiB of spaces (about 1 KB per MiB compressed): one
    member, so a decoder that stops at its end still inflates all of it."""
    comp = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = b" " * (1 << 20)
    parts = [comp.compress(block) for _ in range(inflated_mb)]
    parts.append(comp.flush())
    return b"".join(parts)


def big_json(mb: int = BIG_BODY_MB) -> bytes:
    text = "x" * (mb << 20)
    return json.dumps({"model": "mock-gpt", "messages": [{"role": "user", "content": text}]}
                      ).encode()


def huge_prompt(kind: str, mb: int = HUGE_PROMPT_MB) -> str:
    return ("!" if kind == "bang" else "word ") * ((mb << 20) // (1 if kind == "bang" else 5))


@dataclass
class HostileTally:
    statuses: Counter[tuple[str, str]] = field(default_factory=Counter)  # (kind, status)
    bursts: int = 0
    sighups: int = 0
    windows: list[tuple[float, float]] = field(default_factory=list)  # bursts (monotonic)
    probe_quiet: list[float] = field(default_factory=list)  # seconds
    probe_burst: list[float] = field(default_factory=list)
    probe_failed: int = 0
    # The soak's cache phase (soak_cache), and the probe's requests that overlapped it.
    cache_window: tuple[float, float] | None = None
    probe_cache: list[float] = field(default_factory=list)

    def probed(self, started: float, took: float, ok: bool) -> None:
        self.probe_failed += not ok
        end = started + took
        if self.cache_window is not None and (
                self.cache_window[0] <= end and started <= self.cache_window[1]):
            self.probe_cache.append(took)
            return
        busy = any(a <= end and started <= b for a, b in self.windows)
        (self.probe_burst if busy else self.probe_quiet).append(took)

    def add(self, kind: str, status: int | None) -> None:
        self.statuses[(kind, "no_status" if status is None else str(status))] += 1

    def by_status(self) -> Counter[str]:
        """What the proxy should have counted, per status (requests without one left out)."""
        out: Counter[str] = Counter()
        for (_, status), n in self.statuses.items():
            if status != "no_status":
                out[status] += n
        return out

    @property
    def no_status(self) -> int:
        return sum(n for (_, s), n in self.statuses.items() if s == "no_status")

    def summary(self) -> dict[str, Any]:
        def pct(xs: list[float], q: float) -> float | None:
            if not xs:
                return None
            return round(sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1000, 1)

        return {
            "bursts": self.bursts, "sighups": self.sighups,
            "by_kind_status": {f"{k} {s}": n for (k, s), n in sorted(self.statuses.items())},
            "probe_ms": {
                name: {"n": len(xs), "p50": pct(xs, 0.5), "p99": pct(xs, 0.99),
                       "max": round(max(xs) * 1000, 1) if xs else None,
                       "mean": round(statistics.fmean(xs) * 1000, 1) if xs else None}
                for name, xs in (("outside_bursts", self.probe_quiet),
                                 ("during_bursts", self.probe_burst),
                                 ("during_cache_phase", self.probe_cache))},
            "probe_failed": self.probe_failed,
        }


Record = Callable[[str, int | None, tuple[int, int] | None], None]
"""(kind, status, usage the client read) of a request with a valid key: the soak's tally."""


@dataclass
class Hostile:
    urls: Callable[[], Sequence[str]]  # the replicas serving now
    pids: Callable[[], Sequence[int]]
    configs: Sequence[Path]
    tally: HostileTally
    record: Record
    bomb: bytes = b""
    big: bytes = b""
    busy: Counter[str] = field(default_factory=Counter)  # requests in flight, by replica URL

    async def prepare(self) -> None:
        self.bomb, self.big = await asyncio.gather(asyncio.to_thread(gzip_bomb),
                                                   asyncio.to_thread(big_json))

    async def _post(self, session: aiohttp.ClientSession, url: str, body: bytes,
                    headers: dict[str, str], *, hang_up_s: float | None = None
                    ) -> tuple[int | None, bytes]:
        timeout = TIMEOUT if hang_up_s is None else aiohttp.ClientTimeout(total=hang_up_s)
        self.busy[url] += 1
        try:
            async with session.post(url + CHAT, data=body, headers=headers,
                                    timeout=timeout) as resp:
                return resp.status, await resp.read()
        except (aiohttp.ClientError, TimeoutError):
            return None, b""
        finally:
            self.busy[url] -= 1

    async def _unkeyed(self, session: aiohttp.ClientSession, url: str, kind: str,
                       body: bytes, headers: dict[str, str]) -> None:
        status, _ = await self._post(session, url, body,
                                     {"Content-Type": "application/json", **headers})
        self.tally.add(kind, status)

    async def _keyed(  # noqa: PLR0913, PLR0917  one hostile request: what, where, when to hang up
        self, session: aiohttp.ClientSession, url: str, kind: str, body: bytes,
        headers: dict[str, str], hang_up_s: float | None = None,
    ) -> None:
        hdrs = {"Content-Type": "application/json", "Authorization": f"Bearer {MALLORY_KEY}",
                **headers}
        status, raw = await self._post(session, url, body, hdrs, hang_up_s=hang_up_s)
        if hang_up_s is not None:
            # The proxy saw the client go while the upstream had the request: 499.
            self.tally.add(kind, 499 if status is None else status)
            return
        usage = None
        if status == 200:
            u = json.loads(raw)["usage"]
            usage = (int(u["prompt_tokens"]), int(u["completion_tokens"]))
        self.record(kind, status, usage)

    async def _wrong_keys(self, session: aiohttp.ClientSession, url: str, base: int) -> None:
        body = json.dumps({"model": "mock-gpt", "messages": [{"role": "user", "content": "x"}]}
                          ).encode()
        for i in range(WRONG_KEYS_PER_BURST // 8):
            status, _ = await self._post(session, url, body, {
                "Content-Type": "application/json",
                "Authorization": f"Bearer sk-wrong-{base}-{i}"})
            self.tally.add("wrong-key", status)

    async def _reload_storm(self) -> None:
        for path in self.configs:
            path.write_bytes(path.read_bytes())  # a new mtime: the watcher reloads too
        for _ in range(SIGHUPS_PER_BURST):
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGHUP)
                    self.tally.sighups += 1
                except ProcessLookupError:
                    pass
            await asyncio.sleep(0.02)

    async def burst(self, session: aiohttp.ClientSession, n: int) -> None:
        self.tally.bursts += 1
        begun = time.monotonic()
        try:
            jobs: list[Any] = [self._reload_storm()]
            gz = {"Content-Encoding": "gzip"}
            for i, url in enumerate(self.urls()):
                jobs += [self._unkeyed(session, url, "gzip-bomb-no-key", self.bomb, gz)
                         for _ in range(2)]
                jobs.append(self._keyed(session, url, "gzip-bomb-keyed", self.bomb, gz))
                jobs += [self._unkeyed(session, url, "big-body-no-key", self.big, {})
                         for _ in range(2)]
                jobs += [self._wrong_keys(session, url, n * 100 + i * 10 + j) for j in range(8)]
                for shape in ("words", "bang"):
                    body = json.dumps({"model": HOSTILE_MODEL, "messages": [
                        {"role": "user", "content": huge_prompt(shape)}]}).encode()
                    quick = {"x-mock-output-tokens": "8", "x-mock-ttft-ms": "10"}
                    jobs.append(self._keyed(session, url, f"huge-prompt-{shape}", body, quick))
                    slow = {"x-mock-output-tokens": "8", "x-mock-ttft-ms": "5000"}
                    jobs.append(self._keyed(session, url, f"huge-prompt-{shape}-hang-up",
                                            body, slow, hang_up_s=2.0))
            await asyncio.gather(*jobs)
        finally:
            self.tally.windows.append((begun, time.monotonic()))

    async def run(self, session: aiohttp.ClientSession, start_at: float, stop_at: float,
                  every_s: float) -> None:
        """Bursts from `start_at` every `every_s` seconds; none starts after `stop_at`."""
        n = 0
        at = start_at
        while at < stop_at:
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            await self.burst(session, n)
            n += 1
            at = max(at + every_s, time.monotonic() + 1.0)


PROBE_BODY = json.dumps({"model": "probe-gpt", "messages": [{"role": "user", "content": "Say hi."}]}
                        ).encode()
PROBE_HEADERS = {"Content-Type": "application/json", "x-mock-output-tokens": "8",
                 "x-mock-tokens-per-second": "3000", "x-mock-ttft-ms": "10"}


async def _probe(url: str, key: str, stop_at: float) -> None:
    """One small request every PROBE_EVERY_S until `stop_at` (monotonic); a JSON line each:
    start, seconds taken, status, the usage read."""
    headers = {**PROBE_HEADERS, "Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < stop_at:
            t0 = time.monotonic()
            status, usage = None, None
            try:
                async with session.post(url + CHAT, data=PROBE_BODY, headers=headers,
                                        timeout=TIMEOUT) as resp:
                    status, raw = resp.status, await resp.read()
                    if status == 200:
                        u = json.loads(raw)["usage"]
                        usage = [u["prompt_tokens"], u["completion_tokens"]]
            except (aiohttp.ClientError, TimeoutError):
                pass
            took = time.monotonic() - t0
            print(json.dumps({"t0": t0, "took": took, "status": status, "usage": usage}),
                  flush=True)
            await asyncio.sleep(max(0.0, PROBE_EVERY_S - took))


def probe_argv(url: str, key: str, stop_at: float) -> list[str]:
    return [sys.executable, __file__, "probe", url, key, repr(stop_at)]


def main() -> None:
    parser = argparse.ArgumentParser(description="the soak's probe client (a process)")
    parser.add_argument("what", choices=("probe",))
    parser.add_argument("url")
    parser.add_argument("key")
    parser.add_argument("stop_at", type=float, help="time.monotonic() to stop at")
    args = parser.parse_args()
    asyncio.run(_probe(args.url, args.key, args.stop_at))


if __name__ == "__main__":
    main()
