"""A child process kept running: the one way `serve` keeps its processes, the `--workers`
supervisor's workers and the ledger shipper (`proxy.server.workers`,
`proxy.ledger.shipper_process`).

`Child` starts a process, starts it again whenever it dies until it is stopped, after a wait
that doubles while it dies young (a crash loop must not spin) and drops back to the first once
it lived `healthy_after_s`; a start that fails (no fork, no memory) is tried again the same
way, never given up. It forwards signals to the running process, and stops it by asking it to
exit (SIGTERM, or what the caller asks with), then killing it if it outlives a timeout. What a
death means (a log line, a counter, metrics files to mark dead) is the caller's, through
`on_exit` and `on_death`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

log = logging.getLogger("tokenmeter.children")

Process = asyncio.subprocess.Process


@dataclass(frozen=True, slots=True)
class Backoff:
    """The waits before a start again: `first_s`, doubled while the process dies within
    `healthy_after_s` of its start, up to `max_s`."""

    first_s: float = 0.5
    max_s: float = 15.0
    healthy_after_s: float = 30.0


@dataclass(frozen=True, slots=True)
class Death:
    """A process that died while it was meant to run: it is started again after `wait_s`."""

    pid: int
    code: int  # as `Process.returncode`: negative for a signal
    lived_s: float
    wait_s: float

    @property
    def described(self) -> str:
        return describe(self.code)


async def _terminate(proc: Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)


async def _nothing(proc: Process, code: int) -> None:
    return None


class Child:
    def __init__(
        self, label: str, spawn: Callable[[], Awaitable[Process]], *,
        on_death: Callable[[Death], None] = lambda death: None,
        on_exit: Callable[[Process, int], Awaitable[None]] = _nothing,
        backoff: Backoff = Backoff(),
    ) -> None:
        """`spawn`: starts the process (raises OSError when it cannot). `on_exit`: after each
        exit, stopping or not (its log relayed to the end, its metrics marked dead).
        `on_death`: after an exit while it was meant to run, before the wait."""
        self.label = label
        self._spawn = spawn
        self._on_death = on_death
        self._on_exit = on_exit
        self._backoff = backoff
        self._stopping = asyncio.Event()
        self._ask: Callable[[Process], Awaitable[None]] = _terminate
        self._proc: Process | None = None
        self._began = 0.0
        self._task: asyncio.Task[None] | None = None
        self.code: int | None = None  # the last exit status
        self.started = asyncio.Event()  # set at every start (a test waits for a restart)

    @property
    def process(self) -> Process | None:
        return self._proc

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    async def start(self) -> None:
        """The first start, whose OSError the caller gets; then it is kept running."""
        await self._start()
        self._task = asyncio.create_task(self._keep(), name=f"tokenmeter-child-{self.label}")

    async def _start(self) -> None:
        self._proc = await self._spawn()
        self._began = time.monotonic()
        self.started.set()
        if self._stopping.is_set():  # the stop came while it was being started
            await self._ask(self._proc)

    def send_signal(self, sig: signal.Signals) -> None:
        """To the running process, if there is one."""
        proc = self._proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)

    async def _rest(self, wait_s: float) -> bool:
        """Wait `wait_s`, or less if stopped meanwhile; True when stopped."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                await self._stopping.wait()
        return self._stopping.is_set()

    async def _keep(self) -> None:
        b = self._backoff
        wait = b.first_s
        while True:
            proc = self._proc
            assert proc is not None
            code = self.code = await proc.wait()
            await self._on_exit(proc, code)
            if self._stopping.is_set():
                return
            lived = time.monotonic() - self._began
            wait = b.first_s if lived >= b.healthy_after_s else wait
            self._on_death(Death(proc.pid, code, lived, wait))
            while True:
                if await self._rest(wait):
                    return
                wait = min(wait * 2, b.max_s)
                try:
                    await self._start()
                    break
                except OSError as exc:
                    log.error("cannot start %s again (%s); next try in %.1f s", self.label, exc,
                              wait)

    async def stop(self, timeout_s: float,
                   ask: Callable[[Process], Awaitable[None]] = _terminate) -> int | None:
        """No more starts: `ask` the process to exit (SIGTERM by default), wait up to
        `timeout_s` for it, then kill it. Its exit status (None: it never started)."""
        self._ask = ask
        self._stopping.set()
        proc, task = self._proc, self._task
        if proc is None or task is None:
            return None
        if proc.returncode is None:
            await ask(proc)
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.shield(task)
        except TimeoutError:
            log.error("%s (pid %d) did not exit in %.0f s: killing it", self.label,
                      self._proc.pid if self._proc is not None else proc.pid, timeout_s)
            self.send_signal(signal.SIGKILL)
            await task
        return self.code


def describe(code: int) -> str:
    """An exit status in words: `exit code 3`, `signal SIGKILL`."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
        return f"signal {-code}"
    return f"exit code {code}"
