-- A read-only role for Grafana's "Ledger" datasource (grafana/provisioning/datasources/ledger.yml)
-- or any other reporting tool: it reads the ledger's tables, those there now and those the
-- proxy's migrations create later, and can change nothing.
--
-- The compose stack runs it once, when the ledger-db volume is first created
-- (deploy/compose/ledger-init.sh). For an external database, run it as an administrator:
--
--   psql "postgresql://admin@ledger-db.example:5432/tokenmeter" \
--     -v owner=tokenmeter -v reader=grafana_reader -v reader_password='...' \
--     -f deploy/compose/ledger-reader.sql
--
-- owner: the role in the proxy's ledger.url (it creates the tables); reader: the new role.
\set ON_ERROR_STOP on

-- At most 4 sessions at once: a limit the role cannot lift (only an administrator may ALTER its
-- connection limit), so whatever it runs, it holds at most 4 backends of the ledger database.
CREATE ROLE :"reader" LOGIN PASSWORD :'reader_password' CONNECTION LIMIT 4;
-- Defaults for every session (Grafana never changes them): read-only even if someone grants it
-- more later, and a dashboard over a long time range cannot keep the database busy for long.
-- They are defaults, not limits: PostgreSQL lets any role SET its own statement_timeout (a
-- user-settable parameter; PostgreSQL 15's GRANT/REVOKE SET ON PARAMETER only governs
-- superuser-only ones), even ALTER ROLE itself SET it. The writes are refused by the grants
-- below whatever it sets; the time limit is enforced by tokenmeter_cancel_slow_queries.
ALTER ROLE :"reader" SET default_transaction_read_only = on;
ALTER ROLE :"reader" SET statement_timeout = '60s';
ALTER ROLE :"reader" SET idle_in_transaction_session_timeout = '60s';

GRANT CONNECT ON DATABASE :"DBNAME" TO :"reader";
GRANT USAGE ON SCHEMA public TO :"reader";
GRANT SELECT ON ALL TABLES IN SCHEMA public TO :"reader";
ALTER DEFAULT PRIVILEGES FOR ROLE :"owner" IN SCHEMA public GRANT SELECT ON TABLES TO :"reader";

-- The limit the role cannot lift: cancel its queries running past max_runtime, and end its
-- sessions idle in a transaction that long. Run by an administrator (or a role granted
-- pg_signal_backend) every few seconds: the compose stack's `ledger-guard` service does, every
-- 10 s; on an external database use cron, pg_cron or a pooler's query timeout (PgBouncer
-- query_timeout). Returns how many it cancelled or ended. Not callable by the reader.
CREATE OR REPLACE FUNCTION tokenmeter_cancel_slow_queries(
  reader name, max_runtime interval DEFAULT interval '60 seconds'
) RETURNS integer LANGUAGE sql AS $$
  SELECT count(*)::integer FROM pg_stat_activity a
  WHERE a.usename = reader AND a.pid <> pg_backend_pid()
    AND CASE
      WHEN a.state = 'active' AND now() - a.query_start > max_runtime
        THEN pg_cancel_backend(a.pid)
      WHEN a.state LIKE 'idle in transaction%' AND now() - a.state_change > max_runtime
        THEN pg_terminate_backend(a.pid)
      ELSE false
    END
$$;
REVOKE ALL ON FUNCTION tokenmeter_cancel_slow_queries(name, interval) FROM PUBLIC;
