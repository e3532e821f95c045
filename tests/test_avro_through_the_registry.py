"""Avro topics in the Confluent wire format, read through a Schema Registry (issue 18).

Records are produced with confluent-kafka's own ``AvroSerializer`` against the registry (the
harness's, or a real one with SCHEMA_REGISTRY_URL), and checked against an independent read of
the topic decoded with confluent-kafka's ``AvroDeserializer``.
"""

from __future__ import annotations

import json
from datetime import UTC, date, datetime
from decimal import Decimal

import pyarrow as pa
import pytest
from confluent_kafka import Producer
from confluent_kafka.schema_registry import Schema
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from kafka_truth import assert_exactly_once, ledger_rows, read_topic, wait_until_committed
from s3_tools import S3Proxy

from offsetlake import storage
from offsetlake.embedded.sample_data import ensure_topic
from offsetlake.errors import SchemaChangeError, SchemaRegistryUnavailableError
from offsetlake.plan import RunContext
from offsetlake.runs import run_pipeline

V1 = {
    "type": "record",
    "name": "Order",
    "namespace": "shop",
    "fields": [
        {"name": "order_id", "type": "long"},
        {"name": "customer", "type": "string"},
        {"name": "amount", "type": "double"},
    ],
}
# v2 adds an optional field (BACKWARD compatible: it has a default)
V2 = {**V1, "fields": [*V1["fields"], {"name": "coupon", "type": ["null", "string"], "default": None}]}


def _serializer(registry, schema: dict) -> AvroSerializer:
    return AvroSerializer(registry.client(), json.dumps(schema), conf={"auto.register.schemas": True})


def _produce(bootstrap: str, topic: str, items: list[tuple[AvroSerializer | None, dict | bytes | None]]) -> None:
    producer = Producer({"bootstrap.servers": bootstrap})
    context = SerializationContext(topic, MessageField.VALUE)
    for serializer, value in items:
        payload = serializer(value, context) if serializer is not None else value
        producer.produce(topic, value=payload, partition=0)
    assert producer.flush(30) == 0


def _order_id_reader(registry):
    deserializer = AvroDeserializer(registry.client())

    def order_id(value: bytes) -> int:
        return int(deserializer(value, None)["order_id"])

    return order_id


def _avro(pipeline, registry, **format_options):
    return pipeline.write(format={"type": "avro", "schema_registry": registry.settings, **format_options})


def test_a_new_optional_field_arrives_in_one_commit_with_the_rows_that_carry_it(pipeline, spark, schema_registry):
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    v1, v2 = _serializer(schema_registry, V1), _serializer(schema_registry, V2)
    _produce(pipeline.bootstrap, pipeline.topic, [(v1, {"order_id": i, "customer": f"c{i}", "amount": i / 2}) for i in range(50)])
    config = _avro(pipeline, schema_registry)
    [first] = run_pipeline(config, RunContext("avro-1"), lambda: spark)
    assert first.total("rows_written") == 50
    assert "coupon" not in storage.table(config.layout.sink).schema().to_arrow().names

    # v2 registered mid-stream: old and new producers interleave in the next batch
    items = []
    for i in range(50, 150):
        if i % 2:
            items.append((v2, {"order_id": i, "customer": f"c{i}", "amount": i / 2, "coupon": f"SAVE{i}"}))
        else:
            items.append((v1, {"order_id": i, "customer": f"c{i}", "amount": i / 2}))
    _produce(pipeline.bootstrap, pipeline.topic, items)
    [second] = run_pipeline(config, RunContext("avro-2"), lambda: spark)
    assert second.total("rows_written") == 100 and second.total("dead_letters") == 0

    table = storage.table(config.layout.sink)
    assert table.version() == second.sink_version
    # the column came in the very commit that holds the batch's rows, txns and ledger entry
    log = storage.filesystem(config.layout.sink)
    fs, root = log
    with fs.open_input_stream(f"{root}/_delta_log/{second.sink_version:020d}.json") as handle:
        actions = [json.loads(line) for line in handle.read().decode().splitlines()]
    kinds = {next(iter(a)) for a in actions}
    assert {"metaData", "add", "txn", "commitInfo"} <= kinds
    assert "coupon" in next(a["metaData"]["schemaString"] for a in actions if "metaData" in a)

    rows = {r["order_id"]: r for r in table.to_pyarrow_table().to_pylist()}
    assert rows[7]["coupon"] is None, "a row from before the column reads null"
    assert rows[51]["coupon"] == "SAVE51" and rows[52]["coupon"] is None
    assert_exactly_once(config, read_topic(pipeline.bootstrap, pipeline.topic, order_id=_order_id_reader(schema_registry)))

    # the ledger names the reader schema of each batch: v1 for the first, v2 for the second
    client = schema_registry.client()
    subject = f"{pipeline.topic}-value"
    versions = {r["batch_id"]: json.loads(r["reader_schema"]) for r in ledger_rows(config) if r["status"] == "committed"}
    assert versions[first.plan.batch_id]["version"] == 1
    assert versions[second.plan.batch_id]["version"] == 2
    assert versions[second.plan.batch_id]["id"] == client.get_version(subject, 2).schema_id

    # rerunning the second run (its plan, its recorded reader schema) is a no-op
    rerun = pipeline.cli("run", "--run-id", "avro-2")
    assert rerun.returncode == 0, rerun.stderr
    assert storage.table(config.layout.sink).version() == second.sink_version

    # a rewind to the batch before the column says why the column stays
    from offsetlake.rewind import rewind_pipeline

    rewound = rewind_pipeline(config, first.plan.batch_id, reason="test")
    assert "the columns coupon came after batch" in rewound.text() and "column mapping" in rewound.text()
    after = storage.table(config.layout.sink)
    assert sorted(r["order_id"] for r in after.to_pyarrow_table().to_pylist()) == list(range(50))


ALL_TYPES = {
    "type": "record",
    "name": "Everything",
    "namespace": "types",
    "fields": [
        {"name": "b", "type": "boolean"},
        {"name": "i", "type": "int"},
        {"name": "l", "type": "long"},
        {"name": "f", "type": "float"},
        {"name": "d", "type": "double"},
        {"name": "s", "type": "string"},
        {"name": "raw", "type": "bytes"},
        {"name": "fx", "type": {"type": "fixed", "name": "Four", "size": 4}},
        {"name": "day", "type": {"type": "int", "logicalType": "date"}},
        {"name": "at_ms", "type": {"type": "long", "logicalType": "timestamp-millis"}},
        {"name": "at_us", "type": {"type": "long", "logicalType": "timestamp-micros"}},
        {"name": "price", "type": {"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 3}},
        {
            "name": "fixed_price",
            "type": {"type": "fixed", "name": "Money", "size": 8, "logicalType": "decimal", "precision": 18, "scale": 2},
        },
        {"name": "id", "type": {"type": "string", "logicalType": "uuid"}},
        {"name": "clock_ms", "type": {"type": "int", "logicalType": "time-millis"}},
        {"name": "color", "type": {"type": "enum", "name": "Color", "symbols": ["RED", "GREEN"]}},
        {"name": "maybe", "type": ["null", "long"], "default": None},
        {"name": "tags", "type": {"type": "array", "items": "string"}},
        {"name": "scores", "type": {"type": "map", "values": "double"}},
        {
            "name": "address",
            "type": {
                "type": "record",
                "name": "Address",
                "fields": [{"name": "city", "type": "string"}, {"name": "zip", "type": ["null", "string"], "default": None}],
            },
        },
        {"name": "previous", "type": ["null", "Address"], "default": None},
        {
            "name": "lines",
            "type": {
                "type": "array",
                "items": {"type": "record", "name": "Line", "fields": [{"name": "sku", "type": "string"}, {"name": "qty", "type": "int"}]},
            },
        },
    ],
}


def test_every_avro_type_in_the_mapping_round_trips_to_its_delta_column(pipeline, spark, schema_registry):
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    record = {
        "b": True,
        "i": -7,
        "l": 2**40,
        "f": 1.5,
        "d": -2.25,
        "s": "grüße",
        "raw": b"\x00\xff",
        "fx": b"abcd",
        "day": date(2026, 11, 23),
        "at_ms": datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=UTC),
        "at_us": datetime(1969, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
        "price": Decimal("-12345.678"),
        "fixed_price": Decimal("99.95"),
        "id": "8c4c2a1e-7d6a-4b8e-9c1f-0a5b6c7d8e9f",
        "clock_ms": 3_600_123,
        "color": "GREEN",
        "maybe": None,
        "tags": ["x", "y"],
        "scores": {"a": 1.0, "b": 2.5},
        "address": {"city": "São Paulo", "zip": None},
        "previous": {"city": "Oslo", "zip": "0150"},
        "lines": [{"sku": "A", "qty": 2}, {"sku": "B", "qty": 3}],
    }
    second = {**record, "maybe": 5, "previous": None, "tags": [], "scores": {}, "lines": []}
    serializer = _serializer(schema_registry, ALL_TYPES)
    _produce(pipeline.bootstrap, pipeline.topic, [(serializer, record), (serializer, second)])
    config = _avro(pipeline, schema_registry)
    [result] = run_pipeline(config, RunContext("types"), lambda: spark)
    assert result.total("rows_written") == 2, result.summary()

    table = storage.table(config.layout.sink)
    types = {f.name: f.type for f in pa.schema(table.schema().to_arrow())}
    assert (types["i"], types["l"], types["f"], types["d"]) == (pa.int32(), pa.int64(), pa.float32(), pa.float64())
    assert types["day"] == pa.date32() and types["at_ms"] == pa.timestamp("us", tz="UTC")
    assert types["price"] == pa.decimal128(12, 3) and types["fixed_price"] == pa.decimal128(18, 2)
    assert types["color"] == pa.string() and types["clock_ms"] == pa.int32()
    rows = sorted(table.to_pyarrow_table().to_pylist(), key=lambda r: r["_kafka_offset"])
    got = rows[0]
    for name in (
        "b",
        "i",
        "l",
        "f",
        "d",
        "s",
        "raw",
        "fx",
        "day",
        "price",
        "fixed_price",
        "clock_ms",
        "color",
        "maybe",
        "tags",
        "address",
        "previous",
        "lines",
    ):
        assert got[name] == record[name], name
    assert got["id"] == record["id"]
    assert got["at_ms"] == record["at_ms"] and got["at_us"] == record["at_us"]
    assert dict(got["scores"]) == record["scores"]
    assert rows[1]["maybe"] == 5 and rows[1]["previous"] is None and rows[1]["lines"] == []

    # Spark reads the same values back from the table's files
    frame = spark.read.parquet(*table.file_uris()).orderBy("_kafka_offset").collect()
    assert frame[0]["price"] == Decimal("-12345.678") and frame[0]["address"]["city"] == "São Paulo"
    assert frame[0]["day"] == date(2026, 11, 23)


def test_each_bad_record_kind_becomes_a_dead_letter_with_its_reason(pipeline, spark, schema_registry):
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    good = _serializer(schema_registry, V1)
    _produce(pipeline.bootstrap, pipeline.topic, [(good, {"order_id": 0, "customer": "c", "amount": 1.0})])
    config = _avro(pipeline, schema_registry)  # reader: v1 of the subject, the latest at plan time

    # a schema under another subject whose order_id is a string: it cannot resolve to the reader's long
    other = schema_registry.client().register_schema(
        f"{pipeline.topic}-other", Schema(json.dumps({**V1, "fields": [{"name": "order_id", "type": "string"}]}), "AVRO")
    )
    valid_header = good({"order_id": 9, "customer": "c", "amount": 1.0}, SerializationContext(pipeline.topic, MessageField.VALUE))
    unknown_id = 2**31 - 7
    items: list = [
        (None, b'{"order_id": 1}'),  # 1: no magic byte (JSON)
        (None, b"\x00" + unknown_id.to_bytes(4, "big") + valid_header[5:]),  # 2: a schema id no registry holds
        (None, valid_header[:5] + b"\x02"),  # 3: the header is fine, the payload ends early
        (None, valid_header + b"\x00\x00\x00"),  # 4: ... or leaves bytes over
        (None, b"\x00" + other.to_bytes(4, "big") + b"\x06abc\x02c" + b"\x00" * 8),  # 5: writer does not resolve
        (None, None),  # 6: tombstone
        (good, {"order_id": 7, "customer": "c", "amount": 2.0}),
    ]
    _produce(pipeline.bootstrap, pipeline.topic, items)
    [result] = run_pipeline(config, RunContext("bad"), lambda: spark)
    assert result.total("records_read") == 8 and result.total("rows_written") == 2 and result.total("dead_letters") == 6

    reasons = {d["_kafka_offset"]: d["reason"] for d in storage.table(config.layout.dead_letters).to_pyarrow_table().to_pylist()}
    assert reasons[1].startswith("value does not start with the Confluent wire-format header")
    assert reasons[2] == f"schema id {unknown_id} is not in the Schema Registry"
    good_id = int.from_bytes(valid_header[1:5], "big")
    assert reasons[3] == f"payload ends before the Avro record does (writer schema id {good_id})"
    assert reasons[4] == f"payload has 3 bytes left after the Avro record (writer schema id {good_id})"
    assert reasons[5].startswith(
        f"writer schema id {other} does not resolve to the reader schema (subject {pipeline.topic}-value version 1"
    )
    assert reasons[6] == "tombstone: record has a null value"

    deserializer = AvroDeserializer(schema_registry.client())

    def order_id(value: bytes) -> int:
        if value[1:5] == other.to_bytes(4, "big"):
            raise ValueError("does not resolve to the reader schema")
        if value == valid_header + b"\x00\x00\x00":  # confluent-kafka ignores bytes over; offsetlake does not
            raise ValueError("bytes left after the record")
        return int(deserializer(value, None)["order_id"])

    assert_exactly_once(config, read_topic(pipeline.bootstrap, pipeline.topic, order_id=order_id))


def test_a_type_change_fails_the_batch_naming_field_types_and_schemas(pipeline, spark, schema_registry):
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    subject = f"{pipeline.topic}-value"
    _produce(pipeline.bootstrap, pipeline.topic, [(_serializer(schema_registry, V1), {"order_id": 1, "customer": "c", "amount": 1.0})])
    config = _avro(pipeline, schema_registry)
    [first] = run_pipeline(config, RunContext("before"), lambda: spark)

    client = schema_registry.client()
    from confluent_kafka.schema_registry import ConfigCompatibilityLevel, ServerConfig

    client.set_config(subject_name=subject, config=ServerConfig(compatibility=ConfigCompatibilityLevel.NONE))  # a producer forced it in
    changed = {**V1, "fields": [*V1["fields"][:2], {"name": "amount", "type": "string"}]}
    _produce(
        pipeline.bootstrap, pipeline.topic, [(_serializer(schema_registry, changed), {"order_id": 2, "customer": "c", "amount": "1.5"})]
    )
    with pytest.raises(SchemaChangeError) as failure:
        run_pipeline(config, RunContext("after"), lambda: spark)
    message = str(failure.value)
    v2 = client.get_version(subject, 2)
    assert "column 'amount' as string" in message and "holds it as double" in message
    assert f"subject {subject} version 2 (schema id {v2.schema_id})" in message
    assert f"version 1 (schema id {client.get_version(subject, 1).schema_id})" in message
    assert "a new sink table" in message and "Nothing was committed" in message
    assert storage.table(config.layout.sink).version() == first.sink_version
    assert any(r["status"] == "failed" and r["run_id"] == "after" for r in ledger_rows(config))


def test_on_schema_change_fail_stops_at_the_first_new_field(pipeline, spark, schema_registry):
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    _produce(pipeline.bootstrap, pipeline.topic, [(_serializer(schema_registry, V1), {"order_id": 1, "customer": "c", "amount": 1.0})])
    config = pipeline.write(format={"type": "avro", "schema_registry": schema_registry.settings}, on_schema_change="fail")
    [first] = run_pipeline(config, RunContext("v1"), lambda: spark)
    _produce(
        pipeline.bootstrap,
        pipeline.topic,
        [(_serializer(schema_registry, V2), {"order_id": 2, "customer": "c", "amount": 1.0, "coupon": "X"})],
    )
    with pytest.raises(SchemaChangeError, match=r"new column 'coupon'.*on_schema_change is fail"):
        run_pipeline(config, RunContext("v2"), lambda: spark)
    assert storage.table(config.layout.sink).version() == first.sink_version


def test_a_registry_that_is_down_at_plan_time_or_mid_read_commits_nothing(pipeline, spark, schema_registry):
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    # a schema id no earlier test (or Spark worker cache) has seen: the read tasks must fetch it
    fresh = {**V1, "name": f"Order{pipeline.name}"}
    _produce(
        pipeline.bootstrap,
        pipeline.topic,
        [(_serializer(schema_registry, fresh), {"order_id": i, "customer": "c", "amount": 1.0}) for i in range(20)],
    )
    with S3Proxy(schema_registry.settings["url"]) as proxy:
        config = _avro(pipeline, _Proxied(schema_registry, proxy.endpoint))
        proxy.down = True
        with pytest.raises(SchemaRegistryUnavailableError, match="could not be reached while looking up subject"):
            run_pipeline(config, RunContext("down-at-plan"), lambda: spark)
        assert storage.open_table(config.layout.sink) is None

        # up for the plan, down for the read tasks: the plan's reader schema is fetched by the
        # driver first, the writer schemas by the tasks
        from offsetlake.ledger import Ledger
        from offsetlake.planner import plan_next_batch
        from offsetlake.runs import execute_batch

        proxy.down = False
        plan = plan_next_batch(config, RunContext("down-mid-read"))
        assert plan is not None
        from offsetlake.formats import decoder_for

        decoder_for(config, plan.reader_schema)  # the driver holds the reader schema now
        proxy.down = True
        with pytest.raises(SchemaRegistryUnavailableError, match="fetching schema id"):
            execute_batch(config, plan, Ledger.of(config), lambda: spark)
        assert storage.open_table(config.layout.sink) is None or storage.table(config.layout.sink).version() == 0
        assert storage.open_table(config.layout.dead_letters) is None, "no record became a dead letter for an outage"

        proxy.down = False
        results = run_pipeline(config, RunContext("after-outage"), lambda: spark)
        assert sum(r.total("rows_written") for r in results) == 20
    assert_exactly_once(config, read_topic(pipeline.bootstrap, pipeline.topic, order_id=_order_id_reader(schema_registry)))


class _Proxied:
    """The registry's settings with the URL of a proxy in front of it."""

    def __init__(self, registry, url: str) -> None:
        self.settings = {**registry.settings, "url": url}


def test_a_backfill_of_an_old_range_decodes_its_older_writers_into_the_new_reader_schema(pipeline, spark, schema_registry):
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    _produce(
        pipeline.bootstrap,
        pipeline.topic,
        [(_serializer(schema_registry, V1), {"order_id": i, "customer": "c", "amount": 1.0}) for i in range(30)],
    )
    config = _avro(pipeline, schema_registry)
    run_pipeline(config, RunContext("v1"), lambda: spark)
    _produce(
        pipeline.bootstrap,
        pipeline.topic,
        [(_serializer(schema_registry, V2), {"order_id": i, "customer": "c", "amount": 1.0, "coupon": "N"}) for i in range(30, 40)],
    )
    run_pipeline(config, RunContext("v2"), lambda: spark)

    backfill = pipeline.cli("backfill", "--partitions", "0", "--from-offset", "0", "--to-offset", "30")
    assert backfill.returncode == 0, backfill.stderr[-3000:]
    rows = storage.table(config.layout.sink).to_pyarrow_table().to_pylist()
    assert sorted(r["order_id"] for r in rows) == list(range(40)), "replaced, not duplicated"
    assert all(r["coupon"] is None for r in rows if r["order_id"] < 30)
    [replaced] = [r for r in ledger_rows(config) if r["kind"] == "backfill" and r["status"] == "committed"]
    assert json.loads(replaced["reader_schema"])["version"] == 2, "the backfill read with the subject's latest version"
    assert_exactly_once(config, read_topic(pipeline.bootstrap, pipeline.topic, order_id=_order_id_reader(schema_registry)))


def test_without_a_registry_plain_binary_and_single_object_encodings_read_against_a_local_avsc(pipeline, spark):
    import io

    import fastavro

    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    (pipeline.folder / "orders.avsc").write_text(json.dumps(V1))
    parsed = fastavro.parse_schema(V1)
    crc = bytes.fromhex(fastavro.schema.fingerprint(fastavro.schema.to_parsing_canonical_form(parsed), "CRC-64-AVRO"))

    def encode(order_id: int, header: bytes = b"") -> bytes:
        out = io.BytesIO()
        fastavro.schemaless_writer(out, parsed, {"order_id": order_id, "customer": "c", "amount": 0.5})
        return header + out.getvalue()

    _produce(
        pipeline.bootstrap,
        pipeline.topic,
        [(None, encode(i, b"\xc3\x01" + crc)) for i in range(5)] + [(None, encode(5, b"\xc3\x01" + bytes(8))), (None, encode(6))],
    )
    config = pipeline.write(format={"type": "avro", "schema_file": "orders.avsc", "encoding": "single_object"})
    [result] = run_pipeline(config, RunContext("single-object"), lambda: spark)
    assert result.total("rows_written") == 5 and result.total("dead_letters") == 2
    reasons = sorted(d["reason"] for d in storage.table(config.layout.dead_letters).to_pyarrow_table().to_pylist())
    assert reasons[0].startswith("value does not start with the Avro single-object header")
    assert reasons[1] == f"writer schema fingerprint {bytes(8).hex()} is not the schema file's ({crc.hex()})"

    # plain Avro binary (the schema file's own, no header) on a topic of its own
    topic = f"{pipeline.topic}_plain"
    ensure_topic(pipeline.bootstrap, topic, 1)
    _produce(pipeline.bootstrap, topic, [(None, encode(i)) for i in range(100, 103)])
    plain = pipeline.write(topic=topic, format={"type": "avro", "schema_file": "orders.avsc"}, sink={"table": "plain"})
    [result] = run_pipeline(plain, RunContext("binary"), lambda: spark)
    rows = storage.table(plain.layout.sink).to_pyarrow_table().to_pylist()
    assert sorted(r["order_id"] for r in rows) == [100, 101, 102] and result.total("dead_letters") == 0
    [committed] = [r for r in ledger_rows(plain) if r["status"] == "committed" and r["topic"] == topic]
    assert json.loads(committed["reader_schema"])["source"] == "file"


def test_a_stream_waits_out_a_registry_outage_and_stays_exactly_once(pipeline, schema_registry):
    import signal

    from test_broker_faults import Watched

    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    serializer = _serializer(schema_registry, V1)
    _produce(pipeline.bootstrap, pipeline.topic, [(serializer, {"order_id": i, "customer": "c", "amount": 1.0}) for i in range(200)])
    with S3Proxy(schema_registry.settings["url"]) as proxy:
        config = _avro(pipeline, _Proxied(schema_registry, proxy.endpoint))
        stream = Watched(pipeline.cli_start("stream", "--trigger-interval", "1s"))
        try:
            stream.wait_for("step=commit")
            # a micro-batch with records plans with the subject's latest version: with the registry
            # down, the next plan fails (a caught-up stream does not ask the registry)
            proxy.down = True
            _produce(
                pipeline.bootstrap, pipeline.topic, [(serializer, {"order_id": i, "customer": "c", "amount": 1.0}) for i in range(200, 300)]
            )
            stream.wait_for("step=retry", timeout_s=90)
            assert stream.process.poll() is None, "the stream stopped instead of waiting out the registry"
            proxy.down = False
            truth = read_topic(pipeline.bootstrap, pipeline.topic, order_id=_order_id_reader(schema_registry))
            wait_until_committed(config, truth)
            stream.process.send_signal(signal.SIGTERM)
            assert stream.finish() == 0, stream.stderr()[-3000:]
        finally:
            if stream.process.poll() is None:
                stream.process.kill()
        assert "Schema Registry" in stream.stderr() and "could not be reached" in stream.stderr()
    assert_exactly_once(config, truth)
