"""Merge engines of keyed sinks: ``first_row``, ``partial_update``, ``aggregate`` (invariant 14).

**Every engine is a fold.** Each record (each row of a transform; each of its windows) becomes a
*contribution*: its own partial state (``STATE``), a struct the engine folds associatively —
sums and counts add, min and max compare, and every "which record" question (the first row, the
last value, the newest non-null field, the newest delete) keeps the value together with its
record's *order key* (``order_key``) and picks by it. A key's state is the fold of all its
contributions, so it does not depend on batch boundaries, the order batches ran in, or how
often a partial state was folded again: folding a stored state with a batch's contributions
gives what folding every contribution once gives.

**The order key** is (Kafka timestamp, topic, partition, topic epoch, offset, row index): a
total order. Within one topic-partition whose timestamps do not go backwards (LogAppendTime,
or one producer's CreateTime) it is offset order, as upsert's rule; across partitions it is the
record time, then the coordinates, as upsert's rule. Where a producer's timestamps go backwards
inside a partition, the engines follow the timestamps (upsert follows the offsets).

**One table holds rows and state** (both in the batch's one commit, invariant 2), told apart by
``keyed.HIDDEN``:

- the *visible* row of each key (and window): key columns, the output columns, the folded
  ``STATE``; ``HIDDEN`` null. A ``partial_update`` key whose newest record deletes it keeps its
  state in a row with ``HIDDEN = deleted``, so an older record never brings it back;
- a *contribution* row per committed record (and window): its key, its own outputs, its own
  ``STATE``, its coordinates; ``HIDDEN = contribution``. Readers keep ``HIDDEN IS NULL``.

The two kinds never share a data file (``is_contribution_file`` tells them apart by the
``HIDDEN`` statistics): visible files are sorted by (window, key), so a merge reads only those
holding its batch's keys; contribution files are appended per batch, so a backfill finds the
contributions of its ranges by their offset statistics.

**An ingest batch** folds each touched key's stored state with the batch's contributions,
rewrites the visible files holding touched keys, and appends the batch's contribution files: its
cost follows the touched keys, not the table. **A backfill** (``backfill.py``) removes the
contributions of the records it reprocesses, adds the new ones, and recomputes every key either
touched from all of that key's remaining contributions (no retraction is needed, so every
function is exact). **A rewind** restores the files, state included. The cost: one contribution
row per record, like an append sink of the keys and measures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from offsetlake import keyed, staging
from offsetlake.config import PipelineConfig
from offsetlake.config.models import Measure
from offsetlake.coordinates import OFFSET, PARTITION, ROW_INDEX, TIMESTAMP, TOPIC, TOPIC_EPOCH, Selection
from offsetlake.formats import CHANGE, DELETE, reasons
from offsetlake.keyed import DELETED, HIDDEN, MergeCounts
from offsetlake.sink import live_files, schema_diff, table_schema

if TYPE_CHECKING:
    from deltalake import DeltaTable
    from pyspark.sql import Column, DataFrame

STATE = "_offsetlake_state"  # the partial state of a row (module docstring)
CONTRIBUTION = "contribution"  # HIDDEN of a contribution row
WINDOW_START, WINDOW_END = "window_start", "window_end"
# inside STATE, beside the measures (aggregate) or the value columns (partial_update), whose names
# they must not take: how many contributions the state folds; a partial_update's newest record
# that is not a delete, and its newest delete
RECORDS, SEEN, DELETED_AT = "__records", "__seen", "__deleted"
COORDINATES = (TOPIC, PARTITION, OFFSET, TIMESTAMP, TOPIC_EPOCH)


ORDER_TYPE = "struct<time:timestamp,topic:string,partition:int,epoch:int,offset:bigint,row:int>"


def group_columns(config: PipelineConfig) -> list[str]:
    """The columns that identify a visible row: the key, then the window's start and end."""
    return [*config.sink.key, *((WINDOW_START, WINDOW_END) if config.sink.window is not None else ())]


def is_contribution_file(file: dict[str, Any]) -> bool:
    """Whether a ``sink.live_files`` row is a file of contribution rows (never mixed with visible
    ones): no null ``HIDDEN`` and its least value ``contribution``."""
    return file.get(f"null_count.{HIDDEN}") == 0 and file.get(f"min.{HIDDEN}") == CONTRIBUTION


def row_problem(config: PipelineConfig) -> Column | None:
    """The dead-letter reason of a row an engine cannot place: a null window time, or (with
    ``allowed_lateness``) a record that reached Kafka more than that after its window time."""
    from pyspark.sql import functions as F

    window = config.sink.window
    if config.sink.engine is None or window is None:
        return None
    on = F.col(f"`{window.on}`")
    problem = F.when(on.isNull(), F.lit(reasons.window_time_null(window.on)))
    if config.sink.allowed_lateness is not None:
        from offsetlake.config.models import duration_seconds

        limit = duration_seconds(config.sink.allowed_lateness)
        late_by = F.unix_micros(F.col(TIMESTAMP)) - F.unix_micros(on.cast("timestamp"))
        problem = F.coalesce(
            problem,
            F.when(
                late_by > F.lit(limit * 1_000_000),
                reasons.late_record_column(window.on, config.sink.allowed_lateness, late_by),
            ),
        )
    return problem


def check_columns(config: PipelineConfig, columns: list[str], where: str) -> None:
    """ConfigError naming an engine column the rows do not have (measures, the window's ``on``)."""
    from offsetlake.errors import ConfigError

    wanted = [(f"sink.measures.{m.name}", m.column) for m in config.sink.aggregates() if m.column != "*"]
    if config.sink.window is not None:
        wanted.append(("sink.window.on", config.sink.window.on))
    for field, column in wanted:
        if column not in columns:
            shown = ", ".join(c for c in columns if c != CHANGE)
            raise ConfigError(
                f"{field} names column {column!r}, which is not among the {where} (they are: {shown})", pipeline=config.name, field=field
            )


def order_key(rows: DataFrame) -> Column:
    """Each row's place in the engines' total order (module docstring)."""
    from pyspark.sql import functions as F

    row = F.col(ROW_INDEX) if ROW_INDEX in rows.columns else F.lit(0)
    epoch = F.col(TOPIC_EPOCH) if TOPIC_EPOCH in rows.columns else F.lit(None)
    fields = {
        "time": F.col(TIMESTAMP),
        "topic": F.col(TOPIC),
        "partition": F.col(PARTITION),
        "epoch": F.coalesce(epoch.cast("int"), F.lit(0)),
        "offset": F.col(OFFSET),
        "row": F.coalesce(row.cast("int"), F.lit(0)),
    }
    # every field nullable: a struct that is null (a state without a value yet) has null
    # children, which Arrow refuses to write for a field declared non-nullable
    return F.struct(*[c.alias(n) for n, c in fields.items()]).cast(ORDER_TYPE)


def _picked(ok: Column, value: Column) -> Column:
    return _struct(ok=ok, v=value)


def _struct(**fields: Column) -> Column:
    from pyspark.sql import functions as F

    return F.struct(*[c.alias(n) for n, c in fields.items()])


@dataclass(frozen=True)
class Engine:
    """One engine's three parts, as Spark columns: a row's own state, the fold of states, and the
    output columns of a folded state."""

    config: PipelineConfig

    @property
    def mode(self) -> str:
        return str(self.config.sink.engine)

    def value_columns(self, rows: DataFrame) -> list[str]:
        """first_row, partial_update: the record's columns a row keeps (not the key, coordinates
        or the change kind)."""
        skip = {*self.config.sink.key, *COORDINATES, ROW_INDEX, CHANGE, HIDDEN, STATE}
        return [c for c in rows.columns if c not in skip]

    # ---- a record's own state --------------------------------------------------------------
    def contributions(self, rows: DataFrame) -> DataFrame:
        """Each row's contribution (module docstring): group columns, outputs, ``STATE``,
        coordinates, ``HIDDEN = contribution``; one per window with a sliding window."""
        from pyspark.sql import functions as F

        window = self.config.sink.window
        if window is not None:
            on = F.col(f"`{window.on}`").cast("timestamp")
            slide = f"{window.slide_seconds} seconds"
            w = F.window(on, f"{window.size_seconds} seconds", slide)
            rows = rows.withColumn("_window", w)
            rows = rows.withColumn(WINDOW_START, F.col("_window.start")).withColumn(WINDOW_END, F.col("_window.end")).drop("_window")
        ok = order_key(rows)
        state = self._own_state(rows, ok)
        coordinates = [F.col(c) for c in COORDINATES if c in rows.columns]
        if ROW_INDEX in rows.columns:
            coordinates.append(F.col(ROW_INDEX))
        framed = rows.select(*[F.col(f"`{c}`") for c in group_columns(self.config)], *coordinates, state.alias(STATE))
        framed = self.with_outputs(framed).withColumn(HIDDEN, F.lit(CONTRIBUTION))
        # the group, HIDDEN and the coordinates first: Delta readers keep statistics of the
        # first 32 leaf columns only, and a merge finds files by these (STATE has many leaves)
        first = [*group_columns(self.config), HIDDEN, *[c for c in framed.columns if c in (*COORDINATES, ROW_INDEX)]]
        return framed.select(*first, *[c for c in framed.columns if c not in first and c != STATE], STATE)

    def _own_state(self, rows: DataFrame, ok: Column) -> Column:
        from pyspark.sql import functions as F

        one = F.lit(1).cast("long")
        if self.mode == "aggregate":
            return _struct(**{RECORDS: one}, **{m.name: self._measure_own(m, rows, ok) for m in self.config.sink.aggregates()})
        values = self.value_columns(rows)
        row = F.struct(*[F.col(f"`{c}`") for c in values])
        if self.mode == "first_row":
            return _struct(**{RECORDS: one}, ok=ok, row=row)
        delete = F.col(CHANGE) == DELETE if CHANGE in rows.columns else F.lit(False)
        fields = {c: _picked(F.when(F.col(f"`{c}`").isNotNull() & ~delete, ok), F.col(f"`{c}`")) for c in values}
        return _struct(**{RECORDS: one, SEEN: F.when(~delete, ok), DELETED_AT: F.when(delete, ok)}, **fields)

    @staticmethod
    def _measure_own(m: Measure, rows: DataFrame, ok: Column) -> Column:
        from pyspark.sql import functions as F
        from pyspark.sql.types import DecimalType, DoubleType, FloatType

        if m.function == "count":
            counted = F.lit(True) if m.column == "*" else F.col(f"`{m.column}`").isNotNull()
            return counted.cast("long")
        value = F.col(f"`{m.column}`")
        if m.function == "sum":
            kind = rows.schema[m.column].dataType
            if isinstance(kind, DecimalType):
                return value.cast(DecimalType(min(38, kind.precision + 10), kind.scale))
            return value.cast("double") if isinstance(kind, FloatType | DoubleType) else value.cast("long")
        if m.function in ("min", "max"):
            return value
        if m.function == "last_non_null":
            return _picked(F.when(value.isNotNull(), ok), value)
        return _picked(ok, value)  # first, last

    # ---- the fold ------------------------------------------------------------------------------
    def folded(self, states: DataFrame) -> DataFrame:
        """``states`` (group columns + ``STATE``) folded per group: one state per key (and window)."""
        from pyspark.sql import functions as F

        s = F.col(STATE)
        fields: dict[str, Column] = {RECORDS: F.sum(s[RECORDS])}
        if self.mode == "aggregate":
            for m in self.config.sink.aggregates():
                fields[m.name] = self._measure_fold(m, s[m.name])
        elif self.mode == "first_row":
            fields["ok"] = F.min(s["ok"])
            fields["row"] = F.min_by(s["row"], s["ok"])
        else:
            fields[SEEN] = F.max(s[SEEN])
            fields[DELETED_AT] = F.max(s[DELETED_AT])
            for name in _field_names(states, STATE, skip=(RECORDS, SEEN, DELETED_AT)):
                fields[name] = _picked(F.max(s[name]["ok"]), F.max_by(s[name]["v"], s[name]["ok"]))
        group = [F.col(f"`{c}`") for c in group_columns(self.config)]
        return states.groupBy(*group).agg(_struct(**fields).alias(STATE))

    @staticmethod
    def _measure_fold(m: Measure, state: Column) -> Column:
        from pyspark.sql import functions as F

        if m.function in ("sum", "count"):
            return F.sum(state)
        if m.function == "min":
            return F.min(state)
        if m.function == "max":
            return F.max(state)
        if m.function == "first":
            return _picked(F.min(state["ok"]), F.min_by(state["v"], state["ok"]))
        return _picked(F.max(state["ok"]), F.max_by(state["v"], state["ok"]))  # last, last_non_null

    # ---- the outputs of a state --------------------------------------------------------------
    def with_outputs(self, frame: DataFrame) -> DataFrame:
        """``frame`` (group columns, ``STATE``, ...) with the output columns of its state."""
        from pyspark.sql import functions as F

        s = F.col(STATE)
        if self.mode == "aggregate":
            outputs = {
                m.name: (s[m.name]["v"] if m.function in ("first", "last", "last_non_null") else s[m.name])
                for m in self.config.sink.aggregates()
            }
        elif self.mode == "first_row":
            outputs = {name: s["row"][name] for name in _field_names(frame, STATE, "row")}
        else:
            names = _field_names(frame, STATE, skip=(RECORDS, SEEN, DELETED_AT))
            outputs = {name: F.when(s[DELETED_AT].isNull() | (s[name]["ok"] > s[DELETED_AT]), s[name]["v"]) for name in names}
        for name, column in outputs.items():
            frame = frame.withColumn(name, column)
        return frame

    def visible_rows(self, folded: DataFrame) -> DataFrame:
        """Folded states as visible rows: outputs, no coordinates, ``HIDDEN`` null (``deleted``
        for a partial_update key whose newest record deletes it)."""
        from pyspark.sql import functions as F

        rows = self.with_outputs(folded)
        hidden = F.lit(None).cast("string")
        if self.mode == "partial_update":
            s = F.col(STATE)
            gone = s[SEEN].isNull() | (s[DELETED_AT].isNotNull() & (s[DELETED_AT] > s[SEEN]))
            hidden = F.when(gone, F.lit(DELETED))
        return rows.withColumn(HIDDEN, hidden)


def _field_names(frame: DataFrame, column: str, inner: str | None = None, skip: tuple[str, ...] = ()) -> list[str]:
    """The field names of the struct ``column`` of ``frame`` (of its struct field ``inner``)."""
    from pyspark.sql.types import StructType

    kind = frame.schema[column].dataType
    assert isinstance(kind, StructType)
    if inner is not None:
        kind = kind[inner].dataType
        assert isinstance(kind, StructType)
    return [f.name for f in kind.fields if f.name not in skip]


def engine_for(config: PipelineConfig) -> Engine:
    """The merge engine of a pipeline whose ``sink.mode`` is one (``ENGINE_MODES``)."""
    if config.sink.engine is None:
        from offsetlake.errors import ConfigError

        raise ConfigError(f"sink.mode {config.sink.mode} has no merge engine", pipeline=config.name, field="sink.mode")
    return Engine(config)


def arrow_schema_of(frame: DataFrame) -> pa.Schema:
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(frame.schema, timezone="UTC", prefers_large_types=False)


# ---- a batch's merge ------------------------------------------------------------------------------
@dataclass
class EngineMerge:
    """What a batch's commit writes and removes: the visible rows of the files it rewrites
    (sorted by group), the contribution rows (the batch's, and for a backfill those of the
    replaced contribution files outside its ranges), the live files they replace, the counts."""

    visible: DataFrame
    contributions: DataFrame
    removed: list[dict[str, Any]]
    counts: MergeCounts
    visible_rows: int
    cached: list[DataFrame]


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
    contribution_files = [f for f in files if is_contribution_file(f)]
    replaced_files = [f for f in contribution_files if replaced is not None and replaced.file_may_hold(f)]
    schema = _merged_schema(table, new)
    inside = _selected(replaced)
    dropped = kept = None
    if replaced_files:
        old = staging.read_files(spark, config.layout.sink, replaced_files, schema, [])
        dropped = old.where(inside).select(*group)
        kept = old.where(~inside)
    keys = new.select(*group) if dropped is None else new.select(*group).unionByName(dropped)
    keys = keys.distinct().persist()
    cached.append(keys)
    stored_files = []
    if table is not None:
        # by the key's and the window start's statistics: visible files are sorted by (window, key)
        pruning = [*config.sink.key, *([WINDOW_START] if config.sink.window is not None else [])]
        holding = keyed.files_holding(table, keys.select(*pruning).distinct().toArrow(), config, pruning)
        stored_files = [f for f in holding if not is_contribution_file(f)]
    stored = staging.read_files(spark, config.layout.sink, stored_files, schema, []) if stored_files else None
    states = new.select(*group, STATE)
    if replaced is not None and contribution_files:  # every contribution left of the touched groups
        rest = staging.read_files(spark, config.layout.sink, contribution_files, schema, []).where(~inside)
        states = states.unionByName(rest.join(keys, group, "left_semi").select(*group, STATE))
    elif stored is not None:
        states = states.unionByName(stored.join(keys, group, "left_semi").select(*group, STATE))
    folded = engine.visible_rows(engine.folded(states))
    visible = _shaped(folded, new)
    untouched = None
    if stored is not None:
        untouched = stored.join(keys, group, "left_anti").select(*new.columns)
        visible = visible.unionByName(untouched)
    visible = visible.persist()
    cached.append(visible)
    counts = _counts(engine, new, folded, stored, keys, untouched, len(stored_files))
    contributions = new if kept is None else new.unionByName(kept.select(*new.columns))
    return EngineMerge(visible, contributions, [*stored_files, *replaced_files], counts, visible.count(), cached)


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
    duplicates = 0
    if engine.mode == "first_row":
        first = folded.select(*group, F.col(STATE)["ok"].alias("_ok"))
        won = first.join(new.select(*group, F.col(STATE)["ok"].alias("_ok")), [*group, "_ok"], "left_semi")
        duplicates = new.count() - won.count()
    return MergeCounts(
        inserted=int(found["inserted"] or 0),
        updated=int(found["updated"] or 0),
        deleted=int(found["deleted"] or 0),
        files_rewritten=files,
        rows_rewritten=untouched.count() if untouched is not None else 0,
        duplicates=duplicates,
    )
