# One image for the Spark master, the Spark worker and every Airflow service: drivers, executors
# and Airflow tasks then run the same Python, the same pinned packages and the same code, which
# Spark's Python workers need (PYSPARK_PYTHON must exist at the same path on every node).
# BASE: any Debian bookworm image with Python 3.11 and its venv module. The default is the official
# Python image; `make compose-test` passes a stand-in built from Debian's own packages
# (scripts/compose_test.py) where that image cannot be pulled.
ARG BASE=python:3.11.11-slim-bookworm
FROM ${BASE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

# pyspark ships Spark's jars but no JVM. procps gives `ps`, which Spark's launch scripts call.
# The man1 folder guards the JRE's postinst on slim images, which drop man pages. /opt/java is an
# architecture-neutral JAVA_HOME (the Debian path ends in -amd64 or -arm64).
RUN set -eux; \
    mkdir -p /usr/share/man/man1; \
    apt-get update; \
    apt-get install -y --no-install-recommends openjdk-17-jre-headless procps; \
    rm -rf /var/lib/apt/lists/*; \
    ln -s "$(dirname "$(dirname "$(readlink -f "$(command -v java)")")")" /opt/java; \
    /opt/java/bin/java -version

ENV JAVA_HOME=/opt/java \
    VIRTUAL_ENV=/opt/venv \
    SPARK_HOME=/opt/venv/lib/python3.11/site-packages/pyspark \
    PYSPARK_PYTHON=/opt/venv/bin/python \
    PYSPARK_DRIVER_PYTHON=/opt/venv/bin/python \
    AIRFLOW_HOME=/opt/airflow
ENV PATH=/opt/venv/bin:/opt/java/bin:$PATH

# The lock alone first, so that code changes do not reinstall the packages.
# The lock has no Postgres driver (the embedded default uses SQLite); Airflow's metadata DB in
# docker-compose needs a sync (psycopg2) and an async (asyncpg) one.
COPY requirements.lock /tmp/requirements.lock
RUN set -eux; \
    python -m venv /opt/venv; \
    pip install -r /tmp/requirements.lock; \
    pip install psycopg2-binary==2.9.10 asyncpg==0.30.0; \
    test -x "$SPARK_HOME/bin/spark-class"; \
    test -d "$SPARK_HOME/jars"

COPY . /opt/offsetlake
# .jars/ (Delta Lake for Spark, Spark's Kafka source, the Kafka broker) comes with the build
# context, resolved by `make setup` before the build; --offline only checks it against jars/jars.lock
RUN set -eux; \
    pip install --no-deps -e /opt/offsetlake; \
    python /opt/offsetlake/scripts/resolve_jars.py --offline; \
    chmod -R a+rX /opt/offsetlake/.jars

# A fixed non-root uid. /lake and the Airflow folders are created here, owned by that user, so a
# fresh named volume mounted on them starts with the same owner and every service can write.
RUN set -eux; \
    useradd --uid 50000 --gid 0 --create-home --shell /bin/bash offsetlake; \
    mkdir -p /lake /opt/airflow/logs /opt/spark-work; \
    chown -R 50000:0 /lake /opt/airflow /opt/spark-work

USER 50000
WORKDIR /opt/offsetlake
