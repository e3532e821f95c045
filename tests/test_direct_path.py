"""The direct path (``offsetlake.direct``): read tasks that write the batch's files themselves.

It must change where a record is decided, never what is decided: the same rows, dead letters
with the same reasons and bytes, the same per-range counts and the same file schema as the Spark
path, for every kind of record the Spark path decides differently from the read tasks
(values pyarrow refuses but Spark's ``from_json`` parses, malformed values, tombstones, a
missing required field, timestamps the sink cannot hold).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from confluent_kafka import Producer

from offsetlake import direct, storage
from offsetlake.audit import audit_pipeline
from offsetlake.embedded.sample_data import ensure_topic
from offsetlake.errors import ConfigError
from offsetlake.history import sink_commits
from offsetlake.plan import RunContext
from offsetlake.process import choose_data_path
from offsetlake.processed import DataPath
from offsetlake.runs import run_pipeline

SCHEMA = {"order_id": "long", "customer": "string", "amount": "double", "currency": "string", "created_at": "timestamp", "region": "int"}
YEAR_10000_MS = 253_402_300_800_000


def _order(order_id: int, region: int | None) -> bytes:
    return json.dumps(
        {
            "order_id": order_id,
            "customer": f"c{order_id % 7}",
            "amount": order_id / 4,
            "currency": "EUR",
            "created_at": "2026-11-01T00:00:00Z",
            "region": region,
        }
    ).encode()


def _produce_every_kind(bootstrap: str, topic: str) -> int:
    """Good orders on 3 partitions (regions 0-2 and none) with every kind of record the Spark
    path decides around them; returns how many records."""
    ensure_topic(bootstrap, topic, 3, config={"retention.ms": "-1"})
    producer = Producer({"bootstrap.servers": bootstrap})
    odd = [
        b"{broken",  # not JSON: dead letter
        None,  # tombstone: dead letter
        b"[1, 2]",  # not an object: dead letter
        b'{"customer": "no id", "created_at": "2026-11-01T00:00:00Z"}',  # required order_id missing
        b"{'order_id': 9001, 'customer': 'single quotes'}",  # pyarrow refuses, Spark parses: a row
        b'{"order_id": 9002, "created_at": 1700000000}',  # epoch seconds: Spark's row, not pyarrow's
        b'  {"order_id": 9003}',  # leading blanks: left to Spark, a row
    ]
    count = 0
    for i in range(3_000):
        producer.produce(
            topic, value=_order(i, None if i % 11 == 0 else i % 3), partition=i % 3, headers=[("h", b"\xff")] if i % 500 == 0 else None
        )
        count += 1
        if i % 400 == 0:
            producer.produce(topic, value=odd[(i // 400) % len(odd)], partition=i % 3)
            count += 1
    producer.produce(topic, value=_order(5_000, 1), partition=1, timestamp=YEAR_10000_MS + 1)  # dead letter
    count += 1
    assert producer.flush(30) == 0
    return count


def _run(pipeline, lake: Path, caplog, **overrides):
    config = pipeline.write(
        lake=str(lake), format={"type": "json", "schema": SCHEMA, "required": ["order_id"]}, sink={"partition_by": ["region"]}, **overrides
    )
    with caplog.at_level(logging.INFO, logger="offsetlake.batch"):
        caplog.clear()
        results = run_pipeline(config, RunContext("direct"), lambda: pipeline.spark)
        steps = caplog.text
    return config, results, steps


def _files(location: str) -> list[Path]:
    return [Path(uri.removeprefix("file://")) for uri in storage.table(location).file_uris()]


@pytest.mark.local_lake
def test_the_read_tasks_write_what_the_spark_path_writes(pipeline, spark, tmp_path, caplog):
    pipeline.spark = spark
    produced = _produce_every_kind(pipeline.bootstrap, pipeline.topic)

    direct_config, direct_results, direct_log = _run(pipeline, tmp_path / "direct", caplog, data_path="direct")
    assert "step=path" in direct_log and "path=direct" in direct_log
    spark_config, spark_results, spark_log = _run(pipeline, tmp_path / "spark", caplog, data_path="spark")
    assert "path=spark" in spark_log and "the pipeline says data_path: spark" in spark_log

    [d], [s] = direct_results, spark_results
    # the ledger entry records the path each batch took
    assert [c.entry.data_path for c in sink_commits(storage.table(direct_config.layout.sink), direct_config.name)] == ["direct"]
    assert [c.entry.data_path for c in sink_commits(storage.table(spark_config.layout.sink), spark_config.name)] == ["spark"]
    assert d.per_range == s.per_range
    assert d.total("records_read") == produced
    # 8 odd records (every 400th of 3,000) over 7 kinds, so "{broken" twice: 5 dead letters among
    # them, plus the record stamped in year 10000
    assert d.total("dead_letters") == 6

    order = ["_kafka_partition", "_kafka_offset"]
    rows = storage.table(direct_config.layout.sink).to_pyarrow_table().sort_by([(c, "ascending") for c in order])
    expected = storage.table(spark_config.layout.sink).to_pyarrow_table().sort_by([(c, "ascending") for c in order])
    assert rows.schema == expected.schema
    assert rows.to_pylist() == expected.to_pylist()
    by_id = {r["order_id"]: r for r in rows.to_pylist()}
    assert by_id[9001]["customer"] == "single quotes" and by_id[9002]["created_at"] is not None and 9003 in by_id
    assert storage.table(direct_config.layout.sink).schema().to_arrow() == storage.table(spark_config.layout.sink).schema().to_arrow()

    dead = storage.table(direct_config.layout.dead_letters).to_pyarrow_table().drop_columns(["batch_id", "pipeline"])
    dead_expected = storage.table(spark_config.layout.dead_letters).to_pyarrow_table().drop_columns(["batch_id", "pipeline"])
    key = [("_kafka_partition", "ascending"), ("_kafka_offset", "ascending")]
    assert dead.sort_by(key).to_pylist() == dead_expected.sort_by(key).to_pylist()
    assert {r["reason"] for r in dead.to_pylist()} >= {"value is not a JSON object", "tombstone: record has a null value"}

    # the same parquet schema in every file, partition folders named alike, no undecided file left
    direct_files, spark_files = _files(direct_config.sink_path), _files(spark_config.sink_path)
    assert {pq.read_schema(f).remove_metadata() for f in direct_files} == {pq.read_schema(f).remove_metadata() for f in spark_files}
    assert (
        {f.parent.name for f in direct_files}
        == {f.parent.name for f in spark_files}
        == {"region=0", "region=1", "region=2", "region=__HIVE_DEFAULT_PARTITION__"}
    )
    assert not list((tmp_path / "direct").rglob("undecided-*")), "the undecided records' files were not removed"
    assert audit_pipeline(direct_config, against_kafka=True).ok


def test_what_keeps_a_batch_on_the_spark_path(pipeline):
    """Each reason names itself; the shipped orders pipeline (transform, suite) stays on Spark."""
    from offsetlake.config import load_pipeline
    from offsetlake.formats import decoder_for
    from offsetlake.plan import BatchPlan, RecordTimeWindow

    plan = BatchPlan(pipeline.name, "b-1", "ingest", (), RunContext("t"))
    plain = pipeline.write()
    assert direct.problem(plain, plan, decoder_for(plain)) is None
    by_time = BatchPlan(pipeline.name, "b-2", "backfill", (), RunContext("t"), window=RecordTimeWindow(0, 1))
    assert direct.problem(plain, by_time, decoder_for(plain)) == "a backfill by record time"
    upsert = pipeline.write(sink={"mode": "upsert", "key": ["order_id"]})
    assert direct.problem(upsert, plan, decoder_for(upsert)) == "a keyed sink merges in Spark"
    shipped = load_pipeline(str(Path(__file__).parents[1] / "pipelines" / "orders.yaml"))
    assert direct.problem(shipped, plan, decoder_for(shipped)) == "a transform runs in Spark"
    (pipeline.file.parent / f"{pipeline.name}.expectations.yaml").write_text("expectations: []\n")
    with_suite = pipeline.write()
    assert direct.problem(with_suite, plan, decoder_for(with_suite)) == "the suite validates the rows in Spark"


def test_data_path_direct_is_refused_for_a_pipeline_that_needs_spark(pipeline):
    """The configuration check names the pipeline and the reason; auto and spark load."""
    with pytest.raises(ConfigError) as refused:
        pipeline.write(sink={"mode": "upsert", "key": ["order_id"]}, data_path="direct")
    assert f"data_path: pipeline {pipeline.name} cannot take the direct path: a keyed sink merges in Spark" in str(refused.value)
    assert pipeline.write(sink={"mode": "upsert", "key": ["order_id"]}, data_path="spark").data_path == "spark"
    assert pipeline.write().data_path == "auto"


def test_a_batch_that_needs_spark_fails_under_data_path_direct_before_reading(pipeline, spark):
    """What only the decoder's types tell (a string partition column) fails the batch under
    ``direct`` with the reason, and takes Spark under ``auto``; a backfill takes Spark."""
    from offsetlake.formats import decoder_for
    from offsetlake.plan import BatchPlan, OffsetRange

    plan = BatchPlan(pipeline.name, "b-1", "ingest", (OffsetRange(pipeline.topic, 0, 0, 10),), RunContext("t"))
    forced = pipeline.write(sink={"partition_by": ["customer"]}, data_path="direct")
    with pytest.raises(ConfigError, match=f"pipeline {pipeline.name}: batch b-1 cannot take the direct path .*partition column customer"):
        choose_data_path(forced, plan, spark, decoder_for(forced), adds_files=True)
    auto = pipeline.write(sink={"partition_by": ["customer"]})
    choice = choose_data_path(auto, plan, spark, decoder_for(auto), adds_files=True)
    assert choice.path is DataPath.SPARK and "partition column customer" in choice.reason
    plain = pipeline.write(data_path="direct")
    assert choose_data_path(plain, plan, spark, decoder_for(plain), adds_files=True).path is DataPath.DIRECT
    assert choose_data_path(plain, plan, spark, decoder_for(plain), adds_files=False).path is DataPath.SPARK


ENGINE_SCHEMA = {"order_id": "long", "customer": "string", "amount": "double", "qty": "long", "created_at": "timestamp"}
ENGINE_SINKS = {
    "aggregate": {
        "mode": "aggregate",
        "key": ["order_id"],
        "window": {"on": "created_at", "size": "1h"},
        "measures": {
            "revenue": {"sum": "amount"},
            "items": {"sum": "qty"},
            "orders": {"count": "*"},
            "largest": {"max": "amount"},
            "first_customer": {"first": "customer"},
            "last_customer": {"last_non_null": "customer"},
        },
        "file_rows": 40,
    },
}


def _produce_for_an_engine(bootstrap: str, topic: str, start: int, count: int, odd: bool, group_7: bool) -> None:
    """Orders over 60 ids on 3 partitions. ``odd``: with what Arrow leaves to Spark among them: a
    NaN amount (order 7 at 01:00) and single quotes (pyarrow refuses both, Spark parses them), a
    quantity of 2^40 (its sum is Spark's), a null window time and a missing id (dead letters),
    broken JSON. ``group_7``: with an order of id 7 at 01:00 (the group holding the NaN)."""
    producer = Producer({"bootstrap.servers": bootstrap})
    odd_records = [
        b'{"order_id": 7, "amount": NaN, "created_at": "2026-11-01T01:00:00Z"}',
        b"{'order_id': 8, 'customer': 'quoted', 'created_at': '2026-11-01T02:00:00Z'}",
        b'{"order_id": 9, "qty": 1099511627776, "created_at": "2026-11-01T03:00:00Z"}',
        b'{"order_id": 10, "customer": "no time"}',
        b'{"customer": "no id", "created_at": "2026-11-01T00:00:00Z"}',
        b"{broken",
    ]
    for i in range(start, start + count):
        value = {
            "order_id": i % 60 if i % 60 != 7 else 61,
            "customer": None if i % 13 == 0 else f"c{i % 7}",
            "amount": i / 4,
            "qty": i % 5,
            "created_at": f"2026-11-01T{(i // 7) % 24:02d}:{i % 60:02d}:00Z",
        }
        producer.produce(topic, value=json.dumps(value).encode(), partition=i % 3)
        if odd and i % 50 == 0:
            producer.produce(topic, value=odd_records[(i // 50) % len(odd_records)], partition=i % 3)
    if group_7:
        producer.produce(topic, value=b'{"order_id": 7, "amount": 2.5, "created_at": "2026-11-01T01:30:00Z"}', partition=1)
    assert producer.flush(30) == 0


@pytest.mark.local_lake
def test_an_engines_read_tasks_fold_what_the_spark_path_folds(pipeline, spark, tmp_path, caplog):
    """An hourly aggregate takes the direct path: the read tasks write the contributions and fold
    them per group (``offsetlake.engine_arrow``), the rows Arrow cannot fold go through the Spark
    steps. Three batches: one with such rows (merged in Spark, on the driver), one touching a
    stored state that holds a NaN (Arrow leaves its fold to Spark), one Arrow merges alone. The
    sink, the state table, the dead letters, the counts and the merge counts are the Spark path's.
    (first_row's fold is held to Spark's by test_engine_arrow.py, and its merges on the direct
    path to the replay by test_merge_engines.py.)"""
    mode = "aggregate"
    ensure_topic(pipeline.bootstrap, pipeline.topic, 3, config={"retention.ms": "-1"})
    done = {}
    merged_on = []
    for batch, (odd, group_7) in enumerate(((True, False), (False, True), (False, False))):
        _produce_for_an_engine(pipeline.bootstrap, pipeline.topic, batch * 300, 300, odd, group_7)
        for path in ("direct", "spark"):
            config = pipeline.write(
                lake=str(tmp_path / path),
                format={"type": "json", "schema": ENGINE_SCHEMA, "required": ["order_id"]},
                sink=ENGINE_SINKS[mode],
                data_path=path if path == "spark" else "auto",
            )
            with caplog.at_level(logging.INFO, logger="offsetlake.batch"):
                caplog.clear()
                [result] = run_pipeline(config, RunContext(f"engine-{batch}"), lambda: spark)
                assert f"path={path}" in caplog.text
                if path == "direct":
                    merged_on += re.findall(r"step=merge .*? on=(\w+)", caplog.text)
            done[path] = (config, result)
        (direct_config, d), (spark_config, s) = done["direct"], done["spark"]
        assert d.per_range == s.per_range, f"batch {batch}"
    assert merged_on == ["driver", "driver", "arrow"]

    def state(config):
        from offsetlake import state_table

        return state_table.pinned(config, storage.table(config.layout.sink)).to_pyarrow_table()

    group = ["order_id", "window_start", "window_end"]
    order = [(c, "ascending") for c in [*group, "_kafka_partition", "_kafka_offset"]]
    for what, read in (("sink", lambda c: storage.table(c.layout.sink).to_pyarrow_table()), ("state", state)):
        got, want = read(direct_config), read(spark_config)
        assert got.schema == want.schema, what
        got_rows = got.sort_by([o for o in order if o[0] in got.column_names]).to_pylist()
        want_rows = want.sort_by([o for o in order if o[0] in want.column_names]).to_pylist()
        assert len(got_rows) == len(want_rows) > 0, what
        for g, w in zip(got_rows, want_rows, strict=True):
            assert _close(g, w), (what, g, w)
    commits = {p: sink_commits(storage.table(c.layout.sink), c.name) for p, (c, _) in done.items()}
    assert [c.entry.data_path for c in commits["direct"]] == ["direct"] * 3
    assert [c.entry.merge for c in commits["direct"]] == [c.entry.merge for c in commits["spark"]]
    dead = storage.table(direct_config.layout.dead_letters).to_pyarrow_table().drop_columns(["batch_id", "pipeline"])
    dead_expected = storage.table(spark_config.layout.dead_letters).to_pyarrow_table().drop_columns(["batch_id", "pipeline"])
    key = [("_kafka_partition", "ascending"), ("_kafka_offset", "ascending")]
    assert dead.sort_by(key).to_pylist() == dead_expected.sort_by(key).to_pylist() != []
    leftovers = [p for p in (tmp_path / "direct").rglob("*.parquet") if p.name.startswith(("undecided-", "partial-"))]
    assert not leftovers, "the read tasks' undecided and partial files were not removed"
    assert audit_pipeline(direct_config, against_kafka=True).ok


def _close(got: dict, want: dict) -> bool:
    """Rows equal but for float sums in another order (within 1e-9)."""
    import math

    def same(a, b):
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, float) and isinstance(b, float):
            return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-9)
        return a == b

    return same(got, want)


def test_an_engines_batches_on_the_direct_path_commit_through_spark_connect(pipeline):
    """CLI runs attach to the project's Spark server (Spark Connect), which refuses a DataFrame of
    an empty Arrow table without its schema: a batch whose every record the read tasks leave to
    Spark (single quotes, which pyarrow refuses) and one they decide whole (no rows for Spark)
    both commit, and the sink counts every record (the fault campaign met the first on its
    merge engine keyed by a value column)."""
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    pipeline.write(
        format={"type": "json", "schema": ENGINE_SCHEMA, "required": ["order_id"]},
        sink={"mode": "aggregate", "key": ["order_id"], "measures": {"orders": {"count": "*"}, "items": {"sum": "qty"}}},
    )
    producer = Producer({"bootstrap.servers": pipeline.bootstrap})
    for i in range(30):  # left to Spark, every one
        producer.produce(pipeline.topic, value=f"{{'order_id': {i % 3}, 'qty': 1}}".encode(), partition=i % 2)
    assert producer.flush(30) == 0
    first = pipeline.cli("run")
    assert first.returncode == 0, first.stderr[-3000:]
    for i in range(30):  # decided by the read tasks, every one
        producer.produce(pipeline.topic, value=json.dumps({"order_id": i % 3, "qty": 2}).encode(), partition=i % 2)
    assert producer.flush(30) == 0
    second = pipeline.cli("run")
    assert second.returncode == 0, second.stderr[-3000:]
    rows = storage.table(pipeline.config().layout.sink).to_pyarrow_table().sort_by("order_id").to_pylist()
    assert [(r["order_id"], r["orders"], r["items"]) for r in rows] == [(k, 20, 30) for k in range(3)]
    assert [c.entry.data_path for c in sink_commits(storage.table(pipeline.config().layout.sink), pipeline.name)] == ["direct", "direct"]
