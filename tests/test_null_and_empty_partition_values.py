"""A string partition column holding both null and "" loses nothing, and a staged file that is not
what its task wrote never commits.

Found by an adversarial run (issue 35, finding 1): every file of a Spark task was named by the task
attempt alone and null and "" both map to the default partition folder, so the second run of rows
reopened the path of the first and overwrote it while both add actions were committed: 1,200
records in, 900 rows in the sink, the ledger saying 1,200, and the plain audit saying OK (finding
11). Now each file has its own name, the commit checks every file against its task's report, and
the audit compares each range's rows with its entry.
"""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from confluent_kafka import Producer
from kafka_truth import assert_exactly_once, read_topic

from offsetlake import storage
from offsetlake.audit import audit_pipeline
from offsetlake.backfill import plan_backfill
from offsetlake.embedded.sample_data import ensure_topic
from offsetlake.errors import StagedFilesError
from offsetlake.history import sink_commits
from offsetlake.ledger import Ledger
from offsetlake.plan import RunContext
from offsetlake.runs import execute_recorded_batch, run_pipeline
from offsetlake.sink import StagedFile, add_actions_for

CYCLE = ["a", "", None, "b"]


def _produce(bootstrap: str, topic: str, partitions: int, per_partition: int, cycle: list[str | None], first_id: int) -> None:
    producer = Producer({"bootstrap.servers": bootstrap})
    order_id = first_id
    for partition in range(partitions):
        for i in range(per_partition):
            value = {
                "order_id": order_id,
                "customer": cycle[i % len(cycle)],
                "amount": 1.0,
                "currency": "EUR",
                "created_at": "2026-11-01T00:00:00Z",
            }
            producer.produce(topic, value=json.dumps(value).encode(), partition=partition)
            order_id += 1
    assert producer.flush(30) == 0


def _customers(config) -> dict[str | None, int]:
    data = storage.table(config.layout.sink).to_pyarrow_dataset().to_table(columns=["customer"])
    counts: dict[str | None, int] = {}
    for value in data["customer"].to_pylist():
        counts[value] = counts.get(value, 0) + 1
    return counts


def _empty_as_null(config) -> int:
    table = storage.table(config.layout.sink)
    return sum(
        r.counts.get("empty_as_null", 0)
        for c in sink_commits(table, config.name)
        if c.kind in ("ingest", "backfill")
        for r in c.entry.ranges
    )


def _audits(config) -> None:
    for against_kafka in (False, True):
        report = audit_pipeline(config, against_kafka=against_kafka)
        assert report.ok, report.text()


@pytest.mark.also_on_s3
def test_null_and_empty_partition_values_in_one_task_land_every_record(pipeline, spark):
    config = pipeline.write(sink={"partition_by": ["customer"]})
    ensure_topic(pipeline.bootstrap, pipeline.topic, 3)
    _produce(pipeline.bootstrap, pipeline.topic, 3, 400, CYCLE, 0)
    results = run_pipeline(config, RunContext("null-and-empty"), lambda: spark)
    assert sum(r.total("rows_written") for r in results) == 1200
    assert_exactly_once(config, read_topic(pipeline.bootstrap, pipeline.topic))
    # "" cannot be a Delta partition value: it is read back as null, and counted
    assert _customers(config) == {"a": 300, "b": 300, None: 600}
    assert _empty_as_null(config) == 300
    _audits(config)

    plan = plan_backfill(config, RunContext("null-and-empty-backfill"), [0, 1, 2], 0, 400)
    Ledger.of(config).record_plan(plan)
    execute_recorded_batch(config, plan.batch_id, lambda: spark)
    assert_exactly_once(config, read_topic(pipeline.bootstrap, pipeline.topic))
    assert _customers(config) == {"a": 300, "b": 300, None: 600}
    _audits(config)

    _produce(pipeline.bootstrap, pipeline.topic, 1, 400, ["", None], 10_000)
    run_pipeline(config, RunContext("only-empty-and-null"), lambda: spark)
    assert_exactly_once(config, read_topic(pipeline.bootstrap, pipeline.topic))
    assert _customers(config) == {"a": 300, "b": 300, None: 1000}
    _audits(config)


def test_the_plain_audit_finds_a_committed_file_that_lost_rows(pipeline, spark):
    config = pipeline.write(sink={"partition_by": ["customer"]})
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    _produce(pipeline.bootstrap, pipeline.topic, 1, 400, CYCLE, 0)
    (result,) = run_pipeline(config, RunContext("then-a-file-loses-rows"), lambda: spark)
    assert audit_pipeline(config).ok
    # what finding 1 did: one committed file overwritten by another run's rows (here: half of its own)
    table = storage.table(config.layout.sink)
    victim = next(p for p in table.file_uris() if "customer=a" in p).removeprefix("file://")
    written = pq.ParquetFile(victim).read()
    _overwrite_keeping_size(victim, written.slice(0, 10))
    report = audit_pipeline(config)
    assert not report.ok
    holds = 400 - (written.num_rows - 10)
    assert any(
        f"batch {result.plan.batch_id}: the ledger says 400 sink rows were written, the sink holds {holds}" in p for p in report.problems
    ), report.text()


def _overwrite_keeping_size(path: str, rows: pa.Table) -> None:
    """Replace a data file with fewer rows in exactly as many bytes (padding its footer's
    key-value metadata), as the second file of finding 1 replaced the first: readers that trust
    the logged size still open it."""
    size = os.path.getsize(path)

    def write(pad: int) -> int:
        with pq.ParquetWriter(path, rows.schema) as writer:
            writer.write_table(rows)
            if pad:
                writer.add_key_value_metadata({"pad": "x" * pad})
        return os.path.getsize(path)

    pad = 0
    while (now := write(pad)) < size:
        pad += max(1, (size - now) // 2)  # about a byte a character (the length is a varint)
    if now != size:
        raise AssertionError(f"could not rewrite {path} in {size} bytes (got {now})")


def _staged(folder, name: str, rows: int) -> StagedFile:
    path = folder / name
    pq.write_table(pa.table({"x": list(range(rows))}), path)
    return StagedFile(path=name, rows=rows, counts={}, size=path.stat().st_size)


def test_a_commit_refuses_files_that_are_not_what_their_tasks_wrote(tmp_path):
    good = _staged(tmp_path, "part-00000-a-0000.c000.snappy.parquet", 10)
    assert add_actions_for(str(tmp_path), [good]).rows == 10
    with pytest.raises(StagedFilesError, match="two files a task reported have this path"):
        add_actions_for(str(tmp_path), [good, good])
    with pytest.raises(StagedFilesError, match="holds 10 rows .* its task wrote 12 rows"):
        add_actions_for(str(tmp_path), [StagedFile(good.path, 12, {}, good.size)])
    with pytest.raises(StagedFilesError, match="holds 10 rows in .* bytes, its task wrote 10 rows in 1 bytes"):
        add_actions_for(str(tmp_path), [StagedFile(good.path, 10, {}, 1)])
    with pytest.raises(StagedFilesError, match="missing"):
        add_actions_for(str(tmp_path), [StagedFile("nothing-here.parquet", 1, {}, 1)])
