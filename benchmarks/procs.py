"""What the per-request benchmarks share about the processes they start: a free port, waiting
for one to accept, a process's CPU time from /proc, and a served proxy."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def cpu_s(pid: int) -> float:
    """utime + stime of `pid`, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Served:
    """`tokenmeter serve` on a free port with `config` (YAML text), a state directory of its
    own and `env` added to this process's environment; `stop` sends SIGTERM, so what it queued
    (ledger rows, captures, spans) is written first."""

    def __init__(self, config: str, prefix: str, cwd: Path | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.state = Path(tempfile.mkdtemp(prefix=prefix))
        path = self.state / "tokenmeter.yaml"
        path.write_text(config)
        self.port = free_port()
        env = {**os.environ, "TOKENMETER_STATE_DIR": str(self.state), **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "proxy.cli", "serve", "--config", str(path),
             "--port", str(self.port), "--log-level", "WARNING"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=cwd)
        wait_port(self.port)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)
