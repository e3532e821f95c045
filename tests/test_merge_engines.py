"""Merge engines (issue 38): first_row, partial_update and aggregate (per event-time window) keep
each key's state beside its row, in the batch's one commit, and equal a record-by-record replay
of everything committed (``offsetlake.engine_replay``) after batches, a backfill and a rerun."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime

import pytest
from confluent_kafka import Producer
from kafka_truth import keyed_sink_rows, last_stable_offsets
from orders_truth import backfill, committed_rows, produce, same

from offsetlake import state_table, storage
from offsetlake.audit import audit_pipeline
from offsetlake.coordinates import OFFSET, PARTITION
from offsetlake.embedded.sample_data import ensure_topic
from offsetlake.engine_replay import replay
from offsetlake.formats import CHANGE, DELETE
from offsetlake.history import sink_commits
from offsetlake.maintenance import maintain
from offsetlake.plan import RunContext
from offsetlake.runs import execute_recorded_batch, run_pipeline
from offsetlake.stream import StopControl, StreamOptions, run_stream

BASE = datetime(2026, 11, 1, tzinfo=UTC)
FIELDS = ("order_id", "customer", "amount", "currency", "created_at")


def _visible(config, group: list[str]) -> dict:
    rows = keyed_sink_rows(config.layout.sink)
    out = {tuple(r[c] for c in group): r for r in rows}
    assert len(out) == len(rows), "a group has more than one visible row"
    return out


@pytest.mark.also_on_s3
def test_an_hourly_aggregate_equals_the_replay_after_batches_a_backfill_and_a_rerun(pipeline, spark):
    ensure_topic(pipeline.bootstrap, pipeline.topic, 3)
    produce(pipeline.bootstrap, pipeline.topic, 600, seed=1, nulls=0.1)
    measures = {
        "revenue": {"sum": "amount"},
        "orders": {"count": "*"},
        "paid": {"count": "amount"},
        "smallest": {"min": "amount"},
        "largest": {"max": "amount"},
        "first_customer": {"first": "customer"},
        "last_customer": {"last": "customer"},
        "last_known_customer": {"last_non_null": "customer"},
    }
    # two batches, then one more after the next records: each folds into windows stored before it
    # (every window of 3 currencies x 6 hours is in every batch); a keyed batch costs ~5 s, the
    # number of records next to nothing
    config = pipeline.write(
        max_records_per_batch=300,
        sink={"mode": "aggregate", "key": ["currency"], "window": {"on": "created_at", "size": "1h"}, "measures": measures},
    )
    results = run_pipeline(config, RunContext("agg-1"), lambda: spark, emit=lambda _: None)
    assert len(results) >= 2, "the records must take several batches"
    group = ["currency", "window_start", "window_end"]
    same(replay(config, committed_rows(pipeline)), _visible(config, group), list(measures))

    produce(pipeline.bootstrap, pipeline.topic, 200, seed=2, nulls=0.1)
    run_pipeline(config, RunContext("agg-2"), lambda: spark, emit=lambda _: None)
    expected = replay(config, committed_rows(pipeline))
    same(expected, _visible(config, group), list(measures))
    assert sum(r["orders"] for r in expected.values()) == 800
    report = audit_pipeline(config, against_kafka=True)
    assert report.ok, report.text()
    assert report.against_kafka["groups_checked"] == len(expected) > 0, report.text()

    # today's decoding requires an amount: a backfill of [40, 120) leaves every window as if that
    # range had been read once with it (its records without an amount retracted as dead
    # letters), and every other record as it was read
    body = {**config.format.model_dump(by_alias=True, exclude_none=True), "required": ["order_id", "amount"]}
    config = pipeline.write(
        format=body,
        max_records_per_batch=300,
        sink={"mode": "aggregate", "key": ["currency"], "window": {"on": "created_at", "size": "1h"}, "measures": measures},
    )
    backfill(config, spark, 40, 120)
    rows = [r for r in committed_rows(pipeline) if not (40 <= r[OFFSET] < 120 and r["amount"] is None)]
    assert len(rows) < 800, "the range must hold records the backfill retracts"
    expected = replay(config, rows)
    same(expected, _visible(config, group), list(measures))
    stored = state_table.state_rows(config, storage.table(config.layout.sink)).to_pylist()
    contributions = [(r[PARTITION], r[OFFSET]) for r in stored if r["_offsetlake_hidden"] == "contribution"]
    assert sorted(contributions) == sorted((r[PARTITION], r[OFFSET]) for r in rows), "every kept record contributes once"
    entry = sink_commits(storage.table(config.layout.sink), config.name)[-1].entry
    assert entry.merge is not None and entry.merge["updated"] > 0, entry.merge

    version = storage.table(config.layout.sink).version()
    execute_recorded_batch(config, entry.batch_id, lambda: spark)  # a rerun of a committed batch
    assert storage.table(config.layout.sink).version() == version, "a rerun of a committed batch commits nothing"


def test_partial_updates_in_a_stream_keep_stored_values_for_nulls_and_deletes_forget_the_key(pipeline, spark):
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    produce(pipeline.bootstrap, pipeline.topic, 400, seed=3, keys=30, nulls=0.4, deletes=0.08)
    config = pipeline.write(key_format={"type": "string"}, sink={"mode": "partial_update", "key": ["_kafka_key"]})
    # as a stream of three micro-batches of at most 140 records, stopped once it has caught up
    lso = last_stable_offsets(pipeline.bootstrap, pipeline.topic)
    stop = StopControl(max_duration=240)

    def caught_up() -> None:
        while not stop.requested.is_set():
            table = storage.open_table(config.layout.sink)
            if table is not None and all(table.transaction_version(config.app_id(pipeline.topic, p)) == e for p, e in lso.items()):
                stop.request("caught up")
            time.sleep(0.5)

    watcher = threading.Thread(target=caught_up, daemon=True)
    watcher.start()
    options = StreamOptions(trigger_interval=0.2, max_records_per_batch=140, lease_ttl=10, run_id="pu-stream")
    report = run_stream(config, options, lambda: spark, stop, lambda _: None)
    assert report.stop_reason == "caught up" and report.batches >= 3, report
    rows = committed_rows(pipeline)
    assert any(r.get(CHANGE) == DELETE for r in rows) and any(r.get("customer", 1) is None for r in rows)
    expected = replay(config, rows)
    same(expected, _visible(config, ["_kafka_key"]), [*FIELDS])
    report = audit_pipeline(config, against_kafka=True)
    assert report.ok and report.against_kafka["groups_checked"] == len(expected), report.text()


@pytest.mark.parametrize("merge_on", ["driver", "spark"])
def test_first_row_keeps_each_keys_first_record_and_counts_the_duplicates(pipeline, spark, monkeypatch, merge_on):
    """Both places an ingest merges (``engine_merge``: its groups on the driver, or in Spark when
    they pass ``DRIVER_ROWS``) give the same rows and the same counts."""
    from offsetlake import engine_merge

    if merge_on == "spark":
        monkeypatch.setattr(engine_merge, "DRIVER_ROWS", 0)
    in_spark = []
    spark_merge = engine_merge.merged
    monkeypatch.setattr(
        engine_merge, "merged", lambda *a, **k: in_spark.append(a[4] if len(a) > 4 else k.get("replaced")) or spark_merge(*a, **k)
    )
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    produce(pipeline.bootstrap, pipeline.topic, 300, seed=4, keys=50)
    # two batches of 150 over 50 ids: most ids are in both, so the second counts duplicates of
    # rows the first stored; the 100 records after maintenance are one batch more
    config = pipeline.write(max_records_per_batch=150, key_format={"type": "string"}, sink={"mode": "first_row", "key": ["order_id"]})
    run_pipeline(config, RunContext("fr-1"), lambda: spark, emit=lambda _: None)
    expected = replay(config, committed_rows(pipeline))
    same(expected, _visible(config, ["order_id"]), ["customer", "amount", "currency", "created_at"])
    merges = [c.entry.merge for c in sink_commits(storage.table(config.layout.sink), config.name)]
    assert len(merges) >= 2, "the records must take several batches"
    assert sum(m["inserted"] for m in merges) == len(expected)
    assert sum(m["duplicates"] for m in merges) == 300 - len(expected)
    assert len(in_spark) == (len(merges) if merge_on == "spark" else 0), in_spark

    # maintenance compacts the sink (it holds only rows now), leaves the state table as the
    # batches wrote it, and the next batches still fold right
    reports = {r.table: r for r in maintain(config, retention_hours=168)}
    assert reports["sink"].skipped is None and reports["state"].skipped is not None, reports
    assert reports["state"].files_after == reports["state"].files_before
    same(expected, _visible(config, ["order_id"]), ["customer", "amount", "currency", "created_at"])
    produce(pipeline.bootstrap, pipeline.topic, 100, seed=5, keys=80)
    run_pipeline(config, RunContext("fr-2"), lambda: spark, emit=lambda _: None)
    same(replay(config, committed_rows(pipeline)), _visible(config, ["order_id"]), ["customer", "amount", "currency", "created_at"])


@pytest.mark.also_on_s3
@pytest.mark.parametrize("mode", ["first_row", "partial_update"])
def test_a_contribution_file_without_statistics_stays_contributions_through_later_batches(pipeline, spark, mode):
    """A batch whose records carry a non-finite double (JSON 1e400, -1e400) writes its files with no
    column statistics (``file_stats.delta_stats``: an infinite bound is not JSON, issue 48); a
    later batch must still tell its contribution file from the visible files, by its rows. Taken
    for visible rows, it was rewritten away: the fault campaign's first_row pipeline kept 136 of
    249 contributions after two batches, and its audit against Kafka found the rest in neither table."""
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    producer = Producer({"bootstrap.servers": pipeline.bootstrap})
    for i in range(60):
        amount = {7: "1e400", 33: "-1e400"}.get(i, str(i))  # batch 1 and batch 2 each hold one
        at = f"2026-11-01T0{i % 6}:00:00Z"
        value = f'{{"order_id": {i % 12}, "customer": "c{i}", "amount": {amount}, "currency": "EUR", "created_at": "{at}"}}'
        producer.produce(pipeline.topic, key=str(i % 12).encode(), value=value.encode())
    assert producer.flush(30) == 0
    config = pipeline.write(max_records_per_batch=25, key_format={"type": "string"}, sink={"mode": mode, "key": ["order_id"]})
    run_pipeline(config, RunContext(f"nf-{mode}"), lambda: spark, emit=lambda _: None)
    table = storage.table(config.layout.sink)
    assert len(sink_commits(table, config.name)) == 3
    hidden = state_table.state_rows(config, table, columns=["_offsetlake_hidden"])["_offsetlake_hidden"].to_pylist()
    assert hidden.count("contribution") == 60, "every record keeps its contribution"
    report = audit_pipeline(config, against_kafka=True)
    assert report.ok and report.against_kafka["groups_checked"] == 12, report.text()
    same(replay(config, committed_rows(pipeline)), _visible(config, ["order_id"]), ["customer", "currency", "created_at"])
