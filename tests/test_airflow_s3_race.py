"""Issue 17 in real Airflow: a dag run whose storage settings come from the Airflow connection
``offsetlake_storage_<pipeline>`` and an ``offsetlake run`` given them in its environment race on
one pipeline whose lake is on the embedded S3; each range lands once, a loser is ``superseded``
naming the winner (or finds its ranges taken), and no secret reaches a log.

In ``make torture`` (about 55 s on CI's machine, most of it an Airflow of its own): ``make test``
covers its ground with tests/test_concurrent_runs.py and the also_on_s3 tests (races and runs on
S3), tests/test_object_storage.py, and the Airflow tests that read a connection (the cleared
rerun, the Backfill button).
"""

from __future__ import annotations

import json
import shutil

import pytest
from kafka_truth import assert_exactly_once, ledger_rows, read_topic

from offsetlake import storage
from offsetlake.embedded.sample_data import ensure_topic, produce_orders

# The YAML leaves the settings to its environment: the CLI gets them there, Airflow does not
# have them (its processes started before) and takes them from the connection instead.
_FROM_ENV = {
    "AWS_ENDPOINT_URL": "${RACE_S3_ENDPOINT:-}",
    "AWS_REGION": "${RACE_S3_REGION:-}",
    "AWS_ACCESS_KEY_ID": "${RACE_S3_KEY:-}",
    "AWS_SECRET_ACCESS_KEY": "${RACE_S3_SECRET:-}",
    "AWS_ALLOW_HTTP": "${RACE_S3_ALLOW_HTTP:-}",
}


pytestmark = pytest.mark.torture


def test_an_airflow_dag_run_and_a_cli_run_racing_on_an_s3_lake_stay_exactly_once(running_airflow, pipeline, s3, monkeypatch):
    airflow = running_airflow
    options = s3.options()
    for name, key in (
        ("RACE_S3_ENDPOINT", "AWS_ENDPOINT_URL"),
        ("RACE_S3_REGION", "AWS_REGION"),
        ("RACE_S3_KEY", "AWS_ACCESS_KEY_ID"),
        ("RACE_S3_SECRET", "AWS_SECRET_ACCESS_KEY"),
        ("RACE_S3_ALLOW_HTTP", "AWS_ALLOW_HTTP"),
    ):
        monkeypatch.setenv(name, options[key])
    endpoint = options["AWS_ENDPOINT_URL"]
    host, port = endpoint.rsplit(":", 1)
    airflow.api(
        "POST",
        "/connections",
        {
            "connection_id": f"offsetlake_storage_{pipeline.name}",
            "conn_type": "aws",
            "host": host,
            "port": int(port),
            "login": options["AWS_ACCESS_KEY_ID"],
            "password": options["AWS_SECRET_ACCESS_KEY"],
            "extra": json.dumps({"AWS_REGION": options["AWS_REGION"], "AWS_ALLOW_HTTP": "true"}),
        },
    )
    config = pipeline.write(lake=f"s3://{s3.bucket()}/lake", storage=_FROM_ENV, schedule=None, max_records_per_batch=3_000)
    assert "RACE_S3" in pipeline.file.read_text() and options["AWS_SECRET_ACCESS_KEY"] not in pipeline.file.read_text()
    shutil.copy(pipeline.file, airflow.pipelines / pipeline.file.name)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    produce_orders(pipeline.bootstrap, pipeline.topic, 6_000, malformed_every=211)
    dag_id = f"{pipeline.name}_ingest"
    airflow.wait_for_dag(dag_id)

    run_id = airflow.trigger(dag_id)
    cli = pipeline.cli_start("run")
    _, cli_err = cli.communicate(timeout=600)
    state = airflow.wait_for_run(dag_id, run_id)
    assert cli.returncode == 0, cli_err[-3000:]

    plan_log = airflow.task_log(dag_id, run_id, "plan", 1)
    ingest_log = airflow.task_log(dag_id, run_id, "ingest", 1)
    assert f"come from connection offsetlake_storage_{pipeline.name}" in plan_log, plan_log[-3000:]
    assert options["AWS_SECRET_ACCESS_KEY"] not in plan_log + ingest_log + cli_err
    if state == "failed":
        assert "the plan is stale and was not applied" in ingest_log or "lost the commit race" in ingest_log, ingest_log[-4000:]

    caught_up = pipeline.cli("run")  # what a loser left behind goes in with the next run
    assert caught_up.returncode == 0, caught_up.stderr[-3000:]
    assert config.sink_path.startswith("s3://") and storage.is_table(config.layout.sink)
    assert_exactly_once(config, read_topic(pipeline.bootstrap, pipeline.topic))
    outcomes: dict[str, set[str]] = {}
    for row in ledger_rows(config):  # a row per status a batch reached: planned, then its outcome
        outcomes.setdefault(row["batch_id"], set()).add(row["status"])
    assert all(s - {"planned"} in ({"committed"}, {"superseded"}) for s in outcomes.values()), outcomes
    audit = pipeline.cli("audit", "--against-kafka")
    assert audit.returncode == 0, audit.stdout + audit.stderr
