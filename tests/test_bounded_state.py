"""Bounded state (issue 51, item 2): a merge engine folds the contributions of records older than
``sink.fold_after`` into one row per group of its state table; every group stays exact, the
state stays within the groups plus the records not folded yet, and a backfill below the folded
offsets is refused, naming the horizon, while one above it replaces exactly."""

from __future__ import annotations

import pyarrow.compute as pc
import pytest
from kafka_truth import keyed_sink_rows
from orders_truth import committed_rows, produce, same

from offsetlake import state_table, storage
from offsetlake.audit import audit_pipeline
from offsetlake.backfill import plan_backfill
from offsetlake.coordinates import OFFSET
from offsetlake.embedded.sample_data import ensure_topic
from offsetlake.engine_replay import replay
from offsetlake.errors import BackfillParamsError, ConfigError
from offsetlake.kafka import current_offsets
from offsetlake.ledger import Ledger
from offsetlake.plan import RunContext
from offsetlake.runs import execute_recorded_batch, run_pipeline

MEASURES = {"revenue": {"sum": "amount"}, "orders": {"count": "*"}, "last_customer": {"last": "customer"}}
GROUP = ["currency", "window_start", "window_end"]


def _sink(fold_after: str) -> dict:
    window = {"on": "created_at", "size": "1h"}
    return {"mode": "aggregate", "key": ["currency"], "window": window, "measures": MEASURES, "fold_after": fold_after}


def _visible(config) -> dict:
    return {tuple(r[c] for c in GROUP): r for r in keyed_sink_rows(config.layout.sink)}


def _state(config):
    return state_table.pinned(config, storage.table(config.layout.sink))


def _exact(config, pipeline):
    expected = replay(config, committed_rows(pipeline))
    same(expected, _visible(config), list(MEASURES))
    report = audit_pipeline(config, against_kafka=True)
    assert report.ok, report.text()
    assert report.against_kafka["groups_checked"] == len(expected) > 0, report.text()
    return report


def test_folded_state_stays_exact_bounded_and_refuses_a_backfill_below_it(pipeline, spark):
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    produce(pipeline.bootstrap, pipeline.topic, 300, seed=7, nulls=0.1)
    config = pipeline.write(max_records_per_batch=100, sink=_sink("1s"))
    results = run_pipeline(config, RunContext("fold-1"), lambda: spark, emit=lambda _: None)
    assert len(results) >= 3, "the records must take several batches"

    state = _state(config)
    rows = state.to_pyarrow_table()
    contributions = rows.filter(pc.equal(rows["_offsetlake_hidden"], "contribution"))
    folded = contributions.filter(pc.is_null(contributions[OFFSET]))
    groups = len(_visible(config))
    assert 0 < folded.num_rows <= groups, "one folded row per group at most"
    own = contributions.num_rows - folded.num_rows
    assert own <= 3 * 100, f"{own} contributions of their own: only the records not folded yet may keep one"
    assert sum(r["__records"] for r in folded["_offsetlake_state"].to_pylist()) > 0
    horizon = state_table.folded_below(state)
    assert horizon and all(t == pipeline.topic and epoch == 0 for t, epoch, _ in horizon)
    report = _exact(config, pipeline)
    assert report.against_kafka["folded"] > 0, "the audit counts the folded records, checked through their groups"
    assert f"{report.against_kafka['folded']} committed offsets lie below the engine's fold horizon" in report.text()

    (topic, _, partition), below = sorted(horizon.items())[0]
    end = current_offsets(config)[(topic, partition)].last_stable
    with pytest.raises(BackfillParamsError, match=rf"below offset {below}.*sink.fold_after \(1s\)") as refused:
        plan_backfill(config, RunContext("too-old"), partitions=[partition], from_offset=0, to_offset=end)
    assert (refused.value.topic, refused.value.partition) == (topic, partition)

    # the records above the horizon keep their contributions: a backfill there replaces them
    # exactly (today's decoding requires an amount, so its records without one become dead letters)
    body = {**config.format.model_dump(by_alias=True, exclude_none=True), "required": ["order_id", "amount"]}
    config = pipeline.write(format=body, max_records_per_batch=100, sink=_sink("1s"))
    assert below < end, "the last batch's records are not folded yet"
    plan = plan_backfill(config, RunContext("above"), partitions=[partition], from_offset=below, to_offset=end)
    Ledger.of(config).record_plan(plan)
    execute_recorded_batch(config, plan.batch_id, lambda: spark)
    read_again = {(partition, o) for o in range(below, end)}
    same(replay(config, _without_amount_dropped(pipeline, read_again)), _visible(config), list(MEASURES))

    # more batches fold the backfill's contributions too; every group still equals the replay
    ends = {p: o.last_stable for (_, p), o in current_offsets(config).items()}
    produce(pipeline.bootstrap, pipeline.topic, 100, seed=8, nulls=0.1)
    run_pipeline(config, RunContext("fold-2"), lambda: spark, emit=lambda _: None)
    assert state_table.folded_below(_state(config))[(topic, 0, partition)] >= end, "the backfill's own contributions fold later"
    read_again |= {(p, o) for (_, p), offsets in current_offsets(config).items() for o in range(ends[p], offsets.last_stable)}
    same(replay(config, _without_amount_dropped(pipeline, read_again)), _visible(config), list(MEASURES))


def _without_amount_dropped(pipeline, read_with_amount_required: set[tuple[int, int]]) -> list[dict]:
    """The committed records, less those read with ``amount`` required that have none (dead letters)."""
    return [
        r
        for r in committed_rows(pipeline)
        if r.get("amount") is not None or (r["_kafka_partition"], r["_kafka_offset"]) not in read_with_amount_required
    ]


def test_fold_after_is_refused_where_nothing_folds(pipeline):
    for sink, said in (
        ({"mode": "append", "fold_after": "1d"}, "fold_after applies to the merge engines"),
        ({"mode": "first_row", "key": ["order_id"], "within": "1h", "fold_after": "1d"}, "keeps every contribution"),
        ({**_sink("soon")}, "is not a duration"),
    ):
        with pytest.raises((ConfigError, ValueError), match=said):
            pipeline.write(sink=sink)
