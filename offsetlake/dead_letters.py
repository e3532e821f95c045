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
from offsetlake.coordinates import ranges_arrow, ranges_sql
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


def replace_dead_letters(config: PipelineConfig, ranges: list[OffsetRange], rows: pa.Table, attempts: int = 5) -> int:
    """Make the dead-letter table hold exactly ``rows`` for ``ranges``; returns rows written."""
    rows = rows.cast(DEAD_LETTER_SCHEMA)
    predicate = ranges_sql(ranges)
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
    expression = ranges_arrow(ranges)
    return expression is not None and table.to_pyarrow_dataset().count_rows(filter=expression) > 0


def _batch_filter(batch_ids: list[str]) -> pc.Expression:
    return pc.field("batch_id").isin(batch_ids)


def count_dead_letters_of(config: PipelineConfig, batch_ids: list[str]) -> dict[str, int]:
    """How many dead letters each of ``batch_ids`` wrote (0 for none)."""
    table = open_table(config.dead_letter_path)
    if table is None or not batch_ids:
        return {b: 0 for b in batch_ids}
    found = table.to_pyarrow_dataset().to_table(columns=["batch_id"], filter=_batch_filter(batch_ids))
    counts = {r["batch_id"]: r["count_all"] for r in found.group_by("batch_id").aggregate([([], "count_all")]).to_pylist()}
    return {b: counts.get(b, 0) for b in batch_ids}


def delete_dead_letters_of(config: PipelineConfig, batch_ids: list[str], attempts: int = 5) -> int:
    """Delete the dead letters ``batch_ids`` wrote (a rewind undoing those batches); returns how many."""
    total = sum(count_dead_letters_of(config, batch_ids).values())
    if not total:
        return 0
    quoted = ", ".join("'" + b.replace("'", "''") + "'" for b in batch_ids)
    for attempt in range(attempts):
        try:
            table = open_table(config.dead_letter_path)
            if table is not None:
                table.delete(f"batch_id IN ({quoted})")
            return total
        except CommitFailedError:  # a concurrent dead-letter write: re-read and retry
            if attempt == attempts - 1:
                raise
    return total
