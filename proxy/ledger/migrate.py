"""Bringing a ledger database to this code's schema version, once, whoever starts first.

`tokenmeter_schema` holds one row per applied migration. Each run is one transaction: read the
version, apply what is missing, record it. In PostgreSQL the transaction first takes an advisory
lock, so replicas starting together apply a migration once and never race on `CREATE TABLE`
(advisory locks are per database, so other databases on the server are not held up). In SQLite
`BEGIN IMMEDIATE` takes the write lock before reading the version, to the same effect.

Rollups are rebuilt from the rows (in the same transaction) when a migration being applied
says so: an upgraded database's rollups are exact from the start. On a large ledger that is one
pass over its rows, once, while the other replicas wait on the lock (their rows in their spools).

A database at a version newer than this code's is refused (`SchemaTooNew`): an older replica
must not write rows into a shape it does not know. Its rows wait in the spool meanwhile.
"""

from __future__ import annotations

import sqlite3
import time

import asyncpg

from proxy.ledger import rollup
from proxy.ledger.schema import MIGRATIONS, SCHEMA_TABLE, TABLE, VERSION

# pg_advisory_xact_lock's key: "tokenmet" in ASCII, a constant every replica agrees on.
PG_MIGRATE_LOCK = 0x746F6B656E6D6574


class SchemaTooNew(Exception):
    def __init__(self, found: int, known: int = VERSION) -> None:
        super().__init__(
            f"the ledger database's schema is at version {found}, newer than this tokenmeter's "
            f"{known}: upgrade tokenmeter (rows wait in the spool)"
        )
        self.found = found
        self.known = known


def migrate_sqlite(conn: sqlite3.Connection) -> int:
    """Apply what is missing; the version the database is at afterwards. `conn` must be in
    autocommit mode (`isolation_level=None`): the transaction here is explicit."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute(f"CREATE TABLE IF NOT EXISTS {SCHEMA_TABLE} "
                     "(version INTEGER PRIMARY KEY, applied_at REAL NOT NULL)")
        row = conn.execute(f"SELECT coalesce(max(version), 0) FROM {SCHEMA_TABLE}").fetchone()
        current = int(row[0])
        if current > VERSION:
            raise SchemaTooNew(current)
        for migration in MIGRATIONS:
            if migration.version <= current:
                continue
            for statement in migration.sqlite:
                conn.execute(statement)
            conn.execute(f"INSERT INTO {SCHEMA_TABLE} (version, applied_at) VALUES (?, ?)",
                         (migration.version, time.time()))
        if _rebuilds(current):
            for statement in rollup.rebuild(TABLE, postgresql=False):
                conn.execute(statement)
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    return max(current, VERSION)


async def migrate_postgres(conn: asyncpg.Connection) -> int:
    """Apply what is missing; the version the database is at afterwards."""
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", PG_MIGRATE_LOCK)
        await conn.execute(f"CREATE TABLE IF NOT EXISTS {SCHEMA_TABLE} (version integer PRIMARY "
                           "KEY, applied_at timestamptz NOT NULL DEFAULT now())")
        current = int(await conn.fetchval(f"SELECT coalesce(max(version), 0) FROM {SCHEMA_TABLE}"))
        if current > VERSION:
            raise SchemaTooNew(current)
        for migration in MIGRATIONS:
            if migration.version <= current:
                continue
            for statement in migration.postgresql:
                await conn.execute(statement)
            await conn.execute(f"INSERT INTO {SCHEMA_TABLE} (version) VALUES ($1)",
                               migration.version)
        if _rebuilds(current):
            for statement in rollup.rebuild(TABLE, postgresql=True):
                await conn.execute(statement)
    return max(current, VERSION)


def _rebuilds(current: int) -> bool:
    """Whether a migration past `current` changes the rollups: they are then built again,
    once, after every missing migration ran (their lists name the newest columns)."""
    return any(m.rollups and m.version > current for m in MIGRATIONS)
