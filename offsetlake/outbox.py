"""Lake -> Kafka: ``offsetlake publish`` sends a Delta sink's committed batches to a topic, exactly
once and in ledger order (sink version order).

Each sink commit becomes one Kafka transaction (``offsetlake.kafka_commit``) holding its records
and the outbox's progress: a record keyed ``<pipeline>><topic>`` in the compacted topic
``offsetlake-outbox-progress`` whose value names the sink table and the last published version.
Progress and output commit together, so a publisher killed anywhere published a commit wholly or
not at all, and the next one (which fences it first) starts after the last whole one.

What a commit publishes, each record with ``offsetlake.batch``, ``offsetlake.kind`` and
``offsetlake.sink_version`` headers and, for rows, the source record's coordinates:

* ingest, stream and backfill commits: the rows of the commit's ranges in the table at that
  version (a backfill's are the replacement rows, marked ``backfill``: consumers that keep one
  row per source record replace by the coordinates);
* a rewind: one record per batch it undid, value ``{"rewound_batch": ...}``, marked ``rewind``;
* gaps and epoch commits: nothing but the progress.

Only append sinks: a keyed sink's deletes and a merge engine's folded state leave no row per
source record to publish.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from offsetlake import storage
from offsetlake.config import PipelineConfig
from offsetlake.coordinates import OFFSET, PARTITION, TOPIC, Selection
from offsetlake.errors import ConfigError
from offsetlake.history import SinkCommit, sink_commits
from offsetlake.kafka import group_id
from offsetlake.kafka_commit import OutputRecord, TransactionalWriter, ensure_topics, read_one_partition, row_record
from offsetlake.plan import BatchKind
from offsetlake.sink import table_id

log = logging.getLogger("offsetlake.outbox")

PROGRESS_TOPIC = "offsetlake-outbox-progress"
ROW_KINDS = (BatchKind.INGEST, BatchKind.STREAM, BatchKind.BACKFILL)


@dataclass(frozen=True)
class Progress:
    """Where an outbox stands: the sink table it publishes and the last sink version it published."""

    sink_table_id: str | None = None
    version: int = -1
    batch_id: str | None = None


@dataclass(frozen=True)
class Published:
    """One sink commit published: its batch, kind, version and how many records it sent."""

    batch_id: str
    kind: str
    sink_version: int
    records: int

    def as_dict(self) -> dict[str, Any]:
        return {"batch_id": self.batch_id, "kind": self.kind, "sink_version": self.sink_version, "records": self.records}


def progress_key(config: PipelineConfig, topic: str) -> bytes:
    return f"{config.name}>{topic}".encode()


def publish(config: PipelineConfig, to_topic: str, key_columns: Sequence[str] = (), max_batches: int | None = None) -> list[Published]:
    """Publish every sink commit after the outbox's progress to ``to_topic`` (at most
    ``max_batches`` of them), one transaction each; returns what was published, in order."""
    refuse_unpublishable(config)
    client = config.kafka_client_config()
    ensure_topics(client, config.name, [to_topic], {PROGRESS_TOPIC: {"cleanup.policy": "compact"}})
    table = storage.open_table(config.layout.sink)
    with TransactionalWriter(client, config.name, slot=f"outbox-{to_topic}") as writer:
        progress = read_progress(config, to_topic)  # after the writer fenced any earlier publisher
        if table is None:
            return []
        columns = table.schema().to_arrow().names
        missing = [c for c in key_columns if c not in columns]
        if missing:
            raise ConfigError(f"--key names {missing}, not columns of the sink (it has {columns})", pipeline=config.name, field="--key")
        identity = table_id(table)
        if progress.sink_table_id not in (None, identity):
            raise ConfigError(
                f"topic '{to_topic}' was published from another sink table ({progress.sink_table_id}, up to its version "
                f"{progress.version}); the sink is now table {identity}. Publish it to a new topic",
                pipeline=config.name,
            )
        pending = [c for c in sorted(sink_commits(table, config.name), key=lambda c: c.version) if c.version > progress.version]
        published = []
        for commit in pending[:max_batches]:
            published.append(_publish_commit(config, writer, to_topic, commit, identity, key_columns))
        return published


def refuse_unpublishable(config: PipelineConfig) -> None:
    if config.sink.mode != "append":
        raise ConfigError(
            f"publish takes an append sink; this one is sink.mode {config.sink.mode}, whose deletes and merged rows leave "
            "no row per source record to publish",
            pipeline=config.name,
            field="sink.mode",
        )


def _publish_commit(
    config: PipelineConfig, writer: TransactionalWriter, to_topic: str, commit: SinkCommit, identity: str | None, key_columns: Sequence[str]
) -> Published:
    started = time.monotonic()
    kind, version = str(commit.kind), commit.version
    marks = (("offsetlake.sink_version", str(version).encode()),)
    records = [
        OutputRecord(r.key, r.value, r.topic, r.partition, r.offset, marks + r.headers) for r in commit_records(config, commit, key_columns)
    ]
    progress = json.dumps({"sink_table_id": identity, "version": version, "batch_id": commit.batch_id}).encode()
    done = writer.commit(commit.batch_id, kind, to_topic, records, {}, also=[(PROGRESS_TOPIC, progress_key(config, to_topic), progress)])
    log.info(
        "publish pipeline=%s batch=%s kind=%s sink_version=%d topic=%s records=%d ms=%d",
        config.name,
        commit.batch_id,
        kind,
        version,
        to_topic,
        done.records,
        int((time.monotonic() - started) * 1000),
    )
    return Published(commit.batch_id, kind, version, done.records)


def commit_records(config: PipelineConfig, commit: SinkCommit, key_columns: Sequence[str]) -> Iterator[OutputRecord]:
    """The records one sink commit publishes (module docstring), in source order."""
    if commit.kind == BatchKind.REWIND:
        for undone in getattr(commit.entry, "rewound", ()):
            yield OutputRecord(undone.encode(), json.dumps({"rewound_batch": undone}).encode(), None)
        return
    if commit.kind not in ROW_KINDS:
        return
    selection = Selection(commit.entry.offset_ranges, commit.entry.record_time, dict(commit.entry.topic_epochs))
    where = selection.arrow()
    if where is None:
        return
    then = storage.table(config.layout.sink, version=commit.version)
    rows = then.to_pyarrow_dataset().to_table(filter=where).sort_by([(TOPIC, "ascending"), (PARTITION, "ascending"), (OFFSET, "ascending")])
    for row in rows.to_pylist():
        yield row_record(row, key_columns)


def read_progress(config: PipelineConfig, to_topic: str) -> Progress:
    """The outbox's last committed progress: the newest value of its key in the progress topic,
    read by a read_committed consumer up to the stable offset."""
    key = progress_key(config, to_topic)
    found = Progress()
    for _, record_key, value in read_one_partition(
        config.kafka_client_config(), PROGRESS_TOPIC, f"{group_id(config.name)}-outbox-reader", config.name
    ):
        if record_key == key and value:
            body = json.loads(value)
            found = Progress(body.get("sink_table_id"), int(body["version"]), body.get("batch_id"))
    return found
