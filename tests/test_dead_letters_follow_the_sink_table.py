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

import json
import time

import pyarrow.parquet as pq
import pytest
from deltalake.transaction import AddAction
from kafka_truth import assert_exactly_once, dead_letter_coordinates, read_topic
from s3_tools import delete_tree

from offsetlake import dead_letters, failpoints, storage
from offsetlake.audit import audit_pipeline
from offsetlake.embedded.sample_data import ensure_topic, produce_orders
from offsetlake.entry import AppliedChange
from offsetlake.errors import SchemaChangeError, StalePlanError
from offsetlake.file_stats import delta_stats
from offsetlake.history import sink_commits
from offsetlake.ledger import Ledger
from offsetlake.plan import RunContext
from offsetlake.planner import plan_next_batch
from offsetlake.runs import execute_recorded_batch, run_pipeline
from offsetlake.sink import CommitActions, commit, create_table_once, txns_for

SCHEMA = {"order_id": "long", "customer": "string", "amount": "double", "currency": "string", "created_at": "timestamp"}
CUSTOMER_REQUIRED = {"type": "json", "schema": SCHEMA, "required": ["order_id", "customer"]}
AMOUNT_AS_DECIMAL = {"type": "json", "schema": {**SCHEMA, "amount": "decimal(10,2)"}, "required": ["order_id"]}
ORDER_ID_REQUIRED = {"type": "json", "schema": SCHEMA, "required": ["order_id"]}


def _old_table(pipeline, spark) -> None:
    """60 records in 3 batches on the first sink; every 5th has no customer: 12 dead letters."""
    config = pipeline.write(format=CUSTOMER_REQUIRED, max_records_per_batch=20)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 60, partition=0, null_customer_every=5)
    assert len(run_pipeline(config, RunContext("old-table"), lambda: spark)) == 3
    assert len(dead_letter_coordinates(config.layout.dead_letters)) == 12
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
    changed = pipeline.write(format=AMOUNT_AS_DECIMAL, max_records_per_batch=40)
    with pytest.raises(SchemaChangeError, match=r"Ways forward: a new sink table \(sink.table\)"):
        run_pipeline(changed, RunContext("type-change"), lambda: spark)

    new_table = storage.child(pipeline.lake_uri or str(pipeline.lake), "orders_v2")
    v2 = pipeline.write(format=AMOUNT_AS_DECIMAL, max_records_per_batch=40, sink={"table": new_table})
    assert len(run_pipeline(v2, RunContext("new-table"), lambda: spark)) == 3
    _exactly_once_in_the_new_table(pipeline, v2)
    assert run_pipeline(v2, RunContext("again"), lambda: spark) == []
    _exactly_once_in_the_new_table(pipeline, v2)


@pytest.mark.also_on_s3
def test_a_deleted_and_recreated_sink_table_starts_with_its_own_dead_letters(pipeline, spark):
    _old_table(pipeline, spark)
    config = pipeline.write(format=ORDER_ID_REQUIRED, max_records_per_batch=40)
    delete_tree(config.layout.sink)  # start over: the sink folder is deleted, the next run re-creates it
    assert len(run_pipeline(config, RunContext("recreated"), lambda: spark, max_batches=1)) == 1
    report = audit_pipeline(config)  # behind the old table's ends: the old table's batches do not count
    assert report.ok, report.text()
    assert report.committed == {(pipeline.topic, 0): 40}
    assert len(run_pipeline(config, RunContext("recreated-rest"), lambda: spark)) == 2
    _exactly_once_in_the_new_table(pipeline, config)


def _apply_as_the_old_code_did(config) -> None:
    """The dead-letter commit the code before sink table ids made for the sink's newest change: the
    staged files added, the entry without a table id, the unkeyed marker txn ``sink``."""
    sink = storage.table(config.layout.sink)
    change = sink_commits(sink, config.name)[-1]
    table = create_table_once(config.dead_letter_path, dead_letters.DEAD_LETTER_SCHEMA, [], "dead letters")
    files = []
    for staged in change.entry.staged:
        fs, path = storage.filesystem(config.layout.dead_letters.child(staged.path))
        with fs.open_input_file(path) as handle:
            stats = delta_stats(pq.read_metadata(handle))
        files.append(
            AddAction(
                path=staged.path,
                size=staged.size,
                partition_values={},
                modification_time=int(time.time() * 1000),
                data_change=True,
                stats=json.dumps(stats),
            )
        )
    commit(
        table,
        CommitActions(files=list(files), txns=txns_for([("sink", change.version)])),
        AppliedChange(pipeline=config.name, batch_id=change.batch_id, sink_version=change.version),  # no table id
        partition_by=None,
    )


def _crash(_name: str) -> None:
    raise failpoints.SimulatedCrash()


def _order_id_with_customer(value: bytes) -> int:
    order = json.loads(value)
    if order.get("customer") is None:
        raise ValueError("no customer: a dead letter where the schema requires one")
    return int(order["order_id"])


def test_dead_letters_written_before_table_ids_stay_with_their_own_sink_table(pipeline, spark):
    """A lake written by the old code: its unkeyed marker is adopted by the sink table it was
    written for (that change is not applied twice, and its dead letters come back when the
    pipeline returns to that table), never by a new one (whose first change would be skipped)."""
    old = pipeline.write(max_records_per_batch=100)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 100, partition=0, malformed_every=10, null_customer_every=5)
    with failpoints.on("after_commit", _crash), pytest.raises(failpoints.SimulatedCrash):
        run_pipeline(old, RunContext("old-code"), lambda: spark)
    _apply_as_the_old_code_did(old)
    applied_by_hand = storage.table(old.layout.dead_letters).version()
    assert len(dead_letter_coordinates(old.layout.dead_letters)) == 10

    # a new table whose first batch has other dead letters: 10 truncated + 20 without a customer
    new_table = storage.child(pipeline.lake_uri or str(pipeline.lake), "orders_v2")
    v2 = pipeline.write(format=CUSTOMER_REQUIRED, max_records_per_batch=100, sink={"table": new_table})
    run_pipeline(v2, RunContext("v2"), lambda: spark)
    assert_exactly_once(v2, read_topic(pipeline.bootstrap, pipeline.topic, order_id=_order_id_with_customer))
    assert len(dead_letter_coordinates(v2.layout.dead_letters)) == 30
    report = audit_pipeline(v2, against_kafka=True)
    assert report.ok, report.text()

    produce_orders(pipeline.bootstrap, pipeline.topic, 100, partition=0, first_id=100)
    back = pipeline.write(max_records_per_batch=100)  # back to the first table: its own dead letters return
    run_pipeline(back, RunContext("back"), lambda: spark)
    assert_exactly_once(back, read_topic(pipeline.bootstrap, pipeline.topic))
    report = audit_pipeline(back, against_kafka=True)
    assert report.ok, report.text()
    first_batch = sink_commits(storage.table(old.layout.sink), old.name)[0].batch_id
    applies = [
        i
        for i in storage.table(old.layout.dead_letters).history()
        if f'"batch_id":"{first_batch}"' in (i.get("userMetadata") or "") and int(i["version"]) != applied_by_hand
    ]
    assert applies == [], "the change the old code applied is adopted, never applied again"


@pytest.mark.also_on_s3
def test_a_plan_made_on_a_sink_table_that_was_then_replaced_is_never_applied_to_the_new_one(pipeline, spark):
    """An Airflow retry (or a stream's batch in flight) of a plan made before the sink table was
    deleted and re-created: its ranges start at the old table's committed ends, so applying it to
    the new table would leave that table without the offsets below them, for good."""
    config = pipeline.write(max_records_per_batch=50)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 150, partition=0)
    run_pipeline(config, RunContext("first-table"), lambda: spark, max_batches=1)
    plan = plan_next_batch(config, RunContext("planned-on-the-first-table"))
    assert plan is not None and [(r.start, r.end) for r in plan.ranges] == [(50, 100)]
    assert plan.sink_table_id == str(storage.table(config.layout.sink).metadata().id)
    Ledger.of(config).record_plan(plan)

    delete_tree(config.layout.sink)
    with pytest.raises(
        StalePlanError, match=f"batch {plan.batch_id} .* was planned on sink table {plan.sink_table_id}.* which now holds no table"
    ):
        execute_recorded_batch(config, plan.batch_id, lambda: spark)
    run_pipeline(config, RunContext("second-table"), lambda: spark, max_batches=1)  # a new table: [0, 50)
    with pytest.raises(StalePlanError, match="which now holds table"):
        execute_recorded_batch(config, plan.batch_id, lambda: spark)

    run_pipeline(config, RunContext("second-table-rest"), lambda: spark)
    assert_exactly_once(config, read_topic(pipeline.bootstrap, pipeline.topic))
    report = audit_pipeline(config, against_kafka=True)
    assert report.ok, report.text()
