"""A topic deleted and created again under a running pipeline (issue 35 finding 4, invariant 16):
runs, status and the audit refuse naming topic, partition and both offsets; only the recorded
operator action `offsetlake topic reset-epoch` moves the pipeline on, and then nothing is lost."""

from __future__ import annotations

import pytest
from kafka_truth import dead_letter_coordinates, delete_topic, ledger_rows, read_topic, sink_coordinates

from offsetlake.audit import audit_pipeline
from offsetlake.embedded.sample_data import ensure_topic, produce_orders
from offsetlake.entry import from_dict
from offsetlake.errors import TopicIdentityError
from offsetlake.history import SinkCommit
from offsetlake.kafka import topic_ids
from offsetlake.plan import PartitionOffsets, RunContext
from offsetlake.runs import run_pipeline
from offsetlake.topic_epochs import identity_problems, recorded_topic_ids


def _produce_per_partition(bootstrap: str, topic: str, per_partition: int, first_id: int) -> None:
    for partition in (0, 1):
        produce_orders(bootstrap, topic, per_partition, first_id=first_id + partition * 10_000, partition=partition)


def test_a_recreated_topic_stops_the_pipeline_until_the_operator_starts_a_new_epoch(pipeline, spark):
    config = pipeline.write()
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    _produce_per_partition(pipeline.bootstrap, pipeline.topic, 50, first_id=0)  # order ids 0-49, 10000-10049
    run_pipeline(config, RunContext("before"), lambda: spark)
    [old_id] = topic_ids(config, [pipeline.topic]).values()

    delete_topic(pipeline.bootstrap, pipeline.topic)
    gone = pipeline.cli("run")
    assert gone.returncode == 2, gone.stderr

    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    _produce_per_partition(pipeline.bootstrap, pipeline.topic, 25, first_id=100_000)  # the new topic's first 50
    [new_id] = topic_ids(config, [pipeline.topic]).values()
    assert new_id != old_id  # Apache Kafka names both; the plan recorded the old one
    refused = pipeline.cli("run")
    assert refused.returncode == 2, (refused.stdout, refused.stderr)
    for said in (
        "the topic was re-created or truncated",
        f"{pipeline.topic}[0]: the committed end 50 belongs to topic id {old_id}, but the topic's id is now {new_id} (its log end is 25",
        f"{pipeline.topic}[1]: the committed end 50 belongs to topic id {old_id}",
        "topic reset-epoch",
    ):
        assert said in refused.stderr, refused.stderr
    status = pipeline.cli("status")
    assert status.returncode == 2 and f"the topic's id is now {new_id}" in status.stderr, (status.stdout, status.stderr)
    with pytest.raises(TopicIdentityError, match=r"committed end 50 belongs to topic id .*log end is 25"):
        audit_pipeline(config, against_kafka=True)
    assert len(sink_coordinates(config.layout.sink)) == 100  # nothing was written meanwhile

    reset = pipeline.cli("topic", "reset-epoch", "--topic", pipeline.topic, "--reason", "topic re-created")
    assert reset.returncode == 0, reset.stderr
    assert f"{pipeline.topic}[0] 50 -> 0" in reset.stdout and f"{pipeline.topic}[1] 50 -> 0" in reset.stdout
    epoch_rows = [r for r in ledger_rows(config) if r["kind"] == "epoch"]
    assert {(r["partition"], r["start_offset"], r["end_offset"]) for r in epoch_rows} == {(0, 0, 0), (1, 0, 0)}
    assert all("topic re-created" in r["message"] for r in epoch_rows)
    again = pipeline.cli("topic", "reset-epoch", "--topic", pipeline.topic)
    assert again.returncode == 2 and "looks unchanged" in again.stderr, again.stderr

    first = run_pipeline(config, RunContext("after-reset"), lambda: spark)
    assert sum(r.total("rows_written") for r in first) == 50
    _produce_per_partition(pipeline.bootstrap, pipeline.topic, 50, first_id=200_000)
    later = run_pipeline(config, RunContext("later"), lambda: spark)
    assert sum(r.total("rows_written") for r in later) == 100

    truth = read_topic(pipeline.bootstrap, pipeline.topic)  # the new topic, read independently
    assert len(truth.good) == 150 and not truth.bad
    old_ids = set(range(50)) | set(range(10_000, 10_050))
    order_ids = [order_id for _, _, order_id in sink_coordinates(config.layout.sink)]
    assert len(order_ids) == 250 and len(set(order_ids)) == 250, "a record is missing or twice in the sink"
    assert set(order_ids) == old_ids | set(truth.good.values())
    for against_kafka in (False, True):
        report = audit_pipeline(config, against_kafka=against_kafka)
        assert report.ok, report.text()
    assert report.against_kafka is not None and report.against_kafka["records"] == 150
    assert report.against_kafka["in_sink"] == 150 and report.against_kafka["earlier_epochs"] == 100


def test_the_broker_names_the_topic_id_and_every_plan_records_it(pipeline, spark):
    """Apache Kafka names each topic's id; the plan (and so the ledger entry) records it, and a
    topic created again under the same name has another."""
    config = pipeline.write()
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 5)
    [first_id] = topic_ids(config, [pipeline.topic]).values()
    assert first_id and set(first_id) != {"A"}, first_id  # not the all-zero id (base64 "AAAA...")
    results = run_pipeline(config, RunContext("ids"), lambda: spark)
    assert results and results[0].plan.topic_ids == {pipeline.topic: first_id}
    delete_topic(pipeline.bootstrap, pipeline.topic)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    [second_id] = topic_ids(config, [pipeline.topic]).values()
    assert second_id and second_id != first_id


def test_a_changed_topic_id_is_named_even_when_the_log_end_is_past_the_committed_end():
    offsets = {("t", 0): PartitionOffsets("t", 0, 0, 500)}
    commits = [
        SinkCommit(
            3,
            from_dict(
                {
                    "pipeline": "p",
                    "batch_id": "b1",
                    "kind": "ingest",
                    "topic_ids": {"t": "old-id"},
                    "ranges": [{"topic": "t", "partition": 0, "start": 0, "end": 120}],
                }
            ),
        )
    ]
    recorded = recorded_topic_ids(commits)
    assert recorded == {"t": "old-id"}
    problems = identity_problems({("t", 0): 120}, offsets, recorded, {"t": "new-id"})
    assert problems == [
        "t[0]: the committed end 120 belongs to topic id old-id, but the topic's id is now new-id (its log end is 500, log start 0)"
    ]
    assert identity_problems({("t", 0): 120}, offsets, recorded, {"t": "old-id"}) == []
    assert identity_problems({("t", 0): 120}, offsets, {}, {"t": "new-id"}) == []  # entries from before topic ids
    epoch = SinkCommit(
        4, from_dict({"pipeline": "p", "batch_id": "e1", "kind": "epoch", "epoch": {"topic": "t", "topic_id": "new-id"}, "ranges": []})
    )
    assert recorded_topic_ids([*commits, epoch]) == {"t": "new-id"}


def test_dead_letters_of_an_earlier_epoch_stay_beside_the_new_epochs_at_the_same_offsets(pipeline, spark):
    """The new epoch's batches replace dead letters in their ranges (invariant 8), but the old
    epoch's dead letters at the same offsets are other records: they stay, and the audit keeps
    them apart (a helper's report on the topic-epoch work found them deleted)."""
    config = pipeline.write()
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 50, first_id=0, malformed_every=10, partition=0)
    run_pipeline(config, RunContext("old-epoch"), lambda: spark)
    old_dead = sorted(dead_letter_coordinates(config.layout.dead_letters))
    assert len(old_dead) == 5

    delete_topic(pipeline.bootstrap, pipeline.topic)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 30, first_id=1_000, malformed_every=10, partition=0)
    reset = pipeline.cli("topic", "reset-epoch", "--topic", pipeline.topic, "--reason", "re-created")
    assert reset.returncode == 0, reset.stderr
    produce_orders(pipeline.bootstrap, pipeline.topic, 30, first_id=2_000, malformed_every=10, partition=0)
    run_pipeline(config, RunContext("new-epoch"), lambda: spark)

    dead = sorted(dead_letter_coordinates(config.layout.dead_letters))
    assert len(dead) == 5 + 6, dead
    assert all(dead.count(d) == 2 for d in old_dead), f"the old and the new dead letter at one offset are both kept: {dead}"
    for against_kafka in (False, True):
        report = audit_pipeline(config, against_kafka=against_kafka)
        assert report.ok, report.text()
