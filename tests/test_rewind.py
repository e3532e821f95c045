"""Rewind to batch k of n: one commit restores the sink as of k; the next run restores exactly once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable
from kafka_truth import assert_exactly_once, ledger_rows, read_topic
from s3_tools import delete_file

from offsetlake import storage
from offsetlake.audit import audit_pipeline
from offsetlake.embedded.sample_data import ensure_topic, produce_orders
from offsetlake.errors import RewindError, StalePlanError
from offsetlake.history import sink_commits
from offsetlake.ledger import Ledger
from offsetlake.plan import RunContext
from offsetlake.rewind import rewind_pipeline
from offsetlake.runs import execute_recorded_batch, run_pipeline

ROOT = Path(__file__).resolve().parent.parent


def _rows(table: DeltaTable) -> list[tuple]:
    data = table.to_pyarrow_dataset().to_table()
    data = data.select(sorted(data.column_names))
    return sorted(tuple(row.values()) for row in data.to_pylist())


def _txns(config, table: DeltaTable, partitions) -> dict[int, int | None]:
    return {p: table.transaction_version(config.app_id(config.topic, p)) for p in partitions}


def _dead_letter_batches(config) -> list[str]:
    return storage.table(config.layout.dead_letters).to_pyarrow_dataset().to_table(columns=["batch_id"])["batch_id"].to_pylist()


@pytest.mark.also_on_s3
def test_rewind_to_batch_2_of_4_restores_it_and_the_next_run_restores_everything(pipeline, spark):
    config = pipeline.write(max_records_per_batch=500)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    next_id = produce_orders(pipeline.bootstrap, pipeline.topic, 1_000, malformed_every=37)
    first = run_pipeline(config, RunContext("before"), lambda: spark)
    # a partition added after batch 2: it has no txn at batch 2's version
    ensure_topic(pipeline.bootstrap, pipeline.topic, 3)
    produce_orders(pipeline.bootstrap, pipeline.topic, 400, first_id=next_id, partition=2, malformed_every=37)
    produce_orders(pipeline.bootstrap, pipeline.topic, 600, first_id=next_id + 1_000, malformed_every=37)
    second = run_pipeline(config, RunContext("after"), lambda: spark)
    batches = [r.plan.batch_id for r in first + second]
    assert len(first) == 2 and len(second) == 2, batches
    k, later = batches[1], batches[2:]
    version_k = first[1].sink_version
    then = storage.table(config.layout.sink, version=version_k)
    expected_rows, expected_txns = _rows(then), _txns(config, then, [0, 1])
    assert expected_txns[0] is not None and _txns(config, then, [2])[2] is None
    dead_before = _dead_letter_batches(config)
    # compaction after batch k: the rewind must re-add batch 1..2's files and drop the compacted one
    assert storage.table(config.layout.sink).optimize.compact()["numFilesRemoved"] > 0
    assert {b for b in dead_before} & set(later), "batches 3..4 must have dead letters to rewind"

    unknown = pipeline.cli("rewind", "--to-batch", "no-such-batch")
    assert unknown.returncode == 2, unknown.stderr[-2000:]
    assert f"pipeline {config.name}: cannot rewind to batch no-such-batch: no such batch" in unknown.stderr

    version_before = storage.table(config.layout.sink).version()
    ledger_before = ledger_rows(config)
    dry = pipeline.cli("rewind", "--to-batch", k, "--dry-run")
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert all(b in dry.stdout for b in later) and "dry run: nothing written" in dry.stdout
    assert f"{config.topic}[2]  " in dry.stdout and "-> 0" in dry.stdout, dry.stdout
    assert storage.table(config.layout.sink).version() == version_before, "--dry-run must not commit"
    assert ledger_rows(config) == ledger_before, "--dry-run must not touch the ledger"
    assert _dead_letter_batches(config) == dead_before, "--dry-run must not touch dead letters"

    done = pipeline.cli("rewind", "--to-batch", k, "--reason", "bug in the 14:00 deploy", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert [b["batch_id"] for b in result["rewound"]] == later
    sink = storage.table(config.layout.sink)
    assert sink.version() == version_before + 1, "a rewind is ONE sink commit"
    assert result["remove_files"] and result["readd_files"]
    assert _rows(sink) == expected_rows, "the sink must equal time travel to batch k's version"
    assert _txns(config, sink, [0, 1]) == expected_txns
    assert _txns(config, sink, [2]) == {2: 0}, "a partition without a txn at batch k restarts at its first start"
    entry = json.loads(sink.history(1)[0]["userMetadata"])
    assert entry["kind"] == "rewind" and entry["rewound"] == later and entry["to_batch"] == k
    assert entry["reason"] == "bug in the 14:00 deploy"
    statuses = {r["batch_id"]: r["status"] for r in Ledger(config.layout.ledger, config.name).batches()}
    assert [statuses[b] for b in batches] == ["committed", "committed", "rewound", "rewound"]
    dead_after = _dead_letter_batches(config)
    assert not set(dead_after) & set(later), "dead letters of rewound batches must go"
    assert sorted(dead_after) == sorted(b for b in dead_before if b not in later)
    audit = audit_pipeline(config)
    assert audit.ok, audit.text()
    with pytest.raises(RewindError, match=f"batch {later[0]}: that batch was itself rewound"):
        rewind_pipeline(config, later[0])
    # an Airflow retry or clear of a rewound batch's dag run must not apply its old plan again
    version = storage.table(config.layout.sink).version()
    with pytest.raises(StalePlanError, match=f"batch {later[0]} was rewound by"):
        execute_recorded_batch(config, later[0], lambda: spark)
    assert storage.table(config.layout.sink).version() == version

    config = pipeline.write(max_records_per_batch=1_000)  # one batch reprocesses both rewound ones
    rerun = run_pipeline(config, RunContext("rerun"), lambda: spark)
    assert rerun and rerun[0].plan.ranges[0].start == expected_txns[0]
    assert_exactly_once(config, read_topic(pipeline.bootstrap, pipeline.topic))

    # the sink's history stays the truth: a rebuilt ledger still says rewound, not committed
    ledger = Ledger(config.layout.ledger, config.name)
    ledger.rebuild(sink_commits(storage.table(config.layout.sink), config.name))
    rebuilt = {r["batch_id"]: r["status"] for r in ledger.batches(pc.field("batch_id").isin(batches))}
    assert [rebuilt[b] for b in batches] == ["committed", "committed", "rewound", "rewound"]
    final = audit_pipeline(config, against_kafka=True)
    assert final.ok, final.text()

    # files of the target version gone from disk (vacuumed): refused whole, nothing written
    compacted = storage.table(config.layout.sink)
    assert compacted.optimize.compact()["numFilesRemoved"] > 0
    gone = storage.table(config.layout.sink, version=first[0].sink_version).file_uris()[0]
    delete_file(gone, config.layout.sink.options)
    version = storage.table(config.layout.sink).version()
    with pytest.raises(RewindError, match=f"batch {batches[0]}: 1 data files of sink version .* are gone from disk"):
        rewind_pipeline(config, batches[0])
    assert storage.table(config.layout.sink).version() == version


def test_rewind_dag_parses_with_its_params(pipeline, tmp_path):
    probe = (
        "import json, runpy; g = runpy.run_path('dags/offsetlake_dags.py'); "
        f"dag = g['{pipeline.name}_rewind']; "
        "print(json.dumps({'params': sorted(dag.params.keys()), 'tasks': [t.task_id for t in dag.tasks], "
        "'schedule': str(dag.schedule)}))"
    )
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(tmp_path / "airflow_home"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "OFFSETLAKE_PIPELINES_DIR": str(pipeline.folder),
    }
    parsed = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=ROOT, timeout=180)
    assert parsed.returncode == 0, parsed.stderr[-3000:]
    shape = json.loads(parsed.stdout.strip().splitlines()[-1])
    assert shape == {"params": ["dry_run", "reason", "to_batch"], "tasks": ["rewind"], "schedule": "None"}
