"""Routes: one pipeline file's rows into several sink tables, chosen per row (``routes:``).

Each table of a routed file is a pipeline of its own, ``<file>_<table>`` (``config.loading``):
its own sink table, txns, ledger entries, dead letters, leases and Airflow DAGs, so invariants
2-4 and 10 hold per table unchanged, and a crash between two tables' commits leaves each one
with the batch or without it (the other table's next batch completes it from its own committed
end). Routing by ``topic`` is settled at load: each table reads only its topics. Routing by a
column happens here, after the transform and before validation: each table keeps the rows whose
value it maps; the *owner* (the unmapped table, else the first one listed) also takes what no
table maps (as rows if it is the unmapped table, else as dead letters coded ``unrouted``) and
the records that do not decode. So every record read is, in exactly one table, a row or a dead
letter, or (as before) filtered by the transform.

Values compare as text (Spark's cast of the column to string). A keyed sink's delete whose value
is null (a tombstone carries none) goes to every table: the key's row may be in any of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from offsetlake.config import PipelineConfig
from offsetlake.config.models import UNMAPPED_DEAD_LETTER
from offsetlake.errors import ConfigError
from offsetlake.formats import CHANGE, DELETE
from offsetlake.formats import reasons as dead_letter_reasons

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame


def owns_the_rest(config: PipelineConfig) -> bool:
    """Whether this table's pipeline dead-letters what no table takes: records that do not
    decode (every table reads them) and, routing by a column, rows whose value no table maps.
    True for a pipeline without routes, and for each table of a topic route (it alone reads its
    topics)."""
    if not config.routed_by_column:
        return True
    assert config.routes is not None
    return config.route == config.routes.owner


def may_dead_letter_rows(config: PipelineConfig) -> bool:
    """Whether this table makes dead letters of rows that decoded well (those no table maps): the
    owner of ``unmapped: dead_letter``, which must keep their records' bytes."""
    return (
        config.routed_by_column and owns_the_rest(config) and config.routes is not None and config.routes.unmapped == UNMAPPED_DEAD_LETTER
    )


def rows_of_route(config: PipelineConfig, rows: DataFrame) -> DataFrame:
    """The rows this table takes: those whose value it maps, a keyed sink's deletes without a
    value, and for the owner those whose value no table maps (rows of the unmapped table, or
    future dead letters: ``unrouted_reason``). ``rows`` unchanged when not routed by a column.

    Raises ConfigError (naming the pipeline and the column) when the rows have no such column."""
    if not config.routed_by_column:
        return rows
    return rows.where(_kept(config, rows))


def rows_written(config: PipelineConfig, rows: DataFrame) -> DataFrame:
    """The rows this table writes as rows: ``rows_of_route`` without those its owner makes dead
    letters (``unrouted_reason``); what an audit replays."""
    kept = rows_of_route(config, rows)
    unrouted = unrouted_reason(config, kept)
    return kept if unrouted is None else kept.where(unrouted.isNull())


def unrouted_reason(config: PipelineConfig, rows: DataFrame) -> Column | None:
    """For the owner of ``unmapped: dead_letter``: the dead-letter reason of a row whose value no
    table maps (null for every other row); None when this table dead-letters no row for routing."""
    from pyspark.sql import functions as F

    if not config.routed_by_column or not owns_the_rest(config):
        return None
    assert config.routes is not None
    if config.routes.unmapped != UNMAPPED_DEAD_LETTER:
        return None
    column = config.routes.by
    value = _value(config, rows)
    unmapped = _unmapped(config, value)
    if CHANGE in rows.columns:
        unmapped = unmapped & ~(value.isNull() & (F.col(CHANGE) == DELETE))
    tables = ", ".join(config.routes.tables)
    return F.when(
        unmapped,
        dead_letter_reasons.coded(
            "unrouted",
            F.concat(
                F.lit(f"column '{column}' is "),
                F.coalesce(F.concat(F.lit("'"), value, F.lit("'")), F.lit("null")),
                F.lit(f", which routes: maps to none of its tables ({tables}) and unmapped is dead_letter"),
            ),
        ),
    )


def _kept(config: PipelineConfig, rows: DataFrame) -> Column:
    from pyspark.sql import functions as F

    assert config.routes is not None and config.route is not None
    value = _value(config, rows)
    mine = config.routes.tables[config.route]
    keep = F.coalesce(value.isin(mine), F.lit(False)) if mine else F.lit(False)
    if owns_the_rest(config):
        keep = keep | _unmapped(config, value)
    if CHANGE in rows.columns:
        keep = keep | (value.isNull() & (F.col(CHANGE) == DELETE))
    return keep


def _unmapped(config: PipelineConfig, value: Column) -> Column:
    from pyspark.sql import functions as F

    assert config.routes is not None
    mapped = [v for values in config.routes.tables.values() for v in values]
    return F.coalesce(~value.isin(mapped), F.lit(True)) if mapped else F.lit(True)


def _value(config: PipelineConfig, rows: DataFrame) -> Column:
    from pyspark.sql import functions as F

    assert config.routes is not None
    column = config.routes.by
    if column not in rows.columns:
        raise ConfigError(
            f"routes.by: the rows have no column '{column}' (they have {', '.join(c for c in rows.columns if not c.startswith('_'))})",
            pipeline=config.name,
            field="routes.by",
        )
    return F.col(f"`{column}`").cast("string")


# ---- the same rule in the read tasks (the direct path, ``offsetlake.direct``) ---------------------
# Types whose text in Arrow is Spark's cast to string: the value itself, or an integer's digits.
# Any other type (a double's "1.0" against Arrow's "1", a timestamp's format) is routed in Spark.
_TEXT_AS_SPARK = (pa.types.is_string, pa.types.is_large_string, pa.types.is_integer)


@dataclass(frozen=True)
class ReadTaskRoute:
    """What one table of a route by a column keeps of the rows a read task settled: ``_kept``'s
    rule in Arrow, shipped to the tasks. The rows its owner makes dead letters (``unrouted``) go
    to the Spark steps with the undecided records, which dead-letter them by ``unrouted_reason``."""

    column: str
    mine: tuple[str, ...]
    mapped: tuple[str, ...]
    owner: bool
    unrouted_are_dead_letters: bool

    def masks(self, rows: pa.Table) -> tuple[pa.ChunkedArray, pa.ChunkedArray]:
        """(the rows this table writes, the rows left to the Spark steps) of ``rows``."""
        value = pc.cast(rows.column(self.column), pa.string())
        mine = pc.fill_null(pc.is_in(value, value_set=pa.array(self.mine, pa.string())), False)
        unmapped = pc.invert(pc.fill_null(pc.is_in(value, value_set=pa.array(self.mapped, pa.string())), False))
        nothing = pc.and_(mine, pc.invert(mine))  # all false, of the rows' length
        if not self.owner:
            return mine, nothing
        if self.unrouted_are_dead_letters:
            return mine, unmapped
        return pc.or_(mine, unmapped), nothing


def read_task_route(config: PipelineConfig) -> ReadTaskRoute | None:
    """The rule the read tasks apply for this table, or None when its rows are not routed by a
    column (every settled row is the table's)."""
    if not config.routed_by_column:
        return None
    assert config.routes is not None and config.route is not None
    return ReadTaskRoute(
        column=config.routes.by,
        mine=tuple(config.routes.tables[config.route]),
        mapped=tuple(v for values in config.routes.tables.values() for v in values),
        owner=owns_the_rest(config),
        unrouted_are_dead_letters=config.routes.unmapped == UNMAPPED_DEAD_LETTER,
    )


def read_task_problem(config: PipelineConfig, rows_schema: pa.Schema) -> str | None:
    """Why the read tasks cannot route this table's rows as Spark would, or None."""
    if not config.routed_by_column:
        return None
    assert config.routes is not None
    column = config.routes.by
    if column not in rows_schema.names:
        return f"route column {column} is not a column of the rows"
    kind = rows_schema.field(column).type
    if not any(test(kind) for test in _TEXT_AS_SPARK):
        return f"route column {column} is {kind}, whose text is Spark's cast to string (routed in Spark)"
    return None
