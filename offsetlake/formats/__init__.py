"""Record formats: how a Kafka record's value becomes typed columns, or a dead letter with a reason.

A decoder turns the values of one consumed chunk into Arrow columns inside the Spark read task
(``decode_chunk``, never record by record in the driver), and finishes in Spark whatever the read
task left undecided (``decode_in_spark``), producing the struct column ``PARSED`` and the column
``REASON``: null for a good record, the dead-letter reason otherwise (invariant 8: nothing is
dropped). ``good_rows`` and ``dead_letter_rows`` split the result the same way for every format.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import pyarrow as pa

from offsetlake.coordinates import OFFSET, PARTITION, TIMESTAMP, TOPIC
from offsetlake.formats import reasons

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from offsetlake.config import PipelineConfig
    from offsetlake.plan import ReaderSchema

REASON = "_dead_letter_reason"  # null for a good record, else why it is a dead letter (``formats.reasons``)
PARSED = "_parsed"  # the decoded value: a struct of the format's fields
PARSED_IN_READ = "_parsed_in_read"  # what the read task decoded (null: left to Spark)
TOMBSTONE = reasons.TOMBSTONE  # the dead-letter reason of a null value
# What a good record does to a keyed sink (``offsetlake.keyed``): null (or "upsert") writes its
# row, "delete" removes its key's row, "skip" does nothing (a Debezium tombstone after a delete).
# Set by an envelope decoder or by ``keyed.mark_tombstones``; never a sink column.
CHANGE = "_offsetlake_change"
UPSERT, DELETE, SKIP = "upsert", "delete", "skip"


@dataclass(frozen=True)
class DecodedChunk:
    """What a read task decided about one chunk's values.

    ``parsed``: the decoded values (``read_type()``), null where the task left a record to
    ``decode_in_spark``; None when the decoder decodes nothing in the tasks. ``problems``: per
    record, the dead-letter reason the task already knows (null: none), or None for no problem.
    """

    parsed: pa.StructArray | None
    problems: list[str | None] | None
    settled: list[bool] | None = None  # per record: certainly a row (decoded, required fields present)


class Decoder(Protocol):
    """One pipeline's record format."""

    @property
    def rows_in_read(self) -> bool:
        """True when a record ``decode_chunk`` settled is a row made of exactly what the read task
        decoded (``decode_in_spark`` adds nothing to it): the read tasks may then write it
        themselves (``offsetlake.direct``)."""
        ...

    def fields(self) -> list[str]:
        """The sink columns a decoded value gives, in order."""
        ...

    def read_type(self) -> pa.StructType | None:
        """The Arrow type of the values ``decode_chunk`` decodes, or None when it decodes none
        (it may still find problems)."""
        ...

    def decode_chunk(self, values: list[bytes | None]) -> DecodedChunk:
        """Runs in the read task, for one chunk: decoded values and per-record problems."""
        ...

    def decode_in_spark(self, raw: DataFrame) -> DataFrame:
        """``raw`` (the read columns, with PARSED_IN_READ if ``read_type``) plus PARSED and REASON."""
        ...

    def check_types(self, where: str) -> None:
        """Before a batch reads: the format's types through Spark's own parser (ConfigError if not)."""
        ...


def resolve_reader_schema(config: PipelineConfig, sink_columns: set[str] | None = None) -> ReaderSchema:
    """The reader schema a new plan records (invariant 12): the YAML schema for ``json``; the
    subject's latest or pinned version for the registry formats, or the local ``.avsc`` for
    ``avro``; with how keys decode (``ReaderSchema.key``; ``sink_columns``, the existing sink's,
    decide an unset ``key_format``, see ``keys.effective_key_format``). Raises ConfigError (a
    schema that has no Delta mapping, a subject that does not exist) and
    SchemaRegistryUnavailableError; nothing has been read then."""
    from dataclasses import replace

    from offsetlake.formats.keys import resolve_key_schema

    value = _value_reader_schema(config)
    key = resolve_key_schema(config, sink_columns)
    return replace(value, key=key) if key is not None else value


def _value_reader_schema(config: PipelineConfig) -> ReaderSchema:
    from offsetlake.config import JsonFormat

    if isinstance(config.format, JsonFormat):
        from offsetlake.formats.json_records import yaml_reader_schema

        return yaml_reader_schema(config.format)
    if config.format.type == "json_schema":
        from offsetlake.formats.json_schema_records import resolve_reader_schema as json_schema_reader_schema

        return json_schema_reader_schema(config)
    if config.format.type == "protobuf":
        from offsetlake.formats.protobuf_records import resolve_reader_schema as protobuf_reader_schema

        return protobuf_reader_schema(config)
    from offsetlake.formats.avro_records import resolve_reader_schema as avro_reader_schema

    return avro_reader_schema(config)


def decoder_for(config: PipelineConfig, reader_schema: ReaderSchema | None = None, sink_columns: set[str] | None = None) -> Decoder:
    """The decoder of the pipeline's ``format`` and ``key_format``, decoding into ``reader_schema``
    (a plan's; the one a new plan would record when None)."""
    from offsetlake.formats.keys import KeyedDecoder, key_decoder_for

    reader_schema = reader_schema or resolve_reader_schema(config, sink_columns)
    value = value_decoder_for(config, reader_schema)
    key = key_decoder_for(config, reader_schema.key)
    return KeyedDecoder(value, key, config.name) if key is not None else value


def value_decoder_for(config: PipelineConfig, reader_schema: ReaderSchema) -> Decoder:
    """The decoder of the pipeline's ``format`` alone (of the rows its Debezium envelopes carry,
    with ``format.envelope: debezium``)."""
    from offsetlake.config import JsonFormat
    from offsetlake.formats.debezium import EnvelopeDecoder, envelope_json_format

    where = config.source_file or f"pipeline {config.name}"

    def needs_before(row_fields: list[str]) -> bool:  # a delete keyed by the record key needs no before
        return config.sink.mode != "upsert" or any(column in row_fields for column in config.sink.key)

    if isinstance(config.format, JsonFormat):
        from offsetlake.formats.json_records import JsonDecoder, json_format_of

        fmt = json_format_of(reader_schema, config.format)
        if config.format.envelope == "debezium":
            fields = list(fmt.schema_)
            return EnvelopeDecoder(JsonDecoder(envelope_json_format(fmt)), fields, list(fmt.required), where, needs_before(fields))
        return JsonDecoder(fmt)
    inner = _registry_value_decoder(config, reader_schema)
    if config.format.envelope == "debezium":
        fields = EnvelopeDecoder.row_fields_of(inner, where)
        return EnvelopeDecoder(inner, fields, [], where, needs_before(fields))
    return inner


def _registry_value_decoder(config: PipelineConfig, reader_schema: ReaderSchema) -> Decoder:
    if config.format.type == "json_schema":
        from offsetlake.formats.json_schema_records import JsonSchemaDecoder

        return JsonSchemaDecoder(config, reader_schema)
    if config.format.type == "protobuf":
        from offsetlake.formats.protobuf_records import ProtobufDecoder

        return ProtobufDecoder(config, reader_schema)
    from offsetlake.formats.avro_records import AvroDecoder

    return AvroDecoder(config, reader_schema)


def good_rows(decoded: DataFrame, decoder: Decoder) -> DataFrame:
    """Decoded records as sink rows: the format's fields plus the coordinate columns."""
    from pyspark.sql import functions as F

    from offsetlake.formats.keys import KEY_PARSED, KeyedDecoder

    keyed = decoder if isinstance(decoder, KeyedDecoder) else None
    value_fields = keyed.value.fields() if keyed is not None else decoder.fields()
    key_columns = keyed.key.columns() if keyed is not None else []
    good = F.col(REASON).isNull()
    change = []
    if CHANGE in decoded.columns:  # a record that changes nothing (SKIP) is neither a row nor a dead letter
        good = good & (F.coalesce(F.col(CHANGE), F.lit(UPSERT)) != SKIP)
        change = [F.coalesce(F.col(CHANGE), F.lit(UPSERT)).alias(CHANGE)]
    return decoded.where(good).select(
        *[F.col(f"{PARSED}.`{name}`").alias(name) for name in value_fields],
        *[F.col(f"{KEY_PARSED}.`{inner}`").alias(column) for column, inner in key_columns],
        F.col("topic").alias(TOPIC),
        F.col("partition").alias(PARTITION),
        F.col("offset").alias(OFFSET),
        F.col("timestamp").alias(TIMESTAMP),
        *change,
    )


def dead_letter_rows(decoded: DataFrame, pipeline: str, batch_id: str) -> DataFrame:
    """Records with a REASON as dead-letter rows (raw key, value and headers kept), the reason
    split into its text and its code (``formats.reasons``)."""
    from pyspark.sql import functions as F

    return decoded.where(F.col(REASON).isNotNull()).select(
        F.col("topic").alias(TOPIC),
        F.col("partition").alias(PARTITION),
        F.col("offset").alias(OFFSET),
        F.col("timestamp").alias(TIMESTAMP),
        "key",
        "value",
        "headers",
        reasons.text_column(F.col(REASON)).alias("reason"),
        F.lit(pipeline).alias("pipeline"),
        F.lit(batch_id).alias("batch_id"),
        reasons.code_column(F.col(REASON)).alias("reason_code"),
    )
