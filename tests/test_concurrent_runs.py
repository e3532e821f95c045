"""Invariant 10: writers racing on one pipeline commit each range once; losers re-plan or fail
saying why."""

from __future__ import annotations

import json

import pytest
from kafka_truth import assert_exactly_once, ledger_rows, read_topic

from offsetlake.embedded.sample_data import ensure_topic, produce_orders


@pytest.mark.also_on_s3
def test_two_runs_started_together_end_exactly_once(pipeline):
    config = pipeline.write(max_records_per_batch=8_000)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 3)
    produce_orders(pipeline.bootstrap, pipeline.topic, 20_000, malformed_every=333)

    first, second = pipeline.cli_start("run"), pipeline.cli_start("run")
    outputs = [p.communicate(timeout=600) for p in (first, second)]
    for process, (_, err) in zip((first, second), outputs, strict=True):
        assert process.returncode == 0, err[-3000:]
    committed = [json.loads(line) for out, _ in outputs for line in out.splitlines() if line.startswith("{")]
    batch_ids = [c["batch_id"] for c in committed if c["status"] == "committed"]
    assert len(batch_ids) == len(set(batch_ids))

    assert_exactly_once(config, read_topic(pipeline.bootstrap, pipeline.topic))
    statuses = {r["status"] for r in ledger_rows(config)}
    assert "committed" in statuses
    audit = pipeline.cli("audit", "--against-kafka")
    assert audit.returncode == 0, audit.stdout


def test_dag_runs_whose_ranges_another_batch_took_succeed_as_no_ops_or_replan(pipeline, spark):
    """The CI race that failed: two dag runs planned the same ranges from the same committed ends.

    The first to commit wins; the other is a no-op that succeeds (invariant 3: the sink holds its
    ranges) and publishes, its ledger rows naming the winner. A plan another batch moved part-way
    fails as stale, is superseded, and rerunning its dag run plans anew instead of failing forever.
    """
    import pytest

    from offsetlake.errors import StalePlanError
    from offsetlake.plan import RunContext
    from offsetlake.runs import execute_recorded_batch, plan_for_dag_run, publishable_batch, run_pipeline

    config = pipeline.write(max_records_per_batch=1_000)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    next_id = produce_orders(pipeline.bootstrap, pipeline.topic, 1_500)
    dag = f"{pipeline.name}_ingest"
    first = plan_for_dag_run(config, RunContext("scheduled-1", dag, 1))
    second = plan_for_dag_run(config, RunContext("manual-1", dag, 1))
    assert first.ranges == second.ranges and first.batch_id != second.batch_id

    assert execute_recorded_batch(config, first.batch_id, lambda: spark).status == "committed"
    assert execute_recorded_batch(config, second.batch_id, lambda: spark).status == "superseded"
    second_rows = [r for r in ledger_rows(config) if r["batch_id"] == second.batch_id and r["status"] == "superseded"]
    assert second_rows and all(first.batch_id in r["message"] for r in second_rows)
    published = publishable_batch(config, second.batch_id)
    assert published.batch.status == "superseded" and first.batch_id in (published.batch.message or "")
    assert published.committed_ends == {(r.topic, r.partition): r.end for r in first.ranges}
    assert publishable_batch(config, first.batch_id).batch.status == "committed"

    produce_orders(pipeline.bootstrap, pipeline.topic, 1_500, first_id=next_id)
    stale = plan_for_dag_run(config, RunContext("scheduled-2", dag, 1))
    shorter = pipeline.write(max_records_per_batch=300)  # another run moves the committed end part-way
    assert len(run_pipeline(shorter, RunContext("cli-1"), lambda: spark, max_batches=1)) == 1
    with pytest.raises(StalePlanError, match="the plan is stale and was not applied"):
        execute_recorded_batch(config, stale.batch_id, lambda: spark)
    with pytest.raises(Exception, match=f"batch {stale.batch_id} is superseded"):
        publishable_batch(config, stale.batch_id)
    rerun = plan_for_dag_run(config, RunContext("scheduled-2", dag, 2))  # the user clears the whole dag run
    assert rerun.batch_id != stale.batch_id
    assert execute_recorded_batch(shorter, rerun.batch_id, lambda: spark).status == "committed"
    run_pipeline(shorter, RunContext("cli-2"), lambda: spark)
    assert_exactly_once(config, read_topic(pipeline.bootstrap, pipeline.topic))
