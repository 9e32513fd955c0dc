"""proxy.server.app.stop_task: a background loop that loses a cancellation still ends."""

from __future__ import annotations

import asyncio

import pytest

from proxy.server.app import stop_task

pytestmark = pytest.mark.unit


async def test_a_loop_that_swallows_a_cancellation_is_cancelled_again() -> None:
    swallowed = 0

    async def loop() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed += 1  # as a cancellation turned into a TimeoutError and handled

    task = asyncio.create_task(loop())
    await asyncio.sleep(0)
    await asyncio.wait_for(stop_task(task), 10)
    assert task.cancelled() and swallowed == 1


async def test_a_task_that_ends_at_once_is_waited_for() -> None:
    task = asyncio.create_task(asyncio.sleep(3600))
    await asyncio.wait_for(stop_task(task), 10)
    assert task.cancelled()
