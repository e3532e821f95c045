"""A sink table belongs to one pipeline: a second pipeline naming it is refused, naming both.

Found by an adversarial run (issue 35, finding 6): pipelines eu and us (own topics) both with
``sink: {table: <lake>/orders}`` ran interleaved, and ``rewind eu`` restored the whole table to
one of eu's versions, removing us's later files while us's txns stayed: 200 us records lost for
good, found only by ``audit us --against-kafka``. Rewind, backfill and maintenance work on a
table's versions and files, so the table is one pipeline's; topics are merged with ``topics:``.
"""

from __future__ import annotations

import json
import uuid

import pyarrow as pa
import pytest
from conftest import Pipeline
from deltalake import CommitProperties
from kafka_truth import assert_exactly_once, read_topic

from offsetlake import storage
from offsetlake.audit import audit_pipeline
from offsetlake.embedded.sample_data import ensure_topic, produce_orders
from offsetlake.errors import SinkOwnedError
from offsetlake.plan import RunContext
from offsetlake.rewind import rewind_pipeline
from offsetlake.runs import run_pipeline
from offsetlake.sink import ensure_table


def _second_pipeline(first: Pipeline, name: str) -> Pipeline:
    """Another pipeline in the same folder and lake, with its own topic."""
    suffix = uuid.uuid4().hex[:8]
    return Pipeline(
        name=f"{name}_{suffix}",
        topic=f"t_{name}_{suffix}",
        folder=first.folder,
        lake=first.lake,
        bootstrap=first.bootstrap,
        lake_uri=first.lake_uri,
        storage=first.storage,
    )


def _audit_ok(config, records: int) -> None:
    report = audit_pipeline(config, against_kafka=True)
    assert report.ok, report.text()
    assert report.against_kafka is not None and report.against_kafka["records"] == records


@pytest.mark.also_on_s3
def test_a_second_pipeline_on_the_same_sink_table_is_refused_naming_both(pipeline, spark):
    shared = storage.child(pipeline.lake_uri or str(pipeline.lake), "orders")
    eu = pipeline
    us = _second_pipeline(pipeline, "us")
    eu_config = eu.write(sink={"table": shared}, max_records_per_batch=100)
    us_config = us.write(sink={"table": shared}, max_records_per_batch=100)
    for p in (eu, us):
        ensure_topic(p.bootstrap, p.topic, 2)
        produce_orders(p.bootstrap, p.topic, 200)
    run_pipeline(eu_config, RunContext("eu-1"), lambda: spark)

    with pytest.raises(SinkOwnedError) as refused:
        run_pipeline(us_config, RunContext("us-1"), lambda: spark)
    message = str(refused.value)
    assert f"pipeline {us_config.name}" in message and f"belongs to pipeline {eu_config.name}" in message, message
    assert shared in message and "topics:" in message and "Nothing was committed" in message, message
    cli = us.cli("run")
    assert cli.returncode == 2 and f"belongs to pipeline {eu_config.name}" in cli.stdout + cli.stderr, cli.stdout + cli.stderr
    # the audit of the refused pipeline says the same, not that the owner's rows lie outside its ranges (issue 48, finding 6)
    with pytest.raises(SinkOwnedError, match=f"belongs to pipeline {eu_config.name}"):
        audit_pipeline(us_config, against_kafka=True)

    # eu goes on; nothing of it is lost, nothing of us is in its table
    produce_orders(eu.bootstrap, eu.topic, 200, first_id=200)
    run_pipeline(eu_config, RunContext("eu-2"), lambda: spark)
    assert_exactly_once(eu_config, read_topic(eu.bootstrap, eu.topic))
    _audit_ok(eu_config, 400)
    topics = storage.table(eu_config.layout.sink).to_pyarrow_dataset().to_table(columns=["_kafka_topic"])["_kafka_topic"]
    assert set(topics.to_pylist()) == {eu.topic}

    # with its own table, us runs; the way to merge is one pipeline with `topics:`
    us_config = us.write(sink={"table": storage.child(pipeline.lake_uri or str(pipeline.lake), "orders_us")})
    run_pipeline(us_config, RunContext("us-2"), lambda: spark)
    assert_exactly_once(us_config, read_topic(us.bootstrap, us.topic))
    _audit_ok(us_config, 200)


def test_a_sink_that_already_holds_two_pipelines_refuses_every_commit_and_rewind(pipeline, spark):
    """A lake written before the check: another pipeline's commit is already in the table's
    history. A rewind would undo that commit with the txns it moved; it is refused, and so are
    runs of either pipeline, before anything changes."""
    config = pipeline.write(max_records_per_batch=100)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 200, partition=0)
    first, _second = run_pipeline(config, RunContext("two"), lambda: spark)
    table = storage.table(config.layout.sink)
    foreign = {"pipeline": "us", "batch_id": "us-legacy", "kind": "ingest", "ranges": []}
    table.create_write_transaction(
        [],
        mode="append",
        schema=table.schema(),
        commit_properties=CommitProperties(custom_metadata={"userMetadata": json.dumps({**foreign, "offsetlake": 1})}),
    )  # as main wrote it
    version = storage.table(config.layout.sink).version()

    with pytest.raises(SinkOwnedError, match=f"pipeline {config.name}: .* belongs to pipeline us"):
        rewind_pipeline(config, first.plan.batch_id)
    produce_orders(pipeline.bootstrap, pipeline.topic, 100, partition=0, first_id=200)
    with pytest.raises(SinkOwnedError):
        run_pipeline(config, RunContext("three"), lambda: spark)
    assert storage.table(config.layout.sink).version() == version, "nothing may be committed on a shared table"
    history = [json.loads(h["userMetadata"]) for h in storage.table(config.layout.sink).history() if h.get("userMetadata")]
    assert not any(e.get("kind") == "rewind" for e in history)


def test_the_pipeline_that_created_the_sink_owns_it_before_its_first_commit(pipeline):
    """Two first runs racing on one new table: only one create wins, and its create commit names
    its pipeline, so the other is refused even before the winner's first batch commits."""
    shared = storage.child(pipeline.lake_uri or str(pipeline.lake), "orders")
    eu_config = pipeline.write(sink={"table": shared})
    us = _second_pipeline(pipeline, "us")
    us_config = us.write(sink={"table": shared})
    ensure_topic(us.bootstrap, us.topic, 1)
    produce_orders(us.bootstrap, us.topic, 10, partition=0)
    ensure_table(eu_config, pa.schema([("order_id", pa.int64())]))
    with pytest.raises(SinkOwnedError, match=f"belongs to pipeline {eu_config.name}: its history holds .* version 0"):
        run_pipeline(us_config, RunContext("us-first"), lambda: None)
