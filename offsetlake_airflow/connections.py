"""Airflow connections -> offsetlake settings. Nothing here logs a secret.

Kafka credentials can live in an Airflow connection instead of the pipeline YAML: a connection
``kafka_<pipeline>`` (or ``kafka_default``) whose extra JSON holds librdkafka options such as
``{"security.protocol": "SASL_SSL", "sasl.username": "...", "sasl.password": "..."}`` and whose
host (``host:port``) overrides ``bootstrap_servers``. The Kafka provider's own format works too
(servers in the extra's ``bootstrap.servers``); its consumer-group keys (``group.id``...) are
the ``schedule: on_new_data`` watcher's and never reach offsetlake's clients.

Object-storage settings likewise: a connection ``offsetlake_storage_<pipeline>`` (or
``offsetlake_storage_default``) whose extra JSON holds the ``storage:`` keys (``AWS_ENDPOINT_URL``,
``AWS_REGION``, ...), whose login and password are the access key id and secret, and whose host
(a URL) is the endpoint. A Schema Registry for
``format.type: avro``: a connection ``schema_registry_<pipeline>`` (or ``schema_registry_default``)
whose host (a URL) and port are the registry's address, login and password its basic-auth
user, and extra JSON any other client option (``ssl.ca.location``, ...). ``spark_default`` says
where ingest jobs and streams run; ``spark_connect_default`` (the Spark provider's Spark Connect
connection, e.g. to ``offsetlake spark-server``), when it exists, makes them attach to that warm
server instead of starting a JVM per task.
"""

from __future__ import annotations

import logging

from offsetlake.config import Overrides, PipelineConfig, resolve_pipeline
from offsetlake_airflow import pipelines_folder

log = logging.getLogger("offsetlake.airflow")

# Keys of a Kafka connection that configure the on_new_data watcher's consumer, never offsetlake's
# clients (its reader assigns exact ranges read_committed; publish commits to the pipeline's group).
WATCHER_ONLY_OPTIONS = frozenset(
    {
        "bootstrap.servers",
        "group.id",
        "group.instance.id",
        "enable.auto.commit",
        "auto.offset.reset",
        "isolation.level",
        "enable.partition.eof",
    }
)


def kafka_overrides(pipeline: str) -> tuple[str | None, dict[str, str]]:
    """(bootstrap servers, librdkafka options) from the pipeline's Kafka connection, if any."""
    from airflow.sdk import BaseHook

    for conn_id in (f"kafka_{pipeline}", "kafka_default"):
        try:
            conn = BaseHook.get_connection(conn_id)
        except Exception:
            continue
        extra = dict(conn.extra_dejson or {})
        servers = f"{conn.host}:{conn.port}" if conn.host and conn.port else (conn.host or None)
        # The Kafka provider's format (what `schedule: on_new_data`'s watcher reads) keeps the
        # servers in the extra, with the watcher's own consumer-group settings, which are not ours.
        servers = servers or (str(extra["bootstrap.servers"]) if extra.get("bootstrap.servers") else None)
        options = {str(k): str(v) for k, v in extra.items() if k not in WATCHER_ONLY_OPTIONS}
        log.info("kafka settings of pipeline %s come from connection %s (options: %s)", pipeline, conn_id, sorted(options))
        return servers, options
    return None, {}


def storage_overrides(pipeline: str) -> dict[str, str]:
    """Object-storage settings from the pipeline's storage connection, if any."""
    from airflow.sdk import BaseHook

    for conn_id in (f"offsetlake_storage_{pipeline}", "offsetlake_storage_default"):
        try:
            conn = BaseHook.get_connection(conn_id)
        except Exception:
            continue
        options = {str(k): str(v) for k, v in (conn.extra_dejson or {}).items()}
        if conn.login:
            options["AWS_ACCESS_KEY_ID"] = conn.login
        if conn.password:
            options["AWS_SECRET_ACCESS_KEY"] = conn.password
        if conn.host:
            host = conn.host if "://" in conn.host else f"https://{conn.host}"
            options["AWS_ENDPOINT_URL"] = f"{host}:{conn.port}" if conn.port else host
        log.info("storage settings of pipeline %s come from connection %s (keys: %s)", pipeline, conn_id, sorted(options))
        return options
    return {}


def registry_overrides(pipeline: str) -> dict[str, str]:
    """Schema Registry client options from the pipeline's registry connection, if any."""
    from airflow.sdk import BaseHook

    for conn_id in (f"schema_registry_{pipeline}", "schema_registry_default"):
        try:
            conn = BaseHook.get_connection(conn_id)
        except Exception:
            continue
        options = {str(k): str(v) for k, v in (conn.extra_dejson or {}).items()}
        if conn.host:
            host = conn.host if "://" in conn.host else f"http://{conn.host}"
            options["url"] = f"{host}:{conn.port}" if conn.port else host
        if conn.login:
            options["basic.auth.user.info"] = f"{conn.login}:{conn.password or ''}"
        log.info("schema registry settings of pipeline %s come from connection %s (keys: %s)", pipeline, conn_id, sorted(options))
        return options
    return {}


def connection_overrides(pipeline: str) -> Overrides:
    """The pipeline's Kafka, storage and Schema Registry settings from its Airflow connections
    (the ``OverridesSource`` of ``offsetlake.config.resolve_pipeline`` inside Airflow)."""
    servers, options = kafka_overrides(pipeline)
    return Overrides(
        bootstrap_servers=servers, kafka_options=options, storage=storage_overrides(pipeline), schema_registry=registry_overrides(pipeline)
    )


def overrides_env(pipeline: str) -> dict[str, str]:
    """The environment that hands a child process (spark-submit job, stream) the connections'
    settings: never its command line, which Airflow logs."""
    return connection_overrides(pipeline).as_environment()


def load_config(pipeline: str) -> PipelineConfig:
    """The pipeline's config with Kafka, storage and Schema Registry settings from Airflow
    connections, if they exist."""
    return resolve_pipeline(pipeline, pipelines_folder(), overrides=connection_overrides)


def spark_master() -> str | None:
    """The master of connection ``spark_default`` (what the ingest tasks submit to), if any."""
    from airflow.sdk import BaseHook

    try:
        conn = BaseHook.get_connection("spark_default")
    except Exception:
        return None
    if not conn.host:
        return None
    return f"{conn.host}:{conn.port}" if conn.port else conn.host


def spark_connect_url() -> str | None:
    """The URL of connection ``spark_connect_default`` (a warm Spark Connect server the ingest
    task and the stream attach to), if it exists."""
    from airflow.providers.apache.spark.hooks.spark_connect import SparkConnectHook
    from airflow.sdk import BaseHook

    try:
        BaseHook.get_connection(SparkConnectHook.default_conn_name)
    except Exception:
        return None
    return SparkConnectHook(SparkConnectHook.default_conn_name).get_connection_url()
