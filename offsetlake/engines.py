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

**The state table holds folded rows and contributions** (``offsetlake.state_table``: committed
just before the batch's one sink commit, which pins it, invariant 2), told apart by
``keyed.HIDDEN``; the sink holds each group's row only (``write_modes.engine``):

- the *visible* row of each key (and window): key columns, the output columns, the folded
  ``STATE``; ``HIDDEN`` null. A ``partial_update`` key whose newest record deletes it keeps its
  state in a row with ``HIDDEN = deleted``, so an older record never brings it back;
- a *contribution* row per committed record (and window): its key, its own outputs, its own
  ``STATE``, its coordinates; ``HIDDEN = contribution``.

The two kinds never share a data file (``is_contribution_file`` tells them apart by the
``HIDDEN`` statistics; ``engine_merge`` reads the column of a file written without any):
visible files are sorted by (window, key), so a merge reads only those holding its batch's
keys; contribution files are appended per batch, so a backfill finds the contributions of its
ranges by their offset statistics.

**An ingest batch** folds each touched key's stored state with the batch's contributions,
rewrites the state's visible files holding touched keys (and the sink's rows of those keys), and
appends the batch's contribution files: its
cost follows the touched keys, not the table. **A backfill** (``backfill.py``) removes the
contributions of the records it reprocesses, adds the new ones, and recomputes every key either
touched from all of that key's remaining contributions (no retraction is needed, so every
function is exact). **A rewind** restores the files, state included. The cost: one contribution
row per record, like an append sink of the keys and measures.

**One fold is in order:** ``first_row`` with a horizon (``within``), whose episodes depend on
the order (``FirstRowEngine._episodes``); a batch with a record earlier than its group's stored state
folds that group again from its contributions (``Engine.late``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import pyarrow as pa

from offsetlake.config import PipelineConfig
from offsetlake.config.sink_settings import Measure
from offsetlake.coordinates import OFFSET, PARTITION, ROW_INDEX, TIMESTAMP, TOPIC, TOPIC_EPOCH
from offsetlake.formats import CHANGE, DELETE, reasons
from offsetlake.keyed import DELETED, HIDDEN

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

STATE = "_offsetlake_state"  # the partial state of a row (module docstring)
CONTRIBUTION = "contribution"  # HIDDEN of a contribution row
WINDOW_START, WINDOW_END = "window_start", "window_end"
# inside STATE, beside the measures (aggregate) or the value columns (partial_update), whose names
# they must not take: how many contributions the state folds; a partial_update's newest record
# that is not a delete, and its newest delete
RECORDS, SEEN, DELETED_AT = "__records", "__seen", "__deleted"
COORDINATES = (TOPIC, PARTITION, OFFSET, TIMESTAMP, TOPIC_EPOCH)
NO_TIME = -(2**62)  # first_row's horizon: the time of a record without one (before every other)


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

    if config.sink.within_on is not None:
        return F.when(F.col(f"`{config.sink.within_on}`").isNull(), F.lit(reasons.window_time_null(config.sink.within_on, "horizon")))
    window = config.sink.window
    if config.sink.engine is None or window is None:
        return None
    on = F.col(f"`{window.on}`")
    problem = F.when(on.isNull(), F.lit(reasons.window_time_null(window.on)))
    if config.sink.allowed_lateness is not None:
        from offsetlake.config.sink_settings import duration_seconds

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
    if config.sink.within_on is not None:
        wanted.append(("sink.within_on", config.sink.within_on))
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
    output columns of a folded state. One subclass per engine (``ENGINES``) says what is its own:
    the state of a record, how states fold, and the outputs of a state."""

    config: PipelineConfig
    mode: ClassVar[str]

    @property
    def sequential(self) -> bool:
        """Whether the state is a fold in order rather than an associative one (``first_row``
        with a horizon, whose episodes each start at the first record past the last one's)."""
        return False

    def value_columns(self, rows: DataFrame) -> list[str]:
        """first_row, partial_update: the record's columns a row keeps (not the key, coordinates
        or the change kind)."""
        skip = {*self.config.sink.key, *COORDINATES, ROW_INDEX, CHANGE, HIDDEN, STATE}
        return [c for c in rows.columns if c not in skip]

    def late(self, new: DataFrame, stored: DataFrame) -> bool:
        """Whether the groups the batch touches must be folded again from all their contributions
        rather than from their stored states (never, for an associative fold)."""
        return False

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
        raise NotImplementedError

    # ---- the fold ------------------------------------------------------------------------------
    def folded(self, states: DataFrame) -> DataFrame:
        """``states`` (group columns + ``STATE``) folded per group: one state per key (and window)."""
        from pyspark.sql import functions as F

        s = F.col(STATE)
        fields: dict[str, Column] = {RECORDS: F.sum(s[RECORDS]), **self._fold_fields(states, s)}
        group = [F.col(f"`{c}`") for c in group_columns(self.config)]
        return states.groupBy(*group).agg(_struct(**fields).alias(STATE))

    def _fold_fields(self, states: DataFrame, s: Column) -> dict[str, Column]:
        """The aggregate of each field of the state but the count of records."""
        raise NotImplementedError

    # ---- the outputs of a state --------------------------------------------------------------
    def with_outputs(self, frame: DataFrame) -> DataFrame:
        """``frame`` (group columns, ``STATE``, ...) with the output columns of its state."""
        from pyspark.sql import functions as F

        for name, column in self._outputs(frame, F.col(STATE)).items():
            frame = frame.withColumn(name, column)
        return frame

    def _outputs(self, frame: DataFrame, s: Column) -> dict[str, Column]:
        raise NotImplementedError

    def visible_rows(self, folded: DataFrame) -> DataFrame:
        """Folded states as visible rows: outputs, no coordinates, ``HIDDEN`` null (``deleted``
        for a partial_update key whose newest record deletes it)."""
        return self.with_outputs(folded).withColumn(HIDDEN, self._hidden())

    def _hidden(self) -> Column:
        from pyspark.sql import functions as F

        return F.lit(None).cast("string")

    def checked_outputs(self) -> list[str] | None:
        """The output columns the audit compares with the replay (None: every column it gives)."""
        return None

    def duplicates(self, folded: DataFrame, new: DataFrame) -> int:
        """The batch's records that changed no row because an earlier one of their group stays
        (``first_row``'s duplicates; none for the other engines). ``new``: the batch's states (of
        each contribution, or already folded per group)."""
        return 0


class AggregateEngine(Engine):
    """``aggregate``: per group, each measure folded over the group's records."""

    mode = "aggregate"

    def _own_state(self, rows: DataFrame, ok: Column) -> Column:
        from pyspark.sql import functions as F

        one = F.lit(1).cast("long")
        return _struct(**{RECORDS: one}, **{m.name: self._measure_own(m, rows, ok) for m in self.config.sink.aggregates()})

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

    def _fold_fields(self, states: DataFrame, s: Column) -> dict[str, Column]:
        return {m.name: self._measure_fold(m, s[m.name]) for m in self.config.sink.aggregates()}

    def checked_outputs(self) -> list[str] | None:
        return [m.name for m in self.config.sink.aggregates()]

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

    def _outputs(self, frame: DataFrame, s: Column) -> dict[str, Column]:
        return {
            m.name: (s[m.name]["v"] if m.function in ("first", "last", "last_non_null") else s[m.name])
            for m in self.config.sink.aggregates()
        }


class FirstRowEngine(Engine):
    """``first_row``: per key, its first record (with ``within``: of its last episode)."""

    mode = "first_row"

    @property
    def sequential(self) -> bool:
        return self.config.sink.within is not None

    def _own_state(self, rows: DataFrame, ok: Column) -> Column:
        from pyspark.sql import functions as F

        one = F.lit(1).cast("long")
        row = F.struct(*[F.col(f"`{c}`") for c in self.value_columns(rows)])
        if not self.sequential:
            return _struct(**{RECORDS: one}, ok=ok, row=row)
        at = F.unix_micros(F.col(f"`{self.config.sink.within_on or TIMESTAMP}`").cast("timestamp"))
        at = F.coalesce(at, F.lit(NO_TIME))  # a record without a time is in its key's first episode
        return _struct(**{RECORDS: one}, ok=ok, row=row, start=at, last=_struct(at=at, ok=ok))

    def folded(self, states: DataFrame) -> DataFrame:
        return self._episodes(states) if self.sequential else super().folded(states)

    def _fold_fields(self, states: DataFrame, s: Column) -> dict[str, Column]:
        from pyspark.sql import functions as F

        return {"ok": F.min(s["ok"]), "row": F.min_by(s["row"], s["ok"])}

    def _episodes(self, states: DataFrame) -> DataFrame:
        """``first_row`` with a horizon: each group's states in order (by ``last``: the time the
        horizon is measured on, then the order key), folded one at a time. A state whose
        ``start`` is at least ``within`` past the current episode's start begins a new episode
        and is its first row; every other one only moves ``last``. The first state may be a
        stored one (its episode so far), when every record of the batch comes after it."""
        from pyspark.sql import functions as F

        from offsetlake.config.sink_settings import duration_seconds

        horizon = F.lit(duration_seconds(str(self.config.sink.within)) * 1_000_000)
        group = [F.col(f"`{c}`") for c in group_columns(self.config)]
        listed = states.groupBy(*group).agg(F.collect_list(F.col(STATE)).alias("_states"))
        ordered = F.array_sort(F.col("_states"), lambda a, b: F.when(a["last"] < b["last"], -1).when(a["last"] > b["last"], 1).otherwise(0))

        def step(episode: Column, state: Column) -> Column:
            records = episode[RECORDS] + state[RECORDS]
            anew = state["start"] >= episode["start"] + horizon
            return F.when(
                anew, _struct(**{RECORDS: records}, ok=state["ok"], row=state["row"], start=state["start"], last=state["last"])
            ).otherwise(_struct(**{RECORDS: records}, ok=episode["ok"], row=episode["row"], start=episode["start"], last=state["last"]))

        folded = F.aggregate(F.slice(F.col("_ordered"), 2, F.size(F.col("_ordered"))), F.col("_ordered")[0], step)
        return listed.withColumn("_ordered", ordered).select(*group, folded.alias(STATE))

    def late(self, new: DataFrame, stored: DataFrame) -> bool:
        """Whether a record of the batch comes before what the stored state of its group has
        folded already (then that group's episodes are folded again from all its contributions)."""
        if not self.sequential:
            return False
        from pyspark.sql import functions as F

        group = group_columns(self.config)
        first = new.groupBy(*group).agg(F.min(F.col(STATE)["last"]).alias("_first"))
        held = stored.select(*group, F.col(STATE)["last"].alias("_held"))
        return bool(first.join(held, group).where(F.col("_first") <= F.col("_held")).limit(1).count())

    def _outputs(self, frame: DataFrame, s: Column) -> dict[str, Column]:
        return {name: s["row"][name] for name in _field_names(frame, STATE, "row")}

    def duplicates(self, folded: DataFrame, new: DataFrame) -> int:
        from pyspark.sql import functions as F

        group = group_columns(self.config)
        first = folded.select(*group, F.col(STATE)["ok"].alias("_ok"))
        # a state's order key is its first record's, and no two records share one: the batch's
        # states whose key is their group's first hold the records that made a row
        won = new.select(*group, F.col(STATE)["ok"].alias("_ok")).join(first, [*group, "_ok"], "left_semi")
        records = new.agg(F.sum(F.col(STATE)[RECORDS]).alias("n")).first()
        return int(records["n"] or 0) - won.count() if records is not None else 0


class PartialUpdateEngine(Engine):
    """``partial_update``: per key, each column's newest non-null value; a newest delete hides it."""

    mode = "partial_update"

    def _own_state(self, rows: DataFrame, ok: Column) -> Column:
        from pyspark.sql import functions as F

        one = F.lit(1).cast("long")
        delete = F.col(CHANGE) == DELETE if CHANGE in rows.columns else F.lit(False)
        fields = {c: _picked(F.when(F.col(f"`{c}`").isNotNull() & ~delete, ok), F.col(f"`{c}`")) for c in self.value_columns(rows)}
        return _struct(**{RECORDS: one, SEEN: F.when(~delete, ok), DELETED_AT: F.when(delete, ok)}, **fields)

    def _fold_fields(self, states: DataFrame, s: Column) -> dict[str, Column]:
        from pyspark.sql import functions as F

        fields = {SEEN: F.max(s[SEEN]), DELETED_AT: F.max(s[DELETED_AT])}
        for name in _field_names(states, STATE, skip=(RECORDS, SEEN, DELETED_AT)):
            fields[name] = _picked(F.max(s[name]["ok"]), F.max_by(s[name]["v"], s[name]["ok"]))
        return fields

    def _outputs(self, frame: DataFrame, s: Column) -> dict[str, Column]:
        from pyspark.sql import functions as F

        names = _field_names(frame, STATE, skip=(RECORDS, SEEN, DELETED_AT))
        return {name: F.when(s[DELETED_AT].isNull() | (s[name]["ok"] > s[DELETED_AT]), s[name]["v"]) for name in names}

    def _hidden(self) -> Column:
        from pyspark.sql import functions as F

        s = F.col(STATE)
        gone = s[SEEN].isNull() | (s[DELETED_AT].isNotNull() & (s[DELETED_AT] > s[SEEN]))
        return F.when(gone, F.lit(DELETED))


ENGINES: dict[str, type[Engine]] = {e.mode: e for e in (AggregateEngine, FirstRowEngine, PartialUpdateEngine)}


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
    return ENGINES[config.sink.engine](config)


def arrow_schema_of(frame: DataFrame) -> pa.Schema:
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(frame.schema, timezone="UTC", prefers_large_types=False)
