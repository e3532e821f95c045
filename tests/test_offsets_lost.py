"""Invariant 7: offsets removed before ingestion fail the run loudly; skip is explicit."""

from __future__ import annotations

from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient
from kafka_truth import ledger_rows

from offsetlake import storage
from offsetlake.embedded.sample_data import ensure_topic, produce_orders
from offsetlake.plan import RunContext
from offsetlake.runs import run_pipeline


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
    version = storage.table(config.layout.sink).version()

    produce_orders(pipeline.bootstrap, pipeline.topic, 1_000, first_id=20_000, partition=0)
    _delete_before(pipeline.bootstrap, pipeline.topic, 0, 2_500)

    failed = pipeline.cli("run")
    assert failed.returncode != 0
    message = failed.stderr
    assert f"{pipeline.topic}[0]" in message and "[2000, 2500)" in message, message[-1500:]
    assert "Traceback" not in message
    assert storage.table(config.layout.sink).version() == version, "the sink must not change"


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
    assert storage.table(config.layout.sink).transaction_version(config.app_id(pipeline.topic, 0)) == 2_000
    audit = pipeline.cli("audit", "--against-kafka")
    assert audit.returncode == 0, audit.stdout


def test_gap_over_a_crashed_batch_leaves_none_of_its_dead_letters(pipeline, spark):
    """Found by the fault campaign: a batch killed after writing its dead letters, then its
    offsets deleted and skipped as a gap, left those dead letters behind for records the
    ledger says were never ingested. (Since issue 15 a batch's dead letters only become visible
    after its sink commit, so the crash leaves none; the gap must still leave none.)"""
    from kafka_truth import dead_letter_coordinates

    config = pipeline.write(on_offsets_lost="skip")
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 1_000, partition=0)
    run_pipeline(config, RunContext("first"), lambda: spark)
    produce_orders(pipeline.bootstrap, pipeline.topic, 1_000, first_id=5_000, partition=0, malformed_every=50)

    crashed = pipeline.cli("run", env={"OFFSETLAKE_FAILPOINT": "after_files_written"})
    assert crashed.returncode < 0, crashed.stderr[-2000:]
    # dead letters follow their sink commit now: the crashed batch only staged its 20
    assert dead_letter_coordinates(config.layout.dead_letters) == [], "a batch that never committed shows no dead letter"

    _delete_before(pipeline.bootstrap, pipeline.topic, 0, 1_600)
    run_pipeline(config, RunContext("after"), lambda: spark)
    gaps = [(r["start_offset"], r["end_offset"]) for r in ledger_rows(config) if r["status"] == "gap"]
    assert gaps == [(1_000, 1_600)]
    dead = sorted(o for _, o in dead_letter_coordinates(config.layout.dead_letters))
    assert dead == [o for o in range(1_000, 2_000) if (o - 1_000) % 50 == 49 and o >= 1_600], dead
    assert pipeline.cli("audit", "--against-kafka").returncode == 0
