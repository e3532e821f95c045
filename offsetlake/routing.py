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

from typing import TYPE_CHECKING

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
