"""A merge engine's batch (``offsetlake.engines``): what its one commit writes and removes.

An ingest folds each touched group's stored state with the batch's contributions; a backfill, or
an ingest of ``first_row`` with a horizon that meets a late record, folds each touched group again
from all its contributions. Visible files are found by the statistics of the key (and window
start), contribution files by those of the offsets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from offsetlake import keyed, staging, storage
from offsetlake.config import PipelineConfig
from offsetlake.coordinates import OFFSET, PARTITION, TIMESTAMP, TOPIC, TOPIC_EPOCH, Selection
from offsetlake.engines import (
    CONTRIBUTION,
    COORDINATES,
    HIDDEN,
    RECORDS,
    STATE,
    WINDOW_START,
    Engine,
    FirstRowEngine,
    arrow_schema_of,
    engine_for,
    group_columns,
    is_contribution_file,
)
from offsetlake.file_stats import may_hold_between
from offsetlake.keyed import MergeCounts
from offsetlake.schema_evolution import schema_diff, table_schema
from offsetlake.sink import live_files

if TYPE_CHECKING:
    from deltalake import DeltaTable
    from pyspark.sql import Column, DataFrame


@dataclass
class EngineMerge:
    """What a batch's commit writes and removes: the visible rows of the files it rewrites
    (sorted by group), the contribution rows (the batch's, and for a backfill those of the
    replaced contribution files outside its ranges), the live files they replace, the counts."""

    visible: DataFrame | pa.Table  # a pyarrow table from ``merged_on_driver``
    contributions: DataFrame
    removed: list[dict[str, Any]]
    counts: MergeCounts
    visible_rows: int
    cached: list[DataFrame]
    keys: DataFrame | pa.Table  # the groups the batch touched (its own and those of the contributions it dropped)
    folded: dict[tuple[str, int, int], int] = field(default_factory=dict)  # the horizon a fold raised (``fold``)


def merged(spark: Any, config: PipelineConfig, table: DeltaTable | None, rows: DataFrame, replaced: Selection | None = None) -> EngineMerge:
    """The batch's ``rows`` merged (module docstring). An ingest (``replaced`` None) folds each
    touched group's stored state with the batch's contributions. A backfill (``replaced``: the
    records it reprocesses) drops the stored contributions of those records, and folds every
    touched group — the batch's and the dropped contributions' — from all its contributions left
    plus the batch's; a group none are left for loses its visible row."""

    engine = engine_for(config)
    group = group_columns(config)
    new = engine.contributions(rows).persist()
    cached = [new]
    files = live_files(table) if table is not None else []
    contribution_files = [f for f in files if _holds_contributions(config, f)]
    replaced_files = [f for f in contribution_files if replaced is not None and not _all_folded(f) and replaced.file_may_hold(f)]
    schema = _merged_schema(table, new)
    inside = _selected(replaced)
    dropped = kept = None
    # Spark cannot prune a Python source's columns: a read for the groups and the fold names its own
    placed = [*group, *[c for c in COORDINATES if c in schema.names]]
    if replaced_files:
        dropped = staging.read_files(spark, config.layout.sink, replaced_files, schema, [], placed).where(inside).select(*group)
        kept = staging.read_files(spark, config.layout.sink, replaced_files, schema, []).where(~inside)
    keys = new.select(*group) if dropped is None else new.select(*group).unionByName(dropped)
    keys = keys.distinct().persist()
    cached.append(keys)
    stored_files = []
    if table is not None:
        # by the key's and the window start's statistics: visible files are sorted by (window, key)
        pruning = [*config.sink.key, *([WINDOW_START] if config.sink.window is not None else [])]
        holding = keyed.files_holding(table, keys.select(*pruning).distinct().toArrow(), config, pruning)
        kinds = {f["path"] for f in contribution_files}
        stored_files = [f for f in holding if f["path"] not in kinds]
    stored = None
    if stored_files:  # the touched groups' visible files: a few rows, read for the fold, the counts and the untouched rows
        stored = staging.read_files(spark, config.layout.sink, stored_files, schema, []).persist()
        cached.append(stored)
    states = new.select(*group, STATE)
    refold = replaced is not None or (stored is not None and engine.late(new, stored))
    if refold and contribution_files:  # every contribution left of the touched groups
        rest = staging.read_files(spark, config.layout.sink, contribution_files, schema, [], [*placed, STATE]).where(~inside)
        states = states.unionByName(rest.join(keys, group, "left_semi").select(*group, STATE))
    elif stored is not None:
        states = states.unionByName(stored.join(keys, group, "left_semi").select(*group, STATE))
    # one row per touched group, cached: the counts and the visible rows both read it, and it may
    # be the fold of every contribution of the state (a backfill)
    folded = engine.visible_rows(engine.folded(states)).persist()
    cached.append(folded)
    visible = _shaped(folded, new)
    untouched = None
    if stored is not None:
        untouched = stored.join(keys, group, "left_anti").select(*new.columns)
        visible = visible.unionByName(untouched)
    visible = visible.persist()
    cached.append(visible)
    counts = _counts(engine, new, folded, stored, keys, untouched, len(stored_files))
    contributions = new if kept is None else new.unionByName(kept.select(*new.columns))
    removed = [*stored_files, *replaced_files]
    folding = fold(spark, config, engine, contribution_files, schema, new) if replaced is None else None
    if folding is not None:
        contributions = contributions.unionByName(folding.rows)
        removed += folding.removed
    merge = EngineMerge(visible, contributions, removed, counts, visible.count(), cached, keys)
    if folding is not None:
        merge.folded = folding.below
    return merge


def on_driver(config: PipelineConfig, replaced: Selection | None) -> bool:
    """Whether a batch's merge holds its groups on the driver (``merged_on_driver``): an ingest of
    an associative engine. A backfill, and ``first_row`` with a horizon, fold in ``merged``."""
    return replaced is None and not engine_for(config).sequential


# the most state rows (the batch's groups plus the stored rows of the files holding them) an
# ingest merges on the driver; above it the batch merges in Spark (``merged``)
DRIVER_ROWS = 1_000_000


def merged_on_driver(spark: Any, config: PipelineConfig, table: DeltaTable | None, rows: DataFrame) -> EngineMerge | None:
    """An ingest's merge with its groups on the driver: a batch has many records but few groups.
    Spark folds the batch's contributions per group (``partial``: one row per group; the one job
    over the records besides the one writing the contributions' files); the stored states of those
    groups are read on the driver from the files that may hold them; Spark folds the two on those
    few rows with the same ``Engine.folded`` as ``merged`` (an associative fold: the same state)
    and hands back the visible rows as Arrow, with what each group was before. The visible rows
    are written from the driver (``staging.write_table``), and so is the sink's projection of them
    (``state_table.project``). ``visible`` of the result is a pyarrow table, sorted by nothing yet.
    None: more than ``DRIVER_ROWS`` state rows, for ``merged`` to merge in Spark."""
    from pyspark.sql import functions as F

    from offsetlake.spark import dataframe_from_arrow

    engine = engine_for(config)
    group = group_columns(config)
    first_row = isinstance(engine, FirstRowEngine)
    new = engine.contributions(rows)  # not cached: recomputed from the decoded rows is cheaper than a cache of its states
    partial = engine.folded(new.select(*group, STATE)).persist()
    cached = [partial]
    mine = partial.select(*group, F.col(STATE)[RECORDS].alias(_RECORDS), *([F.col(STATE)["ok"].alias(_OK)] if first_row else []))
    keys = mine.select(*group, _RECORDS).toArrow()
    records = int(pc.sum(keys[_RECORDS]).as_py() or 0)
    files = live_files(table) if table is not None else []
    contribution_files = [f for f in files if _holds_contributions(config, f)]
    schema = _merged_schema(table, new)
    stored_files: list[dict[str, Any]] = []
    if table is not None and keys.num_rows:
        pruning = [*config.sink.key, *([WINDOW_START] if config.sink.window is not None else [])]
        kinds = {f["path"] for f in contribution_files}
        holding = keyed.files_holding(table, _distinct(keys.select(pruning)), config, pruning)
        stored_files = [f for f in holding if f["path"] not in kinds]
    if keys.num_rows + _rows(stored_files) > DRIVER_ROWS:
        for frame in cached:
            frame.unpersist()
        return None
    states = partial.select(*group, STATE)
    flagged = _shaped(engine.visible_rows(engine.folded(states)), new) if not stored_files else None
    untouched = None
    if stored_files:
        stored = staging.read_table(config.layout.sink, stored_files, schema, [])
        before, untouched = keyed.split_by_groups(stored, keys, group)
        old = dataframe_from_arrow(spark, before.select([*group, STATE, HIDDEN]))
        folded = engine.visible_rows(engine.folded(states.unionByName(old.select(*group, STATE))))
        flagged = _shaped(folded, new).join(old.select(*group, F.col(HIDDEN).isNull().alias(_BEFORE)), group, "left")
    assert flagged is not None
    if _BEFORE not in flagged.columns:
        flagged = flagged.withColumn(_BEFORE, F.lit(None).cast("boolean"))
    shape = arrow_schema_of(flagged.select(*new.columns))
    if first_row:
        flagged = flagged.join(mine.select(*group, _OK), group, "left").withColumn(_WON, F.col(STATE)["ok"].eqNullSafe(F.col(_OK)))
    got = flagged.toArrow()
    visible = got.select(shape.names).cast(shape)
    if untouched is not None and untouched.num_rows:
        visible = pa.concat_tables([visible, untouched.select(shape.names).cast(shape)])
    after, was = pc.is_null(got[HIDDEN]), pc.fill_null(got[_BEFORE], False)
    counts = MergeCounts(
        inserted=_true(pc.and_(after, pc.invert(was))),
        updated=_true(pc.and_(after, was)),
        deleted=_true(pc.and_(pc.invert(after), was)),
        files_rewritten=len(stored_files),
        rows_rewritten=untouched.num_rows if untouched is not None else 0,
        duplicates=records - _true(got[_WON]) if first_row else 0,
    )
    contributions, removed = new, list(stored_files)
    folding = fold(spark, config, engine, contribution_files, schema, new)
    if folding is not None:
        contributions = contributions.unionByName(folding.rows)
        removed += folding.removed
    merge = EngineMerge(visible, contributions, removed, counts, visible.num_rows, cached, visible.select(group))
    if folding is not None:
        merge.folded = folding.below
    return merge


_RECORDS, _OK, _BEFORE, _WON = "__batch_records", "__batch_ok", "__before", "__won"


def _true(flags: pa.ChunkedArray | pa.Array) -> int:
    return int(pc.sum(pc.cast(pc.fill_null(flags, False), pa.int64())).as_py() or 0)


def _distinct(rows: pa.Table) -> pa.Table:
    return rows.group_by(rows.column_names).aggregate([])


@dataclass
class Fold:
    """A fold of old contributions: the rows that replace the files it read (one folded row per
    group, and the rows of those files too young to fold), the files, and the horizon it raised."""

    rows: DataFrame
    removed: list[dict[str, Any]]
    below: dict[tuple[str, int, int], int]


def fold(
    spark: Any, config: PipelineConfig, engine: Engine, files: list[dict[str, Any]], schema: pa.Schema, like: DataFrame
) -> Fold | None:
    """Bounded state (docs/design.md, "Bounded state"): the contributions of records older than
    ``sink.fold_after`` (Kafka timestamp, before now) folded into one row per group, a
    contribution without coordinates that stands for all of them. An associative fold of a
    group's folded row and its other contributions is the fold of them all, so a group's state
    stays exact; what is lost is only the single records a backfill would replace, so the state
    commit raises the horizon (``state_table.FOLDED_BELOW``) past every offset folded, and a
    backfill below it is refused. Runs when the contribution rows old enough are at least the
    folded rows already there (each rewrite of the folded rows is paid for by as many records
    folded): the state stays within groups x windows plus the records not yet old enough. None:
    nothing to fold (``files``: the live contribution files; ``like``: the batch's contributions)."""
    from pyspark.sql import functions as F

    seconds = config.sink.fold_after_seconds
    if seconds is None or engine.sequential or not files:
        return None
    cutoff = datetime.now(UTC) - timedelta(seconds=seconds)
    holding = [f for f in files if _holds_folded(config, f)]
    old = [f for f in files if f not in holding and not may_hold_between(f, TIMESTAMP, cutoff, _LAST_INSTANT)]
    if not old or _rows(old) < _rows(holding):
        return None
    read = staging.read_files(spark, config.layout.sink, [*holding, *old], schema, [])
    goes = F.col(OFFSET).isNull() | F.coalesce(F.col(TIMESTAMP) < F.lit(cutoff), F.lit(False))
    group = group_columns(config)
    folded = engine.with_outputs(engine.folded(read.where(goes).select(*group, STATE))).withColumn(HIDDEN, F.lit(CONTRIBUTION))
    rows = _shaped(folded, like).unionByName(read.where(~goes).select(*like.columns))
    epoch = F.coalesce(F.col(TOPIC_EPOCH).cast("int"), F.lit(0)) if TOPIC_EPOCH in read.columns else F.lit(0)
    by_partition = read.where(F.col(OFFSET).isNotNull() & goes).groupBy(TOPIC, epoch.alias("_epoch"), PARTITION)
    reached = by_partition.agg(F.max(OFFSET).alias("_last"))
    below = {(r[TOPIC], int(r["_epoch"]), int(r[PARTITION])): int(r["_last"]) + 1 for r in reached.collect()}
    return Fold(rows, [*holding, *old], below)


_LAST_INSTANT = datetime(9999, 12, 31, tzinfo=UTC)


def _rows(files: list[dict[str, Any]]) -> int:
    return sum(int(f.get("num_records") or 0) for f in files)


def _all_folded(file: dict[str, Any]) -> bool:
    """Whether every row of a contribution file is a folded row (no coordinates): no backfill replaces one."""
    nulls = file.get(f"null_count.{OFFSET}")
    return nulls is not None and nulls == file.get("num_records")


def _holds_folded(config: PipelineConfig, file: dict[str, Any]) -> bool:
    """Whether a contribution file holds a folded row (``fold``: no coordinates), told by its
    statistics or, for a file written without any, by its offset column read."""
    nulls = file.get(f"null_count.{OFFSET}")
    if nulls is not None:
        return bool(nulls)
    fs, path = storage.filesystem(config.layout.sink.child(storage.file_path_from_log(file["path"])))
    with fs.open_input_file(path) as source:
        return bool(pq.ParquetFile(source).read(columns=[OFFSET])[OFFSET].null_count)


def _holds_contributions(config: PipelineConfig, file: dict[str, Any]) -> bool:
    """Whether a live file holds contribution rows (never mixed with visible ones): told by its
    statistics (``engines.is_contribution_file``), or, for a file written without any (a
    non-finite value in one of its columns: ``file_stats.delta_stats``), by its ``HIDDEN`` column
    read. Taking such a file for visible rows rewrote its contributions away (the fault
    campaign's first_row and partial_update pipelines, seed 20261122)."""
    if file.get(f"null_count.{HIDDEN}") is not None:
        return is_contribution_file(file)
    fs, path = storage.filesystem(config.layout.sink.child(storage.file_path_from_log(file["path"])))
    with fs.open_input_file(path) as source:
        parquet = pq.ParquetFile(source)
        if HIDDEN not in parquet.schema_arrow.names:
            return False
        hidden = parquet.read(columns=[HIDDEN])[HIDDEN]
    return len(hidden) > 0 and hidden.null_count == 0 and bool(pc.all(pc.equal(hidden, CONTRIBUTION)).as_py())


def _selected(replaced: Selection | None) -> Column:
    from pyspark.sql import functions as F

    return F.coalesce(replaced.spark(), F.lit(False)) if replaced is not None else F.lit(False)


def _merged_schema(table: DeltaTable | None, new: DataFrame) -> pa.Schema:
    """The stored rows' schema with the batch's new columns and fields (null in older files)."""
    batch = arrow_schema_of(new)
    if table is None:
        return batch
    return keyed.spark_safe(schema_diff(table_schema(table), batch).merged)


def _shaped(folded: DataFrame, like: DataFrame) -> DataFrame:
    """Visible rows in the contribution rows' columns (their coordinates null)."""
    from pyspark.sql import functions as F

    return folded.select(
        *[F.col(f"`{c}`") if c in folded.columns else F.lit(None).cast(like.schema[c].dataType).alias(c) for c in like.columns]
    )


def _counts(
    engine: Engine, new: DataFrame, folded: DataFrame, stored: DataFrame | None, keys: DataFrame, untouched: DataFrame | None, files: int
) -> MergeCounts:
    """What the merge did to the groups it touched (visible before, visible after) and the rows
    of untouched groups it rewrote; for first_row, the batch's records that are not their key's
    first (``duplicates``)."""
    from pyspark.sql import functions as F

    group = group_columns(engine.config)
    after = folded.select(*group, F.col(HIDDEN).isNull().alias("_after"))
    if stored is not None:
        before = stored.join(keys, group, "left_semi").select(*group, F.col(HIDDEN).isNull().alias("_before"))
        after = after.join(before, group, "full_outer")
    else:
        after = after.withColumn("_before", F.lit(None).cast("boolean"))
    a, b = F.coalesce(F.col("_after"), F.lit(False)), F.coalesce(F.col("_before"), F.lit(False))
    found = after.agg(
        F.sum((a & ~b).cast("long")).alias("inserted"),
        F.sum((a & b).cast("long")).alias("updated"),
        F.sum((~a & b).cast("long")).alias("deleted"),
    ).first()
    assert found is not None
    return MergeCounts(
        inserted=int(found["inserted"] or 0),
        updated=int(found["updated"] or 0),
        deleted=int(found["deleted"] or 0),
        files_rewritten=files,
        rows_rewritten=untouched.count() if untouched is not None else 0,
        duplicates=engine.duplicates(folded, new),
    )
