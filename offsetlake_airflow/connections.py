"""Airflow connections -> offsetlake settings. Nothing here logs a secret.

Kafka credentials can live in an Airflow connection instead of the pipeline YAML: a connection
``kafka_<pipeline>`` (or ``kafka_default``) whose extra JSON holds librdkafka options such as
``{"security.protocol": "SASL_SSL", "sasl.username": "...", "sasl.password": "..."}`` and whose
host (``host:port``) overrides ``bootstrap_servers``. ``spark_default`` says where ingest jobs
and streams run.
"""

from __future__ import annotations

import json
import logging

from offsetlake.config import KAFKA_OVERRIDES_ENV, PipelineConfig, load_pipeline
from offsetlake_airflow import pipelines_folder

log = logging.getLogger("offsetlake.airflow")


def kafka_overrides(pipeline: str) -> tuple[str | None, dict[str, str]]:
    """(bootstrap servers, librdkafka options) from the pipeline's Kafka connection, if any."""
    from airflow.sdk import BaseHook

    for conn_id in (f"kafka_{pipeline}", "kafka_default"):
        try:
            conn = BaseHook.get_connection(conn_id)
        except Exception:  # noqa: BLE001 - not defined: the YAML alone configures Kafka
            continue
        extra = conn.extra_dejson or {}
        servers = f"{conn.host}:{conn.port}" if conn.host and conn.port else (conn.host or None)
        log.info("kafka settings of pipeline %s come from connection %s (options: %s)", pipeline, conn_id, sorted(extra))
        return servers, {str(k): str(v) for k, v in extra.items()}
    return None, {}


def kafka_overrides_env(pipeline: str) -> dict[str, str]:
    """The environment that hands a child process (spark-submit job, stream) the connection's
    Kafka settings: never its command line, which Airflow logs."""
    servers, options = kafka_overrides(pipeline)
    if not servers and not options:
        return {}
    return {KAFKA_OVERRIDES_ENV: json.dumps({"bootstrap_servers": servers, "options": options})}


def load_config(pipeline: str) -> PipelineConfig:
    """The pipeline's config with Kafka settings from an Airflow connection, if one exists."""
    config = load_pipeline(pipeline, pipelines_folder())
    return config.with_kafka_overrides(*kafka_overrides(config.name))


def spark_master() -> str | None:
    """The master of connection ``spark_default`` (what the ingest tasks submit to), if any."""
    from airflow.sdk import BaseHook

    try:
        conn = BaseHook.get_connection("spark_default")
    except Exception:  # noqa: BLE001 - no connection: the stream's own default (local[2])
        return None
    if not conn.host:
        return None
    return f"{conn.host}:{conn.port}" if conn.port else conn.host
