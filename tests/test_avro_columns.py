"""The columnar Avro decoder (``offsetlake.formats.avro_columns``) gives fastavro's answers.

Random records of a schema with every shape it takes, written by fastavro, some of them damaged
(cut, extended, bytes flipped): each record the columnar path says it decoded must be one
fastavro decodes to the same values with no bytes left; each undamaged record must take the
columnar path (else it would be no faster). Records it flags go to fastavro in the product, which
names their dead-letter reason.
"""

from __future__ import annotations

import io
import json
import math

import fastavro
from hypothesis import given, settings
from hypothesis import strategies as st

from offsetlake.formats.avro_columns import ColumnReader
from offsetlake.formats.avro_records import ArrowTypes, strip_logical_types

WRITER = {
    "type": "record",
    "name": "Order",
    "namespace": "shop",
    "fields": [
        {"name": "order_id", "type": "long"},
        {"name": "qty", "type": "int"},
        {"name": "paid", "type": "boolean"},
        {"name": "price", "type": "float"},
        {"name": "amount", "type": "double"},
        {"name": "customer", "type": "string"},
        {"name": "blob", "type": "bytes"},
        {"name": "color", "type": {"type": "enum", "name": "Color", "symbols": ["RED", "GREEN", "BLUE"]}},
        {"name": "note", "type": ["null", "string"], "default": None},
        {"name": "at", "type": {"type": "long", "logicalType": "timestamp-millis"}},
        {
            "name": "address",
            "type": {
                "type": "record",
                "name": "Address",
                "fields": [{"name": "city", "type": "string"}, {"name": "zip", "type": ["string", "null"]}],
            },
        },
        {"name": "previous", "type": ["null", "Address"], "default": None},
    ],
}
# the reader: qty promoted to long, a new field with a default, one without the writer's blob
READER = {
    **WRITER,
    "fields": [
        *[f for f in WRITER["fields"] if f["name"] not in ("qty", "blob")],
        {"name": "qty", "type": "long"},
        {"name": "coupon", "type": ["null", "string"], "default": None},
        {"name": "channel", "type": "string", "default": "web"},
    ],
}

_text = st.text(max_size=20)
_address = st.fixed_dictionaries({"city": _text, "zip": st.none() | _text})
_record = st.fixed_dictionaries(
    {
        "order_id": st.integers(-(2**63), 2**63 - 1),
        "qty": st.integers(-(2**31), 2**31 - 1),
        "paid": st.booleans(),
        "price": st.floats(width=32, allow_nan=False),
        "amount": st.floats(allow_nan=False),
        "customer": _text,
        "blob": st.binary(max_size=20),
        "color": st.sampled_from(["RED", "GREEN", "BLUE"]),
        "note": st.none() | _text,
        "at": st.integers(-(2**40), 2**40),
        "address": _address,
        "previous": st.none() | _address,
    }
)
_damage = st.one_of(st.none(), st.tuples(st.sampled_from(["cut", "extend", "flip"]), st.integers(0, 200), st.integers(0, 255)))


def _write(schema: dict, record: dict) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(strip_logical_types(schema), named_schemas={}), record)
    return out.getvalue()


def _damaged(payload: bytes, damage: tuple | None) -> bytes:
    if damage is None:
        return payload
    how, where, byte = damage
    at = where % max(1, len(payload))
    if how == "cut":
        return payload[:at]
    if how == "extend":
        return payload + bytes([byte])
    return payload[:at] + bytes([byte]) + payload[at + 1 :]


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(_record, _damage), min_size=1, max_size=40))
def test_what_the_columnar_path_decodes_is_what_fastavro_decodes(items):
    _, raw_type = ArrowTypes("test").of(READER, "")
    reader = ColumnReader.plan(strip_logical_types(WRITER), strip_logical_types(READER), raw_type)
    assert reader is not None, "this schema pair is one the columnar path takes"
    payloads = [_damaged(_write(WRITER, record), damage) for record, damage in items]
    decoded, ok = reader.decode(payloads)
    rows = decoded.to_pylist()
    writer = fastavro.parse_schema(strip_logical_types(WRITER), named_schemas={})
    reader_schema = fastavro.parse_schema(strip_logical_types(READER), named_schemas={})
    for (record, damage), payload, row, took in zip(items, payloads, rows, ok, strict=True):
        if damage is None or payload == _write(WRITER, record):
            assert took, f"an undamaged record left the columnar path: {record}"
        if not took:
            assert row is None
            continue
        stream = io.BytesIO(payload)
        expected = fastavro.schemaless_reader(stream, writer, reader_schema)
        assert stream.tell() == len(payload), "the columnar path took a record with bytes left over"
        # the raw type holds timestamp-millis as a timestamp: compare its milliseconds
        got = {**row, "at": round(row["at"].timestamp() * 1000)}
        assert _same(got, expected), (got, expected)


def test_shapes_it_does_not_take_go_to_fastavro():
    _, raw_type = ArrowTypes("test").of(READER, "")
    with_array = {**WRITER, "fields": [*WRITER["fields"], {"name": "tags", "type": {"type": "array", "items": "string"}}]}
    assert ColumnReader.plan(strip_logical_types(with_array), strip_logical_types(READER), raw_type) is None
    narrowed = {**WRITER, "fields": [{**f, "type": "string"} if f["name"] == "order_id" else f for f in WRITER["fields"]]}
    assert ColumnReader.plan(strip_logical_types(narrowed), strip_logical_types(READER), raw_type) is None, (
        "string does not resolve to long"
    )
    fewer_symbols = json.loads(json.dumps(READER).replace('"BLUE"', '"PURPLE"'))
    _, fewer_type = ArrowTypes("test").of(fewer_symbols, "")
    assert ColumnReader.plan(strip_logical_types(WRITER), strip_logical_types(fewer_symbols), fewer_type) is None, (
        "BLUE has no reader symbol"
    )
