"""Each pipeline's sink table as an Airflow Asset, and one asset event per committed batch.

The sink is ``Asset(name="<pipeline>_sink", uri=<the Delta table's URI>)``. The tasks that commit
(``publish`` of ``<pipeline>_ingest`` and ``<pipeline>_backfill``, ``rewind``, ``stream``) declare
the alias ``<pipeline>_sink_commits`` as their outlet and add one event to the sink per batch that
committed, with the batch's facts as its extra. A task that committed nothing (caught up, a dry
run, a rewind with nothing to undo, a failed batch) adds none, so no event is emitted: an alias
without events emits nothing, where a plain outlet would emit one on every success.

A downstream DAG schedules on the sink with ``schedule=[sink_asset("orders")]`` and reads the
batch from ``triggering_asset_events`` (docs/guides/airflow.md, "Downstream DAGs").
"""

from __future__ import annotations

import logging
from typing import Any

from airflow.sdk import Asset, AssetAlias

from offsetlake import storage
from offsetlake.batch_view import BatchView
from offsetlake.config import PipelineConfig, load_pipeline
from offsetlake.config.sink_kinds import sink_kind
from offsetlake_airflow import pipelines_folder

log = logging.getLogger("offsetlake.airflow")

RECENT_EVENTS = 200  # how far back a rerun looks for the event its batch already emitted


def sink_asset(pipeline: str | PipelineConfig) -> Asset:
    """The pipeline's sink table as an Asset (what a downstream DAG schedules on): reads the
    pipeline's YAML only (no connection, no Kafka, no Delta), so it is safe at DAG parse time."""
    config = load_pipeline(pipeline, pipelines_folder()) if isinstance(pipeline, str) else pipeline
    return Asset(name=f"{config.name}_sink", uri=sink_kind(config).output_uri(config))


def commits_alias(pipeline: str) -> AssetAlias:
    """The outlet of every task that commits to the pipeline's sink; events go to ``sink_asset``."""
    return AssetAlias(name=f"{pipeline}_sink_commits")


def batch_extra(config: PipelineConfig, batch: BatchView) -> dict[str, Any]:
    """An asset event's extra for a committed batch of the pipeline (``BatchView.asset_extra``)."""
    return batch.asset_extra(config.name, storage.table_uri(config.sink_path))


def _announced(config: PipelineConfig) -> set[str]:
    """Batch ids of the sink's recent asset events: a cleared, already successful task must not
    announce its batch twice (downstream DAGs run once per committed batch)."""
    from airflow.sdk.execution_time.context import InletEventsAccessor

    asset = sink_asset(config)
    try:
        events = InletEventsAccessor(asset_name=asset.name, asset_uri=asset.uri).ascending(False).limit(RECENT_EVENTS)
        return {str((event.extra or {}).get("batch_id")) for event in events}
    except Exception as err:
        log.info("pipeline %s: no earlier asset events of %s (%s)", config.name, asset.uri, err)
        return set()


def announce(context: dict[str, Any], config: PipelineConfig, extras: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add one asset event per committed batch to the sink, through the commits alias; returns
    the extras announced (batches an earlier try already announced are left out)."""
    if not extras:
        return []
    seen = _announced(config)
    fresh = [extra for extra in extras if extra["batch_id"] not in seen]
    for extra in extras:
        if extra["batch_id"] in seen:
            log.info("pipeline %s: batch %s was already announced on %s", config.name, extra["batch_id"], extra["table"])
    accessor = context["outlet_events"][commits_alias(config.name)]
    asset = sink_asset(config)
    for extra in fresh:
        accessor.add(asset, extra=extra)
        log.info(
            "pipeline %s: asset event on %s for batch %s (%s, %d rows)",
            config.name,
            asset.uri,
            extra["batch_id"],
            extra["kind"],
            extra["rows"],
        )
    return fresh


def committed_batches_of_run(config: PipelineConfig, run_id: str) -> list[BatchView]:
    """The batches a run committed (a stream task's micro-batches), oldest first."""
    from offsetlake.batch_view import batch_views
    from offsetlake.ledger_view import ledger_batch_rows
    from offsetlake.plan import BatchStatus
    from offsetlake.sink import open_table

    rows = [r for r in ledger_batch_rows(config, open_table(config.layout.sink)) if r["run_id"] == run_id]
    return [b for b in reversed(batch_views(rows)) if b.status == BatchStatus.COMMITTED]
