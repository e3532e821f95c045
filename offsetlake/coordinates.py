"""Kafka coordinates on rows, and "the rows inside these ranges" in every language we speak.

Invariant 6: every sink row and dead letter carries the coordinates of the record it came from
(``_kafka_topic``, ``_kafka_partition``, ``_kafka_offset``, ``_kafka_timestamp``). A backfill
replaces exactly the rows inside its ranges, a dead-letter write replaces exactly its batch's
ranges, and an audit checks rows against committed ranges: each asks the same question, so it is
written here once per engine — SQL for delta-rs, Arrow for pyarrow datasets, Spark columns —
plus the file-statistics test that says which data files may hold such rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import pyarrow.compute as pc

from offsetlake.plan import OffsetRange

if TYPE_CHECKING:
    from pyspark.sql import Column

TOPIC, PARTITION, OFFSET, TIMESTAMP = "_kafka_topic", "_kafka_partition", "_kafka_offset", "_kafka_timestamp"
COORDINATE_COLUMNS = (TOPIC, PARTITION, OFFSET, TIMESTAMP)
RECORD_KEY = (TOPIC, PARTITION, OFFSET)  # what identifies the source record of a row


def _sized(ranges: Iterable[OffsetRange]) -> list[OffsetRange]:
    return [r for r in ranges if r.size > 0]


def _sql_text(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def ranges_sql(ranges: Iterable[OffsetRange]) -> str:
    """delta-rs SQL predicate selecting rows whose coordinates fall in ``ranges`` ("" for none)."""
    return " OR ".join(
        f"({TOPIC} = {_sql_text(r.topic)} AND {PARTITION} = {r.partition} "
        f"AND {OFFSET} >= {r.start} AND {OFFSET} < {r.end})"
        for r in _sized(ranges)
    )


def ranges_arrow(ranges: Iterable[OffsetRange]) -> pc.Expression | None:
    """pyarrow dataset filter selecting rows inside ``ranges``; None when every range is empty."""
    expression = None
    for r in _sized(ranges):
        term = (
            (pc.field(TOPIC) == r.topic) & (pc.field(PARTITION) == r.partition)
            & (pc.field(OFFSET) >= r.start) & (pc.field(OFFSET) < r.end)
        )
        expression = term if expression is None else expression | term
    return expression


def ranges_spark(ranges: Iterable[OffsetRange]) -> Column:
    """Spark column that is true for rows inside ``ranges`` (false for none)."""
    from pyspark.sql import functions as F

    condition = F.lit(False)
    for r in _sized(ranges):
        condition = condition | (
            (F.col(TOPIC) == r.topic) & (F.col(PARTITION) == r.partition)
            & (F.col(OFFSET) >= r.start) & (F.col(OFFSET) < r.end)
        )
    return condition


def file_may_hold(stats: Mapping[str, Any], ranges: Iterable[OffsetRange]) -> bool:
    """Whether a data file whose min/max statistics are ``stats`` may hold rows inside ``ranges``.

    ``stats`` is one row of ``DeltaTable.get_add_actions(flatten=True)`` (``min._kafka_offset``
    ...). A file without statistics may hold anything, so it counts as a hit: a backfill that
    skipped it would leave the old rows of its range next to the new ones. Topic statistics are
    not used: string statistics may be truncated prefixes, and a wrong "no" here duplicates rows.
    """
    low_p, high_p = stats.get(f"min.{PARTITION}"), stats.get(f"max.{PARTITION}")
    low_o, high_o = stats.get(f"min.{OFFSET}"), stats.get(f"max.{OFFSET}")
    sized = _sized(ranges)
    if low_p is None or high_p is None or low_o is None or high_o is None:
        return bool(sized)
    return any(low_p <= r.partition <= high_p and low_o < r.end and high_o >= r.start for r in sized)
