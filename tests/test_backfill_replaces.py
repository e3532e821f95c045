"""Invariant 6: a backfill replaces exactly its range, repeats identically, never moves txn versions."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime

import pytest
from confluent_kafka import Consumer, TopicPartition
from kafka_truth import ledger_rows

from offsetlake import storage
from offsetlake.backfill import plan_backfill
from offsetlake.embedded.sample_data import ensure_topic, produce_orders
from offsetlake.ledger import Ledger
from offsetlake.plan import RunContext
from offsetlake.runs import execute_recorded_batch, run_pipeline

TRANSFORM = """
from pyspark.sql import functions as F


def cents(rows):
    return rows.withColumn("amount", F.round(F.col("amount") * 100, 2))
"""


def _rows(config) -> list[tuple]:
    table = (
        storage.table(config.layout.sink).to_pyarrow_dataset().to_table(columns=["_kafka_partition", "_kafka_offset", "order_id", "amount"])
    )
    return sorted(zip(*(table[c].to_pylist() for c in table.column_names), strict=True))


def _txns(config, partitions) -> dict[int, int | None]:
    table = storage.table(config.layout.sink)
    return {p: table.transaction_version(config.app_id(config.topic, p)) for p in partitions}


@pytest.mark.also_on_s3
def test_backfill_with_changed_transform_replaces_rows_and_repeats_identically(pipeline, spark):
    config = pipeline.write()
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    produce_orders(pipeline.bootstrap, pipeline.topic, 1_000, partition=0, malformed_every=97)
    produce_orders(pipeline.bootstrap, pipeline.topic, 800, first_id=5_000, partition=1)
    run_pipeline(config, RunContext("ingest"), lambda: spark)
    before = _rows(config)
    txns = _txns(config, [0, 1])
    dead_before = storage.table(config.layout.dead_letters).count()

    (pipeline.folder / "cents.py").write_text(TRANSFORM)
    config = pipeline.write(transform="cents:cents")
    done = pipeline.cli("backfill", "--partitions", "0", "--from-offset", "100", "--to-offset", "600")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["kind"] == "backfill" and summary["ranges"][0]["start"] == 100 and summary["ranges"][0]["end"] == 600

    after = _rows(config)
    assert len(after) == len(before), "a backfill must not change the row count"
    old = {(p, o): (oid, amount) for p, o, oid, amount in before}
    for p, o, _oid, amount in after:
        if p == 0 and 100 <= o < 600:
            assert amount == round(old[(p, o)][1] * 100, 2), f"row {p}/{o} was not reprocessed"
        else:
            assert amount == old[(p, o)][1], f"row {p}/{o} outside the range changed"
    assert _txns(config, [0, 1]) == txns, "a backfill must never move txn versions"
    assert storage.table(config.layout.dead_letters).count() == dead_before
    kinds = {(r["kind"], r["status"]) for r in ledger_rows(config)}
    assert ("backfill", "committed") in kinds

    # the repeat in-process (the CLI path was just checked; a CLI backfill starts a JVM)
    again = plan_backfill(config, RunContext("backfill-again"), [0], 100, 600)
    Ledger(config.layout.ledger, config.name).record_plan(again)
    assert execute_recorded_batch(config, again.batch_id, lambda: spark).status == "committed"
    assert _rows(config) == after, "repeating a backfill must leave the content identical"
    assert pipeline.cli("audit", "--against-kafka").returncode == 0


def test_bad_backfill_params_fail_with_what_to_fix_and_commit_nothing(pipeline, spark):
    config = pipeline.write()
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    produce_orders(pipeline.bootstrap, pipeline.topic, 300)
    run_pipeline(config, RunContext("ingest"), lambda: spark)
    produce_orders(pipeline.bootstrap, pipeline.topic, 100, first_id=10_000, partition=0)
    version = storage.table(config.layout.sink).version()
    committed = _txns(config, [0])[0]
    cases = [
        (["--from-offset", "50", "--to-offset", "50"], "must be greater than from_offset"),
        (["--from-offset", "0", "--to-offset", str(committed + 50)], f"use to_offset <= {committed}"),
        (["--from-offset", "0", "--to-offset", "10000000"], "beyond the last stable offset"),
        (["--partitions", "7", "--from-offset", "0", "--to-offset", "10"], "has no partition 7"),
        (["--from-offset", "0", "--to-offset", "10", "--from-time", "2026-01-01T00:00:00Z"], "not both"),
        (["--from-time", "yesterday", "--to-time", "2026-01-01T00:00:00Z"], "not an ISO-8601 time"),
    ]
    for args, expected in cases:
        result = pipeline.cli("backfill", *args)
        assert result.returncode == 2, (args, result.stderr[-1500:])
        assert expected in result.stderr and pipeline.name in result.stderr, (args, result.stderr[-1500:])
        assert "Traceback" not in result.stderr
    assert storage.table(config.layout.sink).version() == version


def test_backfill_by_time_reads_from_the_offset_offsets_for_times_gives_and_selects_by_record_time(pipeline, spark):
    config = pipeline.write()
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 200, partition=0)
    time.sleep(1.5)
    t1 = datetime.now(UTC)
    time.sleep(0.2)
    produce_orders(pipeline.bootstrap, pipeline.topic, 150, first_id=1_000, partition=0)
    time.sleep(0.2)
    t2 = datetime.now(UTC)
    time.sleep(1.5)
    produce_orders(pipeline.bootstrap, pipeline.topic, 100, first_id=2_000, partition=0)
    run_pipeline(config, RunContext("ingest"), lambda: spark)

    consumer = Consumer({"bootstrap.servers": pipeline.bootstrap, "group.id": "truth-times"})
    expected = [consumer.offsets_for_times([TopicPartition(pipeline.topic, 0, int(t.timestamp() * 1000))], 10)[0].offset for t in (t1, t2)]
    consumer.close()
    assert expected[1] - expected[0] == 150, f"test setup: the middle batch should be 150 records, got {expected}"

    done = pipeline.cli("backfill", "--from-time", t1.isoformat(), "--to-time", t2.isoformat())
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    # record timestamps need not grow with offsets, so the read goes from offsets_for_times(t1) to
    # the committed end and keeps the records whose own timestamps fall in [t1, t2): these 150
    assert [(r["start"], r["end"]) for r in summary["ranges"]] == [(expected[0], 450)]
    assert summary["records_read"] == 150


def test_rows_kept_by_a_backfill_reach_spark_whatever_the_chunking(spark):
    """Found by the fault campaign: a backfill dropped the rows it had to keep from the files it
    replaced, because PySpark 4.2 built no rows from an Arrow table whose first chunks were empty
    (what a filtered read over several files returns)."""
    import pyarrow as pa

    from offsetlake.spark import dataframe_from_arrow

    rows = pa.table({"_kafka_partition": pa.array([0, 0], pa.int32()), "_kafka_offset": [709, 710]})
    chunked = pa.concat_tables([rows.slice(0, 0), rows.slice(0, 0), rows, rows.slice(0, 0)])
    assert [len(c) for c in chunked.column(0).chunks] == [0, 0, 2, 0]
    frame = dataframe_from_arrow(spark, chunked)
    assert sorted(r["_kafka_offset"] for r in frame.collect()) == [709, 710]


def test_a_backfill_that_loses_its_commit_to_a_compaction_retries_on_the_new_files(pipeline, spark, caplog):
    import logging

    from offsetlake import failpoints
    from offsetlake.maintenance import maintain

    config = pipeline.write(max_records_per_batch=300)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 1_200, partition=0)
    assert len(run_pipeline(config, RunContext("ingest"), lambda: spark)) == 4
    before = _rows(config)
    compactions = []

    def compact_once(_name: str) -> None:
        if not compactions:  # between the first attempt's file list and its commit
            compactions.append(next(r for r in maintain(config, vacuum=False) if r.table == "sink"))

    plan = plan_backfill(config, RunContext("backfill-racing-compaction"), [0], 100, 700)
    Ledger(config.layout.ledger, config.name).record_plan(plan)
    with caplog.at_level(logging.INFO, logger="offsetlake.batch"), failpoints.on("after_files_written", compact_once):
        assert execute_recorded_batch(config, plan.batch_id, lambda: spark).status == "committed"
    assert compactions[0].compacted_from >= 2, "the compaction must have replaced the files the backfill read"
    assert "step=retry_commit" in caplog.text and "attempt=1" in caplog.text
    assert _rows(config) == before, "the retried backfill must replace exactly its range once"
    assert pipeline.cli("audit", "--against-kafka").returncode == 0
