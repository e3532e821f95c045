"""A suite that passes is decided by one Spark aggregation (``validation._all_pass_in_spark``,
issue 52), never by a verdict Great Expectations would not give: wherever Spark says the whole
suite passes, GX's own run passes every expectation; every failure, and every expectation or
kwarg Spark does not decide, is left to GX, which then runs as before."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
from pyspark.sql import types as T

from offsetlake import validation
from offsetlake.validation import Expectation, Suite

SCHEMA = T.StructType(
    [
        T.StructField("customer", T.StringType()),
        T.StructField("currency", T.StringType()),
        T.StructField("amount", T.DoubleType()),
        T.StructField("count", T.LongType()),
    ]
)

BATCHES = {
    "clean": [("c00001", "EUR", 10.0, 1), ("c00002", "USD", 0.0, 2), ("c00003", "GBP", 100.0, 3)],
    "nulls": [("c00001", None, None, None), (None, "EUR", 5.0, 1)],
    "edges": [("c00001", "EUR", 100.0, 10), ("c00002", "EUR", 0.0, 0)],
    "nan": [("c00001", "EUR", math.nan, 1)],
    "outsider": [("c00001", "JPY", 10.0, 1), ("x", "EUR", 10.0, 1)] + [("c00002", "EUR", 1.0, 1)] * 18,
    "empty": [],
}

SUITES = {
    "orders": [
        ("expect_column_values_to_not_be_null", {"column": "customer"}),
        ("expect_column_values_to_match_regex", {"column": "customer", "regex": "^c[0-9]{5}$"}),
        ("expect_column_values_to_be_in_set", {"column": "currency", "value_set": ["EUR", "USD", "GBP"]}),
        ("expect_column_values_to_be_between", {"column": "amount", "min_value": 0, "max_value": 100}),
        ("expect_table_row_count_to_be_between", {"min_value": 1}),
    ],
    "strict": [
        ("expect_column_values_to_be_between", {"column": "amount", "min_value": 0, "max_value": 100, "strict_max": True}),
        ("expect_column_values_to_be_between", {"column": "count", "min_value": 0, "strict_min": True}),
    ],
    "mostly": [
        ("expect_column_values_to_be_in_set", {"column": "currency", "value_set": ["EUR"], "mostly": 0.9}),
        ("expect_column_values_to_not_match_regex", {"column": "customer", "regex": "^x$", "mostly": 0.9}),
    ],
    "not_in": [
        ("expect_column_values_to_not_be_in_set", {"column": "currency", "value_set": ["JPY"]}),
        ("expect_column_values_to_be_in_set", {"column": "count", "value_set": [0, 1, 2, 3, 10]}),
        ("expect_table_row_count_to_be_between", {"min_value": 0, "max_value": 3}),
    ],
}


def _suite(name: str) -> Suite:
    entries = tuple(Expectation(i, kind, kwargs) for i, (kind, kwargs) in enumerate(SUITES[name]))
    return Suite(name, Path(f"{name}.expectations.yaml"), entries)


@pytest.mark.parametrize("suite_name", sorted(SUITES))
def test_a_pass_in_spark_is_a_pass_in_great_expectations(spark, suite_name):
    suite = _suite(suite_name)
    decided = 0
    for batch, rows in BATCHES.items():
        frame = spark.createDataFrame(rows, SCHEMA)
        by_spark = validation._all_pass_in_spark(frame, suite)
        by_gx = validation._run_gx(frame, suite, list(suite.expectations), {"result_format": "BOOLEAN_ONLY"})
        gx_passes = all(r["success"] for r in by_gx.values())
        if by_spark is not None:
            decided += 1
            assert gx_passes, (suite_name, batch, by_gx)
            assert by_spark == {e.index: {"success": True} for e in suite.expectations}
        elif batch == "clean":
            assert not gx_passes, f"{suite_name}: Spark left a clean batch GX passes to GX"
    assert decided, f"{suite_name}: Spark decided no batch at all"


def test_spark_leaves_every_failure_and_every_undecidable_entry_to_great_expectations(spark):
    frame = spark.createDataFrame(BATCHES["outsider"], SCHEMA)
    assert validation._all_pass_in_spark(frame, _suite("orders")) is None, "a failing batch goes to GX for its details"
    clean = spark.createDataFrame(BATCHES["clean"], SCHEMA)
    for kind, kwargs in [
        ("expect_column_values_to_be_unique", {"column": "customer"}),
        ("expect_column_values_to_not_be_null", {"column": "customer", "row_condition": 'currency=="EUR"'}),
        ("expect_column_values_to_be_between", {"column": "customer", "min_value": 0}),  # text against a number
        ("expect_column_values_to_match_regex", {"column": "count", "regex": "^1$"}),  # a number against a pattern
        ("expect_column_values_to_be_in_set", {"column": "currency", "value_set": [1, 2]}),
        ("expect_column_mean_to_be_between", {"column": "amount", "min_value": 0}),
    ]:
        suite = Suite("s", Path("s.expectations.yaml"), (Expectation(0, kind, kwargs),))
        assert validation._all_pass_in_spark(clean, suite) is None, kind


def test_a_passing_batch_is_not_handed_to_great_expectations(spark, monkeypatch):
    from offsetlake.plan import BatchKind, BatchPlan, OffsetRange, RunContext

    def no_gx(*args, **kwargs):
        raise AssertionError("Great Expectations ran for a batch Spark showed passing")

    monkeypatch.setattr(validation, "_run_gx", no_gx)
    plan = BatchPlan("p", "b1", BatchKind.INGEST, (OffsetRange("t", 0, 0, 3),), RunContext("r"))

    config = SimpleNamespace(name="p", validation=SimpleNamespace(on_failure="fail", examples=3))
    frame = spark.createDataFrame(BATCHES["clean"], SCHEMA)
    outcome = validation.validate_rows(frame, _suite("orders"), config, plan)  # type: ignore[arg-type]
    assert outcome.summary["success"] and outcome.summary["outcome"] == "passed"
    assert [r["success"] for r in outcome.summary["expectations"]] == [True] * 5
    assert outcome.summary["rows_validated"] == 3


@pytest.mark.parametrize("suite_name", sorted(SUITES))
def test_a_gate_observed_during_the_write_decides_as_the_aggregation_does(spark, suite_name):
    """``ObservedGate``: the same aggregation observed on the job that writes the rows (a
    ``mapInArrow`` that collects, as ``staging.write_rows`` does) passes exactly the batches
    ``_all_pass_in_spark`` passes, with their row count; every other batch is ``Undecided``, for
    Great Expectations to decide before a write; a gate whose rows were never written decides
    nothing."""
    from offsetlake.plan import BatchKind, BatchPlan, OffsetRange, RunContext

    plan = BatchPlan("p", "b1", BatchKind.INGEST, (OffsetRange("t", 0, 0, 3),), RunContext("r"))
    config = SimpleNamespace(name="p", validation=SimpleNamespace(on_failure="fail", examples=3))
    suite = _suite(suite_name)
    for name, batch in BATCHES.items():
        frame = spark.createDataFrame(batch, SCHEMA)
        checks = validation.spark_checks(frame, suite)
        assert checks is not None, suite_name
        gate = validation.ObservedGate(suite, config, plan, checks)  # type: ignore[arg-type]
        written = gate.observed(frame).mapInArrow(lambda batches: iter(batches), frame.schema).collect()
        assert len(written) == len(batch)
        expected = validation._all_pass_in_spark(frame, suite)
        if expected is None:
            with pytest.raises(validation.Undecided):
                gate.settle()
            continue
        outcome = gate.settle()
        assert outcome.passed and outcome.summary["outcome"] == "passed", (suite_name, name)
        assert outcome.summary["rows_validated"] == len(batch)
        assert [r["success"] for r in outcome.summary["expectations"]] == [True] * len(suite.expectations)
    never = validation.ObservedGate(suite, config, plan, [])  # type: ignore[arg-type]
    with pytest.raises(validation.Undecided):
        never.settle()
