"""Runs attached to a warm Spark session (`offsetlake spark-server`, Spark Connect): no JVM of
their own, and the same exactly-once behaviour through a crash at every step."""

from __future__ import annotations

import json
import signal

from kafka_truth import assert_exactly_once, ledger_rows, read_topic

from offsetlake import storage
from offsetlake.embedded.sample_data import ensure_topic, produce_orders
from offsetlake.failpoints import NAMES

JVM_STARTED = "Using Spark's default log4j profile"  # what every classic session start prints


def test_attached_cli_runs_start_no_jvm_and_a_crash_at_every_failpoint_stays_exactly_once(pipeline, spark_server):
    (pipeline.folder / "orders_transform.py").write_text(
        "from pyspark.sql import functions as F\n\n\n"
        "def enrich(df):\n    return df.withColumn('amount_cents', (F.col('amount') * 100).cast('long'))\n")
    config = pipeline.write(max_records_per_batch=3_000, transform="orders_transform:enrich")
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    next_id = 0
    for failpoint in NAMES:
        # each crashed run first recovers from the previous crash, then dies at the next step
        next_id = produce_orders(pipeline.bootstrap, pipeline.topic, 2_000, first_id=next_id, malformed_every=250)
        planned_before = {r["batch_id"] for r in ledger_rows(config) if r["status"] == "planned"} \
            if storage.is_table(config.ledger_path) else set()
        crashed = pipeline.cli("run", "--remote", spark_server, env={"OFFSETLAKE_FAILPOINT": failpoint})
        assert crashed.returncode == -signal.SIGKILL, (failpoint, crashed.stderr[-2000:])
        assert f"failpoint {failpoint} reached" in crashed.stderr
        assert JVM_STARTED not in crashed.stderr, crashed.stderr[-2000:]
        planned_now = {r["batch_id"] for r in ledger_rows(config) if r["status"] == "planned"}
        assert planned_now - planned_before, f"the run killed at {failpoint} planned no batch"

    # the URL from the environment, as an Airflow worker or a cron job would set it
    recovered = pipeline.cli("run", env={"OFFSETLAKE_SPARK_REMOTE": spark_server})
    assert recovered.returncode == 0, recovered.stderr[-3000:]
    assert JVM_STARTED not in recovered.stderr, recovered.stderr[-2000:]
    summaries = [json.loads(line) for line in recovered.stdout.splitlines() if line.startswith("{")]
    assert summaries and all(s["status"] == "committed" for s in summaries)

    assert_exactly_once(config, read_topic(pipeline.bootstrap, pipeline.topic))
    sink = storage.table(config.sink_path).to_pyarrow_dataset().to_table(columns=["amount", "amount_cents"]).to_pylist()
    assert sink and all(r["amount_cents"] == int(r["amount"] * 100) for r in sink)  # the transform ran on the server
    rows = ledger_rows(config)
    outcomes = {(r["batch_id"], r["partition"]) for r in rows if r["status"] != "planned"}
    dangling = {(r["batch_id"], r["partition"]) for r in rows if r["status"] == "planned"} - outcomes
    assert not dangling, f"planned ledger rows without an outcome: {sorted(dangling)}"
    audit = pipeline.cli("audit", "--against-kafka")
    assert audit.returncode == 0, audit.stdout


def test_attaching_to_a_server_that_is_not_there_fails_naming_it_before_planning(pipeline):
    config = pipeline.write()
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 10)
    done = pipeline.cli("run", "--remote", "sc://127.0.0.1:1", timeout=120)
    assert done.returncode == 2
    assert "cannot reach the Spark Connect server at sc://127.0.0.1:1" in done.stderr, done.stderr[-2000:]
    assert not storage.is_table(config.ledger_path), "a run that could not start Spark planned a batch"
