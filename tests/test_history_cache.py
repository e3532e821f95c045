"""The sink-history cache behind `sink_commits` never changes what it returns."""

from __future__ import annotations

import json
import time

import pyarrow as pa
from s3_tools import delete_tree

from offsetlake import storage
from offsetlake.entry import for_plan
from offsetlake.history import sink_commits
from offsetlake.plan import BatchPlan, OffsetRange, RunContext, new_batch_id
from offsetlake.sink import WrittenFiles, commit_batch, ensure_table

SCHEMA = pa.schema(
    [("order_id", pa.int64()), ("_kafka_topic", pa.string()), ("_kafka_partition", pa.int32()), ("_kafka_offset", pa.int64())]
)


def _commit(config, start: int) -> str:
    plan = BatchPlan(
        config.name, new_batch_id(config.name), "ingest", (OffsetRange(config.topic, 0, start, start + 1),), RunContext("cache-test")
    )
    table = ensure_table(config, SCHEMA)
    commit_batch(table, config, plan, WrittenFiles([], 0, SCHEMA), for_plan(plan, {}, time.monotonic()))
    return plan.batch_id


def _uncached(config) -> list:
    """(version, entry) of this pipeline's commits, read straight from the Delta log."""
    history = sorted(storage.table(config.layout.sink).history(), key=lambda h: h["version"])
    entries = [(int(h["version"]), json.loads(h["userMetadata"])) for h in history if h.get("userMetadata")]
    return [(v, e) for v, e in entries if e.get("pipeline") == config.name]


def test_history_cache_returns_what_the_log_holds(pipeline):
    config = pipeline.write()
    ids = [_commit(config, i) for i in range(5)]
    fs, cache = storage.filesystem(config.layout.sink.child("_offsetlake_history", f"{config.name}.json"))

    first = sink_commits(storage.table(config.layout.sink), config.name)
    assert [c.batch_id for c in first] == ids and fs.get_file_info(cache).is_file
    assert [(c.version, json.loads(c.entry.to_json())) for c in first] == _uncached(config)

    ids += [_commit(config, i) for i in range(5, 8)]  # read incrementally on top of the cache
    again = sink_commits(storage.table(config.layout.sink), config.name)
    assert [c.batch_id for c in again] == ids
    assert [(c.version, json.loads(c.entry.to_json())) for c in again] == _uncached(config)
    with fs.open_input_stream(cache) as handle:
        assert json.loads(handle.read())["version"] == storage.table(config.layout.sink).version()

    # a cache from another table at this path (the sink was deleted and recreated) is ignored
    with fs.open_input_stream(cache) as handle:
        saved = handle.read()
    delete_tree(config.layout.sink)
    fresh = [_commit(config, 0)]
    fs.create_dir(cache.rsplit("/", 1)[0], recursive=True)
    with fs.open_output_stream(cache) as out:
        out.write(saved)
    assert [c.batch_id for c in sink_commits(storage.table(config.layout.sink), config.name)] == fresh

    with fs.open_output_stream(cache) as out:
        out.write(b"{not json")  # an unreadable cache only costs a full read
    assert [c.batch_id for c in sink_commits(storage.table(config.layout.sink), config.name)] == fresh
