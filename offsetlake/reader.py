"""Reading planned ranges into a Spark DataFrame: one split per task, consumed with librdkafka.

Spark's own Kafka source is a Maven jar we cannot install, so each task runs a
confluent-kafka consumer over an exact ``[start, end)`` split (``mapInArrow``). Large ranges
are cut into splits so every core works.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from offsetlake import errors
from offsetlake.plan import OffsetRange

RAW_SCHEMA = StructType(
    [
        StructField("key", BinaryType()),
        StructField("value", BinaryType()),
        StructField(
            "headers",
            ArrayType(StructType([StructField("key", StringType()), StructField("value", BinaryType())])),
        ),
        StructField("topic", StringType(), False),
        StructField("partition", IntegerType(), False),
        StructField("offset", LongType(), False),
        StructField("timestamp", TimestampType()),
    ]
)
_ARROW_SCHEMA = pa.schema(
    [
        ("key", pa.binary()),
        ("value", pa.binary()),
        ("headers", pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))),
        pa.field("topic", pa.string(), nullable=False),
        pa.field("partition", pa.int32(), nullable=False),
        pa.field("offset", pa.int64(), nullable=False),
        ("timestamp", pa.timestamp("us", tz="UTC")),
    ]
)
_SPLIT_SCHEMA = StructType(
    [
        StructField("topic", StringType(), False),
        StructField("partition", IntegerType(), False),
        StructField("start", LongType(), False),
        StructField("end", LongType(), False),
    ]
)
_ROWS_PER_ARROW_BATCH = 20_000
_TASK_ERROR = re.compile(r"offsetlake\.errors\.(\w+): (.+)")


@contextmanager
def errors_from_spark_tasks() -> Iterator[None]:
    """Re-raise an OffsetlakeError that a Spark task raised as itself, without the JVM trace.

    A range read inside a task fails with our own errors (offsets lost, read timeout, broker
    unreachable); Spark hands them to the driver as a PythonException whose text is a worker
    traceback. The user should see the one line that names pipeline, topic, partition and
    offsets, and the CLI its exit code, as if the read had run in the driver.
    """
    try:
        yield
    except errors.OffsetlakeError:
        raise
    except Exception as err:
        found = _TASK_ERROR.findall(str(err))
        kind = getattr(errors, found[-1][0], None) if found else None
        if isinstance(kind, type) and issubclass(kind, errors.OffsetlakeError):
            raise kind(found[-1][1].strip()) from err
        raise


def split_ranges(ranges: list[OffsetRange], parallelism: int, min_split: int = 20_000) -> list[OffsetRange]:
    """Cut ranges so there are about ``2 × parallelism`` splits, none smaller than ``min_split``."""
    total = sum(r.size for r in ranges)
    if total == 0:
        return []
    target = max(min_split, -(-total // max(1, 2 * parallelism)))
    splits: list[OffsetRange] = []
    for r in ranges:
        start = r.start
        while start < r.end:
            end = min(r.end, start + target)
            if r.end - end < min_split // 2:  # no tiny tail split
                end = r.end
            splits.append(OffsetRange(r.topic, r.partition, start, end))
            start = end
    return splits


def read_ranges(
    spark: SparkSession,
    ranges: list[OffsetRange],
    client_config: dict[str, str],
    pipeline: str,
    timeout_s: float,
) -> DataFrame:
    """A DataFrame (RAW_SCHEMA) of every committed record in ``ranges``; lazy until an action."""
    splits = split_ranges([r for r in ranges if r.size], spark.sparkContext.defaultParallelism)
    rows = [(s.topic, s.partition, s.start, s.end) for s in splits]
    split_df = spark.createDataFrame(spark.sparkContext.parallelize(rows, max(1, len(rows))), _SPLIT_SCHEMA)
    config = dict(client_config)

    def consume(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from offsetlake.kafka import read_range

        for batch in batches:
            for split in batch.to_pylist():
                yield from _read_split(config, pipeline, split, timeout_s, read_range)

    return split_df.mapInArrow(consume, RAW_SCHEMA)


def _read_split(config, pipeline, split, timeout_s, read_range) -> Iterator[pa.RecordBatch]:
    columns: dict[str, list] = {name: [] for name in _ARROW_SCHEMA.names}
    for message in read_range(
        config, pipeline, split["topic"], split["partition"], split["start"], split["end"], timeout_s
    ):
        columns["key"].append(message.key())
        columns["value"].append(message.value())
        headers = message.headers()
        columns["headers"].append(
            [{"key": k, "value": v} for k, v in headers] if headers else None
        )
        columns["topic"].append(message.topic())
        columns["partition"].append(message.partition())
        columns["offset"].append(message.offset())
        kind, stamp = message.timestamp()
        columns["timestamp"].append(stamp * 1000 if kind and stamp >= 0 else None)
        if len(columns["offset"]) >= _ROWS_PER_ARROW_BATCH:
            yield pa.RecordBatch.from_pydict(columns, schema=_ARROW_SCHEMA)
            columns = {name: [] for name in _ARROW_SCHEMA.names}
    if columns["offset"]:
        yield pa.RecordBatch.from_pydict(columns, schema=_ARROW_SCHEMA)
