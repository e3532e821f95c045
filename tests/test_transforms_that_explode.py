"""A transform may turn a record into several rows (explode) or none (filter); exactly once is per row.

Found by an adversarial run (issue 15, bug 7): an explode transform, which the README allows, made
``audit`` fail forever (a record's rows share its coordinates, so they counted as duplicates).
Rows of a pipeline with a transform carry ``_kafka_row``, their index among their record's rows,
and the audit checks (record, index) once. A record written twice still shows.
"""

from __future__ import annotations

import json
import time

import pyarrow as pa
from confluent_kafka import Producer
from deltalake.transaction import AddAction, CommitProperties

from offsetlake import storage
from offsetlake.audit import audit_pipeline
from offsetlake.backfill import plan_backfill
from offsetlake.embedded.sample_data import ensure_topic
from offsetlake.ledger import Ledger
from offsetlake.plan import RunContext
from offsetlake.runs import execute_recorded_batch, run_pipeline

TRANSFORM = '''
from pyspark.sql import functions as F


def explode_items(rows):
    """One row per item; orders without items give none (a filter, too)."""
    return rows.withColumn("item", F.explode("items")).drop("items")
'''


def _produce(bootstrap: str, topic: str, count: int) -> None:
    producer = Producer({"bootstrap.servers": bootstrap})
    for i in range(count):
        items = [f"item-{i}-{k}" for k in range(i % 4)]  # 0..3 items: 0 is filtered away
        producer.produce(topic, value=json.dumps({"order_id": i, "items": items}).encode(), partition=0)
    assert producer.flush(30) == 0


def _rows(config) -> list[tuple]:
    data = storage.table(config.layout.sink).to_pyarrow_dataset().to_table(columns=["_kafka_offset", "_kafka_row", "item"])
    return sorted(zip(*(data[c].to_pylist() for c in data.column_names), strict=True))


def test_explode_rows_are_exactly_once_per_row_through_backfill_and_the_audit_sees_a_double_write(pipeline, spark):
    (pipeline.folder / "explode_transform.py").write_text(TRANSFORM)
    config = pipeline.write(
        format={"type": "json", "schema": {"order_id": "long", "items": "array<string>"}, "required": ["order_id"]},
        transform="explode_transform:explode_items",
        max_records_per_batch=60,
    )
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    _produce(pipeline.bootstrap, pipeline.topic, 100)
    results = run_pipeline(config, RunContext("explode"), lambda: spark)
    expected = [(i, k, f"item-{i}-{k}") for i in range(100) for k in range(i % 4)]
    assert _rows(config) == expected
    assert sum(r.total("rows_written") for r in results) == len(expected) == 150
    report = audit_pipeline(config, against_kafka=True)
    assert report.ok, report.text()
    assert report.against_kafka["filtered"] == 25, "orders without items were filtered by the transform, not lost"

    plan = plan_backfill(config, RunContext("explode-backfill"), [0], 30, 70)
    Ledger.of(config).record_plan(plan)
    execute_recorded_batch(config, plan.batch_id, lambda: spark)
    assert _rows(config) == expected
    report = audit_pipeline(config, against_kafka=True)
    assert report.ok, report.text()

    # the same data file committed twice: every row of its records is there twice, which the
    # audit must see (per (record, _kafka_row)), explode or not
    table = storage.table(config.layout.sink)
    source = next(f for f in pa.table(table.get_add_actions(flatten=True)).to_pylist() if f["num_records"])
    copy = source["path"].replace(".parquet", "-copy.parquet")
    fs, root = storage.filesystem(config.layout.sink)
    fs.copy_file(f"{root}/{source['path']}", f"{root}/{copy}")
    table.create_write_transaction(
        [AddAction(copy, source["size_bytes"], {}, int(time.time() * 1000), True, "{}")],
        mode="append",
        schema=table.schema(),
        commit_properties=CommitProperties(custom_metadata={"userMetadata": "a bad copy"}),
    )
    report = audit_pipeline(config)
    assert not report.ok and "duplicate in sink" in report.text() and " row " in report.text(), report.text()


def test_a_transform_returning_pandas_is_told_what_to_return(pipeline, spark):
    import pytest

    from offsetlake.errors import TransformError

    (pipeline.folder / "pandas_transform.py").write_text("def to_pandas(rows):\n    return rows.toPandas()\n")
    config = pipeline.write(transform="pandas_transform:to_pandas")
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    _produce(pipeline.bootstrap, pipeline.topic, 3)
    with pytest.raises(TransformError, match="returned a pandas.DataFrame; a transform returns a Spark DataFrame"):
        run_pipeline(config, RunContext("pandas"), lambda: spark)
