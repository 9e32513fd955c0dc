"""The shared ledger: PostgreSQL through asyncpg.

Why asyncpg rather than psycopg 3: it speaks PostgreSQL's binary protocol from C and is
asyncio-native, and `copy_records_to_table` streams a batch of Python tuples as a binary COPY
with no SQL text built per row. A batch is one transaction: COPY into a temporary staging table
(created once per connection, emptied at every commit), then one `INSERT ... SELECT ... ON
CONFLICT (request_id) DO NOTHING` into the ledger, so a row shipped twice (a crash between the
commit and the spool's cursor write) is stored once. COPY alone cannot skip conflicts, and
row-by-row INSERTs are the write path that becomes a bottleneck.

The rollups (`proxy.ledger.rollup`) are kept by the same statement, from the rows the INSERT
returns (those it actually inserted: a row already stored is not returned, so not counted
again). Retention subtracts the rows its DELETE returns, also in one statement. The local-day
rollup is kept in every zone its table lists (the returned rows joined with it); the sink's
configured zone is added to the list, with its sums, when it opens.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import asyncpg

from proxy.ledger import rollup
from proxy.ledger.migrate import add_zone_postgres, migrate_postgres, needs_zone
from proxy.ledger.row import COLUMNS, storable
from proxy.ledger.schema import TABLE
from proxy.storage.pg import PgConnection

# The spool forgets a batch once its commit returns, so the commit must be durable even where
# the server defaults to `synchronous_commit = off` (which acknowledges before the WAL is
# written: a crash of PostgreSQL then loses batches the spool has already forgotten).
# One WAL flush per batch of thousands of rows costs little.
_SESSION = {"synchronous_commit": "on", "application_name": "tokenmeter-ledger"}
_STAGE = "tokenmeter_stage"
_COLS = ", ".join(COLUMNS)
_CREATE_STAGE = (f"CREATE TEMP TABLE IF NOT EXISTS {_STAGE} ON COMMIT DELETE ROWS AS "
                 f"SELECT {_COLS} FROM {TABLE} WITH NO DATA")


def _with_rollups(change: str, sign: int) -> str:
    """`change` (an INSERT or DELETE ... RETURNING *) with every rollup kept from the rows it
    returns (data-modifying CTEs all run, once); the statement's value is their count."""
    parts = [f"changed AS ({change} RETURNING *)"]
    for i, r in enumerate(rollup.ROLLUPS):
        summed = rollup.aggregate(r, "changed", "true", sign=sign, postgresql=True)
        parts.append(f"r{i} AS ({rollup.upsert(r, summed, postgresql=True)})")
    return f"WITH {', '.join(parts)} SELECT count(*) FROM changed"


_MOVE = _with_rollups(f"INSERT INTO {TABLE} ({_COLS}) SELECT {_COLS} FROM {_STAGE} "
                      "ON CONFLICT (request_id) DO NOTHING", 1)
# A slice of old rows by their physical address (ctid): the subselect walks the started_at
# index, the delete is a TID scan, and the transaction holds row locks on `limit` rows only.
_PRUNE = _with_rollups(f"DELETE FROM {TABLE} WHERE ctid = ANY(ARRAY("
                       f"SELECT ctid FROM {TABLE} WHERE started_at < $1 LIMIT $2))", -1)
_DROP_EMPTY = tuple(rollup.drop_empty(r) for r in rollup.ROLLUPS)
# One replica prunes at a time (the others skip that round): "tokenprn" in ASCII.
PG_PRUNE_LOCK = 0x746F6B656E70726E
_STARTED = COLUMNS.index("started_at")
_ENDED = COLUMNS.index("ended_at")


class PostgresSink:
    name = "postgresql"

    def __init__(self, url: str, zone: str = "UTC") -> None:
        """`zone`: the configured time zone, added to the local-day rollup at `open`."""
        self.zone = zone
        # A statement stuck past the connection's command timeout (a network partition) fails
        # the batch: the rows stay in the spool and the shipper reconnects.
        self._pg = PgConnection(url, _SESSION, setup=self._setup)
        self.location = self._pg.location

    @property
    def connected(self) -> bool:
        return self._pg.connected

    async def open(self) -> None:
        await self._pg.connect()

    async def _setup(self, conn: asyncpg.Connection) -> None:
        await migrate_postgres(conn)
        if needs_zone(self.zone):
            await add_zone_postgres(conn, self.zone)
        await conn.execute(_CREATE_STAGE)

    @staticmethod
    def prepare(values: list[Any]) -> tuple[Any, ...]:
        storable(values)
        values[_STARTED] = datetime.fromtimestamp(values[_STARTED], UTC)
        values[_ENDED] = datetime.fromtimestamp(values[_ENDED], UTC)
        return tuple(values)

    def is_poison(self, exc: BaseException) -> bool:
        """A row this database will never take: a value out of its type's range or of the
        wrong type, a constraint. Connection trouble is not poison: the batch is retried."""
        return isinstance(exc, (asyncpg.DataError, asyncpg.IntegrityConstraintViolationError,
                                TypeError, ValueError, OverflowError))

    async def write(self, records: list[tuple[Any, ...]]) -> int:
        conn = self._require()
        async with conn.transaction():
            await conn.copy_records_to_table(_STAGE, records=records, columns=COLUMNS)
            inserted: int = await conn.fetchval(_MOVE)
        return inserted

    async def prune(self, cutoff: float, limit: int) -> int:
        conn = self._require()
        async with conn.transaction():
            if not await conn.fetchval("SELECT pg_try_advisory_xact_lock($1)", PG_PRUNE_LOCK):
                return 0  # another replica is pruning
            deleted: int = await conn.fetchval(_PRUNE, datetime.fromtimestamp(cutoff, UTC),
                                               limit)
            if deleted:
                for statement in _DROP_EMPTY:
                    await conn.execute(statement)
        return deleted

    async def ping(self) -> None:
        await self._require().fetchval("SELECT 1")

    async def close(self) -> None:
        await self._pg.close()

    def shutdown(self) -> None:
        pass

    def _require(self) -> asyncpg.Connection:
        return self._pg.current()
