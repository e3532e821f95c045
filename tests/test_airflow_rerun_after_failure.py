"""A failed ingest cleared through the REST API (as the UI does) reruns exactly the same ranges,
whether it died in the job or failed its Great Expectations suite.

Real Airflow: api-server, scheduler and dag-processor on a SQLite home, LocalExecutor, the DAG
run triggered, failed by a one-shot failpoint in the spark-submit job, cleared, rerun.
"""

from __future__ import annotations

import json
import shutil

import yaml
from kafka_truth import assert_exactly_once, dead_letter_coordinates, ledger_rows, read_topic, sink_coordinates

from offsetlake import storage
from offsetlake.embedded.sample_data import ensure_topic, produce_orders


def test_cleared_failed_runs_rerun_the_same_ranges_exactly_once(running_airflow, pipeline):
    airflow = running_airflow
    config = pipeline.write(schedule=None)
    shutil.copy(pipeline.file, airflow.pipelines / pipeline.file.name)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    produce_orders(pipeline.bootstrap, pipeline.topic, 3_000, malformed_every=101)
    dag_id = f"{pipeline.name}_ingest"
    airflow.wait_for_dag(dag_id)

    # 1. the first try of ingest dies after reading; the run fails; a clear reruns the same plan
    airflow.failpoint_file.write_text("after_read")
    run_id = airflow.trigger(dag_id)
    assert airflow.wait_for_run(dag_id, run_id) == "failed"
    assert airflow.task_states(dag_id, run_id)["ingest"][0] == "failed"
    assert not airflow.failpoint_file.exists(), "the failpoint did not fire"
    planned = {
        (r["batch_id"], r["partition"], r["start_offset"], r["end_offset"])
        for r in ledger_rows(config)
        if r["status"] == "planned" and r["run_id"] == run_id
    }
    assert planned, "the plan task must have recorded the run's ranges"
    assert not storage.is_table(config.layout.sink), "nothing may be committed by a try that died after reading"

    airflow.clear(dag_id, run_id, only_failed=False)  # the whole run, plan included
    assert airflow.wait_for_run(dag_id, run_id) == "success"
    states = airflow.task_states(dag_id, run_id)
    assert states["plan"] == ("success", 2) and states["ingest"] == ("success", 2), states
    committed = {
        (r["batch_id"], r["partition"], r["start_offset"], r["end_offset"]) for r in ledger_rows(config) if r["status"] == "committed"
    }
    assert committed == planned, "the rerun must commit exactly the ranges planned by the failed try"
    assert_exactly_once(config, read_topic(pipeline.bootstrap, pipeline.topic))

    # 2. the first try dies right after its commit; the rerun writes nothing and succeeds
    produce_orders(pipeline.bootstrap, pipeline.topic, 1_000, first_id=50_000)
    airflow.failpoint_file.write_text("after_commit")
    run_id = airflow.trigger(dag_id)
    assert airflow.wait_for_run(dag_id, run_id) == "failed"
    version_after_commit = storage.table(config.layout.sink).version()
    airflow.clear(dag_id, run_id)
    assert airflow.wait_for_run(dag_id, run_id) == "success"
    assert airflow.task_states(dag_id, run_id)["ingest"] == ("success", 2)
    assert storage.table(config.layout.sink).version() == version_after_commit, "the rerun must not write again"
    mine = [r for r in ledger_rows(config) if r["run_id"] == run_id and r["status"] == "committed"]
    assert mine and {r["sink_version"] for r in mine} == {version_after_commit}
    assert_exactly_once(config, read_topic(pipeline.bootstrap, pipeline.topic))
    assert pipeline.cli("audit", "--against-kafka").returncode == 0

    # 3. nulls in a not-null column fail validation: the ingest task fails with the summary in its
    #    log, nothing moves; switched to quarantine, clearing the task commits the same ranges
    suite = {"expectations": [{"expect_column_values_to_not_be_null": {"column": "customer"}}]}
    (airflow.pipelines / f"{pipeline.name}.expectations.yaml").write_text(yaml.safe_dump(suite))
    pipeline.write(schedule=None, validation={"on_failure": "fail"})
    shutil.copy(pipeline.file, airflow.pipelines / pipeline.file.name)
    produce_orders(pipeline.bootstrap, pipeline.topic, 500, first_id=60_000, null_customer_every=20)
    version_before = storage.table(config.layout.sink).version()
    run_id = airflow.trigger(dag_id)
    assert airflow.wait_for_run(dag_id, run_id) == "failed"
    assert airflow.task_states(dag_id, run_id)["ingest"] == ("failed", 1)
    log = airflow.task_log(dag_id, run_id, "ingest", 1)
    assert "failed validation" in log and "expect_column_values_to_not_be_null(column=customer): 25 unexpected of 500 rows" in log
    assert "report: file://" in log or (storage.is_uri(config.lake_path) and f"report: {config.lake_path}/" in log), log[-3000:]
    assert storage.table(config.layout.sink).version() == version_before
    failed = [r for r in ledger_rows(config) if r["run_id"] == run_id and r["status"] == "failed"]
    assert failed and all("expect_column_values_to_not_be_null" in r["message"] for r in failed)
    assert json.loads(failed[0]["validation"])["failed"] == ["expect_column_values_to_not_be_null(column=customer)"]
    planned = {
        (r["batch_id"], r["partition"], r["start_offset"], r["end_offset"])
        for r in ledger_rows(config)
        if r["status"] == "planned" and r["run_id"] == run_id
    }

    pipeline.write(schedule=None, validation={"on_failure": "quarantine"})
    shutil.copy(pipeline.file, airflow.pipelines / pipeline.file.name)
    airflow.clear_task(dag_id, run_id, "ingest")
    assert airflow.wait_for_run(dag_id, run_id) == "success"
    assert airflow.task_states(dag_id, run_id)["ingest"] == ("success", 2)
    committed = {
        (r["batch_id"], r["partition"], r["start_offset"], r["end_offset"])
        for r in ledger_rows(config)
        if r["status"] == "committed" and r["run_id"] == run_id
    }
    assert committed == planned, "the cleared task must commit exactly the ranges the failed try planned"
    truth = read_topic(pipeline.bootstrap, pipeline.topic)
    every = [(p, o) for p, o, _ in sink_coordinates(config.layout.sink)] + dead_letter_coordinates(config.layout.dead_letters)
    assert len(every) == len(set(every)) and set(every) == set(truth.good) | truth.bad
    reasons = storage.table(config.layout.dead_letters).to_pyarrow_dataset().to_table(columns=["reason"])["reason"].to_pylist()
    assert reasons.count("failed expectation: expect_column_values_to_not_be_null(column=customer)") == 25
    assert pipeline.cli("audit", "--against-kafka").returncode == 0
