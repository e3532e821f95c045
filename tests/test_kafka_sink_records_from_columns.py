"""A Kafka sink's batch becomes records a column at a time (``kafka_transactions.table_records``,
issue 52): the keys and JSON values it makes from Arrow columns are byte for byte what the row
by row encoding (``row_record``, ``encode_json``) makes, for every column type a sink row can
hold; the types it cannot prepare exactly fall back to that encoding."""

from __future__ import annotations

import math
from datetime import UTC, date, datetime
from decimal import Decimal

import pyarrow as pa
import pytest

from offsetlake.coordinates import OFFSET, PARTITION, TIMESTAMP, TOPIC
from offsetlake.kafka_transactions import record_keys, row_record, table_records
from offsetlake.sink_values import json_values

N = 7


def _rows(**columns: pa.Array) -> pa.Table:
    coordinates = {
        TOPIC: pa.array(["orders"] * N),
        PARTITION: pa.array([i % 2 for i in range(N)], pa.int32()),
        OFFSET: pa.array(range(100, 100 + N), pa.int64()),
        TIMESTAMP: pa.array([datetime(2026, 11, 1, tzinfo=UTC)] * N, pa.timestamp("us", tz="UTC")),
    }
    return pa.table({**columns, **coordinates})


def _row_by_row(rows: pa.Table, key: list[str]) -> list:
    return [row_record(row, key) for row in rows.to_pylist()]


def _at(*values):
    return [*values, *([None] * (N - len(values)))]


MOMENTS = _at(
    datetime(2026, 11, 1, tzinfo=UTC),
    datetime(2026, 11, 1, 10, 5, 7, 123456, tzinfo=UTC),
    datetime(2026, 11, 1, 10, 5, 7, 1, tzinfo=UTC),
    datetime(1000, 1, 1, tzinfo=UTC),
    datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
)

PREPARED = {
    "long": pa.array(_at(0, -1, 2**62, 7)),
    "int": pa.array(_at(1, 2, 3), pa.int32()),
    "double": pa.array(_at(0.1 + 0.2, -0.0, 1e16, 1e-7, 1.0, 2.5)),
    "non_finite": pa.array(_at(1.5, math.nan, math.inf, -math.inf)),
    "float": pa.array(_at(0.1, 3.0), pa.float32()),
    "bool": pa.array(_at(True, False)),
    "text": pa.array(_at('quote " and \\ back', "tab\tnew\nline\x01", "é ü 日本 🎉", "", "plain")),
    "utc": pa.array(MOMENTS, pa.timestamp("us", tz="UTC")),
    "naive": pa.array([None if m is None else m.replace(tzinfo=None) for m in MOMENTS], pa.timestamp("us")),
    "millis": pa.array(
        _at(datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=UTC), datetime(2026, 1, 2, tzinfo=UTC)), pa.timestamp("ms", tz="UTC")
    ),
    "day": pa.array(_at(date(2026, 11, 1), date(1000, 1, 1), date(9999, 12, 31)), pa.date32()),
    "money": pa.array(_at(Decimal("13.40"), Decimal("0E-10"), Decimal("-0.0000001"), Decimal("12345678901.5")), pa.decimal128(21, 10)),
    "whole": pa.array(_at(Decimal("5"), Decimal("-70")), pa.decimal128(10, 0)),
    "nothing": pa.nulls(N),
}


@pytest.mark.parametrize("column", sorted(PREPARED))
def test_each_prepared_column_is_encoded_exactly_as_row_by_row(column):
    rows = _rows(**{column: PREPARED[column]})
    assert json_values(rows.select([column])) is not None, "this type has a column-at-a-time encoding"
    assert list(table_records(rows, [])) == _row_by_row(rows, [])


def test_a_batch_of_every_prepared_column_and_its_keys():
    rows = _rows(**PREPARED)
    for key in ([], ["text"], ["long"], ["int"], ["text", "utc"], ["utc"], ["double"], ["bool"], ["money"]):
        made = list(table_records(rows, key))
        assert made == _row_by_row(rows, key), key
    assert made[1].value.startswith(b'{"long": -1, "int": 2, "double": -0.0, "non_finite": "NaN",')


FALLBACK = {
    "bytes": pa.array(_at(b"\x00\xff", b"")),
    "struct": pa.array(_at({"a": 1, "b": "x"}), pa.struct([("a", pa.int64()), ("b", pa.string())])),
    "list": pa.array(_at([1.5, math.nan], []), pa.list_(pa.float64())),
    "map": pa.array(_at([("k", 1)]), pa.map_(pa.string(), pa.int64())),
    "berlin": pa.array([*MOMENTS[:4], None, *MOMENTS[5:]], pa.timestamp("us", tz="Europe/Berlin")),
    "nanos": pa.array(_at(datetime(2026, 1, 1, tzinfo=UTC)), pa.timestamp("ns", tz="UTC")),
    "ancient": pa.array(_at(datetime(999, 12, 31, tzinfo=UTC)), pa.timestamp("us", tz="UTC")),
    "old_day": pa.array(_at(date(999, 1, 1)), pa.date32()),
}


@pytest.mark.parametrize("column", sorted(FALLBACK))
def test_a_column_it_cannot_prepare_goes_row_by_row(column):
    rows = _rows(long=PREPARED["long"], **{column: FALLBACK[column]})
    assert json_values(rows.select(["long", column])) is None
    assert list(table_records(rows, ["long"])) == _row_by_row(rows, ["long"])


def test_keys_of_text_integers_and_bytes_are_cast_in_arrow():
    rows = _rows(s=pa.array(_at("c1", "日本")), i=pa.array(_at(-5, 10**15)), b=pa.array(_at(b"\x00k"), pa.binary()))
    assert record_keys(rows, ["s"])[:3] == [b"c1", "日本".encode(), None]
    assert record_keys(rows, ["i"])[:3] == [b"-5", b"1000000000000000", None]
    assert record_keys(rows, ["b"])[:2] == [b"\x00k", None]
    assert record_keys(rows, []) == [None] * N
