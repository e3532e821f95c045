"""A batch's records, from Kafka to staged data files: read -> decode -> transform -> validate -> stage.

The same steps for every kind of batch that reads records (ingest, stream, backfill); what is
committed, and how, is the caller's (``offsetlake.runs``, ``offsetlake.backfill``). Each step
logs one structured line (``offsetlake.log_lines``). Nothing here commits to the sink: staged
files are inert until a commit names them (invariant 2), and a batch that fails validation
(invariant 9) raises before anything is staged or replaced.

Every batch takes one data path (``DataPath``), chosen once before anything is read
(``choose_data_path``) and logged with its reason (``step=path``); the ledger entry records it
(``RowsEntry.data_path``). On the Spark path the read tasks hand every record to Spark, which
decodes, transforms, validates and writes the rows (``stage_files``); on the direct path the read
tasks write the rows of the records they decide alone (``offsetlake.direct``) and only the rest
go through the Spark steps; on the jvm path Spark's own Kafka source reads the records and
Spark decodes them (``offsetlake.kafka_source``), and the Spark steps follow. A path is a
``DataPath`` member, a read function in ``_READS`` that returns a ``_Read``, and a rule in
``choose_data_path`` saying when it is taken.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from offsetlake import direct, engines, failpoints, keyed, routing, state_table, storage
from offsetlake.config import PipelineConfig
from offsetlake.config.sink_kinds import Capability, sink_kind
from offsetlake.coordinates import PARTITION, TOPIC, with_topic_epochs
from offsetlake.errors import ConfigError
from offsetlake.formats import CHANGE, DELETE, REASON, UPSERT, Decoder, dead_letter_rows, decoder_for, good_rows
from offsetlake.formats import reasons as dead_letter_reasons
from offsetlake.log_lines import log_step
from offsetlake.plan import BatchPlan
from offsetlake.processed import DataPath, PathChoice, ProcessedBatch, WrittenInRead
from offsetlake.sink import staging_dir
from offsetlake.spark import add_python_file
from offsetlake.transform import apply_transform, number_rows_per_record
from offsetlake.validation import ObservedGate, Suite, apply_quarantine, spark_checks, validate_rows, write_report

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession


def process_ranges(
    config: PipelineConfig,
    plan: BatchPlan,
    spark: SparkSession,
    suite: Suite | None = None,
    write_in_read: bool = False,
    observe_gate: bool = False,
) -> ProcessedBatch:
    """Read the plan's ranges once on the batch's data path (``choose_data_path``; ``write_in_read``:
    the caller commits new files, an ingest or stream batch, so the direct path is open), count
    them, decode, transform, validate (invariant 9), then stage their dead letters (undecodable
    and quarantined records): files no commit names yet, that the dead-letter table takes after
    the batch's sink commit (``offsetlake.dead_letters``).

    Raises ValidationFailedError when the batch must not commit (nothing was staged then), and
    ConfigError when ``data_path: direct`` meets a batch that needs Spark (nothing was read).

    ``observe_gate``: the sink writes ``rows`` in one job and settles ``processed.gate`` before
    its commit (an append sink's ingest): a suite Spark decides is observed during that write
    (``validation.ObservedGate``) instead of run on cached rows first.
    """
    t = time.monotonic()
    if config.transform:
        add_python_file(spark, str(config.transform_dir / f"{config.transform.split(':')[0]}.py"))
    decoder = decoder_for(config, plan.reader_schema)  # the plan's schema: a rerun decodes identically
    decoder.check_types(config.source_file or config.name)  # before anything is read
    keep_raw = _may_dead_letter_good_records(config, suite, decoder, lambda: _rows_schema_before_reading(config, plan, spark, decoder))
    choice = choose_data_path(config, plan, spark, decoder, adds_files=write_in_read)
    log_step("path", plan, t, path=choice.path, reason=choice.reason)
    per_range = {(r.topic, r.partition): {"records_read": 0, "dead_letters": 0, "rows_written": 0} for r in plan.ranges}
    processed = ProcessedBatch(choice, per_range, rows_schema=choice.rows_schema, observe_gate=observe_gate)
    try:
        decoded = _read_and_decoded(config, plan, spark, decoder, keep_raw, processed)
        processed.timings_ms["read"] = log_step(
            "read",
            plan,
            t,
            records=_total(processed, "records_read"),
            files=len(processed.written.files) if processed.written.folder else None,
        )
        failpoints.failpoint("after_read")
        if decoded is None:  # the read tasks decided every record: every one is a row they wrote
            return processed
        rows, dead = _checked_rows(config, plan, suite, decoder, decoded, processed)
    except Exception:
        processed.release()
        raise
    t = time.monotonic()
    processed.dead_letters = dead.toArrow() if dead is not None else None  # the sink takes them as it commits (``SinkWriter.write``)
    n = processed.dead_letters.num_rows if processed.dead_letters is not None else 0
    processed.timings_ms["dead_letters"] = log_step("dead_letters", plan, t, dead_letters=n)
    # after validation (a suite checks the record's own columns): each row's topic epoch (invariant 16)
    processed.rows = with_topic_epochs(rows, plan.topic_epochs)
    if processed.rows_schema is None:
        processed.rows_schema = _arrow_schema(processed.rows.drop(CHANGE))
    return processed


def choose_data_path(config: PipelineConfig, plan: BatchPlan, spark: SparkSession, decoder: Decoder, *, adds_files: bool) -> PathChoice:
    """The batch's data path and the reason, decided once, before anything is read.

    Spark for a batch whose rows Spark must write (``adds_files`` False: a backfill, but a merge
    engine's that the read tasks fold, ``WriteMode.backfill_reads_in_tasks``), reads nothing, or
    whose pipeline says ``data_path: spark``. Otherwise direct when nothing after the read needs
    Spark (``direct.problem``: the configuration, the plan, the format) and the read tasks decode
    every column with the type the Spark steps would give it (``direct.schema_problem``). Both are
    known before reading: the decoded types come from the plan's reader schema (invariant 12), and
    the Spark steps' types from analysing them over an empty read (no job runs). What only
    decoding tells is decided per record, not per batch: a record the read tasks cannot decide
    alone goes through the Spark steps on the direct path too (``offsetlake.direct``), so a direct
    batch never falls back to the Spark path once chosen. The one move after the choice is the
    jvm path's: a batch whose records the Kafka source cannot read as the read tasks do is read
    again, whole, by the read tasks (``_read_and_decoded``), and its entry records ``spark``.

    Raises ConfigError (naming the pipeline, the batch and the reason) when the pipeline says
    ``data_path: direct`` and this batch needs Spark; the configuration refuses ``direct`` earlier
    for what it alone tells (``config.spark_only_reason``).
    """
    if plan.is_empty:
        return PathChoice(DataPath.SPARK, "the batch reads no records")
    if config.data_path == "jvm":
        return _jvm_or_refused(config, plan, decoder)
    without_spark = sink_kind(config).lacks(config, Capability.FILES_WITHOUT_SPARK)
    if without_spark is not None:
        return PathChoice(DataPath.SPARK, without_spark)
    if not adds_files:
        return PathChoice(DataPath.SPARK, "the batch replaces rows (a backfill) that Spark writes")
    if config.data_path == "spark":
        return PathChoice(DataPath.SPARK, "the pipeline says data_path: spark")
    rows_schema = None
    why_not = direct.problem(config, plan, decoder)
    if why_not is None:
        rows = _rows_before_reading(config, plan, spark, decoder)
        rows_schema = _arrow_schema(rows.drop(CHANGE) if config.sink.folds_in_read else rows)
        why_not = direct.schema_problem(config, decoder, rows_schema)
    if why_not is None and config.sink.folds_in_read:
        engine = _engine_in_read(config, rows)
        return PathChoice(DataPath.DIRECT, "the read tasks fold the engine's contributions", rows_schema, engine)
    if why_not is None:
        return PathChoice(DataPath.DIRECT, "nothing after the read needs Spark", rows_schema)
    if config.data_path == "direct":
        raise ConfigError(
            f"batch {plan.batch_id} cannot take the direct path its data_path asks for: {why_not}; use data_path: auto (or spark)",
            pipeline=config.name,
            batch_id=plan.batch_id,
        )
    return PathChoice(DataPath.SPARK, why_not)


def _jvm_or_refused(config: PipelineConfig, plan: BatchPlan, decoder: Decoder) -> PathChoice:
    """``data_path: jvm``: the JVM path, or ConfigError naming what this batch's decoder or client
    settings need that the path does not do (nothing was read)."""
    from offsetlake import kafka_source

    why_not = kafka_source.problem(config, decoder)
    if why_not is not None:
        raise ConfigError(
            f"batch {plan.batch_id} cannot take the jvm path its data_path asks for: {why_not}; use data_path: auto (or spark)",
            pipeline=config.name,
            batch_id=plan.batch_id,
        )
    return PathChoice(DataPath.JVM, "the pipeline says data_path: jvm")


def _rows_schema_before_reading(config: PipelineConfig, plan: BatchPlan, spark: SparkSession, decoder: Decoder) -> Any:
    """The pyarrow schema the Spark steps give the rows of this batch (an append sink without a
    transform), from analysing them over a read of no ranges: no job runs, nothing is read."""
    return _arrow_schema(_rows_before_reading(config, plan, spark, decoder))


def _rows_before_reading(config: PipelineConfig, plan: BatchPlan, spark: SparkSession, decoder: Decoder) -> DataFrame:
    """The rows the Spark steps make of this batch, over a read of no ranges (for their schema:
    analysing them runs no job and reads nothing)."""
    from offsetlake.reader import read_ranges

    nothing = read_ranges(
        spark, [], config.kafka_client_config(), config.name, config.read_timeout_seconds, decoder, max_record_bytes=config.max_record_bytes
    )
    return with_topic_epochs(
        _rows(config, decoder, _decoded(config, plan, decoder, nothing, keep_raw=True), judge_rows=False), plan.topic_epochs
    )


def _engine_in_read(config: PipelineConfig, rows: DataFrame) -> Any:
    """The merge engine as the read tasks fold it (``offsetlake.engine_arrow``), with the schemas
    Spark gives its contributions and folded states of ``rows`` (analysed: no job runs)."""
    from offsetlake.engine_arrow import ArrowEngine

    engine = engines.engine_for(config)
    contributions = engine.contributions(rows.drop(CHANGE))
    states = engine.folded(contributions.select(*[f"`{c}`" for c in engines.group_columns(config)], engines.STATE))
    return ArrowEngine.of(config, _arrow_schema(contributions), _arrow_schema(states))


class _ToReadTasks(Exception):
    """A ``jvm`` batch the read tasks must read instead (``kafka_source``: the reason)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _read_and_decoded(
    config: PipelineConfig, plan: BatchPlan, spark: SparkSession, decoder: Decoder, keep_raw: bool, processed: ProcessedBatch
) -> DataFrame | None:
    """The batch's records read on its path, decoded, cached and counted (None: the read tasks
    decided every record). A ``jvm`` batch whose records the Kafka source cannot read as the read
    tasks do is read again, whole, by the read tasks, and its path says so (``kafka_source``):
    the same records, the same fates, recorded as the ``spark`` path with the reason."""
    try:
        read = _READS[processed.path.path](config, plan, spark, decoder, keep_raw, processed)
        return _decoded_and_counted(config, plan, decoder, read, keep_raw, processed) if read.frame is not None else None
    except _ToReadTasks as moved:
        processed.release()
        processed.path = PathChoice(DataPath.SPARK, f"{moved.reason}; the read tasks read the batch")
        log_step("path", plan, time.monotonic(), path=processed.path.path, reason=processed.path.reason)
        for counts in processed.per_range.values():
            counts.update(records_read=0, dead_letters=0)
        read = _read_in_spark(config, plan, spark, decoder, keep_raw, processed)
        assert read.frame is not None
        return _decoded_and_counted(config, plan, decoder, read, keep_raw, processed)


def _arrow_schema(frame: DataFrame) -> Any:
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(frame.schema, timezone="UTC", prefers_large_types=False)


@dataclass(frozen=True)
class _Read:
    """What a data path's read step leaves to the Spark steps: the records to decode (the read
    frame, ``reader.read_ranges``'s columns; None: none), and whether the read tasks already
    counted every record read (``records_read`` per range)."""

    frame: DataFrame | None
    counted: bool
    in_jvm: bool = False  # read by Spark's Kafka source: ``kafka_source``'s columns are there


def _read_in_spark(
    config: PipelineConfig, plan: BatchPlan, spark: SparkSession, decoder: Decoder, keep_raw: bool, processed: ProcessedBatch
) -> _Read:
    """The Spark path: every record of the plan's ranges, lazily (``reader.read_ranges``)."""
    from offsetlake.reader import read_ranges

    sized = [r for r in plan.ranges if r.size > 0]
    client = config.kafka_client_config()
    frame = read_ranges(
        spark,
        sized,
        client,
        config.name,
        config.read_timeout_seconds,
        decoder,
        headers_of_rows=keep_raw,
        max_record_bytes=config.max_record_bytes,
    )
    return _Read(frame, counted=False)


def _read_direct(
    config: PipelineConfig, plan: BatchPlan, spark: SparkSession, decoder: Decoder, keep_raw: bool, processed: ProcessedBatch
) -> _Read:
    """The direct path: one Spark job whose read tasks write the rows they decide and count every
    record; the records they left undecided, for the Spark steps."""
    engine = processed.path.engine  # a merge engine's contributions go to the state table
    table = state_table.as_table(config) if engine is not None else config
    folder = staging_dir(table, plan.batch_id)
    wrote = direct.read_and_write(
        spark,
        [r for r in plan.ranges if r.size > 0],
        config.kafka_client_config(),
        config.name,
        config.read_timeout_seconds,
        decoder,
        processed.path.rows_schema,
        table.layout.sink,
        folder,
        config.sink.partition_by,
        max_record_bytes=config.max_record_bytes,
        epochs=plan.topic_epochs,
        route=routing.read_task_route(config),
        engine=engine,
    )
    processed.written = WrittenInRead(folder, wrote.files, wrote.undecided, table.layout.sink, wrote.partials, wrote.partial_rows)
    for key, count in wrote.records_read.items():
        processed.per_range[key]["records_read"] = count
    return _Read(direct.undecided_frame(spark, table.layout.sink, wrote.undecided, decoder), counted=True)


def _read_in_jvm(
    config: PipelineConfig, plan: BatchPlan, spark: SparkSession, decoder: Decoder, keep_raw: bool, processed: ProcessedBatch
) -> _Read:
    """The JVM path: every record of the plan's ranges through Spark's Kafka source, lazily."""
    from offsetlake import kafka_source
    from offsetlake.spark import default_parallelism

    sized = [r for r in plan.ranges if r.size > 0]
    return _Read(kafka_source.read_ranges(spark, sized, config, decoder, default_parallelism(spark)), counted=False, in_jvm=True)


_READS: dict[DataPath, Callable[[PipelineConfig, BatchPlan, Any, Decoder, bool, ProcessedBatch], _Read]] = {
    DataPath.SPARK: _read_in_spark,
    DataPath.DIRECT: _read_direct,
    DataPath.JVM: _read_in_jvm,
}


def _total(processed: ProcessedBatch, key: str) -> int:
    return sum(v.get(key, 0) for v in processed.per_range.values())


def _decoded_and_counted(
    config: PipelineConfig, plan: BatchPlan, decoder: Decoder, read: _Read, keep_raw: bool, processed: ProcessedBatch
) -> DataFrame:
    """The read records decoded and cached; counted per range (records read, unless the read
    tasks counted them, and dead letters so far)."""

    assert read.frame is not None
    decoded = _decoded(config, plan, decoder, read.frame, keep_raw).persist()
    processed.cached.append(decoded)
    counts = _counts(decoded, read.in_jvm)
    if read.in_jvm:
        decoded, counts = _judged_beside_the_jvm(decoded, decoder, counts, processed)
    for row in counts:
        key = (row["topic"], row["partition"])
        if not read.counted:
            processed.per_range[key]["records_read"] = int(row["records_read"])
        processed.per_range[key]["dead_letters"] = int(row["dead_letters"] or 0)
    return decoded


def _counts(decoded: DataFrame, in_jvm: bool) -> list[Any]:
    """Per topic-partition: records read and dead letters so far; on the JVM path also the
    records the read tasks' code judges and those the source shifted (``kafka_source``). The
    batch's first action: a failure of Spark's Kafka source surfaces here."""
    from pyspark.sql import functions as F

    from offsetlake import kafka_source

    measures = [F.count("*").alias("records_read"), F.sum(F.col(REASON).isNotNull().cast("long")).alias("dead_letters")]
    if not in_jvm:
        return decoded.groupBy("topic", "partition").agg(*measures).collect()
    measures += [F.sum(F.col(c).cast("long")).alias(c) for c in (kafka_source.IN_PYTHON, kafka_source.BEFORE_GREGORIAN)]
    try:
        return decoded.groupBy("topic", "partition").agg(*measures).collect()
    except Exception as err:
        reason = kafka_source.read_tasks_reason(err)
        if reason is None:
            raise
        raise _ToReadTasks(reason) from err


def _judged_beside_the_jvm(
    decoded: DataFrame, decoder: Decoder, counts: list[Any], processed: ProcessedBatch
) -> tuple[DataFrame, list[Any]]:
    """A JVM batch after the read tasks' code judged the records the JVM does not judge alone
    (``kafka_source.python_problems``): their reasons, and the dead letters counted again."""
    from pyspark.sql import functions as F

    from offsetlake import kafka_source
    from offsetlake.spark import dataframe_from_arrow

    if any(row[kafka_source.BEFORE_GREGORIAN] for row in counts):
        raise _ToReadTasks("a record's timestamp is before 1582-10-15, which Spark's Kafka source shifts to the Julian calendar")
    done = decoded.drop(kafka_source.IN_PYTHON, kafka_source.BEFORE_GREGORIAN)
    if not any(row[kafka_source.IN_PYTHON] for row in counts):
        return done, counts
    problems = kafka_source.python_problems(decoded.where(F.col(kafka_source.IN_PYTHON)), decoder)
    if not problems.num_rows:
        return done, counts
    found = F.broadcast(dataframe_from_arrow(done.sparkSession, problems.rename_columns(["topic", "partition", "offset", "_found"])))
    judged = done.join(found, ["topic", "partition", "offset"], "left")
    judged = judged.withColumn(REASON, F.coalesce(F.col("_found"), F.col(REASON))).drop("_found").persist()
    processed.cached.append(judged)
    return judged, _counts(judged, in_jvm=False)


def _checked_rows(
    config: PipelineConfig, plan: BatchPlan, suite: Suite | None, decoder: Decoder, decoded: DataFrame, processed: ProcessedBatch
) -> tuple[DataFrame, DataFrame | None]:
    """The decoded records' rows after the suite (invariant 9) and the rows no folder or key can
    hold; and the batch's dead letters (undecodable, quarantined, unwritable), or None."""
    from pyspark.sql import functions as F

    upsert = config.sink.keyed
    rows = _rows(config, decoder, decoded)
    if not routing.owns_the_rest(config):  # another table of the routes dead-letters what does not decode
        for counts in processed.per_range.values():
            counts["dead_letters"] = 0
    dead = dead_letter_rows(decoded, config.name, plan.batch_id) if _total(processed, "dead_letters") else None
    if config.routed_by_column:  # this table's rows, before the suite sees them (``offsetlake.routing``)
        rows = routing.rows_of_route(config, rows)
        unrouted = routing.unrouted_reason(config, rows)
        if unrouted is not None:
            rows, no_table = _split_unrouted(config, plan, rows, decoded, processed, unrouted)
            dead = _union(dead, no_table)
    if suite is not None and _total(processed, "records_read"):
        # a keyed sink's deletes write no row: the suite sees the rows that are written
        deletes = rows.where(F.col(CHANGE) == DELETE) if upsert else None
        checked = rows.where(F.col(CHANGE) != DELETE).drop(CHANGE) if upsert else rows
        checked, quarantined = _validate(config, plan, suite, checked, decoded, processed)
        rows = checked.withColumn(CHANGE, F.lit(UPSERT)).unionByName(deletes) if deletes is not None else checked
        dead = _union(dead, quarantined)
    rows, unwritable = _split_unwritable(config, plan, rows, decoded, processed)
    return rows, _union(dead, unwritable)


def _coalesced(first: Column | None, then: Column | None) -> Column | None:
    from pyspark.sql import functions as F

    if first is None or then is None:
        return first if then is None else then
    return F.coalesce(first, then)


def _union(first: DataFrame | None, then: DataFrame | None) -> DataFrame | None:
    if first is None or then is None:
        return first if then is None else then
    return first.unionByName(then)


def _decoded(config: PipelineConfig, plan: BatchPlan, decoder: Decoder, raw: DataFrame, keep_raw: bool) -> DataFrame:
    """The read frame decoded: REASON null for a record that becomes a row, else why it is a
    dead letter; a backfill by time keeps only its window's records."""
    from pyspark.sql import functions as F

    # a record whose headers or timestamp cannot be kept is a dead letter whatever its value
    decoded = decoder.decode_in_spark(raw).withColumn(REASON, F.coalesce(F.col("read_problem"), F.col(REASON)))
    if config.sink.deletes:
        decoded = keyed.mark_tombstones(decoded)
    if plan.window is not None:  # a backfill by time reprocesses only the records of its window
        decoded = decoded.where(
            (F.col("timestamp") >= F.timestamp_millis(F.lit(plan.window.from_ms)))
            & (F.col("timestamp") < F.timestamp_millis(F.lit(plan.window.to_ms)))
        )
    if not keep_raw:
        # only dead letters and quarantined records need the original bytes: a cache without
        # them for good rows cost the JVM a fifth less per batch (bench, 1M records)
        good = F.col(REASON).isNull()
        from offsetlake.kafka_source import IN_PYTHON

        if IN_PYTHON in decoded.columns:  # the read tasks' code still judges these (the JVM path)
            good = good & ~F.col(IN_PYTHON)
        for column in ("key", "value", "headers"):
            decoded = decoded.withColumn(column, F.when(good, F.lit(None)).otherwise(F.col(column)))
    return decoded


def _rows(config: PipelineConfig, decoder: Decoder, decoded: DataFrame, judge_rows: bool = True) -> DataFrame:
    """The sink rows of the decoded records, transformed (before validation). ``judge_rows``
    False: only their schema is wanted, which is the same whether the transform's rows are
    counted or not, so its plan is not read (two analyses on the server, ~0.1 s a batch)."""
    from pyspark.sql import functions as F

    upsert = config.sink.keyed
    rows = good_rows(decoded, decoder)
    if not upsert and CHANGE in rows.columns:  # an append sink keeps every change as a row
        rows = rows.drop(CHANGE)
    transformed = apply_transform(rows, config)
    if config.transform:  # a record may become several rows: number them (offsetlake.transform)
        transformed = number_rows_per_record(transformed, before=rows if judge_rows else None)
    rows = transformed
    if upsert:
        if CHANGE not in rows.columns:
            rows = rows.withColumn(CHANGE, F.lit(UPSERT))
        keyed.check_key_columns(config, rows.columns, "rows" if not config.transform else "transformed rows")
        engines.check_columns(config, rows.columns, "rows" if not config.transform else "transformed rows")
    return rows


def _may_dead_letter_good_records(config: PipelineConfig, suite: Suite | None, decoder: Decoder, transformed: Callable[[], Any]) -> bool:
    """Whether a record that decoded well may still become a dead letter (so its bytes are kept):
    quarantined by the suite, or a string partition value too long for a folder name.
    ``transformed``: the pyarrow schema of the rows after the transform, from analysing it over
    an empty read (no job runs): whether a partition column is text is known only there."""
    import pyarrow as pa

    if suite is not None and config.validation.on_failure == "quarantine":
        return True
    if routing.may_dead_letter_rows(config):
        return True  # a row whose value no table maps is a dead letter
    if config.sink.keyed:  # a row whose key (or window time) is null is a dead letter
        return True
    if not config.sink.partition_by:
        return False
    if config.transform:
        # the bytes of every record in the batch's cache cost its read a third more (the shipped
        # orders pipeline, partitioned by a date its transform derives): keep them only for text
        schema = transformed()
        return any(c not in schema.names or _text(schema.field(c).type) for c in config.sink.partition_by)
    from offsetlake.formats.keys import KeyedDecoder

    if isinstance(decoder, KeyedDecoder) and {c for c, _ in decoder.key.columns()} & set(config.sink.partition_by):
        return True  # a key column's value may be any length
    read_type = decoder.read_type()
    if read_type is None:  # JSON with types the read tasks leave to Spark
        declared = getattr(config.format, "schema_", {})
        return any(declared.get(c, "").strip().lower() == "string" for c in config.sink.partition_by)
    types = {f.name: f.type for f in read_type}
    return any(c in types and pa.types.is_string(types[c]) for c in config.sink.partition_by)


def _text(t: Any) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_string(t) or pa.types.is_large_string(t))


def _split_unwritable(
    config: PipelineConfig, plan: BatchPlan, rows: DataFrame, decoded: DataFrame, processed: ProcessedBatch
) -> tuple[DataFrame, DataFrame | None]:
    """Rows whose string partition value cannot be a folder name (more than 255 bytes as
    ``column=value`` after Spark's escaping) would fail the whole write, and a keyed sink's row
    without its key has no place; their records become dead letters instead (all rows of such a
    record, as quarantine does), with the reason."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import StringType

    columns = [c for c in config.sink.partition_by if c in rows.columns and isinstance(rows.schema[c].dataType, StringType)]
    null_key = _coalesced(keyed.null_key_reason(config), engines.row_problem(config))
    if not columns and null_key is None:
        return rows, None
    pattern = "[" + "".join(f"\\x{ord(c):02x}" for c in sorted(storage.PARTITION_ESCAPES)) + "]"
    reasons = [null_key] if null_key is not None else []
    for c in columns:
        value = F.col(f"`{c}`")
        escaped = F.octet_length(value) + 2 * (F.length(value) - F.length(F.regexp_replace(value, pattern, "")))
        size = F.lit(len(c.encode()) + 1) + escaped
        reasons.append(
            F.when(
                F.instr(value, "\u0000") > 0,
                F.lit(dead_letter_reasons.partition_value_nul(c)),
            )
        )
        reasons.append(
            F.when(
                size > storage.MAX_FOLDER_NAME_BYTES,
                dead_letter_reasons.coded(
                    "partition_value",
                    F.concat(
                        F.lit(f"partition value of column '{c}' is "),
                        size.cast("string"),
                        F.lit(f" bytes as a folder name ({c}=...); at most {storage.MAX_FOLDER_NAME_BYTES} fit"),
                    ),
                ),
            )
        )
    from offsetlake.coordinates import RECORD_KEY

    flagged = rows.select(*RECORD_KEY, F.coalesce(*reasons).alias(_REASON_OF_ROW))
    bad, dead = _dead_records(config, plan, flagged, decoded, processed, "unwritable")
    if bad is None:
        return rows, None
    return rows.join(bad.drop(_REASON_OF_ROW), list(RECORD_KEY), "left_anti"), dead


def _split_unrouted(
    config: PipelineConfig, plan: BatchPlan, rows: DataFrame, decoded: DataFrame, processed: ProcessedBatch, reason: Column
) -> tuple[DataFrame, DataFrame | None]:
    """The rows some table takes, and the records of the rows no table takes as dead letters
    (``routing.unrouted_reason``), once per record. Only the unrouted rows leave: a record whose
    transform made rows of several values keeps its mapped rows in their tables."""
    from pyspark.sql import functions as F

    flagged = rows.withColumn(_REASON_OF_ROW, reason)
    bad, dead = _dead_records(config, plan, flagged, decoded, processed, "unrouted")
    if bad is None:
        return rows, None
    return flagged.where(F.col(_REASON_OF_ROW).isNull()).drop(_REASON_OF_ROW), dead


_REASON_OF_ROW = "_dead_letter_reason"  # a row's reason to make its record a dead letter (null: none)


def _dead_records(
    config: PipelineConfig, plan: BatchPlan, flagged: DataFrame, decoded: DataFrame, processed: ProcessedBatch, step: str
) -> tuple[DataFrame | None, DataFrame | None]:
    """The records with a row whose ``_REASON_OF_ROW`` is set, once each with the first reason
    (cached; None when there is none), and their dead letters; counted per range, logged as ``step``."""
    from pyspark.sql import functions as F

    from offsetlake.coordinates import RECORD_KEY

    bad = flagged.where(F.col(_REASON_OF_ROW).isNotNull()).groupBy(*RECORD_KEY).agg(F.first(_REASON_OF_ROW).alias(_REASON_OF_ROW)).persist()
    processed.cached.append(bad)
    per_partition = {(r[TOPIC], r[PARTITION]): int(r["count"]) for r in bad.groupBy(TOPIC, PARTITION).count().collect()}
    if not per_partition:
        return None, None
    for key, count in per_partition.items():
        processed.per_range[key]["dead_letters"] += count
    log_step(step, plan, time.monotonic(), records=sum(per_partition.values()))
    coordinates = bad.select(
        F.col(TOPIC).alias("topic"),
        F.col(PARTITION).alias("partition"),
        F.col("_kafka_offset").alias("offset"),
        F.col(_REASON_OF_ROW).alias(REASON),
    )
    records = decoded.drop(REASON).join(coordinates, ["topic", "partition", "offset"])
    return bad, dead_letter_rows(records, config.name, plan.batch_id)


def _validate(
    config: PipelineConfig, plan: BatchPlan, suite: Suite, rows: DataFrame, decoded: DataFrame, processed: ProcessedBatch
) -> tuple[DataFrame, DataFrame | None]:
    """Gate the batch with its suite; returns (rows to write, quarantined dead letters or None).
    A suite Spark decides, on a batch whose sink settles an observed gate, is left to the write
    (``validation.ObservedGate``): nothing is quarantined then, as a passing batch has nothing to."""
    t = time.monotonic()
    checks = spark_checks(rows, suite) if processed.observe_gate else None
    if checks is not None:
        processed.gate = ObservedGate(suite, config, plan, checks)
        return rows, None
    rows = rows.persist()
    processed.cached.append(rows)
    try:
        validation = validate_rows(rows, suite, config, plan)
    except Exception as err:
        summary = getattr(err, "summary", None)
        log_step(
            "validate",
            plan,
            t,
            outcome="failed",
            failed=len(summary["failed"]) if summary else "error",
            report=summary.get("report") if summary else None,
        )
        raise
    quarantined = None
    if validation.quarantine:
        rows, quarantined, per_partition, bad = apply_quarantine(rows, decoded, validation, config, plan.batch_id)
        processed.cached.append(bad)
        for key, count in per_partition.items():
            processed.per_range[key]["dead_letters"] += count
            processed.per_range[key]["quarantined"] = count
    validation.summary["report"] = write_report(config, plan, validation.summary)
    processed.validation = validation.summary
    processed.timings_ms["validate"] = log_step(
        "validate",
        plan,
        t,
        outcome=validation.summary["outcome"],
        failed=len(validation.summary["failed"]),
        quarantined=validation.summary.get("quarantined_records", 0),
        report=validation.summary["report"],
    )
    return rows, quarantined
