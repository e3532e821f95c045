"""``format.type: json_schema``: JSON values in the Confluent wire format (magic byte 0, a 4-byte
schema id, the JSON text) whose schemas are JSON Schemas in a Schema Registry.

The reader schema (the subject's version recorded in the plan) gives the columns: its top-level
``properties`` mapped to Spark types (``spark_type``), its ``required`` the fields a row must
have. In the read task each value is validated against its own writer schema (fetched by id,
cached per worker) with ``jsonschema``, then parsed like ``format.type: json`` (pyarrow in the
task, Spark's ``from_json`` for the rest). A value with no wire-format header, an unknown schema
id, a schema of another type, or one its writer schema rejects is a dead letter with the reason;
a registry outage fails the batch (``offsetlake.formats.registry``).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from offsetlake.errors import ConfigError
from offsetlake.formats import TOMBSTONE, DecodedChunk, reasons
from offsetlake.formats import registry as sr
from offsetlake.formats.avro_records import fingerprint
from offsetlake.formats.base import Format, register_format
from offsetlake.formats.json_records import JsonDecoder
from offsetlake.plan import ReaderSchema

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from offsetlake.config import JsonFormat, PipelineConfig

_HEADER = 5
_NO_HEADER = reasons.undecodable("value does not start with the Confluent wire-format header (magic byte 0 and a 4-byte schema id)")


def resolve_reader_schema(config: PipelineConfig) -> ReaderSchema:
    """The subject's latest (or pinned) JSON Schema; ConfigError now if it has no column mapping."""
    schema = sr.registry_reader_schema(config, "JSON", fingerprint)
    JsonSchemaDecoder(config, schema).fields()
    return schema


def spark_type(schema: Any, path: str, where: str) -> str:
    """The Spark SQL type of a JSON Schema (the table in docs/guides/formats-and-registry.md); ConfigError naming the field for
    what has no one column type (``oneOf``/``anyOf``, ``$ref``, a type list of several non-null types)."""
    if not isinstance(schema, dict):
        raise ConfigError(f"{where}: field '{path}' has no schema object")
    for keyword in ("$ref", "oneOf", "anyOf", "allOf"):
        if keyword in schema:
            raise ConfigError(
                f"{where}: field '{path}' uses {keyword}, which has no single column type; "
                "give it a plain type in the reader schema, or use a transform"
            )
    kind = schema.get("type")
    if isinstance(kind, list):
        kinds = [k for k in kind if k != "null"]
        if len(kinds) != 1:
            raise ConfigError(f"{where}: field '{path}' has types {kind}; a column has one type")
        kind = kinds[0]
    if kind == "string":
        return {"date-time": "timestamp", "date": "date"}.get(schema.get("format", ""), "string")
    if kind in ("integer", "number", "boolean"):
        return {"integer": "long", "number": "double", "boolean": "boolean"}[kind]
    if kind == "array":
        return f"array<{spark_type(schema.get('items'), f'{path}[]', where)}>"
    if kind == "object":
        properties = schema.get("properties")
        if properties:
            inner = ", ".join(f"`{name}`: {spark_type(s, f'{path}.{name}', where)}" for name, s in properties.items())
            return f"struct<{inner}>"
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            return f"map<string, {spark_type(extra, f'{path}{{}}', where)}>"
        raise ConfigError(f"{where}: field '{path}' is an object without properties or an additionalProperties schema")
    raise ConfigError(f"{where}: field '{path}' has no JSON Schema type Delta can hold (type: {kind!r})")


def json_format_of(schema: Any, where: str) -> JsonFormat:
    """The reader schema as ``format.type: json`` would declare it: properties and required."""
    from offsetlake.config import JsonFormat

    if not isinstance(schema, dict) or schema.get("type") != "object" or not schema.get("properties"):
        raise ConfigError(f"{where}: the reader schema is not a JSON Schema object with properties; a sink row needs named fields")
    columns = {name: spark_type(s, name, where) for name, s in schema["properties"].items()}
    required = [name for name in schema.get("required", []) if name in columns]
    return JsonFormat.model_validate({"type": "json", "schema": columns, "required": required})


class JsonSchemaDecoder:
    """The JSON Schema format of one pipeline, parsing into one reader schema."""

    rows_in_read = True

    def __init__(self, config: PipelineConfig, reader: ReaderSchema) -> None:
        self.pipeline = config.name
        self.settings, schema_id, where = sr.decoder_setting(config, reader)
        self.reader = reader
        text = sr.schema_by_id(self.pipeline, self.settings, schema_id).text
        self.inner = JsonDecoder(json_format_of(json.loads(text), where))
        self._validators: dict[int, tuple[Any, str | None]] | None = None

    def __getstate__(self) -> dict[str, Any]:  # shipped to Spark tasks without compiled validators
        return {**self.__dict__, "_validators": None}

    def fields(self) -> list[str]:
        return self.inner.fields()

    def read_type(self) -> pa.StructType | None:
        return self.inner.read_type()

    def check_types(self, where: str) -> None:
        self.inner.check_types(where)

    def decode_in_spark(self, raw: DataFrame) -> DataFrame:
        """The JSON path's parse of the text after the header; dead letters keep the whole value."""
        from pyspark.sql import functions as F

        wire = "_wire_value"
        text_only = raw.withColumn(wire, F.col("value")).withColumn("value", F.expr(f"substring(value, {_HEADER + 1})"))
        return self.inner.decode_in_spark(text_only).withColumn("value", F.col(wire)).drop(wire)

    def _validator(self, schema_id: int) -> tuple[Any, str | None]:
        """The compiled writer schema of ``schema_id``, or the reason its records are dead letters."""
        if self._validators is None:
            self._validators = {}
        if schema_id not in self._validators:
            from jsonschema.validators import validator_for

            try:
                found = sr.schema_by_id(self.pipeline, self.settings, schema_id)
            except sr.SchemaNotFound:
                self._validators[schema_id] = (None, reasons.schema_mismatch(f"schema id {schema_id} is not in the Schema Registry"))
            else:
                if found.schema_type != "JSON":
                    self._validators[schema_id] = (
                        None,
                        reasons.schema_mismatch(f"schema id {schema_id} is a {found.schema_type} schema, not JSON"),
                    )
                else:
                    schema = json.loads(found.text)
                    self._validators[schema_id] = (validator_for(schema)(schema), None)
        return self._validators[schema_id]

    def decode_chunk(self, values: list[bytes | None]) -> DecodedChunk:
        from jsonschema.exceptions import best_match

        problems: list[str | None] = [None] * len(values)
        texts: list[bytes | None] = []
        for i, value in enumerate(values):
            if value is None:
                problems[i] = TOMBSTONE
                texts.append(None)
                continue
            if len(value) < _HEADER or value[0] != 0:
                problems[i] = _NO_HEADER
                texts.append(None)
                continue
            schema_id = int.from_bytes(value[1:_HEADER], "big")
            text = value[_HEADER:]
            texts.append(text)
            validator, problems[i] = self._validator(schema_id)
            if validator is None:
                continue
            try:
                instance = json.loads(text)
            except ValueError:
                continue  # not JSON: the JSON path names why
            error = best_match(validator.iter_errors(instance))
            if error is not None:
                at = "/".join(str(p) for p in error.absolute_path) or "(the value)"
                problems[i] = reasons.schema_mismatch(f"value does not match writer schema id {schema_id} at {at}: {error.message}"[:1000])
        inner = self.inner.decode_chunk(texts)
        if inner.problems is not None:
            problems = [mine if mine is not None else theirs for mine, theirs in zip(problems, inner.problems, strict=True)]
        settled = inner.settled
        if settled is not None:
            settled = [s and p is None for s, p in zip(settled, problems, strict=True)]
        return DecodedChunk(inner.parsed, problems if any(p is not None for p in problems) else None, settled)


register_format(Format("json_schema", resolve_reader_schema, JsonSchemaDecoder))
