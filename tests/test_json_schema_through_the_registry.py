"""JSON Schema topics in the Confluent wire format, read through a Schema Registry (issue 18).

Records are produced with confluent-kafka's own ``JSONSerializer`` against the registry; the
sink is compared with an independent read of the topic (header stripped, JSON parsed).
"""

from __future__ import annotations

import json
from datetime import UTC, date, datetime

import pytest
from confluent_kafka import Producer
from confluent_kafka.schema_registry.json_schema import JSONSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from kafka_truth import assert_exactly_once, ledger_rows, read_topic

from offsetlake import storage
from offsetlake.embedded.sample_data import ensure_topic
from offsetlake.errors import ConfigError
from offsetlake.plan import RunContext
from offsetlake.runs import run_pipeline

V1 = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "title": "Order",
    "type": "object",
    "properties": {
        "order_id": {"type": "integer"},
        "customer": {"type": "string"},
        "amount": {"type": "number"},
        "created_at": {"type": "string", "format": "date-time"},
        "day": {"type": ["string", "null"], "format": "date"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
    "required": ["order_id", "customer"],
}
V2 = {**V1, "properties": {**V1["properties"], "coupon": {"type": ["string", "null"]}}}


def _serializer(registry, schema: dict) -> JSONSerializer:
    return JSONSerializer(json.dumps(schema), registry.client(), conf={"auto.register.schemas": True})


def _produce(bootstrap: str, topic: str, items: list) -> None:
    producer = Producer({"bootstrap.servers": bootstrap})
    context = SerializationContext(topic, MessageField.VALUE)
    for serializer, value in items:
        producer.produce(topic, value=serializer(value, context) if serializer is not None else value, partition=0)
    assert producer.flush(30) == 0


def _order(i: int, **extra: object) -> dict:
    return {
        "order_id": i,
        "customer": f"c{i}",
        "amount": i / 2,
        "created_at": "2026-11-23T10:00:00Z",
        "day": "2026-11-23",
        "tags": ["a"],
        "address": {"city": "Oslo"},
        **extra,
    }


def test_json_schema_versions_interleave_and_bad_records_become_dead_letters(pipeline, spark, schema_registry):
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    v1 = _serializer(schema_registry, V1)
    _produce(pipeline.bootstrap, pipeline.topic, [(v1, _order(i)) for i in range(20)])
    config = pipeline.write(format={"type": "json_schema", "schema_registry": schema_registry.settings})
    [first] = run_pipeline(config, RunContext("v1"), lambda: spark)
    assert first.total("rows_written") == 20

    v2 = _serializer(schema_registry, V2)
    header = v1(_order(0), SerializationContext(pipeline.topic, MessageField.VALUE))[:5]
    items: list = [(v2 if i % 2 else v1, _order(i, coupon="SAVE") if i % 2 else _order(i)) for i in range(20, 40)]
    items += [
        (None, json.dumps(_order(40)).encode()),  # 40: no header
        (None, header + json.dumps({**_order(41), "order_id": "forty-one"}).encode()),  # 41: the writer schema rejects it
        (None, b"\x00" + (2**31 - 9).to_bytes(4, "big") + json.dumps(_order(42)).encode()),  # 42: unknown schema id
        (None, header + b'{"order_id": 43, "customer": '),  # 43: not JSON
        (v1, _order(44)),
    ]
    _produce(pipeline.bootstrap, pipeline.topic, items)
    [second] = run_pipeline(config, RunContext("v2"), lambda: spark)
    assert second.total("rows_written") == 21 and second.total("dead_letters") == 4

    rows = {r["order_id"]: r for r in storage.table(config.layout.sink).to_pyarrow_table().to_pylist()}
    assert rows[21]["coupon"] == "SAVE" and rows[22]["coupon"] is None and rows[3]["coupon"] is None
    assert rows[5]["created_at"] == datetime(2026, 11, 23, 10, tzinfo=UTC) and rows[5]["day"] == date(2026, 11, 23)
    assert rows[5]["tags"] == ["a"] and rows[5]["address"] == {"city": "Oslo"}
    reasons = {d["_kafka_offset"]: d["reason"] for d in storage.table(config.layout.dead_letters).to_pyarrow_table().to_pylist()}
    assert reasons[40].startswith("value does not start with the Confluent wire-format header")
    assert reasons[41].startswith(f"value does not match writer schema id {int.from_bytes(header[1:], 'big')} at order_id:")
    assert reasons[42] == f"schema id {2**31 - 9} is not in the Schema Registry"
    assert reasons[43] == "value does not parse as JSON matching the declared schema"
    dead = next(d for d in storage.table(config.layout.dead_letters).to_pyarrow_table().to_pylist() if d["_kafka_offset"] == 41)
    assert dead["value"][:5] == header, "a dead letter keeps the whole value, header included"
    versions = {json.loads(r["reader_schema"])["version"] for r in ledger_rows(config) if r["status"] == "committed"}
    assert versions == {1, 2}

    def order_id(value: bytes) -> int:
        if value[:1] != b"\x00" or value[1:5] != header[1:] and value[1:5] != v2_id:
            raise ValueError("no header or an unknown id")
        parsed = json.loads(value[5:])
        if not isinstance(parsed["order_id"], int):
            raise ValueError("rejected by its schema")
        return parsed["order_id"]

    v2_id = schema_registry.client().get_version(f"{pipeline.topic}-value", 2).schema_id.to_bytes(4, "big")
    assert_exactly_once(config, read_topic(pipeline.bootstrap, pipeline.topic, order_id=order_id))


def test_a_json_schema_without_one_column_type_is_refused_naming_the_field(pipeline, spark, schema_registry):
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    either = {**V1, "properties": {**V1["properties"], "ref": {"oneOf": [{"type": "string"}, {"type": "integer"}]}}}
    _produce(pipeline.bootstrap, pipeline.topic, [(_serializer(schema_registry, either), {**_order(1), "ref": "x"})])
    config = pipeline.write(format={"type": "json_schema", "schema_registry": schema_registry.settings})
    with pytest.raises(ConfigError, match="field 'ref' uses oneOf, which has no single column type"):
        run_pipeline(config, RunContext("refused"), lambda: spark)
    assert storage.open_table(config.layout.sink) is None
