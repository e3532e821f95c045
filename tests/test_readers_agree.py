"""Every reader of a sink table sees what a user expects (issue 51): plain delta-rs, delta-spark's
``spark.read.format("delta")`` and ``offsetlake sql`` read each kind of sink — append, upsert
with deletes, first_row, partial_update with deletes, an hourly aggregate — with no filter and
see the same rows, equal to an oracle of the committed records, after a crash between a keyed
batch's state commit and its sink commit, the run that recovers, a backfill, a rewind and
maintenance."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from collections import Counter
from datetime import UTC, datetime

import pytest
from conftest import ROOT
from deltalake import DeltaTable
from kafka_truth import PRIVATE_COLUMNS
from orders_truth import backfill, committed_rows, produce

from offsetlake import failpoints, storage
from offsetlake.coordinates import OFFSET, PARTITION
from offsetlake.embedded.sample_data import ensure_topic
from offsetlake.engine_replay import replay
from offsetlake.formats import CHANGE, DELETE
from offsetlake.history import sink_commits
from offsetlake.maintenance import maintain
from offsetlake.plan import RunContext
from offsetlake.rewind import rewind_pipeline
from offsetlake.runs import run_pipeline
from offsetlake.sink import committed_end

MEASURES = {"revenue": {"sum": "amount"}, "orders": {"count": "*"}, "last_customer": {"last": "customer"}}
SINKS = {
    "append": {"mode": "append"},
    "upsert": {"mode": "upsert", "key": ["_kafka_key"]},
    "first_row": {"mode": "first_row", "key": ["_kafka_key"]},
    "partial_update": {"mode": "partial_update", "key": ["_kafka_key"]},
    "aggregate": {"mode": "aggregate", "key": ["currency"], "window": {"on": "created_at", "size": "1h"}, "measures": MEASURES},
}
VALUES = ("order_id", "customer", "amount", "currency", "created_at")


def _expected(config, topic: list[dict]) -> dict[tuple, dict]:
    """The oracle: what the sink must hold for the topic's records (``committed_rows``) below the
    committed ends, by row key."""
    ends = {}
    table = storage.table(config.layout.sink)
    records = []
    for r in topic:
        p = r[PARTITION]
        if p not in ends:
            ends[p] = committed_end(table, config, r["_kafka_topic"], p) or 0
        if r[OFFSET] < ends[p]:
            records.append(r)
    mode = config.sink.mode
    if mode == "append":
        return {(r[PARTITION], r[OFFSET]): {c: r[c] for c in VALUES} for r in records if r.get(CHANGE) != DELETE}
    if mode == "upsert":
        newest: dict[str, dict | None] = {}
        for r in sorted(records, key=lambda r: (r[PARTITION], r[OFFSET])):  # a key lives in one partition
            newest[r["_kafka_key"]] = None if r.get(CHANGE) == DELETE else {c: r[c] for c in VALUES}
        return {(k,): row for k, row in newest.items() if row is not None}
    taken = [r for r in records if mode == "partial_update" or r.get(CHANGE) != DELETE]
    return {k if isinstance(k, tuple) else (k,): v for k, v in replay(config, taken).items()}


def _key(config, row: dict) -> tuple:
    mode = config.sink.mode
    if mode == "append":
        return (row[PARTITION], row[OFFSET])
    if mode == "aggregate":
        return tuple(_instant(row[c]) for c in ("currency", "window_start", "window_end"))
    return (row["_kafka_key"],)


def _instant(value):
    return value.astimezone(UTC) if isinstance(value, datetime) else value


def _compared(config) -> list[str]:
    return list(MEASURES) if config.sink.mode == "aggregate" else list(VALUES)


def _by_key(config, rows: list[dict], reader: str) -> dict[tuple, dict]:
    private = sorted({c for r in rows[:1] for c in r if c in PRIVATE_COLUMNS})
    assert not private, f"{reader} sees offsetlake-private columns {private}"
    keys = Counter(_key(config, r) for r in rows)
    twice = [k for k, n in keys.items() if n > 1]
    assert not twice, f"{reader} sees {len(twice)} keys more than once, e.g. {twice[:3]}"
    return {_key(config, r): r for r in rows}


def _agree(config, topic: list[dict], spark, step: str) -> dict[tuple, dict]:
    """delta-rs and delta-spark (when given a session) read the sink with no filter and see the
    oracle's rows."""
    path = config.layout.sink.path
    expected = _expected(config, topic)
    seen = {"delta-rs": _by_key(config, DeltaTable(path).to_pyarrow_table().to_pylist(), "delta-rs")}
    if spark is not None:
        seen["delta-spark"] = _by_key(config, [r.asDict() for r in spark.read.format("delta").load(path).collect()], "delta-spark")
    for reader, rows in seen.items():
        _same(expected, rows, _compared(config), f"{step}, {reader}")
    return expected


def _same(expected: dict, actual: dict, columns: list[str], where: str) -> None:
    assert set(actual) == set(expected), f"{where}: rows differ: {sorted(set(actual) ^ set(expected), key=str)[:6]}"
    for key, row in expected.items():
        for column in columns:
            want, got = _instant(row.get(column)), _instant(actual[key].get(column))
            if isinstance(want, float) and isinstance(got, float):
                assert math.isclose(want, got, rel_tol=1e-9), (where, key, column, want, got)
            else:
                assert want == got, (where, key, column, want, got)


def _sql_rows(folder, pipelines: dict, remote: str) -> dict[str, list[dict]]:
    """Each sink's rows as ``offsetlake sql`` (delta-spark, every pipeline's tables by name) shows
    them, attached to the warm Spark server as sql is by default (the classic session's sql is
    test_delta_spark's and test_foreign_commits')."""
    statements = "".join(f"SELECT '{kind}' AS kind, to_json(struct(*)) AS row FROM {p.name};\n" for kind, p in pipelines.items())
    done = subprocess.run(
        [sys.executable, "-m", "offsetlake", "--pipelines-dir", str(folder), "sql", "--json", "--limit", "0", "--remote", remote],
        input=statements,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows: dict[str, list[dict]] = {kind: [] for kind in pipelines}
    for line in done.stdout.splitlines():
        shown = json.loads(line)
        row = json.loads(shown["row"])
        for c in ("created_at", "window_start", "window_end"):
            if isinstance(row.get(c), str):
                row[c] = datetime.fromisoformat(row[c].replace("Z", "+00:00"))
        rows[shown["kind"]].append(row)
    return rows


def _crash_at_the_second():
    """A failpoint hook that lets a run's first batch pass and crashes its second."""
    hits = []

    def crash(_name: str) -> None:
        hits.append(_name)
        if len(hits) == 2:
            raise failpoints.SimulatedCrash()

    return crash


@pytest.mark.local_lake
def test_every_reader_sees_the_same_rows_as_the_oracle(pipeline, spark, spark_server):
    """The five kinds of sink side by side on one topic (upsert and partial_update see its
    tombstones as deletes; first_row, the aggregate and the append sink as dead letters).

    Over the 60 s budget on purpose: it is five pipelines through five operations with a plain
    reader after each and one `offsetlake sql` at the end; one test instead of five saves four
    fixtures. delta-spark reads after the crash and after maintenance, delta-rs after each step
    (a delta-spark read of the five tables costs some 15 s a step, delta-rs' 0.1 s)."""
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    produce(pipeline.bootstrap, pipeline.topic, 240, seed=51, keys=30, nulls=0.1, deletes=0.08)
    pipelines = {kind: dataclasses.replace(pipeline, name=f"{pipeline.name}_{kind}") for kind in SINKS}
    # two batches of 120 per sink (a keyed batch is ~5 s whatever its size, so each batch fewer
    # here is five fewer in the test): the first run dies in its second batch, between a keyed
    # batch's two commits (an append sink: once its files are written), and the next run reads
    # that batch again; the rewind to the first batch undoes the second and the backfill
    configs = {kind: p.write(key_format={"type": "string"}, max_records_per_batch=120, sink=SINKS[kind]) for kind, p in pipelines.items()}

    # nothing is produced after this: one read of the topic serves the 25 oracles below (~0.5 s each)
    topic = committed_rows(pipeline)

    def agree(step: str, spark=None) -> dict[str, dict]:
        return {kind: _agree(config, topic, spark, f"{kind}, {step}") for kind, config in configs.items()}

    for kind, config in configs.items():
        where = failpoints.STATE_NAMES[0] if config.sink.mode != "append" else "after_files_written"
        with failpoints.on(where, _crash_at_the_second()), pytest.raises(failpoints.SimulatedCrash):
            run_pipeline(config, RunContext(f"agree-crash-{kind}"), lambda: spark, emit=lambda _: None)
        assert len(sink_commits(storage.table(config.layout.sink), config.name)) == 1, f"{kind}: the first batch committed"
    assert all(agree("after a crash in the second batch", spark).values())
    for kind, config in configs.items():
        assert len(run_pipeline(config, RunContext(f"agree-{kind}"), lambda: spark, emit=lambda _: None)) == 1
    agree("after the run that recovered")
    for kind, config in configs.items():
        if config.sink.mode != "append":
            state = storage.table(config.layout.state)
            assert state.to_pyarrow_dataset().count_rows() > 0, f"{kind}: a keyed sink's state lives in its state table"

    for config in configs.values():
        backfill(config, spark, 10, 40)
    agree("after a backfill")

    for config in configs.values():
        first = sink_commits(storage.table(config.layout.sink), config.name)[0].batch_id
        rewind_pipeline(config, first, reason="readers test")
    agree("after a rewind")

    for config in configs.values():
        maintain(config, retention_hours=168)
    expected = agree("after maintenance", spark)
    shown = _sql_rows(pipeline.folder, pipelines, spark_server)
    for kind, config in configs.items():
        _same(expected[kind], _by_key(config, shown[kind], "offsetlake sql"), _compared(config), f"{kind}, offsetlake sql")
