"""Ids for requests and reservations: unique across processes, ordered by time, cheap.

32 lowercase hex digits, like a UUID's hex: microseconds since the epoch (14), a per-process
counter (6) and 48 random bits drawn once per process (12). `uuid4()` reads the OS's random
source on every call (a system call per id, two ids per request); these cost a counter and a
clock read. Ordered by time, rows the ledger appends land at the end of its primary-key index
instead of at random places in it.
"""

from __future__ import annotations

import itertools
import os
import time

_MASK = 0xFFFFFF


class _Ids:
    """The one owner of this process's id state."""

    __slots__ = ("_counter", "_node")

    def __init__(self) -> None:
        self._node = ""
        self._counter = itertools.count()
        self.seed()

    def seed(self) -> None:
        self._node = os.urandom(6).hex()
        self._counter = itertools.count()

    def new(self) -> str:
        return f"{time.time_ns() // 1000:014x}{next(self._counter) & _MASK:06x}{self._node}"


_IDS = _Ids()
os.register_at_fork(after_in_child=_IDS.seed)  # a forked child draws its own node
new_id = _IDS.new
