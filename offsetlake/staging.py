"""A batch's data files, written by the Spark tasks themselves with pyarrow: one write path for a
local lake and for object storage, with no Hadoop filesystem connector: ``hadoop-aws`` is pinned
only so that Spark can *read* S3 lakes by name (``offsetlake sql``, the catalog), and a run must
not need it on a user's cluster that lacks it.

``TaskFiles`` is the one task-side file writer of every data path: the Spark path's tasks
(``write_rows``: rows that arrive sorted by the partition columns, ``sortWithinPartitions`` as
Spark's own writer does, so one file open at a time) and the direct path's read tasks
(``offsetlake.direct``: rows in Kafka order, up to ``MAX_OPEN_FILES`` open). It writes one file
per partition value it meets (Hive-style ``column=value/`` folders escaped exactly as Spark
escapes them, ``storage.partition_folder``), gathers rows into row groups of ``ROW_GROUP_ROWS``,
names every file after its task attempt (``task_attempt``, ``file_name``) and counts rows per
topic-partition inside the plan's ranges. A task returns the files it wrote as result rows
(``RESULT_SCHEMA``, read back by ``staged_files``); the driver commits exactly those files. Files
of a failed or speculative task attempt are never returned, so they are never committed (they are
inert, and vacuum removes them later), and a file returned but missing makes the commit refuse
(``sink.add_actions_for``).
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
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

ROW_GROUP_ROWS = 65_536  # rows a file gathers before writing a row group
# Files a task keeps open at once: each holds a row group's rows and, on object storage, an upload
# buffer. A task that meets more partition values closes the least recently written file (its
# later rows of that value go to a new file), so memory does not follow the partitions' number.
MAX_OPEN_FILES = 16
# What a task returns: one row per file it wrote (``kind`` ROWS, UNDECIDED for the direct path's
# records left to Spark, PARTIAL for a merge engine's partial states of the task's groups,
# ``offsetlake.engine_arrow``) and any rows of its own kind (the direct path's records READ per range).
RESULT_SCHEMA = "kind string, path string, rows long, size long, empty_as_null long, counts string"
ROWS, UNDECIDED, PARTIAL, READ = "file", "undecided", "partial", "read"


def task_attempt() -> str:
    """The running task attempt's id for its file names: the Spark partition and a random part,
    so a retried or speculative attempt never writes over another attempt's files."""
    from pyspark import TaskContext

    context = TaskContext.get()
    return f"{context.partitionId() if context else 0:05d}-{uuid.uuid4().hex[:12]}"


def file_name(attempt: str, sequence: int, prefix: str = "part") -> str:
    """The name of a task's ``sequence``-th file: unique per file, never per task alone, because
    two runs of rows may map to one folder (null and "" both to the default partition) and a
    second file of the same name would overwrite the first (issue 35, finding 1)."""
    return f"{prefix}-{attempt}-{sequence:04d}.c000.snappy.parquet"


def relative_folder(table_root: storage.Location, folder: str) -> str:
    """``folder`` (a staging folder inside the table) relative to the table root."""
    return folder[len(table_root.path.rstrip("/")) + 1 :]


class TaskFiles:
    """One task's files under ``folder`` (relative to ``table_root``): one parquet file of
    ``schema`` (without the partition columns) per value of ``partition_by``, at most
    ``max_open`` open (the least recently written is closed first), rows gathered into row groups
    of ``ROW_GROUP_ROWS``. Each file counts its rows per topic-partition (the columns
    ``counted_by``) among those ``inside`` keeps (None: all of them).

    Raises what pyarrow raises (a full disk, a store refusing a write): the task fails and none of
    its files is returned, so none is committed.
    """

    def __init__(
        self,
        table_root: storage.Location,
        folder: str,
        schema: pa.Schema,
        partition_by: list[str],
        *,
        max_open: int = MAX_OPEN_FILES,
        attempt: str | None = None,
        prefix: str = "part",
        inside: Any = None,
        counted_by: tuple[str, str] = (TOPIC, PARTITION),
    ) -> None:
        self.fs, self.root = storage.filesystem(table_root)
        self.folder, self.partition_by, self.max_open, self.prefix = folder, partition_by, max_open, prefix
        self.schema = pa.schema([f for f in schema if f.name not in partition_by])
        self.attempt = attempt or task_attempt()
        self.inside, self.counted_by = inside, counted_by
        self.open: dict[tuple, _File] = {}  # least recently written first
        self.closed: list[_File] = []
        self.made = 0

    def write(self, rows: pa.Table, source: tuple[str, int] | None = None) -> None:
        """Rows into the file of their partition value (opened when it has none open). ``source``:
        the one topic-partition every row comes from, when the caller knows it (a read task's
        chunk) and counts every row: they are counted without grouping them."""
        for key, part in _by_partition(rows, self.partition_by):
            file = self.open.pop(key, None) or self._new_file(key)
            self.open[key] = file  # now the most recently written
            if source is not None and self.inside is None:
                counts = Counter({source: part.num_rows})
            elif self.counted_by[0] not in part.column_names:  # rows of no one record (a merge engine's groups)
                counts = Counter()
            else:
                counts = _counts(part if self.inside is None else part.filter(self.inside), self.counted_by)
            file.add(part.drop_columns(self.partition_by) if self.partition_by else part, counts)
            if any(v == "" for v in key):  # "" is stored as null (``storage.stores_as_null``)
                file.empty_as_null += part.num_rows

    def _new_file(self, key: tuple) -> _File:
        if len(self.open) >= self.max_open:
            self.closed.append(self.open.pop(next(iter(self.open))).close())
        sub = "/".join(storage.partition_folder(c, v) for c, v in zip(self.partition_by, key, strict=True))
        relative = "/".join(p for p in (self.folder, sub, file_name(self.attempt, self.made, self.prefix)) if p)
        self.made += 1
        return _File(relative, open_output(self.fs, self.root, relative), self.schema)

    def close(self) -> list[_File]:
        """Close every file; the files written, in the order they were opened or closed."""
        done = self.closed + [f.close() for f in self.open.values()]
        self.open, self.closed = {}, []
        return done


class _File:
    """One parquet file being written: rows gathered into row groups, rows per topic-partition."""

    def __init__(self, relative: str, stream: Any, schema: pa.Schema) -> None:
        self.relative, self.stream = relative, stream
        self.writer = pq.ParquetWriter(stream, schema, compression="snappy")
        self.pending: list[pa.Table] = []
        self.pending_rows = 0
        self.rows = 0
        self.size = 0
        self.empty_as_null = 0
        self.counts: Counter[tuple[str, int]] = Counter()

    def add(self, data: pa.Table, counts: Counter[tuple[str, int]]) -> None:
        self.pending.append(data)
        self.pending_rows += data.num_rows
        self.rows += data.num_rows
        self.counts.update(counts)
        if self.pending_rows >= ROW_GROUP_ROWS:
            self._flush()

    def _flush(self) -> None:
        if self.pending:
            self.writer.write_table(pa.concat_tables(self.pending))
            self.pending, self.pending_rows = [], 0

    def close(self) -> _File:
        self._flush()
        self.writer.close()
        self.size = self.stream.tell()
        self.stream.close()
        return self


def _counts(rows: pa.Table, columns: tuple[str, str]) -> Counter[tuple[str, int]]:
    if rows.num_rows == 0:
        return Counter()
    grouped = rows.group_by(list(columns)).aggregate([([], "count_all")]).to_pylist()
    return Counter({(r[columns[0]], r[columns[1]]): r["count_all"] for r in grouped})


def _by_partition(rows: pa.Table, partition_by: list[str]) -> Iterator[tuple[tuple, pa.Table]]:
    """``rows`` split by the values of the partition columns, in the order each value first comes
    (one piece, key ``()``, without any): rows sorted by them come out as their runs."""
    if rows.num_rows == 0:
        return
    if not partition_by:
        yield (), rows
        return
    keys = list(zip(*(rows.column(c).to_pylist() for c in partition_by), strict=True))
    where: dict[tuple, list[int]] = {}
    for i, key in enumerate(keys):
        where.setdefault(key, []).append(i)
    if len(where) == 1:  # the common case of sorted rows: one value per batch, no copy
        yield keys[0], rows
        return
    for key, indices in where.items():
        yield key, rows.take(pa.array(indices, pa.int64()))


def result_batch(files: Iterable[tuple[str, _File]], read: Counter[tuple[str, int]] | None = None) -> pa.RecordBatch:
    """A task's result rows (``RESULT_SCHEMA``): one per file with its kind, then, when given, one
    READ row with the records the task read per topic-partition."""
    rows = [(kind, f.relative, f.rows, f.size, f.empty_as_null, f.counts) for kind, f in files]
    if read is not None:
        rows.append((READ, "", sum(read.values()), 0, 0, read))
    return pa.RecordBatch.from_pydict(
        {
            "kind": [r[0] for r in rows],
            "path": [r[1] for r in rows],
            "rows": [r[2] for r in rows],
            "size": [r[3] for r in rows],
            "empty_as_null": [r[4] for r in rows],
            "counts": [json.dumps([[t, p, n] for (t, p), n in r[5].items()]) for r in rows],
        },
        schema=pa.schema(
            [
                ("kind", pa.string()),
                ("path", pa.string()),
                ("rows", pa.int64()),
                ("size", pa.int64()),
                ("empty_as_null", pa.int64()),
                ("counts", pa.string()),
            ]
        ),
    )


def result_counts(row: Any) -> dict[tuple[str, int], int]:
    """The per topic-partition counts of a task's result row."""
    return {(t, int(p)): int(n) for t, p, n in json.loads(row["counts"])}


def staged_file(row: Any) -> StagedFile:
    """A task's result row of a file it wrote as a ``StagedFile``."""
    return StagedFile(
        path=row["path"], rows=int(row["rows"]), counts=result_counts(row), size=int(row["size"]), empty_as_null=int(row["empty_as_null"])
    )


def write_rows(
    rows: DataFrame, table_root: storage.Location, folder: str, partition_by: list[str], selection: Selection, sort_by: tuple[str, ...] = ()
) -> list[StagedFile]:
    """Write ``rows`` as parquet files under ``folder`` (inside ``table_root``) from the Spark
    tasks; the files written, for one commit, each counting its rows inside ``selection`` (a
    backfill rewrites rows outside its ranges too). ``sort_by``: columns each file is sorted by
    after the partition columns (a keyed sink's key, so file statistics bound each file's keys)."""
    relative = relative_folder(table_root, folder)

    def write(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        files: TaskFiles | None = None
        for batch in batches:
            if files is None:  # sorted by the partition columns: each value's rows come together
                files = TaskFiles(table_root, relative, batch.schema, partition_by, max_open=1, inside=selection.arrow())
            files.write(pa.Table.from_batches([batch]))
        if files is not None:
            yield result_batch((ROWS, f) for f in files.close())

    ordered = rows.sortWithinPartitions(*partition_by, *sort_by) if partition_by or sort_by else rows
    return [staged_file(row) for row in ordered.mapInArrow(write, RESULT_SCHEMA).collect()]


def write_table(
    rows: pa.Table,
    table_root: storage.Location,
    folder: str,
    partition_by: list[str],
    selection: Selection,
    sort_by: tuple[str, ...],
    files: int,
) -> list[StagedFile]:
    """``write_rows`` from the driver, for rows that are there already (a merge engine's groups,
    a keyed sink's rows of them): sorted by the partition columns and ``sort_by``, cut into
    ``files`` runs of rows as ``repartitionByRange`` cuts them, each run written by its own
    ``TaskFiles``, so each file's statistics bound a range of the sort columns."""
    if rows.num_rows == 0:
        return []
    order = [*partition_by, *sort_by]
    ordered = rows.sort_by([(c, "ascending") for c in order]) if order else rows
    relative = relative_folder(table_root, folder)
    size = -(-ordered.num_rows // max(1, files))
    staged: list[StagedFile] = []
    for start in range(0, ordered.num_rows, size):
        run = TaskFiles(
            table_root,
            relative,
            ordered.schema,
            partition_by,
            max_open=1,
            attempt=f"driver-{uuid.uuid4().hex[:12]}",
            inside=selection.arrow(),
        )
        run.write(ordered.slice(start, size))
        staged += [StagedFile(f.relative, f.rows, dict(f.counts), f.size, f.empty_as_null) for f in run.close()]
    return staged


def open_output(fs: Any, root: str, relative: str) -> Any:
    """A new file under the table root, for a task to write (its folders made on a local disk)."""
    path = f"{root}/{relative}"
    if isinstance(fs, LocalFileSystem):  # object stores have no folders to make
        fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    return fs.open_output_stream(path)


# ---- reading files back (a keyed sink's merge rewrites the files holding touched keys) ---------
def read_files(
    spark: Any,
    table_root: storage.Location,
    files: list[dict[str, Any]],
    schema: pa.Schema,
    partition_by: list[str],
    columns: list[str] | None = None,
    reduce: Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]] | None = None,
    reduced: pa.Schema | None = None,
) -> DataFrame:
    """The rows of these data files (``sink.live_files`` rows) as a DataFrame of ``schema``,
    read by the Spark tasks with pyarrow (the same filesystem as ``write_rows``, so on object
    storage too): partition columns from each file's partition values, a column a file lacks
    (written before the column was added) as null. ``columns``: only these of ``schema`` (Spark
    cannot prune the columns of a Python source, so a reader that needs few says which).
    ``reduce``: what each task hands Spark of the rows it read (a picklable callable, rows of
    schema ``reduced``), so that they need not all cross into the JVM (a merge engine's states
    folded per group, ``engine_arrow.StatesFolded``)."""
    from pyspark.sql.pandas.types import from_arrow_schema

    entries = [(storage.file_path_from_log(f["path"]), {c: f.get(f"partition.{c}") for c in partition_by}) for f in files]
    if columns is not None:
        schema = pa.schema([schema.field(c) for c in columns])

    def parts(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        fs, root = storage.filesystem(table_root)
        for batch in batches:
            for index in batch.column("id").to_pylist():
                path, values = entries[index]
                with fs.open_input_file(f"{root.rstrip('/')}/{path}") as handle:
                    parquet = pq.ParquetFile(handle)
                    present = [c for c in schema.names if c in parquet.schema_arrow.names] if columns is not None else None
                    for part in parquet.iter_batches(batch_size=65_536, columns=present):
                        yield _conformed(part, schema, values)

    def read(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        return reduce(parts(batches)) if reduce is not None else parts(batches)

    slices = max(1, min(len(entries), 2 * default_parallelism(spark)))
    out = reduced if reduce is not None and reduced is not None else schema
    return spark.range(0, len(entries), numPartitions=slices).mapInArrow(read, from_arrow_schema(out))


def read_table(table_root: storage.Location, files: list[dict[str, Any]], schema: pa.Schema, partition_by: list[str]) -> pa.Table:
    """``read_files`` on the driver, for files that hold few rows (a merge engine's groups, a
    keyed sink's rows of them): the rows of these files as one table of ``schema``."""
    fs, root = storage.filesystem(table_root)
    batches = []
    for f in files:
        values = {c: f.get(f"partition.{c}") for c in partition_by}
        with fs.open_input_file(f"{root.rstrip('/')}/{storage.file_path_from_log(f['path'])}") as handle:
            batches += [_conformed(part, schema, values) for part in pq.ParquetFile(handle).iter_batches(batch_size=65_536)]
    return pa.Table.from_batches(batches, schema=schema)


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
