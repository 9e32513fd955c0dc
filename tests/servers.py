"""Real servers the tests start on free loopback ports."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
