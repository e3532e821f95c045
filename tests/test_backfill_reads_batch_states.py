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
    same(replay(config, committed_rows(pipeline)), _visible(config, GROUP), list(MEASURES))
    live = set(state_segments.file_paths(live_files(storage.table(state))))
    stale = [s for s in segments if not s.files <= live]
    assert len(stale) == 1, "the backfill replaced the first batch's files: its state is stale"

    # a batch state cut short is not read: its files are folded instead, with the same result
    kept = sorted((s for s in segments if s.files <= live), key=lambda s: s.path)
    fs, root = storage.filesystem(state)
    with fs.open_output_stream(f"{root.rstrip('/')}/{kept[0].path}") as out:
        out.write(b"PAR1 cut short")
    caplog.clear()
    backfill(config, spark, 20, 70)
    assert _segments_read(caplog) == 1
    same(replay(config, committed_rows(pipeline)), _visible(config, GROUP), list(MEASURES))

    # maintenance removes the stale states and the unreadable one, and keeps the one still usable
    live = state_segments.file_paths(live_files(storage.table(state)))
    assert state_segments.remove_unused(state, live, older_than_s=0) == 2
    assert [s.path for s in state_segments.listed(state)] == [kept[1].path]
