"""`offsetlake maintenance`: file counts go down, nothing a run or a rerun needs goes away."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from kafka_truth import assert_exactly_once, ledger_rows, read_topic
from pyarrow import fs as pafs

from offsetlake import storage
from offsetlake.backfill import plan_backfill
from offsetlake.embedded.sample_data import ensure_topic, produce_orders
from offsetlake.ledger import Ledger
from offsetlake.plan import RunContext
from offsetlake.runs import execute_recorded_batch, run_pipeline


def _staged_files(config, batch_ids: set[str]) -> list[str]:
    """Parquet files a killed attempt staged in the sink's ``data/`` folder (never committed),
    on a local folder or an object store."""
    fs, data = storage.filesystem(config.layout.sink.child("data"))
    found = fs.get_file_info(pafs.FileSelector(data, recursive=True))
    return [
        f.path
        for f in found
        if f.type == pafs.FileType.File and f.path.endswith(".parquet") and any(f.path[len(data) + 1 :].startswith(b) for b in batch_ids)
    ]


def _exists(config, path: str) -> bool:
    fs, _ = storage.filesystem(config.layout.sink)
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def _killed_after_files_written(pipeline, config) -> set[str]:
    before = {r["batch_id"] for r in ledger_rows(config)}
    crashed = pipeline.cli("run", env={"OFFSETLAKE_FAILPOINT": "after_files_written"})
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    return {r["batch_id"] for r in ledger_rows(config)} - before


@pytest.mark.also_on_s3
def test_maintenance_compacts_checkpoints_and_vacuums_without_losing_history(pipeline, spark, lake_kind, request):
    # Runs that need no crash go in-process on the session's Spark (a CLI run starts a JVM).
    # Two batches with dead letters each are enough for every table to hold files to compact
    # (maintenance checkpoints whatever the table's checkpoint interval); the backfill spans both.
    config = pipeline.write(max_records_per_batch=400)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    next_id = produce_orders(pipeline.bootstrap, pipeline.topic, 800, malformed_every=97)
    assert len(run_pipeline(config, RunContext("maintenance-1"), lambda: spark)) == 2
    backfill = plan_backfill(config, RunContext("maintenance-backfill"), [0], 0, 300)
    Ledger(config.layout.ledger, config.name).record_plan(backfill)
    assert execute_recorded_batch(config, backfill.batch_id, lambda: spark).status == "committed"

    # Two attempts died after staging their files: one three hours ago, one just now (as if
    # still in flight). Vacuum with a 1 h retention must delete the first's files only.
    # Both plan from the committed ends, so one batch's worth of records serves both.
    next_id = produce_orders(pipeline.bootstrap, pipeline.topic, 400, first_id=next_id)
    if lake_kind == "s3":  # S3 cannot backdate an object: the server stamps this attempt's 3 h ago
        server = request.getfixturevalue("s3")
        server.shift_clock(-3 * 3600)
        try:
            old_attempt = _staged_files(config, _killed_after_files_written(pipeline, config))
        finally:
            server.shift_clock(0)
    else:
        old_attempt = _staged_files(config, _killed_after_files_written(pipeline, config))
        three_hours_ago = time.time() - 3 * 3600
        for f in old_attempt:
            os.utime(f, (three_hours_ago, three_hours_ago))
    fresh_attempt = _staged_files(config, _killed_after_files_written(pipeline, config))
    assert old_attempt and fresh_attempt

    sink = storage.table(config.layout.sink)
    txns_before = {p: sink.transaction_version(config.app_id(pipeline.topic, p)) for p in (0, 1)}
    rows_before = sink.to_pyarrow_table().sort_by("_kafka_offset").sort_by("_kafka_partition")
    history_before = [h.get("userMetadata") for h in sink.history() if h.get("userMetadata")]

    too_short = pipeline.cli("maintenance", "--retention-hours", "0")
    assert too_short.returncode == 2 and "retention 0 h is below 1 h" in too_short.stderr, too_short.stderr

    done = pipeline.cli("maintenance", "--retention-hours", "1", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    reports = {r["table"]: r for r in map(json.loads, done.stdout.splitlines())}
    print(json.dumps(reports, indent=1))
    assert set(reports) == {"sink", "dead_letters", "ledger"}
    for report in reports.values():
        assert report["files_after"] < report["files_before"], report
        assert report["checkpoint_version"] is not None and report["skipped"] is None
    assert reports["ledger"]["files_after"] == 1
    assert not any(_exists(config, f) for f in old_attempt), "staged files older than the retention were kept"
    assert all(_exists(config, f) for f in fresh_attempt), "vacuum deleted the files of a batch that may be in flight"

    sink = storage.table(config.layout.sink)
    assert sink.metadata().configuration.get("delta.enableExpiredLogCleanup") == "false"
    assert {p: sink.transaction_version(config.app_id(pipeline.topic, p)) for p in (0, 1)} == txns_before
    assert sink.to_pyarrow_table().sort_by("_kafka_offset").sort_by("_kafka_partition").equals(rows_before)
    assert [h.get("userMetadata") for h in sink.history() if h.get("userMetadata")] == history_before
    log_fs, log_dir = storage.filesystem(config.layout.sink.child("_delta_log"))
    assert any(f.path.endswith(".checkpoint.parquet") for f in log_fs.get_file_info(pafs.FileSelector(log_dir)))

    # Runs go on from where they were, exactly once; the audit still finds every commit.
    produce_orders(pipeline.bootstrap, pipeline.topic, 200, first_id=next_id)
    assert run_pipeline(config, RunContext("maintenance-2"), lambda: spark), "the dead attempts' ranges and the new records"
    assert_exactly_once(config, read_topic(pipeline.bootstrap, pipeline.topic))
    audit = pipeline.cli("audit", "--against-kafka")
    assert audit.returncode == 0, audit.stdout
