#!/bin/sh
# The PostgreSQL server of docker/postgres/Dockerfile: creates the cluster, a role and a
# database on the first start (an empty PGDATA), then runs the server in the foreground. Extra
# arguments go to the server (`-c max_connections=300`).
set -eu

if [ -n "${POSTGRES_PASSWORD_FILE:-}" ]; then
  POSTGRES_PASSWORD=$(cat "$POSTGRES_PASSWORD_FILE")
fi

if [ ! -s "$PGDATA/PG_VERSION" ]; then
  if [ -z "${POSTGRES_PASSWORD:-}" ]; then
    echo "lipsync-postgres: set POSTGRES_PASSWORD (or POSTGRES_PASSWORD_FILE) for the first start" >&2
    exit 1
  fi
  echo "lipsync-postgres: creating the cluster in $PGDATA" >&2
  # The superuser `postgres` has no password: it is reachable only through the socket.
  initdb --pgdata="$PGDATA" --username=postgres --encoding=UTF8 --no-locale \
    --auth-local=trust --auth-host=scram-sha-256 >/dev/null
  {
    echo "listen_addresses = '*'"
    echo "password_encryption = 'scram-sha-256'"
  } >>"$PGDATA/postgresql.conf"
  echo "host all all all scram-sha-256" >>"$PGDATA/pg_hba.conf"

  # A server on the socket only, to create the role and the database.
  pg_ctl --pgdata="$PGDATA" --options="-c listen_addresses=''" --wait --silent start
  psql --quiet --no-psqlrc --username=postgres --dbname=postgres -v ON_ERROR_STOP=1 \
    --set=user="$POSTGRES_USER" --set=password="$POSTGRES_PASSWORD" --set=db="$POSTGRES_DB" <<'SQL'
CREATE ROLE :"user" LOGIN PASSWORD :'password';
CREATE DATABASE :"db" OWNER :"user";
SQL
  pg_ctl --pgdata="$PGDATA" --mode=fast --wait --silent stop
  echo "lipsync-postgres: role $POSTGRES_USER and database $POSTGRES_DB created" >&2
fi

exec postgres -D "$PGDATA" "$@"
