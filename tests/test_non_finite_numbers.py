"""A NaN or an infinite double is a row like any other, and every table offsetlake writes stays
readable by every Delta reader (issue 48, finding 1: one ``{"amount": 1e400}`` wrote ``Infinity``
into a commit's file statistics, which is not JSON, and from then on no reader could open the
table and every later run failed)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from confluent_kafka import Producer
from deltalake import DeltaTable

from offsetlake.embedded.sample_data import ensure_topic
from offsetlake.entry import for_plan
from offsetlake.file_stats import delta_stats
from offsetlake.plan import BatchKind, BatchPlan, OffsetRange, RunContext
from offsetlake.runs import run_pipeline
from offsetlake.sink_values import encode_json

SCHEMA = {"order_id": "long", "amount": "double", "ratio": "float", "band": "double", "detail": "struct<score: double>"}

# order_id -> the value's JSON text and the (amount, ratio, band, detail.score) it must become
RECORDS = {
    1: ('{"order_id": 1, "amount": 1e400, "ratio": 1.5, "band": 1.0, "detail": {"score": 1}}', (math.inf, 1.5, 1.0, 1.0)),
    2: (
        '{"order_id": 2, "amount": -1e400, "ratio": 1e39, "band": 1e400, "detail": {"score": -1e400}}',
        (-math.inf, math.inf, math.inf, -math.inf),
    ),
    # bare NaN and Infinity are not JSON, but Spark's parser takes them (allowNonNumericNumbers)
    3: (
        '{"order_id": 3, "amount": NaN, "ratio": -Infinity, "band": NaN, "detail": {"score": NaN}}',
        (math.nan, -math.inf, math.nan, math.nan),
    ),
    4: ('{"order_id": 4, "amount": 2.5, "ratio": 0.5, "band": 2.0, "detail": {"score": 2}}', (2.5, 0.5, 2.0, 2.0)),
}


def _same(a: float | None, b: float) -> bool:
    return a is not None and (a == b or (math.isnan(a) and math.isnan(b)))


def _strict_json(text: str) -> object:
    def refuse(token: str) -> None:
        raise ValueError(f"not JSON: {token}")

    return json.loads(text, parse_constant=refuse)


def _every_commit_is_json(location: Path) -> int:
    """Each line of each commit file parses as strict JSON, and so does every add's stats text."""
    files = sorted((location / "_delta_log").glob("*.json"))
    for commit in files:
        for line in commit.read_text().splitlines():
            action = _strict_json(line)
            add = action.get("add") if isinstance(action, dict) else None
            if add and add.get("stats"):
                _strict_json(add["stats"])
            info = action.get("commitInfo") if isinstance(action, dict) else None
            if info and info.get("userMetadata"):
                _strict_json(info["userMetadata"])
    return len(files)


@pytest.mark.local_lake
@pytest.mark.parametrize("mode", ["append", "upsert"])
def test_non_finite_doubles_are_rows_and_every_reader_opens_the_table(pipeline, spark, mode):
    sink = {} if mode == "append" else {"mode": "upsert", "key": ["order_id"]}
    config = pipeline.write(format={"type": "json", "schema": SCHEMA, "required": ["order_id"]}, sink=sink)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    producer = Producer({"bootstrap.servers": pipeline.bootstrap})
    for order_id, (text, _) in RECORDS.items():
        producer.produce(pipeline.topic, key=str(order_id).encode(), value=text.encode(), partition=0)
    assert producer.flush(30) == 0

    first = run_pipeline(config, RunContext("non-finite-1"), lambda: spark)
    assert [r.status for r in first] == ["committed"], first
    # the table is not blocked: the next batch commits on top of it
    producer.produce(pipeline.topic, key=b"5", value=b'{"order_id": 5, "amount": 1e400, "band": 3.0}', partition=0)
    assert producer.flush(30) == 0
    second = run_pipeline(config, RunContext("non-finite-2"), lambda: spark)
    assert [r.status for r in second] == ["committed"], second

    location = Path(config.layout.sink.path)
    assert _every_commit_is_json(location) >= 2
    assert _every_commit_is_json(Path(config.layout.ledger.path)) >= 1
    expected = {**{k: v for k, (_, v) in RECORDS.items()}, 5: (math.inf, None, 3.0, None)}

    # delta-rs, read whole and through its pyarrow dataset with filters on the columns
    table = DeltaTable(str(location))
    rows = {r["order_id"]: r for r in table.to_pyarrow_table().to_pylist()}
    assert sorted(rows) == sorted(expected), rows
    for order_id, (amount, ratio, band, score) in expected.items():
        row = rows[order_id]
        assert _same(row["amount"], amount), row
        assert ratio is None or _same(row["ratio"], ratio), row
        assert _same(row["band"], band), row
        assert score is None or _same(row["detail"]["score"], score), row
    dataset = table.to_pyarrow_dataset()
    positive = sorted(dataset.to_table(filter=pc.field("amount") > 0).column("order_id").to_pylist())
    assert positive == [1, 4, 5], f"a filter must not prune a file whose bounds were left out: {positive}"
    assert sorted(dataset.to_table(filter=pc.field("band") > 2.5).column("order_id").to_pylist()) == [2, 5]

    # delta-spark, as any Spark user reads it
    frame = spark.read.format("delta").load(str(location))
    assert frame.count() == len(expected)
    # Spark orders NaN above every other double (so order 3 is "> 0" here, not in delta-rs's filter)
    assert sorted(r.order_id for r in frame.where("amount > 0").collect()) == [1, 3, 4, 5]
    assert sorted(r.order_id for r in frame.where("isnan(band)").collect()) == [3]
    assert sorted(r.order_id for r in frame.where("detail.score = double('-Infinity')").collect()) == [2]

    assert pipeline.cli("audit", "--against-kafka").returncode == 0


def test_a_file_with_a_non_finite_bound_gets_no_column_statistics(tmp_path):
    import pyarrow as pa

    for values in ([1.0, math.inf], [-math.inf, 1.0], [math.nan, math.nan]):
        path = tmp_path / "f.parquet"
        pq.write_table(pa.table({"x": pa.array(values, pa.float64()), "n": [1, 2]}), path)
        stats = _strict_json(delta_stats(pq.read_metadata(path)))
        assert stats == {"numRecords": 2}, (values, stats)
    path = tmp_path / "g.parquet"
    pq.write_table(pa.table({"x": pa.array([math.nan, 1.0, 2.0], pa.float64())}), path)
    stats = _strict_json(delta_stats(pq.read_metadata(path)))
    assert stats["minValues"] == {"x": 1.0} and stats["maxValues"] == {"x": 2.0}, "parquet leaves NaN out of finite bounds"


def test_json_written_for_others_holds_no_bare_nan_or_infinity():
    value = encode_json({"a": math.inf, "b": -math.inf, "c": math.nan, "d": [1.5, math.nan], "e": {"f": math.inf}})
    assert _strict_json(value.decode()) == {"a": "Infinity", "b": "-Infinity", "c": "NaN", "d": [1.5, "NaN"], "e": {"f": "Infinity"}}
    plan = BatchPlan("p", "b1", BatchKind.INGEST, (OffsetRange("t", 0, 0, 4),), RunContext("r"))
    entry = for_plan(plan, {}, 0.0, {"success": False, "observed": math.inf, "results": [{"observed_value": math.nan}]}, staged=())
    _strict_json(entry.to_json())
