"""Record keys (``key_format``, issue 18): a string or bytes ``_kafka_key`` column, or a record key
(JSON, Avro, Protobuf through the registry) as named columns; a key that cannot be decoded makes
its record a dead letter whose reason starts with ``key:``."""

from __future__ import annotations

import dataclasses
import json

import pytest
from confluent_kafka import Producer
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.schema_registry.protobuf import ProtobufSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor_pool import DescriptorPool
from google.protobuf.message_factory import GetMessageClass
from kafka_truth import ledger_rows

from offsetlake import storage
from offsetlake.embedded.sample_data import ensure_topic
from offsetlake.errors import ConfigError, SchemaChangeError
from offsetlake.plan import RunContext
from offsetlake.runs import run_pipeline


def _produce(bootstrap: str, topic: str, records: list[tuple[bytes | None, bytes | None]]) -> None:
    producer = Producer({"bootstrap.servers": bootstrap})
    for key, value in records:
        producer.produce(topic, key=key, value=value, partition=0)
    assert producer.flush(30) == 0


def _order(i: int) -> bytes:
    return json.dumps({"order_id": i, "customer": f"c{i}", "amount": 1.5, "currency": "EUR", "created_at": "2026-11-23T10:00:00Z"}).encode()


def _sink(config) -> dict[int, dict]:
    return {r["order_id"]: r for r in storage.table(config.layout.sink).to_pyarrow_table().to_pylist()}


def _dead(config) -> dict[int, str]:
    return {d["_kafka_offset"]: d["reason"] for d in storage.table(config.layout.dead_letters).to_pyarrow_table().to_pylist()}


def _other(pipeline, suffix: str):
    """A second pipeline on the same topic and lake."""
    return dataclasses.replace(pipeline, name=f"{pipeline.name}_{suffix}")


def test_keys_are_text_by_default_or_bytes_and_a_key_that_is_not_utf8_is_a_dead_letter(pipeline, spark):
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    records = [(f"k{i}".encode(), _order(i)) for i in range(10)]
    records += [(None, _order(10)), (b"\xff\x00k", _order(11)), ("clé".encode(), _order(12))]
    _produce(pipeline.bootstrap, pipeline.topic, records)

    config = pipeline.write()  # key_format not set: string
    [batch] = run_pipeline(config, RunContext("text"), lambda: spark)
    assert batch.total("rows_written") == 12 and batch.total("dead_letters") == 1
    rows = _sink(config)
    assert rows[3]["_kafka_key"] == "k3" and rows[10]["_kafka_key"] is None and rows[12]["_kafka_key"] == "clé"
    assert _dead(config) == {11: "key: is not UTF-8 text (byte 0); key_format: bytes keeps keys as they are"}
    assert sorted([*(r["_kafka_offset"] for r in rows.values()), 11]) == list(range(13)), "every record once"

    raw = _other(pipeline, "bytes")
    config = raw.write(key_format="bytes")
    [batch] = run_pipeline(config, RunContext("bytes"), lambda: spark)
    assert batch.total("rows_written") == 13 and batch.total("dead_letters") == 0
    rows = _sink(config)
    assert rows[11]["_kafka_key"] == b"\xff\x00k" and rows[10]["_kafka_key"] is None

    none = _other(pipeline, "none")
    config = none.write(key_format="none")
    run_pipeline(config, RunContext("none"), lambda: spark)
    assert "_kafka_key" not in storage.table(config.layout.sink).schema().to_arrow().names


def test_a_sink_from_before_key_format_keeps_its_shape_until_the_file_asks_for_the_key(pipeline, spark):
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    _produce(pipeline.bootstrap, pipeline.topic, [(f"k{i}".encode(), _order(i)) for i in range(5)])
    config = pipeline.write(key_format="none")
    run_pipeline(config, RunContext("before"), lambda: spark)  # a sink as offsetlake wrote it before key_format

    _produce(pipeline.bootstrap, pipeline.topic, [(b"\xff", _order(5)), *((f"k{i}".encode(), _order(i)) for i in range(6, 10))])
    config = pipeline.write(on_schema_change="fail")  # key_format unset: the sink has no _kafka_key, so none
    [batch] = run_pipeline(config, RunContext("unset"), lambda: spark)
    assert batch.total("rows_written") == 5 and batch.total("dead_letters") == 0, "a binary key is no problem without a key column"
    assert "_kafka_key" not in storage.table(config.layout.sink).schema().to_arrow().names

    _produce(pipeline.bootstrap, pipeline.topic, [(f"k{i}".encode(), _order(i)) for i in range(10, 15)])
    strict = pipeline.write(key_format="string", on_schema_change="fail")
    with pytest.raises(SchemaChangeError, match="new column '_kafka_key'.*key_format: none keeps the sink without it"):
        run_pipeline(strict, RunContext("strict"), lambda: spark)
    version = storage.table(config.layout.sink).version()
    config = pipeline.write(key_format="string")  # evolve: the column comes in the batch's own commit
    [batch] = run_pipeline(config, RunContext("after"), lambda: spark)
    assert batch.total("rows_written") == 5 and batch.sink_version == version + 1
    rows = _sink(config)
    assert rows[2]["_kafka_key"] is None and rows[12]["_kafka_key"] == "k12"
    described = {json.loads(r["reader_schema"]).get("key", {}).get("source") for r in ledger_rows(config) if r["status"] == "committed"}
    assert described == {None, "string"}


def test_an_avro_record_key_becomes_named_columns_through_the_registry(pipeline, spark, schema_registry):
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    key_schema = {
        "type": "record",
        "name": "OrderKey",
        "namespace": "shop",
        "fields": [{"name": "order_id", "type": "long"}, {"name": "region", "type": "string"}],
    }
    serialize = AvroSerializer(schema_registry.client(), json.dumps(key_schema), conf={"auto.register.schemas": True})
    context = SerializationContext(pipeline.topic, MessageField.KEY)
    records = [(serialize({"order_id": i, "region": "eu" if i % 2 else "us"}, context), _order(i)) for i in range(8)]
    records += [(b"plain text key", _order(8)), (None, _order(9))]
    _produce(pipeline.bootstrap, pipeline.topic, records)

    clash = pipeline.write(key_format={"type": "avro", "schema_registry": schema_registry.settings})
    with pytest.raises(ConfigError, match="key column 'order_id' is also a value field .* set key_format.prefix"):
        run_pipeline(clash, RunContext("clash"), lambda: spark)

    config = pipeline.write(
        key_format={"type": "avro", "schema_registry": schema_registry.settings, "prefix": "key_"}, sink={"partition_by": ["key_region"]}
    )
    [batch] = run_pipeline(config, RunContext("avro-key"), lambda: spark)
    assert batch.total("rows_written") == 9 and batch.total("dead_letters") == 1
    rows = _sink(config)
    assert (rows[3]["key_order_id"], rows[3]["key_region"]) == (3, "eu") and rows[4]["key_region"] == "us"
    assert (rows[9]["key_order_id"], rows[9]["key_region"]) == (None, None), "a record without a key"
    assert _dead(config)[8].startswith("key: value does not start with the Confluent wire-format header")
    [entry] = [json.loads(r["reader_schema"]) for r in ledger_rows(config) if r["status"] == "committed"]
    key_id = schema_registry.client().get_version(f"{pipeline.topic}-key", 1).schema_id
    assert entry["key"] == {
        "source": "registry",
        "subject": f"{pipeline.topic}-key",
        "version": 1,
        "id": key_id,
        "fingerprint": entry["key"]["fingerprint"],
    }
    assert sorted(storage.table(config.layout.sink).metadata().partition_columns) == ["key_region"]


def test_json_and_protobuf_record_keys(pipeline, spark, schema_registry):
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    _produce(
        pipeline.bootstrap,
        pipeline.topic,
        [
            (b'{"tenant": "a", "seq": 1}', _order(0)),
            (b'{"tenant": "b"}', _order(1)),
            (b"not json", _order(2)),
            (b'["a", 1]', _order(3)),
            (None, _order(4)),
            (b'{"tenant": "c", "seq": "x"}', _order(5)),
        ],
    )
    config = pipeline.write(key_format={"type": "json", "schema": {"tenant": "string", "seq": "long"}, "prefix": "k_"})
    [batch] = run_pipeline(config, RunContext("json-key"), lambda: spark)
    assert batch.total("rows_written") == 3 and batch.total("dead_letters") == 3
    rows = _sink(config)
    assert (rows[0]["k_tenant"], rows[0]["k_seq"]) == ("a", 1) and (rows[1]["k_tenant"], rows[1]["k_seq"]) == ("b", None)
    assert rows[4]["k_tenant"] is None
    assert set(_dead(config).values()) == {"key: does not parse as a JSON object matching key_format.schema"}
    assert set(_dead(config)) == {2, 3, 5}

    proto = descriptor_pb2.FileDescriptorProto(name="keys.proto", package="keys", syntax="proto3")
    message = proto.message_type.add(name="TenantKey")
    message.field.add(
        name="tenant",
        number=1,
        type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
        label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL,
    )
    pool = DescriptorPool()
    pool.AddSerializedFile(proto.SerializeToString())
    key_class = GetMessageClass(pool.FindMessageTypeByName("keys.TenantKey"))
    topic = f"{pipeline.topic}_pb"
    ensure_topic(pipeline.bootstrap, topic, 1)
    serialize = ProtobufSerializer(
        key_class, schema_registry.client(), conf={"auto.register.schemas": True, "use.deprecated.format": False}
    )
    context = SerializationContext(topic, MessageField.KEY)
    _produce(pipeline.bootstrap, topic, [(serialize(key_class(tenant=f"t{i}"), context), _order(i)) for i in range(4)])
    keyed = _other(pipeline, "pb")
    config = dataclasses.replace(keyed, topic=topic).write(key_format={"type": "protobuf", "schema_registry": schema_registry.settings})
    [batch] = run_pipeline(config, RunContext("pb-key"), lambda: spark)
    assert batch.total("rows_written") == 4
    assert _sink(config)[2]["tenant"] == "t2"
