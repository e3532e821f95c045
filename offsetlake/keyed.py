"""Keyed sinks (``sink.mode: upsert``): one row per key, the newest record's (invariant 13).

**The ordering rule.** Of two records of one key, the newer is the one at the higher offset when
both come from the same topic-partition (Kafka orders a partition, and its default partitioner
keeps a key in one partition); of a topic deleted and re-created under the pipeline (``offsetlake
topic reset-epoch``, invariant 16), a record of a later epoch is newer than every record of an
earlier epoch of the same topic-partition, whatever their offsets or times (the epochs' logs
follow each other; rows carry their epoch, ``coordinates.TOPIC_EPOCH``). When they come from different topic-partitions, the newer is the
one with the later Kafka timestamp, then the greater (topic, partition, offset). A key's row is
the newest, by that cross-partition rule, of the key's last records per topic-partition, over
every committed record; rows carry their record's ``_kafka_*`` coordinates, which is how the
merge compares them.

**State rows: what the merge compares against (invariant 13).** The rule is not a total order
over records (A(p0, ts 200) beats B(p1, ts 100), B beats C(p0, ts 50) by time, C beats A by
offset), so a table that kept only each key's winner would depend on where batch boundaries
fell. The state therefore keeps, per key and topic-partition, the key's last record of that
topic-partition (its *state row*); the key's visible row is the newest of its state rows by the
cross-partition rule, unless that one is a delete. A state row that is not the visible row is
hidden: ``HIDDEN`` (``_offsetlake_hidden``) says ``deleted`` (a delete marker: the key's last
record of that topic-partition deletes it) or ``superseded`` (a newer record of another
topic-partition is the row). The merge runs on the pipeline's state table
(``offsetlake.state_table``), and the sink holds the state rows where ``HIDDEN`` is null, without
that column: a reader needs no filter. A batch's last record of a key in a topic-partition replaces that state row
if it is at least as new by offset ("at least": the same record read again, by a retry or a
backfill, replaces its own row, so applying a batch twice changes nothing); then each touched
key's visible row is chosen again. Keys that stay in one topic-partition have one state row;
only deleted keys (a marker) and keys seen in several topic-partitions have hidden rows. The
markers and hidden rows live in the state table, pinned by the batch's one sink commit
(invariant 2), so they travel with rewind and backfill and are never dropped.

**Deletes.** A record whose change is a delete (a tombstone, a Debezium ``d``) becomes its key's
delete marker for its topic-partition; the key has no visible row while a marker is its newest
state row. A record whose key has a null column becomes a dead letter (``process``).

**The merge** reads only the data files whose statistics (min/max of each key column, partition
values) say they may hold a key of the batch, rewrites them with the batch applied — rows sorted
by key, in files of about ``sink.file_rows`` rows — and the batch's commit removes them and adds
the new files in the state commit the batch's ONE sink commit pins (``sink.commit_batch``). So a
merge costs what the touched files hold, not the table's size, as long as files hold narrow key
ranges: the merge writes them sorted and range-partitioned by key.

**Backfills** (``later_records``): a backfill of an old range must not bring back a record that a
later one of the same key replaced or deleted. The state rows (markers included) already say so;
for sinks written before state rows existed, it also reads from each range's start up to the
committed end and drops every candidate whose key has a later record in the same
topic-partition. A backfill replaces the state rows of the records it reprocesses (invariant 6):
such a state row takes the key's last record of the range in that topic-partition even when it
is at a lower offset (its own record is now a dead letter, or filtered). When the range holds no
record of that key any more, the key's state there would be its last record before the range,
which the backfill did not read: the backfill fails (``refuse_lost_state``) unless the range
starts at the partition's log start, where the key then has no state row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from deltalake import DeltaTable

from offsetlake import staging
from offsetlake.config import PipelineConfig
from offsetlake.coordinates import OFFSET, PARTITION, ROW_INDEX, TIMESTAMP, TOPIC, TOPIC_EPOCH, Selection
from offsetlake.errors import BackfillParamsError, ConfigError
from offsetlake.file_stats import may_hold_any, values_of
from offsetlake.formats import CHANGE, DELETE, REASON, TOMBSTONE, reasons
from offsetlake.plan import BatchPlan, PartitionOffsets
from offsetlake.schema_evolution import schema_diff, table_schema
from offsetlake.sink import live_files

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

# The hidden-row column of an upsert sink (see the module docstring); null on the rows readers see.
HIDDEN = "_offsetlake_hidden"
DELETED = "deleted"  # a delete marker: the key's last record of its topic-partition deletes it
SUPERSEDED = "superseded"  # the key's last record of its topic-partition; one of another is newer
LATER = "_offsetlake_later"  # set by ``mark_later_records``; never a sink column


def with_hidden_column(schema: pa.Schema) -> pa.Schema:
    """An upsert sink's schema: the rows' columns and ``HIDDEN`` (nullable string)."""
    return schema if HIDDEN in schema.names else schema.append(pa.field(HIDDEN, pa.string(), nullable=True))


def current_rows(table: DeltaTable, columns: list[str] | None = None) -> pa.Table:
    """The rows of a keyed table that readers see: those whose ``HIDDEN`` is null (every row of a
    sink, which holds no state: ``offsetlake.state_table``; of a state table, its keys' rows)."""
    import pyarrow.compute as pc

    dataset = table.to_pyarrow_dataset()
    if HIDDEN not in dataset.schema.names:
        return dataset.to_table(columns=columns)
    return dataset.to_table(columns=columns, filter=pc.field(HIDDEN).is_null())


def mark_tombstones(decoded: DataFrame) -> DataFrame:
    """Records with a null value become deletes of their key (``CHANGE``), not dead letters
    (``delete_on_tombstone``, the upsert default); an envelope decoder sets CHANGE itself."""
    from pyspark.sql import functions as F

    if CHANGE in decoded.columns:
        return decoded
    tombstone = F.col("value").isNull() & (F.col(REASON) == TOMBSTONE)
    return decoded.withColumn(CHANGE, F.when(tombstone, F.lit(DELETE))).withColumn(
        REASON, F.when(tombstone, F.lit(None).cast("string")).otherwise(F.col(REASON))
    )


def check_key_columns(config: PipelineConfig, columns: list[str], where: str) -> None:
    """ConfigError naming the key columns the rows do not have (before anything is written)."""
    missing = [c for c in config.sink.key if c not in columns]
    if missing:
        shown = ", ".join(c for c in columns if c != CHANGE)
        raise ConfigError(
            f"sink.key column{'s' if len(missing) > 1 else ''} "
            f"{', '.join(repr(c) for c in missing)} {'are' if len(missing) > 1 else 'is'} not among the "
            f"{where} (they are: {shown}); key by a value field, by the record key "
            "(_kafka_key, or key_format's columns), or by a column the transform makes",
            pipeline=config.name,
            field=missing[0],
        )


def null_key_reason(config: PipelineConfig) -> Column | None:
    """The dead-letter reason of a row whose key has a null column (None for an append sink)."""
    from pyspark.sql import functions as F

    if not config.sink.keyed:
        return None
    reason = None
    for column in config.sink.key:
        this = F.when(F.col(f"`{column}`").isNull(), F.lit(reasons.key_null(column)))
        reason = this if reason is None else F.coalesce(reason, this)
    return reason


def last_per_partition(rows: DataFrame, key: list[str]) -> DataFrame:
    """The batch's state rows: each key's last record per topic-partition, by offset (and by row
    index, for a transform's several rows of one record). Which of them is the key's newest is
    decided by the merge, together with the sink's state rows of the key."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    in_partition = [F.col(OFFSET).desc()] + ([F.col(ROW_INDEX).desc()] if ROW_INDEX in rows.columns else [])
    last = Window.partitionBy(*[F.col(f"`{c}`") for c in key], F.col(TOPIC), F.col(PARTITION)).orderBy(*in_partition)
    return rows.withColumn("_last", F.row_number().over(last)).where(F.col("_last") == 1).drop("_last")


def mark_later_records(candidates: DataFrame, later: DataFrame, key: list[str]) -> DataFrame:
    """``candidates`` with ``LATER`` true on those whose key has a record at a higher offset of the
    same topic-partition in ``later`` (key columns + coordinates): a backfill never restores them,
    and the key's state row there, which a later record gave, is not the backfill's to replace."""
    from pyspark.sql import functions as F

    last = later.groupBy(*key, TOPIC, PARTITION).agg(F.max(OFFSET).alias("_later_offset"))
    joined = candidates.join(last, [*key, TOPIC, PARTITION], "left")
    return joined.withColumn(LATER, F.coalesce(F.col("_later_offset") > F.col(OFFSET), F.lit(False))).drop("_later_offset")


# ---- which files hold the batch's keys ---------------------------------------------------------
def files_holding(table: DeltaTable, keys: pa.Table, config: PipelineConfig, columns: list[str] | None = None) -> list[dict[str, Any]]:
    """Live files that may hold a row of one of ``keys`` (the batch's key columns): every file
    whose statistics (or partition value) of each key column admit some key's value, read by
    ``file_stats.may_hold_any``, which widens what statistics lose (a timestamp key's max is kept
    in milliseconds: a file skipped because its largest key looked above the max would get a
    second row of that key, or keep a deleted one; issue 35). Costs O(files x key columns x log
    keys). ``columns``: the columns of ``keys`` to test (default ``sink.key``; a merge engine's
    window adds its start)."""
    files = live_files(table)
    if not files or keys.num_rows == 0:
        return []
    partition_by = set(config.sink.partition_by)
    columns = columns or config.sink.key
    values = {c: values_of(keys.column(c).to_pylist()) for c in columns}
    return [f for f in files if all(may_hold_any(f, c, values[c], partitioned=c in partition_by) for c in columns)]


# ---- the merge ----------------------------------------------------------------------------------
@dataclass
class MergeCounts:
    """What a merge did to the keys its batch touched (by their visible rows)."""

    inserted: int = 0
    updated: int = 0
    deleted: int = 0
    older: int = 0  # keys whose records changed no visible row: a newer record is the key's row
    files_rewritten: int = 0
    rows_rewritten: int = 0  # rows (hidden ones too) of the rewritten files of keys the batch did not touch
    hidden: int = 0  # hidden rows (delete markers, superseded records) the merge writes for the touched keys
    duplicates: int = 0  # first_row: the batch's records that are not their key's first row

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class MergedRows:
    """The merge's result: the rows to write (``rows_written`` of them), what it did, the
    DataFrames it persisted (unpersist once the rows are written) and the state rows of
    reprocessed records that no record of the batch replaces (see ``refuse_lost_state``)."""

    rows: DataFrame
    counts: MergeCounts
    rows_written: int
    cached: list[DataFrame]
    lost_state: list[dict[str, Any]]  # per topic-partition: TOPIC, PARTITION, count, and one row's key + OFFSET


def merged_rows(
    spark: SparkSession,
    config: PipelineConfig,
    table: DeltaTable | None,
    states: DataFrame,
    files: list[dict[str, Any]],
    replaces: Selection | None = None,
) -> MergedRows:
    """Every state row of ``files`` with the batch's ``states`` (``last_per_partition``, with
    CHANGE) applied, and each touched key's visible row chosen again (invariant 13).

    Per key and topic-partition, the batch's record (unless ``mark_later_records`` marked it)
    replaces the stored state row if it is at least as new by (topic epoch, offset) — a record
    of a later epoch of a re-created topic is newer than every record of an earlier one, and
    offsets of two epochs are never compared (invariant 16) — or if the row came from a
    record ``replaces`` selects (a backfill replaces the rows of what it reprocesses, invariant 6).
    A stored state row that ``replaces`` selects and no record of the batch replaces is left out
    and reported in ``lost_state`` (per topic-partition: how many, and one of them); the caller
    must refuse the batch unless those rows may go (``refuse_lost_state``). The key's
    visible row is then its newest state row by (timestamp, topic, partition, epoch, offset), unless that
    one is a delete; every other state row is written hidden (``HIDDEN``). Rows of keys the batch
    does not touch are written as they were."""
    from pyspark.sql import functions as F

    batch = states.drop(CHANGE, LATER)
    stored = _stored_rows(spark, config, table, batch, files)
    shape = _StateShape.of(batch, stored)
    where = [*config.sink.key, TOPIC, PARTITION]
    joined = _applied(_batch_against_stored(states, batch, stored, shape, where, replaces), shape, where)
    joined = _visible_chosen(joined, config.sink.key, shape).persist()
    counts, written = _merge_counts(joined, len(files))
    state, delete = F.col("_state"), F.col("_delete")
    hidden_as = F.when(F.col("_visible"), F.lit(None)).when(delete, F.lit(DELETED)).otherwise(F.lit(SUPERSEDED))
    rows = joined.where(state.isNotNull()).select(state.withField(HIDDEN, hidden_as).alias("_row")).select("_row.*")
    return MergedRows(rows, counts, written, [joined], _lost_state(joined, config.sink.key))


def _stored_rows(
    spark: SparkSession, config: PipelineConfig, table: DeltaTable | None, batch: DataFrame, files: list[dict[str, Any]]
) -> DataFrame | None:
    """The stored rows of ``files`` in the sink's schema with the batch's new nested fields (null
    in old files); None when there are none."""
    from pyspark.sql.pandas.types import to_arrow_schema

    if table is None or not files:
        return None
    schema = schema_diff(table_schema(table), to_arrow_schema(batch.schema, timezone="UTC", prefers_large_types=False)).merged
    return staging.read_files(spark, config.layout.sink, files, spark_safe(schema), config.sink.partition_by)


@dataclass(frozen=True)
class _StateShape:
    """The columns of a state row (the stored ones, then the batch's new ones, then ``HIDDEN``)
    with their types: batch records and stored rows are compared as structs of this shape."""

    types: dict[str, Any]
    order: list[str]

    @staticmethod
    def of(batch: DataFrame, stored: DataFrame | None) -> _StateShape:
        from pyspark.sql.types import StringType

        have = {f.name: f.dataType for f in stored.schema.fields} if stored is not None else {}
        new = {f.name: f.dataType for f in batch.schema.fields if f.name not in have}
        if HIDDEN not in have:
            new[HIDDEN] = StringType()
        return _StateShape({**have, **new}, [*have, *new])

    def struct(self, frame: DataFrame) -> Column:
        from pyspark.sql import functions as F

        present = set(frame.columns)
        return F.struct(
            *[
                (
                    staging.conformed_column(F.col(f"`{c}`"), frame.schema[c].dataType, self.types[c])
                    if c in present
                    else F.lit(None).cast(self.types[c])
                ).alias(c)
                for c in self.order
            ]
        )

    def epoch(self, state: Column) -> Column:
        """A record's topic epoch (invariant 16; null: epoch 0)."""
        from pyspark.sql import functions as F

        return F.coalesce(state[TOPIC_EPOCH], F.lit(0)) if TOPIC_EPOCH in self.types else F.lit(0)


def _batch_against_stored(
    states: DataFrame, batch: DataFrame, stored: DataFrame | None, shape: _StateShape, where: list[str], replaces: Selection | None
) -> DataFrame:
    """The batch's records (``_b``) full-outer-joined with the stored state rows (``_s``) per key
    and topic-partition."""
    from pyspark.sql import functions as F

    later = F.col(LATER) if LATER in states.columns else F.lit(False)
    b = states.select(
        *[F.col(f"`{c}`") for c in where],
        shape.struct(batch).alias("_b"),
        (F.col(CHANGE) == DELETE).alias("_b_delete"),
        later.alias("_b_later"),
    )
    if stored is None:  # nothing stored: an empty frame of the same shape keeps one code path
        s = b.select(
            *where,
            F.col("_b").alias("_s"),
            F.lit(False).alias("_s_delete"),
            F.lit(False).alias("_s_visible"),
            F.lit(False).alias("_s_replaced"),
        ).where(F.lit(False))
    else:
        hidden = F.col(HIDDEN) if HIDDEN in stored.columns else F.lit(None).cast("string")
        s = stored.select(
            *[F.col(f"`{c}`") for c in where],
            shape.struct(stored).alias("_s"),
            F.coalesce(hidden == DELETED, F.lit(False)).alias("_s_delete"),
            hidden.isNull().alias("_s_visible"),
            (replaces.spark() if replaces is not None else F.lit(False)).alias("_s_replaced"),
        )
    return b.join(s, where, "full_outer")


def _applied(joined: DataFrame, shape: _StateShape, where: list[str]) -> DataFrame:
    """Per key and topic-partition, the state after the batch (``_state``): the batch's record
    where it is at least as new by (epoch, offset), or replaces a row a backfill selects; a
    replaced row no record replaces is lost (``_lost``)."""
    from pyspark.sql import functions as F

    bt, st = F.col("_b"), F.col("_s")
    replaced = F.coalesce(F.col("_s_replaced"), F.lit(False))
    # a candidate a later record of its key replaced is never applied, and the key's state row
    # there came from (or will come from) that later record: it is not lost
    # in one topic-partition a later epoch is a later log: (epoch, offset) orders its records
    at_least_as_new = (shape.epoch(bt) > shape.epoch(st)) | ((shape.epoch(bt) == shape.epoch(st)) & (bt[OFFSET] >= st[OFFSET]))
    take_b = bt.isNotNull() & ~F.col("_b_later") & (st.isNull() | replaced | at_least_as_new)
    lost = bt.isNull() & replaced
    return joined.select(
        *where,
        F.when(take_b, bt).when(lost, F.lit(None)).otherwise(st).alias("_state"),
        F.when(take_b, F.col("_b_delete")).otherwise(F.coalesce(F.col("_s_delete"), F.lit(False))).alias("_delete"),
        take_b.alias("_from_batch"),
        ((bt.isNotNull() & ~F.col("_b_later")) | lost).alias("_in_batch"),
        F.coalesce(F.col("_s_visible"), F.lit(False)).alias("_was_visible"),
        lost.alias("_lost"),
        st[OFFSET].alias("_stored_offset"),
    )


def _visible_chosen(joined: DataFrame, key: list[str], shape: _StateShape) -> DataFrame:
    """Each key's visible row: its newest state row by (timestamp, topic, partition, epoch,
    offset) unless that one is a delete; with what the key was before and after, for the counts."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    state, delete, from_batch = F.col("_state"), F.col("_delete"), F.col("_from_batch")
    far_past = F.lit("0001-01-01 00:00:00").cast("timestamp")
    per_key = Window.partitionBy(*[F.col(f"`{c}`") for c in key])
    newest = per_key.orderBy(
        state.isNotNull().desc(),
        F.coalesce(state[TIMESTAMP], far_past).desc(),
        state[TOPIC].desc(),
        state[PARTITION].desc(),
        shape.epoch(state).desc(),
        state[OFFSET].desc(),
    )
    joined = joined.withColumn("_first", F.row_number().over(newest) == 1)
    winner = F.col("_first") & state.isNotNull()
    visible = winner & ~delete
    return joined.select(
        "*",
        visible.alias("_visible"),
        F.max(F.col("_in_batch")).over(per_key).alias("_touched"),
        F.max(F.col("_was_visible")).over(per_key).alias("_before"),
        F.max(visible).over(per_key).alias("_after"),
        F.max(winner & from_batch).over(per_key).alias("_batch_won"),
        F.max(visible & F.col("_was_visible") & ~from_batch).over(per_key).alias("_kept_visible"),
    )


def _merge_counts(joined: DataFrame, files_rewritten: int) -> tuple[MergeCounts, int]:
    """What the merge did per touched key (inserted, updated, deleted, older) and to the rows it
    rewrote, and how many rows it writes."""
    from pyspark.sql import functions as F

    touched, before, after = F.col("_touched"), F.col("_before"), F.col("_after")
    once = F.col("_first") & touched  # one row per touched key
    inserted = once & after & ~before
    deleted = once & before & ~after
    updated = once & before & after & (F.col("_batch_won") | ~F.col("_kept_visible"))
    live = F.col("_state").isNotNull()
    found = joined.agg(
        F.sum(inserted.cast("long")).alias("inserted"),
        F.sum(updated.cast("long")).alias("updated"),
        F.sum(deleted.cast("long")).alias("deleted"),
        F.sum((once & ~inserted & ~deleted & ~updated & ~F.col("_batch_won")).cast("long")).alias("older"),
        F.sum((live & ~touched).cast("long")).alias("kept"),
        F.sum((live & touched & ~F.col("_visible")).cast("long")).alias("hidden"),
        F.sum(live.cast("long")).alias("written"),
    ).first()
    assert found is not None
    counts = MergeCounts(
        inserted=int(found["inserted"] or 0),
        updated=int(found["updated"] or 0),
        deleted=int(found["deleted"] or 0),
        older=int(found["older"] or 0),
        files_rewritten=files_rewritten,
        rows_rewritten=int(found["kept"] or 0),
        hidden=int(found["hidden"] or 0),
    )
    return counts, int(found["written"] or 0)


def _lost_state(joined: DataFrame, key: list[str]) -> list[dict[str, Any]]:
    """Stored rows a backfill selects that no record of it replaced, per topic-partition: how
    many, and one of them (see ``refuse_lost_state``)."""
    from pyspark.sql import functions as F

    example = F.first(F.struct(*[F.col(f"`{c}`") for c in key], F.col("_stored_offset").alias(OFFSET)))
    return [
        {TOPIC: r[TOPIC], PARTITION: r[PARTITION], "count": r["count"], **r["example"].asDict()}
        for r in joined.where(F.col("_lost")).groupBy(TOPIC, PARTITION).agg(F.count("*").alias("count"), example.alias("example")).collect()
    ]


def refuse_lost_state(
    config: PipelineConfig, plan: BatchPlan, lost_state: list[dict[str, Any]], log_starts: dict[tuple[str, int], PartitionOffsets]
) -> None:
    """Raise BackfillParamsError if a key's state row came from a record ``plan`` reprocesses that
    no longer gives a row (now a dead letter, or filtered) and the range holds no other record of
    that key in that topic-partition, unless the range starts at the partition's log start: the
    key's state there is then its last record before the range, which the backfill did not read.
    The audit would otherwise find the record both a row and a dead letter (issue 35, finding 10).
    Where the range starts at the log start, Kafka holds no earlier record of the key there, and
    the key has no state row in that topic-partition (what one pass over today's topic gives)."""
    starts = {(r.topic, r.partition): r.start for r in plan.ranges}
    blocking = [
        row for row in lost_state if starts.get((row[TOPIC], row[PARTITION]), 0) > log_starts[(row[TOPIC], row[PARTITION])].log_start
    ]
    if not blocking:
        return
    first = blocking[0]
    topic, partition = first[TOPIC], first[PARTITION]
    shown = ", ".join(f"{c}={first[c]!r}" for c in config.sink.key)
    more = sum(row["count"] for row in blocking) - 1
    range_ = next(r for r in plan.ranges if (r.topic, r.partition) == (topic, partition))
    raise BackfillParamsError(
        f"backfill {plan.batch_id} of {plan.describe()}: key {shown}'s row (or hidden state row) "
        f"came from offset {first[OFFSET]}, which this backfill reprocesses and which no longer gives "
        f"a row (it is now a dead letter, or the transform drops it), and the range holds no other record of that key "
        f"in the partition{f' ({more} more such keys)' if more else ''}. The key's row "
        f"would have to come from its last record before offset {range_.start}, which this backfill does "
        f"not read. Nothing was committed. Way forward: backfill {topic}[{partition}] from its log start (offset "
        f"{log_starts[(topic, partition)].log_start})",
        pipeline=config.name,
        batch_id=plan.batch_id,
        topic=topic,
        partition=partition,
        start=range_.start,
        end=range_.end,
    )


def spark_safe(schema: pa.Schema) -> pa.Schema:
    """The table's schema with the types Spark takes from Arrow (large/view strings as strings)."""

    def plain(t: pa.DataType) -> pa.DataType:
        if pa.types.is_large_string(t) or pa.types.is_string_view(t):
            return pa.string()
        if pa.types.is_large_binary(t) or pa.types.is_binary_view(t):
            return pa.binary()
        if pa.types.is_large_list(t) or pa.types.is_list_view(t) or pa.types.is_large_list_view(t):
            return pa.list_(pa.field(t.value_field.name, plain(t.value_type), t.value_field.nullable))
        if pa.types.is_list(t):
            return pa.list_(pa.field(t.value_field.name, plain(t.value_type), t.value_field.nullable))
        if pa.types.is_struct(t):
            return pa.struct([pa.field(f.name, plain(f.type), f.nullable) for f in t])
        if pa.types.is_map(t):
            return pa.map_(plain(t.key_type), plain(t.item_type))
        return t

    return pa.schema([pa.field(f.name, plain(f.type), f.nullable) for f in schema])


def split_by_groups(rows: pa.Table, groups: pa.Table, group: list[str]) -> tuple[pa.Table, pa.Table]:
    """``rows`` (a pyarrow table the driver holds) of the groups among ``groups`` (their ``group``
    columns), and the others. A null column matches nothing, as in Spark's join on columns (keys
    are never null). Joined by row number, as Arrow joins take no nested columns."""
    import pyarrow.compute as pc

    marked = rows.select(group).append_column("__row", pa.array(range(rows.num_rows), pa.int64()))
    hit = marked.join(groups.select(group).cast(rows.select(group).schema), group, join_type="left semi")["__row"]
    inside = pc.is_in(marked["__row"], value_set=hit.combine_chunks())
    return rows.filter(inside), rows.filter(pc.invert(inside))


def file_count(rows: int, config: PipelineConfig) -> int:
    """How many files (range partitions of the key) a merge writes ``rows`` rows into."""
    return max(1, -(-rows // config.sink.file_rows))
