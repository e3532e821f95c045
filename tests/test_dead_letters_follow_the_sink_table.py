"""Dead letters follow one sink table, by its identity: a new or re-created sink table starts clean.

Found by an adversarial run (issue 35, finding 8): a type change is refused with "Ways forward: a
new sink table (sink.table)"; a user who set ``sink.table: orders_v2`` got a new table that
re-ingested from the start while the dead-letter table still said "applied through sink version
N" of the old table: the new table's first N dead-letter changes were taken as applied and never
written (records in neither table, runs exit 0), and the old table's dead letters stayed beside
the new rows (records both a row and a dead letter). Deleting and re-creating the sink did the
same. The applied marker is now keyed by the sink's Delta table id.

Both scenarios: the old table holds 6 batches of 10 records, 12 of them dead letters (no
customer, which that schema requires); the new table takes all 120 records in 6 batches of 20,
with customer optional, so those 12 are rows now and 6 truncated records are its dead letters.
"""

from __future__ import annotations

import pytest
from kafka_truth import assert_exactly_once, dead_letter_coordinates, read_topic
from s3_tools import delete_tree

from offsetlake import storage
from offsetlake.audit import audit_pipeline
from offsetlake.embedded.sample_data import ensure_topic, produce_orders
from offsetlake.errors import SchemaChangeError
from offsetlake.plan import RunContext
from offsetlake.runs import run_pipeline

SCHEMA = {"order_id": "long", "customer": "string", "amount": "double", "currency": "string", "created_at": "timestamp"}
CUSTOMER_REQUIRED = {"type": "json", "schema": SCHEMA, "required": ["order_id", "customer"]}
AMOUNT_AS_DECIMAL = {"type": "json", "schema": {**SCHEMA, "amount": "decimal(10,2)"}, "required": ["order_id"]}
ORDER_ID_REQUIRED = {"type": "json", "schema": SCHEMA, "required": ["order_id"]}


def _old_table(pipeline, spark) -> None:
    """60 records in 6 batches on the first sink; every 5th has no customer: 12 dead letters."""
    config = pipeline.write(format=CUSTOMER_REQUIRED, max_records_per_batch=10)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 60, partition=0, null_customer_every=5)
    assert len(run_pipeline(config, RunContext("old-table"), lambda: spark)) == 6
    assert len(dead_letter_coordinates(config.dead_letter_path)) == 12
    # 60 more, every 10th truncated JSON (a dead letter under any schema)
    produce_orders(pipeline.bootstrap, pipeline.topic, 60, partition=0, first_id=60, malformed_every=10)


def _exactly_once_in_the_new_table(pipeline, config) -> None:
    truth = read_topic(pipeline.bootstrap, pipeline.topic)
    assert len(truth.bad) == 6
    assert_exactly_once(config, truth)  # every record in exactly one of the new sink / dead letters
    report = audit_pipeline(config, against_kafka=True)
    assert report.ok, report.text()
    assert report.against_kafka is not None and report.against_kafka["records"] == 120
    assert report.rows == 114 and report.dead_letters == 6


@pytest.mark.also_on_s3
def test_the_refusals_way_forward_a_new_sink_table_starts_with_its_own_dead_letters(pipeline, spark):
    _old_table(pipeline, spark)
    changed = pipeline.write(format=AMOUNT_AS_DECIMAL, max_records_per_batch=20)
    with pytest.raises(SchemaChangeError, match=r"Ways forward: a new sink table \(sink.table\)"):
        run_pipeline(changed, RunContext("type-change"), lambda: spark)

    new_table = storage.child(pipeline.lake_uri or str(pipeline.lake), "orders_v2")
    v2 = pipeline.write(format=AMOUNT_AS_DECIMAL, max_records_per_batch=20, sink={"table": new_table})
    assert len(run_pipeline(v2, RunContext("new-table"), lambda: spark)) == 6
    _exactly_once_in_the_new_table(pipeline, v2)
    assert run_pipeline(v2, RunContext("again"), lambda: spark) == []
    _exactly_once_in_the_new_table(pipeline, v2)


@pytest.mark.also_on_s3
def test_a_deleted_and_recreated_sink_table_starts_with_its_own_dead_letters(pipeline, spark):
    _old_table(pipeline, spark)
    config = pipeline.write(format=ORDER_ID_REQUIRED, max_records_per_batch=20)
    delete_tree(config.sink_path)  # start over: the sink folder is deleted, the next run re-creates it
    assert len(run_pipeline(config, RunContext("recreated"), lambda: spark)) == 6
    _exactly_once_in_the_new_table(pipeline, config)
