"""The epochs of a re-created topic stay apart in the sink's rows (issue 35, finding 4 follow-up;
invariant 16): after `offsetlake topic reset-epoch` the sink holds old-epoch rows and new-epoch
rows at the same (topic, partition, offset). Each row carries its epoch (``_offsetlake_epoch``), so
a compaction, a backfill (by offsets or by time), a keyed merge and the audit tell them apart,
and a rewind back past the epoch commit is refused."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta

import pyarrow.compute as pc
import pytest
from confluent_kafka import Producer
from kafka_truth import delete_topic, keyed_sink_rows, read_topic, sink_coordinates

from offsetlake import storage
from offsetlake.audit import audit_pipeline
from offsetlake.backfill import plan_backfill
from offsetlake.embedded.sample_data import ensure_topic, produce_orders
from offsetlake.errors import RewindError
from offsetlake.history import sink_commits
from offsetlake.ledger import Ledger
from offsetlake.maintenance import maintain
from offsetlake.plan import RunContext
from offsetlake.rewind import rewind_pipeline
from offsetlake.runs import execute_recorded_batch, run_pipeline
from offsetlake.topic_epochs import reset_topic_epoch

OLD_IDS = set(range(60))  # the old topic's order ids: offsets 0-59 of partition 0
NEW_FIRST = 100_000


def _two_epochs(pipeline, spark):
    """Old topic: order ids 0-59 at offsets 0-59 (two batches). Deleted, re-created, reset: the new
    topic's ids NEW_FIRST.. at offsets 0-59 again (two batches). Returns the config and the ids."""
    config = pipeline.write()
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 30, first_id=0, partition=0)
    run_pipeline(config, RunContext("old-1"), lambda: spark)
    produce_orders(pipeline.bootstrap, pipeline.topic, 30, first_id=30, partition=0)
    run_pipeline(config, RunContext("old-2"), lambda: spark)

    delete_topic(pipeline.bootstrap, pipeline.topic)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 40, first_id=NEW_FIRST, partition=0)
    reset = reset_topic_epoch(config, pipeline.topic, reason="topic re-created")
    assert [(m["from"], m["to"]) for m in reset.moves] == [(60, 0)]
    run_pipeline(config, RunContext("new-1"), lambda: spark)
    produce_orders(pipeline.bootstrap, pipeline.topic, 20, first_id=NEW_FIRST + 40, partition=0)
    run_pipeline(config, RunContext("new-2"), lambda: spark)
    truth = read_topic(pipeline.bootstrap, pipeline.topic)
    new_ids = set(truth.good.values())
    assert new_ids == set(range(NEW_FIRST, NEW_FIRST + 60)) and not truth.bad
    return config, new_ids


def _rows_by_epoch(config) -> dict[int, list[tuple[int, int]]]:
    """Per epoch the sink's rows say, (offset, order id) of each row, duplicates kept."""
    data = storage.table(config.layout.sink).to_pyarrow_dataset().to_table(columns=["_kafka_offset", "order_id", "_offsetlake_epoch"])
    out: dict[int, list[tuple[int, int]]] = {}
    for offset, order_id, epoch in zip(*(data[c].to_pylist() for c in data.column_names), strict=True):
        out.setdefault(epoch or 0, []).append((offset, order_id))
    return out


def _assert_both_epochs_whole(config, new_ids: set[int]) -> None:
    """Every old-epoch row and every new-epoch record in the sink exactly once, both audits pass,
    and each row carries its epoch."""
    order_ids = [order_id for _, _, order_id in sink_coordinates(config.layout.sink)]
    assert sorted(order_ids) == sorted(OLD_IDS | new_ids), (
        f"missing {sorted((OLD_IDS | new_ids) - set(order_ids))[:5]}, {len(order_ids) - len(set(order_ids))} twice"
    )
    for against_kafka in (False, True):
        report = audit_pipeline(config, against_kafka=against_kafka)
        assert report.ok, report.text()
    assert report.against_kafka is not None and report.against_kafka["in_sink"] == 60
    assert report.against_kafka["earlier_epochs"] == 60
    epochs = _rows_by_epoch(config)
    assert set(epochs) == {0, 1}, epochs.keys()
    for epoch, ids in ((0, OLD_IDS), (1, new_ids)):
        order_ids = [order_id for _, order_id in epochs[epoch]]
        assert sorted(order_ids) == sorted(ids), (
            f"epoch {epoch}: missing {sorted(ids - set(order_ids))[:5]}, "
            f"{len(order_ids) - len(set(order_ids))} twice, foreign {sorted(set(order_ids) - ids)[:5]}"
        )
        assert sorted(o for o, _ in epochs[epoch]) == list(range(60)), f"epoch {epoch} offsets"


def test_compaction_after_an_epoch_reset_keeps_each_row_in_its_epoch(pipeline, spark):
    config, new_ids = _two_epochs(pipeline, spark)
    before = storage.table(config.layout.sink)
    assert len(before.file_uris()) >= 4

    sink = next(r for r in maintain(config, retention_hours=1) if r.table == "sink")
    assert sink.compacted_from >= 4 and sink.files_after == 1, sink
    # the one compacted file was added after the epoch commit: only the rows themselves say which
    # of them are the old topic's records
    _assert_both_epochs_whole(config, new_ids)


def test_a_backfill_after_an_epoch_reset_replaces_only_the_current_epochs_rows(pipeline, spark):
    config, new_ids = _two_epochs(pipeline, spark)
    ledger = Ledger(config.layout.ledger, config.name)

    by_offsets = plan_backfill(config, RunContext("backfill-offsets"), [0], 10, 30)
    ledger.record_plan(by_offsets)
    assert execute_recorded_batch(config, by_offsets.batch_id, lambda: spark).status == "committed"
    _assert_both_epochs_whole(config, new_ids)

    now = datetime.now(UTC)  # a window that holds every record of both topics
    by_time = plan_backfill(
        config,
        RunContext("backfill-time"),
        from_time=(now - timedelta(hours=2)).isoformat(),
        to_time=(now + timedelta(hours=1)).isoformat(),
    )
    assert [(r.start, r.end) for r in by_time.ranges] == [(0, 60)], by_time.ranges
    ledger.record_plan(by_time)
    result = execute_recorded_batch(config, by_time.batch_id, lambda: spark)
    assert result.status == "committed" and result.total("rows_written") == 60
    _assert_both_epochs_whole(config, new_ids)


def test_a_rewind_past_the_epoch_commit_is_refused_and_one_inside_the_epoch_works(pipeline, spark):
    config, new_ids = _two_epochs(pipeline, spark)
    commits = sink_commits(storage.table(config.layout.sink), config.name)
    ingests = [c for c in commits if c.kind == "ingest"]
    epoch = next(c for c in commits if c.kind == "epoch")
    old_batch, new_first = ingests[1], ingests[2]
    assert old_batch.version < epoch.version < new_first.version

    with pytest.raises(RewindError) as refused:
        rewind_pipeline(config, old_batch.batch_id, reason="try to go back")
    said = str(refused.value)
    for part in (
        f"pipeline {config.name}",
        f"topic {pipeline.topic}",
        f"sink version {epoch.version}",
        f"batch {epoch.batch_id}",
        # the id its plan recorded (Apache Kafka names one; a broker that names none gets "the
        # topic before it was re-created")
        f"topic id {old_batch.entry.topic_ids[pipeline.topic]}, which Kafka no longer has",
    ):
        assert part in said, said
    assert storage.table(config.layout.sink).version() == max(c.version for c in commits), "nothing was committed"

    done = rewind_pipeline(config, new_first.batch_id, reason="reprocess the new topic's last batch")
    assert [b["batch_id"] for b in done.plan.rewound] == [ingests[3].batch_id]
    assert [(m.current, m.target) for m in done.plan.txn] == [(60, 40)]
    run_pipeline(config, RunContext("after-rewind"), lambda: spark)
    _assert_both_epochs_whole(config, new_ids)


def _produce_keyed(bootstrap: str, topic: str, records: list[tuple[str, int, int, int]]) -> None:
    """(key, order id, timestamp ms, partition) records, in order."""
    producer = Producer({"bootstrap.servers": bootstrap})
    for key, order_id, stamp, partition in records:
        value = json.dumps(
            {"order_id": order_id, "customer": key, "amount": float(order_id), "currency": "EUR", "created_at": "2026-11-23T10:00:00Z"}
        ).encode()
        producer.produce(topic, key=key.encode(), value=value, partition=partition, timestamp=stamp)
    producer.flush(30)


def test_a_keyed_sinks_later_epoch_record_is_newer_at_the_same_record_time_and_a_lower_offset(pipeline, spark):
    """K: epoch 0 at time T, offset 5; epoch 1 at time T, offset 0 (same partition): the epoch-1
    record is K's row. J: epoch 0 on partition 1 at T + 10 s, epoch 1 on partition 0 at T: across
    topic-partitions the record time decides, so J's row stays the old epoch's, and the audit
    against Kafka, which can no longer read that record, replays it from J's state row."""
    config = pipeline.write(sink={"mode": "upsert", "key": ["_kafka_key"]})
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    stamp = int(time.time() * 1000) - 60_000  # recent: the broker's retention goes by record time
    _produce_keyed(
        pipeline.bootstrap,
        pipeline.topic,
        [(f"other{i}", i, stamp - 1000, 0) for i in range(5)] + [("K", 5, stamp, 0), ("J", 7, stamp + 10_000, 1)],
    )
    run_pipeline(config, RunContext("old"), lambda: spark)
    assert {r["_kafka_key"]: r["order_id"] for r in keyed_sink_rows(config.layout.sink)}["K"] == 5

    delete_topic(pipeline.bootstrap, pipeline.topic)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    _produce_keyed(pipeline.bootstrap, pipeline.topic, [("K", 1_000, stamp, 0), ("J", 1_001, stamp, 0)])
    reset_topic_epoch(config, pipeline.topic, reason="topic re-created")
    run_pipeline(config, RunContext("new"), lambda: spark)

    rows = keyed_sink_rows(config.layout.sink)
    by_key = {r["_kafka_key"]: r for r in rows}
    # other0 and other1 sit at offsets 0 and 1 of the old topic, the offsets of K's and J's new
    # records: a merge that took them for records the batch reprocesses dropped them
    assert sorted(by_key) == ["J", "K", *(f"other{i}" for i in range(5))] and len(rows) == 7, rows
    assert (by_key["K"]["order_id"], by_key["K"]["_kafka_offset"]) == (1_000, 0), "the epoch-1 record is K's newest"
    assert by_key["K"]["_offsetlake_epoch"] == 1
    assert (by_key["J"]["order_id"], by_key["J"]["_kafka_partition"], by_key["J"]["_offsetlake_epoch"]) == (7, 1, None)
    assert all(by_key[f"other{i}"]["order_id"] == i and by_key[f"other{i}"]["_offsetlake_epoch"] is None for i in range(5))
    state = storage.table(config.layout.sink).to_pyarrow_dataset().to_table(filter=pc.field("_kafka_key") == "K")
    assert state.num_rows == 1, "K keeps one state row in partition 0: the later epoch's record replaced it"
    for against_kafka in (False, True):
        report = audit_pipeline(config, against_kafka=against_kafka)
        assert report.ok, report.text()
