"""What a person looking at a pipeline wants to see: lag, batches, validation, gaps.

Read-only views over state that already exists, for ``offsetlake status``, the Airflow
"Offset ledger" view, its JSON API and its Prometheus metrics (``offsetlake.metrics``): the
sink's txn versions (committed ends), the broker's log start and Last Stable Offsets, the
ledger table and the stream lease. Nothing here writes a table.

Invariant 4 holds in the view too: the sink commits are the source of truth, so a batch that
committed but whose ledger row was never written (a crash between the two) is shown from its
commit's ``userMetadata``, exactly as the next run's reconciliation will record it.

``pipeline_batches`` gives a pipeline's batches as typed views (``offsetlake.batch_view``); the
other functions return plain JSON-ready dicts (timestamps as ISO-8601 strings), where a batch is
``BatchView.to_json`` / ``BatchView.last_batch``, never a dict built here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from deltalake import DeltaTable

from offsetlake.batch_view import BatchView, batch_views, iso_time
from offsetlake.config import PipelineConfig
from offsetlake.config.sink_kinds import sink_kind
from offsetlake.errors import KafkaUnavailableError, OffsetlakeError
from offsetlake.history import SinkCommit
from offsetlake.kafka import current_offsets, topic_ids
from offsetlake.lease import current_lease
from offsetlake.ledger import Ledger
from offsetlake.sinks.choice import open_sink
from offsetlake.storage import open_table
from offsetlake.topic_epochs import check_topic_identity

log = logging.getLogger("offsetlake.ledger_view")

RECENT_BATCHES = 25


def partition_status(config: PipelineConfig, table: DeltaTable | None = None) -> list[dict]:
    """Per partition: committed end (sink txn version; a Kafka sink's commit log), log start, LSO
    and lag; a Kafka sink's rows also give its group's offset (``group_offset``, Kafka's copy,
    which can expire or be deleted: the next run restores it).

    Lag is ``last_stable - committed_end`` (from the log start when nothing was committed yet),
    never negative. ``lost`` flags a committed end below the log start: those offsets are gone
    from Kafka (invariant 7). ``removed_before_start`` counts the offsets below the log start of
    a partition the pipeline never committed: records removed before it read any (with ``start:
    earliest`` it begins at the log start; nothing offsetlake read was lost, but a lag of 0 alone
    would hide them). Raises KafkaUnavailableError when the broker cannot be asked, and
    TopicIdentityError when a committed end is past its log end or the topic's id changed.
    """
    offsets = current_offsets(config)
    keys = sorted(offsets)
    sink = open_sink(config, table)
    extra = sink.status_columns(keys)  # read before the ends: a Kafka sink's group offsets, never ahead of its log
    ends = sink.ends(keys)
    check_topic_identity(config, sink.commits(), ends, offsets, topic_ids(config, sorted({t for t, _ in offsets})))  # invariant 16
    rows = []
    for (topic, p), o in sorted(offsets.items()):
        committed = ends[(topic, p)]
        lag = o.last_stable - (committed if committed is not None else o.log_start)
        rows.append(
            {
                "topic": o.topic,
                "partition": p,
                "committed_end": committed,
                "log_start": o.log_start,
                "last_stable": o.last_stable,
                "lag": max(lag, 0),
                "lost": committed is not None and committed < o.log_start,
                "removed_before_start": o.log_start if committed is None else 0,
                **extra.get((topic, p), {}),
            }
        )
    return rows


def ledger_batch_rows(config: PipelineConfig, table: DeltaTable | None) -> list[dict]:
    """One row per (batch, topic, partition) with its most final outcome, the sink's commits
    included even where the ledger projection has not caught up with them yet."""
    return Ledger.of(config).batches_as_reconciled(_commits(config, table))


def sink_history(config: PipelineConfig, table: DeltaTable | None = None) -> list[SinkCommit]:
    """The sink's history: a Delta sink's commits, or a Kafka sink's commit log (raises
    KafkaUnavailableError when Kafka cannot be read)."""
    return open_sink(config, table).commits()


def _commits(config: PipelineConfig, table: DeltaTable | None) -> list[SinkCommit]:
    """``sink_history``, or none while Kafka cannot be read: the ledger alone is still worth showing."""
    try:
        return sink_history(config, table)
    except KafkaUnavailableError as err:
        log.warning("pipeline=%s the sink's history could not be read, showing the ledger alone: %s", config.name, err)
        return []


def pipeline_batches(config: PipelineConfig, table: DeltaTable | None) -> list[BatchView]:
    """Every batch of the pipeline, newest first, as the ledger and the sink's commits say."""
    return batch_views(ledger_batch_rows(config, table))


def _lag(config: PipelineConfig, table: DeltaTable | None) -> tuple[list[dict], int | None, str | None]:
    try:
        partitions = partition_status(config, table)
    except OffsetlakeError as err:  # the ledger is still worth showing when Kafka is down
        return [], None, str(err)
    return partitions, sum(p["lag"] for p in partitions), None


def _headline(config: PipelineConfig, batches: list[BatchView]) -> dict:
    committed = [b.recorded_at for b in batches if b.status.committed and b.recorded_at]
    return {
        "pipeline": config.name,
        "topic": config.topic_label,
        "last_commit_at": iso_time(max(committed)) if committed else None,
        "last_batch": batches[0].last_batch() if batches else None,
    }


def pipeline_overview(config: PipelineConfig) -> dict:
    """One line of the pipelines list: total lag, last commit time, last batch and its status."""
    table = open_table(config.layout.sink)
    batches = pipeline_batches(config, table)
    _, total_lag, kafka_error = _lag(config, table)
    return {**_headline(config, batches), "total_lag": total_lag, "kafka_error": kafka_error, "error": None}


def pipeline_detail(config: PipelineConfig, limit: int = RECENT_BATCHES) -> dict:
    """Everything the per-pipeline page shows: lag per partition, recent batches, recorded gaps."""
    table = open_table(config.layout.sink)
    batches = pipeline_batches(config, table)
    partitions, total_lag, kafka_error = _lag(config, table)
    return {
        **_headline(config, batches),
        "sink": sink_kind(config).output(config),
        "sink_type": config.sink.type,
        "sink_mode": config.sink.mode,
        "sink_version": table.version() if table is not None else None,
        "total_lag": total_lag,
        "kafka_error": kafka_error,
        "partitions": partitions,
        "batch_count": len(batches),
        "batches": [b.to_json() for b in (batches[:limit] if limit else batches)],
        "gaps": [gap for b in batches for gap in b.gaps()],
    }


def validation_report(config: PipelineConfig, batch_id: str) -> str | None:
    """URI of the batch's latest validation report (HTML), as its ledger row or commit records it."""
    rows = [r for r in ledger_batch_rows(config, open_table(config.layout.sink)) if r["batch_id"] == batch_id]
    return next((r["validation_report"] for r in rows if r.get("validation_report")), None)


def pipelines_overview(names: list[str], load: Callable[[str], PipelineConfig]) -> list[dict]:
    """``pipeline_overview`` of each named pipeline; one that cannot be loaded or read shows its error."""
    overview = []
    for name in names:
        try:
            overview.append(pipeline_overview(load(name)))
        except Exception as err:
            reason = str(err) if isinstance(err, OffsetlakeError) else f"{type(err).__name__}: {err}"
            overview.append(
                {
                    "pipeline": name,
                    "topic": None,
                    "last_commit_at": None,
                    "last_batch": None,
                    "total_lag": None,
                    "kafka_error": None,
                    "error": reason,
                }
            )
    return overview


def pipeline_metrics(config: PipelineConfig) -> dict:
    """What ``offsetlake.metrics`` exports for one pipeline: the per-partition figures of
    ``partition_status`` (as ``offsetlake status`` shows them), the last commit and last batch,
    batch counts per status and validation outcome (every batch in the ledger), and the stream
    lease (as ``offsetlake status`` reads it)."""
    table = open_table(config.layout.sink)
    batches = pipeline_batches(config, table)
    partitions, _, kafka_error = _lag(config, table)
    lease = current_lease(config)
    statuses: dict[str, int] = {}
    outcomes: dict[str, int] = {}
    for b in batches:
        statuses[str(b.status)] = statuses.get(str(b.status), 0) + 1
        if b.validation_outcome:
            outcomes[b.validation_outcome] = outcomes.get(b.validation_outcome, 0) + 1
    headline = _headline(config, batches)
    return {
        "pipeline": config.name,
        "partitions": partitions,
        "kafka_error": kafka_error,
        "last_commit_at": headline["last_commit_at"],
        "last_batch": headline["last_batch"],
        "batches_by_status": statuses,
        "batches_by_validation": outcomes,
        "stream_lease": None if lease is None else {"owner": lease.owner, "state": lease.state, "live": lease.live()},
    }
