"""Record formats: how a Kafka record's value becomes typed columns, or a dead letter with a reason.

The vocabulary (``REASON``, ``PARSED``, ``Decoder``, ...) and the registry of formats are in
``formats.base`` (re-exported here); this module picks a pipeline's decoder through that registry
(``decoder_for``), and ``good_rows`` and ``dead_letter_rows`` split the result the same way for
every format.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from offsetlake.coordinates import OFFSET, PARTITION, TIMESTAMP, TOPIC
from offsetlake.formats import reasons
from offsetlake.formats.base import (
    CHANGE,
    DELETE,
    PARSED,
    PARSED_IN_READ,
    REASON,
    SKIP,
    TOMBSTONE,
    UPSERT,
    DecodedChunk,
    Decoder,
    format_named,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from offsetlake.config import PipelineConfig
    from offsetlake.plan import ReaderSchema

__all__ = [
    "CHANGE",
    "DELETE",
    "PARSED",
    "PARSED_IN_READ",
    "REASON",
    "SKIP",
    "TOMBSTONE",
    "UPSERT",
    "DecodedChunk",
    "Decoder",
    "dead_letter_rows",
    "decoder_for",
    "good_rows",
    "reasons",
    "resolve_reader_schema",
    "value_decoder_for",
]


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
    return format_named(config.format.type).reader_schema(config)


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
    from offsetlake.formats.debezium import EnvelopeDecoder

    where = config.source_file or f"pipeline {config.name}"

    def needs_before(row_fields: list[str]) -> bool:  # a delete keyed by the record key needs no before
        return not config.sink.removes_keys or any(column in row_fields for column in config.sink.key)

    fmt = format_named(config.format.type)
    if config.format.envelope != "debezium":
        return fmt.decoder(config, reader_schema)
    if fmt.envelope is not None:
        return fmt.envelope(config, reader_schema, where, needs_before)
    inner = fmt.decoder(config, reader_schema)
    fields = EnvelopeDecoder.row_fields_of(inner, where)
    return EnvelopeDecoder(inner, fields, [], where, needs_before(fields))


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
