"""OpenLineage for the tasks that move data: the Kafka topics in, the Delta table out.

The Airflow OpenLineage provider calls an operator's ``get_openlineage_facets_on_start`` /
``_on_complete`` when the task starts and finishes and sends the result through its configured
transport (``[openlineage] transport``: HTTP to Marquez, a file, the console...). The ingest
task of ``<pipeline>_ingest`` and ``<pipeline>_backfill`` and the stream task answer here:

- inputs: each Kafka topic the batch read, namespace ``kafka://<bootstrap server>``, name the topic
  (OpenLineage's naming for Kafka);
- output: the sink table (namespace ``file`` and the path for a local lake, ``s3://<bucket>`` and
  the key for object storage) with its schema, the rows written (``outputStatistics``) and the
  ``offsetlake_batch`` facet: pipeline, batch id(s), kind, ranges, records, rows, dead letters and
  sink version — what the ledger recorded for the batch.

Everything comes from the ledger and the sink after the commit, so lineage says what was
committed, never what was planned.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import attr
import pyarrow as pa
from openlineage.client.generated.base import DatasetFacet
from openlineage.client.generated.output_statistics_output_dataset import OutputStatisticsOutputDatasetFacet
from openlineage.client.generated.schema_dataset import SchemaDatasetFacet, SchemaDatasetFacetFields

from offsetlake import storage
from offsetlake.batch_view import BatchView
from offsetlake.config import PipelineConfig

FACET = "offsetlake_batch"

log = logging.getLogger("offsetlake.airflow")


@attr.define
class OffsetlakeBatchDatasetFacet(DatasetFacet):
    """What offsetlake committed to the dataset: the batches with their Kafka ranges."""

    pipeline: str
    batches: list[str]
    kind: str
    ranges: list[dict[str, Any]]
    records: int
    rows: int
    deadLetters: int
    sinkVersion: int | None

    @staticmethod
    def _get_schema() -> str:
        return "urn:offsetlake:openlineage:OffsetlakeBatchDatasetFacet:1-0-0"


def kafka_namespace(config: PipelineConfig) -> str:
    return f"kafka://{config.kafka.bootstrap_servers.split(',')[0].strip()}"


def table_dataset_name(config: PipelineConfig) -> tuple[str, str]:
    """(namespace, name) of the sink by OpenLineage's naming: ``file`` + path, ``s3://bucket`` + key."""
    location = config.sink_path
    if storage.is_uri(location) and not location.startswith("file://"):
        parts = urlsplit(location)
        return f"{parts.scheme}://{parts.netloc}", parts.path.strip("/")
    return "file", storage.resolve_location(location, Path.cwd())


def _schema(config: PipelineConfig) -> SchemaDatasetFacet | None:
    table = storage.open_table(config.layout.sink)
    if table is None:
        return None
    schema = pa.schema(table.schema().to_arrow())
    return SchemaDatasetFacet(fields=[SchemaDatasetFacetFields(name=f.name, type=str(f.type)) for f in schema])


def lineage(config: PipelineConfig, batches: list[BatchView], with_schema: bool = True) -> Any:
    """OperatorLineage of committed batches (``offsetlake.batch_view.BatchView``);
    ``with_schema`` reads the sink's schema (delta-rs)."""
    from airflow.providers.common.compat.openlineage.facet import InputDataset, OutputDataset
    from airflow.providers.openlineage.extractors import OperatorLineage

    topics = sorted({r.range.topic for b in batches for r in b.ranges}) or _configured_topics(config)
    inputs = [InputDataset(namespace=kafka_namespace(config), name=topic) for topic in topics]
    namespace, name = table_dataset_name(config)
    facets: dict[str, Any] = {}
    schema = _schema(config) if with_schema else None
    if schema is not None:
        facets["schema"] = schema
    output_facets: dict[str, Any] = {}
    if batches:
        rows = sum(b.total("rows_written") or 0 for b in batches)
        facets[FACET] = OffsetlakeBatchDatasetFacet(
            pipeline=config.name,
            batches=[b.batch_id for b in batches],
            kind=str(batches[-1].kind),
            ranges=[
                {"topic": r.range.topic, "partition": r.range.partition, "start": r.range.start, "end": r.range.end, "batch": b.batch_id}
                for b in batches
                for r in b.ranges
            ],
            records=sum(b.total("records_read") or 0 for b in batches),
            rows=rows,
            deadLetters=sum(b.total("dead_letters") or 0 for b in batches),
            sinkVersion=max((b.sink_version for b in batches if b.sink_version is not None), default=None),
        )
        output_facets["outputStatistics"] = OutputStatisticsOutputDatasetFacet(rowCount=rows)
    outputs = [OutputDataset(namespace=namespace, name=name, facets=facets, outputFacets=output_facets)]
    return OperatorLineage(inputs=inputs, outputs=outputs)


def _configured_topics(config: PipelineConfig) -> list[str]:
    if config.topic is not None:
        return [config.topic]
    return list(config.topics or [])


def batch_lineage(config: PipelineConfig, batch_id: str | None) -> Any:
    """Lineage of the batch an ingest task executed, if it committed (else inputs/outputs only)."""
    from offsetlake.batch_view import batch_views
    from offsetlake.ledger_view import ledger_batch_rows
    from offsetlake.plan import BatchStatus
    from offsetlake.sink import open_table

    found = (
        [
            b
            for b in batch_views([r for r in ledger_batch_rows(config, open_table(config.layout.sink)) if r["batch_id"] == batch_id])
            if b.status == BatchStatus.COMMITTED
        ]
        if batch_id
        else []
    )
    return lineage(config, found)


def enabled() -> bool:
    """Whether the OpenLineage provider will ask for lineage (a transport is configured)."""
    from airflow.providers.openlineage.conf import is_disabled

    return not is_disabled()


def completed(what: str, compute: Callable[[], Any]) -> Any:
    """Lineage worked out by the task itself once it succeeded, or None (OpenLineage off, or it
    could not be read: lineage never fails a task).

    The provider calls ``get_openlineage_facets_on_complete`` in a child it forks from the task
    process, and delta-rs (a tokio runtime) panics in a fork of a process that already used it,
    as the stream task has (it reads the ledger to announce its batches). So the task reads the
    ledger and the sink schema before returning, and the forked child only hands the result on.
    """
    if not enabled():
        return None
    try:
        return compute()
    except Exception as err:
        log.warning("%s: lineage not available: %s", what, err)
        return None
