"""Keyed sinks whose key holds a timestamp with sub-millisecond digits (issue 35, finding 2).

Delta keeps timestamp statistics in milliseconds, so a data file's max of such a key is below the
key itself. A merge that read the statistics as exact skipped the file holding a batch's key
whenever that key was the largest of its file: the update became a second row, a delete left the
row, a backfill wrote its record twice — and every run exited 0. Each test here is one of the
issue's scenarios; the expected table is computed from the topic with a plain consumer (newest
record per key, by offset: each test uses one partition), and the audit against Kafka must agree.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest
from confluent_kafka import Producer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka_truth import keyed_sink_rows, read_records

from offsetlake import storage
from offsetlake.audit import audit_pipeline
from offsetlake.backfill import plan_backfill
from offsetlake.embedded.sample_data import ensure_topic
from offsetlake.ledger import Ledger
from offsetlake.plan import RunContext
from offsetlake.runs import execute_recorded_batch, run_pipeline

READING = {"sensor": "string", "at": "timestamp", "reading": "double"}
START = datetime(2026, 11, 23, 10, 0, tzinfo=UTC)


def _at(ms: int, us: int) -> datetime:
    return START + timedelta(milliseconds=ms, microseconds=us)


def _text(at: datetime) -> str:
    return at.isoformat().replace("+00:00", "Z")


def _reading(sensor: str, at: datetime, value: float) -> bytes:
    return json.dumps({"sensor": sensor, "at": _text(at), "reading": value}).encode()


def _produce(bootstrap: str, topic: str, records: list[tuple[bytes | None, bytes | None]]) -> None:
    producer = Producer({"bootstrap.servers": bootstrap})
    for key, value in records:
        producer.produce(topic, key=key, value=value, partition=0)
    assert producer.flush(30) == 0


def _run(config, spark, name: str) -> None:
    run_pipeline(config, RunContext(name), lambda: spark)


def _sink_rows(config, key: list[str]) -> dict[tuple, list[dict]]:
    """The sink's rows readers see, grouped by key (as a tuple of the key columns' values)."""
    grouped: dict[tuple, list[dict]] = {}
    for row in keyed_sink_rows(config.layout.sink):
        grouped.setdefault(tuple(row[c] for c in key), []).append(row)
    return grouped


def _assert_newest_reading_per_key(config, pipeline, key: list[str], newest: dict[tuple, float]) -> None:
    """One row per key, holding the key's newest reading (``newest``, computed from the topic),
    and the audit against Kafka agrees."""
    grouped = _sink_rows(config, key)
    repeated = {k: n for k, n in Counter({k: len(rows) for k, rows in grouped.items()}).items() if n > 1}
    assert not repeated, f"keys with more than one row: {repeated}"
    assert {k: rows[0]["reading"] for k, rows in grouped.items()} == newest
    report = audit_pipeline(config, against_kafka=True)
    assert report.ok, report.text()


def _newest_from_topic(pipeline, key: list[str]) -> dict[tuple, float]:
    """Each key's newest reading, replayed from the topic by offset: a JSON reading sets it, a
    Debezium ``d`` or a tombstone (whose record key is the JSON key) removes it."""
    table: dict[tuple, float] = {}
    for record in read_records(pipeline.bootstrap, pipeline.topic):
        if record.value is None:
            fields = json.loads(record.key)
            table.pop(tuple(_key_value(c, fields[c]) for c in key), None)
            continue
        event = json.loads(record.value)
        if "op" in event:
            if event["op"] == "d":
                table.pop(tuple(_key_value(c, event["before"][c]) for c in key), None)
                continue
            event = event["after"]
        table[tuple(_key_value(c, event[c]) for c in key)] = event["reading"]
    return table


def _key_value(column: str, value: object) -> object:
    return datetime.fromisoformat(str(value)) if column == "at" else value


def test_a_batch_touching_only_the_largest_key_of_a_file_updates_its_row_instead_of_adding_one(pipeline, spark):
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    config = pipeline.write(format={"type": "json", "schema": READING}, sink={"mode": "upsert", "key": ["at"]})
    _produce(pipeline.bootstrap, pipeline.topic, [(None, _reading("s", _at(0, 100), 1.0)), (None, _reading("s", _at(0, 900), 2.0))])
    _run(config, spark, "first")
    # the file's max of `at` is stored as 10:00:00.000, the key below is 10:00:00.000900
    _produce(pipeline.bootstrap, pipeline.topic, [(None, _reading("s", _at(0, 900), 3.0))])
    _run(config, spark, "second")
    newest = _newest_from_topic(pipeline, ["at"])
    assert newest == {(_at(0, 100),): 1.0, (_at(0, 900),): 3.0}
    _assert_newest_reading_per_key(config, pipeline, ["at"], newest)


def test_updates_of_only_the_largest_keys_of_small_files_leave_one_row_per_key(pipeline, spark):
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    config = pipeline.write(format={"type": "json", "schema": READING}, sink={"mode": "upsert", "key": ["sensor", "at"], "file_rows": 2})
    sensors = ["s0", "s1", "s2"]
    _produce(
        pipeline.bootstrap,
        pipeline.topic,
        [(None, _reading(s, _at(i, us), float(i * 10 + us))) for i, s in enumerate(sensors) for us in (100, 900)],
    )
    _run(config, spark, "first")
    assert len(storage.table(config.layout.sink).file_uris()) >= 2, "file_rows makes several small files"
    _produce(pipeline.bootstrap, pipeline.topic, [(None, _reading(s, _at(i, 900), -1.0)) for i, s in enumerate(sensors)])
    _run(config, spark, "second")
    newest = _newest_from_topic(pipeline, ["sensor", "at"])
    assert len(newest) == 6
    _assert_newest_reading_per_key(config, pipeline, ["sensor", "at"], newest)


def test_a_producer_resending_the_newest_reading_leaves_one_row_for_it(pipeline, spark):
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    config = pipeline.write(format={"type": "json", "schema": READING}, sink={"mode": "upsert", "key": ["sensor", "at"]})
    readings = [(None, _reading("boiler", _at(10 * i, 456), 20.0 + i)) for i in range(10)]
    _produce(pipeline.bootstrap, pipeline.topic, readings)
    _run(config, spark, "readings")
    _produce(pipeline.bootstrap, pipeline.topic, [readings[-1]])  # the producer's retry after a lost ack
    _run(config, spark, "retry")
    newest = _newest_from_topic(pipeline, ["sensor", "at"])
    assert len(newest) == 10
    _assert_newest_reading_per_key(config, pipeline, ["sensor", "at"], newest)


def _change(op: str, before: dict | None, after: dict | None, lsn: int) -> bytes:
    return json.dumps(
        {
            "before": before,
            "after": after,
            "op": op,
            "ts_ms": 1_700_000_000_000 + lsn,
            "source": {"ts_ms": 1_700_000_000_000 + lsn, "lsn": lsn, "db": "plant", "table": "readings"},
        }
    ).encode()


def test_a_debezium_delete_of_the_largest_key_of_a_file_removes_its_row(pipeline, spark):
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    config = pipeline.write(
        key_format="none",
        format={"type": "json", "envelope": "debezium", "schema": READING},
        sink={"mode": "upsert", "key": ["sensor", "at"]},
    )
    rows = [{"sensor": "s", "at": _text(_at(i, 250 * i + 1)), "reading": float(i)} for i in range(4)]
    _produce(pipeline.bootstrap, pipeline.topic, [(None, _change("c", None, row, i)) for i, row in enumerate(rows)])
    _run(config, spark, "creates")
    _produce(pipeline.bootstrap, pipeline.topic, [(None, _change("d", rows[-1], None, 10))])
    _run(config, spark, "delete")
    newest = _newest_from_topic(pipeline, ["sensor", "at"])
    assert len(newest) == 3
    _assert_newest_reading_per_key(config, pipeline, ["sensor", "at"], newest)


def test_a_tombstone_of_the_largest_key_of_a_file_removes_its_row(pipeline, spark):
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    config = pipeline.write(
        key_format={"type": "json", "schema": {"sensor": "string", "at": "timestamp"}},
        format={"type": "json", "schema": {"reading": "double"}},
        sink={"mode": "upsert", "key": ["sensor", "at"]},
    )

    def key(i: int) -> bytes:
        return json.dumps({"sensor": "s", "at": _text(_at(i, 777))}).encode()

    _produce(pipeline.bootstrap, pipeline.topic, [(key(i), json.dumps({"reading": float(i)}).encode()) for i in range(3)])
    _run(config, spark, "readings")
    _produce(pipeline.bootstrap, pipeline.topic, [(key(2), None)])
    _run(config, spark, "tombstone")
    newest: dict[tuple, float] = {}
    for record in read_records(pipeline.bootstrap, pipeline.topic):
        fields = json.loads(record.key)
        k = (fields["sensor"], datetime.fromisoformat(fields["at"]))
        if record.value is None:
            newest.pop(k, None)
        else:
            newest[k] = json.loads(record.value)["reading"]
    assert len(newest) == 2
    _assert_newest_reading_per_key(config, pipeline, ["sensor", "at"], newest)


def test_a_backfill_of_the_record_holding_the_largest_key_writes_it_once(pipeline, spark):
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    config = pipeline.write(format={"type": "json", "schema": READING}, sink={"mode": "upsert", "key": ["at"]})
    _produce(pipeline.bootstrap, pipeline.topic, [(None, _reading("s", _at(i, 999), float(i))) for i in range(5)])
    _run(config, spark, "readings")
    plan = plan_backfill(config, RunContext("backfill-the-newest"), from_offset=4, to_offset=5)
    Ledger.of(config).record_plan(plan)
    execute_recorded_batch(config, plan.batch_id, lambda: spark)
    newest = _newest_from_topic(pipeline, ["at"])
    assert len(newest) == 5
    _assert_newest_reading_per_key(config, pipeline, ["at"], newest)


# ---- a property: the largest and smallest keys of many small files, updated and deleted ----------
EXAMPLES = int(os.environ.get("OFFSETLAKE_PROPERTY_EXAMPLES", "3"))
KEY_FORMAT = {"type": "json", "schema": {"sensor": "string", "at": "timestamp"}}


def _file_extremes(config, key: list[str]) -> list[tuple]:
    """The smallest and largest key of every live data file, read from the files' rows (not from
    their statistics; hidden rows, such as delete markers, count: statistics cover them too)."""
    extremes = []
    for fragment in storage.table(config.layout.sink).to_pyarrow_dataset().get_fragments():
        keys = sorted(tuple(row[c] for c in key) for row in fragment.to_table(columns=key).to_pylist())
        if keys:
            extremes += [keys[0], keys[-1]]
    return extremes


def _newest_by_record_key(pipeline, key: list[str]) -> dict[tuple, float]:
    """Each key's newest reading replayed from the topic (record key JSON, a null value deletes);
    a key stays in one partition, so by offset."""
    table: dict[tuple, float] = {}
    for record in read_records(pipeline.bootstrap, pipeline.topic):
        fields = json.loads(record.key)
        k = tuple(_key_value(c, fields[c]) for c in key)
        if record.value is None:
            table.pop(k, None)
        else:
            table[k] = json.loads(record.value)["reading"]
    return table


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    key=st.sampled_from([["at"], ["sensor", "at"]]),
    start=st.sampled_from([START, datetime(1969, 12, 31, 23, 59, 59, 995_000, tzinfo=UTC)]),
    micros=st.sets(st.integers(0, 12_000), min_size=6, max_size=30),
    file_rows=st.integers(2, 4),
    rounds=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
@pytest.mark.timeout(max(600, 200 * EXAMPLES))
def test_updating_and_deleting_the_extreme_keys_of_many_small_files_keeps_the_newest_record_per_key(
    pipeline, spark, key, start, micros, file_rows, rounds, seed
):
    rng = random.Random(seed)
    suffix = uuid.uuid4().hex[:8]
    scene = dataclasses.replace(pipeline, name=f"{pipeline.name}_{suffix}", topic=f"{pipeline.topic}_{suffix}")
    ensure_topic(scene.bootstrap, scene.topic, 2)
    config = scene.write(
        key_format=KEY_FORMAT,
        format={"type": "json", "schema": {"reading": "double"}},
        sink={"mode": "upsert", "key": key, "file_rows": file_rows},
    )
    readings = iter(range(1_000_000))

    def record(k: tuple[str, datetime], value: bool = True) -> tuple[int, bytes, bytes | None]:
        sensor, at = k
        body = json.dumps({"sensor": sensor, "at": _text(at)}).encode()
        partition = (0 if sensor == "a" else 1) if key == ["sensor", "at"] else _micros_of(at) % 2
        return partition, body, json.dumps({"reading": float(next(readings))}).encode() if value else None

    keys = [("a" if rng.random() < 0.5 else "b", start + timedelta(microseconds=us)) for us in sorted(micros)]
    _produce_to(scene.bootstrap, scene.topic, [record(k) for k in keys])
    _run(config, spark, "readings")
    for r in range(rounds):
        by_key = {(k if key == ["sensor", "at"] else k[1:]): k for k in keys}
        extremes = [by_key[e] for e in _file_extremes(config, key) if e in by_key]
        assert extremes, "every file has a smallest and a largest key"
        changes = []
        for k in rng.sample(extremes, max(1, len(extremes) // 2)):
            action = rng.choice(["update", "delete", "resend"])
            changes.append(record(k, value=action != "delete"))
            if action == "resend":
                changes.append(changes[-1])  # the producer's retry
            if action == "delete" and rng.random() < 0.5:
                changes.append(record(k))  # and the key back again
        _produce_to(scene.bootstrap, scene.topic, changes)
        _run(config, spark, f"round-{r}")
        newest = _newest_by_record_key(scene, key)
        _assert_newest_reading_per_key(config, scene, key, newest)


def _micros_of(at: datetime) -> int:
    return (at - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(microseconds=1)


def _produce_to(bootstrap: str, topic: str, records: list[tuple[int, bytes, bytes | None]]) -> None:
    producer = Producer({"bootstrap.servers": bootstrap})
    for partition, key, value in records:
        producer.produce(topic, key=key, value=value, partition=partition)
    assert producer.flush(30) == 0
