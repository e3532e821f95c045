"""Invariant 10 in real Airflow: a scheduled-style dag run, a CLI run and a CLI backfill started
together on one pipeline commit each range once; losers re-plan, find their ranges taken, or
fail saying why."""

from __future__ import annotations

import shutil
from collections import Counter

import pytest
from kafka_truth import assert_exactly_once, ledger_rows, read_topic

from offsetlake import storage
from offsetlake.embedded.sample_data import ensure_topic, produce_orders


@pytest.mark.torture
def test_airflow_run_backfill_and_cli_run_at_once_stay_exactly_once(running_airflow, pipeline):
    """New records, then at the same moment a run of the ingest DAG (its plan task and
    spark-submit job, as the scheduler runs them, triggered through the REST API), a backfill of
    one partition's committed offsets and an `offsetlake run`. Whoever loses must re-plan or fail
    with a message naming the batch that won; the topic must land exactly once. (One round: two
    doubled the suite's slowest test; the fault campaign races writers many more times.)

    In ``make torture`` (about 65 s on CI's machine): ``make test`` covers its ground with
    tests/test_concurrent_runs.py (runs, backfills and rewinds racing) and
    tests/test_airflow_s3_race.py (an Airflow dag run racing a CLI run)."""
    airflow = running_airflow
    config = pipeline.write(schedule=None, max_records_per_batch=3_000)
    shutil.copy(pipeline.file, airflow.pipelines / pipeline.file.name)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 3)
    next_id = produce_orders(pipeline.bootstrap, pipeline.topic, 6_000, malformed_every=211)
    assert pipeline.cli("run").returncode == 0
    dag_id = f"{pipeline.name}_ingest"
    airflow.wait_for_dag(dag_id)

    outcomes: Counter = Counter()
    for round_number in range(1):
        next_id = produce_orders(pipeline.bootstrap, pipeline.topic, 6_000, first_id=next_id, malformed_every=211)
        partition = round_number % 3
        end = storage.table(config.layout.sink).transaction_version(config.app_id(pipeline.topic, partition))
        run_id = airflow.trigger(dag_id)
        # the CLI writers start once the dag run has planned: attached to a warm Spark server they
        # would otherwise commit everything before the scheduler even starts the plan task
        _wait_for_plan(config, dag_id)
        cli = pipeline.cli_start("run")
        backfill = pipeline.cli_start("backfill", "--partitions", str(partition), "--from-offset", "0", "--to-offset", str(end))
        _, cli_err = cli.communicate(timeout=600)
        _, backfill_err = backfill.communicate(timeout=600)
        state = airflow.wait_for_run(dag_id, run_id)

        assert cli.returncode == 0, cli_err[-3000:]
        outcomes["cli run re-planned"] += "step=replan" in cli_err
        if backfill.returncode != 0:
            assert backfill.returncode == 2 and "conflicted with another writer" in backfill_err, backfill_err[-3000:]
            outcomes["backfill conflicted, rerun"] += 1
            again = pipeline.cli("backfill", "--partitions", str(partition), "--from-offset", "0", "--to-offset", str(end))
            assert again.returncode == 0, again.stderr[-3000:]
        ingest_log = airflow.task_log(dag_id, run_id, "ingest", 1)
        if state == "failed":
            assert "the plan is stale and was not applied" in ingest_log or "lost the commit race" in ingest_log, ingest_log[-4000:]
            outcomes["airflow ingest failed naming the winner"] += 1
        else:
            took = "committed_by_another_batch" in ingest_log
            outcomes["airflow ingest " + ("found its ranges committed by another batch" if took else "committed")] += 1

        caught_up = pipeline.cli("run")  # what a loser left behind goes in with the next run
        assert caught_up.returncode == 0, caught_up.stderr[-3000:]
        assert_exactly_once(config, read_topic(pipeline.bootstrap, pipeline.topic))
        audit = pipeline.cli("audit", "--against-kafka")
        assert audit.returncode == 0, audit.stdout
    print("race outcomes:", dict(outcomes))


def _wait_for_plan(config, dag_id: str, timeout_s: float = 300) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not any(r["dag_id"] == dag_id and r["status"] == "planned" for r in ledger_rows(config)):
        assert time.monotonic() < deadline, f"{dag_id} recorded no plan within {timeout_s:.0f}s"
        time.sleep(0.5)
