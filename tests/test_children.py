"""`proxy.children.Child` on real child processes (`python -c ...`): started again after a
wait that doubles while it dies young, signals forwarded, stopped by SIGTERM or killed."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Awaitable, Callable

import pytest

from proxy.children import Backoff, Child, Death

pytestmark = pytest.mark.unit

# Ready once its handlers are in place (a signal before then would kill it, not be handled).
_WAITS = """
import signal, sys
signal.signal(signal.SIGHUP, lambda *_: print("hup", flush=True))
{extra}
print("ready", flush=True)
while True:
    signal.pause()
"""


def _spawner(code: str, started: list[asyncio.subprocess.Process],
             ) -> Callable[[], Awaitable[asyncio.subprocess.Process]]:
    async def spawn() -> asyncio.subprocess.Process:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", code, stdout=asyncio.subprocess.PIPE)
        started.append(proc)
        return proc

    return spawn


async def _line(proc: asyncio.subprocess.Process) -> str:
    assert proc.stdout is not None
    async with asyncio.timeout(30):
        return (await proc.stdout.readline()).decode().strip()


async def test_a_child_that_dies_young_is_started_again_after_a_doubling_wait() -> None:
    started: list[asyncio.subprocess.Process] = []
    deaths: list[Death] = []
    exits: list[int] = []
    three = asyncio.Event()

    def died(death: Death) -> None:
        deaths.append(death)
        if len(deaths) == 3:
            three.set()

    async def exited(proc: asyncio.subprocess.Process, code: int) -> None:
        exits.append(proc.pid)

    child = Child("crasher", _spawner("import sys; sys.exit(3)", started), on_death=died,
                  on_exit=exited, backoff=Backoff(first_s=0.05, max_s=0.15,
                                                  healthy_after_s=60))
    await child.start()
    async with asyncio.timeout(30):
        await three.wait()
    assert [d.code for d in deaths[:3]] == [3, 3, 3]
    assert [d.described for d in deaths[:1]] == ["exit code 3"]
    assert [d.wait_s for d in deaths[:3]] == [0.05, 0.1, 0.15]  # doubled, up to the most
    assert [d.pid for d in deaths[:3]] == [p.pid for p in started[:3]]
    assert await child.stop(10) == 3
    assert exits == [p.pid for p in started]  # each exit seen, the last one's included
    assert all(p.returncode == 3 for p in started)


async def test_signals_are_forwarded_and_stop_ends_it_with_sigterm() -> None:
    started: list[asyncio.subprocess.Process] = []
    deaths: list[Death] = []
    child = Child("waiter", _spawner(_WAITS.format(extra=""), started), on_death=deaths.append)
    await child.start()
    assert await _line(started[0]) == "ready"
    child.send_signal(signal.SIGHUP)
    assert await _line(started[0]) == "hup"
    assert await child.stop(30) == -signal.SIGTERM
    assert deaths == [] and len(started) == 1  # a stop is not a death: no start again


async def test_a_child_that_outlives_its_stop_is_killed() -> None:
    started: list[asyncio.subprocess.Process] = []
    ignores = _WAITS.format(extra="signal.signal(signal.SIGTERM, signal.SIG_IGN)")
    child = Child("stubborn", _spawner(ignores, started))
    await child.start()
    assert await _line(started[0]) == "ready"
    assert await child.stop(0.5) == -signal.SIGKILL
    assert len(started) == 1


async def test_a_killed_child_is_started_again_and_the_new_one_gets_the_signals() -> None:
    started: list[asyncio.subprocess.Process] = []
    child = Child("waiter", _spawner(_WAITS.format(extra=""), started),
                  backoff=Backoff(first_s=0.01))
    await child.start()
    first = started[0]
    assert await _line(first) == "ready"
    child.started.clear()
    first.kill()
    async with asyncio.timeout(30):
        await child.started.wait()
    second = started[1]
    assert child.pid == second.pid != first.pid
    assert await _line(second) == "ready"
    child.send_signal(signal.SIGHUP)
    assert await _line(second) == "hup"
    assert await child.stop(30) == -signal.SIGTERM
