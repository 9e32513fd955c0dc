"""The embedded ledger: an SQLite file (WAL mode), the default when no `ledger.url` is set.

Every call runs on one worker thread of the sink's own, so the event loop never waits on the
file and the connection is only ever used from the thread that opened it (and a write still
running when the shipper is cancelled finishes before `close` runs). WAL lets `tokenmeter
usage` read while the proxy writes; `synchronous=NORMAL` is WAL's usual setting: a committed
batch survives a crash of the process, a power loss may take the last ones back (the spool's
scope too).

Rows are inserted with `ON CONFLICT (request_id) DO NOTHING` rather than `INSERT OR IGNORE`:
both store a re-shipped row once, but OR IGNORE would also silently skip a row that breaks a
NOT NULL constraint, which must be loud instead.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from proxy.ledger.migrate import migrate_sqlite
from proxy.ledger.row import COLUMNS, storable
from proxy.ledger.schema import TABLE

T = TypeVar("T")

_INSERT = (f"INSERT INTO {TABLE} ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))}) "
           "ON CONFLICT (request_id) DO NOTHING")
_PRUNE = (f"DELETE FROM {TABLE} WHERE rowid IN "
          f"(SELECT rowid FROM {TABLE} WHERE started_at < ? LIMIT ?)")
BUSY_TIMEOUT_MS = 10_000  # a report holding the file briefly is waited for, not an error


class SqliteSink:
    name = "sqlite"

    def __init__(self, path: Path) -> None:
        self.path = path
        self.location = f"sqlite://{path.absolute()}"
        self._conn: sqlite3.Connection | None = None
        self._executor: ThreadPoolExecutor | None = None

    @property
    def connected(self) -> bool:
        return self._conn is not None

    async def _run(self, fn: Callable[[], T]) -> T:
        if self._executor is None:  # made here, so a ledger started again after stop works
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="tm-ledger-sqlite")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    async def open(self) -> None:
        await self._run(self._open)

    def _open(self) -> None:
        self._close()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False,
                               timeout=BUSY_TIMEOUT_MS / 1000)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            migrate_sqlite(conn)
        except BaseException:
            conn.close()
            raise
        self._conn = conn

    @staticmethod
    def prepare(values: list[Any]) -> tuple[Any, ...]:
        return tuple(storable(values))  # JSON's types are SQLite's (a bool is stored as 0/1)

    def is_poison(self, exc: BaseException) -> bool:
        """A row this database will never take (a constraint, a value it cannot bind: a
        ValueError such as a string with no UTF-8 form; retried, it would stop the books)."""
        return isinstance(exc, (sqlite3.IntegrityError, sqlite3.InterfaceError,
                                sqlite3.ProgrammingError, OverflowError, TypeError, ValueError))

    async def write(self, records: list[tuple[Any, ...]]) -> int:
        return await self._run(lambda: self._write(records))

    def _write(self, records: list[tuple[Any, ...]]) -> int:
        conn = self._require()
        before = conn.total_changes
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.executemany(_INSERT, records)
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        return conn.total_changes - before

    async def prune(self, cutoff: float, limit: int) -> int:
        return await self._run(lambda: self._prune(cutoff, limit))

    def _prune(self, cutoff: float, limit: int) -> int:
        # One short transaction per slice (autocommit): writers wait at most one slice.
        return self._require().execute(_PRUNE, (cutoff, limit)).rowcount

    async def ping(self) -> None:
        pass  # a file: nothing goes away between writes that the next write would not see

    async def close(self) -> None:
        await self._run(self._close)

    def _close(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            conn.close()

    def shutdown(self) -> None:
        """The worker thread ends once what is queued on it has run."""
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None

    def _require(self) -> sqlite3.Connection:
        if self._conn is None:
            raise sqlite3.OperationalError("the ledger database is not open")
        return self._conn
