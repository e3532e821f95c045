"""A Kafka sink's progress is its commit log, never its group's offsets alone (issue 48, finding 2).

The sink's consumer group has no members (its offsets move only inside the sink's transactions),
so Kafka expires its offsets ``offsets.retention.minutes`` after the last commit (7 days by
default), and an operator may delete the group. Planning from the group's offsets then restarted
from the log start and published every record again. Here the group is deleted (what expiry
leaves), moved ahead of the commit log, and the commit log itself is deleted; each time the
output is checked with a plain read_committed consumer (``kafka_truth``)."""

from __future__ import annotations

import time

import pytest
from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition
from confluent_kafka.admin import AdminClient
from kafka_truth import by_source, check_kafka_sink, delete_topic, group_offsets

from offsetlake.audit import audit_pipeline
from offsetlake.embedded.sample_data import ensure_topic, produce_orders
from offsetlake.errors import KafkaSinkProgressError
from offsetlake.kafka_commit import commit_log_topic
from offsetlake.ledger_view import partition_status
from offsetlake.plan import BatchStatus, RunContext
from offsetlake.runs import run_pipeline


def _kafka_sink(pipeline):
    out = f"{pipeline.topic}-out"
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    ensure_topic(pipeline.bootstrap, out, 2)
    return pipeline.write(max_records_per_batch=500, sink={"type": "kafka", "topic": out, "key": ["customer"]}), out


def _delete_group(bootstrap: str, group: str) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    deadline = time.monotonic() + 30
    while True:
        try:
            admin.delete_consumer_groups([group], request_timeout=15)[group].result(15)
            return
        except Exception:  # the coordinator may still hold the group's last transactional commit
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_a_deleted_group_is_restored_from_the_commit_log_and_nothing_is_published_twice(pipeline, spark):
    config, out = _kafka_sink(pipeline)
    group = f"offsetlake-{config.name}"
    produce_orders(pipeline.bootstrap, pipeline.topic, 300)
    assert [b.status for b in run_pipeline(config, RunContext("first"), lambda: spark)] == [BatchStatus.COMMITTED]
    check_kafka_sink(pipeline.bootstrap, pipeline.topic, config)
    ends = {p["partition"]: p["committed_end"] for p in partition_status(config)}

    _delete_group(pipeline.bootstrap, group)  # what offsets.retention.minutes leaves after an idle week
    assert group_offsets(pipeline.bootstrap, group, pipeline.topic, [0, 1]) == {0: None, 1: None}
    status = partition_status(config)
    assert {p["partition"]: p["committed_end"] for p in status} == ends, "status shows the commit log's ends"
    assert [p["lag"] for p in status] == [0, 0] and [p["group_offset"] for p in status] == [None, None]
    audit = audit_pipeline(config)
    assert audit.ok and "the next run restores it" in audit.text(), audit.text()

    # the next run publishes nothing again and puts the group's offsets back
    assert run_pipeline(config, RunContext("after-an-idle-week"), lambda: spark) == []
    assert sum(by_source(pipeline.bootstrap, out).values()) == 300
    check_kafka_sink(pipeline.bootstrap, pipeline.topic, config)

    # deleted again, then new records: the batch's own transaction restores the other partition too
    _delete_group(pipeline.bootstrap, group)
    produce_orders(pipeline.bootstrap, pipeline.topic, 40, first_id=300, partition=0)
    assert [b.status for b in run_pipeline(config, RunContext("more"), lambda: spark)] == [BatchStatus.COMMITTED]
    check_kafka_sink(pipeline.bootstrap, pipeline.topic, config)
    assert audit_pipeline(config).notes == []


def test_a_group_ahead_of_the_commit_log_or_a_lost_commit_log_is_refused(pipeline, spark):
    config, out = _kafka_sink(pipeline)
    group = f"offsetlake-{config.name}"
    produce_orders(pipeline.bootstrap, pipeline.topic, 200)
    assert [b.status for b in run_pipeline(config, RunContext("first"), lambda: spark)] == [BatchStatus.COMMITTED]
    produce_orders(pipeline.bootstrap, pipeline.topic, 50, first_id=200)

    # someone moved the group past what the sink published: refused, nothing produced
    admin = AdminClient({"bootstrap.servers": pipeline.bootstrap})
    moved = ConsumerGroupTopicPartitions(group, [TopicPartition(pipeline.topic, 0, 10_000)])
    admin.alter_consumer_group_offsets([moved])[group].result(15)
    with pytest.raises(KafkaSinkProgressError, match=r"past the end the sink's commit log .* --delete-offsets"):
        run_pipeline(config, RunContext("ahead"), lambda: spark)
    assert sum(by_source(pipeline.bootstrap, out).values()) == 200
    assert not audit_pipeline(config).ok

    # the way forward the message gives: delete the group's offsets, run again
    _delete_group(pipeline.bootstrap, group)
    assert [b.status for b in run_pipeline(config, RunContext("forward"), lambda: spark)] == [BatchStatus.COMMITTED]
    check_kafka_sink(pipeline.bootstrap, pipeline.topic, config)

    # the commit log topic deleted (and with it the group): planning from it would republish all
    _delete_group(pipeline.bootstrap, group)
    delete_topic(pipeline.bootstrap, commit_log_topic(config.name))
    produce_orders(pipeline.bootstrap, pipeline.topic, 10, first_id=250)
    with pytest.raises(KafkaSinkProgressError, match=f"lacks 2 batch.*offsetlake ledger rebuild {config.name}"):
        run_pipeline(config, RunContext("lost-log"), lambda: spark)
    assert sum(by_source(pipeline.bootstrap, out).values()) == 250
