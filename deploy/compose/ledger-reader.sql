-- A read-only role for Grafana's "Ledger" datasource (grafana/provisioning/datasources/ledger.yml)
-- or any other reporting tool: it reads the ledger's tables, those there now and those the
-- proxy's migrations create later, and can change nothing.
--
-- The compose stack runs it when the ledger-db volume is first created
-- (deploy/compose/ledger-init.sh). For an external database, run it as an administrator:
--
--   psql "postgresql://admin@ledger-db.example:5432/tokenmeter" \
--     -v owner=tokenmeter -v reader=grafana_reader -v reader_password='...' \
--     -f deploy/compose/ledger-reader.sql
--
-- owner: the role in the proxy's ledger.url (it creates the tables); reader: the read-only role.
-- Safe to run again, and run it again after every upgrade of tokenmeter (deploy/README.md,
-- "Upgrading the ledger database"): it creates what is missing, replaces the guard function,
-- sets the reader's password and limits again, and changes nothing else.
\set ON_ERROR_STOP on

-- Created only when missing (CREATE ROLE has no IF NOT EXISTS); then, every run, its password
-- and limits. At most 4 sessions at once: a limit the role cannot lift (only an administrator
-- may ALTER its connection limit), so whatever it runs, it holds at most 4 backends.
SELECT format('CREATE ROLE %I LOGIN', :'reader')
  WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = :'reader') \gexec
ALTER ROLE :"reader" LOGIN PASSWORD :'reader_password' CONNECTION LIMIT 4;
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

-- Captures (capture:, when it writes to this database) hold whole prompts and answers: they are
-- not the books and this role never reads them. The proxy keeps them in a schema of their own
-- (proxy/capture/store.py's SCHEMA), out of reach of the grants above, which are `public`'s.
-- Made here when missing, owned by the proxy's role (which may then lack CREATE on the
-- database), and every run stripped of anything granted to the reader, now or by default.
CREATE SCHEMA IF NOT EXISTS tokenmeter_capture AUTHORIZATION :"owner";
REVOKE ALL ON SCHEMA tokenmeter_capture FROM PUBLIC;
REVOKE ALL ON SCHEMA tokenmeter_capture FROM :"reader";
REVOKE ALL ON ALL TABLES IN SCHEMA tokenmeter_capture FROM :"reader";
ALTER DEFAULT PRIVILEGES FOR ROLE :"owner" IN SCHEMA tokenmeter_capture
  REVOKE ALL ON TABLES FROM :"reader";

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
