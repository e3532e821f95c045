"""A Kafka sink's values in Avro, JSON Schema and Protobuf through the Schema Registry
(``sink.format``, ``offsetlake.sink_values``): the schema derived from the output columns is
registered under ``<topic>-value`` (or only looked up, ``register: false``), every row reads back
with confluent-kafka's own deserializers as the row it was, and a schema the registry refuses
fails the batch before its transaction, with nothing produced and the committed ends unmoved."""

from __future__ import annotations

import uuid
from datetime import UTC, date, datetime
from decimal import Decimal
from pathlib import Path

import pyarrow as pa
import pytest
from conftest import Pipeline
from kafka_truth import check_kafka_sink, group_offsets, read_records

from offsetlake.config import PipelineConfig
from offsetlake.embedded.sample_data import ensure_topic, produce_orders
from offsetlake.errors import ConfigError
from offsetlake.plan import BatchStatus, RunContext
from offsetlake.runs import run_pipeline
from offsetlake.sink_values import value_encoder


def _deserializer(fmt: str, client, columns: pa.Schema | None = None, name: str = ""):
    from confluent_kafka.schema_registry.avro import AvroDeserializer
    from confluent_kafka.schema_registry.json_schema import JSONDeserializer
    from confluent_kafka.schema_registry.protobuf import ProtobufDeserializer
    from confluent_kafka.serialization import MessageField, SerializationContext

    ctx = SerializationContext("any", MessageField.VALUE)
    if fmt == "avro":
        avro = AvroDeserializer(client)
        return lambda raw: avro(raw, ctx)
    if fmt == "json_schema":
        js = JSONDeserializer(None, schema_registry_client=client)
        return lambda raw: js(raw, ctx)
    # a consumer of Protobuf values has the message class; here it is built from the registered
    # schema's descriptor (the writer's), so nothing of offsetlake's own class is reused
    from google.protobuf import descriptor_pb2, descriptor_pool, timestamp_pb2
    from google.protobuf.message_factory import GetMessageClass

    # one deserializer per writer schema, as a consumer keeps it (one per record parsed the schema anew for each)
    by_id: dict[int, ProtobufDeserializer] = {}

    def deserializer(schema_id: int) -> ProtobufDeserializer:
        registered = client.get_schema(schema_id, fmt="serialized")
        file = descriptor_pb2.FileDescriptorProto.FromString(__import__("base64").b64decode(registered.schema_str))
        pool = descriptor_pool.DescriptorPool()
        pool.AddSerializedFile(timestamp_pb2.DESCRIPTOR.serialized_pb)
        pool.Add(file)
        message_class = GetMessageClass(pool.FindMessageTypeByName(f"{file.package}.{file.message_type[0].name}"))
        return ProtobufDeserializer(message_class, {"use.deprecated.format": False}, schema_registry_client=client)

    def decode(raw: bytes) -> dict:
        schema_id = int.from_bytes(raw[1:5], "big")
        if schema_id not in by_id:
            by_id[schema_id] = deserializer(schema_id)
        return _as_dict(by_id[schema_id](raw, ctx))

    return decode


def _as_dict(message) -> dict:
    """A decoded message as a consumer reads it: set fields only (an unset optional is absent),
    Timestamps as datetimes, maps as dicts."""
    out = {}
    for field, value in message.ListFields():
        if field.message_type is not None and field.message_type.full_name == "google.protobuf.Timestamp":
            out[field.name] = value.ToDatetime(tzinfo=UTC)
        elif field.message_type is not None and field.message_type.GetOptions().map_entry:
            out[field.name] = dict(value)
        elif field.message_type is not None:
            out[field.name] = [_as_dict(v) for v in value] if field.is_repeated else _as_dict(value)
        else:
            out[field.name] = list(value) if field.is_repeated else value
    return out


@pytest.mark.parametrize("fmt", ["avro", "json_schema", "protobuf"])
def test_each_registry_format_registers_the_output_schema_and_every_row_reads_back(pipeline, spark, schema_registry, fmt):
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    out = f"{pipeline.topic}-{fmt}"
    ensure_topic(pipeline.bootstrap, out, 2)
    sink = {"type": "kafka", "topic": out, "key": ["customer"], "format": fmt, "schema_registry": schema_registry.settings}
    config = pipeline.write(max_records_per_batch=400, sink=sink)
    # two batches (200 a partition, then the rest): the second's schema is the one the first registered
    produce_orders(pipeline.bootstrap, pipeline.topic, 500, malformed_every=37)
    batches = run_pipeline(config, RunContext("first"), lambda: spark)
    assert len(batches) == 2 and all(b.status == BatchStatus.COMMITTED for b in batches)

    client = schema_registry.client()
    registered = client.get_latest_version(f"{out}-value")
    assert registered.schema.schema_type == {"avro": "AVRO", "json_schema": "JSON", "protobuf": "PROTOBUF"}[fmt]
    decode = _deserializer(fmt, client)
    check_kafka_sink(pipeline.bootstrap, pipeline.topic, config, decode=decode)

    # every column reads back as the row it was (amount a double, created_at the same instant)
    for record in read_records(pipeline.bootstrap, out)[:50]:
        value = decode(record.value)
        assert isinstance(value["amount"], float) and value["currency"]
        created = value["created_at"]
        if isinstance(created, str):  # JSON Schema: date-time text; Protobuf (JSON mapping): RFC 3339
            created = datetime.fromisoformat(created.replace("Z", "+00:00"))
        assert created.tzinfo is not None and created.year == 2026


def test_a_schema_the_registry_refuses_fails_the_batch_before_its_transaction(pipeline, spark, schema_registry):
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    out = f"{pipeline.topic}-refused"
    ensure_topic(pipeline.bootstrap, out, 1)
    sink = {"type": "kafka", "topic": out, "key": ["customer"], "format": "avro", "schema_registry": schema_registry.settings}
    config = pipeline.write(sink=sink)
    produce_orders(pipeline.bootstrap, pipeline.topic, 200)
    assert [b.status for b in run_pipeline(config, RunContext("first"), lambda: spark)] == [BatchStatus.COMMITTED]
    before = len(read_records(pipeline.bootstrap, out))

    # the transform turns amount into text: under BACKWARD compatibility the registry refuses it
    (pipeline.folder / "to_text.py").write_text(
        "from pyspark.sql import functions as F\n\ndef transform(df):\n    return df.withColumn('amount', F.col('amount').cast('string'))\n"
    )
    config = pipeline.write(sink=sink, transform="to_text:transform")
    produce_orders(pipeline.bootstrap, pipeline.topic, 100, first_id=200)
    with pytest.raises(ConfigError, match=rf"subject {out}-value") as refused:
        run_pipeline(config, RunContext("second"), lambda: spark)
    assert refused.value.field == "sink.subject" and refused.value.pipeline == config.name
    assert len(read_records(pipeline.bootstrap, out)) == before, "nothing of the refused batch is visible"
    assert group_offsets(pipeline.bootstrap, f"offsetlake-{config.name}", pipeline.topic, [0]) == {0: 200}, "the ends did not move"


@pytest.fixture
def offline(tmp_path: Path) -> Pipeline:
    """A pipeline file for the encoder tests: no broker is asked (the encoders only meet the registry)."""
    suffix = uuid.uuid4().hex[:8]
    folder = tmp_path / "pipelines"
    folder.mkdir()
    return Pipeline(name=f"p_{suffix}", topic=f"t_{suffix}", folder=folder, lake=tmp_path / "lake", bootstrap="127.0.0.1:1")


def _config(pipeline, schema_registry, topic: str, **sink) -> PipelineConfig:
    body = {"type": "kafka", "topic": topic, "schema_registry": schema_registry.settings, **sink}
    return pipeline.write(sink=body)


COLUMNS = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False),
        pa.field("small", pa.int32()),
        pa.field("flag", pa.bool_()),
        pa.field("ratio", pa.float64()),
        pa.field("name", pa.string()),
        pa.field("blob", pa.binary()),
        pa.field("at", pa.timestamp("us", tz="UTC")),
        pa.field("day", pa.date32()),
        pa.field("price", pa.decimal128(10, 2)),
        pa.field("tags", pa.list_(pa.string())),
        pa.field("attrs", pa.map_(pa.string(), pa.int64())),
        pa.field("address", pa.struct([pa.field("city", pa.string()), pa.field("zip", pa.int32())])),
    ]
)
ROW = {
    "id": 7,
    "small": 3,
    "flag": True,
    "ratio": 0.25,
    "name": "ada",
    "blob": b"\x00\x01",
    "at": datetime(2026, 11, 26, 12, 30, 1, 250000, tzinfo=UTC),
    "day": date(2026, 11, 26),
    "price": Decimal("12.50"),
    "tags": ["a", "b"],
    "attrs": [("x", 1), ("y", 2)],
    "address": {"city": "Oslo", "zip": 150},
}
NULLS = {"id": 8, **{name: None for name in COLUMNS.names if name != "id"}}


@pytest.mark.parametrize("fmt", ["avro", "json_schema", "protobuf"])
def test_every_column_type_and_null_round_trips_through_the_registry(offline, schema_registry, fmt):
    pipeline = offline
    topic = f"{pipeline.topic}-types-{fmt}"
    encode = value_encoder(_config(pipeline, schema_registry, topic, format=fmt), COLUMNS)
    decode = _deserializer(fmt, schema_registry.client())
    full, empty = decode(encode(ROW)), decode(encode(NULLS))
    assert full["id"] == 7 and full["name"] == "ada" and full["tags"] == ["a", "b"]
    assert full["address"]["city"] == "Oslo"
    if fmt == "avro":
        assert full == {**ROW, "attrs": {"x": 1, "y": 2}}
        assert empty == NULLS
    elif fmt == "json_schema":
        assert full["at"] == "2026-11-26T12:30:01.250000+00:00" and full["price"] == "12.50" and full["day"] == "2026-11-26"
        assert full["attrs"] == {"x": 1, "y": 2} and full["blob"] == "AAE="
        assert empty == NULLS
    else:  # Timestamp a google.protobuf.Timestamp; dates and decimals their text
        assert full == {**ROW, "attrs": {"x": 1, "y": 2}, "price": "12.50", "day": "2026-11-26"}
        assert empty == {"id": 8}, "a null scalar is an unset optional field"
        zeros = {"id": 9, "small": 0, "flag": False, "ratio": 0.0, "name": ""}
        assert decode(encode({**NULLS, **zeros})) == zeros, "a zero is set, not taken for a null"


def test_register_false_only_looks_the_schema_up(offline, schema_registry):
    pipeline = offline
    topic = f"{pipeline.topic}-lookup"
    checking = _config(pipeline, schema_registry, topic, format="avro", register=False)
    with pytest.raises(ConfigError, match=rf"subject {topic}-value .*sink.register is false") as missing:
        value_encoder(checking, COLUMNS)(ROW)
    assert missing.value.field == "sink.register"
    assert f"{topic}-value" not in schema_registry.client().get_subjects(), "nothing was registered"

    value_encoder(_config(pipeline, schema_registry, topic, format="avro"), COLUMNS)(ROW)  # registered once
    assert value_encoder(checking, COLUMNS)(ROW)[:1] == b"\x00", "now found, the row is written in the wire format"


def test_a_sink_format_that_needs_a_registry_names_the_missing_setting(offline):
    pipeline = offline
    config = pipeline.write(sink={"type": "kafka", "topic": f"{pipeline.topic}-out", "format": "avro"})
    with pytest.raises(ConfigError, match="sink.schema_registry.url") as err:
        value_encoder(config, COLUMNS)
    assert err.value.field == "sink.schema_registry"
    bad = pa.schema([pa.field("the name", pa.string())])
    with pytest.raises(ConfigError, match="'the name' cannot be a field"):
        value_encoder(_config_without_registry_check(pipeline), bad)


def _config_without_registry_check(pipeline) -> PipelineConfig:
    return pipeline.write(
        sink={"type": "kafka", "topic": f"{pipeline.topic}-out", "format": "avro", "schema_registry": {"url": "http://127.0.0.1:1"}}
    )
