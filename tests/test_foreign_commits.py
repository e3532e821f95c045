"""Commits offsetlake did not make have a contract (issue 48, finding 4): ``offsetlake sql`` only
reads unless asked (``--write``, saying what it changed); runs, ``status`` and the audit recognise a
foreign commit and say what it changed in committed ranges; the audit counts its deleted rows
instead of passing silently or calling them lost; a backfill keeps a user's delete deleted (or
restores it when asked) and a rewind past it is refused unless asked. Every table read with plain
deltalake."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pyarrow.compute as pc
import pytest
from conftest import ROOT
from deltalake import DeltaTable

from offsetlake.audit import audit_pipeline
from offsetlake.backfill import plan_backfill
from offsetlake.catalog import NamedTable, refuse_write, register, writes
from offsetlake.embedded.sample_data import ensure_topic, produce_orders
from offsetlake.errors import ForeignCommitError, OffsetlakeError
from offsetlake.history import foreign_commits
from offsetlake.ledger import Ledger
from offsetlake.plan import RunContext
from offsetlake.rewind import rewind_pipeline
from offsetlake.runs import execute_recorded_batch, run_pipeline

DELETED = "_kafka_partition = 0 AND _kafka_offset < 10"


def _sql(pipeline, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "offsetlake", "--pipelines-dir", str(pipeline.folder), "sql", "--pipeline", pipeline.name, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)


def _partition0_offsets(config) -> list[int]:
    table = DeltaTable(config.layout.sink.path).to_pyarrow_table(columns=["_kafka_partition", "_kafka_offset"])
    return sorted(table.filter(pc.equal(table["_kafka_partition"], 0))["_kafka_offset"].to_pylist())


@pytest.mark.local_lake
def test_statements_that_write_are_told_from_reads(pipeline, spark):
    config = pipeline.write()
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 20)
    run_pipeline(config, RunContext("r"), lambda: spark)
    register(spark, [config])
    name = pipeline.name
    reads = [
        f"SELECT count(*) FROM {name}",
        f"WITH a AS (SELECT * FROM {name}) SELECT count(*) FROM a",
        f"SELECT * FROM {name} VERSION AS OF 1",
        f"DESCRIBE HISTORY {name}",
        "SHOW TABLES",
        f"EXPLAIN DELETE FROM {name}",
        "VALUES (1)",
    ]
    changes = [
        f"DELETE FROM {name} WHERE {DELETED}",
        f"UPDATE {name} SET customer = 'x'",
        f"INSERT INTO {name} SELECT * FROM {name}",
        f"WITH a AS (SELECT * FROM {name}) INSERT INTO {name} SELECT * FROM a",
        f"MERGE INTO {name} t USING {name} s ON t.order_id = s.order_id WHEN MATCHED THEN DELETE",
        f"DROP TABLE {name}",
        f"ALTER TABLE {name} ADD COLUMNS (x int)",
        f"RESTORE TABLE {name} TO VERSION AS OF 1",
        f"OPTIMIZE {name}",
        f"VACUUM {name}",
        f"TRUNCATE TABLE {name}",
        f"CREATE TABLE copy_{name} AS SELECT * FROM {name}",
    ]
    assert [s for s in reads if writes(spark, s)] == []
    assert [s for s in changes if not writes(spark, s)] == []
    tables = [NamedTable(name, name, "sink", "-"), NamedTable(f"{name}_ledger", name, "ledger", "-")]
    with pytest.raises(OffsetlakeError, match="only reads unless asked: add --write"):
        refuse_write(changes[0], 1, False, tables)
    with pytest.raises(OffsetlakeError, match=f"names {name}_ledger, which only offsetlake writes"):
        refuse_write(f"DELETE FROM {name}_ledger", 1, True, tables)
    refuse_write(changes[0], 1, True, tables)  # the sink itself, when asked


@pytest.mark.local_lake
def test_a_foreign_delete_is_reported_counted_and_kept_deleted(pipeline, spark, caplog):
    config = pipeline.write(max_records_per_batch=100)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    produce_orders(pipeline.bootstrap, pipeline.topic, 300, partition=0)
    batches = run_pipeline(config, RunContext("first"), lambda: spark)
    assert len(batches) == 3
    version = DeltaTable(config.layout.sink.path).version()

    # read-only unless asked: the DELETE is refused, nothing is committed
    refused = _sql(pipeline, f"DELETE FROM {pipeline.name} WHERE {DELETED}")
    assert refused.returncode == 2 and "only reads unless asked: add --write" in refused.stderr, refused.stderr[-2000:]
    assert DeltaTable(config.layout.sink.path).version() == version

    done = _sql(pipeline, "--write", f"DELETE FROM {pipeline.name} WHERE {DELETED}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"statement 1 changed {pipeline.name}: version {version + 1} DELETE" in done.stderr, done.stderr[-2000:]
    assert _partition0_offsets(config)[:3] == [10, 11, 12]
    found = foreign_commits(DeltaTable(config.layout.sink.path), pipeline.name)
    assert [(f.version, f.operation) for f in found] == [(version + 1, "DELETE")] and "Delta-Lake" in found[0].engine

    # status and every run say it; the audit counts the deleted rows instead of passing silently
    status = pipeline.cli("status", "--json")
    assert status.returncode == 0, status.stderr[-2000:]
    said = json.loads(status.stdout)["foreign_commits"]
    assert [(s["version"], s["operation"], s["rows_removed"], s["rows_added"]) for s in said] == [(version + 1, "DELETE", 10, 0)]
    with caplog.at_level(logging.WARNING, logger="offsetlake.foreign"):
        assert run_pipeline(config, RunContext("after"), lambda: spark) == []
    assert any("did not make" in r.getMessage() and "rows_removed=10" in r.getMessage() for r in caplog.records), caplog.text
    audit = audit_pipeline(config, against_kafka=True)
    assert audit.ok, audit.text()
    assert any(f"version {version + 1} (DELETE by" in n and "10 row(s) removed" in n for n in audit.notes), audit.text()
    assert audit.against_kafka["deleted_by_others"] == 10, audit.text()

    # a backfill of the range keeps the user's delete; asked to, it restores the rows
    run = RunContext("bf")
    plan = plan_backfill(config, run, [0], 0, 50)
    Ledger.of(config).record_plan(plan)
    execute_recorded_batch(config, plan.batch_id, lambda: spark)
    assert _partition0_offsets(config)[:3] == [10, 11, 12], "a backfill must not bring back rows a user deleted"
    after = audit_pipeline(config)
    assert after.ok, after.text()

    # a rewind to the first batch would bring the deleted rows back: refused unless asked
    with pytest.raises(ForeignCommitError, match="--restore-deleted"):
        rewind_pipeline(config, batches[0].plan.batch_id)
    restore = plan_backfill(config, RunContext("bf-restore"), [0], 0, 50)
    Ledger.of(config).record_plan(restore)
    execute_recorded_batch(config, restore.batch_id, lambda: spark, restore_deleted=True)
    assert _partition0_offsets(config)[:12] == list(range(12))
    rewind_pipeline(config, batches[0].plan.batch_id, restore_deleted=True)
    assert _partition0_offsets(config) == list(range(100))
    assert audit_pipeline(config).ok
