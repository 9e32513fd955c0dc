"""Real servers the tests start on free loopback ports."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis
import yaml


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_PORTS = random.Random()


def free_port() -> int:
    """A free loopback port for a process we start, drawn from below the kernel's ephemeral
    range: a port the kernel hands out (an `aiohttp_server` on port 0, a client connection's
    local end) can then never take it in the second or so before that process binds it. Once a
    parallel test's mock upstream got the port first, and the test read the mock's answers as the
    proxy's."""
    low = _ephemeral_low()
    for _ in range(200):
        port = _PORTS.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def wait_for_port(port: int, timeout: float = 10.0) -> None:
    """A process we started is ready when its port accepts: poll that, with a deadline."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _listening_inodes(port: int) -> set[str]:
    """The socket inodes listening on 127.0.0.1:`port` (or any address), from /proc/net/tcp."""
    found: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    found.add(inode)
    return found


def _holds(pid: int, inodes: set[str]) -> bool:
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                link = os.readlink(fd)
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return True
    return False


def wait_until_listening(proc: subprocess.Popen[Any], port: int, timeout: float = 30.0) -> None:
    """`proc` itself listens on `port`: not merely someone (a parallel test's server could have
    taken a port before the process we started bound it). Raises if it exits first."""
    deadline = time.monotonic() + timeout
    while not _holds(proc.pid, _listening_inodes(port)):
        if proc.poll() is not None:
            raise RuntimeError(f"the process exited ({proc.returncode}) before it listened "
                               f"on port {port}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"nothing of pid {proc.pid} listens on port {port}")
        time.sleep(0.02)


@dataclass
class ServedProxy:
    """`tokenmeter serve` in a process of its own, as deployed: on a free port, its log (stderr)
    in a file, since a pipe nobody reads until the end would fill up and stall it."""

    config: Path | None
    log: Path
    extra: tuple[str, ...] = ()  # more `serve` arguments
    env: dict[str, str] = field(default_factory=dict)  # added to this process's environment
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> ServedProxy:
        args = [sys.executable, "-m", "proxy", "serve", "--port", str(self.port), *self.extra]
        if self.config is not None:
            args += ["--config", str(self.config)]
        with self.log.open("ab") as err:
            self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=err,
                                         env={**os.environ, **self.env})
        try:
            wait_until_listening(self.proc, self.port, timeout)
        except Exception:
            self.kill()
            raise
        return self

    async def started(self, within_s: float = 30.0) -> ServedProxy:
        return await asyncio.to_thread(self.start, within_s)

    def send(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 60.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    async def stopped(self, sig: int = signal.SIGTERM, within_s: float = 60.0) -> int:
        """Signalled (SIGTERM: drain and exit) and waited for: its exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.send(sig)
        return await asyncio.to_thread(self.wait, within_s)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


class RedisServer:
    """A throwaway redis-server (never the machine's own on 6379)."""

    def __init__(self, persistent: bool = False) -> None:
        # persistent: an append-only file synced on every write, so a kill -9 loses nothing and
        # a restart comes back with the counters (as a production Redis with AOF would).
        self.persistent = persistent
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="tm-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        exe = shutil.which("redis-server")
        assert exe, "redis-server is not installed (.ci/run installs it)"
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes" if self.persistent else "no", "--appendfsync", "always",
             "--dir", self.dir, "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        wait_for_port(self.port)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


class PostgresServer:
    """A throwaway PostgreSQL 15 cluster on a free port, for tests that stop or kill the
    database (never the machine's own on 5432). PostgreSQL refuses to run as root, so every
    command runs as the `postgres` user."""

    BIN = "/usr/lib/postgresql/15/bin"

    def __init__(self) -> None:
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="tm-pg-")
        self.data = f"{self.dir}/data"
        shutil.chown(self.dir, "postgres", "postgres")
        self._as_postgres(f"{self.BIN}/initdb", "-D", self.data, "-A", "trust", "-U",
                          "postgres", "--no-sync", "-E", "UTF8")

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _as_postgres(self, *cmd: str) -> None:
        subprocess.run(["runuser", "-u", "postgres", "--", *cmd], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)

    def start(self) -> None:
        options = (f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off "
                   "-c synchronous_commit=off -c full_page_writes=off")
        self._as_postgres(f"{self.BIN}/pg_ctl", "-D", self.data, "-o", options, "-w",
                          "-l", f"{self.dir}/log", "start")

    def stop(self, mode: str = "fast") -> None:
        """`fast`: a clean shutdown; `immediate`: as good as a kill -9."""
        self._as_postgres(f"{self.BIN}/pg_ctl", "-D", self.data, "-m", mode, "-w", "stop")

    def destroy(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            self.stop("immediate")
        shutil.rmtree(self.dir, ignore_errors=True)


@dataclass
class Prometheus:
    """A real Prometheus the test started (`running_prometheus`), and its HTTP API."""

    url: str
    log: Path
    session: aiohttp.ClientSession

    def log_tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])

    async def api(self, path: str, **form: str) -> dict[str, Any]:
        if form:
            request = self.session.post(self.url + path, data=form)
        else:
            request = self.session.get(self.url + path)
        async with request as r:
            body: dict[str, Any] = await r.json()
        return body

    async def get(self, path: str) -> Any:
        """The `data` of a successful API answer."""
        body = await self.api(path)
        assert body["status"] == "success", body
        return body["data"]

    async def query(self, expr: str) -> list[dict[str, Any]]:
        body = await self.api("/api/v1/query", query=expr)
        assert body["status"] == "success", f"{expr}: {body}"
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    async def wait_for(self, expr: str, within: float = 30.0) -> list[dict[str, Any]]:
        """Poll until `expr` has a result with a finite value (the sync point with scrapes)."""
        deadline = time.monotonic() + within
        while True:
            result = await self.query(expr)
            if any(math.isfinite(float(s["value"][1])) for s in result):
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"no data for {expr} within {within}s\n{self.log_tail()}")
            await asyncio.sleep(0.25)


@contextlib.asynccontextmanager
async def running_prometheus(config: dict[str, Any], workdir: Path) -> AsyncIterator[Prometheus]:
    """Debian's `prometheus` with `config` (a prometheus.yml as data), ready when yielded."""
    exe = shutil.which("prometheus")
    assert exe, "prometheus is not installed (Debian package `prometheus`; .ci/run installs it)"
    config_file = workdir / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config))
    port = free_port()
    log = workdir / "prometheus.log"
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            exe, f"--config.file={config_file}", f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            stdout=out, stderr=asyncio.subprocess.STDOUT,
        )
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
    prom = Prometheus(url=f"http://127.0.0.1:{port}", log=log, session=session)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.returncode is None, f"prometheus exited\n{prom.log_tail()}"
            try:
                async with session.get(prom.url + "/-/ready") as r:
                    if r.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            assert time.monotonic() < deadline, f"prometheus not ready\n{prom.log_tail()}"
            await asyncio.sleep(0.1)
        yield prom
    finally:
        await session.close()
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
                await proc.wait()


class Cluster:
    """Three primaries, no replicas, each with its own cluster-bus port, in a temp dir."""

    def __init__(self, nodes: int = 3) -> None:
        self.dir = tempfile.mkdtemp(prefix="tm-redis-cluster-")
        self.ports = [free_port() for _ in range(nodes)]
        self.bus_ports = [free_port() for _ in range(nodes)]
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    def start(self) -> None:
        exe, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        assert exe and cli, "redis-server and redis-cli are needed (.ci/run installs them)"
        for port, bus in zip(self.ports, self.bus_ports, strict=True):
            self.procs.append(subprocess.Popen(
                [exe, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                 "--cluster-config-file", f"{self.dir}/nodes-{port}.conf",
                 "--cluster-port", str(bus), "--dir", self.dir, "--save", "",
                 "--appendonly", "no", "--loglevel", "warning"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            ))
        for port in self.ports:
            wait_for_port(port)
        subprocess.run(
            [cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
             "--cluster-replicas", "0", "--cluster-yes"],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60,
        )
        deadline = time.monotonic() + 30
        while not all(self._ok(p) for p in self.ports):
            assert time.monotonic() < deadline, "the cluster never reached cluster_state:ok"
            time.sleep(0.05)

    @staticmethod
    def _ok(port: int) -> bool:
        with redis.Redis(port=port, decode_responses=True) as r:
            info = r.cluster("INFO")  # parsed by redis-py into a dict
        return isinstance(info, dict) and info.get("cluster_state") == "ok"

    def flush(self) -> None:
        for port in self.ports:
            with redis.Redis(port=port) as r:
                r.flushall()

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


def ledger_shippers() -> dict[int, int]:
    """Every ledger shipper process on the machine (proxy.ledger.shipper_process): pid ->
    its parent's pid."""
    out: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if b"proxy.ledger.shipper_process" in (entry / "cmdline").read_bytes():
                stat = (entry / "stat").read_text()
                out[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return out
