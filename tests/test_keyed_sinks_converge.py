"""Keyed sinks converge whatever the batch boundaries (invariant 13; issue 35, findings 9 and 10).

A key that lives in several topic-partitions is ordered by the ordering rule (docs/design.md): its last record per
topic-partition, then the newest of those by record time. The same records must give the same
table in one batch or many, a backfill must never bring back a key deleted later (from any
partition), and the audit must agree with the keyed backfill rule. Each table is compared with
the same records read in one batch by a second pipeline, and with ``kafka_truth.newest_by_key``
(a plain consumer's read of the topic, replayed apart from offsetlake).
"""

from __future__ import annotations

import dataclasses
import json
import os
import uuid

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from kafka_truth import keyed_sink_rows, newest_by_key, read_records

from offsetlake import storage
from offsetlake.audit import audit_pipeline
from offsetlake.backfill import plan_backfill
from offsetlake.errors import BackfillParamsError
from offsetlake.ledger import Ledger
from offsetlake.plan import RunContext
from offsetlake.runs import execute_recorded_batch, run_pipeline

T0 = 1_700_000_000_000  # record times are explicit; the topics keep records forever
KEYED = {"format": {"type": "json", "schema": {"v": "long", "note": "string"}}, "sink": {"mode": "upsert", "key": ["_kafka_key"]}}


def _topic(bootstrap: str, topic: str, partitions: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    new = NewTopic(
        topic, num_partitions=partitions, replication_factor=1, config={"retention.ms": "-1", "message.timestamp.type": "CreateTime"}
    )
    admin.create_topics([new])[topic].result(30)


def _send(bootstrap: str, topic: str, records: list[tuple[int, str, dict | None, int]]) -> None:
    """(partition, key, value or None for a tombstone, record time in ms), in this order."""
    producer = Producer({"bootstrap.servers": bootstrap})
    for partition, key, value, ms in records:
        producer.produce(
            topic, key=key.encode(), value=None if value is None else json.dumps(value).encode(), partition=partition, timestamp=ms
        )
    assert producer.flush(30) == 0


def _table(config) -> dict[str, tuple]:
    """What a reader of the sink sees: key -> (partition, offset, v)."""
    rows = keyed_sink_rows(config.layout.sink) if storage.is_table(config.layout.sink) else []
    keys = [r["_kafka_key"] for r in rows]
    assert len(keys) == len(set(keys)), f"a key has several visible rows: {sorted(keys)}"
    return {r["_kafka_key"]: (r["_kafka_partition"], r["_kafka_offset"], r["v"]) for r in rows}


def _truth(bootstrap: str, topic: str) -> dict[str, tuple]:
    return newest_by_key(
        read_records(bootstrap, topic),
        key_of=lambda r: r.key.decode(),
        row_of=lambda r: None if r.value is None else (r.partition, r.offset, json.loads(r.value)["v"]),
    )


def _one_batch(pipeline, spark, **body) -> dict[str, tuple]:
    """The same topic read by a second pipeline (its own sink) in one batch."""
    other = dataclasses.replace(pipeline, name=f"{pipeline.name}_once")
    config = other.write(topic=pipeline.topic, **body)
    results = run_pipeline(config, RunContext("once"), lambda: spark)
    assert len(results) == 1, "everything in one batch"
    return _table(config)


def _run(config, spark, label: str) -> None:
    run_pipeline(config, RunContext(label), lambda: spark)


def _backfill(config, spark, start: int, end: int, partition: int) -> None:
    plan = plan_backfill(config, RunContext(f"backfill-{uuid.uuid4().hex[:6]}"), from_offset=start, to_offset=end, partitions=[partition])
    Ledger.of(config).record_plan(plan)
    execute_recorded_batch(config, plan.batch_id, lambda: spark)


def _audit_ok(config) -> None:
    report = audit_pipeline(config, against_kafka=True)
    assert report.ok, report.text()


def test_an_update_older_than_a_delete_from_another_partition_does_not_bring_the_key_back(pipeline, spark):
    _topic(pipeline.bootstrap, pipeline.topic, 2)
    config = pipeline.write(**KEYED)
    _send(pipeline.bootstrap, pipeline.topic, [(0, "k", {"v": 1}, T0), (1, "k", None, T0 + 100), (0, "other", {"v": 5}, T0)])
    _run(config, spark, "insert-and-delete")
    assert "k" not in _table(config)
    _send(pipeline.bootstrap, pipeline.topic, [(0, "k", {"v": 2}, T0 + 40)])  # p0's last, older than p1's delete
    _run(config, spark, "older-update")
    truth = _truth(pipeline.bootstrap, pipeline.topic)
    assert "k" not in truth and set(truth) == {"other"}
    assert _table(config) == truth == _one_batch(pipeline, spark, **KEYED)
    _audit_ok(config)


def test_a_later_older_record_of_one_partition_gives_the_key_back_to_the_newer_partition(pipeline, spark):
    """A(p0, 200), B(p1, 100), then C(p0, 50): p0's last is C, and B is newer than C."""
    _topic(pipeline.bootstrap, pipeline.topic, 2)
    config = pipeline.write(**KEYED)
    _send(pipeline.bootstrap, pipeline.topic, [(0, "k", {"v": 1}, T0 + 200), (1, "k", {"v": 2}, T0 + 100)])
    _run(config, spark, "a-and-b")
    assert _table(config) == {"k": (0, 0, 1)}
    _send(pipeline.bootstrap, pipeline.topic, [(0, "k", {"v": 3}, T0 + 50)])
    _run(config, spark, "c")
    truth = _truth(pipeline.bootstrap, pipeline.topic)
    assert truth == {"k": (1, 0, 2)}, "the ordering rule says B"
    assert _table(config) == truth == _one_batch(pipeline, spark, **KEYED)
    _audit_ok(config)


def test_a_backfill_of_one_partition_never_brings_back_a_key_deleted_later_from_another(pipeline, spark):
    _topic(pipeline.bootstrap, pipeline.topic, 2)
    config = pipeline.write(**KEYED)
    _send(pipeline.bootstrap, pipeline.topic, [(0, "k", {"v": 1}, T0), (0, "kept", {"v": 7}, T0)])
    _run(config, spark, "insert")
    _send(pipeline.bootstrap, pipeline.topic, [(1, "k", None, T0 + 100)])
    _run(config, spark, "delete-from-p1")
    assert set(_table(config)) == {"kept"}
    _backfill(config, spark, 0, 2, partition=0)
    truth = _truth(pipeline.bootstrap, pipeline.topic)
    assert set(truth) == {"kept"}
    assert _table(config) == truth == _one_batch(pipeline, spark, **KEYED)
    _audit_ok(config)


def test_a_debezium_delete_from_another_partition_is_not_undone_by_an_older_update(pipeline, spark):
    _topic(pipeline.bootstrap, pipeline.topic, 2)

    def event(op: str, before: dict | None, after: dict | None) -> dict:
        return {"before": before, "after": after, "op": op, "source": {"ts_ms": T0, "lsn": 1, "db": "shop"}}

    cdc = {
        "key_format": "none",
        "format": {"type": "json", "envelope": "debezium", "schema": {"id": "long", "name": "string"}, "required": ["id"]},
        "sink": {"mode": "upsert", "key": ["id"]},
    }
    config = pipeline.write(**cdc)
    _send(
        pipeline.bootstrap,
        pipeline.topic,
        [
            (0, "1", event("c", None, {"id": 1, "name": "a"}), T0),
            (1, "1", event("d", {"id": 1, "name": "a"}, None), T0 + 100),
            (1, "2", event("c", None, {"id": 2, "name": "b"}), T0),
        ],
    )
    _run(config, spark, "create-and-delete")
    _send(pipeline.bootstrap, pipeline.topic, [(0, "1", event("u", {"id": 1, "name": "a"}, {"id": 1, "name": "a2"}), T0 + 40)])
    _run(config, spark, "older-update")
    ids = sorted(r["id"] for r in keyed_sink_rows(config.layout.sink))
    assert ids == [2], "id 1 was deleted by its newest change (p1, +100 ms), and stays deleted"
    once = dataclasses.replace(pipeline, name=f"{pipeline.name}_once").write(topic=pipeline.topic, **cdc)
    run_pipeline(once, RunContext("once"), lambda: spark)
    assert sorted(r["id"] for r in keyed_sink_rows(once.layout.sink)) == ids
    _audit_ok(config)


# ---- finding 10 ---------------------------------------------------------------------------------
NAN_TRANSFORM = """
from pyspark.sql import functions as F


def with_score(df):
    return df.withColumn("score", F.lit(float("nan")))
"""


def test_the_audit_against_kafka_finds_a_key_holding_nan_where_it_is(pipeline, spark):
    (pipeline.folder / "nan_transform.py").write_text(NAN_TRANSFORM)
    _topic(pipeline.bootstrap, pipeline.topic, 1)
    config = pipeline.write(
        format={"type": "json", "schema": {"v": "long"}},
        transform="nan_transform:with_score",
        sink={"mode": "upsert", "key": ["v", "score"]},
    )
    _send(pipeline.bootstrap, pipeline.topic, [(0, f"k{i}", {"v": i % 3}, T0 + i) for i in range(6)])
    _run(config, spark, "nan-keys")
    rows = keyed_sink_rows(config.layout.sink)
    assert sorted(r["v"] for r in rows) == [0, 1, 2] and all(r["score"] != r["score"] for r in rows)
    _audit_ok(config)


def test_a_keyed_backfill_that_makes_a_keys_newest_record_a_dead_letter_gives_the_key_its_previous_record(pipeline, spark):
    """The keyed backfill rule gives way to the audit's: a record is never both a row and a dead letter."""
    _topic(pipeline.bootstrap, pipeline.topic, 1)
    schema = {"v": "long", "note": "string"}
    config = pipeline.write(format={"type": "json", "schema": schema}, sink={"mode": "upsert", "key": ["_kafka_key"]})
    _send(
        pipeline.bootstrap,
        pipeline.topic,
        [
            (0, "k", {"v": 1, "note": "first"}, T0),  # offset 0
            (0, "k", {"v": 2}, T0 + 1),  # offset 1: no note
            (0, "j", {"v": 3, "note": "j"}, T0 + 2),
        ],
    )  # offset 2
    _run(config, spark, "ingest")
    assert _table(config) == {"k": (0, 1, 2), "j": (0, 2, 3)}
    # the schema fix: a note is required from now on, so offset 1 becomes a dead letter
    config = pipeline.write(format={"type": "json", "schema": schema, "required": ["note"]}, sink={"mode": "upsert", "key": ["_kafka_key"]})
    with pytest.raises(BackfillParamsError, match=r"offset 1.*backfill .*\[0\] from its log start \(offset 0\)"):
        _backfill(config, spark, 1, 3, partition=0)  # k's record before the range is not read: refused
    assert _table(config) == {"k": (0, 1, 2), "j": (0, 2, 3)}, "nothing was committed"
    _backfill(config, spark, 0, 3, partition=0)
    assert _table(config) == {"k": (0, 0, 1), "j": (0, 2, 3)}
    dead = storage.table(config.layout.dead_letters).to_pyarrow_table().to_pylist()
    assert [d["_kafka_offset"] for d in dead] == [1]
    _audit_ok(config)


# ---- the property: one batch or many, the same table --------------------------------------------
EXAMPLES = int(os.environ.get("OFFSETLAKE_PROPERTY_EXAMPLES", "2"))  # + the 2 explicit ones
PROPERTY = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
PARTITIONS = 3
records_strategy = st.lists(
    st.tuples(
        st.integers(0, PARTITIONS - 1),  # partition
        st.sampled_from(["a", "b", "c", "d"]),  # key: every key in several partitions
        st.one_of(st.none(), st.integers(0, 999)),  # a tombstone or a value
        st.integers(0, 6).map(lambda step: T0 + 50 * step),
    ),  # record time: ties and going back
    min_size=1,
    max_size=40,
)


@pytest.mark.timeout(max(600, 120 * EXAMPLES))
@PROPERTY
@given(
    records=records_strategy,
    cuts=st.lists(st.integers(1, 39), min_size=1, max_size=4),
    backfill=st.tuples(st.integers(0, PARTITIONS - 1), st.integers(0, 20), st.integers(1, 20)),
)
# finding 9's shapes, always tried: a delete undone by an older update from the other partition,
# and A(p0, 200), B(p1, 100) | C(p0, 50)
@example(records=[(0, "a", 1, T0), (1, "a", None, T0 + 100), (0, "a", 2, T0 + 40)], cuts=[2], backfill=(0, 0, 1))
@example(records=[(0, "a", 1, T0 + 200), (1, "a", 2, T0 + 100), (0, "a", 3, T0 + 50)], cuts=[2], backfill=(2, 0, 1))
def test_any_split_of_the_same_records_into_batches_gives_the_table_of_one_batch(broker, spark, tmp_path_factory, records, cuts, backfill):
    from conftest import Pipeline

    suffix = uuid.uuid4().hex[:8]
    folder = tmp_path_factory.mktemp("converge")
    (folder / "pipelines").mkdir()
    pipeline = Pipeline(
        name=f"conv_{suffix}", topic=f"conv_{suffix}", folder=folder / "pipelines", lake=folder / "lake", bootstrap=broker.bootstrap
    )
    _topic(pipeline.bootstrap, pipeline.topic, PARTITIONS)
    config = pipeline.write(**KEYED)
    bounds = sorted({c for c in cuts if c < len(records)} | {0, len(records)})
    for n, (start, end) in enumerate(zip(bounds, bounds[1:], strict=False)):
        _send(pipeline.bootstrap, pipeline.topic, [(p, k, None if v is None else {"v": v}, ms) for p, k, v, ms in records[start:end]])
        _run(config, spark, f"wave-{n}")
    truth = _truth(pipeline.bootstrap, pipeline.topic)
    assert _table(config) == truth, f"batches {bounds}"
    assert _one_batch(pipeline, spark, **KEYED) == truth

    partition, start, size = backfill  # a backfill of what is already there changes no visible row
    ends = {p: sum(1 for r in records if r[0] == p) for p in range(PARTITIONS)}
    if start < ends[partition]:
        _backfill(config, spark, start, min(start + size, ends[partition]), partition)
        assert _table(config) == truth, f"after a backfill of [{start}, {start + size}) of partition {partition}"
    _audit_ok(config)


def test_the_audit_against_kafka_takes_the_state_of_a_key_whose_newest_record_retention_took(pipeline, spark):
    """Key K's newest record (by time) is on p1 and an older one on p0; once retention (here
    delete_records) takes p1's, Kafka shows only p0's. The key's row is still right — the sink's
    state row for p1 is the only account of the record that won — so the audit must pass, and it
    must still see a row that is wrong where Kafka can show it (a wrong value for key L on p0)."""
    config = pipeline.write(**KEYED)
    _topic(pipeline.bootstrap, pipeline.topic, 2)
    _send(
        pipeline.bootstrap,
        pipeline.topic,
        [
            (0, "K", {"v": 1}, T0 + 100),
            (1, "K", {"v": 2}, T0 + 200),
            (1, "M", {"v": 3}, T0 + 210),
            (1, "M", None, T0 + 220),
            (0, "L", {"v": 4}, T0 + 230),
            (1, "N", {"v": 5}, T0 + 240),
        ],
    )
    run_pipeline(config, RunContext("keyed"), lambda: spark)
    assert _table(config) == {"K": (1, 0, 2), "L": (0, 1, 4), "N": (1, 3, 5)}
    admin = AdminClient({"bootstrap.servers": pipeline.bootstrap})
    from confluent_kafka import TopicPartition

    for future in admin.delete_records([TopicPartition(pipeline.topic, 1, 3)]).values():
        future.result(30)  # p1 keeps only N's record: K's winner and M's delete are past retention
    report = audit_pipeline(config, against_kafka=True)
    assert report.ok, report.text()
    assert report.against_kafka["past_retention"] == 3

    # a row that is wrong where Kafka still holds its key's record is still found
    sink = storage.table(config.layout.sink)
    sink.update(updates={"v": "40"}, predicate="_kafka_key = 'L'")
    report = audit_pipeline(config, against_kafka=True)
    assert not report.ok and "key _kafka_key='L'" in report.text(), report.text()
