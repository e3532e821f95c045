"""Invariant 7: offsets removed before ingestion fail the run loudly; skip is explicit."""

from __future__ import annotations

from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient
from deltalake import DeltaTable
from kafka_truth import ledger_rows

from offsetlake.batch import run_pipeline
from offsetlake.plan import RunContext
from offsetlake.sample_data import ensure_topic, produce_orders


def _delete_before(bootstrap: str, topic: str, partition: int, offset: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.delete_records([TopicPartition(topic, partition, offset)])
    for future in futures.values():
        future.result(30)


def test_delete_records_past_committed_end_fails_naming_the_offsets(pipeline, spark):
    config = pipeline.write()
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    produce_orders(pipeline.bootstrap, pipeline.topic, 2_000, partition=0)
    produce_orders(pipeline.bootstrap, pipeline.topic, 1_000, first_id=10_000, partition=1)
    run_pipeline(config, RunContext("first"), lambda: spark)
    version = DeltaTable(config.sink_path).version()

    produce_orders(pipeline.bootstrap, pipeline.topic, 1_000, first_id=20_000, partition=0)
    _delete_before(pipeline.bootstrap, pipeline.topic, 0, 2_500)

    failed = pipeline.cli("run")
    assert failed.returncode != 0
    message = failed.stderr
    assert f"{pipeline.topic}[0]" in message and "[2000, 2500)" in message, message[-1500:]
    assert "Traceback" not in message
    assert DeltaTable(config.sink_path).version() == version, "the sink must not change"


def test_skip_policy_records_a_gap_and_continues(pipeline, spark):
    config = pipeline.write()
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 1_000, partition=0)
    run_pipeline(config, RunContext("first"), lambda: spark)
    produce_orders(pipeline.bootstrap, pipeline.topic, 1_000, first_id=5_000, partition=0)
    _delete_before(pipeline.bootstrap, pipeline.topic, 0, 1_400)

    config = pipeline.write(on_offsets_lost="skip")
    run_pipeline(config, RunContext("skip"), lambda: spark)
    gaps = [r for r in ledger_rows(config) if r["status"] == "gap"]
    assert [(g["start_offset"], g["end_offset"]) for g in gaps] == [(1_000, 1_400)]
    assert DeltaTable(config.sink_path).transaction_version(config.app_id(pipeline.topic, 0)) == 2_000
    audit = pipeline.cli("audit")
    assert audit.returncode == 0, audit.stdout
