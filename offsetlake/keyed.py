"""Keyed sinks (``sink.mode: upsert``): one row per key, the newest record's (invariant 13).

**The ordering rule.** Of two records of one key, the newer is the one at the higher offset when
both come from the same topic-partition (Kafka orders a partition, and its default partitioner
keeps a key in one partition). When they come from different topic-partitions, the newer is the
one with the later Kafka timestamp, then the greater (topic, partition, offset). A batch first
keeps each key's last record per topic-partition, then the newest of those by the cross-partition
rule; that record is then compared with the key's current row by the same rule, using the
row's own ``_kafka_*`` coordinates (which say which record it came from). A record replaces the
row only if it is at least as new ("at least": the same record read again, by a retry or a
backfill, replaces its own row, so applying a batch twice changes nothing).

**Deletes.** A record whose change is a delete (a tombstone, a Debezium ``d``) removes its key's
row if it is newer than the row by the same rule; the key then has no row. A record whose key has
a null column becomes a dead letter (``process``).

**The merge** reads only the data files whose statistics (min/max of each key column, partition
values) say they may hold a key of the batch, rewrites them with the batch applied — rows sorted
by key, in files of about ``sink.file_rows`` rows — and the batch's commit removes them and adds
the new files, with its txns and ledger entry, in ONE Delta commit (``sink.commit_batch``). So a
merge costs what the touched files hold, not the table's size, as long as files hold narrow key
ranges: the merge writes them sorted and range-partitioned by key.

**Backfills** (``later_records``): a backfill of an old range must not bring back a record that a
later one of the same key replaced or deleted. Before its merge, it reads from each range's start
up to the committed end and drops every candidate whose key has a later record in the same
topic-partition. (A key deleted from another partition is compared by the rule above against the
row, which no longer exists: keys that move between partitions are outside what a backfill can
order exactly, as they are outside what Kafka orders.)
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from deltalake import DeltaTable

from offsetlake import staging
from offsetlake.config import PipelineConfig
from offsetlake.coordinates import OFFSET, PARTITION, ROW_INDEX, TIMESTAMP, TOPIC
from offsetlake.errors import ConfigError
from offsetlake.formats import CHANGE, DELETE, REASON, TOMBSTONE
from offsetlake.sink import live_files, schema_diff, table_schema

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession


def mark_tombstones(decoded: DataFrame) -> DataFrame:
    """Records with a null value become deletes of their key (``CHANGE``), not dead letters
    (``delete_on_tombstone``, the upsert default); an envelope decoder sets CHANGE itself."""
    from pyspark.sql import functions as F

    if CHANGE in decoded.columns:
        return decoded
    tombstone = F.col("value").isNull() & (F.col(REASON) == TOMBSTONE)
    return (decoded.withColumn(CHANGE, F.when(tombstone, F.lit(DELETE)))
            .withColumn(REASON, F.when(tombstone, F.lit(None).cast("string")).otherwise(F.col(REASON))))


def check_key_columns(config: PipelineConfig, columns: list[str], where: str) -> None:
    """ConfigError naming the key columns the rows do not have (before anything is written)."""
    missing = [c for c in config.sink.key if c not in columns]
    if missing:
        shown = ", ".join(c for c in columns if c != CHANGE)
        raise ConfigError(f"pipeline {config.name}: sink.key column{'s' if len(missing) > 1 else ''} "
                          f"{', '.join(repr(c) for c in missing)} {'are' if len(missing) > 1 else 'is'} not among the "
                          f"{where} (they are: {shown}); key by a value field, by the record key "
                          "(_kafka_key, or key_format's columns), or by a column the transform makes")


def null_key_reason(config: PipelineConfig) -> Column | None:
    """The dead-letter reason of a row whose key has a null column (None outside upsert)."""
    from pyspark.sql import functions as F

    if config.sink.mode != "upsert":
        return None
    reason = None
    for column in config.sink.key:
        this = F.when(F.col(f"`{column}`").isNull(), F.lit(f"sink.key column '{column}' is null; an upsert row needs its key"))
        reason = this if reason is None else F.coalesce(reason, this)
    return reason


def newest_per_key(rows: DataFrame, key: list[str]) -> DataFrame:
    """One record per key: the last per topic-partition by offset (and by row index, for a
    transform's several rows of one record), then the newest by (timestamp, topic, partition,
    offset) across topic-partitions."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    in_partition = [F.col(OFFSET).desc()] + ([F.col(ROW_INDEX).desc()] if ROW_INDEX in rows.columns else [])
    last = Window.partitionBy(*[F.col(f"`{c}`") for c in key], F.col(TOPIC), F.col(PARTITION)).orderBy(*in_partition)
    across = Window.partitionBy(*[F.col(f"`{c}`") for c in key]).orderBy(
        F.col(TIMESTAMP).desc_nulls_last(), F.col(TOPIC).desc(), F.col(PARTITION).desc(), F.col(OFFSET).desc())
    return (rows.withColumn("_last", F.row_number().over(last)).where(F.col("_last") == 1).drop("_last")
            .withColumn("_newest", F.row_number().over(across)).where(F.col("_newest") == 1).drop("_newest"))


def without_later_records(candidates: DataFrame, later: DataFrame, key: list[str]) -> DataFrame:
    """``candidates`` minus those whose key has a record at a higher offset of the same
    topic-partition in ``later`` (key columns + coordinates): a backfill never restores them."""
    from pyspark.sql import functions as F

    last = later.groupBy(*key, TOPIC, PARTITION).agg(F.max(OFFSET).alias("_later"))
    joined = candidates.join(last, [*key, TOPIC, PARTITION], "left")
    return joined.where(F.col("_later").isNull() | (F.col("_later") <= F.col(OFFSET))).drop("_later")


# ---- which files hold the batch's keys ---------------------------------------------------------
def files_holding(table: DeltaTable, keys: pa.Table, config: PipelineConfig) -> list[dict[str, Any]]:
    """Live files that may hold a row of one of ``keys`` (the batch's key columns): every file
    whose min/max statistics (or partition value) of each key column admit some key's value. A
    column without statistics admits anything. Costs O(files x key columns x log keys)."""
    files = live_files(table)
    if not files or keys.num_rows == 0:
        return []
    partition_by = set(config.sink.partition_by)
    values = {c: sorted(v for v in keys.column(c).to_pylist() if v is not None) for c in config.sink.key}
    out = []
    for f in files:
        if all(_column_admits(f, c, values[c], c in partition_by) for c in config.sink.key):
            out.append(f)
    return out


def _column_admits(file: dict[str, Any], column: str, values: list, partitioned: bool) -> bool:
    if not values:
        return False
    if partitioned:
        have = file.get(f"partition.{column}")
        if have is None:
            return True
        low = high = have
    else:
        low, high = file.get(f"min.{column}"), file.get(f"max.{column}")
        if low is None or high is None:
            return True
    try:
        i = bisect.bisect_left(values, low)
        if i < len(values) and values[i] <= high:
            return True
        # a string maximum may be a truncated prefix of the real one: values starting with it count
        return isinstance(high, str) and i < len(values) and isinstance(values[i], str) and values[i].startswith(high)
    except TypeError:  # statistics of another type than the batch's values: cannot tell
        return True


# ---- the merge ----------------------------------------------------------------------------------
@dataclass
class MergeCounts:
    """What a merge did to the keys its batch touched."""

    inserted: int = 0
    updated: int = 0
    deleted: int = 0
    older: int = 0  # records not applied: the key's row came from a newer record
    files_rewritten: int = 0
    rows_rewritten: int = 0  # rows of the rewritten files that stayed as they were

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def merged_rows(spark: SparkSession, config: PipelineConfig, table: DeltaTable | None, winners: DataFrame,
                files: list[dict[str, Any]]) -> tuple[DataFrame, MergeCounts, list[DataFrame]]:
    """The rows the merge writes: every row of ``files`` with the batch's ``winners`` (one per
    key, with CHANGE) applied by the ordering rule. Returns (rows, what it does to the keys,
    the DataFrames it persisted: unpersist them once the rows are written)."""
    from pyspark.sql import functions as F
    from pyspark.sql.pandas.types import to_arrow_schema

    key = config.sink.key
    batch = winners.drop(CHANGE)
    if table is None or not files:
        inserts = winners.where(F.col(CHANGE) != DELETE).drop(CHANGE)
        found = winners.agg(F.sum((F.col(CHANGE) != DELETE).cast("long")).alias("inserted")).first()
        return inserts, MergeCounts(inserted=int((found and found["inserted"]) or 0)), []
    # the stored rows in the sink's schema with the batch's new nested fields (null in old files)
    schema = schema_diff(table_schema(table), to_arrow_schema(batch.schema, timezone="UTC",
                                                              prefers_large_types=False)).merged
    stored = staging.read_files(spark, config.sink_path, files, _spark_safe(schema), config.sink.partition_by)
    have = {f.name: f.dataType for f in stored.schema.fields}
    new = {f.name: f.dataType for f in batch.schema.fields if f.name not in have}
    order = [*have, *new]

    def struct(frame: DataFrame, types: dict) -> Column:
        present = set(frame.columns)
        return F.struct(*[(staging.conformed_column(F.col(f"`{c}`"), frame.schema[c].dataType, types[c]) if c in present
                           else F.lit(None).cast(types[c])).alias(c) for c in order])

    types = {**have, **new}
    b = winners.select(*[F.col(f"`{c}`") for c in key], struct(batch, types).alias("_b"), F.col(CHANGE))
    s = stored.select(*[F.col(f"`{c}`") for c in key], struct(stored, types).alias("_s"))
    joined = b.join(s, key, "full_outer")
    bt, st = F.col("_b"), F.col("_s")
    far_past = F.lit("0001-01-01 00:00:00").cast("timestamp")
    same = (bt[TOPIC] == st[TOPIC]) & (bt[PARTITION] == st[PARTITION])
    newer = F.when(same, bt[OFFSET] >= st[OFFSET]).otherwise(
        F.struct(F.coalesce(bt[TIMESTAMP], far_past), bt[TOPIC], bt[PARTITION], bt[OFFSET])
        >= F.struct(F.coalesce(st[TIMESTAMP], far_past), st[TOPIC], st[PARTITION], st[OFFSET]))
    b_wins = bt.isNotNull() & (st.isNull() | newer)
    delete = F.col(CHANGE) == DELETE
    chosen = F.when(b_wins & delete, F.lit(None)).when(b_wins, bt).otherwise(st)
    joined = joined.select(chosen.alias("_row"), b_wins.alias("_b_wins"), delete.alias("_delete"),
                           bt.isNotNull().alias("_in_batch"), st.isNotNull().alias("_stored")).persist()
    b_wins, delete, st_present, in_batch = F.col("_b_wins"), F.col("_delete"), F.col("_stored"), F.col("_in_batch")
    found = joined.agg(
        F.sum((b_wins & ~delete & ~st_present).cast("long")).alias("inserted"),
        F.sum((b_wins & ~delete & st_present).cast("long")).alias("updated"),
        F.sum((b_wins & delete & st_present).cast("long")).alias("deleted"),
        F.sum((in_batch & ~b_wins).cast("long")).alias("older"),
        F.sum((~in_batch).cast("long")).alias("kept"),
    ).first()
    assert found is not None
    counts = MergeCounts(inserted=int(found["inserted"] or 0), updated=int(found["updated"] or 0),
                         deleted=int(found["deleted"] or 0), older=int(found["older"] or 0),
                         files_rewritten=len(files), rows_rewritten=int(found["kept"] or 0))
    rows = joined.where(F.col("_row").isNotNull()).select("_row.*")
    return rows, counts, [joined]


def _spark_safe(schema: pa.Schema) -> pa.Schema:
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


def file_count(rows: int, config: PipelineConfig) -> int:
    """How many files (range partitions of the key) a merge writes ``rows`` rows into."""
    return max(1, -(-rows // config.sink.file_rows))
