"""Reading the books: the ledger opened read-only, SQLite or PostgreSQL, behind one interface.

Reports and reconcile write each statement once with `proxy.storage.sql.Sql`, in the reader's
dialect. Nothing here ever writes: SQLite is opened with `mode=ro` and `query_only`, and a
PostgreSQL session is read-only (`default_transaction_read_only`), so a report run against the
production database cannot change it, whatever a query says.

Drivers: asyncpg for PostgreSQL (the writer's driver too: one dependency, and async, so an
in-process reconcile never blocks the proxy's event loop); the standard library's sqlite3 for
SQLite, its calls run in a worker thread for the same reason.
"""

from __future__ import annotations

import asyncio
import sqlite3
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from types import TracebackType
from typing import Any

import asyncpg

from proxy.config.ledger import LedgerConfig
from proxy.ledger.rollup import ZONES
from proxy.ledger.schema import LOCAL_DAY_VERSION, ROLLUP_VERSION, SCHEMA_TABLE, TABLE
from proxy.storage.pg import PgConnection
from proxy.storage.sql import Sql
from proxy.storage.urls import SQLITE_SCHEME, Dialect, dialect_of, mask_url, sqlite_path, state_dir

DEFAULT_FILE = "ledger.sqlite3"


class LedgerUnavailable(Exception):
    """The ledger cannot be read: no file, no table yet, the database unreachable."""


def ledger_path(url: str | None) -> Path:
    """The SQLite file of a ledger URL: None is `ledger.sqlite3` in the state directory;
    `sqlite:///abs/path.sqlite3` is `/abs/path.sqlite3` (the third slash starts the path)."""
    if url is None:
        return state_dir() / DEFAULT_FILE
    return sqlite_path(url)


@dataclass(frozen=True, slots=True)
class Location:
    """Where a ledger is: an SQLite file or a PostgreSQL URL."""

    dialect: Dialect
    path: Path | None = None
    url: str | None = None

    def describe(self) -> str:
        """For output and errors: the file, or the URL without its password."""
        if self.path is not None:
            return f"{SQLITE_SCHEME}{self.path}"
        assert self.url is not None
        return mask_url(self.url)


def locate(config: LedgerConfig, url: str | None = None) -> Location:
    """The ledger `config` writes to, or the one `url` names (it wins when given)."""
    url = url if url is not None else config.url
    dialect = Dialect.SQLITE if url is None else dialect_of(url)
    if dialect is None:
        raise LedgerUnavailable(f"{url!r}: a ledger URL is sqlite:///<path> or postgresql://...")
    if dialect is Dialect.POSTGRESQL:
        return Location(dialect, url=url)
    return Location(dialect, path=ledger_path(url))


class LedgerReader:
    """A read-only connection to one ledger. `fetch` returns plain tuples; integer sums come
    back as `int` or (PostgreSQL's `sum(bigint)` is numeric) `Decimal`: use `as_int`."""

    location: Location
    # Whether the rollups may answer (`rollups_ready`); False: every total from the rows
    # themselves (`reconcile --deep`: a row deleted or changed by hand, outside the sinks
    # that keep the rollups, shows only there).
    rollups: bool = True

    @property
    def dialect(self) -> Dialect:
        return self.location.dialect

    def sql(self) -> Sql:
        return Sql(self.dialect)

    async def fetch(self, text: str, params: Sequence[object] = ()) -> list[tuple[Any, ...]]:
        raise NotImplementedError

    def define(self, name: str, fn: Callable[[float], str]) -> None:
        """SQLite only: a one-argument SQL function of ours (time-zone buckets)."""
        raise NotImplementedError(f"{self.dialect} takes no functions of ours")

    async def close(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> LedgerReader:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()


def as_int(value: object) -> int:
    """A count or sum from either driver (None for the sum of no values) as an int."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    if isinstance(value, Decimal) and value == value.to_integral_value():
        return int(value)  # exact (PostgreSQL's numeric sums may come as 7.5E+5)
    raise TypeError(f"not an integer: {value!r}")


class _SqliteReader(LedgerReader):
    def __init__(self, location: Location, conn: sqlite3.Connection) -> None:
        self.location = location
        self._conn = conn
        # One statement at a time on the connection, each in a worker thread.
        self._lock = asyncio.Lock()

    async def fetch(self, text: str, params: Sequence[object] = ()) -> list[tuple[Any, ...]]:
        def run() -> list[tuple[Any, ...]]:
            return [tuple(r) for r in self._conn.execute(text, tuple(params)).fetchall()]

        async with self._lock:
            try:
                return await asyncio.to_thread(run)
            except sqlite3.Error as exc:
                raise LedgerUnavailable(f"{self.location.describe()}: {exc}") from exc

    def define(self, name: str, fn: Callable[[float], str]) -> None:
        self._conn.create_function(name, 1, fn, deterministic=True)

    async def close(self) -> None:
        async with self._lock:
            self._conn.close()


class _PostgresReader(LedgerReader):
    """Its connection is a `PgConnection`: one that broke (the server restarted) fails the
    statement that found it so (`LedgerUnavailable`), and the next statement opens another."""

    def __init__(self, location: Location, pg: PgConnection) -> None:
        self.location = location
        self._pg = pg

    async def fetch(self, text: str, params: Sequence[object] = ()) -> list[tuple[Any, ...]]:
        async def job(conn: asyncpg.Connection) -> list[asyncpg.Record]:
            return await conn.fetch(text, *params)

        try:
            records = await self._pg.run(job)
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError) as exc:
            raise LedgerUnavailable(f"{self.location.describe()}: {exc}") from exc
        return [tuple(r) for r in records]

    async def close(self) -> None:
        await self._pg.close()


async def open_reader(location: Location, timeout_s: float = 10.0, *,
                      rollups: bool = True) -> LedgerReader:
    """Open `location` read-only; `LedgerUnavailable` when there is no ledger to read there
    (no file, no table yet, the server not answering). `rollups`: see `LedgerReader`."""
    reader: LedgerReader
    if location.dialect is Dialect.SQLITE:
        assert location.path is not None
        reader = await asyncio.to_thread(_open_sqlite, location, timeout_s)
    else:
        assert location.url is not None
        pg = PgConnection(location.url, {
            "default_transaction_read_only": "on", "application_name": "tokenmeter-books",
            # A report groups up to a few hundred thousand rollup rows: in memory, not in
            # sorts and hashes spilled to disk; no JIT (its compiling costs more than it
            # saves here).
            "work_mem": "64MB", "jit": "off"},
            # A report's statements may rightly run long: no timeout of the writers'.
            connect_timeout_s=timeout_s, command_timeout_s=None)
        try:
            await pg.connect()
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError) as exc:
            raise LedgerUnavailable(f"{location.describe()}: {exc}") from exc
        reader = _PostgresReader(location, pg)
    reader.rollups = rollups
    try:
        await _require_table(reader)
    except BaseException:
        await reader.close()
        raise
    return reader


def _open_sqlite(location: Location, timeout_s: float) -> LedgerReader:
    path = location.path
    assert path is not None
    if not path.is_file():
        raise LedgerUnavailable(
            f"no ledger at {path} (the proxy creates it when it starts with the ledger on; "
            "give --ledger or --config to read another)"
        )
    uri = f"file:{urllib.parse.quote(str(path.resolve()))}?mode=ro"
    try:
        # check_same_thread off: each statement runs in a worker thread, one at a time.
        conn = sqlite3.connect(uri, uri=True, timeout=timeout_s, check_same_thread=False)
        conn.execute("PRAGMA query_only = ON")
    except sqlite3.Error as exc:
        raise LedgerUnavailable(f"{location.describe()}: {exc}") from exc
    return _SqliteReader(location, conn)


async def _require_table(reader: LedgerReader) -> None:
    q = reader.sql()
    if reader.dialect is Dialect.SQLITE:
        text = f"SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = {q.p(TABLE)}"
    else:
        # to_regclass follows the search path, as the queries' unqualified table name does.
        text = f"SELECT CASE WHEN to_regclass({q.p(TABLE)}) IS NULL THEN 0 ELSE 1 END"
    ((found,),) = await reader.fetch(text, q.params)
    if not as_int(found):
        raise LedgerUnavailable(
            f"{reader.location.describe()} holds no ledger table ({TABLE}) yet: no proxy has "
            "written to it"
        )


async def rollups_ready(reader: LedgerReader) -> bool:
    """Whether the ledger holds the rollups this code reads (`proxy.ledger.rollup`): its
    schema is at least at the version that last built them. A database an older proxy still
    writes is read from its rows, and so is any ledger by a reader opened without them."""
    return reader.rollups and await _version(reader) >= ROLLUP_VERSION


async def zone_rolled(reader: LedgerReader, zone: str) -> bool:
    """Whether the local-day rollup holds `zone` (`proxy.ledger.rollup.USAGE_LOCAL`): the
    schema has it and a shipper configured with the zone added it."""
    if not reader.rollups or await _version(reader) < LOCAL_DAY_VERSION:
        return False
    q = reader.sql()
    ((found,),) = await reader.fetch(f"SELECT count(*) FROM {ZONES} WHERE zone = {q.p(zone)}",
                                     q.params)
    return as_int(found) > 0


async def schema_version(reader: LedgerReader) -> int:
    """The schema version the ledger's database is at (0: none recorded)."""
    return await _version(reader)


async def _version(reader: LedgerReader) -> int:
    ((version,),) = await reader.fetch(f"SELECT max(version) FROM {SCHEMA_TABLE}")
    return 0 if version is None else as_int(version)
