"""The pipeline definition as a typed model: every field and every cross-field rule.

``PipelineConfig.model_validate`` enforces all of it, the rules between fields included (a
partition column the rows cannot have, a suite or transform file that is not there, storage
settings for a local lake), so a config built anywhere is as checked as one ``load_pipeline``
read. Kafka client options are passed to librdkafka unchanged and are never logged:
``PipelineConfig.redacted_kafka_options`` is the only view of them meant for humans.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator
from pydantic_core import PydanticCustomError

from offsetlake import storage
from offsetlake.config.ddl import PARTITION_COLUMN_TYPES, spark_type_problem
from offsetlake.config.layout import LakeLayout, app_id
from offsetlake.config.registry_settings import registry_options, registry_settings_problem
from offsetlake.errors import ConfigError

PIPELINE_NAME = re.compile(r"^[a-z0-9_]+$")
_SECRET_KEY = re.compile(r"(password|secret|jaas|token|key\.pem|keystore|truststore|credential)", re.I)
# ``max_record_bytes``: the default lets the issue-35 records (a 95 MB JSON value beside a 50 MB
# one in one consume call) through on both data paths with the 2g driver; the ceiling is
# librdkafka's own largest message (message.max.bytes, 1,000,000,000).
DEFAULT_MAX_RECORD_BYTES = 128 * 1024 * 1024
MAX_RECORD_BYTES_CEILING = 1_000_000_000


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class KafkaSettings(_Strict):
    bootstrap_servers: str = Field(min_length=1)
    # librdkafka properties, e.g. security.protocol, sasl.mechanism, sasl.password, ssl.ca.location.
    options: dict[str, str] = Field(default_factory=dict)

    @field_validator("options", mode="before")
    @classmethod
    def _stringify(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {str(k): str(v).lower() if isinstance(v, bool) else str(v) for k, v in value.items()}
        return value

    @field_validator("options")
    @classmethod
    def _no_managed_keys(cls, value: dict[str, str]) -> dict[str, str]:
        managed = {"bootstrap.servers", "isolation.level", "enable.auto.commit", "group.id"}
        clash = sorted(managed & value.keys())
        if clash:
            raise ValueError(f"{', '.join(clash)} are set by offsetlake and may not be overridden")
        return value


class JsonFormat(_Strict):
    type: Literal["json"] = "json"
    # field name -> Spark SQL type (string, long, double, boolean, timestamp, date, decimal(p,s), ...)
    schema_: dict[str, str] = Field(alias="schema", min_length=1)
    required: list[str] = Field(default_factory=list)
    # debezium: values are Debezium change events; ``schema`` declares the table's row (the
    # fields of before/after), see ``offsetlake.formats.debezium``
    envelope: Literal["debezium"] | None = None

    @field_validator("schema_")
    @classmethod
    def _known_types(cls, value: dict[str, str]) -> dict[str, str]:
        for name, type_name in value.items():
            if name.startswith("_kafka_"):
                raise ValueError(f"field '{name}': names starting with _kafka_ are reserved for coordinates")
            problem = spark_type_problem(str(type_name))
            if problem:
                raise ValueError(f"field '{name}': type '{type_name}': {problem}")
        return value

    @model_validator(mode="after")
    def _required_declared(self) -> JsonFormat:
        unknown = [name for name in self.required if name not in self.schema_]
        if unknown:
            raise ValueError(f"required names fields not in schema: {', '.join(unknown)}")
        return self

    def ddl(self) -> str:
        """The schema as a Spark DDL string, e.g. ``order_id long, customer string``."""
        return ", ".join(f"`{name}` {type_name}" for name, type_name in self.schema_.items())


class _RegistryFormat(_Strict):
    """What every registry-backed format has: the registry's client options (or the Airflow
    connection ``schema_registry_<pipeline>`` / ``schema_registry_default``), the subject and the
    version the reader schema is (the subject's latest when a batch is planned, or a pinned one)."""

    schema_registry: dict[str, str] = Field(default_factory=dict)
    subject: str | None = None  # default: <topic>-value (the TopicNameStrategy)
    version: int | Literal["latest"] = "latest"
    # debezium: values are Debezium change events (the schema is the envelope: before, after,
    # op, source, ...), see ``offsetlake.formats.debezium``
    envelope: Literal["debezium"] | None = None

    @field_validator("schema_registry", mode="before")
    @classmethod
    def _registry_options(cls, value: Any) -> Any:
        return registry_options(value)

    @field_validator("version")
    @classmethod
    def _positive_version(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError("a pinned version is 1 or more (or 'latest')")
        return value


class AvroFormat(_RegistryFormat):
    """Avro values: in the Confluent wire format with a Schema Registry, or without one against a
    local ``schema_file`` (.avsc next to the YAML) as plain Avro binary or Avro single-object
    encoding."""

    type: Literal["avro"]
    schema_file: str | None = None
    encoding: Literal["confluent", "binary", "single_object"] | None = None  # default: confluent, or binary with schema_file

    @model_validator(mode="after")
    def _one_schema_source(self) -> AvroFormat:
        if self.schema_file and self.schema_registry:
            raise ValueError("give schema_file (no registry) or schema_registry, not both")
        if self.schema_file and self.encoding == "confluent":
            raise ValueError("encoding confluent needs a schema registry; with schema_file use binary or single_object")
        if not self.schema_file and self.encoding in ("binary", "single_object"):
            raise ValueError(f"encoding {self.encoding} reads against a local schema_file (.avsc next to the YAML)")
        if self.schema_file and (self.subject or self.version != "latest"):
            raise ValueError("subject and version choose a registry schema; with schema_file leave them out")
        return self

    @property
    def uses_registry(self) -> bool:
        return not self.schema_file


class JsonSchemaFormat(_RegistryFormat):
    """JSON values in the Confluent wire format (magic byte, schema id, JSON text) whose schemas
    are JSON Schemas in a Schema Registry: each value is validated against its writer schema and
    parsed into the columns the reader schema's properties give (``formats.json_schema_records``)."""

    type: Literal["json_schema"]

    @property
    def uses_registry(self) -> bool:
        return True


class ProtobufFormat(_RegistryFormat):
    """Protobuf values in the Confluent wire format (magic byte, schema id, message indexes, the
    message) with their schemas in a Schema Registry: each decoded with its own writer schema and
    mapped by field name onto the reader message's columns (``formats.protobuf_records``)."""

    type: Literal["protobuf"]
    message: str | None = None  # the reader message's full name; default: the schema's first message

    @property
    def uses_registry(self) -> bool:
        return True


KEY_TYPES = ("none", "string", "bytes", "json", "avro", "protobuf")


class KeyFormat(_Strict):
    """What a record's key becomes (``formats.keys``): ``string`` (UTF-8 text) or ``bytes`` in
    one column ``_kafka_key``; ``json`` (against ``schema``), ``avro`` or ``protobuf`` (through
    the Schema Registry, subject ``<topic>-key``) as named columns, ``<prefix><field>``; ``none``
    keeps no key. ``key_format: bytes`` is short for ``key_format: {type: bytes}``."""

    type: Literal["none", "string", "bytes", "json", "avro", "protobuf"] = "string"
    schema_: dict[str, str] = Field(default_factory=dict, alias="schema")  # json: field -> Spark SQL type
    schema_registry: dict[str, str] = Field(default_factory=dict)  # default: format.schema_registry
    subject: str | None = None  # default: <topic>-key
    version: int | Literal["latest"] = "latest"
    message: str | None = None  # protobuf: the key message's full name (default: the schema's first)
    prefix: str = ""  # record keys: each field becomes the column <prefix><field>

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        return {"type": value} if isinstance(value, str) else value

    @field_validator("schema_registry", mode="before")
    @classmethod
    def _registry_options(cls, value: Any) -> Any:
        return registry_options(value)

    @field_validator("schema_")
    @classmethod
    def _types_parse(cls, value: dict[str, str]) -> dict[str, str]:
        for name, type_name in value.items():
            problem = spark_type_problem(type_name)
            if problem:
                raise ValueError(f"{name}: {problem}")
        return value

    @model_validator(mode="after")
    def _fits_the_type(self) -> KeyFormat:
        registry = self.type in ("avro", "protobuf")
        if self.type == "json" and not self.schema_:
            raise ValueError("a json key needs schema (field: Spark SQL type), its columns; for the text itself use string")
        if self.type != "json" and self.schema_:
            raise ValueError(f"schema is for json keys; a {self.type} key has none")
        if not registry and (self.schema_registry or self.subject or self.version != "latest"):
            raise ValueError(f"schema_registry, subject and version are for avro and protobuf keys, not {self.type}")
        if self.message and self.type != "protobuf":
            raise ValueError("message names a protobuf key's message")
        if self.prefix and self.type not in ("json", "avro", "protobuf"):
            raise ValueError(f"prefix names the columns of a record key; a {self.type} key is one column, _kafka_key")
        return self

    @property
    def uses_registry(self) -> bool:
        return self.type in ("avro", "protobuf")


KEY_COLUMN = "_kafka_key"  # the column of a string or bytes key


def key_columns(key: KeyFormat) -> dict[str, str]:
    """The sink columns a key gives that are known without a registry: column -> Spark SQL type."""
    if key.type in ("string", "bytes"):
        return {KEY_COLUMN: "string" if key.type == "string" else "binary"}
    if key.type == "json":
        return {f"{key.prefix}{name}": kind for name, kind in key.schema_.items()}
    return {}


_DURATION = re.compile(r"^([1-9][0-9]*)(s|m|h|d)$")
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3_600, "d": 86_400}
# the merge engines that keep state per key beside the rows (``offsetlake.engines``)
ENGINE_MODES = ("first_row", "partial_update", "aggregate")
MEASURE_FUNCTIONS = ("sum", "count", "min", "max", "first", "last", "last_non_null")


def duration_seconds(text: str) -> int:
    """Seconds of a duration written ``<n>s``, ``<n>m``, ``<n>h`` or ``<n>d`` (ValueError else)."""
    found = _DURATION.match(text.strip()) if isinstance(text, str) else None
    if found is None:
        raise ValueError(f"{text!r} is not a duration: write a whole number with s, m, h or d (30s, 5m, 1h, 7d)")
    return int(found.group(1)) * _DURATION_UNITS[found.group(2)]


class WindowSettings(_Strict):
    """An event-time window of an aggregate: ``on`` is a timestamp column of the rows; a record
    counts in the window ``[start, start + size)`` holding its ``on`` value, or, with ``slide``,
    in each of the ``size / slide`` windows starting every ``slide`` that hold it. The window's
    ``window_start`` and ``window_end`` are part of the row's key."""

    on: str = Field(min_length=1)
    size: str
    slide: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _yaml_on(cls, data: Any) -> Any:
        """YAML 1.1 reads an unquoted ``on:`` key as the boolean true: take it as ``on``."""
        if isinstance(data, dict) and True in data and "on" not in data:
            data = {("on" if k is True else k): v for k, v in data.items()}
        return data

    @model_validator(mode="after")
    def _sizes(self) -> WindowSettings:
        size = duration_seconds(self.size)
        if self.slide is not None:
            slide = duration_seconds(self.slide)
            if slide > size or size % slide:
                raise ValueError(f"window slide {self.slide} must divide size {self.size} (a record is in size/slide windows)")
        return self

    @property
    def size_seconds(self) -> int:
        return duration_seconds(self.size)

    @property
    def slide_seconds(self) -> int:
        return duration_seconds(self.slide) if self.slide is not None else self.size_seconds


class Measure(_Strict):
    """One output column of an aggregate: ``function`` over the rows' ``column`` (``*`` for
    ``count``: every record)."""

    name: str
    function: Literal["sum", "count", "min", "max", "first", "last", "last_non_null"]
    column: str


class SinkSettings(_Strict):
    # delta: a Delta table in the lake (the default). kafka: a topic (``offsetlake.kafka_sink``):
    # each batch's rows are produced in ONE Kafka transaction with the source end offsets
    # committed for the pipeline's group; the transaction is the commit point, the ledger follows.
    type: Literal["delta", "kafka"] = "delta"
    table: str | None = None  # path; relative paths are under the lake; default <lake>/<name>
    # kafka: the output topic (it must exist: its partitions are yours to choose); key: the
    # columns that become the record key (one: its value as text; several: a JSON array; none:
    # no key); format: how a row becomes the record value (json: an object of the row's columns
    # without the _kafka_* coordinates); dead_letter_topic: where records that became no row go,
    # in the same transaction, with the reason in headers (default <topic>.dead-letters).
    topic: str | None = Field(default=None, min_length=1)
    # format avro, json_schema, protobuf: the Confluent wire format through the Schema Registry
    # (``offsetlake.sink_values``): the schema derived from the output columns is registered
    # under ``subject`` (default <topic>-value), or with register: false only looked up there.
    format: Literal["json", "avro", "json_schema", "protobuf"] = "json"
    schema_registry: dict[str, str] = Field(default_factory=dict)  # default: format.schema_registry
    subject: str | None = Field(default=None, min_length=1)
    register_schema: bool = Field(default=True, alias="register")  # YAML: register
    dead_letter_topic: str | None = Field(default=None, min_length=1)
    partition_by: list[str] = Field(default_factory=list)
    # append: every record's rows are added. upsert: one row per key (``offsetlake.keyed``): the
    # newest record of each key replaces its row, a delete (tombstone, Debezium op d) removes it.
    # first_row, partial_update, aggregate: merge engines keeping each key's state beside its row
    # (``offsetlake.engines``): the first record per key; the non-null fields of every record;
    # declared measures per key (and window).
    mode: Literal["append", "upsert", "first_row", "partial_update", "aggregate"] = "append"
    key: list[str] = Field(default_factory=list)  # keyed modes: the columns that identify a row
    # upsert, partial_update: a record with a null value deletes its key's row (default); false:
    # a dead letter. first_row and aggregate take no deletes: a tombstone is a dead letter.
    delete_on_tombstone: bool = True
    # keyed modes: about how many rows each file a merge writes holds (files sorted by key; a
    # merge rewrites the files holding the keys its batch touches, so smaller files rewrite less)
    file_rows: int = Field(default=500_000, gt=0)
    # aggregate: output column -> {function: column}, e.g. revenue: {sum: amount}, orders: {count: "*"}
    measures: dict[str, dict[str, str]] = Field(default_factory=dict)
    window: WindowSettings | None = None  # aggregate: an event-time window, part of the key
    # aggregate with a window: a record whose Kafka timestamp is more than this after its
    # window's ``on`` value is a dead letter (``late_record``) instead of updating its window
    allowed_lateness: str | None = None
    # first_row: a horizon after which a key may be inserted again: a record at least this long
    # after the first record of its key's current episode starts a new episode, whose first
    # record becomes the key's row; measured on ``within_on`` (a timestamp column; default the
    # record's Kafka timestamp)
    within: str | None = None
    within_on: str | None = None

    @field_validator("schema_registry", mode="before")
    @classmethod
    def _registry_options(cls, value: Any) -> Any:
        return registry_options(value)

    @model_validator(mode="after")
    def _keyed(self) -> SinkSettings:
        if self.type == "kafka":
            self._kafka_fields()
            return self
        for name in ("topic", "dead_letter_topic", "subject"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name} applies to a Kafka sink (type: kafka), not to a Delta table")
        for name in ("format", "schema_registry", "register_schema"):
            if name in self.model_fields_set:
                name = name.removesuffix("_schema")
                raise ValueError(f"{name} applies to a Kafka sink (type: kafka); a Delta sink keeps the rows' own columns")
        if self.mode != "append" and not self.key:
            raise ValueError(f"mode {self.mode} needs key: [columns] (e.g. key: [_kafka_key], or the fields that identify a row)")
        if self.mode == "append" and self.key:
            raise ValueError(
                "key applies to the keyed modes (upsert, first_row, partial_update, aggregate); an append sink keeps every record's rows"
            )
        doubled = sorted({c for c in self.key if self.key.count(c) > 1})
        if doubled:
            raise ValueError(f"key: {', '.join(doubled)} listed more than once")
        coordinates = [c for c in self.key if c in ("_kafka_topic", "_kafka_partition", "_kafka_offset", "_kafka_timestamp", "_kafka_row")]
        if coordinates:
            raise ValueError(f"key: {coordinates[0]} is a record coordinate, not a key column (every record has its own)")
        self._engine_fields()
        return self

    def _kafka_fields(self) -> None:
        """A Kafka sink: a topic, the append mode (a log cannot replace or fold rows) and none of a
        Delta table's settings."""
        if self.topic is None:
            raise ValueError("a Kafka sink (type: kafka) needs topic: the topic its rows are produced to")
        if self.mode != "append":
            raise ValueError(
                f"a Kafka sink takes mode append only, not {self.mode}: a topic cannot replace or delete a key's row "
                "(produce to a compacted topic keyed by key: [columns] for newest-per-key, or use a Delta sink)"
            )
        for name in ("table", "partition_by"):
            if getattr(self, name):
                raise ValueError(f"{name} applies to a Delta sink; a Kafka sink writes to topic {self.topic}")
        for name in ("measures", "window", "allowed_lateness", "within", "within_on"):
            if getattr(self, name):
                raise ValueError(f"{name} applies to a Delta sink's merge engines, not to a Kafka sink")
        doubled = sorted({c for c in self.key if self.key.count(c) > 1})
        if doubled:
            raise ValueError(f"key: {', '.join(doubled)} listed more than once")
        if self.format == "json":
            for name in ("schema_registry", "subject", "register_schema"):
                if name in self.model_fields_set:
                    name = name.removesuffix("_schema")
                    raise ValueError(f"{name} applies to the registry formats (avro, json_schema, protobuf), not to format json")
        for name in ("topic", "dead_letter_topic"):
            value = getattr(self, name)
            if value is not None and not re.fullmatch(r"[A-Za-z0-9._-]{1,249}", value):
                raise ValueError(f"{name}: '{value}' is not a Kafka topic name (letters, digits, '.', '_', '-')")

    @property
    def is_kafka(self) -> bool:
        """The sink is a Kafka topic (``type: kafka``), not a Delta table."""
        return self.type == "kafka"

    @property
    def dead_letters_to(self) -> str:
        """A Kafka sink's dead-letter topic."""
        return self.dead_letter_topic or f"{self.topic}.dead-letters"

    def _engine_fields(self) -> None:
        if self.mode != "first_row":
            for name in ("within", "within_on"):
                if getattr(self, name):
                    raise ValueError(f"{name} applies to mode: first_row, not {self.mode}")
        elif self.within is not None:
            duration_seconds(self.within)
        elif self.within_on is not None:
            raise ValueError("within_on needs within: the horizon it measures")
        if self.mode != "aggregate":
            for name in ("measures", "window", "allowed_lateness"):
                if getattr(self, name):
                    raise ValueError(f"{name} applies to mode: aggregate, not {self.mode}")
            return
        if not self.measures:
            raise ValueError("mode aggregate needs measures: {output column: {function: column}}, e.g. revenue: {sum: amount}")
        self.aggregates()  # each measure well-formed
        if self.partition_by:
            raise ValueError("partition_by does not apply to mode: aggregate (its files are sorted by window and key instead)")
        if self.allowed_lateness is not None:
            if self.window is None:
                raise ValueError("allowed_lateness needs a window: it is measured from the window's `on` column")
            duration_seconds(self.allowed_lateness)
        taken = set(self.key) | ({"window_start", "window_end"} if self.window else set())
        clash = sorted(taken & set(self.measures))
        if clash:
            raise ValueError(f"measure {clash[0]} has the name of a key column")
        if self.delete_on_tombstone and "delete_on_tombstone" in self.model_fields_set:
            raise ValueError("mode aggregate takes no deletes: leave out delete_on_tombstone (a tombstone is a dead letter)")

    def aggregates(self) -> list[Measure]:
        """The declared measures, in order (ValueError naming a bad one)."""
        out = []
        for name, spec in self.measures.items():
            if not isinstance(spec, dict) or len(spec) != 1:
                raise ValueError(f"measure {name}: write one function and its column, e.g. {name}: {{sum: amount}}")
            [(function, column)] = spec.items()
            if name.startswith("__"):
                raise ValueError(f"measure {name}: names starting with __ are offsetlake's own")
            if function not in MEASURE_FUNCTIONS:
                raise ValueError(f"measure {name}: unknown function {function!r}; use one of {', '.join(MEASURE_FUNCTIONS)}")
            if column == "*" and function != "count":
                raise ValueError(f"measure {name}: only count takes '*' (every record)")
            out.append(Measure.model_validate({"name": name, "function": function, "column": str(column)}))
        return out

    @property
    def keyed(self) -> bool:
        """One row per key (and window): every mode but append."""
        return self.mode != "append"

    @property
    def engine(self) -> str | None:
        """The merge engine (``ENGINE_MODES``) or None (append, upsert)."""
        return self.mode if self.mode in ENGINE_MODES else None

    @property
    def removes_keys(self) -> bool:
        """Whether a delete removes its key's row (upsert and partial_update): a Debezium delete
        keyed by the record key needs no ``before``."""
        return self.mode in ("upsert", "partial_update")

    @property
    def deletes(self) -> bool:
        """Whether a tombstone deletes its key's row (upsert and partial_update)."""
        return self.removes_keys and self.delete_on_tombstone


class OutboxSettings(_Strict):
    """``outbox:``: the Airflow DAG ``<name>_outbox`` publishes the Delta sink's committed batches to
    ``topic`` after each commit, exactly as ``offsetlake publish <name> --to <topic> --key ...``."""

    topic: str = Field(min_length=1)
    key: list[str] = Field(default_factory=list)


class ValidationSettings(_Strict):
    # Great Expectations suite next to the YAML (a YAML list or a GX 1.x suite JSON); default
    # <name>.expectations.yaml in the pipeline's folder, used when that file exists.
    suite: str | None = None
    # fail: nothing is committed when any expectation fails. quarantine: records whose rows fail
    # a row-level expectation go to the dead-letter table, the rest commits; a failing
    # table-level expectation still fails the batch.
    on_failure: Literal["fail", "quarantine"] = "fail"
    examples: int = Field(default=5, ge=0, le=50)  # unexpected values shown per expectation


class PipelineConfig(_Strict):
    name: str
    # Exactly one of: one topic, a list, or a pattern (a regular expression a topic name must
    # match in full, as Kafka Connect's topics.regex; topics created later are picked up).
    topic: str | None = Field(default=None, min_length=1)
    topics: list[str] | None = None
    topic_pattern: str | None = None
    kafka: KafkaSettings
    lake: str = "lake"
    # Object-store settings for a lake (or sink.table) on s3:// (or gs://, az://), passed to
    # delta-rs and pyarrow: AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID,
    # AWS_SECRET_ACCESS_KEY, AWS_ALLOW_HTTP, ... (``offsetlake.storage``). Never logged.
    storage: dict[str, str] = Field(default_factory=dict)
    start: Literal["earliest", "latest"] = "earliest"
    max_records_per_batch: int = Field(default=500_000, gt=0)
    # A record whose key and value together hold more bytes is a dead letter (record_too_large),
    # whatever the records around it; every smaller one is decoded (``reader.record_size_problems``).
    max_record_bytes: int = Field(default=DEFAULT_MAX_RECORD_BYTES, gt=0, le=MAX_RECORD_BYTES_CEILING)
    read_timeout_seconds: float = Field(default=120.0, gt=0)
    on_offsets_lost: Literal["fail", "skip"] = "fail"
    # Airflow schedule of <name>_ingest: cron or preset, "on_new_data" (woken by records arriving,
    # offsetlake_airflow.wake), or null (manual runs only)
    schedule: str | None = "@hourly"
    format: JsonFormat | AvroFormat | JsonSchemaFormat | ProtobufFormat = Field(discriminator="type")
    # What the record key becomes; unset: string, or none for a sink from before key_format
    # (offsetlake.formats.keys.effective_key_format).
    key_format: KeyFormat | None = None
    # A batch whose records bring a new field: evolve (the sink gains a nullable column in that
    # batch's commit) or fail (the batch fails naming the change; nothing is committed).
    on_schema_change: Literal["evolve", "fail"] = "evolve"
    transform: str | None = None  # "module:function" found next to the YAML file
    # Which data path reads a batch and writes its rows (``offsetlake.process.choose_data_path``):
    # auto (the rule there), spark (read tasks read, Spark decodes and writes), direct (the read
    # tasks write the rows of an ingest or stream batch; refused here when the pipeline needs
    # Spark, ``spark_only_reason``) or jvm (Spark's Kafka source reads and Spark decodes a JSON
    # pipeline's batches, ``offsetlake.kafka_source``; refused here for what it cannot read).
    data_path: Literal["auto", "spark", "direct", "jvm"] = "auto"
    sink: SinkSettings = Field(default_factory=SinkSettings)
    validation: ValidationSettings = Field(default_factory=ValidationSettings)
    outbox: OutboxSettings | None = None  # lake -> Kafka after each commit (append Delta sinks)
    source_file: str = ""  # filled in by load_pipeline
    _layout: LakeLayout | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _one_topic_source(self) -> PipelineConfig:
        given = [n for n in ("topic", "topics", "topic_pattern") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of topic, topics, topic_pattern (given: {', '.join(given) or 'none'})")
        if self.topics is not None:
            if not self.topics or any(not t for t in self.topics):
                raise ValueError("topics: a list of one or more topic names")
            doubled = sorted({t for t in self.topics if self.topics.count(t) > 1})
            if doubled:
                raise ValueError(f"topics: {', '.join(doubled)} listed more than once")
        if self.topic_pattern is not None:
            try:
                re.compile(self.topic_pattern)
            except re.error as err:
                raise ValueError(f"topic_pattern: {self.topic_pattern!r} is not a regular expression: {err}") from None
        return self

    @model_validator(mode="after")
    def _fields_agree(self) -> PipelineConfig:
        """The rules between fields and the files beside the YAML, in the order a user fixes them;
        the first broken one is reported as ``<field>: <problem>``."""
        for check in (
            _locations_problem,
            _files_problem,
            _partition_columns_problem,
            _data_path_problem,
            _engine_problem,
            _kafka_sink_problem,
        ):
            found = check(self)
            if found:
                raise PydanticCustomError(FIELD_PROBLEM, "{field}: {problem}", {"field": found[0], "problem": found[1]})
        return self

    @property
    def topic_label(self) -> str:
        """The pipeline's source as messages name it: a topic, a list, or the pattern."""
        if self.topic is not None:
            return self.topic
        if self.topics is not None:
            return ", ".join(self.topics)
        return f"topics matching {self.topic_pattern}"

    @field_validator("name")
    @classmethod
    def _safe_name(cls, value: str) -> str:
        if not PIPELINE_NAME.match(value):
            raise ValueError(f"'{value}' is not allowed: pipeline names are [a-z0-9_]+")
        return value

    @field_validator("format", mode="before")
    @classmethod
    def _json_by_default(cls, value: Any) -> Any:
        if isinstance(value, dict) and "type" not in value:
            return {**value, "type": "json"}
        return value

    @field_validator("storage", mode="before")
    @classmethod
    def _storage_options(cls, value: Any) -> Any:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ValueError("expected a mapping of object-store settings (AWS_ENDPOINT_URL: ..., AWS_REGION: ...)")
        for key, item in value.items():
            if isinstance(item, (dict, list)) or item is None:
                raise ValueError(f"{key}: expected a plain value")
            problem = storage.option_problem(str(key), str(item))
            if problem:
                raise ValueError(f"{key}: {problem}")
        # an empty value (e.g. ${AWS_ENDPOINT_URL:-}) means the setting is not set
        return {str(k): (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in value.items() if str(v) != ""}

    @field_validator("transform")
    @classmethod
    def _transform_ref(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if re.match(r"^[A-Za-z_][\w]*\.[\w.]*:", value):
            raise ValueError(
                f"'{value}' names a module in a package; a transform is one module file next to the "
                "YAML (module:function, the module without dots), which Spark ships to its tasks"
            )
        if not re.match(r"^[A-Za-z_]\w*:[A-Za-z_]\w*$", value):
            raise ValueError(f"'{value}' must look like module:function")
        return value

    @property
    def base_dir(self) -> Path:
        """Relative paths in the file resolve against the folder above ``pipelines/``."""
        return Path(self.source_file).resolve().parent.parent if self.source_file else Path.cwd()

    # Locations (``offsetlake.config.layout``): a local path, or a URI for a lake elsewhere.
    @property
    def layout(self) -> LakeLayout:
        """Where this pipeline's tables live, each with the storage settings that reach it;
        computed once per config value."""
        if self._layout is None:
            self._layout = LakeLayout.of(self.name, self.lake, self.sink.table, self.storage, self.base_dir)
        return self._layout

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> PipelineConfig:
        copied = super().model_copy(update=update, deep=deep)
        copied._layout = None  # an update may change the lake, the sink table or the storage settings
        return copied

    @property
    def lake_path(self) -> str:
        return self.layout.lake.path

    @property
    def sink_label(self) -> str:
        """The sink as messages and DAG descriptions name it."""
        return f"Kafka topic {self.sink.topic}" if self.sink.is_kafka else f"Delta {self.sink_path}"

    @property
    def sink_path(self) -> str:
        return self.layout.sink.path

    @property
    def dead_letter_path(self) -> str:
        return self.layout.dead_letters.path

    @property
    def ledger_path(self) -> str:
        return self.layout.ledger.path

    @property
    def stream_lease_path(self) -> str:
        """Who owns the pipeline as a stream (``offsetlake.lease``)."""
        return self.layout.stream_leases.path

    @property
    def stream_log_path(self) -> str:
        """Where the Airflow stream task keeps the output of its ``offsetlake stream`` process: a
        local folder (process logs stay on the machine): in the lake when the lake is a local
        folder, else under ``$OFFSETLAKE_LOG_DIR`` (default ``~/.offsetlake/logs``)."""
        if not storage.is_uri(self.lake_path):
            return storage.child(self.lake_path, "_stream_logs", self.name)
        base = os.environ.get("OFFSETLAKE_LOG_DIR") or str(Path.home() / ".offsetlake" / "logs")
        return str(Path(base) / "_stream_logs" / self.name)

    @property
    def validation_path(self) -> str:
        """Where each validation's HTML report and JSON summary go."""
        return self.layout.validation.path

    @property
    def transform_dir(self) -> Path:
        return Path(self.source_file).resolve().parent if self.source_file else Path.cwd()

    @property
    def suite_file(self) -> Path | None:
        """The expectation suite file, or None when the pipeline has none (no validation)."""
        if self.validation.suite:
            return self.transform_dir / self.validation.suite
        default = self.transform_dir / f"{self.name}.expectations.yaml"
        return default if default.exists() else None

    def kafka_client_config(self) -> dict[str, str]:
        """Full librdkafka config, secrets included: hand it to clients, never to a logger."""
        return {"bootstrap.servers": self.kafka.bootstrap_servers, **self.kafka.options}

    def redacted_kafka_options(self) -> dict[str, str]:
        return {k: ("***" if _SECRET_KEY.search(k) else v) for k, v in self.kafka.options.items()}

    def app_id(self, topic: str, partition: int) -> str:
        """Delta txn appId for one topic-partition of this pipeline (invariant 2)."""
        return app_id(self.name, topic, partition)

    def with_kafka_overrides(self, bootstrap_servers: str | None, options: dict[str, str]) -> PipelineConfig:
        """This config with Kafka settings from elsewhere (e.g. an Airflow connection) on top."""
        if not bootstrap_servers and not options:
            return self
        kafka = KafkaSettings.model_validate(
            {
                "bootstrap_servers": bootstrap_servers or self.kafka.bootstrap_servers,
                "options": {**self.kafka.options, **options},
            }
        )
        return self.model_copy(update={"kafka": kafka})

    def with_storage_overrides(self, options: dict[str, str]) -> PipelineConfig:
        """This config with storage settings from elsewhere (an Airflow connection) on top."""
        if not options:
            return self
        try:
            checked = PipelineConfig._storage_options({**self.storage, **options})
        except ValueError as err:
            raise ConfigError(f"storage connection: {err}", pipeline=self.name) from None
        return self.model_copy(update={"storage": checked})

    def with_registry_overrides(self, options: dict[str, str]) -> PipelineConfig:
        """This config with Schema Registry settings from elsewhere (an Airflow connection) on top,
        for the value format and the key format that read through a registry."""
        options = {k: v for k, v in options.items() if v != ""}
        if not options:
            return self
        update: dict[str, Any] = {}
        for field_name, fmt in (("format", self.format), ("key_format", self.key_format)):
            if fmt is None or isinstance(fmt, JsonFormat) or not fmt.uses_registry:
                continue
            merged = {**fmt.schema_registry, **options}
            problem = registry_settings_problem(merged)
            if problem:
                raise ConfigError(f"schema registry connection: {problem}", pipeline=self.name)
            update[field_name] = fmt.model_copy(update={"schema_registry": merged})
        if self.sink.is_kafka and self.sink.format != "json":
            merged = {**self.sink.schema_registry, **options}
            problem = registry_settings_problem(merged)
            if problem:
                raise ConfigError(f"schema registry connection: {problem}", pipeline=self.name)
            update["sink"] = self.sink.model_copy(update={"schema_registry": merged})
        return self.model_copy(update=update) if update else self

    def check_storage(self) -> None:
        """Refuse an object store that cannot be used or cannot commit safely (``storage.check_store``),
        before anything is read from Kafka; nothing to do for a local lake."""
        lake, sink = self.layout.lake, self.layout.sink
        for location in dict.fromkeys([lake, sink]):
            if not any(location.path.startswith(root.path + "/") for root in {lake} - {location}):
                storage.check_store(location, self.name)

    def redacted_storage_options(self) -> dict[str, str]:
        return storage.shown_options(self.storage)

    def __repr__(self) -> str:  # keep secrets out of tracebacks and debug logs
        return f"PipelineConfig(name={self.name!r}, topic={self.topic!r}, file={self.source_file!r})"

    __str__ = __repr__


FIELD_PROBLEM = "field_problem"  # a cross-field rule's error: its message names the field itself


def _locations_problem(config: PipelineConfig) -> tuple[str, str] | None:
    """A lake or sink location delta-rs cannot address, or storage settings for a local lake."""
    for field_name, location in (("lake", config.lake_path), ("sink.table", config.sink_path)):
        problem = storage.location_problem(location)
        if problem:
            return field_name, f"{location} {problem}"
    if config.storage and not any(storage.is_uri(loc) and not loc.startswith("file://") for loc in (config.lake_path, config.sink_path)):
        return "storage", (f"settings for object storage, but lake {config.lake_path} is a local folder (use lake: s3://bucket/prefix)")
    return None


def _files_problem(config: PipelineConfig) -> tuple[str, str] | None:
    """A suite, transform module or .avsc the YAML names that is not next to it; without a
    transform, a partition column that is neither a schema field nor a key column."""
    if config.validation.suite and not (config.transform_dir / config.validation.suite).is_file():
        return "validation.suite", f"{config.transform_dir / config.validation.suite} does not exist"
    if config.transform:
        module = config.transform_dir / f"{config.transform.split(':')[0]}.py"
        if not module.is_file():
            return "transform", f"{module} does not exist (the module goes next to the YAML)"
    elif isinstance(config.format, JsonFormat) and not (config.key_format and config.key_format.uses_registry):
        # a registry schema's fields are known when a batch is planned
        fields = set(config.format.schema_) | set(key_columns(config.key_format or KeyFormat()))
        missing = [c for c in config.sink.partition_by if c not in fields]
        if missing:
            return "sink.partition_by", (
                f"column '{missing[0]}' is not a field of format.schema or a key column (without a transform the rows have only those)"
            )
    if isinstance(config.format, AvroFormat) and config.format.schema_file:
        avsc = config.transform_dir / config.format.schema_file
        if not avsc.is_file():
            return "format.schema_file", f"{avsc} does not exist (the .avsc goes next to the YAML)"
    return None


def _partition_columns_problem(config: PipelineConfig) -> tuple[str, str] | None:
    """A partition column whose declared type Delta cannot partition by."""
    for column in config.sink.partition_by:
        declared = config.format.schema_.get(column) if isinstance(config.format, JsonFormat) else None
        declared = declared or key_columns(config.key_format or KeyFormat()).get(column)
        if declared is not None and declared.lower() not in PARTITION_COLUMN_TYPES:
            return "sink.partition_by", (
                f"column '{column}' has type {declared}; partition columns must be one of {', '.join(sorted(PARTITION_COLUMN_TYPES))}"
            )
    return None


def spark_only_reason(config: PipelineConfig) -> str | None:
    """Why every batch of this pipeline takes the Spark path, known from its configuration alone
    (a step after the read runs in Spark), or None. ``offsetlake.direct.problem`` adds what only a
    batch's plan and decoder tell; this is the part ``data_path: direct`` is checked against."""
    if config.sink.mode != "append":
        return "a keyed sink merges in Spark"
    if config.transform:
        return "a transform runs in Spark"
    if config.suite_file is not None:
        return "the suite validates the rows in Spark"
    if getattr(config.format, "envelope", None) == "debezium":
        return "the format finishes decoding in Spark"
    return None


def jvm_refusal(config: PipelineConfig) -> str | None:
    """Why no batch of this pipeline can take the ``jvm`` path, known from its configuration
    alone, or None (``offsetlake.kafka_source.problem`` checks the batch's decoder too)."""
    if config.format.type != "json" or getattr(config.format, "envelope", None) is not None:
        return "the JVM path decodes plain JSON values; this format decodes in the read tasks"
    if config.key_format is not None and config.key_format.type not in ("string", "bytes", "json", "none"):
        return f"key_format {config.key_format.type} decodes in the read tasks"
    return None


def _data_path_problem(config: PipelineConfig) -> tuple[str, str] | None:
    """``data_path: direct`` for a pipeline whose batches need Spark; ``jvm`` for one whose
    records the JVM path cannot read."""
    if config.data_path == "direct" and (reason := spark_only_reason(config)) is not None:
        return "data_path", f"pipeline {config.name} cannot take the direct path: {reason} (use auto or spark)"
    if config.data_path == "jvm" and (reason := jvm_refusal(config)) is not None:
        return "data_path", f"pipeline {config.name} cannot take the jvm path: {reason} (use auto or spark)"
    return None


def _engine_problem(config: PipelineConfig) -> tuple[str, str] | None:
    """A merge engine that cannot take this pipeline's records: Debezium deletes for the engines
    that take no deletes."""
    if config.sink.mode in ("first_row", "aggregate") and getattr(config.format, "envelope", None) == "debezium":
        return "sink.mode", (
            f"mode {config.sink.mode} takes no deletes, and a Debezium envelope carries them; "
            "use partial_update or upsert for a change stream"
        )
    return None


def _kafka_sink_problem(config: PipelineConfig) -> tuple[str, str] | None:
    """A Kafka sink that would read its own output: its topic (or dead-letter topic) is a source."""
    if config.outbox is not None and (config.sink.is_kafka or config.sink.mode != "append"):
        what = "a Kafka sink (its topic is already the output)" if config.sink.is_kafka else f"sink.mode {config.sink.mode}"
        return "outbox", f"publishes an append Delta sink's rows, not {what}"
    if not config.sink.is_kafka:
        return None
    if config.data_path in ("direct", "jvm"):
        return "data_path", f"a Kafka sink takes auto or spark (Spark hands the rows to the driver's producer), not {config.data_path}"
    for name, topic in (("sink.topic", config.sink.topic), ("sink.dead_letter_topic", config.sink.dead_letters_to)):
        if (
            topic == config.topic
            or topic in (config.topics or ())
            or (config.topic_pattern and re.fullmatch(config.topic_pattern, topic or ""))
        ):
            return name, f"{topic} is also a source of pipeline {config.name}: it would read its own output"
    return None
