"""The direct path: read tasks that write the batch's data files themselves.

For the most common batch (an append sink, no transform, no suite, a format the read tasks
decode) nothing after the read needs Spark: each step is per record. The Spark path still
turned every record into a JVM row, cached the frame, counted it in a job with a shuffle, and
handed the rows back to Python to be written (issue 20's profile: the JVM spent more CPU on
that than the read itself). Here each read task consumes its split, decodes each chunk and
writes the records its decoder settled as rows straight into parquet files, in one Spark job
with no cache and no shuffle; the rows never enter the JVM.

The files are the Spark path's files: the same folder layout and names (``staging``), the same
Arrow schema (the one Spark gives the rows, checked before the job), inert until the batch's
commit names them (invariant 2). What the tasks do not decide alone (a record its decoder left
to Spark, one with a problem: every future dead letter) goes to an ``undecided-*`` file in the
same folder and through the Spark path afterwards (``decode_in_spark``, the same dead-letter
rules). So the direct path never changes which record becomes a row or a dead letter, only
where that is decided; ``test_direct_path.py`` holds the two paths to the same files.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from offsetlake import errors, routing, storage
from offsetlake.config import PipelineConfig, spark_only_reason
from offsetlake.coordinates import TOPIC_EPOCH, topic_epoch_array
from offsetlake.engines import STATE
from offsetlake.formats import PARSED_IN_READ, Decoder
from offsetlake.formats.keys import KEY_PARSED, KeyedDecoder
from offsetlake.plan import BatchPlan, OffsetRange
from offsetlake.reader import decided_columns, read_schemas, split_ranges, task_count
from offsetlake.sink import StagedFile
from offsetlake.spark import default_parallelism
from offsetlake.staging import (
    PARTIAL,
    READ,
    RESULT_SCHEMA,
    ROWS,
    UNDECIDED,
    TaskFiles,
    read_files,
    relative_folder,
    result_batch,
    result_counts,
    staged_file,
    task_attempt,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from offsetlake.engine_arrow import ArrowEngine


def problem(config: PipelineConfig, plan: BatchPlan, decoder: Decoder) -> str | None:
    """Why this batch takes the Spark path, or None when its read tasks may write its files
    (then ``schema_problem`` has the last word; ``process.choose_data_path`` asks both): what
    the configuration alone says (``config.spark_only_reason``), then the plan and the format."""
    reason = spark_only_reason(config)
    if reason is not None:
        return reason
    if plan.window is not None:
        return "a backfill by record time"
    if not decoder.rows_in_read or decoder.read_type() is None:
        return "the format finishes decoding in Spark"
    return None


def schema_problem(config: PipelineConfig, decoder: Decoder, rows_schema: pa.Schema) -> str | None:
    """Why the read tasks cannot write rows of ``rows_schema`` (the schema the Spark path gives
    the batch's rows) from what they decode, or None."""
    for column, (_, struct, inner) in zip(decoder.fields(), _sources(decoder), strict=True):
        decoded = struct.field(inner).type if struct.get_field_index(inner) >= 0 else None
        if decoded is None or column not in rows_schema.names:
            return f"column {column} is not decoded in the read tasks"
        if decoded != rows_schema.field(column).type:
            return f"column {column} is {decoded} in the read tasks but {rows_schema.field(column).type} in Spark"
    for column in config.sink.partition_by:
        if column not in rows_schema.names or pa.types.is_string(rows_schema.field(column).type):
            return f"partition column {column} may hold a value no folder name can (checked in Spark)"
    if config.sink.folds_in_read:
        from offsetlake.engine_arrow import schema_problem as engine_problem

        why_not = engine_problem(config, rows_schema)
        if why_not is not None:
            return why_not
    return routing.read_task_problem(config, rows_schema)


def _sources(decoder: Decoder) -> list[tuple[str, pa.StructType, str]]:
    """Where each of ``decoder.fields()`` (the columns ``formats.good_rows`` takes from a decoded
    record) is in a read task's columns: the struct column, its type, and the field in it."""
    value = decoder.value if isinstance(decoder, KeyedDecoder) else decoder
    value_type = value.read_type()
    assert value_type is not None  # problem() said so
    out = [(PARSED_IN_READ, value_type, name) for name in value.fields()]
    if isinstance(decoder, KeyedDecoder):
        key_type = decoder.key.read_type()
        assert key_type is not None
        out += [(KEY_PARSED, key_type, inner) for _, inner in decoder.key.columns()]
    return out


@dataclass
class DirectResult:
    """What the read tasks wrote: data files, files of undecided records, and records read."""

    files: list[StagedFile]
    undecided: list[str]  # paths under the table of the undecided records' files
    records_read: Counter[tuple[str, int]]
    partials: list[str] = field(default_factory=list)  # a merge engine's partial states, a file per task
    partial_rows: int = 0  # the rows of those files


def read_and_write(
    spark: SparkSession,
    ranges: list[OffsetRange],
    client_config: dict[str, str],
    pipeline: str,
    timeout_s: float,
    decoder: Decoder,
    rows_schema: pa.Schema,
    table_root: storage.Location,
    folder: str,
    partition_by: list[str],
    *,
    max_record_bytes: int,
    epochs: dict[str, int] | None = None,
    route: routing.ReadTaskRoute | None = None,
    engine: ArrowEngine | None = None,
) -> DirectResult:
    """One Spark job: each task reads its split, writes the rows its decoder settled as parquet
    under ``folder`` (inside ``table_root``) with the task-side writer (``staging.TaskFiles``),
    and the rest of its records to an undecided file (a record above ``max_record_bytes`` among
    them: the Spark path's rule, ``reader.decided_columns``). ``epochs``: each topic's current
    epoch, which its rows carry as the Spark path's do (``coordinates.TOPIC_EPOCH``, when
    ``rows_schema`` has it). ``route``: one routed table's rule (``routing.read_task_route``): the
    rows it does not take are dropped (another table writes them), and those its owner makes
    dead letters go to the undecided file. ``engine``: a merge engine's (``offsetlake.engine_arrow``):
    the tasks write the rows' contributions (``table_root`` is the state table) and each task one
    file of its groups' partial states (``DirectResult.partials``); rows the engine cannot fold
    exactly go to the undecided file, for the Spark steps."""
    parallelism = default_parallelism(spark)
    splits = [(s.topic, s.partition, s.start, s.end) for s in split_ranges([r for r in ranges if r.size], parallelism)]
    raw_schema, _ = read_schemas(decoder)
    relative = relative_folder(table_root, folder)
    reader = _SplitReader(
        dict(client_config), pipeline, timeout_s, decoder, max_record_bytes, raw_schema, rows_schema, dict(epochs or {}), route, engine
    )
    files_schema = engine.contributions_schema if engine is not None else rows_schema

    def tasks(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import gc

        attempt = task_attempt()
        rows = TaskFiles(table_root, relative, files_schema, partition_by, attempt=attempt)
        undecided = TaskFiles(table_root, relative, raw_schema, [], attempt=attempt, prefix="undecided")
        partial = _Partial(engine) if engine is not None else None
        read: Counter[tuple[str, int]] = Counter()
        was_enabled = gc.isenabled()
        gc.disable()  # as in reader.read_ranges: the chunks hold no cycles
        try:
            for batch in batches:
                for index in batch.column("id").to_pylist():
                    read.update(reader.read(splits[index], rows, undecided, partial))
            written = [*((ROWS, f) for f in rows.close()), *((UNDECIDED, f) for f in undecided.close())]
            if partial is not None and engine is not None:
                states = TaskFiles(table_root, relative, engine.states_schema, [], attempt=attempt, prefix="partial")
                states.write(partial.folded())
                written += [(PARTIAL, f) for f in states.close()]
            yield result_batch(written, read)
        finally:
            if was_enabled:
                gc.enable()

    job = spark.range(0, len(splits), numPartitions=task_count(splits, parallelism)).mapInArrow(
        errors.reported_as_data(tasks), RESULT_SCHEMA
    )
    result = DirectResult([], [], Counter())
    for row in job.collect():
        if row["kind"] == READ:
            result.records_read.update(result_counts(row))
        elif row["kind"] == UNDECIDED:
            result.undecided.append(row["path"])
        elif row["kind"] == PARTIAL:
            result.partials.append(row["path"])
            result.partial_rows += int(row["rows"])
        else:
            result.files.append(staged_file(row))
    return result


@dataclass(frozen=True)
class _SplitReader:
    """What a read task needs to read one split and write it (shipped to the tasks with the job)."""

    client_config: dict[str, str]
    pipeline: str
    timeout_s: float
    decoder: Decoder
    max_record_bytes: int
    raw_schema: pa.Schema
    rows_schema: pa.Schema
    epochs: dict[str, int]
    route: routing.ReadTaskRoute | None = None
    engine: ArrowEngine | None = None

    def read(
        self, split: tuple[str, int, int, int], rows: TaskFiles, undecided: TaskFiles, partial: _Partial | None
    ) -> Counter[tuple[str, int]]:
        """Consume ``[start, end)`` of one partition (``kafka.read_range``); the settled records'
        rows (a merge engine's: their contributions, folded into ``partial`` too) into ``rows``,
        the others into ``undecided``; the records read."""
        from offsetlake.kafka import read_range

        topic, partition, start, end = split
        sources = [(column, inner) for column, _, inner in _sources(self.decoder)]
        read: Counter[tuple[str, int]] = Counter()
        for chunk in read_range(self.client_config, self.pipeline, topic, partition, start, end, self.timeout_s):
            read[(topic, partition)] += len(chunk)
            columns, settled = decided_columns(
                chunk, topic, partition, self.decoder, headers_of_rows=False, max_record_bytes=self.max_record_bytes
            )
            records = pa.RecordBatch.from_arrays(columns, schema=self.raw_schema)
            mask = pa.array(settled if settled is not None else [False] * len(chunk), pa.bool_())
            settled_records = pa.Table.from_batches([records.filter(mask)])
            sink_rows = _sink_rows(settled_records, sources, self.rows_schema, self.epochs)
            left = [pa.Table.from_batches([records.filter(pc.invert(mask))])]
            if self.route is not None:
                kept, to_spark = self.route.masks(sink_rows)
                sink_rows, left = sink_rows.filter(kept), [*left, settled_records.filter(to_spark)]
                settled_records = settled_records.filter(kept)
            if self.engine is not None and partial is not None:
                exact = self.engine.exact(sink_rows)
                sink_rows, left = sink_rows.filter(exact), [*left, settled_records.filter(pc.invert(exact))]
                sink_rows = self.engine.contributions(sink_rows)
                partial.add(sink_rows)
            rows.write(sink_rows, source=(topic, partition))
            undecided.write(pa.concat_tables(left) if len(left) > 1 else left[0], source=(topic, partition))
        return read


class _Partial:
    """A read task's partial states of its groups (a merge engine's, ``offsetlake.engine_arrow``):
    its contributions folded per group as they come, folded again once they hold many rows."""

    FOLD_AT = 100_000  # rows held before they are folded into one per group

    def __init__(self, engine: ArrowEngine) -> None:
        self.engine = engine
        self.held: list[pa.Table] = []
        self.rows = 0

    def add(self, contributions: pa.Table) -> None:
        if not contributions.num_rows:
            return
        self.held.append(self.engine.fold(contributions.select([*self.engine.group, STATE])))
        self.rows += self.held[-1].num_rows
        if self.rows >= self.FOLD_AT and len(self.held) > 1:
            self.held = [self.folded()]
            self.rows = self.held[0].num_rows

    def folded(self) -> pa.Table:
        """One row per group of every contribution added."""
        if not self.held:
            return self.engine.states_schema.empty_table()
        return self.held[0] if len(self.held) == 1 else self.engine.fold(pa.concat_tables(self.held))


def undecided_frame(spark: SparkSession, table_root: storage.Location, paths: list[str], decoder: Decoder) -> DataFrame | None:
    """The undecided records as the read frame the Spark path reads (``reader.read_ranges``'s
    columns), or None when there are none."""
    if not paths:
        return None
    raw_schema, _ = read_schemas(decoder)
    return read_files(spark, table_root, [{"path": storage.log_path_from_file_path(p)} for p in paths], raw_schema, [])


def remove_undecided(table_root: storage.Location, paths: list[str]) -> None:
    """Delete the undecided records' files once the Spark path has decided them (a crash
    leaves them, uncommitted and inert, for vacuum)."""
    fs, root = storage.filesystem(table_root)
    for path in paths:
        fs.delete_file(f"{root.rstrip('/')}/{path}")


def _sink_rows(records: pa.Table, sources: list[tuple[str, str]], rows_schema: pa.Schema, epochs: dict[str, int]) -> pa.Table:
    """Settled records (of one topic-partition) as sink rows: the decoded fields (value, then
    key), then the coordinate columns (the columns of ``formats.good_rows``) and, when the schema
    has it, the topic's epoch (``coordinates.with_topic_epochs``), in the schema Spark gives them."""
    columns = []
    for struct, inner in sources:
        column = records.column(struct).combine_chunks()
        assert isinstance(column, pa.StructArray)
        # a null struct (a record without a key) gives null fields, as in Spark
        columns.append(column.flatten()[column.type.get_field_index(inner)])
    columns += [records.column(c) for c in ("topic", "partition", "offset", "timestamp")]
    if TOPIC_EPOCH in rows_schema.names:
        topic = records.column("topic")[0].as_py() if records.num_rows else ""
        columns.append(topic_epoch_array(topic, records.num_rows, epochs))
    return pa.Table.from_arrays(columns, schema=rows_schema)
