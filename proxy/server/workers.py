"""`serve --workers N`: a supervisor process and N worker processes serving one port.

The supervisor is a pre-fork parent, as gunicorn's: it binds the listening sockets itself (the
API port, and `metrics.port` when set), then starts N workers that inherit them and each accept
on them (the kernel hands every new connection to one worker that is waiting in accept). It
serves no request. It restarts a worker that dies (`proxy.children.Child`, as the ledger
shipper's: after a backoff that grows while workers die young, with an error log line and
`tokenmeter_worker_restarts_total`), forwards SIGHUP (each worker reloads its configuration)
and SIGTERM/SIGINT (it closes its own copies of the listening sockets, so the port refuses
connections once the workers have closed theirs, and waits while each worker drains as a single
process does, then exits).

A worker is a fresh interpreter (`python -m proxy serve ...`, the supervisor's own arguments)
with the sockets passed as file descriptors (`pass_fds`) and named in `TOKENMETER_WORKER`,
rather than an `os.fork()` of the supervisor: prometheus_client picks its multiprocess mode when
it is imported, from `PROMETHEUS_MULTIPROC_DIR`, which the supervisor sets for its workers
before they import anything; a restarted worker starts exactly as the first did (nothing
inherited from a parent that has imported, configured and run things); and nothing depends on
fork-safety of the libraries loaded. The price is start-up time and memory per worker (each
loads its own tokenizer tables), which a copy-on-write fork would share.

Shared state: the workers share what the configuration points them at. Budgets need the Redis
store (`store.url: redis://...`), whose counters and leases are the same for every worker as
for replicas: a worker that dies leaves its reservations to expire with their lease
(`store.lease_seconds`), and the next reservation of that user reaps them. The in-process store
cannot be shared, so `budget_sharing_problem` refuses to start N > 1 workers on it while any
limit is configured. Each worker keeps its own settlement spool and ledger spool files (per
process, flock'd; a restarted worker adopts a dead one's settlement spool). One ledger shipper
process (proxy.ledger.shipper_process), started first and supervised like the workers (started
again when it dies), ships every worker's ledger rows into the database; it is stopped last,
once every worker has exited, and ships what they left.

Metrics: the supervisor makes a private directory for prometheus_client's multiprocess files
before starting workers and removes it at exit; each worker writes its series there and any of
them answers /metrics with the sum (proxy/telemetry/metrics.py says how each gauge combines).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from prometheus_client import multiprocess
from prometheus_client.values import MultiProcessValue

from proxy.children import Backoff, Child, Death, describe
from proxy.config.ledger import LedgerConfig
from proxy.config.load import Config
from proxy.config.policy import Limits, Policy
from proxy.ledger.shipper_process import ShipperChild, ShipperSpec
from proxy.storage.urls import state_dir

log = logging.getLogger("tokenmeter.workers")

WORKER_ENV = "TOKENMETER_WORKER"  # set by the supervisor in a worker's environment only
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
BACKLOG = 128  # as aiohttp's own sites
# A worker that dies within this long of its start doubles the wait before the next start
# (a crash loop must not spin); one that lived longer is restarted after the first wait again.
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 15.0
HEALTHY_AFTER_S = 30.0
_BACKOFF = Backoff(BACKOFF_FIRST_S, BACKOFF_MAX_S, HEALTHY_AFTER_S)
# After SIGTERM, how long past its own drain a worker may take before it is killed: its
# listener drains for drain_seconds, then settling and the ledger's last shipping follow.
EXIT_GRACE_S = 15.0
PARENT_CHECK_S = 1.0  # how often a worker looks whether its supervisor is still there


def resolve_workers(value: int | Literal["auto"]) -> int:
    """`auto`: the CPUs this process may run on (its affinity mask, which a container's
    cpuset narrows), else every CPU the machine has."""
    if value != "auto":
        return value
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def parse_workers(text: str) -> int | Literal["auto"]:
    """`--workers` on the command line: a count of at least 1, or auto."""
    if text == "auto":
        return "auto"
    try:
        count = int(text)
    except ValueError:
        raise ValueError(f"--workers: {text!r} is not a number or 'auto'") from None
    if count < 1:
        raise ValueError("--workers must be at least 1 (or 'auto': one per CPU)")
    return count


# --- what N workers need ---------------------------------------------------------------------

# max_output_tokens caps each request on its own: no counter behind it, nothing to share.
_SHARED_LIMITS = tuple(f for f in Limits.model_fields if f != "max_output_tokens")


def configured_limits(policy: Policy) -> list[str]:
    """Where the configuration sets a limit that is counted (so must be shared by workers),
    as config paths; empty in open and pass-through modes, where nothing is enforced."""
    if policy.effective_mode != "keys":
        return []
    found: list[str] = []

    def scan(path: str, limits: Limits | None) -> None:
        if limits is not None:
            found.extend(f"{path}.{f}" for f in _SHARED_LIMITS if getattr(limits, f) is not None)

    scan("defaults", policy.defaults)
    for name, user in policy.users.items():
        scan(f"users.{name}", user)
        for glob, model_limits in user.model_limits.items():
            scan(f"users.{name}.model_limits.{glob}", model_limits)
        for i, key in enumerate(user.key_configs()):
            scan(f"users.{name}.keys[{i}]", key)
    for name, team in policy.teams.items():
        scan(f"teams.{name}", team)
    return found


def budget_sharing_problem(config: Config, workers: int) -> str | None:
    """Why `workers` processes cannot enforce this configuration's budgets, or None.

    With no limit configured, N workers on the in-process store start: metering, metrics and
    the ledger are exact, only the per-user counters each worker's store holds are its own
    (`tokenmeter_budget_used_tokens` shows one worker's), which the start-up log says."""
    if workers <= 1 or config.store.url != "memory":
        return None
    limits = configured_limits(config)
    if not limits:
        return None
    shown = ", ".join(limits[:3]) + (f" and {len(limits) - 3} more" if len(limits) > 3 else "")
    return (
        f"server.workers is {workers} but the budget store is the in-process one (store.url: "
        f"memory), which each worker would hold on its own: every limit would be multiplied by "
        f"{workers} ({shown}). Set store.url to a Redis server the workers share, e.g. "
        "store.url: redis://127.0.0.1:6379/0, or run one worker (--workers 1)."
    )


# --- the sockets -------------------------------------------------------------------------------


def bind(host: str, port: int) -> list[socket.socket]:
    """Listening sockets for `host`:`port`, one per address the host resolves to (as
    asyncio's create_server binds them): what the workers inherit and accept on."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                               flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            # Port 0: every address on the one port the kernel gave the first.
            sock.bind((address[0], port, *address[2:]))
            port = sock.getsockname()[1]
            sock.listen(BACKLOG)
            sock.set_inheritable(True)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


@dataclass(frozen=True, slots=True)
class BoundSockets:
    """The listening sockets a supervisor bound once, for every worker to serve."""

    api: tuple[socket.socket, ...]
    metrics: tuple[socket.socket, ...]  # empty: /metrics is served on the API port


@dataclass(frozen=True, slots=True)
class WorkerSockets:
    """What a worker was handed by its supervisor."""

    index: int
    count: int  # workers the supervisor runs
    api: tuple[socket.socket, ...]
    metrics: tuple[socket.socket, ...]  # empty: /metrics is served on the API port


def inherited_sockets() -> WorkerSockets | None:
    """The sockets this process inherited as a worker, or None when it is not one."""
    raw = os.environ.pop(WORKER_ENV, None)  # not passed on to anything this process starts
    if raw is None:
        return None
    spec = json.loads(raw)

    def adopt(fds: list[int]) -> tuple[socket.socket, ...]:
        return tuple(socket.socket(fileno=fd) for fd in fds)

    return WorkerSockets(int(spec["index"]), int(spec["count"]), adopt(spec["api"]),
                         adopt(spec["metrics"]))


async def watch_supervisor(stop: asyncio.Event) -> None:
    """In a worker: drain and exit if the supervisor is gone (killed without its SIGTERM
    reaching the workers), instead of serving on unsupervised."""
    parent = os.getppid()
    while not stop.is_set():
        await asyncio.sleep(PARENT_CHECK_S)
        if os.getppid() != parent:
            log.error("the supervisor (pid %d) is gone: this worker drains and exits", parent)
            stop.set()


# --- the supervisor ----------------------------------------------------------------------------


class Supervisor:
    def __init__(  # noqa: PLR0913, PLR0917  what one supervisor runs, given once
        self, argv: Sequence[str], count: int, bound: BoundSockets, metrics_dir: str,
        drain_seconds: float, shipper: ShipperSpec | None = None,
    ) -> None:
        """`shipper`: the one ledger shipper process for all workers (None: the ledger is
        off)."""
        self._argv = list(argv)
        self._count = count
        self._api = list(bound.api)
        self._metrics = list(bound.metrics)
        self._dir = metrics_dir
        self._drain_s = drain_seconds
        self._stopping = asyncio.Event()
        self._workers = [self._worker(i) for i in range(count)]
        self._failed = False
        # Written straight into the multiprocess files (this process's own prometheus_client
        # was imported before the directory existed, so its metrics would not be shared).
        self._restarts = MultiProcessValue()(  # type: ignore[no-untyped-call]
            "counter", "tokenmeter_worker_restarts", "tokenmeter_worker_restarts_total", (), (),
            "Worker processes that died and were started again (serve --workers).",
        )
        self._restarts.inc(0)  # present, at zero, from the start
        self._shipper: ShipperChild | None = None
        if shipper is not None:
            deaths = MultiProcessValue()(  # type: ignore[no-untyped-call]
                "counter", "tokenmeter_ledger_errors", "tokenmeter_ledger_errors_total",
                ("stage",), ("shipper",), "Ledger failures by stage.",
            )
            self._shipper = ShipperChild(shipper, {**os.environ, MULTIPROC_ENV: metrics_dir},
                                         on_restart=lambda: deaths.inc(1))
            self._shipper.on_exit = lambda pid: multiprocess.mark_process_dead(  # type: ignore[no-untyped-call]
                pid, metrics_dir)

    def _worker(self, index: int) -> Child:
        async def exited(proc: asyncio.subprocess.Process, code: int) -> None:
            # Its live gauges (in flight, connections open...) leave the sums now.
            multiprocess.mark_process_dead(proc.pid, self._dir)  # type: ignore[no-untyped-call]

        def died(death: Death) -> None:
            log.error("worker %d (pid %d) died (%s) after %.1f s: starting it again in %.1f s; "
                      "its reservations are released when their lease runs out", index,
                      death.pid, death.described, death.lived_s, death.wait_s)
            self._restarts.inc(1)

        return Child(f"worker {index}", lambda: self._start(index), on_death=died,
                     on_exit=exited, backoff=_BACKOFF)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._stop, sig)
        loop.add_signal_handler(signal.SIGHUP, self._forward, signal.SIGHUP)
        if self._shipper is not None:
            await self._shipper.start()
            log.info("ledger shipper started (pid %s)", self._shipper.pid)
        for worker in self._workers:
            await worker.start()
        await self._stopping.wait()
        # Our copies closed first: once the workers close theirs, the port refuses.
        for sock in (*self._api, *self._metrics):
            sock.close()
        codes = await asyncio.gather(*(w.stop(2 * self._drain_s + EXIT_GRACE_S)
                                       for w in self._workers))
        for worker, code in zip(self._workers, codes, strict=True):
            # -SIGTERM: it was still starting (no handler yet), so it had nothing to drain.
            if code not in (None, 0, -signal.SIGTERM):
                log.error("%s (pid %s) exited with %s while stopping", worker.label,
                          worker.pid, describe(code))
                self._failed = True
        log.info("all workers have exited")
        if self._shipper is not None:  # their spool files closed: it ships what is left
            await self._shipper.stop(self._drain_s, self._drain_s + EXIT_GRACE_S)
        return 1 if self._failed else 0

    def _stop(self, sig: signal.Signals) -> None:
        if not self._stopping.is_set():
            log.info("%s: stopping %d workers (each drains for up to %.0f s)", sig.name,
                     len(self._workers), self._drain_s)
        self._stopping.set()

    def _forward(self, sig: signal.Signals) -> None:
        for worker in self._workers:
            worker.send_signal(sig)

    async def _start(self, index: int) -> asyncio.subprocess.Process:
        fds = [s.fileno() for s in (*self._api, *self._metrics)]
        spec = {"index": index, "count": self._count, "api": [s.fileno() for s in self._api],
                "metrics": [s.fileno() for s in self._metrics]}
        env = {**os.environ, WORKER_ENV: json.dumps(spec), MULTIPROC_ENV: self._dir}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "proxy", *self._argv, pass_fds=fds, env=env,
        )
        log.info("worker %d started (pid %d)", index, proc.pid)
        return proc


def supervise(
    argv: Sequence[str], config: Config | None, count: int, host: str | None, port: int | None,
) -> int:
    """Run `count` workers of `tokenmeter <argv>` on one port until SIGTERM or SIGINT; the exit
    status. Binding fails here, once, before any worker starts (port in use, bad address)."""
    server = config.server if config is not None else None
    host = host or (server.host if server is not None else "127.0.0.1")
    port = port if port is not None else (server.port if server is not None else 8080)
    metrics_port = config.metrics.port if config is not None else None
    api = bind(host, port)
    metrics: list[socket.socket] = []
    try:
        if metrics_port is not None:
            assert config is not None
            metrics = bind(config.metrics.host or host, metrics_port)
        if config is not None and config.store.url == "memory" and count > 1:
            log.warning("%d workers on the in-process budget store: no limit is configured, so "
                        "nothing needs sharing, but each worker counts its own users' usage "
                        "(tokenmeter_budget_used_tokens shows one worker's)", count)
        metrics_dir = tempfile.mkdtemp(prefix="tokenmeter-metrics-")
        # Workers inherit it from this environment too (the supervisor's own metrics above).
        os.environ[MULTIPROC_ENV] = metrics_dir
        try:
            log.info("supervising %d workers on %s port %d (pid %d)", count, host,
                     api[0].getsockname()[1], os.getpid())
            drain = server.drain_seconds if server is not None else 30.0
            with asyncio.Runner() as runner:
                bound = BoundSockets(tuple(api), tuple(metrics))
                ledger = config.ledger if config is not None else LedgerConfig()
                zone = config.timezone if config is not None else "UTC"
                shipper = ShipperSpec.of(ledger, state_dir(), drain, zone) if ledger.enabled \
                    else None
                return runner.run(Supervisor(argv, count, bound, metrics_dir, drain,
                                             shipper).run())
        finally:
            os.environ.pop(MULTIPROC_ENV, None)
            shutil.rmtree(metrics_dir, ignore_errors=True)
    finally:
        for sock in (*api, *metrics):
            sock.close()
