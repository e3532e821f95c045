"""Protobuf topics in the Confluent wire format, read through a Schema Registry (issue 18).

No protoc here: the message types are built as ``FileDescriptorProto``s, and records are produced
with confluent-kafka's own ``ProtobufSerializer`` (which registers the schema and writes the
message indexes). The sink is compared with an independent read of the topic: the header taken
apart by hand, the payload parsed with the newest message class.
"""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime
from decimal import Decimal

import pytest
from confluent_kafka import Producer
from confluent_kafka.schema_registry import Schema
from confluent_kafka.schema_registry.protobuf import ProtobufSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from google.protobuf import descriptor_pb2, timestamp_pb2, wrappers_pb2
from google.protobuf.descriptor_pool import DescriptorPool
from google.protobuf.message_factory import GetMessageClass
from kafka_truth import assert_exactly_once, ledger_rows, read_topic

from offsetlake import storage
from offsetlake.embedded.sample_data import ensure_topic
from offsetlake.errors import ConfigError
from offsetlake.plan import RunContext
from offsetlake.runs import run_pipeline

F = descriptor_pb2.FieldDescriptorProto


def _file(version: int, *, amount_type: int = F.TYPE_DOUBLE, recursive: bool = False) -> descriptor_pb2.FileDescriptorProto:
    """shop/orders.proto: Order (every type of the README's table), Other; v2 adds ``coupon``."""
    fd = descriptor_pb2.FileDescriptorProto(
        name="shop/orders.proto",
        package="shop",
        syntax="proto3",
        dependency=["google/protobuf/timestamp.proto", "google/protobuf/wrappers.proto"],
    )
    status = fd.enum_type.add(name="Status")
    status.value.add(name="NEW", number=0)
    status.value.add(name="PAID", number=1)
    order = fd.message_type.add(name="Order")

    def field(message, name: str, number: int, kind: int, type_name: str = "", repeated: bool = False, oneof: int | None = None):
        f = message.field.add(name=name, number=number, type=kind, label=F.LABEL_REPEATED if repeated else F.LABEL_OPTIONAL)
        if type_name:
            f.type_name = type_name
        if oneof is not None:
            f.oneof_index = oneof
        return f

    field(order, "order_id", 1, F.TYPE_INT64)
    field(order, "customer", 2, F.TYPE_STRING)
    field(order, "amount", 3, amount_type)
    field(order, "created_at", 4, F.TYPE_MESSAGE, ".google.protobuf.Timestamp")
    field(order, "status", 5, F.TYPE_ENUM, ".shop.Status")
    field(order, "tags", 6, F.TYPE_STRING, repeated=True)
    address = order.nested_type.add(name="Address")
    field(address, "city", 1, F.TYPE_STRING)
    field(address, "zip", 2, F.TYPE_MESSAGE, ".google.protobuf.Int32Value")
    field(order, "address", 7, F.TYPE_MESSAGE, ".shop.Order.Address")
    entry = order.nested_type.add(name="AttributesEntry")
    entry.options.map_entry = True
    field(entry, "key", 1, F.TYPE_STRING)
    field(entry, "value", 2, F.TYPE_INT64)
    field(order, "attributes", 8, F.TYPE_MESSAGE, ".shop.Order.AttributesEntry", repeated=True)
    field(order, "note", 9, F.TYPE_MESSAGE, ".google.protobuf.StringValue")
    order.oneof_decl.add(name="payment")
    field(order, "card", 10, F.TYPE_STRING, oneof=0)
    field(order, "iban", 11, F.TYPE_STRING, oneof=0)
    field(order, "quantity", 12, F.TYPE_UINT32)
    field(order, "big", 13, F.TYPE_UINT64)
    field(order, "ratio", 14, F.TYPE_FLOAT)
    field(order, "flag", 15, F.TYPE_BOOL)
    field(order, "blob", 16, F.TYPE_BYTES)
    field(order, "delta", 17, F.TYPE_SINT32)
    item = order.nested_type.add(name="Item")
    field(item, "sku", 1, F.TYPE_STRING)
    field(item, "qty", 2, F.TYPE_INT32)
    if recursive:
        field(item, "parts", 3, F.TYPE_MESSAGE, ".shop.Order.Item", repeated=True)
    field(order, "items", 18, F.TYPE_MESSAGE, ".shop.Order.Item", repeated=True)
    if version >= 2:
        field(order, "coupon", 19, F.TYPE_STRING)
    other = fd.message_type.add(name="Other")
    field(other, "order_id", 1, F.TYPE_INT64)
    return fd


def _classes(fd: descriptor_pb2.FileDescriptorProto) -> tuple[type, type]:
    pool = DescriptorPool()
    for module in (timestamp_pb2, wrappers_pb2):
        pool.AddSerializedFile(module.DESCRIPTOR.serialized_pb)
    pool.AddSerializedFile(fd.SerializeToString())
    return GetMessageClass(pool.FindMessageTypeByName("shop.Order")), GetMessageClass(pool.FindMessageTypeByName("shop.Other"))


def _serializer(registry, message_class: type) -> ProtobufSerializer:
    return ProtobufSerializer(message_class, registry.client(), conf={"auto.register.schemas": True, "use.deprecated.format": False})


def _produce(bootstrap: str, topic: str, items: list) -> None:
    producer = Producer({"bootstrap.servers": bootstrap})
    context = SerializationContext(topic, MessageField.VALUE)
    for serializer, value in items:
        producer.produce(topic, value=serializer(value, context) if serializer is not None else value, partition=0)
    assert producer.flush(30) == 0


def _order(cls: type, i: int, **extra: object):
    order = cls(
        order_id=i,
        customer=f"c{i}",
        amount=i / 4,
        status=i % 2,
        tags=["a", f"t{i}"],
        quantity=4_000_000_000,
        big=2**64 - 1 - i,
        ratio=0.5,
        flag=bool(i % 2),
        blob=bytes([i % 256, 0]),
        delta=-i,
        **extra,
    )
    order.created_at.FromDatetime(datetime(2026, 11, 23, 10, 0, i % 60, 123456, tzinfo=UTC))
    order.address.city = "Oslo"
    if i % 3 == 0:
        order.address.zip.value = 150 + i
        order.note.value = f"note {i}"
        order.card = f"4111-{i}"
    elif i % 3 == 1:
        order.iban = f"NO93-{i}"
    order.attributes["size"] = i
    order.attributes["weight"] = -i
    order.items.add(sku=f"sku{i}", qty=i)
    return order


def test_protobuf_versions_interleave_types_round_trip_and_bad_records_become_dead_letters(pipeline, spark, schema_registry):
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    order1, other1 = _classes(_file(1))
    order2, _ = _classes(_file(2))
    v1, v2, other = _serializer(schema_registry, order1), _serializer(schema_registry, order2), _serializer(schema_registry, other1)
    _produce(pipeline.bootstrap, pipeline.topic, [(v1, _order(order1, i)) for i in range(12)])
    config = pipeline.write(format={"type": "protobuf", "schema_registry": schema_registry.settings})
    [first] = run_pipeline(config, RunContext("v1"), lambda: spark)
    assert first.total("rows_written") == 12 and first.total("dead_letters") == 0

    client = schema_registry.client()
    subject = f"{pipeline.topic}-value"
    v1_id = client.get_version(subject, 1).schema_id
    header = b"\x00" + v1_id.to_bytes(4, "big") + b"\x00"
    # a schema the topic's subject never had: "amount" is a string there
    stray_id = client.register_schema(
        f"{pipeline.topic}-stray", Schema(base64.b64encode(_file(2, amount_type=F.TYPE_STRING).SerializeToString()).decode(), "PROTOBUF")
    )
    stray_order, _ = _classes(_file(2, amount_type=F.TYPE_STRING))
    avro_id = client.register_schema(f"{pipeline.topic}-avro", Schema('{"type": "string"}', "AVRO"))
    far_future = order1(order_id=48)
    far_future.created_at.seconds = 10**15
    items: list = [(v2 if i % 2 else v1, _order(order2, i, coupon="SAVE") if i % 2 else _order(order1, i)) for i in range(12, 40)]
    items += [
        (None, _order(order1, 40).SerializeToString()),  # 40: no header
        (None, b"\x00" + (2**31 - 9).to_bytes(4, "big") + b"\x00" + _order(order1, 41).SerializeToString()),  # 41: unknown id
        (None, b"\x00" + v1_id.to_bytes(4, "big") + b"\x04"),  # 42: two indexes announced, none there
        (None, header + b"\x0a\xff\x01"),  # 43: a string field longer than the payload
        (other, other1(order_id=44)),  # 44: another message of the same file
        (None, b"\x00" + stray_id.to_bytes(4, "big") + b"\x00" + stray_order(order_id=45, amount="1.5").SerializeToString()),  # 45
        (None, b"\x00" + avro_id.to_bytes(4, "big") + b"\x00\x02x"),  # 46: an Avro schema's id
        (None, b"\x00" + v1_id.to_bytes(4, "big") + b"\x02\x06" + _order(order1, 47).SerializeToString()),  # 47: index [3]
        (v1, far_future),  # 48: a Timestamp microseconds cannot hold
        (None, None),  # 49: tombstone
        (v1, _order(order1, 50)),
    ]
    _produce(pipeline.bootstrap, pipeline.topic, items)
    [second] = run_pipeline(config, RunContext("v2"), lambda: spark)
    assert second.total("rows_written") == 29 and second.total("dead_letters") == 10

    rows = {r["order_id"]: r for r in storage.table(config.layout.sink).to_pyarrow_table().to_pylist()}
    assert rows[13]["coupon"] == "SAVE" and rows[14]["coupon"] is None and rows[3]["coupon"] is None
    # every type of the mapping table, as produced
    r = rows[15]
    assert (r["customer"], r["amount"], r["status"], r["tags"]) == ("c15", 3.75, "PAID", ["a", "t15"])
    assert r["created_at"] == datetime(2026, 11, 23, 10, 0, 15, 123456, tzinfo=UTC)
    assert r["address"] == {"city": "Oslo", "zip": 165}, "a nested message; a wrapper reads its value"
    assert dict(r["attributes"]) == {"size": 15, "weight": -15}
    assert (r["note"], r["card"], r["iban"]) == ("note 15", "4111-15", None), "oneof: the member set, the other null"
    assert (r["quantity"], r["big"], r["ratio"], r["flag"], r["blob"], r["delta"]) == (
        4_000_000_000,
        Decimal(2**64 - 16),
        0.5,
        True,
        bytes([15, 0]),
        -15,
    )
    assert r["items"] == [{"sku": "sku15", "qty": 15}]
    assert rows[16]["address"] == {"city": "Oslo", "zip": None} and rows[16]["note"] is None, "unset wrappers are null"
    assert (rows[16]["card"], rows[16]["iban"]) == (None, "NO93-16")
    assert (rows[0]["status"], rows[0]["delta"], rows[0]["flag"]) == ("NEW", 0, False), "proto3 fields without presence read their default"
    assert rows[11]["coupon"] is None, "a row written before the column existed"

    reasons = {d["_kafka_offset"]: d["reason"] for d in storage.table(config.layout.dead_letters).to_pyarrow_table().to_pylist()}
    assert reasons[40].startswith("value does not start with the Confluent wire-format header")
    assert reasons[41] == f"schema id {2**31 - 9} is not in the Schema Registry"
    assert reasons[42] == f"the message indexes after schema id {v1_id} are cut short or malformed"
    assert reasons[43].startswith(f"payload does not parse as Protobuf message shop.Order with writer schema id {v1_id}")
    assert reasons[44] == f"writer schema id {v1_id} message shop.Other is not the reader's message shop.Order"
    assert (
        reasons[45].startswith(f"writer schema id {stray_id} does not resolve to the reader schema")
        and "field 'amount' is string in the writer and double in the reader" in reasons[45]
    )
    assert reasons[46] == f"schema id {avro_id} is a AVRO schema, not Protobuf"
    assert reasons[47] == f"message indexes [3] name no message in writer schema id {v1_id}"
    assert reasons[48].startswith("a value does not fit its sink column type")
    assert reasons[49] == "tombstone: record has a null value"
    versions = {json.loads(r["reader_schema"])["version"] for r in ledger_rows(config) if r["status"] == "committed"}
    assert versions == {1, 2}

    v2_id = client.get_version(subject, 2).schema_id

    def order_id(value: bytes) -> int:
        if value[:1] != b"\x00" or int.from_bytes(value[1:5], "big") not in (v1_id, v2_id) or value[5:6] != b"\x00":
            raise ValueError("no header, another schema, or another message")
        order = order2.FromString(value[6:])
        if order.created_at.seconds > 10**11:
            raise ValueError("a timestamp past the column type")
        return order.order_id

    assert_exactly_once(config, read_topic(pipeline.bootstrap, pipeline.topic, order_id=order_id))
    version = storage.table(config.layout.sink).version()
    assert run_pipeline(config, RunContext("v2"), lambda: spark) == [], "a rerun of a committed run is a no-op"
    assert storage.table(config.layout.sink).version() == version


def test_a_recursive_protobuf_message_or_an_unknown_reader_message_is_refused(pipeline, spark, schema_registry):
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    order, _ = _classes(_file(1, recursive=True))
    _produce(pipeline.bootstrap, pipeline.topic, [(_serializer(schema_registry, order), _order(order, 1))])
    config = pipeline.write(format={"type": "protobuf", "schema_registry": schema_registry.settings})
    with pytest.raises(ConfigError, match=r"field 'items\[\]\.parts\[\]' is a shop\.Order\.Item, which contains itself"):
        run_pipeline(config, RunContext("recursive"), lambda: spark)
    config = pipeline.write(format={"type": "protobuf", "schema_registry": schema_registry.settings, "message": "shop.Nope"})
    with pytest.raises(ConfigError, match=r"format.message shop.Nope is not a message of it \(it has: shop.Order, shop.Other"):
        run_pipeline(config, RunContext("unknown"), lambda: spark)
    assert storage.open_table(config.layout.sink) is None


def test_protobuf_imports_through_registry_references_and_json_valued_types(pipeline, spark, schema_registry):
    """A message from an imported file (registered by the serializer as a reference) and a
    ``google.protobuf.Struct`` field land as a struct and as JSON text."""
    from google.protobuf import struct_pb2

    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    common = descriptor_pb2.FileDescriptorProto(name="shop/common.proto", package="shop.common", syntax="proto3")
    money = common.message_type.add(name="Money")
    money.field.add(name="currency", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    money.field.add(name="units", number=2, type=F.TYPE_INT64, label=F.LABEL_OPTIONAL)
    sale = descriptor_pb2.FileDescriptorProto(
        name="shop/sale.proto", package="shop", syntax="proto3", dependency=["shop/common.proto", "google/protobuf/struct.proto"]
    )
    message = sale.message_type.add(name="Sale")
    message.field.add(name="order_id", number=1, type=F.TYPE_INT64, label=F.LABEL_OPTIONAL)
    message.field.add(name="price", number=2, type=F.TYPE_MESSAGE, type_name=".shop.common.Money", label=F.LABEL_OPTIONAL)
    message.field.add(name="extra", number=3, type=F.TYPE_MESSAGE, type_name=".google.protobuf.Struct", label=F.LABEL_OPTIONAL)
    pool = DescriptorPool()
    pool.AddSerializedFile(struct_pb2.DESCRIPTOR.serialized_pb)
    pool.AddSerializedFile(common.SerializeToString())
    pool.AddSerializedFile(sale.SerializeToString())
    sale_class = GetMessageClass(pool.FindMessageTypeByName("shop.Sale"))
    sales = []
    for i in range(5):
        item = sale_class(order_id=i)
        item.price.currency, item.price.units = "NOK", 100 * i
        item.extra.update({"channel": "web", "rank": i})
        sales.append(item)
    _produce(pipeline.bootstrap, pipeline.topic, [(_serializer(schema_registry, sale_class), s) for s in sales])
    client = schema_registry.client()
    assert [r.subject for r in client.get_version(f"{pipeline.topic}-value", 1).schema.references] == ["shop/common.proto"]

    config = pipeline.write(format={"type": "protobuf", "schema_registry": schema_registry.settings, "message": "shop.Sale"})
    [batch] = run_pipeline(config, RunContext("refs"), lambda: spark)
    assert batch.total("rows_written") == 5 and batch.total("dead_letters") == 0
    rows = {r["order_id"]: r for r in storage.table(config.layout.sink).to_pyarrow_table().to_pylist()}
    assert rows[3]["price"] == {"currency": "NOK", "units": 300}
    assert json.loads(rows[3]["extra"]) == {"channel": "web", "rank": 3.0}
