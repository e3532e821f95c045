#!/bin/bash
# First start on an empty data folder: initdb with POSTGRES_USER as the superuser (password
# auth over TCP), then POSTGRES_DB. Every start: the server in the foreground, listening on
# POSTGRES_LISTEN (default: every interface of the container) and PGPORT (default 5432).
set -euo pipefail
: "${POSTGRES_USER:?}" "${POSTGRES_PASSWORD:?}" "${POSTGRES_DB:?}"
port="${PGPORT:-5432}"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  pwfile="$(mktemp)"
  printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
  initdb -D "$PGDATA" -U "$POSTGRES_USER" --pwfile="$pwfile" --auth-local=trust --auth-host=scram-sha-256 > /dev/null
  rm -f "$pwfile"
  echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
  pg_ctl -D "$PGDATA" -o "-c listen_addresses='' -c unix_socket_directories=/tmp" -w start > /dev/null
  psql -h /tmp -U "$POSTGRES_USER" -d postgres -v ON_ERROR_STOP=1 -c "CREATE DATABASE \"$POSTGRES_DB\""
  pg_ctl -D "$PGDATA" -m fast -w stop > /dev/null
  echo "initialised $PGDATA: user $POSTGRES_USER, database $POSTGRES_DB"
fi
exec postgres -D "$PGDATA" -c listen_addresses="${POSTGRES_LISTEN:-*}" -c port="$port" -c unix_socket_directories=/tmp
