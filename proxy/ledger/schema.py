"""The ledger's schema, versioned: migration n takes a database from version n-1 to n.

Both dialects hold the same table and columns (`proxy.ledger.row.COLUMNS`, in that order, then
the generated `cost_usd`; columns added by later migrations come after it), so reports and
dashboards read one shape. Timestamps are
`timestamptz` in PostgreSQL and epoch seconds (REAL) in SQLite, which has no time type.
A migration is only ever appended; `tokenmeter_schema` holds the version a database is at.
Beside the table, the rollups (`proxy.ledger.rollup`): built by a migration with `rollups=True`
(the local-day rollup's zones, listed in their own table, are added by the shipper).
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.ledger import rollup

TABLE = "tokenmeter_requests"
# One row per applied migration (version, applied_at); a database is at its highest version.
SCHEMA_TABLE = "tokenmeter_schema"


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    postgresql: tuple[str, ...]
    sqlite: tuple[str, ...]
    # Rebuild every rollup from the rows once this migration's statements ran (and those of
    # any later one being applied with it): the rollups' lists changed (`proxy.ledger.rollup`).
    rollups: bool = False


_PG_V1 = f"""
CREATE TABLE IF NOT EXISTS {TABLE} (
    request_id text PRIMARY KEY,
    started_at timestamptz NOT NULL,
    ended_at timestamptz NOT NULL,
    replica text NOT NULL,
    user_name text NOT NULL,
    key_name text,
    team text,
    operation text NOT NULL,
    requested_model text NOT NULL,
    model text,
    response_model text,
    upstream text,
    fallback_from text,
    attempts integer NOT NULL,
    status integer NOT NULL,
    error_class text NOT NULL,
    stream boolean NOT NULL,
    input_tokens bigint NOT NULL,
    output_tokens bigint NOT NULL,
    cached_input_tokens bigint NOT NULL,
    reasoning_tokens bigint NOT NULL,
    token_source text NOT NULL,
    ttft_ms double precision,
    upstream_ttft_ms double precision,
    overhead_ms double precision,
    duration_ms double precision NOT NULL,
    output_tokens_per_s double precision,
    cost_nanousd bigint,
    price_version text,
    windows text NOT NULL,
    cost_usd numeric(20, 9) GENERATED ALWAYS AS (cost_nanousd / 1000000000.0) STORED
)"""

_SQLITE_V1 = f"""
CREATE TABLE IF NOT EXISTS {TABLE} (
    request_id TEXT PRIMARY KEY,
    started_at REAL NOT NULL,
    ended_at REAL NOT NULL,
    replica TEXT NOT NULL,
    user_name TEXT NOT NULL,
    key_name TEXT,
    team TEXT,
    operation TEXT NOT NULL,
    requested_model TEXT NOT NULL,
    model TEXT,
    response_model TEXT,
    upstream TEXT,
    fallback_from TEXT,
    attempts INTEGER NOT NULL,
    status INTEGER NOT NULL,
    error_class TEXT NOT NULL,
    stream INTEGER NOT NULL,
    input_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    cached_input_tokens INTEGER NOT NULL,
    reasoning_tokens INTEGER NOT NULL,
    token_source TEXT NOT NULL,
    ttft_ms REAL,
    upstream_ttft_ms REAL,
    overhead_ms REAL,
    duration_ms REAL NOT NULL,
    output_tokens_per_s REAL,
    cost_nanousd INTEGER,
    price_version TEXT,
    windows TEXT NOT NULL,
    cost_usd REAL GENERATED ALWAYS AS (cost_nanousd / 1000000000.0) VIRTUAL
)"""

_INDEXES = (
    f"CREATE INDEX IF NOT EXISTS {TABLE}_started ON {TABLE} (started_at)",
    f"CREATE INDEX IF NOT EXISTS {TABLE}_user ON {TABLE} (user_name, started_at)",
    f"CREATE INDEX IF NOT EXISTS {TABLE}_team ON {TABLE} (team, started_at)",
)

# v2: cache writes (Anthropic), a token type of their own; existing rows wrote none.
_V2_PG = (f"ALTER TABLE {TABLE} ADD COLUMN IF NOT EXISTS cache_creation_input_tokens bigint "
          "NOT NULL DEFAULT 0",)
_V2_SQLITE = (f"ALTER TABLE {TABLE} ADD COLUMN cache_creation_input_tokens INTEGER NOT NULL "
              "DEFAULT 0",)

# v3: the response cache. `cache` is what it did (proxy.record.CacheResult: none, hit,
# miss, bypass); on a hit the row's token columns are 0 (no upstream call) and the
# `saved_*` columns hold what the stored answer used, `saved_cost_nanousd` its cost at the
# price of the day of the hit (NULL: the model has no price). Existing rows: no cache, nothing
# saved.
_V3_SAVED = ("saved_input_tokens", "saved_output_tokens", "saved_cached_input_tokens",
             "saved_reasoning_tokens", "saved_cache_creation_input_tokens")
_V3_PG = (
    f"ALTER TABLE {TABLE} ADD COLUMN IF NOT EXISTS cache text NOT NULL DEFAULT 'none'",
    *(f"ALTER TABLE {TABLE} ADD COLUMN IF NOT EXISTS {c} bigint NOT NULL DEFAULT 0"
      for c in _V3_SAVED),
    f"ALTER TABLE {TABLE} ADD COLUMN IF NOT EXISTS saved_cost_nanousd bigint",
)
_V3_SQLITE = (
    f"ALTER TABLE {TABLE} ADD COLUMN cache TEXT NOT NULL DEFAULT 'none'",
    *(f"ALTER TABLE {TABLE} ADD COLUMN {c} INTEGER NOT NULL DEFAULT 0" for c in _V3_SAVED),
    f"ALTER TABLE {TABLE} ADD COLUMN saved_cost_nanousd INTEGER",
)
# v4: tags (proxy.config.tags): a JSON object with its keys sorted, as text in both dialects
# (PostgreSQL's reports cast it to jsonb, SQLite's read it with json_extract); rows from before
# had none.
_TAGS_PG = (f"ALTER TABLE {TABLE} ADD COLUMN IF NOT EXISTS tags text NOT NULL DEFAULT '{{}}'",)
_TAGS_SQLITE = (f"ALTER TABLE {TABLE} ADD COLUMN tags TEXT NOT NULL DEFAULT '{{}}'",)

# v7: the upstream's own id of the request, so a ticket quoting the id its SDK
# showed finds the row; rows from before have none. Indexed: it is looked up by, as the
# primary key is.
_UPSTREAM_ID_INDEX = (f"CREATE INDEX IF NOT EXISTS {TABLE}_upstream_request_id "
                      f"ON {TABLE} (upstream_request_id)")
_V7_PG = (f"ALTER TABLE {TABLE} ADD COLUMN IF NOT EXISTS upstream_request_id text",
          _UPSTREAM_ID_INDEX)
_V7_SQLITE = (f"ALTER TABLE {TABLE} ADD COLUMN upstream_request_id TEXT", _UPSTREAM_ID_INDEX)

MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, (_PG_V1, *_INDEXES), (_SQLITE_V1, *_INDEXES)),
    Migration(2, _V2_PG, _V2_SQLITE),
    Migration(3, _V3_PG, _V3_SQLITE),
    Migration(4, _TAGS_PG, _TAGS_SQLITE),
    # v5: the rollups (proxy.ledger.rollup), built from the rows already stored; their lists
    # name v3's cache columns and v4's tags.
    Migration(5, (), (), rollups=True),
    # v6: the rollup by local day (`proxy.ledger.rollup.USAGE_LOCAL`) and its list of zones,
    # empty: a shipper adds its configured zone, and its sums, when it starts
    # (`proxy.ledger.migrate.add_zone_sqlite`). The other rollups are as they were.
    Migration(6, (rollup.create_zones(postgresql=True),
                  *rollup.create(rollup.USAGE_LOCAL, postgresql=True)),
              (rollup.create_zones(postgresql=False),
               *rollup.create(rollup.USAGE_LOCAL, postgresql=False))),
    Migration(7, _V7_PG, _V7_SQLITE),
)

VERSION = MIGRATIONS[-1].version
# The version whose migration last rebuilt the rollups: a database below it has none, or
# rollups of other lists, and is read from its rows alone.
ROLLUP_VERSION = max(m.version for m in MIGRATIONS if m.rollups)
# The version that made the local-day rollup: a database below it has no zones table.
LOCAL_DAY_VERSION = 6
# The version that added `upstream_request_id`: a database below it has no such column.
UPSTREAM_ID_VERSION = 7
