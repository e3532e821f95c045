"""Every record Kafka can deliver becomes a row or a dead letter with a reason, never an exception.

Found by an adversarial run against Apache Kafka 3.8 (issue 15, bug 6): three records that Kafka
accepts with default settings blocked a pipeline forever (every run failed with a traceback,
nothing committed, no dead letter): a header key that is not UTF-8 (confluent-kafka's
``Message.headers()`` raises SystemError, and later crashed the read task: headers are read through
librdkafka now, and such a key is no reason to refuse a row), a timestamp at or after year 10000 (OverflowError in
the file statistics), and a timestamp of 2^62 ms (OverflowError building ``_kafka_timestamp``).
A negative timestamp (before 1970, valid) became a null ``_kafka_timestamp``.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

from confluent_kafka import Producer
from raw_records import produce_raw

from offsetlake import storage
from offsetlake.audit import audit_pipeline
from offsetlake.embedded.sample_data import ensure_topic
from offsetlake.plan import RunContext
from offsetlake.runs import run_pipeline

YEAR_10000_MS = 253_402_300_800_000  # 10000-01-01T00:00:00Z
# Records stamped weeks (or decades) ago would be deleted by the broker's time-based retention
# (7 days by default) as soon as it checks: the topic keeps them.
KEEP_OLD_RECORDS = {"retention.ms": "-1"}


def _order(order_id: int) -> bytes:
    return json.dumps(
        {"order_id": order_id, "customer": "c", "amount": 1.0, "currency": "EUR", "created_at": "2026-11-01T00:00:00Z"}
    ).encode()


def test_poison_records_become_dead_letters_and_the_pipeline_moves_on(pipeline, spark):
    config = pipeline.write()
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1, config=KEEP_OLD_RECORDS)
    producer = Producer({"bootstrap.servers": pipeline.bootstrap})
    producer.produce(pipeline.topic, value=_order(0), partition=0)  # offset 0: fine
    assert producer.flush(30) == 0
    produce_raw(pipeline.bootstrap, pipeline.topic, 0, _order(1), [(b"\xff\xfe-not-utf8", b"v"), (b"ok", b"w")])  # 1
    producer.produce(pipeline.topic, value=_order(2), partition=0, timestamp=YEAR_10000_MS + 5_000)  # 2
    producer.produce(pipeline.topic, value=_order(3), partition=0, timestamp=2**62)  # 3
    producer.produce(pipeline.topic, value=_order(4), partition=0, timestamp=-5)  # 4: 1969-12-31T23:59:59.995Z
    producer.produce(pipeline.topic, value=_order(5), partition=0, headers=[("source", b"\xff binary value")])  # 5
    assert producer.flush(30) == 0
    produce_raw(pipeline.bootstrap, pipeline.topic, 0, b"{broken", [(b"\xff\xfe-not-utf8", b"v"), (b"ok", b"w")])  # 6

    [result] = run_pipeline(config, RunContext("poison"), lambda: spark)
    assert result.total("records_read") == 7 and result.total("dead_letters") == 3

    dead = storage.table(config.layout.dead_letters).to_pyarrow_table().to_pylist()
    reasons = {d["_kafka_offset"]: d["reason"] for d in dead}
    assert reasons[2].startswith(f"record timestamp {YEAR_10000_MS + 5_000} ms is outside what the sink's timestamp type")
    assert reasons[3].startswith(f"record timestamp {2**62} ms is outside")
    assert reasons[6] == "value does not parse as JSON matching the declared schema"
    assert set(reasons) == {2, 3, 6}
    assert {d["_kafka_offset"]: d["value"] for d in dead}[2] == _order(2), "a dead letter keeps the record's bytes"
    # header keys are not part of a row, and a dead letter keeps a key that is not UTF-8 with its bytes escaped
    assert {d["_kafka_offset"]: d["headers"] for d in dead}[6] == [
        {"key": "\\xff\\xfe-not-utf8", "value": b"v"},
        {"key": "ok", "value": b"w"},
    ]

    rows = {r["_kafka_offset"]: r for r in storage.table(config.layout.sink).to_pyarrow_table().to_pylist()}
    assert sorted(rows) == [0, 1, 4, 5]
    assert rows[4]["_kafka_timestamp"] == datetime(1970, 1, 1, tzinfo=UTC) - timedelta(milliseconds=5)
    report = audit_pipeline(config, against_kafka=True)
    assert report.ok, report.text()
