"""The soak's cache phase (`bench_soak.py`, on with the hostile client; issue 31, items 5-7): what
one client can do to the others through the response cache, sent while the ordinary load runs.

The cache answers one model only (`CACHE_MODEL`, served by a simulated upstream of its own), so
the rest of the soak's load is never cached and its exact checks stay what they were. The phase:
- a large entry: `dave` (limited to `DAVE_RPM` requests a minute and 1 at a time) asks once for
  a long streamed answer (some 4 MB of events: a stream entry, reassembled on its hits), then
  `hitters` clients send him the same request as fast as they can, as JSON and as streams, for
  `seconds`: hits while his rate allows, 429s after (a hit of that entry used to cost some
  110 ms of CPU each, uncounted);
- a stalled single-flight leader: `erin` sends a streamed request for a long answer on a raw
  socket and reads nothing after its status line, then her other key sends the identical
  request: it must be answered (going upstream itself), not held for `lock_timeout_s`;
- long fills: `fills` long streamed misses of `erin` at once (each some `fill_tokens` tokens,
  1 MB at the soak's size): together past `cache.fills_mb`, the process keeps at most that.

Every answer is tallied like the soak's own requests (`Record`): a miss's usage joins the
client = proxy = mock check, a hit (no upstream call) and a 429 are requests without usage, the
stalled leader a request whose client got no status. Its own checks (`CacheTally.problems`):
the rate limit held for hits (at most `DAVE_RPM` a minute window), the team-mate was answered,
every fill was answered. The probe's latency during the phase and the RSS bound are the soak's
(checks 8 and 9)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import aiohttp

CACHE_MODEL = "cache-gpt"
CHAT = "/v1/chat/completions"
DAVE_KEY = "sk-soak-dave-000"
ERIN_KEYS = ("sk-soak-erin-000", "sk-soak-erin-001")
DAVE_RPM = 2
BIG_OUTPUT = 10**6  # their `max_output_tokens`: the long answers' caps are their own
TIMEOUT = aiohttp.ClientTimeout(total=120, sock_connect=10, sock_read=60)
# The team-mate of a stalled leader waits at most this long (the soak's bound on it): far
# below the lock's `lock_timeout_s`.
TEAM_MATE_BOUND_S = 20.0


@dataclass(frozen=True)
class Sizes:
    entry_tokens: int  # the large entry's answer (some 265 bytes of events a token)
    hitters: int  # clients hitting it at once
    seconds: float  # how long they hit it
    fills: int  # long misses at once
    fill_tokens: int
    leader_tokens: int  # the stalled leader's answer: longer than any socket buffer


FULL = Sizes(entry_tokens=15_000, hitters=8, seconds=20.0, fills=64, fill_tokens=4_000,
             leader_tokens=200_000)
QUICK = Sizes(entry_tokens=2_000, hitters=4, seconds=3.0, fills=8, fill_tokens=500,
              leader_tokens=100_000)


def users() -> dict[str, Any]:
    """The phase's users, for the proxy's `users:`."""
    return {"dave": {"keys": [DAVE_KEY], "requests_per_minute": DAVE_RPM,
                     "max_concurrent_requests": 1, "max_output_tokens": BIG_OUTPUT},
            "erin": {"keys": list(ERIN_KEYS), "max_output_tokens": BIG_OUTPUT}}


def cache_config() -> dict[str, Any]:
    """The proxy's `cache:`: on for `CACHE_MODEL` only; an entry's stream up to 8 MB."""
    return {"enabled": True, "models": [CACHE_MODEL], "max_entry_kb": 512}


class Who(NamedTuple):
    kind: str  # the phase's name for the request
    user: str
    key: str


Record = Callable[[str, str, int | None, tuple[int, int] | None], None]
"""(kind, user, status, usage read: None for a hit, a refusal or an error) of one request."""


@dataclass
class CacheTally:
    results: Counter[str] = field(default_factory=Counter)  # "kind result"
    dave_admitted: int = 0  # his requests answered (200)
    team_mate_s: float | None = None
    team_mate: str = ""
    fills_done: int = 0
    window: tuple[float, float] | None = None  # monotonic
    minutes: int = 0  # clock minutes the phase touched: dave's rate allows DAVE_RPM in each
    errors: list[str] = field(default_factory=list)

    def problems(self, sizes: Sizes) -> list[str]:
        out = list(self.errors)
        if self.dave_admitted > DAVE_RPM * self.minutes:
            out.append(f"dave's rate limit did not hold for hits: {self.dave_admitted} "
                       f"answered in {self.minutes} clock minutes")
        if not self.results["dave-hit hit"]:
            out.append("the large entry was never hit")
        if not self.results["dave-hit refused"]:
            out.append("dave's hits were never refused")
        if self.team_mate != "answered":
            out.append(f"the stalled leader's team-mate: {self.team_mate or 'not sent'}")
        if self.fills_done != sizes.fills:
            out.append(f"{sizes.fills - self.fills_done} of {sizes.fills} fills not answered")
        return out

    def summary(self, sizes: Sizes) -> dict[str, Any]:
        return {"results": dict(sorted(self.results.items())),
                "dave_answered": self.dave_admitted, "clock_minutes": self.minutes,
                "team_mate_s": None if self.team_mate_s is None else round(self.team_mate_s, 2),
                "team_mate": self.team_mate, "fills_answered": self.fills_done,
                "sizes": sizes.__dict__, "problems": self.problems(sizes)}


def _body(prompt: str, *, stream: bool) -> bytes:
    body: dict[str, Any] = {"model": CACHE_MODEL, "temperature": 0, "max_tokens": BIG_OUTPUT,
                            "messages": [{"role": "user", "content": prompt}]}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return json.dumps(body).encode()


def _usage(raw: bytes, *, stream: bool) -> tuple[int, int]:
    if stream:  # the usage chunk: the last event before `[DONE]`
        event = raw[:raw.rindex(b"data: [DONE]")].rstrip().rsplit(b"\n\n", 1)[-1]
        usage = json.loads(event.removeprefix(b"data: "))["usage"]
    else:
        usage = json.loads(raw)["usage"]
    return int(usage["prompt_tokens"]), int(usage["completion_tokens"])


@dataclass
class CachePhase:
    url: str  # a replica (the phase's requests all go to one: its process is what is bound)
    record: Record
    sizes: Sizes
    tally: CacheTally = field(default_factory=CacheTally)

    async def _ask(self, session: aiohttp.ClientSession, who: Who, body: bytes,
                   headers: dict[str, str], *, stream: bool) -> str:
        """Its result: hit, miss, refused, or an error; tallied and recorded."""
        kind, user, key = who
        hdrs = {"Authorization": f"Bearer {key}", "Content-Type": "application/json", **headers}
        status, usage, result = None, None, "no_status"
        try:
            async with session.post(self.url + CHAT, data=body, headers=hdrs,
                                    timeout=TIMEOUT) as resp:
                status, raw = resp.status, await resp.read()
                cached = resp.headers.get("x-tokenmeter-cache")
            if status == 200:
                result = "hit" if cached == "hit" else "miss"
                if result == "miss":  # it went upstream: its usage joins the soak's check
                    usage = await asyncio.to_thread(_usage, raw, stream=stream)
            else:
                result = "refused" if status == 429 else f"http_{status}"
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as exc:
            self.tally.errors.append(f"{kind}: {type(exc).__name__}: {exc}"[:300])
        if user == "dave" and status == 200:
            self.tally.dave_admitted += 1
        self.tally.results[f"{kind} {result}"] += 1
        self.record(kind, user, status, usage)
        return result

    async def _hitter(self, session: aiohttp.ClientSession, n: int, stop_at: float) -> None:
        i = 0
        while time.monotonic() < stop_at:
            stream = (n + i) % 2 == 1
            await self._ask(session, Who("dave-hit", "dave", DAVE_KEY),
                            _body("the large one", stream=stream), {}, stream=stream)
            i += 1

    async def _stalled_leader(self, session: aiohttp.ClientSession) -> None:
        """A leader that reads nothing after its status line, and its team-mate's request."""
        host, port = self.url.removeprefix("http://").split(":")
        body = _body("the stalled one", stream=True)
        raw = socket.socket()
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        raw.setblocking(False)
        loop = asyncio.get_running_loop()
        try:
            await loop.sock_connect(raw, (host, int(port)))
            await loop.sock_sendall(raw, (
                f"POST {CHAT} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {ERIN_KEYS[0]}"
                f"\r\nContent-Type: application/json\r\nx-mock-output-tokens: "
                f"{self.sizes.leader_tokens}\r\nx-mock-tokens-per-second: 0\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode() + body)
            # Its status line: the proxy has its flight open and its upstream answering.
            async with asyncio.timeout(30):
                await loop.sock_recv(raw, 12)
            started = time.monotonic()
            result = "timed_out"
            try:
                async with asyncio.timeout(TEAM_MATE_BOUND_S):
                    result = await self._ask(session, Who("team-mate", "erin", ERIN_KEYS[1]), body,
                                             {"x-mock-output-tokens": "8"}, stream=True)
            except TimeoutError:
                pass
            self.tally.team_mate_s = time.monotonic() - started
            self.tally.team_mate = "answered" if result in ("miss", "hit") else result
        finally:
            raw.close()
            self.tally.results["stalled-leader no_status"] += 1
            self.record("stalled-leader", "erin", None, None)

    async def _fill(self, session: aiohttp.ClientSession, n: int) -> None:
        result = await self._ask(
            session, Who("long-fill", "erin", ERIN_KEYS[n % 2]),
            _body(f"long fill {n}", stream=True),
            {"x-mock-output-tokens": str(self.sizes.fill_tokens),
             "x-mock-tokens-per-second": "2000"}, stream=True)
        self.tally.fills_done += result == "miss"

    async def run(self, session: aiohttp.ClientSession) -> None:
        begun, minute = time.monotonic(), int(time.time() // 60)
        try:
            first = await self._ask(
                session, Who("dave-entry", "dave", DAVE_KEY), _body("the large one", stream=True),
                {"x-mock-output-tokens": str(self.sizes.entry_tokens),
                 "x-mock-tokens-per-second": "0"}, stream=True)
            if first != "miss":
                self.tally.errors.append(f"the large entry's first request: {first}")
            stop_at = time.monotonic() + self.sizes.seconds
            await asyncio.gather(
                *(self._hitter(session, n, stop_at) for n in range(self.sizes.hitters)),
                self._stalled_leader(session),
                *(self._fill(session, n) for n in range(self.sizes.fills)))
        finally:
            self.tally.window = (begun, time.monotonic())
            self.tally.minutes = int(time.time() // 60) - minute + 1
