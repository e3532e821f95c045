"""The `<pipeline>_stream` DAG in real Airflow: the stream owns the pipeline until it is marked
failed in the UI (here: the same REST call), then stops cleanly and batch runs take over.

In ``make torture`` (about 50 s on CI's machine): ``make test`` covers its ground with
tests/test_stream.py (streams stopped, killed and taken over; the lease) and the Airflow tests of
the batch DAGs.
"""

from __future__ import annotations

import shutil
import time

import pytest
from kafka_truth import assert_exactly_once, ledger_rows, read_topic

from offsetlake.embedded.sample_data import ensure_topic, produce_orders
from offsetlake.lease import RELEASED, current_lease, live_lease
from offsetlake.plan import RunContext
from offsetlake.runs import run_pipeline


def _wait_for(what: str, condition, timeout: float = 180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _stream_commits(config) -> list[dict]:
    try:
        rows = ledger_rows(config)
    except Exception:
        return []
    return [r for r in rows if r["kind"] == "stream" and r["status"] == "committed"]


pytestmark = pytest.mark.torture


def test_the_stream_dag_owns_the_pipeline_until_marked_failed(running_airflow, pipeline, spark):
    airflow = running_airflow
    config = pipeline.write(schedule=None)
    shutil.copy(pipeline.file, airflow.pipelines / pipeline.file.name)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    next_id = produce_orders(pipeline.bootstrap, pipeline.topic, 2_000, malformed_every=101)
    stream_dag, ingest_dag = f"{pipeline.name}_stream", f"{pipeline.name}_ingest"
    airflow.wait_for_dag(stream_dag)
    airflow.wait_for_dag(ingest_dag)

    stream_run = airflow.trigger(stream_dag, {"trigger_interval": "1s", "max_duration_minutes": 30})
    _wait_for("the stream's first commit", lambda: _stream_commits(config))
    assert live_lease(config) is not None

    # a scheduled-style ingest run while the stream lives: its plan task skips, saying why
    ingest_run = airflow.trigger(ingest_dag)
    assert airflow.wait_for_run(ingest_dag, ingest_run) == "success"
    states = airflow.task_states(ingest_dag, ingest_run)
    assert states["plan"][0] == "skipped" and states["ingest"][0] == "skipped", states
    assert "is owned by a live stream" in airflow.task_log(ingest_dag, ingest_run, "plan", 1)

    # records produced meanwhile are streamed
    produce_orders(pipeline.bootstrap, pipeline.topic, 1_000, first_id=next_id, malformed_every=101)
    before = len(_stream_commits(config))
    _wait_for("a stream batch of the new records", lambda: len(_stream_commits(config)) > before)

    # Mark as failed (what the UI button does): the task's on_kill sends SIGTERM, the stream
    # finishes its batch in flight and releases the lease
    airflow.api("PATCH", f"/dags/{stream_dag}/dagRuns/{stream_run}/taskInstances/stream", {"new_state": "failed"})
    _wait_for("the stream to release its lease", lambda: current_lease(config).state == RELEASED, timeout=120)
    assert airflow.wait_for_run(stream_dag, stream_run, timeout_s=120) == "failed"
    output = f"{config.stream_log_path}/{stream_run}.try1.log"  # in a local lake, or $OFFSETLAKE_LOG_DIR
    with open(output) as handle:
        text = handle.read()
    assert "step=stop received SIGTERM" in text and "step=stream_stop" in text, text[-3000:]
    planned = {r["batch_id"] for r in ledger_rows(config) if r["kind"] == "stream" and r["status"] == "planned"}
    decided = {r["batch_id"] for r in ledger_rows(config) if r["kind"] == "stream" and r["status"] != "planned"}
    assert planned <= decided, "a stream batch was left planned: the stop was not clean"

    # batch runs take over at once, from the stream's last commit
    produce_orders(pipeline.bootstrap, pipeline.topic, 500, first_id=next_id + 1_000)
    assert run_pipeline(config, RunContext("after-the-stream"), lambda: spark)
    assert_exactly_once(config, read_topic(pipeline.bootstrap, pipeline.topic))
