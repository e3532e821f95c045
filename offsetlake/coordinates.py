"""Kafka coordinates on rows, and "the rows of these records" in every language we speak.

Invariant 6: every sink row and dead letter carries the coordinates of the record it came from
(``_kafka_topic``, ``_kafka_partition``, ``_kafka_offset``, ``_kafka_timestamp``). A backfill
replaces exactly the rows of the records it reprocesses, a batch's dead letters replace exactly
those of its records, and an audit checks rows against committed ranges: each asks the same
question — which rows came from the records of these offset ranges (and, for a backfill by
time, whose record timestamps fall in its window)? — so a ``Selection`` answers it here once per
engine: an Arrow filter for pyarrow datasets, a Spark column, and the file-statistics test that
says which data files may hold such rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from offsetlake.plan import BatchPlan, OffsetRange, RecordTimeWindow

if TYPE_CHECKING:
    from pyspark.sql import Column

TOPIC, PARTITION, OFFSET, TIMESTAMP = "_kafka_topic", "_kafka_partition", "_kafka_offset", "_kafka_timestamp"
COORDINATE_COLUMNS = (TOPIC, PARTITION, OFFSET, TIMESTAMP)
RECORD_KEY = (TOPIC, PARTITION, OFFSET)  # what identifies the source record of a row
# With a transform, a record may become several rows (explode): each row's index among its
# record's rows, so (record, index) identifies a row and a record written twice shows as duplicates.
ROW_INDEX = "_kafka_row"
_MICROS = pa.timestamp("us", tz="UTC")


@dataclass(frozen=True)
class Selection:
    """The rows whose source records lie in ``ranges`` and, with a ``window``, whose record
    timestamps fall in it (a row without a timestamp is then never selected)."""

    ranges: tuple[OffsetRange, ...]
    window: RecordTimeWindow | None = None

    @staticmethod
    def of(plan: BatchPlan) -> Selection:
        return Selection(tuple(plan.ranges), plan.window)

    @staticmethod
    def of_entry(entry: Mapping[str, Any]) -> Selection:
        """The selection a ledger entry (``offsetlake.history.ledger_entry``) records."""
        ranges = tuple(OffsetRange(r["topic"], r["partition"], r["start"], r["end"]) for r in entry.get("ranges", []))
        time = entry.get("record_time")
        return Selection(ranges, RecordTimeWindow(int(time["from_ms"]), int(time["to_ms"])) if time else None)

    @property
    def sized(self) -> list[OffsetRange]:
        return [r for r in self.ranges if r.size > 0]

    def arrow(self) -> pc.Expression | None:
        """pyarrow dataset filter for the selected rows; None when no range holds an offset."""
        expression = None
        for r in self.sized:
            term = (
                (pc.field(TOPIC) == r.topic) & (pc.field(PARTITION) == r.partition)
                & (pc.field(OFFSET) >= r.start) & (pc.field(OFFSET) < r.end)
            )
            expression = term if expression is None else expression | term
        if expression is not None and self.window is not None:
            expression = expression & (
                (pc.field(TIMESTAMP) >= pa.scalar(self.window.from_ms * 1000, _MICROS))
                & (pc.field(TIMESTAMP) < pa.scalar(self.window.to_ms * 1000, _MICROS))
            )
        return expression

    def outside(self) -> pc.Expression | None:
        """pyarrow filter for the rows NOT selected (rows without a timestamp included)."""
        inside = self.arrow()
        if inside is None:
            return None
        return ~inside if self.window is None else (~inside | pc.field(TIMESTAMP).is_null())

    def spark(self) -> Column:
        """Spark column that is true for the selected rows (false for none)."""
        from pyspark.sql import functions as F

        condition = F.lit(False)
        for r in self.sized:
            condition = condition | (
                (F.col(TOPIC) == r.topic) & (F.col(PARTITION) == r.partition)
                & (F.col(OFFSET) >= r.start) & (F.col(OFFSET) < r.end)
            )
        if self.window is not None:
            condition = condition & F.coalesce(
                (F.col(TIMESTAMP) >= F.timestamp_millis(F.lit(self.window.from_ms)))
                & (F.col(TIMESTAMP) < F.timestamp_millis(F.lit(self.window.to_ms))), F.lit(False))
        return condition

    def file_may_hold(self, stats: Mapping[str, Any]) -> bool:
        """Whether a data file whose min/max statistics are ``stats`` may hold selected rows.

        ``stats`` is one row of ``DeltaTable.get_add_actions(flatten=True)`` (``min._kafka_offset``
        ...). A file without statistics may hold anything, so it counts as a hit: a backfill that
        skipped it would leave the old rows of its range next to the new ones. Topic statistics are
        not used: string statistics may be truncated prefixes, and a wrong "no" here duplicates
        rows. With a window, a file whose timestamps all lie outside it holds none.
        """
        sized = self.sized
        low_p, high_p = stats.get(f"min.{PARTITION}"), stats.get(f"max.{PARTITION}")
        low_o, high_o = stats.get(f"min.{OFFSET}"), stats.get(f"max.{OFFSET}")
        if low_p is None or high_p is None or low_o is None or high_o is None:
            return bool(sized)
        if not any(low_p <= r.partition <= high_p and low_o < r.end and high_o >= r.start for r in sized):
            return False
        if self.window is not None:
            low_t, high_t = _millis(stats.get(f"min.{TIMESTAMP}")), _millis(stats.get(f"max.{TIMESTAMP}"))
            if low_t is not None and high_t is not None and (high_t < self.window.from_ms or low_t >= self.window.to_ms):
                return False
        return True


def _millis(value: Any) -> int | None:
    if isinstance(value, datetime):
        return int(value.timestamp() * 1000)
    return None


def selection(ranges: Iterable[OffsetRange], window: RecordTimeWindow | None = None) -> Selection:
    return Selection(tuple(ranges), window)
