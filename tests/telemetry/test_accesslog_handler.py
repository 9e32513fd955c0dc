"""The access log's own handler (`serve` installs it): no lock, the lines of one turn of the
event loop in one write, after the turn's callbacks that came first."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterator

import pytest

from proxy.telemetry.accesslog import LoopLineHandler

pytestmark = pytest.mark.timeout(10)


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    r, w = os.pipe()
    os.set_blocking(r, False)
    yield r, w
    os.close(r)
    os.close(w)


def pending(fd: int) -> bytes:
    try:
        return os.read(fd, 1 << 16)
    except BlockingIOError:
        return b""


async def test_lines_of_one_loop_turn_go_out_together_and_whole(
        pipe: tuple[int, int]) -> None:
    r, w = pipe
    handler = LoopLineHandler(os.fdopen(os.dup(w), "w", encoding="utf-8"))
    assert handler.lock is None  # nothing shared with another thread's logging
    logger = logging.getLogger("tests.access.loopline")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    for i in range(3):
        logger.info(f'{{"n":{i},"text":"\\u00e9"}}')
    assert pending(r) == b""  # queued for the end of this turn
    await asyncio.sleep(0)
    assert pending(r) == b"".join(b'{"n":%d,"text":"\\u00e9"}\n' % i for i in range(3))
    logger.warning('{"event":"auth_failed"}')
    handler.flush()  # logging.shutdown's flush at exit: nothing queued is left behind
    assert pending(r) == b'{"event":"auth_failed"}\n'
    await asyncio.sleep(0)
    assert pending(r) == b""  # written once


def test_without_a_loop_a_line_is_written_at_once(pipe: tuple[int, int]) -> None:
    r, w = pipe
    handler = LoopLineHandler(os.fdopen(os.dup(w), "w", encoding="utf-8"))
    handler.handle(logging.makeLogRecord({"msg": '{"a":1}', "levelno": logging.INFO}))
    assert pending(r) == b'{"a":1}\n'
