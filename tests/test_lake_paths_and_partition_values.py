"""Any folder a user can name holds a lake, and any partition value survives backfill and rewind.

Found by an adversarial run (issue 15, bugs 1-3): a lake path with ``#`` or ``?`` was cut by a
URI parser, so a batch committed its offsets with none of its files (records lost); a space or a
non-ASCII character failed every run; and a partition value that needs escaping was encoded twice
in remove actions, so backfill and rewind left the old rows next to the new ones.
"""

from __future__ import annotations

import json

import pytest
from confluent_kafka import Producer
from kafka_truth import assert_exactly_once, read_topic

from offsetlake import storage
from offsetlake.audit import audit_pipeline
from offsetlake.backfill import plan_backfill
from offsetlake.embedded.sample_data import ensure_topic, produce_orders
from offsetlake.errors import ConfigError
from offsetlake.ledger import Ledger
from offsetlake.plan import RunContext
from offsetlake.rewind import rewind_pipeline
from offsetlake.runs import execute_recorded_batch, run_pipeline

AWKWARD_CUSTOMERS = ["New York", "São Paulo", "a/b", "x%20y", "q?r#s", "k:v=1", "tab\there", "ünï ©ødé", "plain"]


def _audit(config) -> None:
    report = audit_pipeline(config, against_kafka=True)
    assert report.ok, report.text()


@pytest.mark.parametrize("folder", ["lake#1", "lake?x=1", "my lake/é", "josé's ~lake (1)"])
def test_a_lake_in_a_folder_with_reserved_or_non_ascii_characters_lands_every_record(pipeline, spark, folder):
    config = pipeline.write(lake=str(pipeline.lake.parent / folder), sink={"partition_by": ["currency"]})
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    produce_orders(pipeline.bootstrap, pipeline.topic, 600, malformed_every=50)
    results = run_pipeline(config, RunContext("awkward-folder"), lambda: spark)
    assert results and sum(r.total("rows_written") for r in results) == 588
    assert config.sink_path.startswith(str(pipeline.lake.parent / folder))
    assert_exactly_once(config, read_topic(pipeline.bootstrap, pipeline.topic))
    _audit(config)


@pytest.mark.parametrize("folder", ["lake%20x", "tab\tlake", "lake[1]"])
def test_a_lake_folder_delta_rs_cannot_address_is_refused_when_the_pipeline_loads(pipeline, folder):
    with pytest.raises(ConfigError, match="lake: .* contains .*(cannot open a table under|refuses in paths)"):
        pipeline.write(lake=str(pipeline.lake.parent / folder))


def _produce_customers(bootstrap: str, topic: str, count: int) -> None:
    producer = Producer({"bootstrap.servers": bootstrap})
    for i in range(count):
        value = {
            "order_id": i,
            "customer": AWKWARD_CUSTOMERS[i % len(AWKWARD_CUSTOMERS)],
            "amount": 1.0,
            "currency": "EUR",
            "created_at": "2026-11-01T00:00:00Z",
        }
        producer.produce(topic, value=json.dumps(value).encode(), partition=0)
    assert producer.flush(30) == 0


def _rows(config) -> list[tuple]:
    data = storage.table(config.layout.sink).to_pyarrow_dataset().to_table(columns=["_kafka_offset", "customer"])
    return sorted(zip(data["_kafka_offset"].to_pylist(), data["customer"].to_pylist(), strict=True))


@pytest.mark.also_on_s3  # folder names with Spark's %XX escapes are object keys as written
def test_backfill_and_rewind_replace_rows_whatever_their_partition_values(pipeline, spark):
    config = pipeline.write(sink={"partition_by": ["customer"]}, max_records_per_batch=45)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    _produce_customers(pipeline.bootstrap, pipeline.topic, 90)
    first, second = run_pipeline(config, RunContext("two-batches"), lambda: spark)
    expected = [(i, AWKWARD_CUSTOMERS[i % len(AWKWARD_CUSTOMERS)]) for i in range(90)]
    assert _rows(config) == expected

    plan = plan_backfill(config, RunContext("awkward-backfill"), [0], 0, 60)
    Ledger.of(config).record_plan(plan)
    execute_recorded_batch(config, plan.batch_id, lambda: spark)
    assert _rows(config) == expected, "a backfill must replace, never add next to, rows of awkward partitions"
    _audit(config)

    rewind_pipeline(config, first.plan.batch_id)
    assert _rows(config) == expected[:45], "a rewind must remove every later row, whatever its partition value"
    _audit(config)
    run_pipeline(config, RunContext("after-rewind"), lambda: spark)
    assert _rows(config) == expected
    _audit(config)
