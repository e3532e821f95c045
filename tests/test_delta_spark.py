"""Delta Lake for Spark in every session: the lake's tables by name, time travel, and each Delta
library reading what the other wrote, protocol features included (deletion vectors, checkpoints)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
from conftest import ROOT
from deltalake import DeltaTable, QueryBuilder, write_deltalake

from offsetlake.catalog import register
from offsetlake.embedded.sample_data import ensure_topic, produce_orders
from offsetlake.maintenance import maintain
from offsetlake.plan import RunContext
from offsetlake.runs import run_pipeline


def _sql(pipeline, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "offsetlake", "--pipelines-dir", str(pipeline.folder), "sql", "--pipeline", pipeline.name, "--json", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )


@pytest.mark.local_lake
def test_sql_names_the_sink_dead_letters_and_ledger_and_travels_in_time(pipeline, spark, spark_server):
    config = pipeline.write(max_records_per_batch=1_000)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    produce_orders(pipeline.bootstrap, pipeline.topic, 600, malformed_every=50)
    first = run_pipeline(config, RunContext("sql-1"), lambda: spark)
    produce_orders(pipeline.bootstrap, pipeline.topic, 900, first_id=10_000)
    second = run_pipeline(config, RunContext("sql-2"), lambda: spark)
    assert len(first) == 1 and len(second) == 1
    rows_first, rows_all = first[0].total("rows_written"), first[0].total("rows_written") + second[0].total("rows_written")
    dead = first[0].total("dead_letters") + second[0].total("dead_letters")
    assert dead > 0, "malformed_every=50 must make dead letters"

    done = _sql(
        pipeline,
        stdin=f"SELECT count(*) AS n FROM {pipeline.name};\n"
        f"SELECT count(*) AS n FROM {pipeline.name} VERSION AS OF {first[0].sink_version};\n"
        f"SELECT count(*) AS n FROM {pipeline.name}_dead_letters;\n"
        f"SELECT status, count(DISTINCT batch_id) AS batches FROM {pipeline.name}_ledger\n"
        f"  WHERE pipeline = '{pipeline.name}' GROUP BY status ORDER BY status;\n"
        "SELECT * FROM no_such_table;\n",
    )
    # the results come one after another; a table name that is not registered is an error naming it
    assert done.returncode == 2, done.stderr[-3000:]
    refusal = done.stderr.strip().splitlines()[-1]
    assert refusal.startswith("offsetlake sql: error: statement 5: [TABLE_OR_VIEW_NOT_FOUND]") and "no_such_table" in refusal, refusal
    assert f"tables here: {pipeline.name}, {pipeline.name}_dead_letters, {pipeline.name}_ledger" in refusal, refusal
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert lines[:3] == [{"n": rows_all}, {"n": rows_first}, {"n": dead}]
    assert {"status": "committed", "batches": 2} in lines[3:]

    # one statement as an argument, on a Spark server (a JVM start fewer than a second session of its own)
    done = _sql(pipeline, "--remote", spark_server, f"SELECT max(order_id) AS top FROM {pipeline.name}")
    assert done.returncode == 0 and json.loads(done.stdout) == {"top": 10_899}, done.stderr[-3000:]


@pytest.mark.local_lake
def test_delta_spark_reads_what_offsetlake_committed_with_delta_rs_after_a_checkpoint(pipeline, spark):
    config = pipeline.write(max_records_per_batch=500)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 1_500)
    results = run_pipeline(config, RunContext("interop"), lambda: spark)
    assert len(results) == 3
    reports = maintain(config, vacuum=False)
    sink_report = next(r for r in reports if r.table == "sink")
    assert sink_report.checkpoint_version is not None

    registered, _ = register(spark, [config])
    assert {t.name for t in registered} >= {pipeline.name, f"{pipeline.name}_ledger"}
    assert spark.table(pipeline.name).count() == 1_500
    # the ledger entry each commit carries is the commit's userMetadata, which Spark shows too
    history = spark.sql(f"DESCRIBE HISTORY {pipeline.name}").collect()
    entries = [json.loads(h["userMetadata"]) for h in history if h["userMetadata"]]
    assert {e.get("batch_id") for e in entries} >= {r.plan.batch_id for r in results}
    # delta-spark reads the checkpoint delta-rs wrote, and the txn (app id -> version) per partition
    checkpoints = list((Path(config.layout.sink.path) / "_delta_log").glob("*.checkpoint.parquet"))
    assert checkpoints, "maintenance must have written a checkpoint"
    assert spark.read.format("delta").load(str(Path(config.layout.sink.path))).count() == 1_500


def test_delta_rs_reads_a_delta_spark_merge_with_deletion_vectors(spark, tmp_path):
    path = str(tmp_path / "dv")
    spark.range(0, 1_000).selectExpr("id", "id * 2 AS v").repartition(1).write.format("delta").option(
        "delta.enableDeletionVectors", "true"
    ).save(path)
    spark.sql(f"DELETE FROM delta.`{path}` WHERE id % 10 = 0")
    spark.sql(
        f"MERGE INTO delta.`{path}` t USING (SELECT id, -1 AS v FROM range(0, 1000) WHERE id % 7 = 1) s "
        "ON t.id = s.id WHEN MATCHED THEN UPDATE SET v = s.v"
    )
    actions = [json.loads(line) for f in sorted((tmp_path / "dv" / "_delta_log").glob("*.json")) for line in f.read_text().splitlines()]
    assert any((a.get("add") or {}).get("deletionVector") for a in actions), "Spark must have written deletion vectors"
    assert any("deletionVectors" in (a.get("protocol") or {}).get("readerFeatures", []) for a in actions)

    # delta-rs 1.6's to_pyarrow_table refuses the deletionVectors reader feature; its DataFusion
    # scan (QueryBuilder) applies the vectors
    with pytest.raises(Exception, match="deletionVectors"):
        DeltaTable(path).to_pyarrow_table()
    table = pa.table(QueryBuilder().register("t", DeltaTable(path)).execute("SELECT id, v FROM t").read_all()).to_pylist()
    expected = {i: (-1 if i % 7 == 1 else i * 2) for i in range(1_000) if i % 10 != 0}
    assert {r["id"]: r["v"] for r in table} == expected
    assert len(table) == len(expected)


def test_delta_spark_reads_a_delta_rs_table_with_its_checkpoint_and_later_commits(spark, tmp_path):
    path = str(tmp_path / "rs")
    for start in range(0, 500, 100):
        write_deltalake(path, pa.table({"id": list(range(start, start + 100))}), mode="append")
    table = DeltaTable(path)
    table.create_checkpoint()
    write_deltalake(path, pa.table({"id": list(range(500, 550))}), mode="append")
    table.update_incremental()
    table.delete("id < 50")
    assert (tmp_path / "rs" / "_delta_log" / "00000000000000000004.checkpoint.parquet").exists()

    frame = spark.read.format("delta").load(path)
    assert sorted(r["id"] for r in frame.collect()) == list(range(50, 550))
    assert spark.read.format("delta").option("versionAsOf", 4).load(path).count() == 500
