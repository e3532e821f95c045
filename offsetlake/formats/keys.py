"""Record keys (``key_format``): what a Kafka key becomes in the sink.

``string`` (the default) and ``bytes`` keep the key in one column, ``_kafka_key`` (null for a
record without a key). Record keys become named columns, ``<prefix><field>``: ``json`` parsed
against ``key_format.schema`` in Spark, ``avro`` and ``protobuf`` in the Confluent wire format
through the Schema Registry (subject ``<topic>-key``; the registry of ``key_format`` or else the
value format's), decoded in the read tasks by the value formats' own decoders. A key's reader
schema is fixed when the batch is planned, recorded in the plan beside the value's
(``ReaderSchema.key``), so a rerun decodes keys identically too.

A key that cannot be decoded (not UTF-8 under ``string``, no wire-format header, an unknown
schema id, a payload that does not parse, JSON that does not match) makes its record a dead
letter whose reason starts with ``key:`` (invariant 8); a registry outage fails the batch.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any, Protocol

import pyarrow as pa

from offsetlake.config import KEY_COLUMN, AvroFormat, KeyFormat, ProtobufFormat
from offsetlake.coordinates import OFFSET, PARTITION, ROW_INDEX, TIMESTAMP, TOPIC
from offsetlake.errors import ConfigError
from offsetlake.formats import REASON, DecodedChunk, Decoder, reasons
from offsetlake.plan import ReaderSchema

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from offsetlake.config import PipelineConfig

KEY_PARSED = "_key_parsed"  # the decoded key: a struct of the key's fields (inner names)
_JSON_CORRUPT = "_corrupt_key"


class KeyDecoder(Protocol):
    """One pipeline's key format."""

    def columns(self) -> list[tuple[str, str]]:
        """(sink column, field of KEY_PARSED) for each column the key gives."""
        ...

    def read_type(self) -> pa.StructType | None:
        """The Arrow type of KEY_PARSED when the read tasks decode the keys, else None."""
        ...

    def decode_chunk(self, keys: list[bytes | None]) -> DecodedChunk:
        """In the read task: KEY_PARSED of one chunk and per-record problems (``key: ...``)."""
        ...

    def decode_in_spark(self, decoded: DataFrame) -> DataFrame:
        """Adds KEY_PARSED when the tasks did not, and amends REASON for keys that fail."""
        ...


def effective_key_format(config: PipelineConfig, sink_columns: set[str] | None = None) -> KeyFormat:
    """The pipeline's ``key_format``; when the file sets none: ``string``, except for a sink that
    exists without a ``_kafka_key`` column (written before key_format existed, or under
    ``key_format: none``), which keeps its shape (``none``) until the file says otherwise."""
    if config.key_format is not None:
        return config.key_format
    if sink_columns is not None and KEY_COLUMN not in sink_columns:
        return KeyFormat(type="none")
    return KeyFormat()


def registry_settings(config: PipelineConfig) -> dict[str, str]:
    """The registry a key reads through: ``key_format.schema_registry``, else the value format's."""
    if config.key_format is not None and config.key_format.schema_registry:
        return dict(config.key_format.schema_registry)
    return dict(getattr(config.format, "schema_registry", {}) or {})


def _key_config(config: PipelineConfig, key: KeyFormat) -> PipelineConfig:
    """The pipeline as if its values were its keys: what the value decoders take."""
    if not key.subject and config.topic is None:
        raise ConfigError(
            f"key_format.subject is needed: the pipeline reads {config.topic_label}, so there is no one <topic>-key subject to default to",
            pipeline=config.name,
        )
    fields: dict[str, Any] = {
        "schema_registry": registry_settings(config),
        "subject": key.subject or f"{config.topic}-key",
        "version": key.version,
    }
    fmt = AvroFormat(type="avro", **fields) if key.type == "avro" else ProtobufFormat(type="protobuf", message=key.message, **fields)
    return config.model_copy(update={"format": fmt})


def resolve_key_schema(config: PipelineConfig, sink_columns: set[str] | None = None) -> ReaderSchema | None:
    """How a new plan's keys decode (None: no key column): ``string``/``bytes``, the json key's
    schema, or the key subject's version. Raises ConfigError and SchemaRegistryUnavailableError;
    nothing has been read then."""
    key = effective_key_format(config, sink_columns)
    if key.type == "none":
        return None
    if key.type in ("string", "bytes"):
        return ReaderSchema(source=key.type, fingerprint=key.type)
    if key.type == "json":
        text = json.dumps({"schema": key.schema_}, separators=(",", ":"))
        return ReaderSchema(source="yaml", fingerprint="sha256:" + hashlib.sha256(text.encode()).hexdigest(), text=text)
    from offsetlake.formats import registry as sr
    from offsetlake.formats.avro_records import fingerprint

    schema = sr.registry_reader_schema(_key_config(config, key), key.type.upper(), fingerprint, field="key_format")
    key_decoder_for(config, schema)  # its columns map to Delta's, or ConfigError now
    return schema


def key_decoder_for(config: PipelineConfig, schema: ReaderSchema | None) -> KeyDecoder | None:
    """The decoder of the keys a plan recorded (``schema``, its ``ReaderSchema.key``; None: keys
    are not kept, as in plans made before key_format existed)."""
    if schema is None:
        return None
    if schema.source in ("string", "bytes"):
        return TextKey(schema.source == "string")
    prefix = config.key_format.prefix if config.key_format is not None else ""
    if schema.source == "yaml":
        return JsonKey(json.loads(schema.text or "{}").get("schema", {}), prefix)
    key = config.key_format
    if key is None or not key.uses_registry:
        raise ConfigError(
            f"the batch's plan decodes keys with {schema.describe()}, but "
            f"key_format is now {key.type if key else 'not set'}; restore key_format (avro or protobuf) "
            "to finish the batch as planned",
            pipeline=config.name,
        )
    from offsetlake.formats import value_decoder_for

    return RecordKey(value_decoder_for(_key_config(config, key), schema), key.prefix)


class TextKey:
    """A key as one column: UTF-8 text (``string``) or the bytes themselves (``bytes``)."""

    def __init__(self, text: bool) -> None:
        self.text = text
        self._type = pa.struct([pa.field(KEY_COLUMN, pa.string() if text else pa.binary())])

    def columns(self) -> list[tuple[str, str]]:
        return [(KEY_COLUMN, KEY_COLUMN)]

    def read_type(self) -> pa.StructType:
        return self._type

    def decode_chunk(self, keys: list[bytes | None]) -> DecodedChunk:
        raw = pa.array(keys, pa.binary())
        problems: list[str | None] | None = None
        if self.text:
            try:
                column = raw.cast(pa.string())  # validates UTF-8 for the whole chunk at once
            except pa.ArrowInvalid:
                texts: list[str | None] = []
                problems = [None] * len(keys)
                for i, k in enumerate(keys):
                    try:
                        texts.append(k.decode("utf-8") if k is not None else None)
                    except UnicodeDecodeError as err:
                        texts.append(None)
                        problems[i] = reasons.key_undecodable(
                            f"is not UTF-8 text (byte {err.start}); key_format: bytes keeps keys as they are"
                        )
                column = pa.array(texts, pa.string())
        else:
            column = raw
        return DecodedChunk(pa.StructArray.from_arrays([column], fields=list(self._type)), problems)

    def decode_in_spark(self, decoded: DataFrame) -> DataFrame:
        return decoded


class RecordKey:
    """A key decoded by a registry format's value decoder (Avro, Protobuf), its fields as columns."""

    def __init__(self, inner: Decoder, prefix: str) -> None:
        self.inner = inner
        self.prefix = prefix
        read_type = inner.read_type()
        assert read_type is not None, "the registry decoders decode in the read tasks"
        self._type = read_type

    def columns(self) -> list[tuple[str, str]]:
        return [(f"{self.prefix}{name}", name) for name in self.inner.fields()]

    def read_type(self) -> pa.StructType:
        return self._type

    def decode_chunk(self, keys: list[bytes | None]) -> DecodedChunk:
        present = [i for i, k in enumerate(keys) if k is not None]
        if not present:
            return DecodedChunk(pa.nulls(len(keys), self._type), None)
        inner = self.inner.decode_chunk([keys[i] for i in present])
        assert inner.parsed is not None
        where: list[int | None] = [None] * len(keys)
        for n, i in enumerate(present):
            where[i] = n
        parsed = inner.parsed.take(pa.array(where, pa.int64()))
        problems: list[str | None] | None = None
        if inner.problems is not None:
            problems = [None] * len(keys)
            for n, i in enumerate(present):
                problem = inner.problems[n]
                if problem is not None:
                    problems[i] = reasons.key_undecodable(problem)
        return DecodedChunk(parsed, problems)

    def decode_in_spark(self, decoded: DataFrame) -> DataFrame:
        return decoded


class JsonKey:
    """A JSON key parsed against ``key_format.schema`` by Spark's ``from_json``."""

    def __init__(self, schema: dict[str, str], prefix: str) -> None:
        self.schema = dict(schema)
        self.prefix = prefix

    def columns(self) -> list[tuple[str, str]]:
        return [(f"{self.prefix}{name}", name) for name in self.schema]

    def read_type(self) -> None:
        return None

    def decode_chunk(self, keys: list[bytes | None]) -> DecodedChunk:
        return DecodedChunk(None, None)

    def decode_in_spark(self, decoded: DataFrame) -> DataFrame:
        from pyspark.sql import functions as F

        from offsetlake.formats.json_records import spark_json_options

        ddl = ", ".join(f"`{name}` {kind}" for name, kind in self.schema.items())
        text = F.col("key").cast("string")
        parsed = F.from_json(text, f"{ddl}, `{_JSON_CORRUPT}` string", spark_json_options(_JSON_CORRUPT))
        # a record with a read problem (too large among them) is a dead letter already: never parsed
        out = decoded.withColumn(KEY_PARSED, F.when(F.col("key").isNotNull() & F.col("read_problem").isNull(), parsed))
        utf8_ok = F.try_validate_utf8(text).isNotNull() if hasattr(F, "try_validate_utf8") else F.lit(True)
        bad = F.col("key").isNotNull() & (
            ~utf8_ok | F.col(KEY_PARSED).isNull() | ~text.rlike(r"^\s*\{") | F.col(f"{KEY_PARSED}.{_JSON_CORRUPT}").isNotNull()
        )
        problem = F.when(bad, F.lit(reasons.key_undecodable("does not parse as a JSON object matching key_format.schema")))
        return out.withColumn(REASON, F.coalesce(F.col(REASON), problem))


class KeyedDecoder:
    """A value decoder and a key decoder as one Decoder: the value's columns, then the key's."""

    def __init__(self, value: Decoder, key: KeyDecoder, pipeline: str) -> None:
        self.value = value
        self.key = key
        clash = [
            column for column, _ in key.columns() if column in value.fields() or column in (TOPIC, PARTITION, OFFSET, TIMESTAMP, ROW_INDEX)
        ]
        if clash:
            raise ConfigError(
                f"key column '{clash[0]}' is also a value field or a coordinate "
                "column; set key_format.prefix (e.g. key_) to name the key's columns apart",
                pipeline=pipeline,
            )

    def fields(self) -> list[str]:
        return [*self.value.fields(), *(column for column, _ in self.key.columns())]

    def read_type(self) -> pa.StructType | None:
        return self.value.read_type()

    @property
    def rows_in_read(self) -> bool:
        # a key the read tasks decode (text, bytes, a registry format) gets nothing more in Spark
        return self.value.rows_in_read and self.key.read_type() is not None

    def decode_chunk(self, values: list[bytes | None]) -> DecodedChunk:
        return self.value.decode_chunk(values)

    def decode_in_spark(self, raw: DataFrame) -> DataFrame:
        return self.key.decode_in_spark(self.value.decode_in_spark(raw))

    def check_types(self, where: str) -> None:
        """The value's types; a JSON key's were checked against Spark's grammar when the file loaded."""
        self.value.check_types(where)
