#!/bin/sh
# Run once by the postgres image, when the ledger-db volume is empty
# (/docker-entrypoint-initdb.d/, deploy/docker-compose.yml): creates Grafana's read-only role.
# Run it again after an upgrade (deploy/README.md, "Upgrading the ledger database"): the SQL is
# safe to run any number of times, and the container's environment has every variable below.
# The database and its owner (POSTGRES_DB, POSTGRES_USER) the image has just created; the
# proxy creates its tables itself, at its first connection.
psql -v ON_ERROR_STOP=1 --no-psqlrc --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" \
  -v owner="$POSTGRES_USER" \
  -v reader="$LEDGER_READER_USER" \
  -v reader_password="$LEDGER_READER_PASSWORD" \
  -f /etc/tokenmeter-ledger/ledger-reader.sql
