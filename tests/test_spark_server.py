"""Runs attached to a warm Spark session (`offsetlake spark-server`, Spark Connect): no JVM of
their own, and the same exactly-once behaviour through a crash at every step."""

from __future__ import annotations

import json

from crash_runs import assert_every_plan_has_an_outcome, crash_at_every_failpoint
from kafka_truth import assert_exactly_once, read_topic

from offsetlake import storage
from offsetlake.embedded.sample_data import ensure_topic, produce_orders

JVM_STARTED = "Using Spark's default log4j profile"  # what every classic session start prints


def test_attached_cli_runs_start_no_jvm_and_a_crash_at_every_failpoint_stays_exactly_once(pipeline, spark_server):
    (pipeline.folder / "orders_transform.py").write_text(
        "from pyspark.sql import functions as F\n\n\n"
        "def enrich(df):\n    return df.withColumn('amount_cents', (F.col('amount') * 100).cast('long'))\n"
    )
    config = pipeline.write(max_records_per_batch=3_000, transform="orders_transform:enrich")
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    for crashed in crash_at_every_failpoint(pipeline, config, 2_000, "--remote", spark_server):
        assert JVM_STARTED not in crashed.stderr, crashed.stderr[-2000:]

    # the URL from the environment, as an Airflow worker or a cron job would set it
    recovered = pipeline.cli("run", env={"OFFSETLAKE_SPARK_REMOTE": spark_server})
    assert recovered.returncode == 0, recovered.stderr[-3000:]
    assert JVM_STARTED not in recovered.stderr, recovered.stderr[-2000:]
    summaries = [json.loads(line) for line in recovered.stdout.splitlines() if line.startswith("{")]
    assert summaries and all(s["status"] == "committed" for s in summaries)

    assert_exactly_once(config, read_topic(pipeline.bootstrap, pipeline.topic))
    sink = storage.table(config.layout.sink).to_pyarrow_dataset().to_table(columns=["amount", "amount_cents"]).to_pylist()
    assert sink and all(r["amount_cents"] == int(r["amount"] * 100) for r in sink)  # the transform ran on the server
    assert_every_plan_has_an_outcome(config)
    audit = pipeline.cli("audit", "--against-kafka")
    assert audit.returncode == 0, audit.stdout


def test_attaching_to_a_server_that_is_not_there_fails_naming_it_before_planning(pipeline):
    config = pipeline.write()
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 10)
    done = pipeline.cli("run", "--remote", "sc://127.0.0.1:1", timeout=120)
    assert done.returncode == 2
    assert "cannot reach the Spark Connect server at sc://127.0.0.1:1" in done.stderr, done.stderr[-2000:]
    assert not storage.is_table(config.layout.ledger), "a run that could not start Spark planned a batch"
