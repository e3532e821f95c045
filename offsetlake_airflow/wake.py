"""``schedule: on_new_data``: wake ``<pipeline>_ingest`` when records arrive, never tell it what to read.

The ingest DAG is scheduled on an Asset for the pipeline's topics whose AssetWatcher runs the
Kafka provider's message-queue trigger (``KafkaMessageQueueTrigger``) in the triggerer, with the
pipeline's Kafka connection ``kafka_<pipeline>`` in the provider's format (extra JSON holding
``bootstrap.servers``, ``group.id`` — the watcher's own consumer group — and any security
options). The trigger consumes the topics and asks ``new_data`` about each record; an event
queues an ingest run. The run plans its ranges from the ledger as any run does (invariant 3), so
an event is only a wake-up: a stale or duplicate one costs at most a run that finds nothing new
and skips.

Bursts coalesce: the ingest DAG allows one active run and Airflow queues asset events that
arrive while it is queued or running into one next run, and ``new_data`` answers "nothing new"
for every record below the pipeline's committed end (read from the sink's txn versions), so the
tail of a burst the first run already committed wakes nothing. A record at or above the
committed end always wakes a run: none is skipped while it is still to be ingested.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from offsetlake.config import PipelineConfig

log = logging.getLogger("offsetlake.airflow")

ON_NEW_DATA = "on_new_data"
COMMITTED_ENDS_TTL_S = 1.0  # how long the triggerer reuses the committed ends it read

_snapshots: dict[str, tuple[float, PipelineConfig, Any]] = {}


def connection_id(pipeline: str) -> str:
    return f"kafka_{pipeline}"


def watched_topics(config: PipelineConfig) -> list[str]:
    """What the trigger's consumer subscribes to: the topics, or the pattern (librdkafka takes a
    subscription starting with ``^`` as a regular expression; offsetlake's patterns match in full)."""
    if config.topic is not None:
        return [config.topic]
    if config.topics is not None:
        return list(config.topics)
    assert config.topic_pattern is not None
    return [f"^({config.topic_pattern})$"]  # a plain group: librdkafka's regex engine is small


def new_data_asset(config: PipelineConfig) -> Any:
    """The Asset that stands for "new records in the pipeline's topics", watched by the trigger."""
    from airflow.providers.apache.kafka.triggers.msg_queue import KafkaMessageQueueTrigger
    from airflow.sdk import Asset, AssetWatcher

    trigger = KafkaMessageQueueTrigger(
        topics=watched_topics(config),
        kafka_config_id=connection_id(config.name),
        apply_function=f"{__name__}.new_data",
        apply_function_kwargs={"pipeline": config.name},
        poll_timeout=1,
        # the provider sleeps this long after each record that wakes nothing: a backlog of records
        # already committed must drain fast (an empty poll already waits poll_timeout)
        poll_interval=0,
    )
    first = watched_topics(config)[0].strip("^$()")
    servers = config.kafka.bootstrap_servers.split(",")[0].strip()
    return Asset(
        name=f"{config.name}_new_data",
        uri=f"kafka://{servers}/{first}",
        watchers=[AssetWatcher(name=f"{config.name}_new_data_watcher", trigger=trigger)],
    )


def _committed_end(pipeline: str, topic: str, partition: int) -> int:
    """The pipeline's committed end of one partition, from a sink snapshot at most
    ``COMMITTED_ENDS_TTL_S`` old (an older snapshot only wakes a run that finds nothing)."""
    from offsetlake.sink import committed_end, open_table
    from offsetlake_airflow.connections import load_config

    cached = _snapshots.get(pipeline)
    if cached is None or time.monotonic() - cached[0] >= COMMITTED_ENDS_TTL_S:
        config = load_config(pipeline)
        cached = (time.monotonic(), config, open_table(config.layout.sink))
        _snapshots[pipeline] = cached
    _, config, table = cached
    return committed_end(table, config, topic, partition) or 0


def new_data(message: Any, pipeline: str) -> dict | None:
    """The trigger's apply function (runs in the triggerer): an event payload if ``message`` is
    not yet committed to the pipeline's sink, None (no event) if it is."""
    key = (message.topic(), message.partition())
    try:
        end = _committed_end(pipeline, *key)
    except Exception as err:
        log.warning("pipeline %s: cannot read the committed ends (%s); waking the ingest run", pipeline, err)
        end = 0
    if message.offset() < end:
        return None
    log.info(
        "pipeline %s: new record %s[%d]@%d (committed end %d): waking %s_ingest", pipeline, key[0], key[1], message.offset(), end, pipeline
    )
    return {"pipeline": pipeline, "topic": key[0], "partition": key[1], "offset": message.offset()}
