"""Bringing a ledger database to this code's schema version, once, whoever starts first.

`tokenmeter_schema` holds one row per applied migration. Each run is one transaction: read the
version, apply what is missing, record it. In PostgreSQL the transaction first takes an advisory
lock, so replicas starting together apply a migration once and never race on `CREATE TABLE`
(advisory locks are per database, so other databases on the server are not held up). In SQLite
`BEGIN IMMEDIATE` takes the write lock before reading the version, to the same effect.

Rollups are rebuilt from the rows (in the same transaction) when a migration being applied
says so: an upgraded database's rollups are exact from the start. On a large ledger that is one
pass over its rows, once, while the other replicas wait on the lock (their rows in their spools).

The local-day rollup (`proxy.ledger.rollup.USAGE_LOCAL`) holds the zones its table lists. A
shipper adds its configured zone when it starts (`add_zone_sqlite`, `add_zone_postgres`): in
one transaction the zone's row and its sums of every row stored, so the rollup never holds a
zone partly. The batches that follow keep it (their statements join the zones table).

A database at a version newer than this code's is refused (`SchemaTooNew`): an older replica
must not write rows into a shape it does not know. Its rows wait in the spool meanwhile.
"""

from __future__ import annotations

import logging
import sqlite3
import time

import asyncpg

from proxy.ledger import rollup
from proxy.ledger.rollup import needs_zone
from proxy.ledger.schema import MIGRATIONS, SCHEMA_TABLE, TABLE, VERSION

__all__ = ["add_zone_postgres", "add_zone_sqlite", "migrate_postgres", "migrate_sqlite",
           "needs_zone"]

log = logging.getLogger("tokenmeter.ledger")

# A zone's backfill reads every row once: minutes on a large ledger, longer than a batch's
# command timeout (`proxy.storage.pg.COMMAND_TIMEOUT_S`).
BACKFILL_TIMEOUT_S = 3600.0
_LOCAL = rollup.USAGE_LOCAL


def _backfill(postgresql: bool) -> tuple[str, ...]:
    """A zone's local-day sums from every row, in place of any it had (the zone's row is
    inserted first, in the same transaction; its name is the one parameter)."""
    p = "$1" if postgresql else "?"
    return (f"DELETE FROM {_LOCAL.table} WHERE zone = {p}",
            rollup.upsert(_LOCAL, rollup.aggregate(_LOCAL, TABLE, f"z.zone = {p}",
                                                   postgresql=postgresql),
                          postgresql=postgresql))


_ZONE_KNOWN = f"SELECT count(*) FROM {rollup.ZONES} WHERE zone = "
_ADD_ZONE = f"INSERT INTO {rollup.ZONES} (zone) VALUES ({{}}) ON CONFLICT (zone) DO NOTHING"

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
    rollup.register(conn)  # the local-day rollup's statements call it (rebuilding it here)
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


def add_zone_sqlite(conn: sqlite3.Connection, zone: str) -> bool:
    """`zone` in the local-day rollup, if it is not yet: its row and its sums of every row, in
    one transaction (the write lock taken first: no batch commits meanwhile). Whether it was
    added. `conn`: autocommit, migrated (`migrate_sqlite` registered `tm_local_day`)."""
    if int(conn.execute(_ZONE_KNOWN + "?", (zone,)).fetchone()[0]):
        return False
    started = time.monotonic()
    conn.execute("BEGIN IMMEDIATE")
    try:
        before = conn.total_changes
        conn.execute(_ADD_ZONE.format("?"), (zone,))
        added = conn.total_changes > before
        if added:
            log.info("ledger: summing every row by local day in %s (once)", zone)
            for statement in _backfill(postgresql=False):
                conn.execute(statement, (zone,))
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    if added:
        log.info("ledger: the local-day rollup holds %s (%.1f s)", zone,
                 time.monotonic() - started)
    return added


async def add_zone_postgres(conn: asyncpg.Connection, zone: str) -> bool:
    """`zone` in the local-day rollup, if it is not yet: its row and its sums of every row, in
    one transaction. Whether it was added (False: it was there, or another replica added it
    meanwhile)."""
    if int(await conn.fetchval(_ZONE_KNOWN + "$1", zone)):
        return False
    started = time.monotonic()
    async with conn.transaction():
        # Other replicas' batches may be committing meanwhile. SHARE mode conflicts with the
        # ROW EXCLUSIVE lock every INSERT and DELETE of the ledger takes: it waits for the
        # batches (and retention slices) in flight to commit, whose rows the sums below then
        # see; the next ones wait for this transaction, and their statements, whose snapshot
        # is taken once they hold their lock, see the zone listed and keep it. Without it, a
        # batch committing between our snapshot and our commit would be summed by neither.
        # Readers are not held up; writers wait one pass over the ledger, once (their rows
        # wait in their spools). Two replicas adding the zone at once both get SHARE (it does
        # not conflict with itself): the second's insert waits for the first's and adds none.
        await conn.execute(f"LOCK TABLE {TABLE} IN SHARE MODE", timeout=BACKFILL_TIMEOUT_S)
        added = bool(await conn.fetchval(_ADD_ZONE.format("$1") + " RETURNING true", zone,
                                         timeout=BACKFILL_TIMEOUT_S))
        if added:
            log.info("ledger: summing every row by local day in %s (once)", zone)
            for statement in _backfill(postgresql=True):
                await conn.execute(statement, zone, timeout=BACKFILL_TIMEOUT_S)
    if added:
        log.info("ledger: the local-day rollup holds %s (%.1f s)", zone,
                 time.monotonic() - started)
    return added


def _rebuilds(current: int) -> bool:
    """Whether a migration past `current` changes the rollups: they are then built again,
    once, after every missing migration ran (their lists name the newest columns)."""
    return any(m.rollups and m.version > current for m in MIGRATIONS)
