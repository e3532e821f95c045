"""Reading planned ranges into a Spark DataFrame: one split per task, consumed with librdkafka.

The read tasks of the spark and direct paths: each task runs a confluent-kafka consumer over an
exact ``[start, end)`` split (``mapInArrow``, the range rules are ``offsetlake.kafka.read_range``'s)
and decodes what it read with the pipeline's decoder (``offsetlake.formats``). Large ranges are
cut into splits so every core works. They stay the default read: on the machine measured they
are faster than Spark's own Kafka source (the jvm path, ``offsetlake.kafka_source``), and they
decode every format (Avro, Protobuf and JSON Schema through the registry).
"""

from __future__ import annotations

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
from offsetlake.formats import PARSED_IN_READ, Decoder, reasons
from offsetlake.formats.keys import KEY_PARSED, KeyedDecoder
from offsetlake.kafka import record_headers
from offsetlake.plan import OffsetRange
from offsetlake.spark import default_parallelism

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
        # why the record itself (not its value) cannot become a row: unreadable headers, a
        # timestamp the sink's type cannot hold; null for almost every record
        StructField("read_problem", StringType()),
    ]
)
_HEADERS = pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))
_ARROW_SCHEMA = pa.schema(
    [
        ("key", pa.binary()),
        ("value", pa.binary()),
        ("headers", _HEADERS),
        pa.field("topic", pa.string(), nullable=False),
        pa.field("partition", pa.int32(), nullable=False),
        pa.field("offset", pa.int64(), nullable=False),
        ("timestamp", pa.timestamp("us", tz="UTC")),
        ("read_problem", pa.string()),
    ]
)
_TIMESTAMP = _ARROW_SCHEMA.field("timestamp").type
# What the sink's timestamp type (Spark's TimestampType, Delta's timestamp) holds: years 1 to 9999.
# A Kafka timestamp is any int64 of milliseconds (-1: none); one outside this range makes its
# record a dead letter instead of an overflow that stops the batch.
TIMESTAMP_MIN_MS, TIMESTAMP_MAX_MS = -62_135_596_800_000, 253_402_300_799_999
NO_TIMESTAMP = -1
RECORD_TOO_LARGE = "record_too_large"  # how the reason of a record above max_record_bytes begins


@contextmanager
def errors_from_spark_tasks() -> Iterator[None]:
    """Re-raise an OffsetlakeError that a Spark task raised as itself, without the JVM trace.

    A range read inside a task fails with our own errors (offsets lost, read timeout, broker
    unreachable); the task reports it as data (``errors.reported_as_data``: class name, text,
    fields) and Spark hands that to the driver inside a PythonException. The user sees the one
    line that names pipeline, topic, partition and offsets, the CLI its exit code, and the caller
    its class and fields (``errors.is_transient`` included), as if the read had run in the driver.
    """
    try:
        yield
    except errors.OffsetlakeError:
        raise
    except Exception as err:
        reported = errors.from_task_failure(err)
        if reported is None:
            raise
        raise reported from err


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


def task_count(splits: list[tuple[str, int, int, int]], parallelism: int, min_split: int = 20_000) -> int:
    """How many read tasks share ``splits`` (``split_ranges``' (topic, partition, start, end)):
    one per split, but no more than keep every core busy with ``min_split`` records each. A task
    pays for its scheduling, its consumer and its files whatever it reads: a batch of 1,000
    records over six partitions is two tasks, not six (1,000 new records through the CLI)."""
    if not splits:
        return 1
    records = sum(end - start for _, _, start, end in splits)
    return max(1, min(len(splits), max(parallelism, -(-records // min_split))))


def read_ranges(
    spark: SparkSession,
    ranges: list[OffsetRange],
    client_config: dict[str, str],
    pipeline: str,
    timeout_s: float,
    decoder: Decoder | None = None,
    headers_of_rows: bool = True,
    *,
    max_record_bytes: int,
) -> DataFrame:
    """A DataFrame (RAW_SCHEMA) of every committed record in ``ranges``; lazy until an action.

    When the decoder decodes in the read tasks (``decoder.read_type()``), the tasks also decode
    each chunk's values into the column ``PARSED_IN_READ`` (null where they left the record to
    Spark). ``headers_of_rows=False``: records the decoder already knows become rows get no
    headers (only dead letters keep them, unless the pipeline may dead-letter a good record).
    A record larger than ``max_record_bytes`` is decoded by nobody: its ``read_problem`` says
    so (``record_size_problems``).
    """

    parallelism = default_parallelism(spark)
    splits = [(s.topic, s.partition, s.start, s.end) for s in split_ranges([r for r in ranges if r.size], parallelism)]
    # each task finds its splits by index: the same plan on a classic session and on Spark
    # Connect (which has no parallelize), and no rows to ship to the JVM
    split_df = spark.range(0, len(splits), numPartitions=task_count(splits, parallelism))
    config = dict(client_config)
    arrow_schema, spark_schema = read_schemas(decoder)

    def consume(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import gc

        from offsetlake.kafka import read_range

        # The chunks hold thousands of Message objects and bytes, none in a cycle; the cyclic
        # collector only rescans them (1.5-2 µs of CPU per record measured). Refcounting frees them.
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            for batch in batches:
                for index in batch.column("id").to_pylist():
                    topic, partition, start, end = splits[index]
                    for chunk in read_range(config, pipeline, topic, partition, start, end, timeout_s):
                        columns = record_columns(chunk, topic, partition, decoder, headers_of_rows, max_record_bytes=max_record_bytes)
                        yield pa.RecordBatch.from_arrays(columns, schema=arrow_schema)
        finally:
            if was_enabled:
                gc.enable()

    return split_df.mapInArrow(errors.reported_as_data(consume), spark_schema)


def raw_dataframe(spark: SparkSession, chunks: list[tuple[str, int, list]], decoder: Decoder, *, max_record_bytes: int) -> DataFrame:
    """Records already consumed in the driver ((topic, partition, messages)) as the DataFrame a
    read task would have made of them: RAW_SCHEMA plus what the decoder decides in the tasks."""
    arrow_schema, schema = read_schemas(decoder)
    batches = [
        pa.RecordBatch.from_arrays(
            record_columns(messages, topic, partition, decoder, max_record_bytes=max_record_bytes), schema=arrow_schema
        )
        for topic, partition, messages in chunks
    ]
    table = pa.Table.from_batches(batches, schema=arrow_schema).combine_chunks()
    return spark.createDataFrame(table, schema=schema)


def _decoded_fields(decoder: Decoder | None) -> list[pa.Field]:
    """The columns the read tasks add after RAW_SCHEMA's: the decoded values (PARSED_IN_READ) when
    the value decoder decodes in the tasks, the decoded keys (KEY_PARSED) when the key decoder does."""
    if decoder is None:
        return []
    out = []
    parsed_type = decoder.read_type()
    if parsed_type is not None:
        out.append(pa.field(PARSED_IN_READ, parsed_type))
    key_type = decoder.key.read_type() if isinstance(decoder, KeyedDecoder) else None
    if key_type is not None:
        out.append(pa.field(KEY_PARSED, key_type))
    return out


def read_schemas(decoder: Decoder | None) -> tuple[pa.Schema, StructType]:
    """The Arrow and Spark schemas of the read frame: RAW_SCHEMA and what the tasks decode."""
    from pyspark.sql.pandas.types import from_arrow_type

    extra = _decoded_fields(decoder)
    arrow_schema = _ARROW_SCHEMA
    for f in extra:
        arrow_schema = arrow_schema.append(f)
    return arrow_schema, StructType([*RAW_SCHEMA.fields, *(StructField(f.name, from_arrow_type(f.type)) for f in extra)])


def record_columns(
    chunk: list, topic: str, partition: int, decoder: Decoder | None = None, headers_of_rows: bool = True, *, max_record_bytes: int
) -> list[pa.Array]:
    """One consumed chunk of one partition as RAW_SCHEMA's Arrow columns (plus PARSED_IN_READ when
    the decoder decodes in the read task), built column by column: this loop is the read path's
    hot spot (a per-record append loop ran at a third of the consumer's own rate)."""
    return decided_columns(chunk, topic, partition, decoder, headers_of_rows, max_record_bytes=max_record_bytes)[0]


def decided_columns(
    chunk: list, topic: str, partition: int, decoder: Decoder | None = None, headers_of_rows: bool = True, *, max_record_bytes: int
) -> tuple[list[pa.Array], list[bool] | None]:
    """``record_columns`` and, per record, whether the read task alone decided it is a row
    (decoded, required fields present, no problem with its size, value, key, headers or
    timestamp); None when the decoder settles nothing in the task. The decoders never see a
    record larger than ``max_record_bytes`` (``record_size_problems``)."""
    stamps = [m.timestamp() for m in chunk]
    values = [m.value() for m in chunk]
    keys = [m.key() for m in chunk]
    problems = record_size_problems(keys, values, max_record_bytes)
    values_to_decode, keys_to_decode = values, keys
    if problems is not None:  # a record too large is decoded by nobody: as a null value and key
        values_to_decode = [None if p else v for p, v in zip(problems, values, strict=True)]
        keys_to_decode = [None if p else k for p, k in zip(problems, keys, strict=True)]
    micros = [s * 1000 if kind and s != NO_TIMESTAMP and TIMESTAMP_MIN_MS <= s <= TIMESTAMP_MAX_MS else None for kind, s in stamps]
    if None in micros:  # rare: records without a timestamp, or with one out of range
        for i, ((kind, s), us) in enumerate(zip(stamps, micros, strict=True)):
            if us is None and kind and s != NO_TIMESTAMP:
                problems = problems or [None] * len(chunk)
                problems[i] = problems[i] or reasons.timestamp_range(s)
    decoded = decoder.decode_chunk(values_to_decode) if decoder is not None else None
    if decoded is not None and decoded.problems is not None:
        problems = merged_problems(problems, decoded.problems)
    key_decoder = decoder.key if isinstance(decoder, KeyedDecoder) and decoder.key.read_type() is not None else None
    decoded_keys = key_decoder.decode_chunk(keys_to_decode) if key_decoder is not None else None
    if decoded_keys is not None and decoded_keys.problems is not None:
        problems = merged_problems(problems, decoded_keys.problems)
    rows = None
    if decoded is not None and decoded.settled is not None:
        rows = decoded.settled if problems is None else [row and problems[i] is None for i, row in enumerate(decoded.settled)]
    wanted = None  # which records need their headers (None: all)
    if not headers_of_rows and rows is not None:
        wanted = [not row for row in rows]
    headers = record_headers(chunk, wanted)
    columns = [
        pa.array(keys, pa.binary()),
        pa.array(values, pa.binary()),
        pa.array(headers, _HEADERS),
        pa.array([topic] * len(chunk), pa.string()),
        pa.array([partition] * len(chunk), pa.int32()),
        pa.array([m.offset() for m in chunk], pa.int64()),
        pa.array(micros, _TIMESTAMP),
        pa.array(problems, pa.string()) if problems is not None else pa.nulls(len(chunk), pa.string()),
    ]
    if decoded is not None and decoded.parsed is not None and decoder is not None and decoder.read_type() is not None:
        columns.append(decoded.parsed)
    if decoded_keys is not None and decoded_keys.parsed is not None:
        columns.append(decoded_keys.parsed)
    return columns, rows


def record_size_problems(keys: list[bytes | None], values: list[bytes | None], limit: int) -> list[str | None] | None:
    """Per record, the ``record_too_large`` reason (its size and the limit) when its key and value
    hold more than ``limit`` bytes (the pipeline's ``max_record_bytes``), else None; None when no
    record of the chunk is too large.

    The one size rule of every data path and of the audit (invariant 8, a dead letter with a true
    reason): whether a record is too large follows its own bytes alone, decided here before any
    parser sees it, so no parser's own limit (Jackson's 20,000,000-character strings, a pyarrow
    block) decides a record's fate, and the parsers take every record up to the limit
    (``formats.json_records``). Headers are not counted: they are no part of a row.
    """
    if _longest(keys) + _longest(values) <= limit:  # the common chunk: one pass at C speed each
        return None
    sizes = [len(k or b"") + len(v or b"") for k, v in zip(keys, values, strict=True)]
    return [reasons.record_too_large(size, limit) if size > limit else None for size in sizes]


def _longest(items: list[bytes | None]) -> int:
    return max(map(len, filter(None, items)), default=0)


def merged_problems(first: list[str | None] | None, then: list[str | None] | None) -> list[str | None] | None:
    """Per-record reasons, the first list's winning where both have one."""
    if first is None or then is None:
        return first if then is None else then
    return [a if a is not None else b for a, b in zip(first, then, strict=True)]
