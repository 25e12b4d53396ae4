#!/usr/bin/env bash
# Initialise the cluster on first start (the official image's environment variables), then run
# PostgreSQL in the foreground on every interface of the container, passwords required over TCP.
set -euo pipefail
: "${POSTGRES_PASSWORD:?}"
user=${POSTGRES_USER:-postgres} db=${POSTGRES_DB:-${POSTGRES_USER:-postgres}}
export PGDATA=/var/lib/postgresql/data PATH=/usr/lib/postgresql/15/bin:$PATH
mkdir -p "$PGDATA" /run/postgresql
chown postgres:postgres "$PGDATA" /run/postgresql
chmod 700 "$PGDATA"
as_postgres() { runuser -u postgres -- "$@"; }
if [[ ! -s $PGDATA/PG_VERSION ]]; then
  pwfile=$(mktemp)
  printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
  chown postgres "$pwfile"
  as_postgres initdb -D "$PGDATA" -U "$user" --pwfile="$pwfile" --auth-local=trust --auth-host=scram-sha-256 >/dev/null
  rm -f "$pwfile"
  echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
  if [[ $db != postgres ]]; then  # initdb makes only `postgres` and the templates
    as_postgres pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start >/dev/null
    as_postgres createdb -U "$user" "$db"
    as_postgres pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
  fi
fi
exec runuser -u postgres -- postgres -D "$PGDATA" -c listen_addresses='*'
