"""Kafka coordinates on rows, and "the rows of these records" in every language we speak.

Invariant 6: every sink row and dead letter carries the coordinates of the record it came from
(``_kafka_topic``, ``_kafka_partition``, ``_kafka_offset``, ``_kafka_timestamp``). A backfill
replaces exactly the rows of the records it reprocesses, a batch's dead letters replace exactly
those of its records, and an audit checks rows against committed ranges: each asks the same
question — which rows came from the records of these offset ranges (and, for a backfill by
time, whose record timestamps fall in its window)? — so a ``Selection`` answers it here once per
engine: an Arrow filter for pyarrow datasets, a Spark column, and the file-statistics test that
says which data files may hold such rows.

Invariant 16: offsets name records only within one epoch of their topic (a topic deleted and
re-created starts a new epoch, ``offsetlake topic reset-epoch``), and the sink keeps the rows of
earlier epochs. So a row of a topic in epoch 1 or later carries its epoch as data
(``TOPIC_EPOCH``, ``_offsetlake_epoch``; null or absent = epoch 0), whatever compaction or a
rewrite did to the files, and a ``Selection`` planned for a topic's current epoch selects only
that epoch's rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from offsetlake.entry import LedgerEntry
from offsetlake.file_stats import may_hold_between
from offsetlake.plan import BatchPlan, OffsetRange, RecordTimeWindow

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

TOPIC, PARTITION, OFFSET, TIMESTAMP = "_kafka_topic", "_kafka_partition", "_kafka_offset", "_kafka_timestamp"
COORDINATE_COLUMNS = (TOPIC, PARTITION, OFFSET, TIMESTAMP)
RECORD_KEY = (TOPIC, PARTITION, OFFSET)  # what identifies the source record of a row
# With a transform, a record may become several rows (explode): each row's index among its
# record's rows, so (record, index) identifies a row and a record written twice shows as duplicates.
ROW_INDEX = "_kafka_row"
# The epoch of its topic a row's record belongs to (module docstring): an int, null for epoch 0,
# so the rows of a pipeline whose topics were never re-created carry nothing new.
TOPIC_EPOCH = "_offsetlake_epoch"
TOPIC_EPOCH_TYPE = pa.int32()
_MICROS = pa.timestamp("us", tz="UTC")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)


@dataclass(frozen=True)
class Selection:
    """The rows whose source records lie in ``ranges`` and, with a ``window``, whose record
    timestamps fall in it (a row without a timestamp is then never selected); of a topic that
    ``epochs`` gives an epoch of 1 or more, only the rows of that epoch (``TOPIC_EPOCH``)."""

    ranges: tuple[OffsetRange, ...]
    window: RecordTimeWindow | None = None
    epochs: Mapping[str, int] = field(default_factory=dict)  # topic -> its current epoch (absent: 0)

    @staticmethod
    def of(plan: BatchPlan) -> Selection:
        return Selection(tuple(plan.ranges), plan.window, dict(plan.topic_epochs))

    @staticmethod
    def of_entry(entry: LedgerEntry) -> Selection:
        """The selection a ledger entry (``offsetlake.entry``) records, by offsets (and window)
        alone: the dead-letter table has no epoch column; it tells the epochs of its rows apart by
        the batch that wrote them (``offsetlake.dead_letters``)."""
        return Selection(entry.offset_ranges, entry.record_time)

    @property
    def sized(self) -> list[OffsetRange]:
        return [r for r in self.ranges if r.size > 0]

    def _epoch(self, topic: str) -> int:
        return int(self.epochs.get(topic, 0))

    def arrow(self) -> pc.Expression | None:
        """pyarrow dataset filter for the selected rows; None when no range holds an offset.
        A range of a topic in epoch 1 or later also needs ``TOPIC_EPOCH`` equal to that epoch
        (the sink has the column from the topic's first epoch commit on)."""
        expression = None
        for r in self.sized:
            term = (
                (pc.field(TOPIC) == r.topic)
                & (pc.field(PARTITION) == r.partition)
                & (pc.field(OFFSET) >= r.start)
                & (pc.field(OFFSET) < r.end)
            )
            if self._epoch(r.topic):
                term = term & (pc.field(TOPIC_EPOCH) == pa.scalar(self._epoch(r.topic), TOPIC_EPOCH_TYPE))
            expression = term if expression is None else expression | term
        if expression is not None and self.window is not None:
            expression = expression & (
                (pc.field(TIMESTAMP) >= pa.scalar(self.window.from_ms * 1000, _MICROS))
                & (pc.field(TIMESTAMP) < pa.scalar(self.window.to_ms * 1000, _MICROS))
            )
        return expression

    def outside(self) -> pc.Expression | None:
        """pyarrow filter for the rows NOT selected (rows without a timestamp included, and rows
        of an earlier epoch: their null epoch makes the inside test null, not false)."""
        inside = self.arrow()
        if inside is None:
            return None
        return ~pc.coalesce(inside, pa.scalar(False)) if (self.window is not None or self.epochs) else ~inside

    def spark(self) -> Column:
        """Spark column that is true for the selected rows (false for none)."""
        from pyspark.sql import functions as F

        condition = F.lit(False)
        for r in self.sized:
            term = (F.col(TOPIC) == r.topic) & (F.col(PARTITION) == r.partition) & (F.col(OFFSET) >= r.start) & (F.col(OFFSET) < r.end)
            if self._epoch(r.topic):
                term = term & F.coalesce(F.col(TOPIC_EPOCH) == F.lit(self._epoch(r.topic)), F.lit(False))
            condition = condition | term
        if self.window is not None:
            condition = condition & F.coalesce(
                (F.col(TIMESTAMP) >= F.timestamp_millis(F.lit(self.window.from_ms)))
                & (F.col(TIMESTAMP) < F.timestamp_millis(F.lit(self.window.to_ms))),
                F.lit(False),
            )
        return condition

    def file_may_hold(self, stats: Mapping[str, Any]) -> bool:
        """Whether a data file whose statistics are ``stats`` may hold selected rows.

        ``stats`` is one row of ``DeltaTable.get_add_actions(flatten=True)`` (``min._kafka_offset``
        ...), read by ``offsetlake.file_stats``, which widens what statistics lose (a topic name
        cut to a prefix, a timestamp kept in milliseconds). A file without statistics may hold
        anything, so it counts as a hit: a backfill that skipped it would leave the old rows of
        its range next to the new ones (invariant 6). With a window, a file whose timestamps all
        lie outside it holds none; a file whose ``TOPIC_EPOCH`` statistics exclude a range's
        epoch holds none of that range.
        """
        sized = self.sized
        if self.window is not None:
            first, end = _instant(self.window.from_ms), _instant(self.window.to_ms)
            if first is not None and end is not None and not may_hold_between(stats, TIMESTAMP, first, end - _MICROSECOND):
                return False
        return any(
            may_hold_between(stats, TOPIC, r.topic, r.topic)
            and may_hold_between(stats, PARTITION, r.partition, r.partition)
            and may_hold_between(stats, OFFSET, r.start, r.end - 1)
            and (not self._epoch(r.topic) or may_hold_between(stats, TOPIC_EPOCH, self._epoch(r.topic), self._epoch(r.topic)))
            for r in sized
        )


def with_topic_epochs(rows: DataFrame, epochs: Mapping[str, int]) -> DataFrame:
    """``rows`` with ``TOPIC_EPOCH``: each row's topic's epoch from ``epochs`` (null for a topic
    absent from it: epoch 0). Unchanged when ``epochs`` is empty: a pipeline none of whose
    topics was ever re-created writes no such column (invariant 16, module docstring)."""
    from pyspark.sql import functions as F

    if not epochs:
        return rows
    value = F.lit(None).cast("int")
    for topic, epoch in sorted(epochs.items()):
        value = F.when(F.col(TOPIC) == topic, F.lit(int(epoch))).otherwise(value)
    return rows.withColumn(TOPIC_EPOCH, value.cast("int"))


def topic_epoch_array(topic: str, rows: int, epochs: Mapping[str, int]) -> pa.Array:
    """``TOPIC_EPOCH`` for ``rows`` rows of ``topic`` (what ``with_topic_epochs`` gives them)."""
    return pa.array([epochs.get(topic)] * rows, TOPIC_EPOCH_TYPE)


def _instant(ms: int) -> datetime | None:
    """Milliseconds since the epoch as a UTC datetime; None beyond the years Python's datetime
    holds (a record's timestamp may be there: such a window does not prune)."""
    try:
        return _EPOCH + timedelta(milliseconds=ms)
    except OverflowError:
        return None


def selection(ranges: Iterable[OffsetRange], window: RecordTimeWindow | None = None) -> Selection:
    return Selection(tuple(ranges), window)
