# A stand-in for the official postgres image where it cannot be pulled (docker/offline/): Debian's
# PostgreSQL from the offline base image, started by an entrypoint that honours the official image's
# contract (POSTGRES_USER, POSTGRES_PASSWORD, POSTGRES_DB, data in /var/lib/postgresql/data).
ARG BASE=farm-offline/bookworm:latest
FROM ${BASE}
COPY postgres-entrypoint.sh /usr/local/bin/postgres-entrypoint
ENTRYPOINT ["postgres-entrypoint"]
