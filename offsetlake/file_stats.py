"""Delta file statistics: what a data file's min/max say, as offsetlake writes them and as every
reader must read them.

Statistics let a reader skip data files: a keyed merge rewrites only the files that may hold the
batch's keys (``keyed.files_holding``), a backfill, rewind or dead-letter replacement only the
files that may hold its ranges' rows (``coordinates.Selection.file_may_hold``). A wrong "may
hold" costs one file read; a wrong "cannot hold" is a duplicate row, a missed delete or a record
written twice (issue 35, finding 2: exactly once, invariant 1, and keyed sinks converge, 13). So
every reader asks here, and each lossy statistic is widened here to every value it may stand for:

- **timestamps**: the Delta protocol keeps them in milliseconds (delta-rs#4659, kernel-rs#2249);
  ``delta_stats`` truncates like Spark and delta-rs do, so a bound stands for its whole
  millisecond: the max ``…00.123`` admits ``…00.123999``. The min is widened the same way, for
  writers that truncate a negative (pre-1970) value toward zero. delta-rs's own pyarrow dataset
  widens the max by 1 ms too.
- **strings**: a writer may cut a long max to a prefix (Delta Spark keeps 32 characters, then
  appends a tie-breaker character, U+FFFF in Java's UTF-16 order, which is not the top in code
  point order): a value starting with the max, or with the max less a last character >= U+FFFD,
  is admitted. And deltalake 1.6.6 reads an escaped character from U+20000 up as one 0x10000
  lower (``delta_stats`` writes UTF-8 since, but older files keep their statistics): a value
  starting with what precedes the max's first character beyond U+FFFF is admitted too. A cut or
  misread min is below the real min already.
- **floats**: parquet leaves NaN out of min/max, so a NaN value may be in any file; a NaN bound
  says nothing.
- **decimals or integers under float statistics** (a reader that parsed them as doubles): compared
  as floats, whose rounding keeps order (``a <= b`` gives ``float(a) <= float(b)``).
- **anything else that does not compare** with the values asked about: says nothing, so admits.

Partition values are exact (the protocol stores them as text in full) and are not widened. A
file without a bound for the column may hold anything.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from offsetlake import json_text
from offsetlake.json_text import is_finite_number

_STAT_TYPES = (
    pa.types.is_integer,
    pa.types.is_floating,
    pa.types.is_date,
    pa.types.is_timestamp,
    pa.types.is_string,
    pa.types.is_boolean,
)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)
_MILLISECOND_SLACK = 999  # µs: a timestamp bound of millisecond precision stands for [b, b + 1 ms)
# A string max may end in a tie-breaker character after its cut (Delta Spark appends U+FFFF; a cut
# inside a surrogate pair reads back as U+FFFD): values starting with what precedes it are admitted.
_TIE_BREAKER_FROM = "\ufffd"
# What comparing statistics with values of another type raises (a str bound as a float, an integer
# beyond a double): such statistics say nothing.
_INCOMPARABLE = (TypeError, ValueError, OverflowError)


# ---- writing -----------------------------------------------------------------------------------
def delta_stats(metadata: pq.FileMetaData) -> str:
    """Delta file statistics from the parquet footer (numRecords, nullCount, min/max), as the
    JSON text of an ``add`` action's ``stats``.

    Only top-level columns of simple types get statistics, found by their parquet leaf path (a
    nested column before them has several leaves, so arrow field positions are not leaf
    positions: reading by position gave ``_kafka_offset`` another column's statistics).
    Timestamps are written in milliseconds, truncated, as the protocol has them (readers widen
    them: ``may_hold_any``). Text is written as UTF-8, not as ``\\u`` escapes: deltalake 1.6.6
    reads the escaped surrogate pair of a character from U+20000 up as a character 0x10000 lower
    (seen here: U+20000 read back as U+10000), which made a string max lower than the file's
    largest value.

    When any such column holds values whose bounds cannot be stated, the file gets no column
    statistics at all, only ``numRecords``: an infinite bound (not JSON: written as ``Infinity``
    it made the Delta log unreadable, issue 48, finding 1), a column of NaNs only (parquet
    leaves NaN out of min/max), incomplete footer statistics, a value Python's datetime cannot
    hold. Leaving out just that column is not enough: deltalake 1.6's pyarrow dataset reads a
    simple column missing from a file's statistics, beside columns that have them, as all null,
    and prunes the file for any filter on it (seen here: ``amount > 0`` matched none of a file's
    rows once its ``amount`` bounds were left out, or written as null the way delta-rs writes
    them itself). A file without statistics is read whole by every reader.
    """
    arrow_schema = metadata.schema.to_arrow_schema()
    leaves = {metadata.schema.column(i).path: i for i in range(metadata.num_columns)}
    mins: dict = {}
    maxs: dict = {}
    nulls: dict = {}
    for column in arrow_schema:
        index = leaves.get(column.name)
        if index is None or not any(check(column.type) for check in _STAT_TYPES):
            continue
        try:
            null_count, low, high = _column_stats(metadata, index)
        except (OverflowError, ValueError, TypeError):
            return _records_only(metadata)
        if null_count is None:
            return _records_only(metadata)
        # Every column with values needs min and max (the delta-rs pruning above)
        if low is None:
            if null_count < metadata.num_rows:
                return _records_only(metadata)
        elif not (is_finite_number(low) and is_finite_number(high)):
            return _records_only(metadata)
        else:
            mins[column.name], maxs[column.name] = _stat_value(low), _stat_value(high)
        nulls[column.name] = null_count
    stats = {"numRecords": metadata.num_rows, "minValues": mins, "maxValues": maxs, "nullCount": nulls}
    return json_text.dumps(stats, ensure_ascii=False)


def _records_only(metadata: pq.FileMetaData) -> str:
    """The statistics of a file whose column bounds cannot all be stated (``delta_stats``)."""
    return json_text.dumps({"numRecords": metadata.num_rows})


def _column_stats(metadata: pq.FileMetaData, index: int) -> tuple[int | None, Any, Any]:
    """(null count, min, max) of one leaf column over all row groups; null count None if unknown."""
    null_count = 0
    low = high = None
    for rg in range(metadata.num_row_groups):
        stats = metadata.row_group(rg).column(index).statistics
        if stats is None or not stats.has_null_count:
            return None, None, None
        null_count += stats.null_count
        if stats.has_min_max:
            low = stats.min if low is None else min(low, stats.min)
            high = stats.max if high is None else max(high, stats.max)
    return null_count, low, high


def _stat_value(value: object) -> object:
    """A statistic as the protocol writes it: a timestamp in milliseconds (truncated: the
    protocol's precision, which Spark and delta-rs readers expect), a date as ISO text."""
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    if isinstance(value, date):
        return value.isoformat()
    return value


# ---- reading -----------------------------------------------------------------------------------
class ColumnValues:
    """The non-null values of one column that files are asked about, sorted once for many files
    (``values_of``). ``anywhere``: a NaN, or values that do not order among themselves — any file
    may hold one of them."""

    def __init__(self, ordered: list[Any], instants: bool, anywhere: bool) -> None:
        self.ordered = ordered  # sorted; datetimes as microseconds since the epoch (``instants``)
        self.instants = instants
        self.anywhere = anywhere
        self.floats_only = all(isinstance(v, float) for v in ordered)
        self._floats: list[float] | None = None

    @property
    def empty(self) -> bool:
        return not self.ordered and not self.anywhere

    def as_floats(self) -> list[float]:
        """The values as floats, still sorted (float rounding keeps order); OverflowError for an
        integer beyond a double."""
        if self._floats is None:
            self._floats = [float(v) for v in self.ordered]
        return self._floats


def values_of(values: Iterable[Any]) -> ColumnValues:
    """``values`` (None ones left out) prepared for ``may_hold_any``."""
    present = [v for v in values if v is not None]
    if any(_is_nan(v) for v in present):
        return ColumnValues([], False, True)
    if present and all(isinstance(v, datetime) for v in present):
        return ColumnValues(sorted(_micros(v) for v in present), True, False)
    try:
        return ColumnValues(sorted(present), False, False)
    except TypeError:  # values of several types: no order to search in
        return ColumnValues([], False, True)


def may_hold_any(file: Mapping[str, Any], column: str, values: ColumnValues, *, partitioned: bool = False) -> bool:
    """Whether the data file ``file`` (a ``sink.live_files`` row: ``min.<c>``, ``max.<c>``,
    ``partition.<c>``) may hold a row whose ``column`` is one of ``values``.

    False only when its statistics, widened for what they may have lost (module docstring), rule
    every value out; a file without statistics for the column may hold anything.
    """
    if values.empty:
        return False
    try:
        found = _in_bounds_terms(file, column, values, partitioned)
        if found is None:
            return True
        bounds, ordered = found
        i = bisect.bisect_left(ordered, bounds.low)
        return i < len(ordered) and bounds.at_most_high(ordered[i])
    except _INCOMPARABLE:  # statistics of another type than the values: cannot tell
        return True


def may_hold_between(file: Mapping[str, Any], column: str, low: Any, high: Any, *, partitioned: bool = False) -> bool:
    """Whether ``file`` may hold a row whose ``column`` lies in ``[low, high]`` (both inclusive,
    ``low <= high``, neither None), by the same widened statistics as ``may_hold_any``."""
    try:
        if high < low:
            return False
    except TypeError:  # bounds of two types: cannot tell
        return True
    try:
        found = _in_bounds_terms(file, column, values_of([low, high]), partitioned)
        if found is None:
            return True
        bounds, (first, last) = found
        # the values a file admits are all >= bounds.low, and closed downward above it: if any of
        # [low, high] is admitted, the least value >= bounds.low in it is
        candidate = max(first, bounds.low)
        return bool(candidate <= last and bounds.at_most_high(candidate))
    except _INCOMPARABLE:
        return True


@dataclass(frozen=True)
class _Bounds:
    """A file's widened bounds of one column, in the values' terms: a value it may hold is
    >= ``low`` and either <= ``high`` or starts with ``prefix`` (a string max that may be cut)."""

    low: Any
    high: Any
    prefix: str | None = None
    as_floats: bool = False  # compare the values as floats (float statistics of other numbers)

    def at_most_high(self, value: Any) -> bool:
        if value <= self.high:
            return True
        return self.prefix is not None and isinstance(value, str) and value.startswith(self.prefix)


def _in_bounds_terms(file: Mapping[str, Any], column: str, values: ColumnValues, partitioned: bool) -> tuple[_Bounds, list] | None:
    """The file's bounds of ``column`` and ``values`` ordered in the bounds' terms (floats when
    the bounds are); None when the statistics cannot rule out any value."""
    if values.anywhere:
        return None
    bounds = _bounds(file, column, values, partitioned)
    if bounds is None:
        return None
    return bounds, (values.as_floats() if bounds.as_floats else values.ordered)


def _bounds(file: Mapping[str, Any], column: str, values: ColumnValues, partitioned: bool) -> _Bounds | None:
    """The file's bounds of ``column`` comparable with ``values``; None when they say nothing
    (no statistics, a NaN, a type that does not compare with the values)."""
    if partitioned:
        low = high = file.get(f"partition.{column}")
    else:
        low, high = file.get(f"min.{column}"), file.get(f"max.{column}")
    if low is None or high is None or _is_nan(low) or _is_nan(high):
        return None
    if isinstance(low, datetime) != values.instants or isinstance(high, datetime) != values.instants:
        return None
    if values.instants:
        slack = 0 if partitioned else _MILLISECOND_SLACK
        return _Bounds(_micros(low) - slack, _micros(high) + slack)
    if isinstance(low, float) or isinstance(high, float):
        return _Bounds(float(low), float(high), as_floats=not values.floats_only)
    if isinstance(high, str) and not partitioned:
        return _Bounds(low, high, prefix=_max_prefix(high))
    return _Bounds(low, high)


def _max_prefix(high: str) -> str:
    """What every value a string max may stand for starts with (module docstring: strings)."""
    prefix = high[:-1] if high and high[-1] >= _TIE_BREAKER_FROM else high
    beyond = next((i for i, c in enumerate(prefix) if c > "\uffff"), None)
    return prefix if beyond is None else prefix[:beyond]


def _micros(value: datetime) -> int:
    """Microseconds since the epoch, exactly (a naive datetime is UTC: Delta writes both
    timestamp types' statistics as UTC)."""
    aware = value if value.tzinfo is not None else value.replace(tzinfo=UTC)
    return (aware - _EPOCH) // _MICROSECOND


def _is_nan(value: Any) -> bool:
    if isinstance(value, float):
        return math.isnan(value)
    return isinstance(value, Decimal) and value.is_nan()
