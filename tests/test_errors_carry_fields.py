"""Errors carry what they are about as data (issue 36 item 5): pipeline, batch, topic, partition,
offsets, field as attributes, one formatter for the message, and a ``transient`` flag that the
stream's back-off reads instead of a tuple of classes. The key errors are raised here by the real
broker, Spark and Delta, and the tests read their fields, not their prose."""

from __future__ import annotations

import pickle

import pyarrow as pa
import pytest
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient

from offsetlake import errors
from offsetlake.backfill import plan_backfill
from offsetlake.embedded.sample_data import ensure_topic, produce_orders
from offsetlake.errors import (
    BackfillParamsError,
    CommitConflictError,
    KafkaUnavailableError,
    OffsetsLostError,
    ReadTimeoutError,
    SchemaChangeError,
    SchemaRegistryUnavailableError,
    SinkOwnedError,
    StalePlanError,
    TopicEpochError,
    TopicIdentityError,
    ValidationFailedError,
)
from offsetlake.history import refuse_foreign_sink
from offsetlake.kafka import check_log_start, current_offsets, read_range
from offsetlake.plan import OffsetRange, RunContext
from offsetlake.reader import errors_from_spark_tasks, read_ranges
from offsetlake.rewind import rewind_pipeline
from offsetlake.runs import execute_recorded_batch, plan_for_dag_run, run_pipeline
from offsetlake.schema_evolution import evolved_schema, table_schema
from offsetlake.sink import open_table
from offsetlake.topic_epochs import check_topic_identity, reset_topic_epoch


# ---- the formatter and the flag (no services) -------------------------------------------------
def test_the_fields_are_attributes_and_the_message_shows_them_one_way():
    err = OffsetsLostError("offsets from 7 are gone", pipeline="orders", topic="t", partition=2, start=5, end=9, batch_id="b1")
    assert (err.pipeline, err.topic, err.partition, err.start, err.end, err.batch_id, err.field) == ("orders", "t", 2, 5, 9, "b1", None)
    assert err.fields == {"pipeline": "orders", "batch_id": "b1", "topic": "t", "partition": 2, "start": 5, "end": 9}
    assert str(err) == "pipeline orders: t[2] range [5, 9): offsets from 7 are gone"
    assert str(StalePlanError("batch b1 was rewound", pipeline="orders", batch_id="b1")) == "pipeline orders: batch b1 was rewound"
    assert str(KafkaUnavailableError("topic 't' is gone", pipeline="p", topic="t")) == "pipeline p: topic 't' is gone"
    assert str(errors.OffsetlakeError("no fields")) == "no fields" and errors.OffsetlakeError("x").fields == {}


def test_outages_are_transient_and_nothing_else_is():
    for outage in (KafkaUnavailableError, ReadTimeoutError, SchemaRegistryUnavailableError, errors.SparkServerUnavailableError):
        assert errors.is_transient(outage("down")), outage
    for lasting in (OffsetsLostError, StalePlanError, CommitConflictError, SchemaChangeError, errors.StorageError, errors.LeaseHeldError):
        assert not errors.is_transient(lasting("no")), lasting
    assert not errors.is_transient(TimeoutError("not ours")) and not errors.is_transient(KeyboardInterrupt())


def test_an_error_pickles_with_its_fields_and_what_its_class_adds():
    err = pickle.loads(pickle.dumps(ReadTimeoutError("no progress", pipeline="p", topic="t", partition=0, start=1, end=2)))
    assert type(err) is ReadTimeoutError and err.fields == {"pipeline": "p", "topic": "t", "partition": 0, "start": 1, "end": 2}
    assert str(err) == "pipeline p: t[0] range [1, 2): no progress"
    failed = pickle.loads(pickle.dumps(ValidationFailedError("failed", {"failed": ["x"]})))
    assert type(failed) is ValidationFailedError and failed.summary == {"failed": ["x"]} and str(failed) == "failed"
    staged = pickle.loads(pickle.dumps(errors.StagedFilesError("sink", "part-0.parquet", "other bytes")))
    assert (staged.table, staged.path, staged.problem) == ("sink", "part-0.parquet", "other bytes")


def test_a_task_failure_is_data_that_rebuilds_the_error():
    sent = ReadTimeoutError("no progress for 5s at offset 7", pipeline="p", topic="t", partition=1, start=0, end=9)

    def task(batches):
        yield from batches
        raise sent

    with pytest.raises(errors.TaskFailure) as in_task:
        list(errors.reported_as_data(task)(iter([1])))
    # what the driver gets: the worker's traceback text around the report
    quoted = f"PythonException: Traceback (most recent call last):\n  ...\n{type(in_task.value).__name__}: {in_task.value}\n"
    rebuilt = errors.from_task_failure(RuntimeError(quoted))
    assert type(rebuilt) is ReadTimeoutError and rebuilt.fields == sent.fields and str(rebuilt) == str(sent)
    assert errors.is_transient(rebuilt)
    # prose alone is not parsed: an error's class name and message in a traceback rebuild nothing
    assert errors.from_task_failure(RuntimeError("offsetlake.errors.ReadTimeoutError: pipeline p: no progress")) is None
    unknown = errors.from_task_failure(RuntimeError(errors.TASK_FAILURE + '{"error":"NewerError","text":"x","fields":{"pipeline":"p"}}'))
    assert type(unknown) is errors.OffsetlakeError and str(unknown) == "pipeline p: x"


# ---- raised by the real services ---------------------------------------------------------------
def test_lost_offsets_name_the_partition_and_range_as_fields(pipeline):
    config = pipeline.write()
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 300, partition=0)
    admin = AdminClient({"bootstrap.servers": pipeline.bootstrap})  # kept until answered: a collected client cancels
    for future in admin.delete_records([TopicPartition(pipeline.topic, 0, 200)]).values():
        future.result(30)

    with pytest.raises(OffsetsLostError) as planned:
        check_log_start(current_offsets(config)[(pipeline.topic, 0)], 50, config.name)
    assert planned.value.fields == {"pipeline": config.name, "topic": pipeline.topic, "partition": 0, "start": 50, "end": 200}

    with pytest.raises(OffsetsLostError) as read:
        for _ in read_range(config.kafka_client_config(), config.name, pipeline.topic, 0, 100, 250, 10):
            pass
    assert read.value.fields == {"pipeline": config.name, "topic": pipeline.topic, "partition": 0, "start": 100, "end": 250}
    assert not errors.is_transient(read.value)


def test_an_error_inside_a_spark_read_task_comes_back_typed_with_its_fields(pipeline, spark):
    config = pipeline.write()
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 300, partition=0)
    admin = AdminClient({"bootstrap.servers": pipeline.bootstrap})  # kept until answered: a collected client cancels
    for future in admin.delete_records([TopicPartition(pipeline.topic, 0, 200)]).values():
        future.result(30)
    rows = read_ranges(
        spark, [OffsetRange(pipeline.topic, 0, 100, 300)], config.kafka_client_config(), config.name, 10, max_record_bytes=1 << 20
    )
    with pytest.raises(OffsetsLostError) as lost, errors_from_spark_tasks():
        rows.count()
    assert lost.value.fields == {"pipeline": config.name, "topic": pipeline.topic, "partition": 0, "start": 100, "end": 300}
    assert str(lost.value).startswith(f"pipeline {config.name}: {pipeline.topic}[0] range [100, 300): offsets from 100 are no longer")


def test_a_committed_end_past_the_log_end_names_pipeline_and_topic(pipeline):
    config = pipeline.write()
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 10, partition=0)
    offsets = current_offsets(config)
    with pytest.raises(TopicIdentityError) as refused:
        check_topic_identity(config, [], {(pipeline.topic, 0): 50}, offsets, {pipeline.topic: None})
    assert (refused.value.pipeline, refused.value.topic) == (config.name, pipeline.topic)


def test_stale_plan_foreign_sink_and_schema_change_carry_their_fields(pipeline, spark):
    config = pipeline.write(max_records_per_batch=1_000)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 1_500, partition=0)
    stale = plan_for_dag_run(config, RunContext("scheduled-1", f"{pipeline.name}_ingest", 1))
    assert stale is not None
    shorter = pipeline.write(max_records_per_batch=300)  # another run moves the committed end part-way
    assert len(run_pipeline(shorter, RunContext("cli-1"), lambda: spark, max_batches=1)) == 1

    with pytest.raises(StalePlanError) as superseded:
        execute_recorded_batch(config, stale.batch_id, lambda: spark)
    assert superseded.value.fields == {
        "pipeline": config.name,
        "batch_id": stale.batch_id,
        "topic": pipeline.topic,
        "partition": 0,
        "start": 0,
        "end": 1_000,
    }

    table = open_table(config.layout.sink)
    with pytest.raises(SinkOwnedError) as owned:
        refuse_foreign_sink(table, "another_pipeline")
    assert owned.value.pipeline == "another_pipeline" and owned.value.batch_id is None

    schema = table_schema(table)
    amount = schema.get_field_index("amount")
    retyped = schema.set(amount, pa.field("amount", pa.string()))
    with pytest.raises(SchemaChangeError) as changed:
        evolved_schema(table, config, retyped, stale)
    assert changed.value.fields == {"pipeline": config.name, "batch_id": stale.batch_id, "field": "amount"}


def test_refused_backfill_rewind_and_epoch_name_what_they_are_about_as_fields(pipeline):
    """Refusals that once wrote the pipeline, partition and offsets into their text carry them as
    fields; the message shows them once, before the same sentence."""
    config = pipeline.write()
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 20, partition=0)

    with pytest.raises(BackfillParamsError) as beyond:
        plan_backfill(config, RunContext("backfill-1"), from_offset=0, to_offset=1_000)
    assert beyond.value.fields == {"pipeline": config.name, "topic": pipeline.topic, "partition": 0, "start": 0, "end": 1_000}
    assert str(beyond.value) == (
        f"pipeline {config.name}: {pipeline.topic}[0] range [0, 1000): backfill: to_offset 1000 is beyond the last stable offset 20 "
        "of the partition"
    )
    with pytest.raises(BackfillParamsError) as mixed:
        plan_backfill(config, RunContext("backfill-2"), from_offset=0, to_offset=10, from_time="2026-01-01T00:00:00Z")
    assert mixed.value.fields == {"pipeline": config.name} and str(mixed.value).startswith(f"pipeline {config.name}: backfill: give ")

    with pytest.raises(errors.RewindError) as rewind:
        rewind_pipeline(config, "no-such-batch")
    assert rewind.value.fields == {"pipeline": config.name, "batch_id": "no-such-batch"}
    assert str(rewind.value).startswith(f"pipeline {config.name}: cannot rewind to batch no-such-batch: the sink ")

    with pytest.raises(TopicEpochError) as epoch:
        reset_topic_epoch(config, pipeline.topic)
    assert epoch.value.fields == {"pipeline": config.name, "topic": pipeline.topic}
    assert str(epoch.value) == f"pipeline {config.name}: it has committed nothing of topic {pipeline.topic}; nothing to reset"
