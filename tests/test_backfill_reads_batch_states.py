"""A merge engine's backfill folds the groups it touches from the batch states of the files it
does not replace (``offsetlake.state_segments``), not from every contribution again; a batch
state that is stale (one of its files replaced) or unreadable is never used, and the groups
still equal the replay."""

from __future__ import annotations

import logging
import re

import pytest
from orders_truth import backfill, committed_rows, produce, same
from test_merge_engines import _visible

from offsetlake import state_segments, storage
from offsetlake.embedded.sample_data import ensure_topic
from offsetlake.engine_replay import replay
from offsetlake.plan import RunContext
from offsetlake.runs import run_pipeline
from offsetlake.sink import live_files

MEASURES = {"revenue": {"sum": "amount"}, "orders": {"count": "*"}, "largest": {"max": "amount"}, "last_customer": {"last": "customer"}}
GROUP = ["currency", "window_start", "window_end"]


def _step_line(caplog, step: str) -> str:
    lines = [r.getMessage() for r in caplog.records if f"step={step} " in r.getMessage()]
    assert lines, f"the backfill logged no {step} step"
    return lines[-1]


def _segments_read(caplog) -> int:
    lines = [r.getMessage() for r in caplog.records if "step=merge" in r.getMessage()]
    assert lines, "the backfill logged no merge step"
    found = re.search(r"segments=(\d+)", lines[-1])
    assert found, lines[-1]
    return int(found.group(1))


@pytest.mark.also_on_s3
def test_a_backfill_folds_the_batch_states_of_the_files_it_keeps(pipeline, spark, caplog):
    ensure_topic(pipeline.bootstrap, pipeline.topic, 3)
    produce(pipeline.bootstrap, pipeline.topic, 900, seed=5, nulls=0.1)
    sink = {"mode": "aggregate", "key": ["currency"], "window": {"on": "created_at", "size": "1h"}, "measures": MEASURES}
    config = pipeline.write(max_records_per_batch=300, sink=sink)
    results = run_pipeline(config, RunContext("states-1"), lambda: spark, emit=lambda _: None)
    assert len(results) == 3
    state = config.layout.state
    segments = state_segments.listed(state)
    live = set(state_segments.file_paths(live_files(storage.table(state))))
    assert len(segments) == 3 and all(s.files <= live for s in segments), (segments, live)  # one per batch: the direct path

    # [10, 60) of every partition lies in the first batch ([0, 100) of each): the other two
    # batches' files are kept whole, and their states stand for their 600 contributions
    caplog.set_level(logging.INFO, logger="offsetlake")
    backfill(config, spark, 10, 60)
    assert _segments_read(caplog) == 2
    # its read tasks wrote its contributions and folded them, as an ingest's do: a batch state of its own
    assert "path=direct" in _step_line(caplog, "path")
    same(replay(config, committed_rows(pipeline)), _visible(config, GROUP), list(MEASURES))
    live = set(state_segments.file_paths(live_files(storage.table(state))))
    stale = [s for s in segments if not s.files <= live]
    assert len(stale) == 1, "the backfill replaced the first batch's files: its state is stale"
    (own,) = [s for s in state_segments.listed(state) if s.path not in {b.path for b in segments}]
    assert own.files <= live and own.rows > 0

    # a batch state cut short is not read: its files are folded instead, with the same result
    kept = sorted((s for s in segments if s.files <= live), key=lambda s: s.path)
    fs, root = storage.filesystem(state)
    with fs.open_output_stream(f"{root.rstrip('/')}/{kept[0].path}") as out:
        out.write(b"PAR1 cut short")
    caplog.clear()
    backfill(config, spark, 20, 70)
    assert _segments_read(caplog) == 1
    same(replay(config, committed_rows(pipeline)), _visible(config, GROUP), list(MEASURES))

    # maintenance removes the stale states (the first batch's and the first backfill's, whose
    # files the second replaced) and the unreadable one, and keeps those still usable
    live = state_segments.file_paths(live_files(storage.table(state)))
    assert state_segments.remove_unused(state, live, older_than_s=0) == 3
    left = [s.path for s in state_segments.listed(state)]
    assert kept[1].path in left and own.path not in left and len(left) == 2


@pytest.mark.also_on_s3
@pytest.mark.parametrize(
    "sink",
    [
        pytest.param(
            {"mode": "aggregate", "key": ["currency"], "window": {"on": "created_at", "size": "1h"}, "measures": MEASURES}, id="aggregate"
        ),
        pytest.param({"mode": "first_row", "key": ["order_id"]}, id="first_row"),
    ],
)
def test_the_audit_compares_each_batch_state_with_the_fold_of_its_files(pipeline, spark, sink):
    """``audit`` folds the contribution files each usable batch state names and compares the two
    group by group: a batch state that is not their exact fold (here one group's state changed
    on purpose, its footer kept) is a problem naming the state and the group; a stale one (a
    file of it replaced by a backfill) is never used and not compared."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from offsetlake.audit import audit_pipeline
    from offsetlake.engines import RECORDS, STATE

    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    produce(pipeline.bootstrap, pipeline.topic, 200, seed=9, nulls=0.1)
    config = pipeline.write(max_records_per_batch=100, sink=sink)
    run_pipeline(config, RunContext("audit-states"), lambda: spark, emit=lambda _: None)
    segments = state_segments.listed(config.layout.state)
    assert len(segments) == 2
    report = audit_pipeline(config)
    assert report.ok, report.text()
    assert report.batch_states == 2, report.text()
    assert "2 batch states compared" in report.text()

    # one group's record count doubled, the footer (the files it folds) kept
    fs, root = storage.filesystem(config.layout.state)
    path = f"{root.rstrip('/')}/{segments[0].path}"
    with fs.open_input_file(path) as handle:
        rows = pq.read_table(handle)
    state = rows.column(STATE).combine_chunks()
    records = state.field(RECORDS)
    changed = pc.if_else(pa.array([i == 0 for i in range(rows.num_rows)]), pc.multiply(records, 2), records)
    fields = [changed if f.name == RECORDS else state.field(f.name) for f in state.type]
    wrong = rows.set_column(rows.schema.get_field_index(STATE), STATE, pa.StructArray.from_arrays(fields, fields=list(state.type)))
    with fs.open_output_stream(path) as out:
        pq.write_table(wrong.replace_schema_metadata(rows.schema.metadata), out)
    report = audit_pipeline(config)
    assert not report.ok
    assert any(segments[0].path in p and "the fold of its files gives" in p for p in report.problems), report.problems
    with fs.open_output_stream(path) as out:
        pq.write_table(rows, out)

    # a backfill of the first offsets replaces a batch's files: its state is stale, never used,
    # and the audit compares only the states whose files are all live (the other batch's, and
    # the backfill's own: its read tasks folded its contributions)
    backfill(config, spark, 0, 10)
    report = audit_pipeline(config)
    assert report.ok, report.text()
    live = set(state_segments.file_paths(live_files(storage.table(config.layout.state))))
    usable = [s for s in segments if s.files <= live]
    assert len(usable) == 1, (segments, live)
    own = [s for s in state_segments.listed(config.layout.state) if s.path not in {b.path for b in segments}]
    assert len(own) == 1 and own[0].files <= live, own
    assert report.batch_states == 2, report.text()
