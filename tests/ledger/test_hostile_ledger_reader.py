"""The ledger's read-only role (deploy/compose/ledger-reader.sql) on the machine's PostgreSQL 15
(issue 20, item 22): `grafana_reader` could `SET statement_timeout = 0` and run as long as it
liked. PostgreSQL lets every role set its own statement_timeout (and even ALTER ROLE itself),
so the limit it cannot lift is enforced from outside: `tokenmeter_cancel_slow_queries`, run
by an administrator (the compose stack's `ledger-guard`), and a connection limit the role
cannot raise. The test creates its own database and role and drops both.

Issue 31: the SQL runs again on an existing database (item 23: the upgrade path; it stopped at
"role already exists", and the guard function of a volume made before it existed was never
created), and the role cannot read captures, which live in the ledger's database by default
(item 21): the proxy keeps them in a schema of their own, which grants it nothing."""

from __future__ import annotations

import asyncio
import re
import subprocess
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import asyncpg
import pytest
import yaml

from proxy.capture.store import CaptureFilter, CaptureStore
from proxy.ledger.migrate import migrate_postgres
from proxy.ledger.schema import TABLE as LEDGER_TABLE
from tests.capture.captures import capture
from tests.helpers import ROOT, until

pytestmark = pytest.mark.timeout(90)

READER_SQL = ROOT / "deploy" / "compose" / "ledger-reader.sql"
COMPOSE = ROOT / "deploy" / "docker-compose.yml"


@dataclass(frozen=True)
class Ledger:
    admin_url: str
    reader_url: str
    reader: str


async def run_reader_sql(db: str, reader: str, password: str = "test") -> None:
    """deploy/compose/ledger-reader.sql as compose's ledger-init.sh runs it (ON_ERROR_STOP),
    as the database's owner."""
    run = await asyncio.to_thread(
        subprocess.run,
        ["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-h", "127.0.0.1", "-U", "postgres",
         "-d", db, "-v", "owner=postgres", "-v", f"reader={reader}",
         "-v", f"reader_password={password}", "-f", str(READER_SQL)],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.fixture
async def ledger(pg_url: str) -> AsyncIterator[Ledger]:
    db = pg_url.rsplit("/", 1)[1]
    reader = f"tm_reader_{uuid.uuid4().hex[:12]}"
    await run_reader_sql(db, reader)
    try:
        yield Ledger(pg_url, f"postgresql://{reader}@127.0.0.1:5432/{db}", reader)
    finally:
        conn = await asyncpg.connect(pg_url)
        try:
            await conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1",
                reader)
            await conn.execute(f'DROP OWNED BY "{reader}"')
            await conn.execute(f'DROP ROLE "{reader}"')
        finally:
            await conn.close()


async def _running(admin: asyncpg.Connection, reader: str) -> None:
    """Until the reader's query is running: state in another server, so a poll."""

    async def active() -> bool:
        return bool(await admin.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE usename = $1 AND state = 'active'",
            reader))

    await until(active)


async def test_the_reader_cannot_outrun_the_guard(ledger: Ledger) -> None:
    reader = await asyncpg.connect(ledger.reader_url)
    admin = await asyncpg.connect(ledger.admin_url)
    try:
        assert await reader.fetchval("SHOW statement_timeout") == "1min"
        assert await reader.fetchval("SHOW default_transaction_read_only") == "on"
        # What PostgreSQL allows and the guard exists for: the role lifts its own default.
        await reader.execute("SET statement_timeout = 0")
        slow = asyncio.create_task(reader.fetchval("SELECT pg_sleep(60)"))
        await _running(admin, ledger.reader)
        # A limit of 0 s: anything running is past it, so the test need not wait a minute.
        cancelled = await admin.fetchval(
            "SELECT tokenmeter_cancel_slow_queries($1, interval '0 seconds')", ledger.reader)
        assert cancelled == 1
        async with asyncio.timeout(10):
            with pytest.raises(asyncpg.QueryCanceledError):
                await slow
        # Below the limit, nothing is touched.
        assert await admin.fetchval(
            "SELECT tokenmeter_cancel_slow_queries($1)", ledger.reader) == 0
        assert await reader.fetchval("SELECT 1") == 1  # the session itself lives on
    finally:
        await reader.close()
        await admin.close()


async def test_the_reader_cannot_lift_its_limits_or_write(ledger: Ledger) -> None:
    reader = await asyncpg.connect(ledger.reader_url)
    try:
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await reader.fetchval("SELECT tokenmeter_cancel_slow_queries($1)", ledger.reader)
        # Read-only is a default it can SET off; the grants hold all the same.
        await reader.execute("SET default_transaction_read_only = off")
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await reader.execute(f'ALTER ROLE "{ledger.reader}" CONNECTION LIMIT -1')
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await reader.execute("CREATE TABLE t (x int)")
        limit = await reader.fetchval(
            "SELECT rolconnlimit FROM pg_roles WHERE rolname = $1", ledger.reader)
        assert limit == 4
        more = [await asyncpg.connect(ledger.reader_url) for _ in range(limit - 1)]
        try:
            with pytest.raises(asyncpg.TooManyConnectionsError):
                await asyncpg.connect(ledger.reader_url)
        finally:
            for conn in more:
                await conn.close()
    finally:
        await reader.close()


def test_compose_runs_the_guard_for_the_reader_grafana_uses() -> None:
    services = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))["services"]
    guard, db, grafana = services["ledger-guard"], services["ledger-db"], services["grafana"]
    assert guard["image"] == db["image"]
    env = {k: str(v) for k, v in guard["environment"].items()}
    assert env["LEDGER_READER_USER"] == str(db["environment"]["LEDGER_READER_USER"]) == str(
        grafana["environment"]["TOKENMETER_LEDGER_DB_USER"])
    assert env["PGHOST"] == "ledger-db" and env["PGUSER"] == db["environment"]["POSTGRES_USER"]
    assert env["PGPASSWORD"] == str(db["environment"]["POSTGRES_PASSWORD"])
    script = " ".join(guard["entrypoint"])
    # `$$` is compose's escape: the shell sees $LEDGER_READER_USER.
    assert "tokenmeter_cancel_slow_queries('$$LEDGER_READER_USER'" in script
    # The guard's limit is the role's own default.
    sql = READER_SQL.read_text(encoding="utf-8")
    (timeout,) = re.findall(r"SET statement_timeout = '(\d+)s'", sql)
    assert f"interval '{timeout} seconds'" in script
    assert guard["depends_on"]["ledger-db"]["condition"] == "service_healthy"


GUARD = "tokenmeter_cancel_slow_queries(name, interval)"


async def test_the_sql_runs_again_on_an_existing_database(ledger: Ledger) -> None:
    """The upgrade (deploy/README.md): a volume made before the guard function existed has the
    role but not the function; running the SQL again creates it and keeps the role as it
    should be, and a third run changes nothing."""
    db = ledger.admin_url.rsplit("/", 1)[1]
    admin = await asyncpg.connect(ledger.admin_url)
    try:
        await admin.execute(f"DROP FUNCTION {GUARD}")
        await admin.execute(f'ALTER ROLE "{ledger.reader}" CONNECTION LIMIT 40')
        for _ in range(2):
            await run_reader_sql(db, ledger.reader, password="rotated")
            assert await admin.fetchval("SELECT to_regprocedure($1) IS NOT NULL", GUARD)
            assert await admin.fetchval(
                "SELECT rolconnlimit FROM pg_roles WHERE rolname = $1", ledger.reader) == 4
        assert await admin.fetchval(
            "SELECT tokenmeter_cancel_slow_queries($1)", ledger.reader) == 0
        assert not await admin.fetchval(
            "SELECT has_function_privilege($1, $2, 'EXECUTE')", ledger.reader, GUARD)
    finally:
        await admin.close()
    reader = await asyncpg.connect(ledger.reader_url)
    try:
        assert await reader.fetchval("SHOW statement_timeout") == "1min"
    finally:
        await reader.close()


async def _captures_table(admin: asyncpg.Connection) -> str:
    """Where the proxy put its captures table, schema-qualified."""
    (name,) = await admin.fetch(
        "SELECT quote_ident(n.nspname) || '.' || quote_ident(c.relname) FROM pg_class c "
        "JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE c.relname = 'tokenmeter_captures' AND c.relkind = 'r'")
    return str(name[0])


async def _reader_cannot_read_captures(ledger: Ledger, table: str) -> None:
    reader = await asyncpg.connect(ledger.reader_url)
    try:
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await reader.fetchval(f"SELECT count(*) FROM {table}")
        # The name the operator typed: not in the role's search path either.
        with pytest.raises(asyncpg.UndefinedTableError):
            await reader.fetchval("SELECT count(*) FROM tokenmeter_captures")
        # The books, created by the proxy after the role: readable as before.
        assert await reader.fetchval(f"SELECT count(*) FROM {LEDGER_TABLE}") == 0
    finally:
        await reader.close()


async def test_the_reader_cannot_read_captures(ledger: Ledger) -> None:
    """The compose order: the role first (initdb), then the proxy creates the ledger's tables
    and, with capture on, the captures table in the same database."""
    admin = await asyncpg.connect(ledger.admin_url)
    try:
        await migrate_postgres(admin)
        store = await CaptureStore.open(ledger.admin_url)
        try:
            await store.write([capture("r1", 1_764_000_000.0)])
        finally:
            await store.close()
        table = await _captures_table(admin)
        assert await admin.fetchval(f"SELECT count(*) FROM {table}") == 1
        await _reader_cannot_read_captures(ledger, table)
    finally:
        await admin.close()


async def test_a_captures_table_an_earlier_version_left_in_public_moves_out_of_reach(
    ledger: Ledger,
) -> None:
    """An upgrade: the table is in `public` with the reader's grant (what `public`'s default
    privileges gave it); the proxy's next start moves it, with its rows and index, and strips
    the grant; running the SQL again afterwards is fine too."""
    admin = await asyncpg.connect(ledger.admin_url)
    try:
        await migrate_postgres(admin)
        store = await CaptureStore.open(ledger.admin_url)
        await store.write([capture("r1", 1_764_000_000.0)])
        await store.close()
        # Put back as an earlier version kept it.
        await admin.execute("ALTER TABLE tokenmeter_capture.tokenmeter_captures "
                            "SET SCHEMA public")
        await admin.execute("DROP SCHEMA tokenmeter_capture")
        await admin.execute(f'GRANT SELECT ON public.tokenmeter_captures TO "{ledger.reader}"')
        reader = await asyncpg.connect(ledger.reader_url)
        try:
            assert await reader.fetchval("SELECT count(*) FROM tokenmeter_captures") == 1
        finally:
            await reader.close()

        store = await CaptureStore.open(ledger.admin_url)
        try:
            assert await store.get("r1") == capture("r1", 1_764_000_000.0)
        finally:
            await store.close()
        table = await _captures_table(admin)
        assert table == "tokenmeter_capture.tokenmeter_captures"
        assert await admin.fetchval(
            "SELECT count(*) FROM pg_indexes WHERE schemaname = 'tokenmeter_capture' "
            "AND indexname = 'tokenmeter_captures_started'") == 1
        assert not await admin.fetchval(
            "SELECT has_table_privilege($1, $2, 'SELECT')", ledger.reader, table)
        await _reader_cannot_read_captures(ledger, table)
        await run_reader_sql(ledger.admin_url.rsplit("/", 1)[1], ledger.reader)
        await _reader_cannot_read_captures(ledger, table)
    finally:
        await admin.close()


async def test_a_captures_table_an_earlier_replica_made_again_is_merged_and_dropped(
    ledger: Ledger,
) -> None:
    """A rolling upgrade: the new replica moved the table, then a replica of the earlier
    version started and made `public.tokenmeter_captures` again (with the reader's grant) and
    wrote to it. The next start of a new replica copies its rows over and drops it."""
    admin = await asyncpg.connect(ledger.admin_url)
    try:
        await migrate_postgres(admin)
        store = await CaptureStore.open(ledger.admin_url)
        await store.write([capture("r1", 1_764_000_000.0)])
        await store.close()
        await admin.execute("CREATE TABLE public.tokenmeter_captures "
                            "(LIKE tokenmeter_capture.tokenmeter_captures INCLUDING ALL)")
        await admin.execute("INSERT INTO public.tokenmeter_captures SELECT * FROM "
                            "tokenmeter_capture.tokenmeter_captures")
        await admin.execute("UPDATE public.tokenmeter_captures SET request_id = 'r2'")
        await admin.execute(f'GRANT SELECT ON public.tokenmeter_captures TO "{ledger.reader}"')

        store = await CaptureStore.open(ledger.admin_url)
        try:
            assert {r.request_id for r in await store.list(CaptureFilter())} == {"r1", "r2"}
        finally:
            await store.close()
        assert await admin.fetchval("SELECT to_regclass('public.tokenmeter_captures')") is None
        await _reader_cannot_read_captures(ledger, await _captures_table(admin))
    finally:
        await admin.close()
