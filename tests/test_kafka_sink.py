"""A pipeline whose sink is a Kafka topic (``sink: {type: kafka}``) on the real broker: every valid
source record's row appears exactly once for read_committed consumers, and every malformed one
once in the dead-letter topic, through runs crashed at every step, a rerun of a committed batch, two
runners at once, a republishing backfill and a refused rewind. The checker reads the topics with a
plain read_committed consumer (``kafka_truth``) and compares them with the source topic."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from confluent_kafka import Producer
from kafka_truth import by_source, check_kafka_sink, source_orders

from offsetlake import failpoints
from offsetlake.audit import audit_pipeline
from offsetlake.backfill import plan_backfill
from offsetlake.embedded.sample_data import ensure_topic, produce_orders
from offsetlake.errors import BackfillParamsError, KafkaSinkFencedError, RewindError
from offsetlake.kafka_commit import kafka_sink_commits
from offsetlake.ledger import Ledger
from offsetlake.ledger_view import partition_status, pipeline_detail
from offsetlake.plan import BatchStatus, RunContext
from offsetlake.rewind import rewind_pipeline
from offsetlake.runs import execute_recorded_batch, plan_or_reuse, run_pipeline

CRASH_STEPS = ("after_plan", "after_read", "after_produce", "after_flush", "after_kafka_commit", "after_ledger")


def _kafka_sink(pipeline, **sink):
    out = f"{pipeline.topic}-out"
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    ensure_topic(pipeline.bootstrap, out, 3)
    config = pipeline.write(max_records_per_batch=300, sink={"type": "kafka", "topic": out, "key": ["customer"], **sink})
    return config, out


def test_a_kafka_sink_commits_each_record_once_and_a_rerun_produces_nothing(pipeline, spark):
    config, out = _kafka_sink(pipeline)
    # two batches of 300 (150 a partition): each its own transaction, the second planned from the
    # first's committed ends; more batches prove nothing new and cost 5-10 s of Spark each
    produce_orders(pipeline.bootstrap, pipeline.topic, 500, malformed_every=41)
    batches = run_pipeline(config, RunContext("first"), lambda: spark)
    assert len(batches) == 2 and all(b.status == BatchStatus.COMMITTED for b in batches)
    check_kafka_sink(pipeline.bootstrap, pipeline.topic, config)

    staged = Path(config.layout.dead_letters.path) / "staged"
    assert not list(staged.glob("*.parquet")), "a batch's staged dead letters went out in its transaction and are removed"

    # the ledger follows the commit log: every batch committed, its version the entry's offset there
    commits = {c.batch_id: c.version for c in kafka_sink_commits(config)}
    ledger = {r["batch_id"]: r["sink_version"] for r in Ledger.of(config).batches() if r["status"] == "committed"}
    assert ledger == commits == {b.plan.batch_id: b.sink_version for b in batches}

    # status, the Offset ledger view and metrics read the group's offsets and the commit log
    assert [p["lag"] for p in partition_status(config)] == [0, 0]
    detail = pipeline_detail(config)
    assert detail["sink_type"] == "kafka" and detail["batch_count"] == 2 and detail["total_lag"] == 0
    audit = audit_pipeline(config)
    assert audit.ok and audit.rows == 500 - audit.dead_letters and audit.dead_letters > 0, audit.text()

    # an Airflow clear re-executes a committed batch's recorded plan: nothing is produced
    again = execute_recorded_batch(config, batches[0].plan.batch_id, lambda: spark)
    assert again.status == BatchStatus.ALREADY_COMMITTED
    assert run_pipeline(config, RunContext("second"), lambda: spark) == []
    check_kafka_sink(pipeline.bootstrap, pipeline.topic, config)

    # a backfill must say it republishes; it marks its records and leaves the ends where they are
    with pytest.raises(BackfillParamsError, match="--republish"):
        plan_backfill(config, RunContext("bf"), from_offset=0, to_offset=100)
    run = RunContext("bf")
    plan, _ = plan_or_reuse(
        Ledger.of(config), run, "backfill", lambda: plan_backfill(config, run, [0], from_offset=10, to_offset=60, republish=True)
    )
    assert execute_recorded_batch(config, plan.batch_id, lambda: spark).status == BatchStatus.COMMITTED
    assert execute_recorded_batch(config, plan.batch_id, lambda: spark).status == BatchStatus.ALREADY_COMMITTED
    republished = by_source(pipeline.bootstrap, out, kinds=("backfill",))
    source = source_orders(pipeline.bootstrap, pipeline.topic)
    assert set(republished) == {(0, o) for o in range(10, 60) if source[(0, o)] is not None} and max(republished.values()) == 1
    check_kafka_sink(pipeline.bootstrap, pipeline.topic, config)  # the ingest records and the ends are unchanged

    assert audit_pipeline(config).ok
    with pytest.raises(RewindError, match="cannot take records back"):
        rewind_pipeline(config, batches[0].plan.batch_id)

    # the audit finds a record no committed transaction wrote (e.g. a stray producer)
    stray = Producer({"bootstrap.servers": pipeline.bootstrap})
    stray.produce(out, b"{}", headers=[("offsetlake.batch", b"nobody"), ("offsetlake.kind", b"backfill")])
    stray.flush(30)
    found = audit_pipeline(config)
    assert not found.ok and "a record of batch nobody, which the commit log does not hold" in found.text(), found.text()


def test_a_run_crashed_at_every_step_leaves_each_record_once(pipeline, spark, monkeypatch):
    """A crash (the process dies: no outcome recorded, an open transaction left to the broker) at
    each step of the batch, then a run that recovers: nothing twice, nothing lost."""
    config, out = _kafka_sink(pipeline)
    next_id = 0

    def crash(_name: str) -> None:
        raise failpoints.SimulatedCrash()

    for step in CRASH_STEPS:
        next_id = produce_orders(pipeline.bootstrap, pipeline.topic, 150, first_id=next_id, malformed_every=37)
        with failpoints.on(step, crash), pytest.raises(failpoints.SimulatedCrash):
            run_pipeline(config, RunContext(f"crash-{step}"), lambda: spark)
    # and a crash during the reconcile that records the batch killed after its Kafka commit: before
    # its ledger rows are written, then after
    from offsetlake import kafka_sink

    reconcile = kafka_sink.reconcile

    def crash_before(config_, ledger):
        raise failpoints.SimulatedCrash()

    def crash_after(config_, ledger):
        reconcile(config_, ledger)
        raise failpoints.SimulatedCrash()

    for crashing in (crash_before, crash_after):
        monkeypatch.setattr(kafka_sink, "reconcile", crashing)
        with pytest.raises(failpoints.SimulatedCrash):
            run_pipeline(config, RunContext(f"crash-in-{crashing.__name__}"), lambda: spark)
    monkeypatch.setattr(kafka_sink, "reconcile", reconcile)
    run_pipeline(config, RunContext("recover"), lambda: spark)
    check_kafka_sink(pipeline.bootstrap, pipeline.topic, config)
    rows = Ledger.of(config).rows().to_pylist()
    outcomes = {r["batch_id"] for r in rows if r["status"] != "planned"}
    assert {r["batch_id"] for r in rows} == outcomes, "every plan got an outcome"
    assert audit_pipeline(config).ok
    # the batch that died after its Kafka commit is in the ledger as committed, learned from the commit log
    assert len({r["batch_id"] for r in rows if r["status"] == "committed"}) == len(kafka_sink_commits(config))


def test_a_second_runner_fences_the_first_whose_batch_shows_nothing(pipeline, spark):
    config, out = _kafka_sink(pipeline)
    produce_orders(pipeline.bootstrap, pipeline.topic, 200)  # one batch: the second runner commits the first's very ranges
    other: dict = {}

    def second_runner_starts(_: str) -> None:
        if other:  # the second runner's own batches pass here too
            return
        other["results"] = []

        def run() -> None:
            other["results"] = run_pipeline(config, RunContext("second"), lambda: spark)

        thread = threading.Thread(target=run)
        thread.start()
        thread.join(300)

    with failpoints.on("after_flush", second_runner_starts), pytest.raises(KafkaSinkFencedError, match="fenced"):
        run_pipeline(config, RunContext("first"), lambda: spark, max_batches=1)
    assert [r.status for r in other["results"]] == [BatchStatus.COMMITTED]
    check_kafka_sink(pipeline.bootstrap, pipeline.topic, config)
    first = [r for r in Ledger.of(config).batches() if r["run_id"] == "first"]
    assert {r["status"] for r in first} <= {"failed", "superseded"} and first


def test_a_runner_that_commits_between_anothers_state_read_and_its_commit_fences_it(pipeline, spark, monkeypatch):
    """The state a runner checks its plan against is read after its producer fenced every earlier
    one: a second runner that commits the same ranges right after that read fences the first,
    whose commit fails and shows nothing (read before fencing, the first would commit them again)."""
    from offsetlake import kafka_sink

    config, out = _kafka_sink(pipeline)
    produce_orders(pipeline.bootstrap, pipeline.topic, 200)
    read = kafka_sink.KafkaSinkState.read
    calls: list = []
    second: list = []

    def read_then_another_runner_commits(config_, keys):
        state = read(config_, keys)
        calls.append(keys)
        if len(calls) == 2:  # the first runner's batch (its run's reconcile read first)
            second.extend(run_pipeline(config, RunContext("second"), lambda: spark))
        return state

    monkeypatch.setattr(kafka_sink.KafkaSinkState, "read", staticmethod(read_then_another_runner_commits))
    with pytest.raises(KafkaSinkFencedError):
        run_pipeline(config, RunContext("first"), lambda: spark, max_batches=1)
    assert [r.status for r in second] == [BatchStatus.COMMITTED]
    check_kafka_sink(pipeline.bootstrap, pipeline.topic, config)
