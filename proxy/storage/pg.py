"""The one way a part of the proxy holds a PostgreSQL connection: `PgConnection`.

Every wing with a PostgreSQL connection holds it through this (the ledger's shipper sink, the
reader of the in-process reconcile, the capture store), so each comes back by itself after the
database restarts, fails over or drops the connection: a job that finds the connection broken
fails (its caller counts and logs that), the connection is dropped, and the next job opens a
new one. A connection kept for good would fail every round until the replica restarted, and a
broken one is easy to miss (`connection is closed` from asyncpg is an `InterfaceError`, not a
`PostgresError`).

A connection is opened when a job needs one (or by `connect`), one opening at a time, with its
session settings and the caller's `setup` (migrations, a table created if missing) run on it
before any job. A job that fails because of what it asked (a constraint, a type, a statement
the read-only session refuses) keeps the connection: only failures that say the connection or
the server is gone drop it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

import asyncpg

from proxy.storage.urls import mask_url

T = TypeVar("T")

CONNECT_TIMEOUT_S = 5.0
# A statement stuck longer than this (a network partition) fails, and its connection is dropped.
COMMAND_TIMEOUT_S = 60.0

# Server errors after which the connection is gone or about to be: class 08 (connection
# exceptions) and 57 (operator intervention: admin shutdown, crash shutdown, cannot connect now).
_GONE = (asyncpg.PostgresConnectionError, asyncpg.OperatorInterventionError)


def breaks_connection(exc: BaseException) -> bool:
    """Whether `exc`, raised by a statement, says its connection can no longer be used (any
    failure that is not the server's answer to the statement: the socket, a timeout, asyncpg's
    `InterfaceError`s; or the server's word that the connection or the server is going)."""
    if isinstance(exc, asyncpg.PostgresError):
        return isinstance(exc, _GONE)
    return True


class PgConnection:
    """One PostgreSQL connection, opened when needed and opened again after it broke."""

    def __init__(self, url: str, settings: Mapping[str, str], *,
                 setup: Callable[[asyncpg.Connection], Awaitable[None]] | None = None,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S,
                 command_timeout_s: float | None = COMMAND_TIMEOUT_S) -> None:
        """`settings`: the session's (`application_name`, ...). `setup`: run on every new
        connection before it is used; when it fails, the connection is closed again."""
        self._url = url
        self._settings = dict(settings)
        self._setup = setup
        self._connect_timeout_s = connect_timeout_s
        self._command_timeout_s = command_timeout_s
        self.location = mask_url(url)
        self._conn: asyncpg.Connection | None = None
        self._opening = asyncio.Lock()

    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._conn.is_closed()

    async def connect(self) -> asyncpg.Connection:
        """A new connection now (the old one, if any, closed first); raises when it cannot."""
        async with self._opening:
            await self._close()
            return await self._open()

    async def connection(self) -> asyncpg.Connection:
        """The open connection, or a new one when there is none or it broke."""
        conn = self._conn
        if conn is not None and not conn.is_closed():
            return conn
        async with self._opening:
            conn = self._conn
            if conn is not None and not conn.is_closed():
                return conn  # another job opened it meanwhile
            await self._close()
            return await self._open()

    def current(self) -> asyncpg.Connection:
        """The open connection, without opening one: for a caller that connects itself (the
        shipper, whose connecting is a stage of its own with its backoff)."""
        conn = self._conn
        if conn is None or conn.is_closed():
            raise asyncpg.ConnectionDoesNotExistError(f"{self.location} is not connected")
        return conn

    async def run(self, job: Callable[[asyncpg.Connection], Awaitable[T]]) -> T:
        """`job` on the connection. A failure that broke the connection drops it (the next
        job opens another) and is raised as it came."""
        conn = await self.connection()
        try:
            return await job(conn)
        except Exception as exc:
            if conn.is_closed() or breaks_connection(exc):
                self.drop(conn)
            raise

    def drop(self, conn: asyncpg.Connection | None = None) -> None:
        """Forget the connection (`conn`, when it is still the current one), closing its
        socket at once: a broken connection is not waited on."""
        if conn is not None and conn is not self._conn:
            return
        old, self._conn = self._conn, None
        if old is not None and not old.is_closed():
            old.terminate()

    async def close(self) -> None:
        async with self._opening:
            await self._close()

    async def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and not conn.is_closed():
            try:
                await conn.close(timeout=2)
            except Exception:
                conn.terminate()  # a dead server: just drop the socket

    async def _open(self) -> asyncpg.Connection:
        conn = await asyncpg.connect(self._url, timeout=self._connect_timeout_s,
                                     command_timeout=self._command_timeout_s,
                                     server_settings=self._settings)
        try:
            if self._setup is not None:
                await self._setup(conn)
        except BaseException:
            with contextlib.suppress(Exception):
                conn.terminate()
            raise
        self._conn = conn
        return conn
