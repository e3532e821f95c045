"""A batch's data files, written by the Spark tasks themselves with pyarrow: one write path for a
local lake and for object storage, with no Hadoop filesystem connector (``hadoop-aws`` is a
Maven download that nothing here, nor many users' clusters, can install).

Each task sorts nothing and shuffles nothing: the rows arrive sorted by the partition columns
(``sortWithinPartitions``, as Spark's own writer does), so a task has one file open at a time
and writes one file per partition value it sees, under Hive-style ``column=value/`` folders
escaped exactly as Spark escapes them (``storage.partition_folder``). A task returns the files it
wrote (path under the table, rows, and rows per topic-partition inside the plan's ranges); the
driver commits exactly those files. Files of a failed or speculative task attempt are never
returned, so they are never committed (they are inert, and vacuum removes them later), and a
file returned but missing makes the commit refuse (``sink.add_actions_for``).
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq
from pyarrow.fs import LocalFileSystem

from offsetlake import storage
from offsetlake.coordinates import PARTITION, TOPIC, Selection
from offsetlake.sink import StagedFile
from offsetlake.spark import default_parallelism

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame
    from pyspark.sql.types import DataType

_RESULT_SCHEMA = "path string, rows long, size long, empty_as_null long, counts string"


def file_name(attempt: str, sequence: int) -> str:
    """The name of a task's ``sequence``-th file: unique per file, never per task alone, because
    two runs of rows may map to one folder (null and "" both to the default partition) and a
    second file of the same name would overwrite the first (issue 35, finding 1)."""
    return f"part-{attempt}-{sequence:04d}.c000.snappy.parquet"


def write_rows(
    rows: DataFrame, table_root: storage.Location, folder: str, partition_by: list[str], selection: Selection, sort_by: tuple[str, ...] = ()
) -> list[StagedFile]:
    """Write ``rows`` as parquet files under ``folder`` (inside ``table_root``) from the Spark
    tasks; the files written, for one commit. ``sort_by``: columns each file is sorted by after
    the partition columns (a keyed sink's key, so file statistics bound each file's keys)."""
    relative_folder = folder[len(table_root.path.rstrip("/")) + 1 :]

    def write(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        context = TaskContext.get()
        attempt = f"{context.partitionId() if context else 0:05d}-{uuid.uuid4().hex[:12]}"
        fs, root = storage.filesystem(table_root)
        inside = selection.arrow()
        done: list[_OpenFile] = []
        current: _OpenFile | None = None
        for batch in batches:
            for key, part in _runs(batch, partition_by):
                if current is None or current.key != key:
                    if current is not None:
                        done.append(current.close())
                    sub = "/".join(storage.partition_folder(c, v) for c, v in zip(partition_by, key, strict=True))
                    relative = "/".join(p for p in (relative_folder, sub, file_name(attempt, len(done))) if p)
                    current = _OpenFile(
                        key, relative, open_output(fs, root, relative), pa.schema([f for f in part.schema if f.name not in partition_by])
                    )
                current.write(part.drop_columns(partition_by) if partition_by else part, part if inside is None else part.filter(inside))
        if current is not None:
            done.append(current.close())
        if done:
            yield pa.RecordBatch.from_pydict(
                {
                    "path": [f.relative for f in done],
                    "rows": [f.rows for f in done],
                    "size": [f.size for f in done],
                    "empty_as_null": [f.rows if any(v == "" for v in f.key) else 0 for f in done],
                    "counts": [json.dumps([[t, p, n] for (t, p), n in f.counts.items()]) for f in done],
                }
            )

    ordered = rows.sortWithinPartitions(*partition_by, *sort_by) if partition_by or sort_by else rows
    files = []
    for row in ordered.mapInArrow(write, _RESULT_SCHEMA).collect():
        files.append(staged_file(row))
    return files


def staged_file(row: Any) -> StagedFile:
    """A task's result row (``path, rows, size, empty_as_null, counts``) as a ``StagedFile``."""
    counts = {(t, int(p)): int(n) for t, p, n in json.loads(row["counts"])}
    return StagedFile(
        path=row["path"], rows=int(row["rows"]), counts=counts, size=int(row["size"]), empty_as_null=int(row["empty_as_null"])
    )


def open_output(fs: Any, root: str, relative: str) -> Any:
    """A new file under the table root, for a task to write (its folders made on a local disk)."""
    path = f"{root}/{relative}"
    if isinstance(fs, LocalFileSystem):  # object stores have no folders to make
        fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    return fs.open_output_stream(path)


class _OpenFile:
    """One parquet file a task is writing: its partition key, path, rows and per-range counts."""

    def __init__(self, key: tuple, relative: str, stream: Any, schema: pa.Schema) -> None:
        self.key, self.relative, self.stream = key, relative, stream
        self.writer = pq.ParquetWriter(stream, schema, compression="snappy")
        self.rows = 0
        self.size = 0
        self.counts: Counter[tuple[str, int]] = Counter()

    def write(self, data: pa.Table, inside: pa.Table) -> None:
        self.writer.write_table(data)
        self.rows += data.num_rows
        if inside.num_rows:
            for row in inside.group_by([TOPIC, PARTITION]).aggregate([([], "count_all")]).to_pylist():
                self.counts[(row[TOPIC], row[PARTITION])] += row["count_all"]

    def close(self) -> _OpenFile:
        self.writer.close()
        self.size = self.stream.tell()
        self.stream.close()
        return self


def _runs(batch: pa.RecordBatch, partition_by: list[str]) -> Iterator[tuple[tuple, pa.Table]]:
    """Consecutive slices of ``batch`` with one value of the partition columns each."""
    if batch.num_rows == 0:
        return
    table = pa.Table.from_batches([batch])
    if not partition_by:
        yield (), table
        return
    keys = list(zip(*(table.column(c).to_pylist() for c in partition_by), strict=True))
    start = 0
    for i in range(1, len(keys) + 1):
        if i == len(keys) or keys[i] != keys[start]:
            yield keys[start], table.slice(start, i - start)
            start = i


# ---- reading files back (a keyed sink's merge rewrites the files holding touched keys) ---------
def read_files(
    spark: Any, table_root: storage.Location, files: list[dict[str, Any]], schema: pa.Schema, partition_by: list[str]
) -> DataFrame:
    """The rows of these data files (``sink.live_files`` rows) as a DataFrame of ``schema``,
    read by the Spark tasks with pyarrow (the same filesystem as ``write_rows``, so on object
    storage too): partition columns from each file's partition values, a column a file lacks
    (written before the column was added) as null."""
    from pyspark.sql.pandas.types import from_arrow_schema

    entries = [(storage.file_path_from_log(f["path"]), {c: f.get(f"partition.{c}") for c in partition_by}) for f in files]

    def read(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        fs, root = storage.filesystem(table_root)
        for batch in batches:
            for index in batch.column("id").to_pylist():
                path, values = entries[index]
                with fs.open_input_file(f"{root.rstrip('/')}/{path}") as handle:
                    for part in pq.ParquetFile(handle).iter_batches(batch_size=65_536):
                        yield _conformed(part, schema, values)

    slices = max(1, min(len(entries), 2 * default_parallelism(spark)))
    return spark.range(0, len(entries), numPartitions=slices).mapInArrow(read, from_arrow_schema(schema))


def _conformed(batch: pa.RecordBatch, schema: pa.Schema, partition_values: dict[str, Any]) -> pa.RecordBatch:
    columns = []
    for f in schema:
        if f.name in partition_values:
            columns.append(pa.array([partition_values[f.name]] * batch.num_rows).cast(f.type))
        elif f.name in batch.schema.names:
            column = batch.column(f.name)
            columns.append(column if column.type == f.type else column.cast(f.type))
        else:
            columns.append(pa.nulls(batch.num_rows, f.type))
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def conformed_column(column: Column, have: DataType, want: DataType) -> Column:
    """``column`` (of Spark type ``have``) as type ``want``, struct fields matched by name at any
    depth (inside arrays and map values too), a field ``have`` lacks as null: the Spark side of
    ``_conformed``, for rows decoded without a nested field the sink holds (invariant 12: a field
    that leaves the schema stays in the sink, its new rows read null). Spark's own cast matches
    struct fields by position and refuses structs of different sizes, so it is used for leaves only;
    a leaf whose type cannot be cast raises Spark's AnalysisException, as a plain cast does."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import ArrayType, MapType, StructType

    if have == want:
        return column
    if isinstance(have, StructType) and isinstance(want, StructType):
        present = {f.name: f.dataType for f in have.fields}
        fields = [
            (
                conformed_column(column.getField(f.name), present[f.name], f.dataType)
                if f.name in present
                else F.lit(None).cast(f.dataType)
            ).alias(f.name)
            for f in want.fields
        ]
        return F.when(column.isNull(), F.lit(None).cast(want)).otherwise(F.struct(*fields))
    if isinstance(have, ArrayType) and isinstance(want, ArrayType):
        return F.transform(column, lambda item: conformed_column(item, have.elementType, want.elementType))
    if isinstance(have, MapType) and isinstance(want, MapType):
        return F.transform_values(column, lambda _, value: conformed_column(value, have.valueType, want.valueType))
    return column.cast(want)
