"""Where captures are kept: the table `tokenmeter_captures`, beside the ledger's (in the ledger's
database by default, or in `capture.url`'s), never inside the ledger's rows.

In PostgreSQL the table lives in a schema of its own, `tokenmeter_capture`, not in `public`:
the ledger's read-only role (deploy/compose/ledger-reader.sql, Grafana's) reads every table of
`public`, those created later included, and captures hold whole prompts and answers. A new
schema grants nothing to anyone but its owner, so that role cannot reach them by construction.
A table left in `public` by an earlier version is moved there at open (the grants it got from
`public`'s default privileges revoked as it moves), or, should both exist (a replica of the
earlier version started during a rolling upgrade made it again), its rows are copied over and it
is dropped. SQLite has no schemas (and no
roles): the table is `tokenmeter_captures` in the file.

One row per captured request: the columns a listing filters on, and `data`, the zlib-compressed
JSON of `Capture.to_json()` (a capture is read whole or not at all, and its texts compress
well). The capture format carries its own version inside `data`, so the table needs no
migrations of the ledger's kind: it is created if missing and the ledger's schema is untouched.

SQLite calls run on one worker thread of the store's own (the event loop never waits on the
file; the connection is only used from the thread that opened it), as the ledger's sink does.
PostgreSQL goes through asyncpg, the ledger's driver.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import asyncpg

from proxy.capture.collect import completed, redactor
from proxy.capture.record import Capture
from proxy.config.capture import DEFAULT_REDACT, CaptureConfig
from proxy.config.ledger import LedgerConfig
from proxy.files import create_private
from proxy.ledger.query import ledger_path
from proxy.storage.pg import PgConnection
from proxy.storage.sql import Sql
from proxy.storage.urls import Dialect, dialect_of, sqlite_path, sqlite_url

T = TypeVar("T")
# `CaptureStore.list` hides the builtin inside the classes.
_Rows = list[tuple[Any, ...]]

TABLE = "tokenmeter_captures"
SCHEMA = "tokenmeter_capture"  # PostgreSQL's: see the module's docstring
PG_TABLE = f"{SCHEMA}.{TABLE}"
# pg_advisory_xact_lock's key: "tokencap" in ASCII. Replicas starting together create the
# schema and move an old table one at a time (two CREATE SCHEMAs at once: a unique violation).
PG_CREATE_LOCK = 0x746F6B656E636170
_COLUMNS = ("request_id", "started_at", "user_name", "key_name", "team", "requested_model",
            "model", "status", "error_class", "stream", "size", "data", "upstream_request_id")
_LISTED = ", ".join(c for c in _COLUMNS if c != "data")
# Added after the table's first form: a table made by an earlier version gets it at open
# (nullable; its captures have none). Last, so an earlier version's INSERT of its own columns
# and the copy of an old `public` table (`SELECT *`) still line up.
_UPSTREAM_ID = "upstream_request_id"
# One statement, one transaction: the schema (created only when missing, so a role that may not
# create schemas can use one an administrator made for it), the move of an earlier version's
# table out of `public` with its grants stripped (or its rows), then the table and its index.
_PG_CREATE = (f"""
DO $$
DECLARE
  grantee text;
BEGIN
  PERFORM pg_advisory_xact_lock({PG_CREATE_LOCK});
  IF to_regnamespace('{SCHEMA}') IS NULL THEN
    CREATE SCHEMA {SCHEMA};
  END IF;
  IF to_regclass('public.{TABLE}') IS NULL THEN
    NULL;
  ELSIF to_regclass('{PG_TABLE}') IS NULL THEN
    ALTER TABLE public.{TABLE} SET SCHEMA {SCHEMA};
    FOR grantee IN
      SELECT DISTINCT CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(r.rolname) END
      FROM pg_class c CROSS JOIN LATERAL aclexplode(c.relacl) a
      LEFT JOIN pg_roles r ON r.oid = a.grantee
      WHERE c.oid = '{PG_TABLE}'::regclass AND a.grantee <> c.relowner
    LOOP
      EXECUTE format('REVOKE ALL ON {PG_TABLE} FROM %s', grantee);
    END LOOP;
  ELSE
    -- Both: a replica of the earlier version made it again (started during a rolling upgrade).
    -- Its rows join the others (the same columns: the same DDL), and it goes.
    INSERT INTO {PG_TABLE} SELECT * FROM public.{TABLE} ON CONFLICT (request_id) DO NOTHING;
    DROP TABLE public.{TABLE};
  END IF;
  CREATE TABLE IF NOT EXISTS {PG_TABLE} (
    request_id text PRIMARY KEY,
    started_at timestamptz NOT NULL,
    user_name text,
    key_name text,
    team text,
    requested_model text NOT NULL,
    model text,
    status integer NOT NULL,
    error_class text NOT NULL,
    stream boolean NOT NULL,
    size bigint NOT NULL,
    data bytea NOT NULL
  );
  CREATE INDEX IF NOT EXISTS {TABLE}_started ON {PG_TABLE} (started_at);
  ALTER TABLE {PG_TABLE} ADD COLUMN IF NOT EXISTS {_UPSTREAM_ID} text;
  CREATE INDEX IF NOT EXISTS {TABLE}_{_UPSTREAM_ID} ON {PG_TABLE} ({_UPSTREAM_ID});
END
$$""",)
_SQLITE_CREATE = (f"""
CREATE TABLE IF NOT EXISTS {TABLE} (
    request_id TEXT PRIMARY KEY,
    started_at REAL NOT NULL,
    user_name TEXT,
    key_name TEXT,
    team TEXT,
    requested_model TEXT NOT NULL,
    model TEXT,
    status INTEGER NOT NULL,
    error_class TEXT NOT NULL,
    stream INTEGER NOT NULL,
    size INTEGER NOT NULL,
    data BLOB NOT NULL
)""", f"CREATE INDEX IF NOT EXISTS {TABLE}_started ON {TABLE} (started_at)")
_SQLITE_PRUNE = (f"DELETE FROM {TABLE} WHERE rowid IN "
                 f"(SELECT rowid FROM {TABLE} WHERE started_at < ? LIMIT ?)")
# By physical address, as the ledger's retention does: the transaction locks `limit` rows only.
_PG_PRUNE = (f"DELETE FROM {PG_TABLE} WHERE ctid = ANY(ARRAY("
             f"SELECT ctid FROM {PG_TABLE} WHERE started_at < $1 LIMIT $2))")
_PG_TYPES = ("text", "timestamptz", "text", "text", "text", "text", "text", "integer", "text",
             "boolean", "bigint", "bytea", "text")
_PG_INSERT = (f"INSERT INTO {PG_TABLE} ({', '.join(_COLUMNS)}) SELECT * FROM unnest("
              + ", ".join(f"${i + 1}::{t}[]" for i, t in enumerate(_PG_TYPES))
              + ") ON CONFLICT (request_id) DO NOTHING RETURNING size")
BUSY_TIMEOUT_MS = 10_000
_PG_SESSION = {"application_name": "tokenmeter-captures"}


def default_url(capture: CaptureConfig, ledger: LedgerConfig) -> str:
    """Where captures go: `capture.url`, else the ledger's database (its URL, else its SQLite
    file in the state directory)."""
    if capture.url is not None:
        return capture.url
    if ledger.url is not None:
        return ledger.url
    return sqlite_url(ledger_path(None))


# The parts of a capture whose `text` is kept after the JSON rather than inside it: JSON-escaping
# a request body or a stream (quotes on every line) was half of what encoding a capture cost.
_TEXTS = ("request", "upstream_request", "response", "upstream_error", "chunks")


def encode(capture: Capture) -> bytes:
    """`data`: the JSON of `Capture.to_json()` without the big texts, a newline (compact JSON
    has none of its own), then those texts' UTF-8 one after another (each part says its length
    in `bytes`); zlib-compressed. Level 1: a third of the default's CPU for a few percent more
    bytes (an SSE stream's repeated JSON compresses well at any level)."""
    obj = capture.to_json()  # fresh dicts for every part: popping from them changes nothing
    texts: list[bytes] = []
    for name in _TEXTS:
        part = obj.get(name)
        if part is not None:
            text = part.pop("text").encode()
            part["bytes"] = len(text)
            texts.append(text)
    head = json.dumps(obj, separators=(",", ":")).encode()
    return zlib.compress(b"".join([head, b"\n", *texts]), 1)


def decode(data: bytes, redact: Callable[[str], str] | None = None) -> Capture:
    """A stored capture as read: a stream kept as chunks is cut into events and its output
    reassembled, then redacted with `redact` (default: `capture.redact`'s default list)."""
    head, _, texts = zlib.decompress(data).partition(b"\n")
    obj = json.loads(head)
    at = 0
    for name in _TEXTS:
        part = obj.get(name)
        if part is not None and "bytes" in part:  # else all JSON, as first written
            end = at + part.pop("bytes")
            part["text"] = texts[at:end].decode()
            at = end
    capture = Capture.from_json(obj)
    return completed(capture, redact or redactor(list(DEFAULT_REDACT)))


@dataclass(frozen=True, slots=True)
class CaptureRow:
    """One capture as a listing shows it; `size` is its stored (compressed) length in bytes."""

    request_id: str
    started_at: float  # unix seconds
    user: str | None
    key_name: str | None
    team: str | None
    requested_model: str
    model: str | None
    status: int
    error_class: str
    stream: bool
    size: int
    upstream_request_id: str | None = None

    @staticmethod
    def of(row: Sequence[Any]) -> CaptureRow:
        started = row[1].timestamp() if isinstance(row[1], datetime) else float(row[1])
        return CaptureRow(row[0], started, row[2], row[3], row[4], row[5], row[6], int(row[7]),
                          row[8], bool(row[9]), int(row[10]), row[11])


def either_id(q: Sql, request_id: str) -> str:
    """The term matching a request by either of its ids: tokenmeter's (`x-tokenmeter-request-id`,
    the row's key) or the upstream's (what the SDKs show as `request_id`)."""
    return f"(request_id = {q.p(request_id)} OR upstream_request_id = {q.p(request_id)})"


@dataclass(frozen=True, slots=True)
class CaptureFilter:
    """Which captures a listing shows (each None: any), newest first, at most `limit`.
    `model` matches the model asked for or the one sent upstream."""

    user: str | None = None
    model: str | None = None
    status: int | None = None
    error_class: str | None = None
    since: float | None = None  # unix seconds, inclusive
    until: float | None = None  # unix seconds, exclusive
    limit: int = 100
    request_id: str | None = None  # tokenmeter's id of the request, or the upstream's

    def where(self, q: Sql) -> str:
        terms = []
        if self.request_id is not None:
            terms.append(either_id(q, self.request_id))
        if self.user is not None:
            terms.append(f"user_name = {q.p(self.user)}")
        if self.model is not None:
            terms.append(f"(model = {q.p(self.model)} OR requested_model = {q.p(self.model)})")
        if self.status is not None:
            terms.append(f"status = {q.p(self.status)}")
        if self.error_class is not None:
            terms.append(f"error_class = {q.p(self.error_class)}")
        if self.since is not None:
            terms.append(f"started_at >= {q.ts(self.since)}")
        if self.until is not None:
            terms.append(f"started_at < {q.ts(self.until)}")
        return " AND ".join(terms) or "TRUE"


class CaptureStore:
    """The captures table in one database. `open` creates the table when it is missing."""

    dialect: Dialect
    table: str  # its name as this dialect's statements write it
    location: str

    @staticmethod
    async def open(url: str) -> CaptureStore:
        """`url`: sqlite:///<path> or postgresql://... (see `default_url`)."""
        store: CaptureStore
        dialect = dialect_of(url)
        if dialect is Dialect.POSTGRESQL:
            store = _PostgresStore(url)
        elif dialect is Dialect.SQLITE:
            store = _SqliteStore(sqlite_path(url))
        else:
            raise ValueError(f"{url!r}: a capture URL is sqlite:///<path> or postgresql://...")
        try:
            await store._open()
        except BaseException:
            await store.close()  # the SQLite worker thread, a half-open connection
            raise
        return store

    async def write(self, captures: Sequence[Capture]) -> int:
        """Store `captures` in one statement; one already stored (by request_id) is kept as it
        was. Returns the bytes stored for the new ones (their compressed size: what
        `proxy.capture.writer` counts)."""
        if not captures:
            return 0
        return await self._insert(captures)

    def _rows(self, captures: Sequence[Capture]) -> _Rows:
        """The batch's rows: encoding (JSON, then zlib) is CPU work, run on a worker thread."""
        return [self._values(c) for c in captures]

    def _values(self, c: Capture) -> tuple[Any, ...]:
        started = Sql(self.dialect)
        started.ts(c.started_at)
        data = encode(c)
        return (c.request_id, started.params[0], c.user, c.key_name, c.team, c.requested_model,
                c.model, c.status, c.error_class, c.stream, len(data), data,
                c.upstream_request_id)

    async def get(self, request_id: str,
                  redact: Callable[[str], str] | None = None) -> Capture | None:
        """The capture of `request_id` (tokenmeter's id, else the upstream's), as `decode`
        reads it (with `redact`)."""
        q = Sql(self.dialect)
        # Tokenmeter's id first: the primary key; an upstream's id names one request too,
        # but should two share it (one upstream's ids are another's), the newest is shown.
        rows = await self._fetch(
            f"SELECT data FROM {self.table} WHERE {either_id(q, request_id)} "
            f"ORDER BY request_id = {q.p(request_id)} DESC, started_at DESC LIMIT 1", q.params)
        return decode(bytes(rows[0][0]), redact) if rows else None

    async def list(self, filters: CaptureFilter) -> list[CaptureRow]:
        q = Sql(self.dialect)
        where = filters.where(q)
        text = (f"SELECT {_LISTED} FROM {self.table} WHERE {where} "
                f"ORDER BY started_at DESC, request_id LIMIT {q.p(filters.limit)}")
        return [CaptureRow.of(r) for r in await self._fetch(text, q.params)]

    async def delete_older_than(self, cutoff: float, slice_rows: int) -> int:
        """Delete captures started before `cutoff`, `slice_rows` at a time, each slice its own
        short transaction (a writer waits one slice at most). Returns how many went."""
        if slice_rows < 1:
            raise ValueError(f"slice_rows must be at least 1, not {slice_rows}")
        total = 0
        while True:
            deleted = await self._prune(cutoff, slice_rows)
            total += deleted
            if deleted < slice_rows:
                return total

    async def _open(self) -> None:
        raise NotImplementedError

    async def _insert(self, captures: Sequence[Capture]) -> int:
        raise NotImplementedError

    async def _fetch(self, text: str, params: Sequence[object]) -> _Rows:
        raise NotImplementedError

    async def _prune(self, cutoff: float, limit: int) -> int:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError


class _SqliteStore(CaptureStore):
    dialect = Dialect.SQLITE
    table = TABLE

    def __init__(self, path: Path) -> None:
        self.path = path
        self.location = sqlite_url(path)
        self._conn: sqlite3.Connection | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="tm-capture-sqlite")

    async def _run(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    async def _open(self) -> None:
        await self._run(self._open_file)

    def _open_file(self) -> None:
        create_private(self.path)  # 0600 before SQLite makes it (and its -wal, -shm, alike)
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False,
                               timeout=BUSY_TIMEOUT_MS / 1000)
        try:
            conn.execute("PRAGMA journal_mode=WAL")  # the ledger's file is in WAL mode too
            conn.execute("PRAGMA synchronous=NORMAL")
            for statement in _SQLITE_CREATE:
                conn.execute(statement)
            known = {r[1] for r in conn.execute(f"PRAGMA table_info({TABLE})")}
            if _UPSTREAM_ID not in known:  # a table an earlier version made
                conn.execute(f"ALTER TABLE {TABLE} ADD COLUMN {_UPSTREAM_ID} TEXT")
            conn.execute(f"CREATE INDEX IF NOT EXISTS {TABLE}_{_UPSTREAM_ID} "
                         f"ON {TABLE} ({_UPSTREAM_ID})")
        except BaseException:
            conn.close()
            raise
        self._conn = conn

    def _require(self) -> sqlite3.Connection:
        if self._conn is None:
            raise sqlite3.OperationalError("the capture store is closed")
        return self._conn

    async def _insert(self, captures: Sequence[Capture]) -> int:
        # One statement for the batch, encoded on the store's own thread (one trip for both);
        # RETURNING names the rows that were new (a conflict returns none), whose sizes are
        # the bytes stored.
        marks = "(" + ", ".join("?" * len(_COLUMNS)) + ")"
        text = (f"INSERT INTO {TABLE} ({', '.join(_COLUMNS)}) VALUES "
                f"{', '.join([marks] * len(captures))} "
                "ON CONFLICT (request_id) DO NOTHING RETURNING size")

        def run() -> int:
            params = tuple(v for row in self._rows(captures) for v in row)
            return sum(r[0] for r in self._require().execute(text, params).fetchall())

        return await self._run(run)

    async def _fetch(self, text: str, params: Sequence[object]) -> _Rows:
        def run() -> _Rows:
            return [tuple(r) for r in self._require().execute(text, tuple(params)).fetchall()]

        return await self._run(run)

    async def _prune(self, cutoff: float, limit: int) -> int:
        return await self._run(
            lambda: self._require().execute(_SQLITE_PRUNE, (cutoff, limit)).rowcount)

    async def close(self) -> None:
        def run() -> None:
            conn, self._conn = self._conn, None
            if conn is not None:
                conn.close()

        await self._run(run)
        self._executor.shutdown(wait=False)


class _PostgresStore(CaptureStore):
    """Its connection is a `PgConnection` (the ledger's way of holding one): a batch that
    finds it broken (the server restarted) is dropped like any batch the store refuses
    (captures are evidence, not books: `proxy.capture.writer`), and the next one reconnects."""

    dialect = Dialect.POSTGRESQL
    table = PG_TABLE

    def __init__(self, url: str) -> None:
        self._pg = PgConnection(url, _PG_SESSION, setup=self._create)
        self.location = self._pg.location

    async def _open(self) -> None:
        await self._pg.connect()

    @staticmethod
    async def _create(conn: asyncpg.Connection) -> None:
        for statement in _PG_CREATE:
            await conn.execute(statement)

    async def _insert(self, captures: Sequence[Capture]) -> int:
        # One statement and one round trip for the batch: each column as an array.
        rows = await asyncio.to_thread(self._rows, captures)
        columns = [list(c) for c in zip(*rows, strict=True)]
        new = await self._pg.run(lambda conn: conn.fetch(_PG_INSERT, *columns))
        return sum(int(r[0]) for r in new)

    async def _fetch(self, text: str, params: Sequence[object]) -> _Rows:
        return [tuple(r) for r in await self._pg.run(lambda conn: conn.fetch(text, *params))]

    async def _prune(self, cutoff: float, limit: int) -> int:
        q = Sql(self.dialect)
        q.ts(cutoff)
        status = await self._pg.run(lambda conn: conn.execute(_PG_PRUNE, q.params[0], limit))
        return int(status.rsplit(" ", 1)[1])  # "DELETE <rows>"

    async def close(self) -> None:
        await self._pg.close()
