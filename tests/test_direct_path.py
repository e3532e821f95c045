"""The direct path (``offsetlake.direct``): read tasks that write the batch's files themselves.

It must change where a record is decided, never what is decided: the same rows, dead letters
with the same reasons and bytes, the same per-range counts and the same file schema as the Spark
path, for every kind of record the Spark path decides differently from the read tasks
(values pyarrow refuses but Spark's ``from_json`` parses, malformed values, tombstones, a
missing required field, timestamps the sink cannot hold).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from confluent_kafka import Producer

from offsetlake import direct, storage
from offsetlake.audit import audit_pipeline
from offsetlake.embedded.sample_data import ensure_topic
from offsetlake.errors import ConfigError
from offsetlake.history import sink_commits
from offsetlake.plan import RunContext
from offsetlake.process import choose_data_path
from offsetlake.processed import DataPath
from offsetlake.runs import run_pipeline

SCHEMA = {"order_id": "long", "customer": "string", "amount": "double", "currency": "string", "created_at": "timestamp", "region": "int"}
YEAR_10000_MS = 253_402_300_800_000


def _order(order_id: int, region: int | None) -> bytes:
    return json.dumps(
        {
            "order_id": order_id,
            "customer": f"c{order_id % 7}",
            "amount": order_id / 4,
            "currency": "EUR",
            "created_at": "2026-11-01T00:00:00Z",
            "region": region,
        }
    ).encode()


def _produce_every_kind(bootstrap: str, topic: str) -> int:
    """Good orders on 3 partitions (regions 0-2 and none) with every kind of record the Spark
    path decides around them; returns how many records."""
    ensure_topic(bootstrap, topic, 3, config={"retention.ms": "-1"})
    producer = Producer({"bootstrap.servers": bootstrap})
    odd = [
        b"{broken",  # not JSON: dead letter
        None,  # tombstone: dead letter
        b"[1, 2]",  # not an object: dead letter
        b'{"customer": "no id", "created_at": "2026-11-01T00:00:00Z"}',  # required order_id missing
        b"{'order_id': 9001, 'customer': 'single quotes'}",  # pyarrow refuses, Spark parses: a row
        b'{"order_id": 9002, "created_at": 1700000000}',  # epoch seconds: Spark's row, not pyarrow's
        b'  {"order_id": 9003}',  # leading blanks: left to Spark, a row
    ]
    count = 0
    for i in range(3_000):
        producer.produce(
            topic, value=_order(i, None if i % 11 == 0 else i % 3), partition=i % 3, headers=[("h", b"\xff")] if i % 500 == 0 else None
        )
        count += 1
        if i % 400 == 0:
            producer.produce(topic, value=odd[(i // 400) % len(odd)], partition=i % 3)
            count += 1
    producer.produce(topic, value=_order(5_000, 1), partition=1, timestamp=YEAR_10000_MS + 1)  # dead letter
    count += 1
    assert producer.flush(30) == 0
    return count


def _run(pipeline, lake: Path, caplog, **overrides):
    config = pipeline.write(
        lake=str(lake), format={"type": "json", "schema": SCHEMA, "required": ["order_id"]}, sink={"partition_by": ["region"]}, **overrides
    )
    with caplog.at_level(logging.INFO, logger="offsetlake.batch"):
        caplog.clear()
        results = run_pipeline(config, RunContext("direct"), lambda: pipeline.spark)
        steps = caplog.text
    return config, results, steps


def _files(location: str) -> list[Path]:
    return [Path(uri.removeprefix("file://")) for uri in storage.table(location).file_uris()]


@pytest.mark.local_lake
def test_the_read_tasks_write_what_the_spark_path_writes(pipeline, spark, tmp_path, caplog):
    pipeline.spark = spark
    produced = _produce_every_kind(pipeline.bootstrap, pipeline.topic)

    direct_config, direct_results, direct_log = _run(pipeline, tmp_path / "direct", caplog, data_path="direct")
    assert "step=path" in direct_log and "path=direct" in direct_log
    spark_config, spark_results, spark_log = _run(pipeline, tmp_path / "spark", caplog, data_path="spark")
    assert "path=spark" in spark_log and "the pipeline says data_path: spark" in spark_log

    [d], [s] = direct_results, spark_results
    # the ledger entry records the path each batch took
    assert [c.entry.data_path for c in sink_commits(storage.table(direct_config.layout.sink), direct_config.name)] == ["direct"]
    assert [c.entry.data_path for c in sink_commits(storage.table(spark_config.layout.sink), spark_config.name)] == ["spark"]
    assert d.per_range == s.per_range
    assert d.total("records_read") == produced
    # 8 odd records (every 400th of 3,000) over 7 kinds, so "{broken" twice: 5 dead letters among
    # them, plus the record stamped in year 10000
    assert d.total("dead_letters") == 6

    order = ["_kafka_partition", "_kafka_offset"]
    rows = storage.table(direct_config.layout.sink).to_pyarrow_table().sort_by([(c, "ascending") for c in order])
    expected = storage.table(spark_config.layout.sink).to_pyarrow_table().sort_by([(c, "ascending") for c in order])
    assert rows.schema == expected.schema
    assert rows.to_pylist() == expected.to_pylist()
    by_id = {r["order_id"]: r for r in rows.to_pylist()}
    assert by_id[9001]["customer"] == "single quotes" and by_id[9002]["created_at"] is not None and 9003 in by_id
    assert storage.table(direct_config.layout.sink).schema().to_arrow() == storage.table(spark_config.layout.sink).schema().to_arrow()

    dead = storage.table(direct_config.layout.dead_letters).to_pyarrow_table().drop_columns(["batch_id", "pipeline"])
    dead_expected = storage.table(spark_config.layout.dead_letters).to_pyarrow_table().drop_columns(["batch_id", "pipeline"])
    key = [("_kafka_partition", "ascending"), ("_kafka_offset", "ascending")]
    assert dead.sort_by(key).to_pylist() == dead_expected.sort_by(key).to_pylist()
    assert {r["reason"] for r in dead.to_pylist()} >= {"value is not a JSON object", "tombstone: record has a null value"}

    # the same parquet schema in every file, partition folders named alike, no undecided file left
    direct_files, spark_files = _files(direct_config.sink_path), _files(spark_config.sink_path)
    assert {pq.read_schema(f).remove_metadata() for f in direct_files} == {pq.read_schema(f).remove_metadata() for f in spark_files}
    assert (
        {f.parent.name for f in direct_files}
        == {f.parent.name for f in spark_files}
        == {"region=0", "region=1", "region=2", "region=__HIVE_DEFAULT_PARTITION__"}
    )
    assert not list((tmp_path / "direct").rglob("undecided-*")), "the undecided records' files were not removed"
    assert audit_pipeline(direct_config, against_kafka=True).ok


def test_what_keeps_a_batch_on_the_spark_path(pipeline):
    """Each reason names itself; the shipped orders pipeline (transform, suite) stays on Spark."""
    from offsetlake.config import load_pipeline
    from offsetlake.formats import decoder_for
    from offsetlake.plan import BatchPlan, RecordTimeWindow

    plan = BatchPlan(pipeline.name, "b-1", "ingest", (), RunContext("t"))
    plain = pipeline.write()
    assert direct.problem(plain, plan, decoder_for(plain)) is None
    by_time = BatchPlan(pipeline.name, "b-2", "backfill", (), RunContext("t"), window=RecordTimeWindow(0, 1))
    assert direct.problem(plain, by_time, decoder_for(plain)) == "a backfill by record time"
    upsert = pipeline.write(sink={"mode": "upsert", "key": ["order_id"]})
    assert direct.problem(upsert, plan, decoder_for(upsert)) == "a keyed sink merges in Spark"
    shipped = load_pipeline(str(Path(__file__).parents[1] / "pipelines" / "orders.yaml"))
    assert direct.problem(shipped, plan, decoder_for(shipped)) == "a transform runs in Spark"
    (pipeline.file.parent / f"{pipeline.name}.expectations.yaml").write_text("expectations: []\n")
    with_suite = pipeline.write()
    assert direct.problem(with_suite, plan, decoder_for(with_suite)) == "the suite validates the rows in Spark"


def test_data_path_direct_is_refused_for_a_pipeline_that_needs_spark(pipeline):
    """The configuration check names the pipeline and the reason; auto and spark load."""
    with pytest.raises(ConfigError) as refused:
        pipeline.write(sink={"mode": "upsert", "key": ["order_id"]}, data_path="direct")
    assert f"data_path: pipeline {pipeline.name} cannot take the direct path: a keyed sink merges in Spark" in str(refused.value)
    assert pipeline.write(sink={"mode": "upsert", "key": ["order_id"]}, data_path="spark").data_path == "spark"
    assert pipeline.write().data_path == "auto"


def test_a_batch_that_needs_spark_fails_under_data_path_direct_before_reading(pipeline, spark):
    """What only the decoder's types tell (a string partition column) fails the batch under
    ``direct`` with the reason, and takes Spark under ``auto``; a backfill takes Spark."""
    from offsetlake.formats import decoder_for
    from offsetlake.plan import BatchPlan, OffsetRange

    plan = BatchPlan(pipeline.name, "b-1", "ingest", (OffsetRange(pipeline.topic, 0, 0, 10),), RunContext("t"))
    forced = pipeline.write(sink={"partition_by": ["customer"]}, data_path="direct")
    with pytest.raises(ConfigError, match=f"pipeline {pipeline.name}: batch b-1 cannot take the direct path .*partition column customer"):
        choose_data_path(forced, plan, spark, decoder_for(forced), adds_files=True)
    auto = pipeline.write(sink={"partition_by": ["customer"]})
    choice = choose_data_path(auto, plan, spark, decoder_for(auto), adds_files=True)
    assert choice.path is DataPath.SPARK and "partition column customer" in choice.reason
    plain = pipeline.write(data_path="direct")
    assert choose_data_path(plain, plan, spark, decoder_for(plain), adds_files=True).path is DataPath.DIRECT
    assert choose_data_path(plain, plan, spark, decoder_for(plain), adds_files=False).path is DataPath.SPARK
