"""The ledger shipper as a process of its own: one per spool directory (per host), moving the
rows every serving process appends to the spool into the database.

Why a process: shipping (reading the spool, encoding rows for the database, SQLite's inserts,
PostgreSQL's COPY) on a thread and the event loop of the process serving requests would take
the GIL and the loop from requests, and contend with the access log's lock. The serving
process only appends rows (proxy.ledger.spool.SpoolWriter); this process follows
the segments of every writer in the directory (complete lines only, as they grow), ships them
with proxy.ledger.shipper.Shipper, and adopts the files of writers that are gone. Its CPU is
still tokenmeter's (the benchmarks count it), but no request waits on it.

Who starts it: `serve` (one process) starts it as its child (`Ledger.start`) and starts it
again if it dies; `serve --workers N` has the supervisor start one for all workers, supervised
like them. A fresh interpreter (`python -m proxy.ledger.shipper_process`), its settings in the
environment (`SHIPPER_ENV`, JSON), its metrics in a prometheus_client multiprocess directory
(the supervisor's, or a private one that the single serving process adds to its /metrics).

One per directory: it holds `shipper.lock` (flock) while it runs; a second one waits for
it. Crash safety is the spool's: a cursor (`<segment>.pos`) moves only after the database
committed, the database stores a request id once, so a shipper killed anywhere re-ships at most
its last batch, which is stored once. It writes what `/readyz` reports into
`shipper.json` (replaced whole, about once a second).

Stopping: its stdin is a pipe from the process that started it. That one writes
`done <seconds>` once its writers have closed their spool files (`serve`: after its last
request settled; the supervisor: after every worker exited), and it ships what is left for up
to that long, then exits. On SIGTERM (a whole process group may get it at once) or at the
pipe's end (its parent is gone), it first keeps shipping until no writer holds its lock any
more, then for `drain_s` (EXIT_WAIT_S at most in all). What is left stays on disk for the next
start.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from proxy.children import Backoff, Child, Death
from proxy.config.ledger import LedgerConfig
from proxy.files import FILE_MODE, private_dir, private_opener
from proxy.ledger.shipper import BACKOFF_MAX_S, Shipper, Sink
from proxy.ledger.sink_postgres import PostgresSink
from proxy.ledger.sink_sqlite import SqliteSink
from proxy.ledger.spool import RowSpool
from proxy.storage.urls import Dialect, sqlite_path
from proxy.telemetry.accesslog import JsonFormatter
from proxy.telemetry.verbs import LedgerMetrics, process_ledger_metrics

log = logging.getLogger("tokenmeter.ledger")

SHIPPER_ENV = "TOKENMETER_SHIPPER"
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
# Not named ledger-*: those are the writers' files.
LOCK_FILE = "shipper.lock"
STATUS_FILE = "shipper.json"
SQLITE_FILE = "ledger.sqlite3"
STATUS_EVERY_S = 1.0
START_REPORT_S = 2.0
# A status older than this is from a shipper that is gone (it writes one every STATUS_EVERY_S).
STATUS_STALE_S = 5.0
EXIT_WAIT_S = 120.0  # after SIGTERM: the longest it waits for writers that do not leave
DONE = "done"  # on stdin, with the seconds to drain: the writers have closed their files
# Restarts (proxy.children.Backoff): as the workers', a shipper dying young waits longer.
BACKOFF_FIRST_S = 0.5
RESTART_MAX_S = 15.0
HEALTHY_AFTER_S = 30.0


@dataclass(frozen=True, slots=True)
class ShipperSpec:
    """What a shipper process is told by the process that starts it."""

    ledger: dict[str, object]  # LedgerConfig, as JSON
    state_dir: str
    drain_s: float
    # The config's `timezone`: the sink adds it to the local-day rollup when it opens (the
    # rollup then serves that zone's reports by day, week and month).
    zone: str = "UTC"

    @classmethod
    def of(cls, config: LedgerConfig, state_dir: Path, drain_s: float,
           zone: str = "UTC") -> ShipperSpec:
        return cls(config.model_dump(mode="json"), str(state_dir), drain_s, zone)

    @property
    def config(self) -> LedgerConfig:
        return LedgerConfig.model_validate(self.ledger)

    @property
    def spool_dir(self) -> Path:
        spool = self.config.spool_dir
        return Path(spool) if spool else Path(self.state_dir)


def make_sink(config: LedgerConfig, state_dir: Path, zone: str = "UTC") -> Sink:
    """The sink `config` names; `zone`: the configured time zone (its local-day sums)."""
    if config.url is not None and config.dialect is Dialect.POSTGRESQL:
        return PostgresSink(config.url, zone)
    if config.url is not None:
        return SqliteSink(sqlite_path(config.url), zone)
    return SqliteSink(state_dir / SQLITE_FILE, zone)


# --- what /readyz says -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ShipperStatus:
    ok: bool
    detail: str  # one line, no secrets
    pending_rows: int
    at: float  # epoch seconds it was written
    pid: int


def read_status(spool_dir: Path, now: float) -> ShipperStatus | None:
    """The running shipper's last word; None when there is none or it is stale."""
    try:
        raw = json.loads((spool_dir / STATUS_FILE).read_bytes())
        status = ShipperStatus(bool(raw["ok"]), str(raw["detail"]), int(raw["pending_rows"]),
                               float(raw["at"]), int(raw["pid"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return status if now - status.at <= STATUS_STALE_S else None


def _write_status(spool_dir: Path, status: ShipperStatus) -> None:
    tmp = spool_dir / f"{STATUS_FILE}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8", opener=private_opener) as out:
        out.write(json.dumps(asdict(status)))
    os.replace(tmp, spool_dir / STATUS_FILE)


def _health(shipper: Shipper, location: str) -> tuple[bool, str]:
    pending = shipper.spool.pending_rows
    if shipper.too_new is not None:
        return False, str(shipper.too_new)
    if shipper.down_since is not None:
        down = time.monotonic() - shipper.down_since
        return False, (f"{location} failing for {down:.0f} s ({shipper.error}); {pending} rows "
                       "wait in the spool")
    if not shipper.ever_connected:
        return False, f"connecting to {location}; {pending} rows wait"
    return True, f"{location}; {pending} rows waiting"


# --- the process -------------------------------------------------------------------------------


class ShipperProcess:
    def __init__(self, spec: ShipperSpec, metrics: LedgerMetrics) -> None:
        self._spec = spec
        config = spec.config
        self._sink = make_sink(config, Path(spec.state_dir), spec.zone)
        self._spool = RowSpool(spec.spool_dir)
        self._shipper = Shipper(self._spool, self._sink, metrics, config, clock=time.time)
        self._stop = asyncio.Event()
        self._writers_done = False  # the parent said its writers have closed their files
        self._drain_s = spec.drain_s

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._stop.set)
        parent = asyncio.create_task(self._listen())
        # ^C at a terminal reaches the whole process group: the serving process drains, then
        # stops this one (SIGTERM) once its last rows are in the spool.
        loop.add_signal_handler(signal.SIGINT, lambda: None)
        directory = self._spec.spool_dir
        private_dir(directory)
        lock = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
        try:
            if not await self._lock(lock):
                return 0
            log.info("ledger shipper (pid %d) ships %s into %s", os.getpid(), directory,
                     self._sink.location)
            return await self._ship()
        finally:
            os.close(lock)
            parent.cancel()

    async def _listen(self) -> None:
        """The parent's word on stdin: `done <seconds>`, or the pipe's end (it is gone)."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := await reader.readline():
            word, _, seconds = line.decode(errors="replace").strip().partition(" ")
            if word == DONE:
                with contextlib.suppress(ValueError):
                    self._drain_s = max(0.0, float(seconds))
                self._writers_done = True
                self._stop.set()
                return
        if not self._stop.is_set():
            log.error("the process that started the ledger shipper is gone: it ships until "
                      "the writers have left, then exits")
            self._stop.set()

    async def _lock(self, fd: int) -> bool:
        """The directory's one shipper: wait while another holds it (unless told to stop)."""
        waiting = False
        while not self._stop.is_set():
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not waiting:
                    log.warning("another ledger shipper runs on %s: waiting for it",
                                self._spec.spool_dir)
                    waiting = True
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(STATUS_EVERY_S):
                        await self._stop.wait()
                continue
            return True
        return False

    async def _ship(self) -> int:
        shipper = self._shipper
        await shipper.scan()
        if rows := self._spool.pending_rows:
            log.info("ledger: %d rows wait in %s", rows, self._spool.directory)
        task = asyncio.create_task(shipper.run(), name="tokenmeter-ledger-shipper")
        status = asyncio.create_task(self._report())
        try:
            await self._stop.wait()
            stored = await self._drain()
        finally:
            status.cancel()
            await _cancel(task)
            try:
                async with asyncio.timeout(BACKOFF_MAX_S):
                    await self._sink.close()
            except Exception as exc:
                log.debug("ledger: closing %s: %s", self._sink.location, exc)
            self._sink.shutdown()
            left = self._spool.close()
            with contextlib.suppress(FileNotFoundError):
                (self._spool.directory / STATUS_FILE).unlink()
        if left:
            log.warning("ledger: %d rows not yet stored in %s stay in the spool %s for the next "
                        "start", left, self._sink.location, self._spool.directory)
        elif stored:
            log.info("ledger: every row stored in %s", self._sink.location)
        return 0

    async def _drain(self) -> bool:
        """Ship until nothing waits, for `drain_s` at most. After SIGTERM (which a whole
        process group may get at once) or its parent's death, first until no writer is left
        (EXIT_WAIT_S at most); after `done`, its parent's word that they are, at once."""
        shipper, spool = self._shipper, self._spool
        loop = asyncio.get_running_loop()
        hard = loop.time() + EXIT_WAIT_S
        began = time.monotonic()
        deadline = loop.time() + self._drain_s
        while loop.time() < min(hard, deadline):
            # The shipper's own loop scans (kicked): one scan at a time, on its terms.
            shipper.kick()
            shipper.progress.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(STATUS_EVERY_S / 4):
                    await shipper.progress.wait()
            if shipper.live_writers and not self._writers_done:
                deadline = loop.time() + self._drain_s  # counted from the last leaving
            elif spool.pending_rows <= 0 and shipper.scanned_after(began):
                return True
        return spool.pending_rows <= 0

    async def _report(self) -> None:
        # The first word once the first connection attempt is over (its parent waits for it,
        # so /readyz is right from the first request), or after START_REPORT_S.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(START_REPORT_S):
                await self._shipper.attempted.wait()
        while True:
            ok, detail = _health(self._shipper, self._sink.location)
            with contextlib.suppress(OSError):
                await asyncio.to_thread(_write_status, self._spool.directory, ShipperStatus(
                    ok, detail, self._spool.pending_rows, time.time(), os.getpid()))
            # Again after each batch (a flush that saw the cursors move then reads a fresh one
            # soon), at least every STATUS_EVERY_S.
            progress = self._shipper.progress
            progress.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(STATUS_EVERY_S):
                    await progress.wait()


async def _cancel(task: asyncio.Task[None]) -> None:
    """Cancel the shipper's loop and wait until it has ended, cancelling again while it has
    not: Python 3.11's `asyncio.timeout` can turn a cancellation that arrives as its deadline
    passes into a TimeoutError, which the loop's waits suppress (as proxy.server.app.stop_task
    does for the app's tasks)."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=1.0)
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("ledger: the shipper failed: %s", exc)


def main() -> int:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(os.environ.get("TOKENMETER_LOG_LEVEL", "INFO").upper())
    raw = os.environ.pop(SHIPPER_ENV, None)
    if raw is None:
        print(f"{SHIPPER_ENV} is not set: this process is started by `tokenmeter serve`",
              file=sys.stderr)
        return 2
    spec = ShipperSpec(**json.loads(raw))
    metrics = process_ledger_metrics()
    with asyncio.Runner() as runner:
        return runner.run(ShipperProcess(spec, metrics).run())


# --- the parent's side -------------------------------------------------------------------------


class ShipperChild:
    """A shipper process kept running by the process that starts it (`serve`'s serving process,
    or the supervisor of `serve --workers`), with `proxy.children.Child`: started again when it
    dies, after a wait that grows while it dies young; stopped by `done` on its stdin, then
    killed if it outlives the timeout."""

    def __init__(self, spec: ShipperSpec, env: Mapping[str, str],
                 on_restart: Callable[[], None] = lambda: None) -> None:
        self._env = {**env, SHIPPER_ENV: json.dumps(asdict(spec))}
        self._on_restart = on_restart
        self._relay: asyncio.Task[None] | None = None
        self.on_exit: Callable[[int], None] = lambda pid: None  # the supervisor's metrics
        self._child = Child("the ledger shipper", self._spawn, on_death=self._died,
                            on_exit=self._exited,
                            backoff=Backoff(BACKOFF_FIRST_S, RESTART_MAX_S, HEALTHY_AFTER_S))

    @property
    def pid(self) -> int | None:
        return self._child.pid

    @property
    def started(self) -> asyncio.Event:
        """Set at every start (a test waits for a restart)."""
        return self._child.started

    async def start(self) -> None:
        await self._child.start()

    async def _spawn(self) -> asyncio.subprocess.Process:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "proxy.ledger.shipper_process", env=self._env,
            stdin=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        assert proc.stderr is not None
        self._relay = asyncio.create_task(_relay(proc.stderr))
        return proc

    async def _exited(self, proc: asyncio.subprocess.Process, code: int) -> None:
        if self._relay is not None:
            await self._relay  # its last words, before saying it died
        self.on_exit(proc.pid)

    def _died(self, death: Death) -> None:
        log.error("the ledger shipper (pid %d) died (%s) after %.1f s: starting it again "
                  "in %.1f s; rows wait in the spool meanwhile", death.pid, death.described,
                  death.lived_s, death.wait_s)
        self._on_restart()

    async def stop(self, drain_s: float, timeout_s: float) -> None:
        """Once the writers it serves have closed their spool files: it ships what is left for
        up to `drain_s` and exits (killed after `timeout_s`)."""

        async def done(proc: asyncio.subprocess.Process) -> None:
            assert proc.stdin is not None
            with contextlib.suppress(ConnectionError):
                proc.stdin.write(f"{DONE} {drain_s}\n".encode())
                await proc.stdin.drain()

        await self._child.stop(timeout_s, done)


async def _relay(stream: asyncio.StreamReader) -> None:
    """The shipper's log lines (JSON, as `main` writes them) logged again in this process, by
    the same logger at the same level: one log, wherever this process's goes (and what a
    test captures)."""
    while line := await stream.readline():
        try:
            raw = json.loads(line)
            level = logging.getLevelName(str(raw["level"]).upper())
            name, message = str(raw["logger"]), str(raw["message"])
        except (ValueError, KeyError, TypeError):
            level, name, message = logging.WARNING, log.name, line.decode(errors="replace")
        if not isinstance(level, int):
            level = logging.WARNING
        logging.getLogger(name).log(level, "%s", message.rstrip("\n"))


if __name__ == "__main__":
    raise SystemExit(main())
