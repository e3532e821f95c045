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

from offsetlake import keyed, staging, state_segments, storage
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
class BatchContributions:
    """A batch's contributions as a merge takes them: ``rows``, the contribution rows Spark holds
    and writes (None: the read tasks wrote them all, ``offsetlake.engine_arrow``); ``like``, a
    frame with the contribution rows' columns and types; ``held``, the read tasks' partial states
    folded on the driver (one row per group; None on the Spark path), ``in_read`` the
    ``engine_arrow.ArrowEngine`` they ran. ``states`` is what Spark folds of them all."""

    group: list[str]
    rows: DataFrame | None
    like: DataFrame
    in_read: Any = None
    held: pa.Table | None = None
    spark: Any = None
    given: DataFrame | None = None  # the states, when Spark reads the read tasks' partial states itself

    @property
    def states(self) -> DataFrame:
        """The group columns and STATE of each contribution Spark holds and of each group the read
        tasks folded (the fold is associative, so a merge takes either); made when a merge in
        Spark asks (``merged_in_arrow`` needs none)."""
        from offsetlake.spark import dataframe_from_arrow

        if self.given is not None:
            return self.given
        group = [f"`{c}`" for c in self.group]
        mine = self.rows.select(*group, STATE) if self.rows is not None else None
        if self.held is None or (self.held.num_rows == 0 and mine is not None):
            assert mine is not None
            return mine
        held = dataframe_from_arrow(self.spark, self.held)
        return held if mine is None else held.unionByName(mine)


def batch_contributions(spark: Any, config: PipelineConfig, rows: DataFrame | None, in_read: Any, written: Any) -> BatchContributions:
    """The contributions of a batch's rows that Spark holds (``rows``), and of those its read
    tasks folded themselves (the direct path: ``in_read`` is the ``engine_arrow.ArrowEngine``
    they ran, ``written`` the ``processed.WrittenInRead`` naming a partial state file per task),
    whose rows the driver folds once more, in Arrow, before Spark sees them (one row per group,
    whatever the number of tasks)."""
    from offsetlake.spark import dataframe_from_arrow

    engine = engine_for(config)
    group = group_columns(config)
    new = engine.contributions(rows) if rows is not None else None
    if in_read is None:
        assert new is not None, "a batch on the Spark path has rows"
        return BatchContributions(group, new, new)
    like = new if new is not None else dataframe_from_arrow(spark, in_read.contributions_schema.empty_table())
    if written.partial_rows > DRIVER_ROWS:  # groups nearly as many as records: Spark reads and folds them
        files = [{"path": storage.log_path_from_file_path(p)} for p in written.partials]
        partial = staging.read_files(spark, written.table_root, files, in_read.states_schema, [])
        states = partial if new is None else partial.unionByName(new.select(*group, STATE))
        return BatchContributions(group, new, like, spark=spark, given=states)
    held = _read_partials(in_read, written.table_root, written.partials)
    return BatchContributions(group, new, like, in_read, held, spark)


def _read_partials(engine: Any, table_root: storage.Location | None, paths: list[str]) -> pa.Table:
    """The read tasks' partial states (``engine_arrow``), folded into one row per group."""
    tables = [engine.states_schema.empty_table()]
    if paths:
        assert table_root is not None
        fs, root = storage.filesystem(table_root)
        for path in paths:
            with fs.open_input_file(f"{root.rstrip('/')}/{path}") as handle:
                tables.append(pq.ParquetFile(handle).read().cast(engine.states_schema))
    return engine.fold(pa.concat_tables(tables))


@dataclass
class EngineMerge:
    """What a batch's commit writes and removes: the visible rows of the files it rewrites
    (sorted by group), the contribution rows (the batch's, and for a backfill those of the
    replaced contribution files outside its ranges; None: none for Spark to write), the live
    files they replace, the counts."""

    visible: DataFrame | pa.Table  # a pyarrow table from ``merged_on_driver``
    contributions: DataFrame | None
    removed: list[dict[str, Any]]
    counts: MergeCounts
    visible_rows: int
    cached: list[DataFrame]
    keys: DataFrame | pa.Table  # the groups the batch touched (its own and those of the contributions it dropped)
    folded: dict[tuple[str, int, int], int] = field(default_factory=dict)  # the horizon a fold raised (``fold``)
    on: str = "spark"  # where the groups were folded: "spark", "driver" (``merged_on_driver``), "arrow" (``merged_in_arrow``)
    held_contributions: pa.Table | None = None  # contribution rows the driver holds and writes (``backfill_in_arrow``)
    segments: int = 0  # batch states read instead of the contribution files they fold (``state_segments``)


def merged(
    spark: Any, config: PipelineConfig, table: DeltaTable | None, batch: BatchContributions, replaced: Selection | None = None
) -> EngineMerge:
    """The batch's contributions merged (module docstring). An ingest (``replaced`` None) folds each
    touched group's stored state with the batch's contributions. A backfill (``replaced``: the
    records it reprocesses) drops the stored contributions of those records, and folds every
    touched group — the batch's and the dropped contributions' — from all its contributions left
    plus the batch's; a group none are left for loses its visible row."""

    engine = engine_for(config)
    group = group_columns(config)
    cached = []
    if batch.rows is not None:  # its states are read from it (Spark finds the cache by the plan)
        cached.append(batch.rows.persist())
    new = batch.states
    files = live_files(table) if table is not None else []
    contribution_files = [f for f in files if _holds_contributions(config, f)]
    replaced_files = [f for f in contribution_files if replaced is not None and not _all_folded(f) and replaced.file_may_hold(f)]
    schema = _merged_schema(table, batch.like)
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
        pruning = [*config.sink.key, *([WINDOW_START] if config.sink.window is not None else [])]
        stored_files = _visible_files_holding(config, table, keys.select(*pruning).distinct().toArrow(), contribution_files)
    stored = None
    if stored_files:  # the touched groups' visible files: a few rows, read for the fold, the counts and the untouched rows
        stored = staging.read_files(spark, config.layout.sink, stored_files, schema, []).persist()
        cached.append(stored)
    states = new.select(*group, STATE)
    refold = replaced is not None or (stored is not None and engine.late(new, stored))
    if refold and contribution_files:  # every contribution left of the touched groups
        states = states.unionByName(
            _states_left(spark, config, contribution_files, schema, placed, replaced, batch).join(keys, group, "left_semi")
        )
    elif stored is not None:
        states = states.unionByName(stored.join(keys, group, "left_semi").select(*group, STATE))
    # one row per touched group, cached: the counts and the visible rows both read it, and it may
    # be the fold of every contribution of the state (a backfill)
    folded = engine.visible_rows(engine.folded(states)).persist()
    cached.append(folded)
    visible = _shaped(folded, batch.like)
    untouched = None
    if stored is not None:
        untouched = stored.join(keys, group, "left_anti").select(*batch.like.columns)
        visible = visible.unionByName(untouched)
    visible = visible.persist()
    cached.append(visible)
    counts = _counts(engine, new, folded, stored, keys, untouched, len(stored_files))
    contributions = _union(batch.rows, kept.select(*batch.like.columns) if kept is not None else None)
    removed = [*stored_files, *replaced_files]
    folding = fold(spark, config, engine, contribution_files, schema, batch.like) if replaced is None else None
    if folding is not None:
        contributions = _union(contributions, folding.rows)
        removed += folding.removed
    merge = EngineMerge(visible, contributions, removed, counts, visible.count(), cached, keys)
    if folding is not None:
        merge.folded = folding.below
    return merge


def _states_left(
    spark: Any,
    config: PipelineConfig,
    files: list[dict[str, Any]],
    schema: pa.Schema,
    placed: list[str],
    replaced: Selection | None,
    batch: BatchContributions,
) -> DataFrame:
    """The states (group columns, STATE) of every contribution in ``files`` but ``replaced``'s: the
    read tasks fold them per group in Arrow where that is exact (``engine_arrow.StatesFolded``),
    so a few rows per group and task reach Spark instead of one per contribution (a backfill's
    fold read every contribution of the state into the JVM: 17 s of a 31 s backfill after 2M
    records, BENCHMARKS.md); the engines Arrow does not fold read every row, as before."""
    from offsetlake import engine_arrow

    group = group_columns(config)
    columns = [*placed, STATE]
    if config.sink.folds_in_read:
        engine = engine_arrow.ArrowEngine.of(
            config, arrow_schema_of(batch.like), arrow_schema_of(engine_for(config).folded(batch.like.select(*group, STATE)))
        )
        if engine_arrow.reads(engine, schema):
            reduce = engine_arrow.StatesFolded(engine, replaced)
            return staging.read_files(spark, config.layout.sink, files, schema, [], columns, reduce=reduce, reduced=engine.states_schema)
    rest = staging.read_files(spark, config.layout.sink, files, schema, [], columns).where(~_selected(replaced))
    return rest.select(*group, STATE)


def merged_in_arrow(spark: Any, config: PipelineConfig, table: DeltaTable | None, batch: BatchContributions) -> EngineMerge | None:
    """``merged_on_driver`` without Spark, for a batch whose read tasks folded every contribution
    (the direct path, ``engine_arrow``): the stored states of its groups are read on the driver
    and folded with its partial states in Arrow, the visible rows made there. None (for Spark to
    merge) when Arrow cannot fold the stored states exactly (``engine_arrow.folds_exactly``: they
    may hold what Spark folded from rows Arrow leaves to it), when Spark holds contributions of
    the batch too, or when the state rows pass ``DRIVER_ROWS``."""
    from offsetlake import engine_arrow

    engine, held = batch.in_read, batch.held
    if engine is None or held is None or batch.rows is not None:
        return None
    group = group_columns(config)
    files = live_files(table) if table is not None else []
    contribution_files = [f for f in files if _holds_contributions(config, f)]
    stored_files = _visible_files_holding(config, table, held, contribution_files)
    if held.num_rows + _rows(stored_files) > DRIVER_ROWS:
        return None
    shape = _visible_shape(config, batch.like)
    before = untouched = shape.empty_table()
    if stored_files:
        assert table is not None
        stored = staging.read_table(config.layout.sink, stored_files, _merged_schema(table, batch.like), [])
        before, untouched = keyed.split_by_groups(stored, held.select(group), group)
        if not engine_arrow.folds_exactly(engine, before):
            return None
    both = pa.concat_tables([held, before.select([*group, STATE]).cast(engine.states_schema)])
    folded = engine.fold(both)
    visible = engine_arrow.visible(engine, folded, shape)
    records = int(pc.sum(pc.struct_field(held.column(STATE), RECORDS)).as_py() or 0)
    counts = MergeCounts(
        inserted=held.num_rows - before.num_rows,
        updated=before.num_rows,
        files_rewritten=len(stored_files),
        rows_rewritten=untouched.num_rows,
        duplicates=records - _won(folded, held, group) if isinstance(engine_for(config), FirstRowEngine) else 0,
    )
    if untouched.num_rows:
        visible = pa.concat_tables([visible, untouched.select(shape.names).cast(shape)])
    merge = EngineMerge(visible, None, list(stored_files), counts, visible.num_rows, [], visible.select(group), on="arrow")
    schema = _merged_schema(table, batch.like)
    try:
        folding = fold_in_arrow(config, engine, contribution_files, schema)
    except _SparkFolds:
        folding = fold(spark, config, engine_for(config), contribution_files, schema, batch.like)
    if folding is not None:
        if isinstance(folding.rows, pa.Table):
            merge.held_contributions = folding.rows
        else:
            merge.contributions = folding.rows
        merge.removed += folding.removed
        merge.folded = folding.below
    return merge


def backfill_in_arrow(
    spark: Any, config: PipelineConfig, table: DeltaTable | None, batch: BatchContributions, replaced: Selection
) -> EngineMerge | None:
    """``merged``'s backfill on the driver, in Arrow, for an engine the read tasks fold
    (``engine_arrow``): the batch's contributions come to the driver as states, the read tasks'
    partial states of those they folded and wrote (the direct path: ``batch.held``) and the rows
    of those Spark holds (``batch.rows``: every one on the Spark path); the contribution files
    that may hold the replaced records are read there and split into the replaced ones (their
    groups are touched) and the kept ones (written again); the states of
    every other contribution file are folded per group by the Spark tasks that read them
    (``engine_arrow.StatesFolded``: a few rows per group and task reach the driver, not one per
    contribution); the touched groups are folded from all of that with their stored states'
    files' other rows kept, and a group with nothing left loses its row. None (for ``merged``)
    when something is not Arrow's to fold exactly, or the rows pass ``DRIVER_ROWS``."""
    from offsetlake import engine_arrow

    group = group_columns(config)
    like = batch.like
    engine = engine_arrow.ArrowEngine.of(
        config, arrow_schema_of(like), arrow_schema_of(engine_for(config).folded(like.select(*group, STATE)))
    )
    schema = _merged_schema(table, like)
    if batch.given is not None or (batch.rows is None and batch.held is None) or table is None or not engine_arrow.reads(engine, schema):
        return None
    files = live_files(table)
    contribution_files = [f for f in files if _holds_contributions(config, f)]
    replaced_files = [f for f in contribution_files if not _all_folded(f) and replaced.file_may_hold(f)]
    if _rows(replaced_files) > DRIVER_ROWS:
        return None
    new = batch.rows.toArrow().select(like.columns) if batch.rows is not None else engine.contributions_schema.empty_table()
    new = new.cast(engine.contributions_schema)
    # the batch's states: one per group the read tasks folded (their files are staged already), one per row Spark holds
    batch_states = new.select([*group, STATE]).cast(engine.states_schema)
    if batch.held is not None:
        batch_states = pa.concat_tables([batch.held.cast(engine.states_schema), batch_states])
    stored_contributions = staging.read_table(config.layout.sink, replaced_files, schema, []) if replaced_files else schema.empty_table()
    inside = replaced.arrow()  # null for a folded row (no offset): never inside
    inside = pc.coalesce(inside, pa.scalar(False)) if inside is not None else None
    kept = stored_contributions.filter(pc.invert(inside)) if inside is not None else stored_contributions
    dropped = stored_contributions.filter(inside) if inside is not None else schema.empty_table()
    mine = pa.concat_tables([batch_states, kept.select([*group, STATE]).cast(engine.states_schema)])
    if not bool(pc.all(engine_arrow.exact_states(engine, mine)).as_py() if mine.num_rows else True):
        return None
    keys = _distinct(pa.concat_tables([batch_states.select(group), dropped.select(group).cast(batch_states.select(group).schema)]))
    stored_files = _visible_files_holding(config, table, keys, contribution_files)
    if keys.num_rows + _rows(stored_files) > DRIVER_ROWS:
        return None
    shape = _visible_shape(config, like)
    before = untouched = shape.empty_table()
    if stored_files:
        stored = staging.read_table(config.layout.sink, stored_files, schema, [])
        before, untouched = keyed.split_by_groups(stored, keys, group)
    others = [f for f in contribution_files if f not in replaced_files]
    segments, covered, others = _segments_of(config, engine, others)
    left = engine.states_schema.empty_table()
    if covered is not None:
        left, _ = keyed.split_by_groups(covered, keys, group)
    if others:
        reduce = engine_arrow.StatesFolded(engine)  # their statistics say they hold none of the replaced records
        read = staging.read_files(spark, config.layout.sink, others, schema, [], [*group, STATE], reduce, engine.states_schema)
        read_left, _ = keyed.split_by_groups(read.toArrow().cast(engine.states_schema), keys, group)
        left = pa.concat_tables([left, read_left])
    if left.num_rows and not engine_arrow.folds_exactly(engine, left):
        return None
    mine, _ = keyed.split_by_groups(mine, keys, group)
    folded = engine.fold(pa.concat_tables([mine, left]))
    visible = engine_arrow.visible(engine, folded, shape)
    after = folded.select(group)
    was, _ = keyed.split_by_groups(before.select(group), after, group)  # groups with a row before and after
    counts = MergeCounts(
        inserted=after.num_rows - was.num_rows,
        updated=was.num_rows,
        deleted=before.num_rows - was.num_rows,
        files_rewritten=len(stored_files),
        rows_rewritten=untouched.num_rows,
        duplicates=_duplicates_in_arrow(config, folded, batch_states, group),
    )
    if untouched.num_rows:
        visible = pa.concat_tables([visible, untouched.select(shape.names).cast(shape)])
    shape_of_rows = _relaxed(engine)
    contributions = pa.concat_tables([new.cast(shape_of_rows), kept.select(like.columns).cast(shape_of_rows)])
    # the sink's projection rewrites every group these state rows hold, touched or sharing their files
    touched = _distinct(pa.concat_tables([keys, visible.select(group).cast(keys.schema)]))
    merge = EngineMerge(visible, None, [*stored_files, *replaced_files], counts, visible.num_rows, [], touched, on="arrow")
    merge.held_contributions = contributions
    merge.segments = segments
    return merge


def _segments_of(config: PipelineConfig, engine: Any, files: list[dict[str, Any]]) -> tuple[int, pa.Table | None, list[dict[str, Any]]]:
    """The batch states (``offsetlake.state_segments``) that fold whole contribution files of
    ``files``: how many, their rows (None: none usable), and the files they leave to be read."""
    root = config.layout.sink
    usable = state_segments.usable(state_segments.listed(root), state_segments.file_paths(files))
    if not usable or sum(s.rows for s in usable) > DRIVER_ROWS:
        return 0, None, files
    rows = state_segments.read(root, usable, engine.states_schema)
    if rows is None:
        return 0, None, files
    covered = state_segments.covered_files(usable)
    return len(usable), rows, [f for f in files if storage.file_path_from_log(f["path"]) not in covered]


def _duplicates_in_arrow(config: PipelineConfig, folded: pa.Table, batch: pa.Table, group: list[str]) -> int:
    """first_row: the batch's records that are not their group's first (none for other engines)."""
    if not isinstance(engine_for(config), FirstRowEngine):
        return 0
    records = int(pc.sum(pc.struct_field(batch.column(STATE), RECORDS)).as_py() or 0)
    return records - _won(folded, batch, group)


def _visible_files_holding(
    config: PipelineConfig, table: DeltaTable | None, groups: pa.Table, contribution_files: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The live state files of visible rows that may hold one of ``groups``: by the key's and the
    window start's statistics (visible files are sorted by window and key), contribution files
    left out."""
    if table is None or not groups.num_rows:
        return []
    pruning = [*config.sink.key, *([WINDOW_START] if config.sink.window is not None else [])]
    kinds = {f["path"] for f in contribution_files}
    return [f for f in keyed.files_holding(table, _distinct(groups.select(pruning)), config, pruning) if f["path"] not in kinds]


def _visible_shape(config: PipelineConfig, like: DataFrame) -> pa.Schema:
    """The visible rows' schema in the contribution rows' columns (Spark's analysis, no job)."""
    engine = engine_for(config)
    group = group_columns(config)
    return arrow_schema_of(_shaped(engine.visible_rows(engine.folded(like.select(*group, STATE))), like).select(*like.columns))


def _won(folded: pa.Table, batch: pa.Table, group: list[str]) -> int:
    """first_row: the groups whose first record is the batch's (its state's order key is the
    folded one; no two records share an order key)."""
    from offsetlake.engine_arrow import ORDER_FIELDS

    def keyed_by_ok(table: pa.Table) -> pa.Table:
        ok = pc.struct_field(table.column(STATE), "ok")
        columns = {c: table.column(c) for c in group}
        columns.update({f"__ok_{name}": pc.struct_field(ok, name) for name in ORDER_FIELDS})
        return pa.table(columns)

    left, right = keyed_by_ok(folded), keyed_by_ok(batch)
    return left.join(right, list(left.column_names), join_type="inner").num_rows


def on_driver(config: PipelineConfig, replaced: Selection | None) -> bool:
    """Whether a batch's merge holds its groups on the driver (``merged_on_driver``): an ingest of
    an associative engine. A backfill, and ``first_row`` with a horizon, fold in ``merged``."""
    return replaced is None and not engine_for(config).sequential


# the most state rows (the batch's groups plus the stored rows of the files holding them) an
# ingest merges on the driver; above it the batch merges in Spark (``merged``)
DRIVER_ROWS = 1_000_000


def _union(first: DataFrame | None, then: DataFrame | None) -> DataFrame | None:
    if first is None or then is None:
        return first if then is None else then
    return first.unionByName(then)


def merged_on_driver(spark: Any, config: PipelineConfig, table: DeltaTable | None, batch: BatchContributions) -> EngineMerge | None:
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
    # not cached: recomputed from the decoded rows is cheaper than a cache of its states
    partial = engine.folded(batch.states).persist()
    cached = [partial]
    mine = partial.select(*group, F.col(STATE)[RECORDS].alias(_RECORDS), *([F.col(STATE)["ok"].alias(_OK)] if first_row else []))
    keys = mine.select(*group, _RECORDS).toArrow()
    records = int(pc.sum(keys[_RECORDS]).as_py() or 0)
    files = live_files(table) if table is not None else []
    contribution_files = [f for f in files if _holds_contributions(config, f)]
    schema = _merged_schema(table, batch.like)
    stored_files = _visible_files_holding(config, table, keys, contribution_files)
    if keys.num_rows + _rows(stored_files) > DRIVER_ROWS:
        for frame in cached:
            frame.unpersist()
        return None
    states = partial.select(*group, STATE)
    like = batch.like
    flagged = _shaped(engine.visible_rows(engine.folded(states)), like) if not stored_files else None
    untouched = None
    if stored_files:
        stored = staging.read_table(config.layout.sink, stored_files, schema, [])
        before, untouched = keyed.split_by_groups(stored, keys, group)
        old = dataframe_from_arrow(spark, before.select([*group, STATE, HIDDEN]))
        folded = engine.visible_rows(engine.folded(states.unionByName(old.select(*group, STATE))))
        flagged = _shaped(folded, like).join(old.select(*group, F.col(HIDDEN).isNull().alias(_BEFORE)), group, "left")
    assert flagged is not None
    if _BEFORE not in flagged.columns:
        flagged = flagged.withColumn(_BEFORE, F.lit(None).cast("boolean"))
    shape = arrow_schema_of(flagged.select(*like.columns))
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
    contributions, removed = batch.rows, list(stored_files)
    folding = fold(spark, config, engine, contribution_files, schema, like)
    if folding is not None:
        contributions = _union(contributions, folding.rows)
        removed += folding.removed
    merge = EngineMerge(visible, contributions, removed, counts, visible.num_rows, cached, visible.select(group), on="driver")
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

    rows: DataFrame | pa.Table  # a pyarrow table from ``fold_in_arrow``
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


def fold_in_arrow(config: PipelineConfig, engine: Any, files: list[dict[str, Any]], schema: pa.Schema) -> Fold | None:
    """``fold`` on the driver, in Arrow (an engine the read tasks fold, ``engine_arrow``): the same
    files, the same rule, ``Fold.rows`` a pyarrow table of the contribution rows' schema. None
    when nothing is to be folded, and when Spark must fold (``fold`` is then asked): more rows
    than ``DRIVER_ROWS``, a state Arrow cannot fold exactly, a schema it does not read."""
    from offsetlake import engine_arrow

    seconds = config.sink.fold_after_seconds
    if seconds is None or not files or not engine_arrow.reads(engine, schema):
        return None
    cutoff = datetime.now(UTC) - timedelta(seconds=seconds)
    holding = [f for f in files if _holds_folded(config, f)]
    old = [f for f in files if f not in holding and not may_hold_between(f, TIMESTAMP, cutoff, _LAST_INSTANT)]
    if not old or _rows(old) < _rows(holding) or _rows(holding) + _rows(old) > DRIVER_ROWS:
        return None
    group = group_columns(config)
    read = staging.read_table(config.layout.sink, [*holding, *old], schema, [])
    stamp = pc.cast(read.column(TIMESTAMP), pa.int64())
    before = int((cutoff - datetime(1970, 1, 1, tzinfo=UTC)) / timedelta(microseconds=1))
    goes = pc.or_(pc.is_null(read.column(OFFSET)), pc.fill_null(pc.less(stamp, before), False))
    going = read.filter(goes)
    states = going.select([*group, STATE]).cast(engine.states_schema)
    if not engine_arrow.folds_exactly(engine, states):
        raise _SparkFolds
    shape = _relaxed(engine)
    folded = engine_arrow.visible(engine, engine.fold(states), shape, hidden=CONTRIBUTION)
    young = read.filter(pc.invert(goes)).select(shape.names).cast(shape)
    below: dict[tuple[str, int, int], int] = {}
    placed = going.filter(pc.is_valid(going.column(OFFSET)))
    epochs = placed.column(TOPIC_EPOCH) if TOPIC_EPOCH in placed.column_names else pa.nulls(placed.num_rows, pa.int32())
    keyed_by = pa.table(
        {
            "t": placed.column(TOPIC),
            "e": pc.fill_null(pc.cast(epochs, pa.int32()), 0),
            "p": placed.column(PARTITION),
            "o": placed.column(OFFSET),
        }
    )
    for r in keyed_by.group_by(["t", "e", "p"]).aggregate([("o", "max")]).to_pylist():
        below[(r["t"], int(r["e"]), int(r["p"]))] = int(r["o_max"]) + 1
    return Fold(pa.concat_tables([folded, young]), [*holding, *old], below)


class _SparkFolds(Exception):
    """``fold_in_arrow`` met a state Arrow cannot fold exactly: Spark folds (``fold``)."""


def _relaxed(engine: Any) -> pa.Schema:
    """The contribution rows' schema with every column nullable and STATE of the folded states'
    type: rows of several kinds in one file (a fold's rows, a batch's, the kept rows of a file),
    as Spark's union of them types them."""
    state = engine.states_schema.field(STATE).type
    return pa.schema([pa.field(f.name, state if f.name == STATE else f.type) for f in engine.contributions_schema])


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
