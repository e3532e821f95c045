"""The ``jvm`` data path: Spark's own Kafka source reads a batch's exact ranges, and Spark decodes.

No record crosses Python on the way in: the source reads each topic-partition's ``[start, end)``
(``startingOffsets``/``endingOffsets``, ``kafka.isolation.level=read_committed``, headers
included) and ``from_json`` decodes in the JVM. The frame it makes has the read tasks' columns
(``reader.RAW_SCHEMA``), so everything after the read is the Spark path's own code.

A record's fate never depends on the path that read it (invariant 8, and the rule that it never
depends on its neighbours). What the read tasks decide about a record, the JVM decides the same
way or hands to the read tasks' own code:

- size (``record_too_large``) and the timestamp (null without one, ``timestamp_range`` outside
  years 1 to 9999) are Spark expressions with the same texts (``formats.reasons``);
- the few records whose value or key the JVM cannot judge alone (``IN_PYTHON``: a JSON value
  that may hold more than one JSON value, an unpaired surrogate escape or too deep a nesting, a
  key that is not UTF-8) are judged by the decoders' ``decode_chunk``, the read tasks' code, in
  one Spark job over just those records (``python_problems``);
- what the source cannot read as the read tasks do makes the batch go to the read tasks whole
  (``read_tasks_reason``): a timestamp that overflows Spark's microseconds (the source fails the
  job), one before the Gregorian calendar (the source shifts it to the Julian calendar), and a
  failure of the source itself (offsets lost, broker unreachable), which the read tasks then
  name with pipeline, topic, partition and offsets as on every path.

The path is open to a JSON pipeline whose key is text, bytes or JSON and whose client settings
the Java client can take (``problem``); Avro, Protobuf and JSON Schema values keep the read tasks.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from offsetlake.formats import reasons
from offsetlake.formats.json_records import JsonDecoder, structure_suspects
from offsetlake.formats.keys import KEY_PARSED, JsonKey, KeyedDecoder, TextKey
from offsetlake.plan import OffsetRange
from offsetlake.reader import NO_TIMESTAMP, TIMESTAMP_MAX_MS, TIMESTAMP_MIN_MS, split_ranges

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

    from offsetlake.config import PipelineConfig
    from offsetlake.formats import Decoder

IN_PYTHON = "_judged_in_python"  # true for a record whose value or key the read tasks' code judges
BEFORE_GREGORIAN = "_before_gregorian"  # true for a timestamp the source shifted (before 1582-10-17)
# 1582-10-17T00:00:00Z in microseconds: the Gregorian switch (10-15) plus a day for any time zone
# the JVM's default may be in; before it, the source's java.sql.Timestamp is Julian-rebased
_GREGORIAN_US = -12_219_120_000_000_000
# librdkafka settings the Java client takes under the same name and meaning
_SAME_IN_JAVA = ("bootstrap.servers", "client.id", "security.protocol", "sasl.mechanism", "ssl.endpoint.identification.algorithm")
# Spark's Kafka source and the Java client in a failure's first lines: a failure of the source
# itself, whose batch the read tasks read (and name, if it is theirs too)
_SOURCE_FAILURES = ("org.apache.spark.sql.kafka010.", "org.apache.kafka.", "KAFKA_")


def java_options(client: dict[str, str]) -> tuple[dict[str, str], str | None]:
    """The pipeline's librdkafka client settings as the Kafka source's ``kafka.*`` options, or
    the first setting it cannot pass on (then the path is not taken, and the reason names it)."""
    options: dict[str, str] = {}
    for key, value in client.items():
        if key in _SAME_IN_JAVA:
            options[f"kafka.{key}"] = value
        elif key == "sasl.mechanisms":
            options["kafka.sasl.mechanism"] = value
        elif key == "ssl.ca.location":
            options["kafka.ssl.truststore.location"] = value
            options["kafka.ssl.truststore.type"] = "PEM"
        elif key.startswith("sasl.") or "password" in key:
            return {}, f"kafka.options sets {key}, a credential the JVM path does not pass to Spark's Kafka source yet"
        else:
            return {}, f"kafka.options sets {key}, a librdkafka setting the JVM path does not translate for the Java client"
    return options, None


def problem(config: PipelineConfig, decoder: Decoder) -> str | None:
    """Why a batch of this pipeline cannot take the ``jvm`` path (None: it can)."""
    keyed = decoder if isinstance(decoder, KeyedDecoder) else None
    value = keyed.value if keyed is not None else decoder
    if not isinstance(value, JsonDecoder):
        return f"format {config.format.type} decodes in the read tasks (the JVM path decodes plain JSON)"
    if keyed is not None and not isinstance(keyed.key, TextKey | JsonKey):
        return "key_format decodes keys in the read tasks (the JVM path decodes text, bytes and JSON keys)"
    return java_options(config.kafka_client_config())[1]


def read_ranges(spark: SparkSession, ranges: list[OffsetRange], config: PipelineConfig, decoder: Decoder, parallelism: int) -> DataFrame:
    """The committed records of ``ranges`` (none empty) as the read tasks' frame
    (``reader.RAW_SCHEMA``, with ``KEY_PARSED`` for a text key) plus ``IN_PYTHON`` and
    ``BEFORE_GREGORIAN``; lazy until an action."""
    from pyspark.sql import functions as F

    options, why_not = java_options(config.kafka_client_config())
    assert why_not is None, why_not  # ``problem`` said the path is open
    assign: dict[str, list[int]] = {}
    starts: dict[str, dict[str, int]] = {}
    ends: dict[str, dict[str, int]] = {}
    for r in ranges:
        assign.setdefault(r.topic, []).append(r.partition)
        starts.setdefault(r.topic, {})[str(r.partition)] = r.start
        ends.setdefault(r.topic, {})[str(r.partition)] = r.end
    source = (
        spark.read.format("kafka")
        .options(**options)
        .option("kafka.isolation.level", "read_committed")
        .option("assign", json.dumps(assign))
        .option("startingOffsets", json.dumps(starts))
        .option("endingOffsets", json.dumps(ends))
        .option("includeHeaders", "true")
        .option("failOnDataLoss", "true")
        .option("kafkaConsumer.pollTimeoutMs", str(int(config.read_timeout_seconds * 1000)))
        # as many splits as the read tasks would make, so every core reads
        .option("minPartitions", str(max(1, len(split_ranges(ranges, parallelism)))))
        .load()
    )
    frame = source.select(
        "key",
        "value",
        F.when(F.size("headers") > 0, F.col("headers")).alias("headers"),
        "topic",
        "partition",
        "offset",
        _timestamp(F.col("timestamp"), F.col("timestampType")).alias("timestamp"),
        _read_problem(F.col("key"), F.col("value"), F.col("timestamp"), F.col("timestampType"), config.max_record_bytes).alias(
            "read_problem"
        ),
        (F.unix_micros(F.col("timestamp")) < F.lit(_GREGORIAN_US)).alias(BEFORE_GREGORIAN),
    )
    key = keyed.key if isinstance((keyed := decoder), KeyedDecoder) else None
    if isinstance(key, TextKey):  # what the read tasks decode: the key as it is, or as text
        frame = frame.withColumn(KEY_PARSED, F.struct(F.col("key").cast("string" if key.text else "binary").alias(key.columns()[0][0])))
    return frame.withColumn(IN_PYTHON, F.col("read_problem").isNull() & _suspects(decoder))


def _stamped(timestamp: Column, kind: Column) -> Column:
    """A record that carries a timestamp: a type, and not Kafka's -1 for none."""
    from pyspark.sql import functions as F

    return (kind >= 0) & (F.unix_millis(timestamp) != F.lit(NO_TIMESTAMP))


def _in_range(timestamp: Column) -> Column:
    from pyspark.sql import functions as F

    return F.unix_millis(timestamp).between(TIMESTAMP_MIN_MS, TIMESTAMP_MAX_MS)


def _timestamp(timestamp: Column, kind: Column) -> Column:
    """The record's timestamp as the read tasks keep it: null without one or outside years 1-9999."""
    from pyspark.sql import functions as F

    return F.when(_stamped(timestamp, kind) & _in_range(timestamp), timestamp)


def _read_problem(key: Column, value: Column, timestamp: Column, kind: Column, limit: int) -> Column:
    """The read tasks' ``read_problem``: too large first (``reader.record_size_problems``), then a
    timestamp the sink cannot hold."""
    from pyspark.sql import functions as F

    size = F.coalesce(F.octet_length(key), F.lit(0)) + F.coalesce(F.octet_length(value), F.lit(0))
    too_large = F.when(size > F.lit(limit), reasons.record_too_large_column(size, limit))
    out_of_range = F.when(_stamped(timestamp, kind) & ~_in_range(timestamp), reasons.timestamp_range_column(F.unix_millis(timestamp)))
    return F.coalesce(too_large, out_of_range)


def _suspects(decoder: Decoder) -> Column:
    """The records the JVM does not judge alone (see the module doc)."""
    from pyspark.sql import functions as F

    keyed = decoder if isinstance(decoder, KeyedDecoder) else None
    suspect = structure_suspects(F.col("value"))
    if keyed is not None and isinstance(keyed.key, TextKey) and keyed.key.text:
        suspect = suspect | (F.col("key").isNotNull() & F.try_validate_utf8(F.col("key").cast("string")).isNull())
    return suspect


def python_problems(suspects: DataFrame, decoder: Decoder) -> pa.Table:
    """What the read tasks' decoders say about ``suspects`` (the decoded frame's ``IN_PYTHON``
    records, read problems none): per record with a problem, its topic, partition, offset and
    reason. One Spark job over just these records; a handful in a batch of hostile input."""
    schema = pa.schema([("topic", pa.string()), ("partition", pa.int32()), ("offset", pa.int64()), ("problem", pa.string())])

    def judge(batches: Any) -> Any:
        for batch in batches:
            problems = judged(decoder, batch.column("value").to_pylist(), batch.column("key").to_pylist())
            if problems is None:
                continue
            keep = pa.array([p is not None for p in problems])
            yield pa.RecordBatch.from_arrays(
                [batch.column("topic"), batch.column("partition"), batch.column("offset"), pa.array(problems, pa.string())], schema=schema
            ).filter(keep)

    from pyspark.sql.pandas.types import from_arrow_schema

    frame = suspects.select("topic", "partition", "offset", "key", "value").mapInArrow(judge, from_arrow_schema(schema))
    return frame.toArrow().cast(schema)


def judged(decoder: Decoder, values: list[bytes | None], keys: list[bytes | None]) -> list[str | None] | None:
    """The read tasks' per-record problems of these values and keys (``reader.decided_columns``):
    the value decoder's, then the key decoder's; None when there are none."""
    from offsetlake.reader import merged_problems

    problems = decoder.decode_chunk(values).problems
    if isinstance(decoder, KeyedDecoder) and decoder.key.read_type() is not None:
        problems = merged_problems(problems, decoder.key.decode_chunk(keys).problems)
    return problems


def read_tasks_reason(err: BaseException) -> str | None:
    """Why a failure of a ``jvm`` batch's read sends the batch to the read tasks (None: it does
    not; the failure is the batch's). A cancelled job (a stream told to stop) stays cancelled."""
    head = [line.strip() for line in str(err).strip().splitlines()[:4]]
    if any("cancel" in line.lower() for line in head):
        return None
    failure = next((line for line in head if any(word in line for word in _SOURCE_FAILURES)), None)
    if failure is None:
        return None
    if "overflows when converting" in failure:
        return "a record's timestamp overflows Spark's microseconds, which fails Spark's Kafka source"
    return f"Spark's Kafka source failed ({failure.removeprefix(': ')[:300]})"
