"""A merge engine in Arrow (``offsetlake.engine_arrow``) against its definition in Spark
(``offsetlake.engines``): on random rows, the read tasks' contributions and fold must be Spark's,
row for row, and the rows Arrow cannot fold exactly must be the ones it leaves to Spark.

No broker: the rows are made here, the same ones handed to both.
"""

from __future__ import annotations

import math
import random
from datetime import UTC, datetime, timedelta
from typing import Any

import pyarrow as pa
import pytest

from offsetlake import engines
from offsetlake.engine_arrow import ArrowEngine, folds_exactly
from offsetlake.spark import dataframe_from_arrow

MICROS = pa.timestamp("us", tz="UTC")
ROWS_SCHEMA = pa.schema(
    [
        ("order_id", pa.int64()),
        ("customer", pa.string()),
        ("amount", pa.float64()),
        ("qty", pa.int64()),
        ("paid", pa.bool_()),
        ("created_at", MICROS),
        ("_kafka_topic", pa.string()),
        ("_kafka_partition", pa.int32()),
        ("_kafka_offset", pa.int64()),
        ("_kafka_timestamp", MICROS),
        ("_offsetlake_epoch", pa.int32()),
    ]
)
FORMAT = {
    "type": "json",
    "schema": {"order_id": "long", "customer": "string", "amount": "double", "qty": "long", "paid": "boolean", "created_at": "timestamp"},
}
AGGREGATE = {
    "mode": "aggregate",
    "key": ["order_id"],
    "measures": {
        "revenue": {"sum": "amount"},
        "items": {"sum": "qty"},
        "orders": {"count": "*"},
        "with_customer": {"count": "customer"},
        "largest": {"max": "amount"},
        "smallest": {"min": "qty"},
        "last_paid": {"max": "paid"},
        "first_customer": {"first": "customer"},
        "last_amount": {"last": "amount"},
        "last_customer": {"last_non_null": "customer"},
        "latest": {"max": "created_at"},
    },
}
BASE = datetime(2026, 11, 1, tzinfo=UTC)


def _rows(rng: random.Random, n: int, partitions: int = 2) -> pa.Table:
    """Orders over few keys, with nulls, NaN, infinities, huge quantities, times before 1970 and
    null Kafka timestamps among them: each a reason Arrow must fold it as Spark does, or leave it."""
    columns: dict[str, list[Any]] = {f.name: [] for f in ROWS_SCHEMA}
    offsets = [0] * partitions
    for _ in range(n):
        p = rng.randrange(partitions)
        offsets[p] += rng.randint(1, 3)
        when = BASE + timedelta(minutes=rng.randrange(-90, 400))
        columns["order_id"].append(rng.randrange(12) if rng.random() > 0.02 else None)
        columns["customer"].append(rng.choice(["ann", "bo", "", "São", None]))
        columns["amount"].append(
            rng.choice([rng.uniform(-5, 500), 0.0, -0.0, None, math.inf, math.nan] if rng.random() < 0.2 else [rng.uniform(0, 99)])
        )
        columns["qty"].append(rng.choice([rng.randrange(-3, 40), None, 2**40, -(2**63)] if rng.random() < 0.1 else [rng.randrange(0, 9)]))
        columns["paid"].append(rng.choice([True, False, None]))
        columns["created_at"].append(rng.choice([when, None, datetime(1969, 12, 31, 23, 30, tzinfo=UTC)]) if rng.random() < 0.05 else when)
        columns["_kafka_topic"].append("t")
        columns["_kafka_partition"].append(p)
        columns["_kafka_offset"].append(offsets[p])
        stamp = when + timedelta(seconds=rng.randrange(0, 3800))
        # equal Kafka timestamps across partitions: the order key goes on to topic, partition, offset
        columns["_kafka_timestamp"].append(None if rng.random() < 0.01 else stamp.replace(second=0, microsecond=0))
        columns["_offsetlake_epoch"].append(rng.choice([None, None, 1]))
    return pa.table(columns, schema=ROWS_SCHEMA)


def _engines(pipeline, spark, sink: dict[str, Any], rows: pa.Table) -> tuple[Any, ArrowEngine, Any]:
    config = pipeline.write(format=FORMAT, sink=sink)
    spark_engine = engines.engine_for(config)
    contributions = spark_engine.contributions(dataframe_from_arrow(spark, rows.slice(0, 0)))
    states = spark_engine.folded(contributions.select(*engines.group_columns(config), engines.STATE))
    arrow = ArrowEngine.of(config, engines.arrow_schema_of(contributions), engines.arrow_schema_of(states))
    return config, arrow, spark_engine


def _same(a: Any, b: Any, where: str = "") -> None:
    """Equal values, floats within 1e-9 (sums in another order), NaN equal to NaN."""
    if isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, float) and isinstance(b, float):
        assert (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9), f"{where}: {a} != {b}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _compare(got: pa.Table, want: pa.Table, order: list[str]) -> None:
    assert got.schema == want.schema
    key = [(c, "ascending") for c in order]
    got_rows, want_rows = got.sort_by(key).to_pylist(), want.sort_by(key).to_pylist()
    assert len(got_rows) == len(want_rows)
    for i, (g, w) in enumerate(zip(got_rows, want_rows, strict=True)):
        _same(g, w, f"row {i}")


@pytest.mark.parametrize(
    "sink",
    [
        pytest.param({**AGGREGATE, "window": {"on": "created_at", "size": "1h"}}, id="aggregate-hourly"),
        pytest.param({**AGGREGATE, "window": {"on": "created_at", "size": "2h", "slide": "30m"}, "allowed_lateness": "1h"}, id="sliding"),
        pytest.param({**AGGREGATE}, id="aggregate"),
        pytest.param({"mode": "first_row", "key": ["order_id"]}, id="first_row"),
    ],
)
def test_the_read_tasks_contributions_and_fold_are_sparks(pipeline, spark, sink):
    rng = random.Random(51)
    rows = _rows(rng, 3_000)
    config, arrow, spark_engine = _engines(pipeline, spark, sink, rows)
    group = engines.group_columns(config)
    exact = arrow.exact(rows)
    kept, left = rows.filter(exact), rows.filter(pa.compute.invert(exact))
    # what Arrow leaves to Spark: each row has one of the reasons it names, and no other row does
    assert 0 < left.num_rows < rows.num_rows / 5
    for row in left.to_pylist():
        reasons = [row["order_id"] is None, row["_kafka_timestamp"] is None]
        if "window" in sink:
            reasons.append(row["created_at"] is None or row["created_at"] < datetime(1970, 1, 1, tzinfo=UTC))
        if sink.get("allowed_lateness") and row["created_at"] is not None and row["_kafka_timestamp"] is not None:
            reasons.append(row["_kafka_timestamp"] - row["created_at"] > timedelta(hours=1))
        if sink["mode"] == "aggregate":
            reasons += [row["amount"] is not None and math.isnan(row["amount"]), row["qty"] is not None and abs(row["qty"]) >= 2**31]
        assert any(reasons), row

    mine = arrow.contributions(kept)
    theirs = spark_engine.contributions(dataframe_from_arrow(spark, kept)).toArrow()
    _compare(mine, theirs.cast(mine.schema), ["_kafka_partition", "_kafka_offset", *group])

    # folded in two halves, then the halves folded: the fold is associative, as the tasks use it
    half = mine.num_rows // 2
    states = mine.select([*group, engines.STATE])
    partials = pa.concat_tables([arrow.fold(states.slice(0, half)), arrow.fold(states.slice(half))])
    folded = arrow.fold(partials)
    spark_folded = spark_engine.folded(dataframe_from_arrow(spark, theirs).select(*group, engines.STATE)).toArrow()
    _compare(folded, spark_folded.cast(folded.schema), group)
    assert folded.num_rows == len({tuple(r[c] for c in group) for r in mine.select(group).to_pylist()})
    assert folds_exactly(arrow, folded)


def test_stored_states_arrow_cannot_fold_are_left_to_spark(pipeline, spark):
    """A stored state with NaN in a max (folded by Spark from a row Arrow left to it), or with an
    order key without a time, is not folded in Arrow."""
    rows = _rows(random.Random(7), 400)
    config, arrow, spark_engine = _engines(pipeline, spark, {**AGGREGATE}, rows)
    group = engines.group_columns(config)
    clean = rows.filter(arrow.exact(rows))
    stored = spark_engine.folded(spark_engine.contributions(dataframe_from_arrow(spark, clean)).select(*group, engines.STATE)).toArrow()
    assert folds_exactly(arrow, stored)
    nan = clean.set_column(clean.schema.get_field_index("amount"), "amount", pa.array([math.nan] * clean.num_rows, pa.float64()))
    with_nan = spark_engine.folded(spark_engine.contributions(dataframe_from_arrow(spark, nan)).select(*group, engines.STATE)).toArrow()
    assert not folds_exactly(arrow, with_nan)
    untimed = clean.set_column(clean.schema.get_field_index("_kafka_timestamp"), "_kafka_timestamp", pa.nulls(clean.num_rows, MICROS))
    no_time = spark_engine.folded(spark_engine.contributions(dataframe_from_arrow(spark, untimed)).select(*group, engines.STATE)).toArrow()
    assert not folds_exactly(arrow, no_time)
