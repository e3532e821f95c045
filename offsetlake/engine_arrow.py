"""A merge engine's contributions and their fold in Arrow, for the read tasks of the direct path.

An engine's batch has many records and few groups (200,000 orders over 10,000 ids in the bench),
and on the Spark path every record crossed into the JVM to be decoded, cached, turned into a
contribution, folded and handed back to Python to be written: about three times the append
sink's whole batch (BENCHMARKS.md, issue 51). Here the read tasks do for an engine what they do
for an append sink (``offsetlake.direct``): each decodes its split, turns the rows into their
contributions, writes them as the state table's contribution files, and folds them per group into
one partial state per group, which is all the driver reads of the records
(``engine_merge.merged_on_driver`` folds those few rows with the stored states, in Spark, with
``Engine.folded`` as for every batch).

``offsetlake.engines`` stays the definition of every engine (Spark columns); this module computes
the same values in Arrow for the part of the domain where it can be exact, and hands every other
row to Spark with the undecided records (``ArrowEngine.exact``), so Spark decides a record's fate
as before (a dead letter for a null key or window time, a late record). What Arrow leaves to
Spark: a null key or Kafka timestamp, a window time that is null or before 1970, a record later
than ``allowed_lateness``, NaN in a ``min``/``max`` column (Spark orders NaN above every number,
pyarrow skips it), an integer ``sum`` value of 2^31 or more (Spark's ANSI sum raises on an
overflow, pyarrow's wraps; below 2^31 no task's sum can reach 2^63). What takes the Spark path
for the whole pipeline (``schema_problem``): ``first_row`` with ``within`` (a fold in order),
``partial_update`` (deletes), a window on a column that is not a timestamp, a floating-point key
(Spark normalizes -0.0 and NaN when it groups), a measure over a column that is not a number,
text, boolean or timestamp.

The two computations are held equal by ``tests/test_direct_path.py`` (the same records through
both paths give the same state table and sink) and ``tests/test_engine_arrow.py`` (random rows,
the Arrow contributions and fold against Spark's).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import pyarrow as pa
import pyarrow.compute as pc

from offsetlake.coordinates import OFFSET, PARTITION, ROW_INDEX, TIMESTAMP, TOPIC, TOPIC_EPOCH
from offsetlake.engines import CONTRIBUTION, RECORDS, STATE, WINDOW_END, WINDOW_START, group_columns
from offsetlake.keyed import HIDDEN

if TYPE_CHECKING:
    from offsetlake.config import PipelineConfig

# the order key's fields (``engines.order_key``), in the order they compare
ORDER_FIELDS = ("time", "topic", "partition", "epoch", "offset", "row")
# an integer sum's values at or above this go to Spark: a task's sum of them cannot overflow int64
INTEGER_SUM_LIMIT = 2**31
_PICKS = ("first", "last", "last_non_null")
_MICROS = pa.timestamp("us", tz="UTC")


def schema_problem(config: PipelineConfig, rows_schema: pa.Schema) -> str | None:
    """Why the read tasks cannot fold this engine's rows of ``rows_schema`` exactly as Spark
    does (module docstring), or None; asked for an engine pipeline by ``direct.schema_problem``."""
    sink = config.sink
    if not sink.folds_in_read:
        return f"sink.mode {sink.mode}{' with within' if sink.within is not None else ''} merges in Spark"
    for column in sink.key:
        if column not in rows_schema.names:
            return f"key column {column} is not a column of the rows"
        kind = rows_schema.field(column).type
        if pa.types.is_floating(kind) or not _plain(kind):
            return f"key column {column} is {kind}, which Spark groups (floating-point or nested keys)"
    if sink.window is not None:
        on = sink.window.on
        if on not in rows_schema.names or rows_schema.field(on).type != _MICROS:
            return f"window column {on} is not a timestamp the read tasks decode"
    for m in sink.aggregates():
        if m.column == "*":
            continue
        if m.column not in rows_schema.names:
            return f"measure {m.name}'s column {m.column} is not a column of the rows"
        kind = rows_schema.field(m.column).type
        if not _plain(kind) or pa.types.is_decimal(kind) or pa.types.is_date(kind):
            return f"measure {m.name} is over {m.column} of type {kind}, which Spark folds"
    return None


def _plain(kind: pa.DataType) -> bool:
    return bool(
        pa.types.is_integer(kind)
        or pa.types.is_floating(kind)
        or pa.types.is_string(kind)
        or pa.types.is_boolean(kind)
        or pa.types.is_timestamp(kind)
        or pa.types.is_decimal(kind)
        or pa.types.is_date(kind)
    )


@dataclass(frozen=True)
class Measure:
    """An aggregate's measure, as the read tasks need it (plain data, shipped with the job)."""

    name: str
    function: str
    column: str


@dataclass(frozen=True)
class ArrowEngine:
    """One pipeline's engine in Arrow (module docstring): plain data, shipped to the read tasks.
    ``contributions_schema`` and ``states_schema`` are what Spark gives the contribution rows and
    the folded states (``Engine.contributions``, ``Engine.folded``), read from Spark's analysis
    of an empty read, so the files the tasks write are the files Spark would write."""

    mode: str
    key: tuple[str, ...]
    group: tuple[str, ...]
    measures: tuple[Measure, ...]
    window: tuple[str, int, int] | None  # (on, size, slide) in microseconds
    lateness_us: int | None
    contributions_schema: pa.Schema
    states_schema: pa.Schema

    @staticmethod
    def of(config: PipelineConfig, contributions_schema: pa.Schema, states_schema: pa.Schema) -> ArrowEngine:
        from offsetlake.config.sink_settings import duration_seconds

        sink = config.sink
        window = None
        if sink.window is not None:
            window = (sink.window.on, sink.window.size_seconds * 1_000_000, sink.window.slide_seconds * 1_000_000)
        lateness = duration_seconds(sink.allowed_lateness) * 1_000_000 if sink.allowed_lateness is not None else None
        measures = tuple(Measure(m.name, m.function, m.column) for m in sink.aggregates())
        return ArrowEngine(
            mode=str(sink.engine),
            key=tuple(sink.key),
            group=tuple(group_columns(config)),
            measures=measures,
            window=window,
            lateness_us=lateness,
            contributions_schema=contributions_schema,
            states_schema=states_schema,
        )

    # ---- which rows Arrow folds exactly ----------------------------------------------------------
    def exact(self, rows: pa.Table) -> pa.Array:
        """Per row of ``rows`` (the sink rows of settled records, one per record): whether Arrow
        gives it exactly Spark's contributions (module docstring). The others' records go to the
        Spark steps, which decide them as on the Spark path."""
        ok = pc.is_valid(rows.column(TIMESTAMP))
        for column in self.key:
            ok = pc.and_(ok, pc.is_valid(rows.column(column)))
        if self.window is not None:
            on = rows.column(self.window[0])
            ok = pc.and_(ok, pc.fill_null(pc.greater_equal(pc.cast(on, pa.int64()), 0), False))
            if self.lateness_us is not None:
                late_by = pc.subtract(pc.cast(rows.column(TIMESTAMP), pa.int64()), pc.cast(on, pa.int64()))
                ok = pc.and_(ok, pc.fill_null(pc.less_equal(late_by, self.lateness_us), True))
        for m in self.measures:
            if m.column == "*":
                continue
            value = rows.column(m.column)
            if m.function in ("min", "max") and pa.types.is_floating(value.type):
                ok = pc.and_(ok, pc.invert(pc.fill_null(pc.is_nan(value), False)))
            if m.function == "sum" and pa.types.is_integer(value.type):
                wide = pc.cast(value, pa.int64())  # compared, not abs(): abs of int64's least value wraps
                small = pc.and_(pc.less(wide, INTEGER_SUM_LIMIT), pc.greater(wide, -INTEGER_SUM_LIMIT))
                ok = pc.and_(ok, pc.fill_null(small, True))
        return pc.fill_null(ok, False).combine_chunks() if isinstance(ok, pa.ChunkedArray) else ok

    # ---- a record's own state ----------------------------------------------------------------------
    def contributions(self, rows: pa.Table) -> pa.Table:
        """Each row's contribution (``Engine.contributions``): one per window with a sliding
        window; ``rows`` are rows ``exact`` keeps."""
        rows = self._windowed(rows)
        n = rows.num_rows
        ok = self._order_key(rows)
        names = self.contributions_schema.names
        state_type = self.contributions_schema.field(STATE).type
        if self.mode == "aggregate":
            fields = {RECORDS: _ones(n)}
            outputs = {}
            for m in self.measures:
                own = self._measure_own(m, rows, ok)
                fields[m.name] = own
                outputs[m.name] = own.field("v") if m.function in _PICKS else own
        else:  # first_row: the record's value columns, kept whole
            row_type = state_type.field("row").type
            row = _struct([rows.column(f.name) for f in row_type], row_type)
            fields = {RECORDS: _ones(n), "ok": ok, "row": row}
            outputs = {f.name: rows.column(f.name) for f in row_type}
        state = _struct([fields[f.name] for f in state_type], state_type)
        columns: dict[str, Any] = {c: rows.column(c) for c in names if c in rows.column_names}
        columns.update(outputs)
        columns[HIDDEN] = pa.repeat(pa.scalar(CONTRIBUTION, pa.string()), n)
        columns[STATE] = state
        return _table([columns[c] for c in names], self.contributions_schema)

    def _windowed(self, rows: pa.Table) -> pa.Table:
        """``rows`` with WINDOW_START and WINDOW_END: epoch-aligned windows of ``size`` starting
        every ``slide`` that hold the row's ``on`` time, one row per window (``F.window``)."""
        if self.window is None:
            return rows
        on, size, slide = self.window
        at = pc.cast(rows.column(on), pa.int64()).combine_chunks() if rows.num_rows else pa.array([], pa.int64())
        last = pc.subtract(at, _mod(at, slide))
        pieces = []
        for i in range(size // slide):
            start = pc.subtract(last, i * slide)
            piece = rows.append_column(WINDOW_START, pc.cast(start, _MICROS))
            pieces.append(piece.append_column(WINDOW_END, pc.cast(pc.add(start, size), _MICROS)))
        return pa.concat_tables(pieces) if len(pieces) > 1 else pieces[0]

    def _order_key(self, rows: pa.Table) -> pa.StructArray:
        n = rows.num_rows
        epoch = rows.column(TOPIC_EPOCH) if TOPIC_EPOCH in rows.column_names else pa.nulls(n, pa.int32())
        row = rows.column(ROW_INDEX) if ROW_INDEX in rows.column_names else pa.nulls(n, pa.int32())
        arrays = [
            rows.column(TIMESTAMP),
            rows.column(TOPIC),
            rows.column(PARTITION),
            pc.fill_null(pc.cast(epoch, pa.int32()), 0),
            rows.column(OFFSET),
            pc.fill_null(pc.cast(row, pa.int32()), 0),
        ]
        return _struct(arrays, _order_type(self.contributions_schema))

    def _measure_own(self, m: Measure, rows: pa.Table, ok: pa.StructArray) -> Any:
        kind = self.contributions_schema.field(STATE).type.field(m.name).type
        n = rows.num_rows
        if m.function == "count":
            counted = _ones(n) if m.column == "*" else pc.cast(pc.is_valid(rows.column(m.column)), pa.int64())
            return _combined(counted)
        value = _combined(rows.column(m.column))
        if m.function in ("sum", "min", "max"):
            return _combined(pc.cast(value, kind))
        v_type = kind.field("v").type
        picked_ok = ok
        if m.function == "last_non_null":
            picked_ok = _nulled_where(ok, pc.invert(pc.is_valid(value)))
        return _struct([picked_ok, pc.cast(value, v_type)], kind)

    # ---- the fold ------------------------------------------------------------------------------------
    def fold(self, states: pa.Table) -> pa.Table:
        """``states`` (group columns and STATE, of ``contributions_schema`` or ``states_schema``)
        folded per group (``Engine.folded``): one row per group of ``states_schema``."""
        group = list(self.group)
        target = self.states_schema.field(STATE).type
        if states.num_rows == 0:
            return self.states_schema.empty_table()
        # only the group columns are sorted: each row's run (group) is put back in the rows' own
        # order, so the states, the widest columns (order keys with their topic), are never
        # copied into another order (a take of 600,000 states was the largest part of a backfill's fold)
        keys = states.select(group)
        order = pc.sort_indices(keys, sort_keys=[(c, "ascending") for c in group])
        sorted_runs, heads = _runs(keys.take(order), group)
        runs = _in_rows_order(sorted_runs, order)
        state = _combined(states.column(STATE))
        # every sum, min and max in one grouping: the runs are hashed once, not once per measure
        reduced = {RECORDS: (state.field(RECORDS), "sum")}
        if self.mode == "aggregate":
            for m in self.measures:
                if m.function in ("sum", "count", "min", "max"):
                    reduced[m.name] = (state.field(m.name), "sum" if m.function == "count" else m.function)
        fields = _per_run(runs, reduced, len(heads))
        if self.mode == "aggregate":
            for m in self.measures:
                own = state.field(m.name)
                kind = target.field(m.name).type
                if m.name in reduced:
                    fields[m.name] = pc.cast(fields[m.name], kind)
                else:
                    fields[m.name] = _picked(runs, len(heads), own.field("ok"), own.field("v"), m.function != "first", kind)
        else:
            ok, row = state.field("ok"), state.field("row")
            at = _pick_positions(runs, len(heads), ok, last=False)
            fields["ok"] = pc.cast(ok.take(at), target.field("ok").type)
            fields["row"] = pc.cast(row.take(at), target.field("row").type)
        folded = _struct([fields[f.name] for f in target], target)
        keys = keys.take(order.take(heads))  # each group's key, in group order as the runs are
        return _table([*[keys.column(c) for c in group], folded], self.states_schema)


# ``engines.ORDER_TYPE`` as Spark hands it to Arrow (every field nullable)
ORDER_TYPE = pa.struct(
    [
        ("time", _MICROS),
        ("topic", pa.string()),
        ("partition", pa.int32()),
        ("epoch", pa.int32()),
        ("offset", pa.int64()),
        ("row", pa.int32()),
    ]
)


def _order_type(schema: pa.Schema) -> pa.DataType:
    """The order key's struct type as ``schema`` stores it (an aggregate with no "which record"
    measure stores none: then ``ORDER_TYPE``)."""
    for f in schema.field(STATE).type:
        if f.name == "ok":
            return f.type
        if pa.types.is_struct(f.type) and f.type.get_field_index("ok") >= 0:
            return f.type.field("ok").type
    return ORDER_TYPE


def _ones(n: int) -> pa.Array:
    return pa.repeat(pa.scalar(1, pa.int64()), n)


def _combined(array: Any) -> Any:
    return array.combine_chunks() if isinstance(array, pa.ChunkedArray) else array


def _mod(values: pa.Array, by: int) -> pa.Array:
    """``values`` mod ``by`` for values ≥ 0 (what ``exact`` keeps), in integer arithmetic."""
    return pc.subtract(values, pc.multiply(pc.divide(values, by), by))


def _struct(arrays: Sequence[Any], kind: pa.StructType) -> pa.StructArray:
    """A struct array of ``kind`` from its children (cast to the fields' types), never null itself."""
    children = [_combined(pc.cast(a, f.type)) if a.type != f.type else _combined(a) for a, f in zip(arrays, kind, strict=True)]
    return pa.StructArray.from_arrays(children, fields=list(kind))


def _nulled_where(array: pa.StructArray, mask: Any) -> pa.StructArray:
    """``array`` with the rows where ``mask`` holds set to null (their children too)."""
    children = [pc.if_else(mask, pa.scalar(None, f.type), array.field(i)) for i, f in enumerate(array.type)]
    return pa.StructArray.from_arrays(children, fields=list(array.type), mask=_combined(mask))


def _table(columns: Sequence[Any], schema: pa.Schema) -> pa.Table:
    arrays = [_combined(c) if c.type == f.type else _combined(pc.cast(c, f.type)) for c, f in zip(columns, schema, strict=True)]
    return pa.Table.from_arrays(arrays, schema=schema)


def _runs(ordered: pa.Table, group: list[str]) -> tuple[pa.Array, pa.Array]:
    """For rows sorted by ``group``: each row's run number (rows of one group share it) and the
    index of each run's first row. Nulls equal nulls, as Spark groups them."""
    import numpy as np

    n = ordered.num_rows
    change = np.zeros(n, dtype=bool)
    change[0] = True
    for c in group:
        column = _combined(ordered.column(c))
        a, b = column.slice(1), column.slice(0, n - 1)
        differ = pc.fill_null(pc.not_equal(a, b), True)
        both_null = pc.and_(pc.is_null(a), pc.is_null(b))
        change[1:] |= np.asarray(pc.and_(differ, pc.invert(both_null)).to_numpy(zero_copy_only=False), dtype=bool)
    runs = np.cumsum(change) - 1
    return pa.array(runs, pa.int64()), pa.array(np.flatnonzero(change), pa.int64())


def _in_rows_order(sorted_runs: pa.Array, order: pa.Array) -> pa.Array:
    """The run of each row in its own order, from the runs of the rows sorted by ``order``."""
    import numpy as np

    runs = np.empty(len(order), dtype=np.int64)
    runs[np.asarray(order.to_numpy(zero_copy_only=False), dtype=np.int64)] = np.asarray(sorted_runs.to_numpy(), dtype=np.int64)
    return pa.array(runs, pa.int64())


def _per_run(runs: pa.Array, reduced: dict[str, tuple[Any, str]], count: int) -> dict[str, pa.Array]:
    """Each of ``reduced`` (name: values and ``sum``, ``min`` or ``max``) aggregated per run,
    nulls skipped; in run order."""
    names = list(reduced)
    columns = {"run": runs, **{f"v{i}": _combined(reduced[name][0]) for i, name in enumerate(names)}}
    aggregations = [(f"v{i}", reduced[name][1]) for i, name in enumerate(names)]
    grouped = pa.table(columns).group_by("run", use_threads=False).aggregate(aggregations).sort_by("run")
    assert grouped.num_rows == count
    return {name: _combined(grouped.column(f"v{i}_{reduced[name][1]}")) for i, name in enumerate(names)}


def _pick_positions(runs: pa.Array, count: int, ok: pa.StructArray, last: bool) -> pa.Array:
    """Per run, the position of its row with the least (``last``: greatest) non-null order key
    ``ok``; null for a run with none (Spark's ``min_by``/``max_by`` skip a null ordering)."""
    import numpy as np

    valid = np.flatnonzero(np.asarray(pc.is_valid(ok).to_numpy(zero_copy_only=False), dtype=bool))
    at = np.full(count, -1, dtype=np.int64)
    if len(valid):
        positions = pa.array(valid, pa.int64())
        taken = ok if len(valid) == len(ok) else ok.take(positions)  # most often every key is there
        keys = {"run": runs if len(valid) == len(ok) else runs.take(positions), "pos": positions}
        for name in ORDER_FIELDS:
            keys[name] = taken.field(name)
        direction = "descending" if last else "ascending"
        table = pa.table(keys)
        # stable: of two equal order keys the first row wins, as the sort of whole rows had it
        order = pc.sort_indices(table, sort_keys=[("run", "ascending"), *[(name, direction) for name in ORDER_FIELDS]])
        run = table.column("run").take(order).to_numpy()
        first = np.ones(len(run), dtype=bool)
        first[1:] = run[1:] != run[:-1]
        at[run[first]] = table.column("pos").take(order).to_numpy()[first]
    return pa.array(at, pa.int64(), mask=at < 0)


def _picked(runs: pa.Array, count: int, ok: pa.StructArray, value: pa.Array, last: bool, kind: pa.StructType) -> pa.StructArray:
    """A "which record" field folded: the order key and value of each run's first (``last``:
    newest) row with an order key, both null where the run has none."""
    at = _pick_positions(runs, count, ok, last)
    return _struct([ok.take(at), value.take(at)], kind)


def folds_exactly(engine: ArrowEngine, states: pa.Table) -> bool:
    """Whether ``fold`` gives Spark's fold of ``states`` (stored states of the groups a batch
    touches, which Spark may have folded from rows Arrow leaves to it): ``exact_states`` holds
    for every row."""
    return states.num_rows == 0 or bool(pc.all(exact_states(engine, states)).as_py())


def exact_states(engine: ArrowEngine, states: pa.Table) -> pa.Array:
    """Per row of ``states`` (group columns and STATE, folded or of one contribution): whether
    Arrow folds it as Spark does: no NaN in a ``min`` or ``max``, no integer sum whose addition
    could overflow, no order key with a null field."""
    n = states.num_rows
    state = _combined(states.column(STATE))
    ok = pa.array([True] * n, pa.bool_()) if n else pa.array([], pa.bool_())
    keys: list[Any] = []
    if engine.mode == "first_row":
        keys.append(state.field("ok"))
    for m in engine.measures:
        own = state.field(m.name)
        if m.function in _PICKS:
            keys.append(own.field("ok"))
        elif m.function in ("min", "max") and pa.types.is_floating(own.type):
            ok = pc.and_(ok, pc.invert(pc.fill_null(pc.is_nan(own), False)))
        elif m.function == "sum" and pa.types.is_integer(own.type):
            ok = pc.and_(ok, pc.fill_null(pc.less(pc.abs(pc.cast(own, pa.float64())), 2.0**62), True))
    for key in keys:
        whole = pc.is_valid(key)
        for name in ORDER_FIELDS:
            whole = pc.and_(whole, pc.is_valid(key.field(name)))
        ok = pc.and_(ok, pc.or_(pc.invert(pc.is_valid(key)), whole))
    return _combined(ok)


def reads(engine: ArrowEngine, schema: pa.Schema) -> bool:
    """Whether rows of ``schema`` (a state table's files) hold the state ``engine`` folds: the same
    fields, by name, at every depth (a field the pipeline's records dropped would not cast)."""

    def names(kind: pa.DataType) -> Any:
        return [(f.name, names(f.type)) for f in kind] if pa.types.is_struct(kind) else None

    return STATE in schema.names and names(schema.field(STATE).type) == names(engine.states_schema.field(STATE).type)


@dataclass(frozen=True)
class StatesFolded:
    """How a Spark task reading a state table's contribution files hands their states on
    (``staging.read_files``' ``reduce``): the rows outside ``replaced`` (a backfill's records),
    as group columns and STATE, folded per group in Arrow where that is exact
    (``exact_states``), the others as they are. What Spark folds of them is then the fold of
    every row, read by a few rows per group per task instead of one per contribution."""

    engine: ArrowEngine
    replaced: Any = None  # coordinates.Selection

    FOLD_AT: ClassVar[int] = 200_000  # rows held before they are folded into one per group

    def __call__(self, parts: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        group = [*self.engine.group, STATE]
        out = self.engine.states_schema
        inside = self.replaced.arrow() if self.replaced is not None else None
        held: list[pa.Table] = []
        rows = 0
        for part in parts:
            table = pa.Table.from_batches([part])
            if inside is not None:
                table = table.filter(pc.invert(pc.coalesce(inside, pa.scalar(False))))
            states = table.select(group)
            exact = exact_states(self.engine, states)
            raw = states.filter(pc.invert(exact))
            if raw.num_rows:
                yield from raw.cast(out).to_batches()
            folded = self.engine.fold(states.filter(exact))
            held.append(folded)
            rows += folded.num_rows
            if rows >= self.FOLD_AT and len(held) > 1:
                held = [self.engine.fold(pa.concat_tables(held))]
                rows = held[0].num_rows
        if held:
            yield from (held[0] if len(held) == 1 else self.engine.fold(pa.concat_tables(held))).to_batches()


def visible(engine: ArrowEngine, folded: pa.Table, shape: pa.Schema, hidden: str | None = None) -> pa.Table:
    """Folded states (``states_schema``) as visible rows in the contribution rows' columns
    (``Engine.visible_rows`` shaped as ``engine_merge._shaped`` shapes them: coordinates null,
    ``HIDDEN`` null, each output from its state), of ``shape``; ``hidden``: HIDDEN's value instead
    (``CONTRIBUTION``: a fold's rows, which stand for the contributions they fold)."""
    n = folded.num_rows
    state = _combined(folded.column(STATE))
    outputs: dict[str, Any] = {}
    if engine.mode == "aggregate":
        for m in engine.measures:
            own = state.field(m.name)
            outputs[m.name] = own.field("v") if m.function in _PICKS else own
    else:
        row = state.field("row")
        outputs = {f.name: row.field(f.name) for f in row.type}
    columns = []
    for f in shape:
        if f.name == STATE:
            columns.append(state)
        elif f.name in engine.group:
            columns.append(folded.column(f.name))
        elif f.name in outputs:
            columns.append(outputs[f.name])
        elif f.name == HIDDEN and hidden is not None:
            columns.append(pa.array([hidden] * n, f.type))
        else:  # HIDDEN and the coordinates: null on a visible row
            columns.append(pa.nulls(n, f.type))
    return _table(columns, shape)
