"""The pipeline's dead-letter Delta table: records that could not become sink rows.

Invariant 8: dead letters of a batch are written before its sink commit and *replace* the
batch's ranges (delete rows with those coordinates, insert the new ones, one commit), so a
retry or a re-plan after a crash never duplicates a dead letter.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable, write_deltalake
from deltalake.exceptions import CommitFailedError

from offsetlake.config import PipelineConfig
from offsetlake.plan import OffsetRange
from offsetlake.sink import create_table_once, open_table

DEAD_LETTER_SCHEMA = pa.schema(
    [
        ("_kafka_topic", pa.string()),
        ("_kafka_partition", pa.int32()),
        ("_kafka_offset", pa.int64()),
        ("_kafka_timestamp", pa.timestamp("us", tz="UTC")),
        ("key", pa.binary()),
        ("value", pa.binary()),
        ("headers", pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))),
        ("reason", pa.string()),
        ("pipeline", pa.string()),
        ("batch_id", pa.string()),
    ]
)


def range_predicate(ranges: list[OffsetRange]) -> str:
    """delta-rs SQL predicate selecting rows whose coordinates fall in ``ranges``."""
    parts = [
        f"(_kafka_topic = '{r.topic}' AND _kafka_partition = {r.partition} "
        f"AND _kafka_offset >= {r.start} AND _kafka_offset < {r.end})"
        for r in ranges
        if r.size > 0
    ]
    return " OR ".join(parts)


def range_filter(ranges: list[OffsetRange]) -> pc.Expression | None:
    expression = None
    for r in ranges:
        if r.size <= 0:
            continue
        term = (
            (pc.field("_kafka_topic") == r.topic)
            & (pc.field("_kafka_partition") == r.partition)
            & (pc.field("_kafka_offset") >= r.start)
            & (pc.field("_kafka_offset") < r.end)
        )
        expression = term if expression is None else expression | term
    return expression


def replace_dead_letters(config: PipelineConfig, ranges: list[OffsetRange], rows: pa.Table, attempts: int = 5) -> int:
    """Make the dead-letter table hold exactly ``rows`` for ``ranges``; returns rows written."""
    rows = rows.cast(DEAD_LETTER_SCHEMA)
    predicate = range_predicate(ranges)
    if not predicate:
        return 0
    for attempt in range(attempts):
        table = open_table(config.dead_letter_path)
        if table is None and rows.num_rows == 0:
            return 0
        # Create empty first so racing writers both go through the predicate overwrite below.
        table = table or create_table_once(config.dead_letter_path, DEAD_LETTER_SCHEMA, [], f"dead letters of {config.name}")
        try:
            if rows.num_rows:
                write_deltalake(table, rows, mode="overwrite", predicate=predicate)
            elif _has_rows(table, ranges):
                table.delete(predicate)
            return rows.num_rows
        except CommitFailedError:  # a racing writer replaced the same range: re-read and retry
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def _has_rows(table: DeltaTable, ranges: list[OffsetRange]) -> bool:
    expression = range_filter(ranges)
    return expression is not None and table.to_pyarrow_dataset().count_rows(filter=expression) > 0
