"""`serve --workers 2`: a real supervisor and its worker processes on one port, one real
redis-server, the real openai SDK over loopback. The budget races of test_budget.py and
test_budget_windows.py hold across workers as across replicas; /metrics (whichever worker
answers) sums every worker; a worker killed mid-stream is started again and its reservation
released by its lease; SIGHUP reaches every worker and SIGTERM drains them all."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import redis.asyncio as aioredis
from aiohttp.test_utils import TestServer
from prometheus_client.mmap_dict import MmapedDict

from proxy.budget import limits as lim
from proxy.config.load import Config, parse_config
from proxy.config.policy import Policy, Price
from proxy.cost import CostLines
from proxy.protocol.usage import Usage
from proxy.server.workers import budget_sharing_problem, configured_limits, parse_workers
from proxy.testing.mock_upstream import MockSettings
from tests.helpers import (
    ALICE_KEY,
    BOB_KEY,
    MESSAGES,
    ROOT,
    Samples,
    ask_usage,
    budget_yaml,
    relayed,
    sample,
    until,
)
from tests.servers import free_port, ledger_shippers

pytestmark = pytest.mark.timeout(90)

CACHED = 4
PRICE = Price(input=1.0, output=2.0, cached_input=0.5)
PRICES = "prices:\n  mock-gpt: {input: 1.0, output: 2.0, cached_input: 0.5}\n"
START_S = 30.0  # two fresh interpreters importing and loading tokenizers on a loaded 2-core box


@pytest.fixture
def mock_settings() -> MockSettings:
    return MockSettings(tokens_per_second=0, ttft_ms=5, output_tokens=16, cached_tokens=CACHED)


@dataclass
class Workers:
    """A supervisor this test started, read through its log (stderr, JSON lines) and its
    workers' prometheus_client files."""

    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    tmp: Path  # the supervisor's TMPDIR: its metrics directory is made in there
    config: Config

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def lines(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out

    def messages(self) -> list[str]:
        return [str(x.get("message", "")) for x in self.lines()]

    def pids(self) -> dict[int, int]:
        """Worker index -> the pid it runs as now (the latest start)."""
        out: dict[int, int] = {}
        for message in self.messages():
            if message.startswith("worker ") and " started (pid " in message:
                index, pid = message.split()[1], message.rsplit("pid ", 1)[1].rstrip(")")
                out[int(index)] = int(pid)
        return out

    def serving(self) -> set[int]:
        return {int(m.split("(pid ")[1].split(")")[0]) for m in self.messages()
                if m.startswith("worker ") and ") serving " in m}

    async def ready(self, workers: int = 2) -> None:
        def check() -> bool:
            assert self.proc.poll() is None, self.tail()
            pids = self.pids()
            return len(pids) == workers and set(pids.values()) <= self.serving()

        await until(check, deadline=START_S, every=0.05)

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])

    def metrics_dir(self) -> Path:
        (found,) = self.tmp.glob("tokenmeter-metrics-*")
        return found

    def written(self, kind: str, pid: int, name: str) -> float:
        """The sum of `name`'s samples in one process's own multiprocess file."""
        path = self.metrics_dir() / f"{kind}_{pid}.db"
        if not path.exists():
            return 0.0
        total = 0.0
        values = MmapedDict.read_all_values_from_file(str(path))  # type: ignore[no-untyped-call]
        for key, value, _, _ in values:
            if json.loads(key)[1] == name:
                total += value
        return total

    async def scrape(self) -> Samples:
        from prometheus_client.parser import text_string_to_metric_families

        port = self.config.metrics.port or self.port
        async with aiohttp.ClientSession() as s, s.get(
                f"http://127.0.0.1:{port}/metrics") as r:
            assert r.status == 200
            text = await r.text()
        out: Samples = {}
        for family in text_string_to_metric_families(text):
            for smp in family.samples:
                out[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value
        return out

    def sdk(self, key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0)


@contextlib.asynccontextmanager
async def supervised(tmp_path: Path, config_text: str, *flags: str) -> AsyncIterator[Workers]:
    cfg = tmp_path / "tm.yaml"
    cfg.write_text(config_text)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    log = tmp_path / "supervisor.log"
    port = free_port()
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "proxy", "serve", "--config", str(cfg), "--port", str(port),
             *flags],
            stdout=subprocess.DEVNULL, stderr=err, env={**os.environ, "TMPDIR": str(tmp)},
        )
    workers = Workers(proc, port, log, tmp, parse_config(config_text, "tm.yaml"))
    try:
        await workers.ready()
        yield workers
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, 30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def users(body: dict[str, dict[str, Any]]) -> str:
    """The `users:` section's body as budget_yaml wants it (indented YAML)."""
    lines = []
    for name, fields in body.items():
        lines.append(f"  {name}:")
        lines.extend(f"    {k}: {json.dumps(v)}" for k, v in fields.items())
    return "\n".join(lines)


async def counter(redis_url: str, config: Config, user: str, name: str) -> int:
    """The store's counter of `user`'s window `name`, read straight from Redis."""
    window = next(w for w in lim.windows_at(config, user, time.time()) if w.name == name)
    r = aioredis.Redis.from_url(redis_url)
    try:
        value = await r.get(window.key)
    finally:
        await r.aclose()
    return int(value or 0)


@dataclass(frozen=True)
class Served:
    input: int
    cached: int
    output: int
    stream: bool

    @property
    def tokens(self) -> int:
        return self.input + self.output

    @property
    def cost(self) -> int:
        usage = Usage(input_tokens=self.input, output_tokens=self.output,
                      cached_input_tokens=self.cached)
        return CostLines.of(PRICE, usage).nanousd


async def ask(client: openai.AsyncOpenAI, stream: bool) -> Served:
    prompt, cached, completion = await ask_usage(client, stream)
    return Served(prompt, cached, completion, stream)


async def race(workers: Workers, key: str, n: int, stream_every: int
               ) -> tuple[list[Served], list[openai.RateLimitError]]:
    """`n` requests at once through two clients (two connection pools), streamed unless
    `j % stream_every == 0`."""
    clients = [workers.sdk(key), workers.sdk(key)]
    try:
        results = await asyncio.gather(
            *(ask(clients[j % 2], stream=j % stream_every != 0) for j in range(n)),
            return_exceptions=True,
        )
    finally:
        for c in clients:
            await c.close()
    served = [r for r in results if isinstance(r, Served)]
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert len(served) + len(refused) == n, [r for r in results if isinstance(r, Exception)
                                             and not isinstance(r, openai.RateLimitError)][:3]
    return served, refused


async def both_served(workers: Workers) -> None:
    """Each worker counted requests of its own (in its pid's file, written within a second),
    so the port was shared."""

    def per_worker() -> dict[int, float]:
        return {pid: workers.written("counter", pid, "tokenmeter_requests_total")
                for pid in workers.pids().values()}

    try:
        await until(lambda: len(per_worker()) == 2 and all(per_worker().values()), deadline=5)
    except TimeoutError:
        raise AssertionError(f"requests per worker pid: {per_worker()}") from None


# --- budgets and metrics ------------------------------------------------------------------------
async def test_concurrent_streams_never_exceed_quota_across_workers(
    upstream: TestServer, redis_url: str, tmp_path: Path
) -> None:
    """test_budget.py's race on two workers of one proxy; then /metrics, answered by either
    worker, equals what the clients received, and the one SQLite ledger has every row."""
    config = budget_yaml(
        str(upstream.make_url("/v1")), redis_url,
        users({"alice": {"keys": [ALICE_KEY], "daily_tokens": 1500, "max_output_tokens": 20}}),
        extra="server:\n  workers: 2\n",
    )
    async with supervised(tmp_path, config) as workers:
        n = 240
        served, refused = await race(workers, ALICE_KEY, n, stream_every=n + 1)
        assert served and refused, (len(served), len(refused))
        used = sum(s.tokens for s in served)
        assert used <= 1500
        for exc in refused:
            assert exc.status_code == 429 and exc.code == "daily_quota_exceeded"
        assert await counter(redis_url, workers.config, "alice", "daily_tokens") == used
        await both_served(workers)

        expected = {
            ("tokenmeter_requests_total", "200"): len(served),
            ("tokenmeter_requests_total", "429"): len(refused),
        }

        async def metrics_match() -> bool:
            m = await workers.scrape()
            return (
                all(sample(m, name, status=status) == count
                    for (name, status), count in expected.items())
                and sample(m, "tokenmeter_tokens_total", type="input")
                == sum(s.input for s in served)
                and sample(m, "tokenmeter_tokens_total", type="output")
                == sum(s.output for s in served)
            )

        try:
            await until(metrics_match, deadline=10)
        except TimeoutError:
            m = await workers.scrape()
            assert {k: sample(m, k[0], status=k[1]) for k in expected} == expected
            raise
        # Histograms too: a duration per request (refused ones too), a TTFT per stream served,
        # whichever worker served it; requests in flight summed over live workers.
        m = await workers.scrape()
        assert sample(m, "gen_ai_server_request_duration_seconds_count") == n
        assert sample(m, "gen_ai_server_time_to_first_token_seconds_count") == sum(
            s.stream for s in served)
        assert sample(m, "tokenmeter_inter_chunk_latency_seconds_count") > 0
        assert sample(m, "tokenmeter_active_requests") == 0
        assert sample(m, "tokenmeter_store_errors_total") == 0
        assert sample(m, "tokenmeter_worker_restarts_total") == 0

        # Both workers' shippers write one SQLite file (WAL, busy timeout): every row arrives.
        db = Path(os.environ["TOKENMETER_STATE_DIR"]) / "ledger.sqlite3"

        def rows() -> tuple[int, int]:
            with contextlib.closing(sqlite3.connect(db, timeout=10)) as conn:
                count, tokens = conn.execute(
                    "SELECT count(*), coalesce(sum(input_tokens + output_tokens), 0) "
                    "FROM tokenmeter_requests WHERE status = 200").fetchone()
            return int(count), int(tokens)

        await until(lambda: db.exists() and rows() == (len(served), used), deadline=15)


async def test_cost_budgets_hold_to_the_nanodollar_across_workers(
    upstream: TestServer, redis_url: str, tmp_path: Path
) -> None:
    """test_budget_windows.py's cost race (streamed and not, cached input at its own price) on
    two workers: not one nano-dollar over, settled at the real cost."""
    config = budget_yaml(
        str(upstream.make_url("/v1")), redis_url,
        users({"alice": {"keys": [ALICE_KEY], "daily_usd": 0.002, "max_output_tokens": 20}}),
        extra=PRICES,
    )
    async with supervised(tmp_path, config, "--workers", "2") as workers:
        served, refused = await race(workers, ALICE_KEY, 120, stream_every=3)
        assert served and refused, (len(served), len(refused))
        assert all(s.cached == CACHED for s in served)
        spent = sum(s.cost for s in served)
        assert spent <= 2_000_000  # zero nano-dollars over
        for exc in refused:
            assert exc.code == "daily_budget_exceeded"
            assert "cost budget reached for user 'alice'" in exc.message
        # Settled at the real cost (cached input at its price), not the reserved worst case.
        assert await counter(redis_url, workers.config, "alice", "daily_usd") == spent
        await both_served(workers)


# --- a worker that dies -------------------------------------------------------------------------
async def _open_stream(session: aiohttp.ClientSession, url: str, key: str, tokens: int,
                       per_second: int) -> tuple[aiohttp.ClientResponse, bytes]:
    resp = await session.post(
        url + "/v1/chat/completions",
        json={"model": "mock-gpt", "messages": MESSAGES, "stream": True},
        headers={"Authorization": f"Bearer {key}", "x-mock-output-tokens": str(tokens),
                 "x-mock-tokens-per-second": str(per_second)},
    )
    assert resp.status == 200
    return resp, await resp.content.readany()  # under way: reserved, first bytes relayed


def _server_of(workers: Workers, resp: aiohttp.ClientResponse) -> int:
    """The worker pid holding the server end of `resp`'s connection: its TCP socket's inode
    (/proc/net/tcp, by the client's port) among the workers' file descriptors."""
    assert resp.connection is not None and resp.connection.transport is not None
    client_port = resp.connection.transport.get_extra_info("sockname")[1]
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, remote = (int(f.rsplit(":", 1)[1], 16) for f in fields[1:3])
            if (local, remote) == (workers.port, client_port):
                inodes.add(f"socket:[{fields[9]}]")
    for pid in workers.pids().values():
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                if os.readlink(fd) in inodes:
                    return pid
    raise AssertionError(f"no worker holds the connection from port {client_port}")


async def test_a_killed_worker_is_restarted_and_its_reservation_released_by_lease(
    upstream: TestServer, redis_url: str, tmp_path: Path
) -> None:
    config = budget_yaml(
        str(upstream.make_url("/v1")), redis_url,
        users({"bob": {"keys": [BOB_KEY], "max_concurrent_requests": 1, "daily_tokens": 100_000,
                       "max_output_tokens": 400}}),
        lease_seconds=1,
    )
    async with supervised(tmp_path, config, "--workers", "2") as workers, \
            aiohttp.ClientSession() as session:
        before = workers.pids()
        stream, _ = await _open_stream(session, workers.url, BOB_KEY, 300, 20)  # 15 s
        victim = _server_of(workers, stream)
        # bob holds his one concurrent request: a second is refused while it runs.
        client = workers.sdk(BOB_KEY)
        with pytest.raises(openai.RateLimitError):
            await client.chat.completions.create(model="mock-gpt", messages=MESSAGES)

        r = aioredis.Redis.from_url(redis_url)
        slot = lim.plan(workers.config, "bob", lim.limits_for(workers.config, "bob"), "mock-gpt",
                        time.time()).slot
        try:
            assert await r.zcard(f"{slot}:inflight") == 1  # the stream's reservation
        finally:
            await r.aclose()
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(aiohttp.ClientError):  # the stream is cut, never finished
            async with asyncio.timeout(10):
                async for _ in stream.content.iter_any():
                    pass
                raise aiohttp.ClientPayloadError("EOF")  # no [DONE] check needed: cut short
        stream.release()

        # The dead worker's reservation stays until its lease (1 s) runs out; then bob's next
        # request reaps it and is served. No other worker renews it: it was not theirs.
        served: list[Served] = []

        async def bob_served() -> bool:
            try:
                served.append(await ask(client, stream=False))
            except openai.RateLimitError:
                return False
            return True

        await until(bob_served, deadline=15, every=0.1)
        await client.close()
        r = aioredis.Redis.from_url(redis_url)
        try:
            assert await r.zcard(f"{slot}:inflight") == 0
            assert await r.hlen(f"{slot}:reserved") == 0
        finally:
            await r.aclose()
        # Released, not charged: only the request that finished counts.
        assert await counter(redis_url, workers.config, "bob", "daily_tokens") == (
            served[0].tokens)

        # Meanwhile the dead worker was started again, under a new pid, and serves.
        def restarted() -> bool:
            now = workers.pids()
            return set(now.values()) - set(before.values()) <= workers.serving() and (
                len(set(now.values()) - set(before.values())) == 1)

        await until(restarted, deadline=START_S, every=0.05)
        assert any("died (signal SIGKILL)" in m for m in workers.messages())
        m = await workers.scrape()
        assert sample(m, "tokenmeter_worker_restarts_total") == 1
        assert sample(m, "tokenmeter_active_requests") == 0  # the dead worker's gauge is gone


# --- signals ------------------------------------------------------------------------------------
def _refuses(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return False
    except OSError:
        return True


async def test_sighup_reaches_every_worker_and_sigterm_drains_them(
    upstream: TestServer, tmp_path: Path
) -> None:
    metrics_port = free_port()  # its own port: bound by the supervisor too
    config = (f"server:\n  drain_seconds: 20\nupstreams:\n  mock:\n    base_url: "
              f"{upstream.make_url('/v1')}\nmetrics:\n  discover_models: false\n"
              f"  port: {metrics_port}\n")
    async with supervised(tmp_path, config, "--workers", "2") as workers:
        # The file is unchanged, so only the forwarded signal makes each worker reload.
        workers.proc.send_signal(signal.SIGHUP)

        async def reloaded_twice() -> bool:
            return sample(await workers.scrape(), "tokenmeter_config_reloads_total",
                          result="ok") == 2

        await until(reloaded_twice, deadline=10, every=0.05)

        # A stream on each worker (the kernel picks who accepts: open until both have one).
        async with aiohttp.ClientSession() as session:
            streams: list[tuple[aiohttp.ClientResponse, bytes]] = []
            holders: set[int] = set()
            while len(holders) < 2:
                assert len(streams) < 24, "the kernel gave every connection to one worker"
                streams.append(await _open_stream(session, workers.url, "none", 60, 30))
                holders.add(_server_of(workers, streams[-1][0]))
            metrics_dir = workers.metrics_dir()
            workers.proc.send_signal(signal.SIGTERM)
            await until(lambda: asyncio.to_thread(lambda: all(
                _refuses(p) for p in (workers.port, metrics_port))), deadline=10)
            for resp, first in streams:  # each running stream finishes whole (2 s at 30 tok/s)
                body = first + await resp.content.read()
                assert relayed(body).rstrip().endswith(b"data: [DONE]")
                assert body.count(b'"content":" ') == 60
        assert await asyncio.to_thread(workers.proc.wait, 30) == 0
        assert not metrics_dir.exists()  # the supervisor's private directory is gone
        access = [x for x in workers.lines() if x.get("event") == "request"]
        assert len(access) == len(streams)
        assert all(x["output_tokens"] == 60 and x["error_class"] == "none" for x in access)


async def test_user_info_follows_a_reload_of_every_worker(
    upstream: TestServer, tmp_path: Path
) -> None:
    """The workers' shared files cannot forget a series: after a reload, a dropped user and a
    user's former team read 0 (the dashboards join on `tokenmeter_user_info == 1`)."""
    head = (f"upstreams:\n  mock:\n    base_url: {upstream.make_url('/v1')}\n"
            "metrics:\n  discover_models: false\nusers:\n")
    before = users({"alice": {"keys": ["sk-alice-0123456789"], "team": "a"},
                    "bob": {"keys": ["sk-bob-0123456789"]}})
    after = users({"alice": {"keys": ["sk-alice-0123456789"], "team": "b"}})

    def info(samples: Samples) -> dict[str, float]:
        return {f"{dict(lab)['user']}/{dict(lab)['team']}": v for (n, lab), v in samples.items()
                if n == "tokenmeter_user_info"}

    async with supervised(tmp_path, head + before + "\n", "--workers", "2") as workers:
        async def published(want: dict[str, float]) -> bool:
            return info(await workers.scrape()) == want

        await until(lambda: published({"alice/a": 1.0, "bob/": 1.0}), deadline=10, every=0.05)
        (tmp_path / "tm.yaml").write_text(head + after + "\n")
        workers.proc.send_signal(signal.SIGHUP)
        await until(lambda: published({"alice/a": 0.0, "bob/": 0.0, "alice/b": 1.0}),
                    deadline=10, every=0.05)
        assert sample(await workers.scrape(), "tokenmeter_config_reloads_total",
                      result="ok") == 2


async def test_workers_drain_and_exit_when_their_supervisor_is_killed(
    upstream: TestServer, tmp_path: Path
) -> None:
    """SIGKILL leaves no supervisor to forward SIGTERM: each worker notices and exits."""
    config = (f"upstreams:\n  mock:\n    base_url: {upstream.make_url('/v1')}\n"
              "metrics:\n  discover_models: false\n")
    async with supervised(tmp_path, config, "--workers", "2") as workers:
        pids = list(workers.pids().values())
        workers.proc.kill()
        workers.proc.wait(10)

        def gone() -> bool:
            # A worker reparented to init and exited is reaped by it; one in the zombie state
            # (reparented to a subreaper that has not reaped yet) has exited too.
            for pid in pids:
                with contextlib.suppress(FileNotFoundError):
                    if Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z":
                        return False
            return True

        await until(gone, deadline=20, every=0.1)
        await until(lambda: asyncio.to_thread(_refuses, workers.port), deadline=5)


# --- the ledger's one shipper process ---------------------------------------------------------
async def test_one_shipper_for_all_workers_restarted_when_killed_rows_neither_lost_nor_doubled(
    upstream: TestServer, tmp_path: Path
) -> None:
    """`--workers 2` runs exactly one ledger shipper, the supervisor's child. SIGKILLed while
    rows flow, it is started again, and every answered request has exactly one row."""
    books = tmp_path / "books.sqlite3"
    config = (f"upstreams:\n  mock:\n    base_url: {upstream.make_url('/v1')}\n"
              f"metrics:\n  discover_models: false\nledger:\n  url: sqlite://{books}\n"
              f"  spool_dir: {tmp_path / 'spool'}\n")
    body = {"model": "mock-gpt", "messages": [{"role": "user", "content": "hi"}]}
    ids: list[str] = []
    async with supervised(tmp_path, config, "--workers", "2") as workers, \
            aiohttp.ClientSession() as session:

        async def load(n: int) -> None:
            async def one() -> None:
                async with session.post(workers.url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200
                    await r.read()
                    ids.append(r.headers["x-tokenmeter-request-id"])
            await asyncio.gather(*(one() for _ in range(n)))

        family = {workers.proc.pid, *workers.pids().values()}
        ours = {pid: parent for pid, parent in ledger_shippers().items() if parent in family}
        assert list(ours.values()) == [workers.proc.pid]  # one, the supervisor's, none a worker's
        (first,) = ours
        await load(40)
        rows_flow = asyncio.create_task(load(200))
        os.kill(first, signal.SIGKILL)
        await rows_flow

        def restarted() -> bool:
            now = {p for p, parent in ledger_shippers().items() if parent == workers.proc.pid}
            return len(now) == 1 and first not in now

        await until(restarted, deadline=START_S, every=0.05)
        await load(40)
        workers.proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(workers.proc.wait, 60) == 0
    assert any(f"the ledger shipper (pid {first}) died (signal SIGKILL)" in m
               for m in workers.messages())
    assert not {p for p, parent in ledger_shippers().items() if parent == workers.proc.pid}
    with contextlib.closing(sqlite3.connect(books)) as conn:
        stored = [r[0] for r in conn.execute("SELECT request_id FROM tokenmeter_requests")]
    assert len(ids) == 280
    assert sorted(stored) == sorted(ids)  # none lost, none twice


# --- what cannot be shared ----------------------------------------------------------------------
def test_workers_with_the_memory_store_and_limits_refuse_to_start(
    upstream: TestServer, tmp_path: Path
) -> None:
    cfg = tmp_path / "tm.yaml"
    cfg.write_text(budget_yaml(str(upstream.make_url("/v1")), "memory",
                               users({"alice": {"keys": [ALICE_KEY], "daily_tokens": 1000}}),
                               extra="server:\n  workers: 2\n"))
    done = subprocess.run(
        [sys.executable, "-m", "proxy", "serve", "--config", str(cfg), "--port",
         str(free_port())], capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == 2
    assert "server.workers is 2 but the budget store is the in-process one" in done.stderr
    assert "users.alice.daily_tokens" in done.stderr
    assert "store.url: redis://" in done.stderr


def test_which_configurations_need_a_shared_store() -> None:
    def policy(**data: Any) -> Policy:
        return Policy.model_validate(data)

    # Open and pass-through modes enforce nothing; an output cap is per request.
    assert configured_limits(policy()) == []
    assert configured_limits(policy(mode="open", defaults={"daily_tokens": 5})) == []
    plain = {"keys": [ALICE_KEY], "max_output_tokens": 100}
    assert configured_limits(policy(users={"alice": plain})) == []
    assert configured_limits(policy(users={"alice": {
        "keys": [{"key": ALICE_KEY, "name": "ci", "requests_per_minute": 5}],
        "model_limits": {"o1*": {"daily_tokens": 5}},
    }}, teams={"t": {"monthly_usd": 1.0}})) == [
        "users.alice.model_limits.o1*.daily_tokens", "users.alice.keys[0].requests_per_minute",
        "teams.t.monthly_usd",
    ]
    base = {"upstreams": {"u": {"base_url": "http://127.0.0.1:1/v1"}},
            "users": {"alice": {"keys": [ALICE_KEY], "max_concurrent_requests": 1}}}
    limited = Config.model_validate(base)
    assert budget_sharing_problem(limited, 1) is None
    assert "max_concurrent_requests" in (budget_sharing_problem(limited, 2) or "")
    shared = Config.model_validate({**base, "store": {"url": "redis://127.0.0.1:1/0"}})
    assert budget_sharing_problem(shared, 8) is None
    assert parse_workers("auto") == "auto" and parse_workers("3") == 3
    for bad in ("0", "x"):
        with pytest.raises(ValueError):
            parse_workers(bad)


# --- the SQLite ledger written by several processes ----------------------------------------------
_WRITER = """
import asyncio, sys
from pathlib import Path
from proxy.ledger.row import COLUMNS
from proxy.ledger.sink_sqlite import SqliteSink

async def main(path, me, batches):
    sink = SqliteSink(Path(path))
    await sink.open()
    for b in range(batches):
        rows = []
        for i in range(20):
            row = dict.fromkeys(COLUMNS, 0)
            row.update(request_id=f"{me}-{b}-{i}", replica=me, user_name="u",
                       operation="chat", requested_model="m", error_class="none",
                       token_source="reported", windows="", status=200, stream=False)
            rows.append(SqliteSink.prepare([row[c] for c in COLUMNS]))
        assert await sink.write(rows) == 20
    await sink.close()
    sink.shutdown()

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""


def test_sqlite_ledger_takes_concurrent_writers_from_several_processes(tmp_path: Path) -> None:
    """Four processes open one fresh file at once (WAL switch, migration) and commit batches
    over each other: the busy timeout makes them wait their turn, none fails."""
    db = tmp_path / "ledger.sqlite3"
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(db), f"w{k}", "25"],
                              stderr=subprocess.PIPE, text=True) for k in range(4)]
    for p in procs:
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
    with contextlib.closing(sqlite3.connect(db)) as conn:
        assert conn.execute("SELECT count(*) FROM tokenmeter_requests").fetchone()[0] == 4 * 25 * 20


# --- the deploy files ---------------------------------------------------------------------------
DEPLOY = ROOT / "deploy"


def test_deploy_files_expose_the_workers_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """compose and the Kubernetes ConfigMap read server.workers from TOKENMETER_WORKERS, which
    docker-compose.yml and the Deployment set (to 1: replicas first); both use Redis, so any
    count starts."""
    import yaml

    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    assert compose["services"]["tokenmeter"]["environment"]["TOKENMETER_WORKERS"] == (
        "${TOKENMETER_WORKERS:-1}")
    (deployment,) = yaml.safe_load_all((DEPLOY / "kubernetes" / "deployment.yaml").read_text())
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert int(env["TOKENMETER_WORKERS"]) <= int(container["resources"]["limits"]["cpu"])
    configmap = yaml.safe_load((DEPLOY / "kubernetes" / "configmap.yaml").read_text())
    texts = {"compose": (DEPLOY / "compose" / "tokenmeter.yaml").read_text(),
             "k8s": configmap["data"]["tokenmeter.yaml"]}
    for name in ("REDIS_URL", "LEDGER_URL", "OPENAI_API_KEY", "ALICE_API_KEY",
                 "LEDGER_DB_PASSWORD"):
        monkeypatch.setenv(name, {"REDIS_URL": "redis://r:6379/0",
                                  "LEDGER_URL": "postgresql://u@db:5432/tm"}.get(name, "x" * 12))
    for where, text in texts.items():
        assert "workers: ${TOKENMETER_WORKERS:-1}" in text, where
        monkeypatch.delenv("TOKENMETER_WORKERS", raising=False)
        assert parse_config(text, where).server.workers == 1
        monkeypatch.setenv("TOKENMETER_WORKERS", "auto")
        config = parse_config(text, where)
        assert config.server.workers == "auto"
        assert budget_sharing_problem(config, 4) is None
    assert "TOKENMETER_WORKERS" in (DEPLOY / "README.md").read_text()
    assert "server.workers" in (DEPLOY / "Dockerfile").read_text()
