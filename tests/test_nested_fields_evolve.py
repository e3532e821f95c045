"""A field added inside a struct evolves the sink like a new column does (issue 35, finding 3).

v1 of a topic's records is ``{order_id, addr: {city}, lines: [{sku}], extras: {k: {a}}}``; v2
adds ``addr.zip``, ``lines.element.qty`` and ``extras.value.b`` (nullable; in the registry
with a default, so compatible). The first batch that carries them commits them in its own
commit (invariant 12), old rows read null there with every reader, and a nested type change
stays refused naming the field's path. Checked against an independent read of the topic.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from confluent_kafka import Producer
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from kafka_truth import assert_exactly_once, keyed_sink_rows, read_records, read_topic, replay_by_key

from offsetlake import storage
from offsetlake.audit import audit_pipeline
from offsetlake.embedded.sample_data import ensure_topic
from offsetlake.errors import SchemaChangeError
from offsetlake.maintenance import maintain
from offsetlake.plan import RunContext
from offsetlake.runs import run_pipeline

V1_YAML = {
    "order_id": "long",
    "addr": "struct<city: string>",
    "lines": "array<struct<sku: string>>",
    "extras": "map<string, struct<a: int>>",
}
V2_YAML = {
    "order_id": "long",
    "addr": "struct<city: string, zip: string>",
    "lines": "array<struct<sku: string, qty: int>>",
    "extras": "map<string, struct<a: int, b: string>>",
}
UPSERT = {"mode": "upsert", "key": ["order_id"]}


def _v1(order_id: int) -> dict:
    return {"order_id": order_id, "addr": {"city": f"c{order_id}"}, "lines": [{"sku": f"s{order_id}"}], "extras": {"k": {"a": order_id}}}


def _v2(order_id: int) -> dict:
    """A v2 record; odd ids carry the new fields, even ids come from producers that still omit them."""
    record = _v1(order_id)
    if order_id % 2:
        record["addr"]["zip"] = f"z{order_id}"
        record["lines"][0]["qty"] = order_id
        record["extras"]["k"]["b"] = f"b{order_id}"
    return record


def _produce_json(bootstrap: str, topic: str, records: list[dict]) -> None:
    producer = Producer({"bootstrap.servers": bootstrap})
    for i, record in enumerate(records):
        producer.produce(topic, value=json.dumps(record).encode(), partition=i % 2)
    assert producer.flush(30) == 0


def _json_pipeline(pipeline, schema: dict, **overrides):
    return pipeline.write(key_format="none", format={"type": "json", "schema": schema, "required": ["order_id"]}, **overrides)


def _sink_rows(config) -> dict[int, dict]:
    """The sink's rows by order id, read by plain delta-rs (one row per id in these tests): the
    rows readers see (an upsert sink also keeps hidden rows, ``kafka_truth.keyed_sink_rows``)."""
    rows = keyed_sink_rows(config.layout.sink)
    by_id = {r["order_id"]: r for r in rows}
    assert len(by_id) == len(rows), "one row per order id"
    return by_id


def _nested(row: dict) -> tuple:
    """The nested values a test compares: (city, zip, [(sku, qty)], {key: (a, b)})."""
    return (
        row["addr"]["city"],
        row["addr"].get("zip"),
        [(x["sku"], x.get("qty")) for x in row["lines"]],
        {k: (v["a"], v.get("b")) for k, v in dict(row["extras"]).items()},
    )


def _expected(i: int, city: str, carried: bool) -> tuple:
    """What ``_nested`` reads for order ``i``: the new fields' values, or null where a row has none."""
    return (city, f"z{i}" if carried else None, [(f"s{i}", i if carried else None)], {"k": (i, f"b{i}" if carried else None)})


def _commit_actions(config, version: int) -> list[dict]:
    fs, root = storage.filesystem(config.layout.sink)
    with fs.open_input_stream(f"{root}/_delta_log/{version:020d}.json") as handle:
        return [json.loads(line) for line in handle.read().decode().splitlines()]


def _assert_nested_fields_in_schema(config) -> None:
    types = {f.name: f.type for f in pa.schema(storage.table(config.layout.sink).schema().to_arrow())}
    assert [f.name for f in types["addr"]] == ["city", "zip"]
    assert [f.name for f in types["lines"].value_type] == ["sku", "qty"]
    assert [f.name for f in types["extras"].item_type] == ["a", "b"]


@pytest.mark.parametrize("sink", [{}, UPSERT], ids=["append", "upsert"])
def test_a_field_added_inside_a_yaml_struct_reaches_the_sink_in_the_commit_of_its_first_batch(pipeline, spark, sink):
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    _produce_json(pipeline.bootstrap, pipeline.topic, [_v1(i) for i in range(40)])
    config = _json_pipeline(pipeline, V1_YAML, sink=sink or {"mode": "append"})
    [first] = run_pipeline(config, RunContext("nested-v1"), lambda: spark)
    assert first.total("rows_written") == 40

    # the YAML's structs gain fields; upserts also update every old key, so the merge rewrites old files
    config = _json_pipeline(pipeline, V2_YAML, sink=sink or {"mode": "append"})
    updates = [{**_v2(i), "addr": {**_v2(i)["addr"], "city": f"moved{i}"}} for i in range(0, 40, 3)] if sink else []
    _produce_json(pipeline.bootstrap, pipeline.topic, [*[_v2(i) for i in range(40, 80)], *updates])
    run = pipeline.cli("run", "--run-id", "nested-v2")
    assert run.returncode == 0, run.stderr[-3000:]
    table = storage.table(config.layout.sink)
    _assert_nested_fields_in_schema(config)
    # the fields came in the commit that holds the batch's rows and txns; a merge that rewrites files
    # (removes) takes them in a metadata-only commit just before (delta-rs: no schema change with removes)
    actions = _commit_actions(config, table.version())
    kinds = {next(iter(a)) for a in actions}
    assert {"add", "txn", "commitInfo"} <= kinds
    if sink:
        assert "remove" in kinds and table.version() == first.sink_version + 2
        actions = _commit_actions(config, table.version() - 1)
        assert {next(iter(a)) for a in actions} == {"metaData", "commitInfo"}
    else:
        assert "metaData" in kinds and table.version() == first.sink_version + 1
    schema_string = next(a["metaData"]["schemaString"] for a in actions if "metaData" in a)
    assert '"zip"' in schema_string and '"qty"' in schema_string and '"b"' in schema_string

    rows = _sink_rows(config)
    for i in range(80):
        moved = bool(sink) and i < 40 and i % 3 == 0
        carried = (i >= 40 or moved) and i % 2 == 1  # decoded with v2 from a record that has the new fields
        assert _nested(rows[i]) == _expected(i, city=f"moved{i}" if moved else f"c{i}", carried=carried), i

    # Spark reads the old files with the new fields as null too
    frame = {r["order_id"]: r for r in spark.read.schema(_spark_schema(spark, config)).parquet(*table.file_uris()).collect()}
    assert frame[1]["addr"]["zip"] is None and frame[41]["addr"]["zip"] == "z41"
    assert frame[1]["lines"][0]["qty"] is None and frame[41]["extras"]["k"]["b"] == "b41"

    # the fields leave the YAML again: they stay in the sink, and new rows read null there
    config = _json_pipeline(pipeline, V1_YAML, sink=sink or {"mode": "append"})
    again = [_v2(i) for i in range(80, 90)] + ([_v2(41)] if sink else [])
    _produce_json(pipeline.bootstrap, pipeline.topic, again)
    [third] = run_pipeline(config, RunContext("nested-v1-again"), lambda: spark)
    assert third.total("dead_letters") == 0
    _assert_nested_fields_in_schema(config)
    rows = _sink_rows(config)
    assert _nested(rows[81]) == _expected(81, "c81", carried=False)
    if sink:
        assert _nested(rows[41]) == _expected(41, "c41", carried=False), "the newest record wins, read with v1"
        assert _nested(rows[43])[1] == "z43", "a key the batch did not touch keeps its value"

    # compaction reads the old and new files together
    maintain(config, retention_hours=1, vacuum=False)
    assert _sink_rows(config) == rows

    if sink:
        records = read_records(pipeline.bootstrap, pipeline.topic)
        expected = replay_by_key(records, lambda r: json.loads(r.value)["order_id"], lambda r: json.loads(r.value))
        assert set(rows) == set(expected)
    else:
        assert_exactly_once(config, read_topic(pipeline.bootstrap, pipeline.topic))
    report = audit_pipeline(config, against_kafka=True)
    assert report.ok, report.text()


def _spark_schema(spark, config):
    from pyspark.sql.pandas.types import from_arrow_schema

    return from_arrow_schema(pa.schema(storage.table(config.layout.sink).schema().to_arrow()))


_LINE_V1 = {"type": "record", "name": "Line", "fields": [{"name": "sku", "type": "string"}]}
_EXTRA_V1 = {"type": "record", "name": "Extra", "fields": [{"name": "a", "type": "int"}]}
AVRO_V1 = {
    "type": "record",
    "name": "Order",
    "namespace": "shop",
    "fields": [
        {"name": "order_id", "type": "long"},
        {"name": "addr", "type": {"type": "record", "name": "Address", "fields": [{"name": "city", "type": "string"}]}},
        {"name": "lines", "type": {"type": "array", "items": _LINE_V1}},
        {"name": "extras", "type": {"type": "map", "values": _EXTRA_V1}},
    ],
}
# v2 adds a nullable field with a default inside each: BACKWARD compatible, the registry takes it
AVRO_V2 = {
    **AVRO_V1,
    "fields": [
        AVRO_V1["fields"][0],
        {
            "name": "addr",
            "type": {
                "type": "record",
                "name": "Address",
                "fields": [{"name": "city", "type": "string"}, {"name": "zip", "type": ["null", "string"], "default": None}],
            },
        },
        {
            "name": "lines",
            "type": {
                "type": "array",
                "items": {**_LINE_V1, "fields": [*_LINE_V1["fields"], {"name": "qty", "type": ["null", "int"], "default": None}]},
            },
        },
        {
            "name": "extras",
            "type": {
                "type": "map",
                "values": {**_EXTRA_V1, "fields": [*_EXTRA_V1["fields"], {"name": "b", "type": ["null", "string"], "default": None}]},
            },
        },
    ],
}


def _avro_v2_record(order_id: int, city: str | None = None) -> dict:
    """A v2 record; odd ids fill the new fields, even ids leave them at their default (null)."""
    carried = order_id % 2 == 1
    return {
        "order_id": order_id,
        "addr": {"city": city or f"c{order_id}", "zip": f"z{order_id}" if carried else None},
        "lines": [{"sku": f"s{order_id}", "qty": order_id if carried else None}],
        "extras": {"k": {"a": order_id, "b": f"b{order_id}" if carried else None}},
    }


@pytest.mark.parametrize("sink", [{}, UPSERT], ids=["append", "upsert"])
def test_a_registry_version_that_adds_a_nested_field_with_a_default_reaches_the_sink(pipeline, spark, schema_registry, sink):
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    client = schema_registry.client()
    v1 = AvroSerializer(client, json.dumps(AVRO_V1), conf={"auto.register.schemas": True})
    v2 = AvroSerializer(client, json.dumps(AVRO_V2), conf={"auto.register.schemas": True})
    context = SerializationContext(pipeline.topic, MessageField.VALUE)
    producer = Producer({"bootstrap.servers": pipeline.bootstrap})
    for i in range(40):
        producer.produce(pipeline.topic, value=v1(_v1(i), context), partition=0)
    assert producer.flush(30) == 0
    config = pipeline.write(
        key_format="none", sink=sink or {"mode": "append"}, format={"type": "avro", "schema_registry": schema_registry.settings}
    )
    [first] = run_pipeline(config, RunContext("avro-nested-v1"), lambda: spark)
    assert first.total("rows_written") == 40

    # v2 registered mid-stream; old producers go on with v1; upserts also move some old keys
    for i in range(40, 80):
        producer.produce(pipeline.topic, value=(v2(_avro_v2_record(i), context) if i % 2 else v1(_v1(i), context)), partition=0)
    for i in range(0, 40, 3) if sink else ():
        producer.produce(pipeline.topic, value=v2(_avro_v2_record(i, city=f"moved{i}"), context), partition=0)
    assert producer.flush(30) == 0
    [second] = run_pipeline(config, RunContext("avro-nested-v2"), lambda: spark)
    assert second.total("dead_letters") == 0
    _assert_nested_fields_in_schema(config)
    subject = f"{pipeline.topic}-value"
    assert second.plan.reader_schema is not None and second.plan.reader_schema.version == 2, subject

    rows = _sink_rows(config)
    for i in range(80):
        moved = bool(sink) and i < 40 and i % 3 == 0
        carried = (i >= 40 or moved) and i % 2 == 1
        assert _nested(rows[i]) == _expected(i, city=f"moved{i}" if moved else f"c{i}", carried=carried), i

    deserializer = AvroDeserializer(client)
    if sink:
        records = read_records(pipeline.bootstrap, pipeline.topic)
        expected = replay_by_key(records, lambda r: deserializer(r.value, None)["order_id"], lambda r: deserializer(r.value, None))
        assert set(rows) == set(expected)
    else:
        assert_exactly_once(
            config, read_topic(pipeline.bootstrap, pipeline.topic, order_id=lambda value: int(deserializer(value, None)["order_id"]))
        )
    report = audit_pipeline(config, against_kafka=True)
    assert report.ok, report.text()


def test_a_nested_type_change_is_refused_naming_the_field_path_both_types_and_the_ways_forward(pipeline, spark):
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    _produce_json(pipeline.bootstrap, pipeline.topic, [_v1(i) for i in range(10)])
    config = _json_pipeline(pipeline, V1_YAML)
    [first] = run_pipeline(config, RunContext("nested-types-v1"), lambda: spark)
    _produce_json(pipeline.bootstrap, pipeline.topic, [{**_v1(i), "addr": {"city": i}} for i in range(10, 14)])

    config = _json_pipeline(pipeline, {**V1_YAML, "addr": "struct<city: long>"})
    run = pipeline.cli("run")
    assert run.returncode == 2, run.stderr[-2000:]
    assert "nested field 'addr.city' as int64, but the sink" in run.stderr and "holds it as string" in run.stderr
    assert "Nothing was committed" in run.stderr and "a new sink table (sink.table)" in run.stderr
    assert "transform that casts the nested field back to the sink's type" in run.stderr
    for changed, path, old, new in (("lines", "lines.element.sku", "string", "int64"), ("extras", "extras.value.a", "int32", "string")):
        types = {"lines": "array<struct<sku: long>>", "extras": "map<string, struct<a: string>>"}
        config = _json_pipeline(pipeline, {**V1_YAML, changed: types[changed]})
        with pytest.raises(SchemaChangeError, match=rf"nested field '{path}' as {new}, but the sink .* holds it as {old}"):
            run_pipeline(config, RunContext(f"nested-types-{changed}"), lambda: spark)

    # under on_schema_change: fail, a new nested field stops the batch like a new column, by its path
    config = _json_pipeline(pipeline, V2_YAML, on_schema_change="fail")
    with pytest.raises(
        SchemaChangeError,
        match=r"new nested fields 'addr.zip', 'lines.element.qty', 'extras.value.b'\)"
        r".*on_schema_change is fail",
    ):
        run_pipeline(config, RunContext("nested-fail"), lambda: spark)
    assert storage.table(config.layout.sink).version() == first.sink_version, "nothing committed"
