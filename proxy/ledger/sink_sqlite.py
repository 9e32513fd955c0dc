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

The rollups (`proxy.ledger.rollup`) are kept in the batch's transaction, from the rows it
actually inserted: those past the table's largest rowid before the batch (SQLite gives a new
row the largest rowid plus one; the write lock is ours from `BEGIN IMMEDIATE`). A row already
stored is not inserted again, so it is not counted again. Retention subtracts the rows it
deletes from the rollups in the same transaction. The local-day rollup is kept in every zone
its table lists (`tm_local_day`, a function of ours: SQLite has no time zones); the sink's
configured zone is added to the list, with its sums, when it opens.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from proxy.files import create_private
from proxy.ledger import rollup
from proxy.ledger.migrate import add_zone_sqlite, migrate_sqlite, needs_zone
from proxy.ledger.row import COLUMNS, storable
from proxy.ledger.schema import TABLE
from proxy.storage.urls import sqlite_url

T = TypeVar("T")

_INSERT = (f"INSERT INTO {TABLE} ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))}) "
           "ON CONFLICT (request_id) DO NOTHING")
_NEWEST = f"SELECT coalesce(max(rowid), 0) FROM {TABLE}"
_ROLL_NEW = tuple(rollup.upsert(r, rollup.aggregate(r, TABLE, "rowid > ?", postgresql=False),
                                postgresql=False) for r in rollup.ROLLUPS)
# Retention: the slice's rowids first, so the rows subtracted are the rows deleted.
_DOOMED = "tm_prune"
_CREATE_DOOMED = f"CREATE TEMP TABLE IF NOT EXISTS {_DOOMED} (id INTEGER PRIMARY KEY)"
_PICK = (f"INSERT INTO {_DOOMED} (id) SELECT rowid FROM {TABLE} WHERE started_at < ? LIMIT ?")
_IN_DOOMED = f"rowid IN (SELECT id FROM {_DOOMED})"
_ROLL_OUT = tuple(rollup.upsert(r, rollup.aggregate(r, TABLE, _IN_DOOMED, postgresql=False,
                                                    sign=-1), postgresql=False)
                  for r in rollup.ROLLUPS)
_PRUNE = f"DELETE FROM {TABLE} WHERE {_IN_DOOMED}"
BUSY_TIMEOUT_MS = 10_000  # a report holding the file briefly is waited for, not an error


class SqliteSink:
    name = "sqlite"

    def __init__(self, path: Path, zone: str = "UTC") -> None:
        """`zone`: the configured time zone, added to the local-day rollup at `open`."""
        self.path = path
        self.zone = zone
        self.location = sqlite_url(path)
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
        create_private(self.path)  # 0600 before SQLite makes it (and its -wal, -shm, alike)
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False,
                               timeout=BUSY_TIMEOUT_MS / 1000)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            migrate_sqlite(conn)  # (registers tm_local_day, which the batches call)
            if needs_zone(self.zone):
                add_zone_sqlite(conn, self.zone)
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
        conn.execute("BEGIN IMMEDIATE")
        try:
            (newest,) = conn.execute(_NEWEST).fetchone()
            before = conn.total_changes
            conn.executemany(_INSERT, records)
            inserted = conn.total_changes - before
            if inserted:
                for statement in _ROLL_NEW:
                    conn.execute(statement, (newest,))
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        return inserted

    async def prune(self, cutoff: float, limit: int) -> int:
        return await self._run(lambda: self._prune(cutoff, limit))

    def _prune(self, cutoff: float, limit: int) -> int:
        # One short transaction per slice: writers wait at most one slice.
        conn = self._require()
        conn.execute(_CREATE_DOOMED)
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute(_PICK, (cutoff, limit))
            for statement in _ROLL_OUT:
                conn.execute(statement)
            deleted = conn.execute(_PRUNE).rowcount
            if deleted:
                for r in rollup.ROLLUPS:
                    conn.execute(rollup.drop_empty(r))
            conn.execute(f"DELETE FROM {_DOOMED}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        return deleted

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
