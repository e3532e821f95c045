"""The ``format:`` and ``key_format:`` settings of a pipeline: how its records' values and keys
become columns (the decoders live in ``offsetlake.formats``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from offsetlake.config.ddl import spark_type_problem
from offsetlake.config.registry_settings import RegistryOptions
from offsetlake.config.strict import Strict as _Strict


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

    schema_registry: RegistryOptions = Field(default_factory=dict)
    subject: str | None = None  # default: <topic>-value (the TopicNameStrategy)
    version: int | Literal["latest"] = "latest"
    # debezium: values are Debezium change events (the schema is the envelope: before, after,
    # op, source, ...), see ``offsetlake.formats.debezium``
    envelope: Literal["debezium"] | None = None

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
    schema_registry: RegistryOptions = Field(default_factory=dict)  # default: format.schema_registry
    subject: str | None = None  # default: <topic>-key
    version: int | Literal["latest"] = "latest"
    message: str | None = None  # protobuf: the key message's full name (default: the schema's first)
    prefix: str = ""  # record keys: each field becomes the column <prefix><field>

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        return {"type": value} if isinstance(value, str) else value

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
