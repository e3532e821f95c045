"""Why a record is a dead letter: one constructor per cause, each giving a code and the text.

Invariant 8: nothing is dropped, and a dead letter says why. The dead-letter table keeps both: the
text ``reason`` (what a person reads: the field, the sizes, the parser's words) and its
``reason_code`` (what a query groups by and an alert counts; ``CODES``, listed in
docs/reference/dead-letters.md). The cause is known where the record is decided — a read task, a
decoder, a Spark expression, the validation gate — so the constructors live here, below every one
of them (formats is the lowest layer that decides records), and the dead-letter table
(``offsetlake.dead_letters``) only splits what they made (``code_column``, ``text_column``,
through ``formats.dead_letter_rows``).

A reason travels from where it is found to the dead-letter row as one string (the read frame's
``read_problem``, the decoders' ``REASON`` column, Arrow lists in the read tasks), so a
constructor's value is ``<code>`` + ``SEPARATOR`` + ``<text>``: no column is added to any frame
on the way, and the two are split in one place. ``SEPARATOR`` (the ASCII unit separator) is in
no code; a reason without it (never made here) keeps its whole text and has no code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    from pyspark.sql import Column

SEPARATOR = "\x1f"

# the codes, each with what it means (docs/reference/dead-letters.md lists the same)
CODES = {
    "tombstone": "the record has a null value and the sink does not delete with it",
    "undecodable": "the value does not decode as the pipeline's format (no wire-format header, does not parse, bytes over)",
    "schema_mismatch": "the value's writer schema is unknown, unreadable, not the expected one, or the value breaks it",
    "required_missing": "a required field is missing or null",
    "value_range": "a decoded value does not fit its sink column's type",
    "envelope": "a Debezium event without what its op needs",
    "key_undecodable": "the record key does not decode as key_format",
    "key_null": "a key column of a keyed sink is null",
    "window_time_null": "the column a merge engine's window or horizon is on (sink.window.on, sink.within_on) is null",
    "late_record": "the record reached Kafka more than sink.allowed_lateness after its window time",
    "record_too_large": "key and value hold more bytes than max_record_bytes",
    "timestamp_range": "the record timestamp is outside what the sink's timestamp type holds",
    "partition_value": "a string partition value cannot be a folder name",
    "quarantined": "the record failed a row-level expectation under validation.on_failure: quarantine",
    "unrouted": "the value of the column routes: goes by maps to none of its tables, and routes.unmapped is dead_letter",
}


def reason(code: str, text: str) -> str:
    """The dead-letter reason ``text`` with its ``code`` (one of ``CODES``)."""
    if code not in CODES:
        raise ValueError(f"unknown dead-letter reason code {code!r}")
    return f"{code}{SEPARATOR}{text}"


def code_of(value: str | None) -> str | None:
    """The code of a reason made here (None for none)."""
    return value.split(SEPARATOR, 1)[0] if value is not None and SEPARATOR in value else None


def text_of(value: str | None) -> str | None:
    """The text of a reason, without its code."""
    return value.split(SEPARATOR, 1)[1] if value is not None and SEPARATOR in value else value


# ---- one constructor per cause ------------------------------------------------------------------
TOMBSTONE = reason("tombstone", "tombstone: record has a null value")


def undecodable(text: str) -> str:
    return reason("undecodable", text)


def schema_mismatch(text: str) -> str:
    return reason("schema_mismatch", text)


def required_missing(name: str, where: str = "") -> str:
    return reason("required_missing", f"required field '{name}' is missing or null{where}")


def value_range(text: str) -> str:
    return reason("value_range", text)


def envelope(text: str) -> str:
    return reason("envelope", f"debezium envelope: {text}")


def key_undecodable(text: str) -> str:
    """A key problem, said as ``key: <text>``; a reason made here keeps only its text."""
    return reason("key_undecodable", f"key: {text_of(text)}")


def _record_too_large_text(size: str, limit: int) -> str:
    return f"record_too_large: its key and value hold {size} bytes, more than the pipeline's max_record_bytes ({limit})"


def record_too_large(size: int, limit: int) -> str:
    return reason("record_too_large", _record_too_large_text(str(size), limit))


def _timestamp_range_text(ms: str) -> str:
    return f"record timestamp {ms} ms is outside what the sink's timestamp type holds (0001-01-01 to 9999-12-31 UTC)"


def timestamp_range(ms: int) -> str:
    return reason("timestamp_range", _timestamp_range_text(str(ms)))


def key_null(column: str) -> str:
    return reason("key_null", f"sink.key column '{column}' is null; an upsert row needs its key")


def window_time_null(column: str, what: str = "window") -> str:
    return reason("window_time_null", f"{what} column '{column}' is null: the record has no time for its {what}")


def late_record_column(column: str, lateness: str, late_by_us: Column) -> Column:
    """The reason of a record whose Kafka timestamp is ``late_by_us`` microseconds after its
    window column's value, more than ``sink.allowed_lateness``."""
    from pyspark.sql import functions as F

    seconds = F.format_number(late_by_us / F.lit(1_000_000), 3)
    text = F.concat(F.lit("record reached Kafka "), seconds, F.lit(f" s after its window time '{column}'; allowed_lateness is {lateness}"))
    return coded("late_record", text)


def partition_value_nul(column: str) -> str:
    return reason("partition_value", f"partition value of column '{column}' holds a NUL character, which no folder name may")


# ---- the same in Spark --------------------------------------------------------------------------
def coded(code: str, text: Column) -> Column:
    """A Spark column of reasons of one ``code`` whose text is ``text`` (null stays null)."""
    from pyspark.sql import functions as F

    return F.concat(F.lit(reason(code, "")), text)


def _filled(code: str, text_with: Callable[[str], str], value: Column) -> Column:
    """``coded`` with the text a constructor makes, ``value`` (cast to text) where it puts its
    argument: one template for a reason made in Python and the same reason made in Spark."""
    from pyspark.sql import functions as F

    before, after = text_with(_MARK).split(_MARK)
    return coded(code, F.concat(F.lit(before), value.cast("string"), F.lit(after)))


_MARK = "\x00"


def record_too_large_column(size: Column, limit: int) -> Column:
    """``record_too_large`` of a column of sizes (the JVM read path, ``offsetlake.kafka_source``)."""
    return _filled("record_too_large", lambda s: _record_too_large_text(s, limit), size)


def timestamp_range_column(ms: Column) -> Column:
    """``timestamp_range`` of a column of millisecond timestamps."""
    return _filled("timestamp_range", _timestamp_range_text, ms)


def code_column(value: Column) -> Column:
    """The code of a column of reasons (null where none)."""
    from pyspark.sql import functions as F

    parts = F.split(value, SEPARATOR, 2)
    return F.when(F.size(parts) == 2, parts.getItem(0))


def text_column(value: Column) -> Column:
    """The text of a column of reasons, without the code (all of a reason that has none)."""
    from pyspark.sql import functions as F

    return F.element_at(F.split(value, SEPARATOR, 2), -1)
