"""Dead letters follow the sink: a batch's dead-letter change applies only after its sink commit,
a rewind restores them as of the target batch, and a crash in between is repaired by the next run.

Found by an adversarial run (issue 15, bugs 4 and 5): a rewind that undid a backfill restored the
sink but not the dead letters the backfill had replaced (500 records in neither table, audit OK),
and a backfill killed between its dead-letter write and its sink commit lost the same 500.
Every check here ends with ``audit --against-kafka``, which reads the records back from Kafka.
"""

from __future__ import annotations

import pytest
from kafka_truth import dead_letter_coordinates, ledger_rows

from offsetlake import failpoints, storage
from offsetlake.audit import audit_pipeline
from offsetlake.backfill import plan_backfill
from offsetlake.embedded.sample_data import ensure_topic, produce_orders
from offsetlake.ledger import Ledger, reconcile_ledger
from offsetlake.plan import RunContext
from offsetlake.rewind import rewind_pipeline
from offsetlake.runs import execute_recorded_batch, run_pipeline

# Orders have no `vendor`: requiring it makes every record a dead letter ("schema mismatch").
STRICT = {"type": "json", "schema": {"order_id": "long", "vendor": "string"}, "required": ["vendor"]}


def _crash(_name: str) -> None:
    raise failpoints.SimulatedCrash()


def _rows(config) -> int:
    return storage.table(config.layout.sink).to_pyarrow_dataset().count_rows()


def _audit_ok(config) -> None:
    report = audit_pipeline(config, against_kafka=True)
    assert report.ok, report.text()
    assert report.against_kafka["records"] == 1_000


def _backfill(config, spark, start: int, end: int, run_id: str):
    plan = plan_backfill(config, RunContext(run_id), [0], start, end)
    Ledger.of(config).record_plan(plan)
    return plan, lambda: execute_recorded_batch(config, plan.batch_id, lambda: spark)


def test_a_rewind_past_a_backfill_restores_the_dead_letters_it_replaced(pipeline, spark):
    strict = pipeline.write(format=STRICT)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 1_000, partition=0)
    [ingest] = run_pipeline(strict, RunContext("strict-ingest"), lambda: spark)
    assert len(dead_letter_coordinates(strict.layout.dead_letters)) == 1_000

    fixed = pipeline.write()  # the schema fixed: a backfill makes 500 of them rows
    _, run = _backfill(fixed, spark, 0, 500, "fixed-backfill")
    run()
    assert _rows(fixed) == 500 and len(dead_letter_coordinates(fixed.layout.dead_letters)) == 500
    _audit_ok(fixed)

    rewind_pipeline(fixed, ingest.plan.batch_id, reason="undo the backfill")
    assert _rows(fixed) == 0
    assert sorted(dead_letter_coordinates(fixed.layout.dead_letters)) == [(0, o) for o in range(1_000)], (
        "the dead letters the backfill replaced must come back with the rewind"
    )
    _audit_ok(fixed)


def test_a_rewind_past_a_backfill_removes_the_dead_letters_it_wrote(pipeline, spark):
    config = pipeline.write()
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 1_000, partition=0)
    [ingest] = run_pipeline(config, RunContext("ingest"), lambda: spark)
    strict = pipeline.write(format=STRICT)  # a stricter schema: the backfill turns 500 rows into dead letters
    _, run = _backfill(strict, spark, 0, 500, "strict-backfill")
    run()
    assert _rows(strict) == 500 and len(dead_letter_coordinates(strict.layout.dead_letters)) == 500

    rewind_pipeline(strict, ingest.plan.batch_id)
    assert _rows(strict) == 1_000 and dead_letter_coordinates(strict.layout.dead_letters) == []
    _audit_ok(strict)


def test_a_backfill_killed_before_its_sink_commit_changes_no_dead_letter(pipeline, spark):
    strict = pipeline.write(format=STRICT)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 1_000, partition=0)
    run_pipeline(strict, RunContext("strict-ingest"), lambda: spark)
    fixed = pipeline.write()
    plan, run = _backfill(fixed, spark, 0, 500, "killed-backfill")
    with failpoints.on("after_files_written", _crash), pytest.raises(failpoints.SimulatedCrash):
        run()  # its dead letters (none: all 500 are rows now) are staged, its sink commit never happens
    assert _rows(fixed) == 0 and len(dead_letter_coordinates(fixed.layout.dead_letters)) == 1_000
    _audit_ok(fixed)

    # the killed backfill does not stay `planned` forever: reconcile gives it an outcome
    reconcile_ledger(fixed, abandon_after_s=0)
    statuses = {r["status"] for r in ledger_rows(fixed) if r["batch_id"] == plan.batch_id}
    assert statuses == {"planned", "failed"}, statuses

    run()  # the same backfill again (an Airflow clear) completes
    assert _rows(fixed) == 500 and len(dead_letter_coordinates(fixed.layout.dead_letters)) == 500
    _audit_ok(fixed)


def test_a_crash_between_the_sink_commit_and_its_dead_letters_is_repaired_by_the_next_run(pipeline, spark):
    config = pipeline.write()
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 1_000, partition=0, malformed_every=10)
    with failpoints.on("after_commit", _crash), pytest.raises(failpoints.SimulatedCrash):
        run_pipeline(config, RunContext("killed-after-commit"), lambda: spark)
    assert _rows(config) == 900
    assert dead_letter_coordinates(config.layout.dead_letters) == [], "the dead letters wait for their commit's repair"
    _audit_ok(config)  # the audit counts the pending change as the next run will apply it

    assert run_pipeline(config, RunContext("after"), lambda: spark) == []  # nothing new, but it repairs
    assert sorted(dead_letter_coordinates(config.layout.dead_letters)) == [(0, o) for o in range(9, 1_000, 10)]
    _audit_ok(config)


def test_a_rewind_killed_after_its_sink_commit_restores_dead_letters_on_the_next_run(pipeline, spark):
    config = pipeline.write(max_records_per_batch=500)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 1_000, partition=0, malformed_every=10)
    first, _second = run_pipeline(config, RunContext("two-batches"), lambda: spark)
    with failpoints.on("after_commit", _crash), pytest.raises(failpoints.SimulatedCrash):
        rewind_pipeline(config, first.plan.batch_id)
    assert _rows(config) == 450 and len(dead_letter_coordinates(config.layout.dead_letters)) == 100
    report = audit_pipeline(config)
    assert report.ok, report.text()  # no "dead letters outside every committed range": the restore is pending

    run_pipeline(config, RunContext("after-rewind"), lambda: spark)
    assert _rows(config) == 900 and len(dead_letter_coordinates(config.layout.dead_letters)) == 100
    _audit_ok(config)


def test_audit_against_kafka_finds_records_in_neither_table(pipeline, spark):
    """The state bug 4 left, made directly: dead letters gone, no rows for them. Reading only
    Delta sees it since the audit compares each range's dead letters with its entry (issue 35,
    finding 11: it used to be invisible there); reading the records back from Kafka names them."""
    strict = pipeline.write(format=STRICT)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 1_000, partition=0)
    run_pipeline(strict, RunContext("strict-ingest"), lambda: spark)
    storage.table(strict.layout.dead_letters).delete("_kafka_offset < 500")

    plain = audit_pipeline(strict)
    assert not plain.ok and any(
        "the ledger says 1000 dead letters were written, the dead-letter table holds 500" in p for p in plain.problems
    ), plain.text()
    report = audit_pipeline(strict, against_kafka=True)
    assert not report.ok
    assert f"500 committed records of {pipeline.topic}[0] that Kafka holds are in neither" in report.text()
    cli = pipeline.cli("audit", "--against-kafka")
    assert cli.returncode == 1 and "in neither the sink nor the dead letters" in cli.stdout, cli.stdout + cli.stderr
