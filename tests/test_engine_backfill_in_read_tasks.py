"""A merge engine's backfill takes the read tasks (the direct path) where its ingest does: they
write the backfill's contributions and fold its groups' partial states, the records they cannot
decide alone go through Spark, and the merge folds the touched groups from both. The result is
the Spark path's, row for row, dead letters included, and a backfill that loses its commit to a
compaction stages again from the same read."""

from __future__ import annotations

import logging

import pytest
from confluent_kafka import Producer
from orders_truth import backfill, produce, same
from test_merge_engines import _visible

from offsetlake import failpoints, storage
from offsetlake.backfill import plan_backfill
from offsetlake.embedded.sample_data import ensure_topic
from offsetlake.history import sink_commits
from offsetlake.ledger import Ledger
from offsetlake.plan import RunContext
from offsetlake.runs import execute_recorded_batch, run_pipeline

MEASURES = {"revenue": {"sum": "amount"}, "orders": {"count": "*"}, "largest": {"max": "amount"}, "last_customer": {"last": "customer"}}
SINKS = [
    pytest.param(
        {"mode": "aggregate", "key": ["currency"], "window": {"on": "created_at", "size": "1h"}, "measures": MEASURES},
        ["currency", "window_start", "window_end"],
        id="aggregate",
    ),
    pytest.param({"mode": "first_row", "key": ["order_id"]}, ["order_id"], id="first_row"),
]
# values the read tasks leave to Spark: rows Spark decodes, and dead letters
ODD = [b'  {"order_id": 7001, "currency": "EUR", "amount": 2.5, "created_at": "2026-11-01T01:00:00Z"}', b"{broken", b"[1, 2]"]


def _produce(bootstrap: str, topic: str) -> None:
    """600 orders in three runs, ten odd values after each of the first two (inside the backfills' ranges)."""
    producer = Producer({"bootstrap.servers": bootstrap})
    for run in range(3):
        produce(bootstrap, topic, 200, seed=17 + run, nulls=0.1)
        for i in range(10 if run < 2 else 0):
            producer.produce(topic, value=ODD[i % len(ODD)], partition=i % 2)
        assert producer.flush(30) == 0


def _dead_letters(config) -> list[tuple]:
    rows = storage.table(config.layout.dead_letters).to_pyarrow_table().to_pylist()
    return sorted((r["_kafka_partition"], r["_kafka_offset"], r["reason"]) for r in rows)


def _paths(config) -> list[str]:
    return [c.entry.data_path for c in sink_commits(storage.table(config.layout.sink), config.name)]


@pytest.mark.parametrize(("sink", "group"), SINKS)
def test_an_engine_backfill_in_the_read_tasks_equals_the_spark_path(pipeline, spark, tmp_path, caplog, sink, group):
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    _produce(pipeline.bootstrap, pipeline.topic)
    results = {}
    for path in ("auto", "spark"):
        config = pipeline.write(lake=str(tmp_path / path), data_path=path, max_records_per_batch=200, sink=sink)
        run_pipeline(config, RunContext(f"ingest-{path}"), lambda: spark, emit=lambda _: None)
        with caplog.at_level(logging.INFO, logger="offsetlake.batch"):
            caplog.clear()
            backfill(config, spark, 30, 180)
            backfill(config, spark, 60, 90)  # inside the first backfill's own files
            log = caplog.text
        results[path] = (config, log)
    direct, direct_log = results["auto"]
    spark_config, spark_log = results["spark"]
    assert "path=direct" in direct_log and "path=spark" not in direct_log
    assert "path=spark" in spark_log
    assert _paths(direct)[-2:] == ["direct", "direct"] and set(_paths(spark_config)) == {"spark"}
    assert not list((tmp_path / "auto").rglob("undecided-*")), "the read tasks' undecided files are removed once the batch is done"
    expected = _visible(spark_config, group)
    same(expected, _visible(direct, group), list(next(iter(expected.values()))))
    # the backfills' ranges hold odd values: the direct path's Spark steps decided them as the Spark path's did
    dead = _dead_letters(direct)
    assert dead == _dead_letters(spark_config) and any(30 <= offset < 180 for _, offset, _ in dead), dead
    assert pipeline.cli("audit", "--against-kafka").returncode == 0  # the pipeline file names the spark lake last


def test_an_engine_backfill_that_loses_its_commit_stages_again_from_its_read(pipeline, spark, caplog):
    """A compaction of the sink between the backfill's state commit and its sink commit: the
    commit conflicts and the backfill stages again, folding the same read tasks' partial states
    (kept until the batch is done) and Spark's rows of the records they left undecided."""
    from offsetlake.maintenance import maintain

    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    _produce(pipeline.bootstrap, pipeline.topic)
    sink = {"mode": "aggregate", "key": ["currency"], "window": {"on": "created_at", "size": "1h"}, "measures": MEASURES}
    group = ["currency", "window_start", "window_end"]
    config = pipeline.write(max_records_per_batch=200, sink=sink)
    run_pipeline(config, RunContext("ingest"), lambda: spark, emit=lambda _: None)
    before = _visible(config, group)
    compactions = []

    def compact_once(_name: str) -> None:
        if not compactions:
            compactions.append(next(r for r in maintain(config, vacuum=False) if r.table == "sink"))

    plan = plan_backfill(config, RunContext("backfill-racing-compaction"), [0, 1], 30, 180)
    Ledger.of(config).record_plan(plan)
    with caplog.at_level(logging.INFO, logger="offsetlake.batch"), failpoints.on("after_state_commit", compact_once):
        assert execute_recorded_batch(config, plan.batch_id, lambda: spark).status == "committed"
    assert compactions and compactions[0].compacted_from >= 1, "the compaction must replace the sink file the backfill rewrites"
    assert "step=retry_commit" in caplog.text and "path=direct" in caplog.text
    same(before, _visible(config, group), list(MEASURES))  # the same records again: the same groups
    audit = pipeline.cli("audit", "--against-kafka")
    assert audit.returncode == 0, audit.stdout + audit.stderr
