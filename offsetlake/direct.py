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

import json
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from offsetlake import errors, storage
from offsetlake.coordinates import TOPIC_EPOCH, topic_epoch_array
from offsetlake.formats import PARSED_IN_READ, Decoder
from offsetlake.formats.keys import KEY_PARSED, KeyedDecoder
from offsetlake.plan import BatchPlan, OffsetRange
from offsetlake.reader import decided_columns, read_schemas, split_ranges
from offsetlake.sink import StagedFile
from offsetlake.spark import default_parallelism
from offsetlake.staging import file_name, open_output, partition_folder, read_files, staged_file

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from offsetlake.config import PipelineConfig

ROW_GROUP_ROWS = 65_536  # rows a task gathers per partition value before writing a row group
# Files a task keeps open at once: each holds a row group's rows and, on object storage, an upload
# buffer. A task that meets more partition values closes the least recently written file (its
# later rows of that value go to a new file), so memory does not follow the partitions' number.
MAX_OPEN_FILES = 16
_RESULT_SCHEMA = "kind string, path string, rows long, size long, empty_as_null long, counts string"
_FILE, _UNDECIDED, _READ = "file", "undecided", "read"


def problem(config: PipelineConfig, plan: BatchPlan, has_suite: bool, decoder: Decoder) -> str | None:
    """Why this batch takes the Spark path, or None when its read tasks may write its files
    (then ``schema_problem`` has the last word)."""
    if config.sink.mode != "append":
        return "a keyed sink merges in Spark"
    if config.transform:
        return "a transform runs in Spark"
    if has_suite:
        return "the suite validates the rows in Spark"
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
    return None


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
) -> DirectResult:
    """One Spark job: each task reads its split, writes the rows its decoder settled as parquet
    under ``folder`` (inside ``table_root``), and the rest of its records to an undecided file
    (a record above ``max_record_bytes`` among them: the Spark path's rule, ``reader.decided_columns``).
    ``epochs``: each topic's current epoch, which its rows carry as the Spark path's do
    (``coordinates.TOPIC_EPOCH``, when ``rows_schema`` has it)."""
    splits = [(s.topic, s.partition, s.start, s.end) for s in split_ranges([r for r in ranges if r.size], default_parallelism(spark))]
    raw_schema, _ = read_schemas(decoder)
    relative_folder = folder[len(table_root.path.rstrip("/")) + 1 :]
    file_schema = pa.schema([f for f in rows_schema if f.name not in partition_by])
    sources = [(column, inner) for column, _, inner in _sources(decoder)]
    max_open = MAX_OPEN_FILES
    epochs = dict(epochs or {})

    def tasks(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import gc

        from pyspark import TaskContext

        from offsetlake.kafka import read_range

        context = TaskContext.get()
        attempt = f"{context.partitionId() if context else 0:05d}-{uuid.uuid4().hex[:12]}"
        fs, root = storage.filesystem(table_root)
        files = _TaskFiles(fs, root, relative_folder, attempt, file_schema, partition_by, max_open)
        read: Counter[tuple[str, int]] = Counter()
        was_enabled = gc.isenabled()
        gc.disable()  # as in reader.read_ranges: the chunks hold no cycles
        try:
            for batch in batches:
                for index in batch.column("id").to_pylist():
                    topic, partition, start, end = splits[index]
                    for chunk in read_range(client_config, pipeline, topic, partition, start, end, timeout_s):
                        read[(topic, partition)] += len(chunk)
                        columns, settled = decided_columns(
                            chunk, topic, partition, decoder, headers_of_rows=False, max_record_bytes=max_record_bytes
                        )
                        records = pa.RecordBatch.from_arrays(columns, schema=raw_schema)
                        mask = pa.array(settled if settled is not None else [False] * len(chunk), pa.bool_())
                        files.add_rows(_sink_rows(records.filter(mask), sources, rows_schema, epochs), (topic, partition))
                        files.add_undecided(records.filter(pc.invert(mask)), (topic, partition))
            yield from files.close(read)
        finally:
            if was_enabled:
                gc.enable()

    job = spark.range(0, len(splits), numPartitions=max(1, len(splits))).mapInArrow(errors.reported_as_data(tasks), _RESULT_SCHEMA)
    result = DirectResult([], [], Counter())
    for row in job.collect():
        counts = {(t, int(p)): int(n) for t, p, n in json.loads(row["counts"])}
        if row["kind"] == _READ:
            result.records_read.update(counts)
        elif row["kind"] == _UNDECIDED:
            result.undecided.append(row["path"])
        else:
            result.files.append(staged_file(row))
    return result


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


def _sink_rows(records: pa.RecordBatch, sources: list[tuple[str, str]], rows_schema: pa.Schema, epochs: dict[str, int]) -> pa.Table:
    """Settled records (of one topic-partition) as sink rows: the decoded fields (value, then
    key), then the coordinate columns (the columns of ``formats.good_rows``) and, when the schema
    has it, the topic's epoch (``coordinates.with_topic_epochs``), in the schema Spark gives them."""
    columns = []
    for struct, inner in sources:
        column = records.column(struct)
        assert isinstance(column, pa.StructArray)
        # a null struct (a record without a key) gives null fields, as in Spark
        columns.append(column.flatten()[column.type.get_field_index(inner)])
    columns += [records.column(c) for c in ("topic", "partition", "offset", "timestamp")]
    if TOPIC_EPOCH in rows_schema.names:
        topic = records.column("topic")[0].as_py() if records.num_rows else ""
        columns.append(topic_epoch_array(topic, records.num_rows, epochs))
    return pa.Table.from_arrays(columns, schema=rows_schema)


class _TaskFiles:
    """A task's open files: one parquet file per partition value (rows gathered into row groups
    of ``ROW_GROUP_ROWS``, at most ``max_open`` open) and one for its undecided records."""

    def __init__(self, fs: Any, root: str, folder: str, attempt: str, schema: pa.Schema, partition_by: list[str], max_open: int) -> None:
        self.fs, self.root, self.folder, self.attempt = fs, root, folder, attempt
        self.schema, self.partition_by, self.max_open = schema, partition_by, max_open
        self.open: dict[tuple, _Buffered] = {}  # least recently written first
        self.closed: list[_Buffered] = []
        self.made = 0
        self.undecided: _Buffered | None = None

    def _create(self, relative: str, schema: pa.Schema) -> _Buffered:
        return _Buffered(relative, open_output(self.fs, self.root, relative), schema)

    def add_rows(self, rows: pa.Table, source: tuple[str, int]) -> None:
        if rows.num_rows == 0:
            return
        for key, part in _by_partition(rows, self.partition_by):
            file = self.open.pop(key, None)
            if file is None:
                if len(self.open) >= self.max_open:
                    self.closed.append(self.open.pop(next(iter(self.open))).close())
                sub = "/".join(partition_folder(c, v) for c, v in zip(self.partition_by, key, strict=True))
                name = file_name(self.attempt, self.made)
                self.made += 1
                file = self._create("/".join(p for p in (self.folder, sub, name) if p), self.schema)
            self.open[key] = file  # now the most recently written
            file.add(part.drop_columns(self.partition_by) if self.partition_by else part, source)
            if any(v == "" for v in key):
                file.empty_as_null += part.num_rows

    def add_undecided(self, records: pa.RecordBatch, source: tuple[str, int]) -> None:
        if records.num_rows == 0:
            return
        if self.undecided is None:
            self.undecided = self._create(f"{self.folder}/undecided-{self.attempt}.parquet", records.schema)
        self.undecided.add(pa.Table.from_batches([records]), source)

    def close(self, read: Counter[tuple[str, int]]) -> Iterator[pa.RecordBatch]:
        """Close every file; one result row per file, then the records read per topic-partition."""
        results = [(_FILE, f) for f in self.closed] + [(_FILE, f.close()) for f in self.open.values()]
        if self.undecided is not None:
            results.append((_UNDECIDED, self.undecided.close()))
        yield pa.RecordBatch.from_pydict(
            {
                "kind": [k for k, _ in results] + [_READ],
                "path": [f.relative for _, f in results] + [""],
                "rows": [f.rows for _, f in results] + [sum(read.values())],
                "size": [f.size for _, f in results] + [0],
                "empty_as_null": [f.empty_as_null for _, f in results] + [0],
                "counts": [_counts_json(c) for c in [*(f.counts for _, f in results), read]],
            }
        )


class _Buffered:
    """One parquet file being written: rows gathered into row groups, and rows per topic-partition."""

    def __init__(self, relative: str, stream: Any, schema: pa.Schema) -> None:
        self.relative, self.stream = relative, stream
        self.writer = pq.ParquetWriter(stream, schema, compression="snappy")
        self.pending: list[pa.Table] = []
        self.pending_rows = 0
        self.rows = 0
        self.size = 0
        self.empty_as_null = 0
        self.counts: Counter[tuple[str, int]] = Counter()

    def add(self, data: pa.Table, source: tuple[str, int]) -> None:
        """Rows (or records) of one consumed chunk, so all of one topic-partition."""
        self.pending.append(data)
        self.pending_rows += data.num_rows
        self.rows += data.num_rows
        self.counts[source] += data.num_rows
        if self.pending_rows >= ROW_GROUP_ROWS:
            self._flush()

    def _flush(self) -> None:
        if self.pending:
            self.writer.write_table(pa.concat_tables(self.pending))
            self.pending, self.pending_rows = [], 0

    def close(self) -> _Buffered:
        self._flush()
        self.writer.close()
        self.size = self.stream.tell()
        self.stream.close()
        return self


def _counts_json(counts: Counter[tuple[str, int]]) -> str:
    return json.dumps([[t, p, n] for (t, p), n in counts.items()])


def _by_partition(rows: pa.Table, partition_by: list[str]) -> Iterator[tuple[tuple, pa.Table]]:
    """``rows`` split by the values of the partition columns (one piece, key ``()``, without any)."""
    if not partition_by:
        yield (), rows
        return
    keys = list(zip(*(rows.column(c).to_pylist() for c in partition_by), strict=True))
    where: dict[tuple, list[int]] = {}
    for i, key in enumerate(keys):
        where.setdefault(key, []).append(i)
    for key, indices in where.items():
        yield key, rows.take(pa.array(indices, pa.int64()))
