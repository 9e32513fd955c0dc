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

CREATE ROLE :"reader" LOGIN PASSWORD :'reader_password';
-- Read-only even if someone grants it more later; and a dashboard over a long time range
-- cannot hold the ledger database busy for long.
ALTER ROLE :"reader" SET default_transaction_read_only = on;
ALTER ROLE :"reader" SET statement_timeout = '60s';

GRANT CONNECT ON DATABASE :"DBNAME" TO :"reader";
GRANT USAGE ON SCHEMA public TO :"reader";
GRANT SELECT ON ALL TABLES IN SCHEMA public TO :"reader";
ALTER DEFAULT PRIVILEGES FOR ROLE :"owner" IN SCHEMA public GRANT SELECT ON TABLES TO :"reader";
