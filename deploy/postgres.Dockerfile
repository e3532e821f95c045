# PostgreSQL 15 from Debian's packages, for Airflow's metadata database in `make compose-test`
# (deploy/compose-test.yaml) where the official postgres image cannot be pulled. It honours the
# same variables as that image: POSTGRES_USER, POSTGRES_PASSWORD, POSTGRES_DB, and PGPORT.
ARG BASE=python:3.11.11-slim-bookworm
FROM ${BASE}

# No cluster from the package's postinst: the entrypoint makes one in the volume on first start.
RUN set -eux; \
    mkdir -p /etc/postgresql-common; \
    echo "create_main_cluster = false" > /etc/postgresql-common/createcluster.conf; \
    apt-get update; \
    apt-get install -y --no-install-recommends postgresql-15; \
    rm -rf /var/lib/apt/lists/*; \
    mkdir -p /var/lib/postgresql/data; \
    chown postgres:postgres /var/lib/postgresql/data; \
    chmod 700 /var/lib/postgresql/data

COPY deploy/postgres-entrypoint.sh /usr/local/bin/postgres-entrypoint.sh
ENV PATH=/usr/lib/postgresql/15/bin:$PATH \
    PGDATA=/var/lib/postgresql/data
USER postgres
ENTRYPOINT ["/usr/local/bin/postgres-entrypoint.sh"]
