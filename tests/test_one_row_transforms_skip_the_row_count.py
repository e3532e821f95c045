"""A transform that makes at most one row per record gets ``_kafka_row`` = 0 in the JVM, uncounted.

Issue 52: counting each record's rows (``transform.number_rows_per_record``) sends every row
through Python and back, a third of the shipped orders pipeline's write, although its transform
only derives columns. The rows are counted only when Spark's analysed plan of the transform holds
anything but projections and filters over its input; explode and everything else that may make
several rows of one record is still counted (tests/test_transforms_that_explode.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from confluent_kafka import Producer

from offsetlake import storage, transform
from offsetlake.embedded.sample_data import ensure_topic
from offsetlake.plan import RunContext
from offsetlake.runs import run_pipeline

ONE_ROW = {"identity", "derive_and_filter", "python_udf", "alias", "isin_filter"}
COUNTED = {"explode", "union", "map_in_pandas", "join", "distinct", "window", "unrelated_frame"}


def judged(spark) -> dict[str, bool]:
    """Each kind of transform over one input frame, and whether it is read as one row per record."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    schema = "_kafka_topic string, _kafka_partition int, _kafka_offset long, v string"
    rows = spark.createDataFrame([("t", 0, 1, "a b"), ("t", 0, 2, "c")], schema).where("v is not null")
    cases = {
        "identity": rows,
        "derive_and_filter": rows.withColumn("x", F.upper("v")).where("x != 'Q'").select("*", F.lit(1).alias("y")).drop("v"),
        "python_udf": rows.withColumn("u", F.udf(lambda v: v + "!", "string")("v")),
        "alias": rows.alias("a").select("a.*"),
        "isin_filter": rows.where(F.col("v").isin(["a b"])),
        "explode": rows.withColumn("w", F.explode(F.split("v", " "))),
        "union": rows.union(rows),
        "map_in_pandas": rows.mapInPandas(lambda frames: frames, rows.schema),
        "join": rows.join(rows.select("_kafka_offset"), "_kafka_offset"),
        "distinct": rows.distinct(),
        "window": rows.withColumn("r", F.row_number().over(Window.orderBy("v"))),
        "unrelated_frame": spark.createDataFrame([("t", 0, 1, "a b")], schema),
    }
    return {name: transform.at_most_one_row_per_record(frame, rows) for name, frame in cases.items()}


def test_only_projections_and_filters_read_as_one_row_per_record(spark):
    verdicts = judged(spark)
    assert {name for name, one in verdicts.items() if one} == ONE_ROW
    assert {name for name, one in verdicts.items() if not one} == COUNTED


def test_the_same_verdicts_over_spark_connect(spark_server):
    """The Connect client reads the server's explained plan instead of the JVM's tree."""
    script = (
        "import importlib.util, json, sys\n"
        f"spec = importlib.util.spec_from_file_location('case', {str(Path(__file__))!r})\n"
        "case = importlib.util.module_from_spec(spec); spec.loader.exec_module(case)\n"
        "from offsetlake.spark import is_connect, spark_session\n"
        "spark = spark_session()\n"
        "assert is_connect(spark)\n"
        "print(json.dumps(case.judged(spark)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "OFFSETLAKE_SPARK_REMOTE": spark_server},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    verdicts = json.loads(done.stdout.strip().splitlines()[-1])
    assert {name for name, one in verdicts.items() if one} == ONE_ROW
    assert {name for name, one in verdicts.items() if not one} == COUNTED


DERIVE = """
from pyspark.sql import functions as F


def derive(rows):
    return rows.withColumn("big", F.col("amount") > 50).where(F.col("order_id") % 7 != 0)
"""


def test_a_pipeline_whose_transform_derives_columns_writes_index_zero_without_counting(pipeline, spark, monkeypatch):
    (pipeline.folder / "derive_transform.py").write_text(DERIVE)
    config = pipeline.write(transform="derive_transform:derive", max_records_per_batch=40)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    producer = Producer({"bootstrap.servers": pipeline.bootstrap})
    for i in range(100):
        producer.produce(pipeline.topic, value=json.dumps({"order_id": i, "amount": float(i)}).encode(), partition=i % 2)
    assert producer.flush(30) == 0

    verdicts: list[bool] = []
    judge = transform.at_most_one_row_per_record
    monkeypatch.setattr(
        transform, "at_most_one_row_per_record", lambda after, before: verdicts.append(judge(after, before)) or verdicts[-1]
    )
    run_pipeline(config, RunContext("derive"), lambda: spark)

    assert verdicts and all(verdicts), "a transform of projections and filters is not counted"
    data = storage.table(config.layout.sink).to_pyarrow_table(columns=["order_id", "big", "_kafka_row"])
    got = sorted(zip(data["order_id"].to_pylist(), data["big"].to_pylist(), data["_kafka_row"].to_pylist(), strict=True))
    assert got == [(i, i > 50, 0) for i in range(100) if i % 7 != 0]
    assert not data.schema.field("_kafka_row").nullable
