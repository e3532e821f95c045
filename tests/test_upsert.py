"""Keyed sinks (issue 19): ``sink.mode: upsert`` keeps one row per key, the newest record's;
a tombstone deletes its key; the merge is one commit with the batch's txns and ledger entry."""

from __future__ import annotations

import json
import random

import pyarrow as pa
import pytest
from confluent_kafka import Producer
from kafka_truth import read_records, replay_by_key

from offsetlake import failpoints, storage
from offsetlake.embedded.sample_data import ensure_topic
from offsetlake.history import sink_commits
from offsetlake.plan import RunContext
from offsetlake.runs import run_pipeline


def _produce(bootstrap: str, topic: str, records: list[tuple[int, bytes | None, bytes | None]]) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    for partition, key, value in records:
        producer.produce(topic, key=key, value=value, partition=partition)
    assert producer.flush(30) == 0


def _updates(n: int, keys: int, partitions: int, seed: int, delete_share: float = 0.1) -> list[tuple[int, bytes | None, bytes | None]]:
    """``n`` updates over ``keys`` keys, each key always in the same partition, some tombstones."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = rng.randrange(keys)
        value = None if rng.random() < delete_share else json.dumps(
            {"order_id": i, "customer": f"c{k}", "amount": float(i), "currency": "EUR", "created_at": "2026-11-23T10:00:00Z"}
        ).encode()
        out.append((k % partitions, f"k{k}".encode(), value))
    return out


def _sink_by_key(config) -> dict[str, dict]:
    rows = storage.table(config.sink_path).to_pyarrow_table().to_pylist()
    keys = [r["_kafka_key"] for r in rows]
    assert len(keys) == len(set(keys)), "a key appears more than once"
    return {r["_kafka_key"]: r for r in rows}


def _expected(pipeline) -> dict[str, dict]:
    records = read_records(pipeline.bootstrap, pipeline.topic)
    return replay_by_key(records, key_of=lambda r: r.key.decode(),
                         row_of=lambda r: None if r.value is None else {**json.loads(r.value), "_kafka_partition": r.partition,
                                                                          "_kafka_offset": r.offset})


def _assert_converged(config, pipeline) -> None:
    expected = _expected(pipeline)
    actual = _sink_by_key(config)
    assert set(actual) == set(expected), (sorted(set(actual) ^ set(expected))[:10])
    for key, row in expected.items():
        got = actual[key]
        assert (got["order_id"], got["amount"], got["_kafka_partition"], got["_kafka_offset"]) == \
            (row["order_id"], row["amount"], row["_kafka_partition"], row["_kafka_offset"]), key


def test_upsert_keeps_the_newest_record_per_key_and_tombstones_delete(pipeline, spark):
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    _produce(pipeline.bootstrap, pipeline.topic, _updates(600, 50, 2, seed=1))
    config = pipeline.write(max_records_per_batch=150, sink={"mode": "upsert", "key": ["_kafka_key"]})
    batches = run_pipeline(config, RunContext("first"), lambda: spark)
    assert len(batches) >= 2
    _assert_converged(config, pipeline)

    _produce(pipeline.bootstrap, pipeline.topic, _updates(300, 60, 2, seed=2, delete_share=0.3))
    run_pipeline(config, RunContext("second"), lambda: spark)
    _assert_converged(config, pipeline)
    assert run_pipeline(config, RunContext("third"), lambda: spark) == []


def _crash(name: str) -> None:
    raise failpoints.SimulatedCrash()


def test_20k_updates_over_2k_keys_with_crashes_between_batches_converge_and_audit_against_kafka(pipeline, spark):
    ensure_topic(pipeline.bootstrap, pipeline.topic, 3)
    config = pipeline.write(max_records_per_batch=2_500, sink={"mode": "upsert", "key": ["_kafka_key"]})
    updates = _updates(20_000, 2_000, 3, seed=19, delete_share=0.12)
    rounds = len(failpoints.NAMES)
    share = len(updates) // rounds
    for i, name in enumerate(failpoints.NAMES):
        _produce(pipeline.bootstrap, pipeline.topic, updates[i * share: (i + 1) * share if i < rounds - 1 else None])
        # each round: a run dies at one step of a batch (as a SIGKILL would leave it), the next recovers
        with failpoints.on(name, _crash), pytest.raises(failpoints.SimulatedCrash):
            run_pipeline(config, RunContext(f"crash-{name}"), lambda: spark)
        run_pipeline(config, RunContext(f"after-{name}"), lambda: spark)
    _assert_converged(config, pipeline)
    commits = [c for c in sink_commits(storage.table(config.sink_path), config.name)]
    merged = [c.entry["merge"] for c in commits if "merge" in c.entry]
    assert sum(m["deleted"] for m in merged) > 0 and sum(m["updated"] for m in merged) > 0
    audit = pipeline.cli("audit", "--against-kafka")
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert "rows compared with their key's newest record" in audit.stdout, audit.stdout
    print(audit.stdout)

    # the audit sees a key written twice, and a row that is not its key's newest record
    table = storage.table(config.sink_path)
    some = table.to_pyarrow_table().slice(0, 1)
    older = some.set_column(some.schema.get_field_index("amount"), "amount", pa.array([-1.0]))
    storage.append(config.sink_path, older)
    audit = pipeline.cli("audit", "--against-kafka")
    assert audit.returncode == 1, audit.stdout
    assert "has 2 rows in the keyed sink" in audit.stdout and "a row differs from its newest record" in audit.stdout, audit.stdout
