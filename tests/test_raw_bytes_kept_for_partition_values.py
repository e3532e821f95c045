"""A record that decoded well keeps its original bytes through a batch only when it may still
become a dead letter: with a transform, only when the transform makes a partition column text
(a value too long for a folder name is a dead letter, with the record's bytes).

Keeping every record's key, value and headers in the batch's cache made the shipped orders
pipeline's read about a third slower (it is partitioned by a date its transform derives, which no
value can make unwritable); the decision is taken from the transformed schema before reading.
"""

from __future__ import annotations

import json

import pytest
from confluent_kafka import Producer

from offsetlake import process, storage
from offsetlake.embedded.sample_data import ensure_topic
from offsetlake.plan import RunContext
from offsetlake.runs import run_pipeline

TRANSFORM = '''
from pyspark.sql import functions as F


def with_region(rows):
    """Every tenth order's region is 300 characters: no folder can be named after it."""
    long_name = F.repeat(F.lit("r"), 300)
    return rows.withColumn("region", F.when(F.col("order_id") % 10 == 0, long_name).otherwise(F.lit("eu")))


def with_day(rows):
    return rows.withColumn("day", F.to_date("created_at"))
'''

FORMAT = {"type": "json", "schema": {"order_id": "long", "created_at": "timestamp"}, "required": ["order_id"]}


def _produce(bootstrap: str, topic: str, count: int) -> list[bytes]:
    producer = Producer({"bootstrap.servers": bootstrap})
    values = [json.dumps({"order_id": i, "created_at": f"2026-11-{1 + i % 28:02d}T10:00:00Z"}).encode() for i in range(count)]
    for value in values:
        producer.produce(topic, value=value, partition=0)
    assert producer.flush(30) == 0
    return values


def _kept_raw(monkeypatch) -> list[bool]:
    """What every batch decided (``process._may_dead_letter_good_records``)."""
    seen: list[bool] = []
    decide = process._may_dead_letter_good_records

    def spy(*args):
        seen.append(decide(*args))
        return seen[-1]

    monkeypatch.setattr(process, "_may_dead_letter_good_records", spy)
    return seen


@pytest.mark.also_on_s3
def test_a_text_partition_column_a_transform_makes_keeps_the_bytes_of_its_dead_letters(pipeline, spark, monkeypatch):
    (pipeline.folder / "region_transform.py").write_text(TRANSFORM)
    config = pipeline.write(format=FORMAT, transform="region_transform:with_region", sink={"partition_by": ["region"]})
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    values = _produce(pipeline.bootstrap, pipeline.topic, 50)
    kept = _kept_raw(monkeypatch)
    results = run_pipeline(config, RunContext("region"), lambda: spark)
    assert kept and all(kept), "a text partition column after the transform: every batch keeps the records' bytes"
    assert sum(r.total("rows_written") for r in results) == 45
    dead = storage.table(config.layout.dead_letters).to_pyarrow_dataset().to_table(columns=["_kafka_offset", "value", "reason"]).to_pylist()
    assert sorted(d["_kafka_offset"] for d in dead) == list(range(0, 50, 10))
    for letter in dead:
        assert letter["value"] == values[letter["_kafka_offset"]], "a dead letter carries its record's original bytes"
        assert "folder name" in letter["reason"]


def test_a_date_partition_column_a_transform_makes_keeps_no_bytes(pipeline, spark, monkeypatch):
    (pipeline.folder / "region_transform.py").write_text(TRANSFORM)
    config = pipeline.write(format=FORMAT, transform="region_transform:with_day", sink={"partition_by": ["day"]})
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    _produce(pipeline.bootstrap, pipeline.topic, 50)
    kept = _kept_raw(monkeypatch)
    results = run_pipeline(config, RunContext("day"), lambda: spark)
    assert kept and not any(kept), "no value of a date can make a folder name too long: nothing to keep"
    assert sum(r.total("rows_written") for r in results) == 50
    days = storage.table(config.layout.sink).to_pyarrow_dataset().to_table(columns=["day"])["day"].to_pylist()
    assert len(set(days)) == 28
