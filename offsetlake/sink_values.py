"""How a Kafka sink's rows become record values (``sink.format``).

* ``json`` (the default): a JSON object of the row's columns, no registry.
* ``avro``, ``json_schema``, ``protobuf``: the Confluent wire format (magic byte, schema id, the
  encoded row) through the Schema Registry. The schema is derived from the batch's output columns
  (Spark's types as the Avro, JSON Schema or Protobuf types a consumer of that format expects;
  nullable columns stay nullable). ``sink.register: true`` (the default) registers it under the
  subject, so the registry's compatibility rules decide whether the output may change shape;
  ``register: false`` only checks that the subject already holds exactly that schema, for
  subjects whose schemas are registered by someone else.

The registry is asked before the batch's transaction opens: an incompatible or unregistered
schema (``ConfigError``) or a registry outage (``SchemaRegistryUnavailableError``) fails the
batch with nothing produced. The encoding itself is confluent-kafka's serializers.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable, Mapping
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from offsetlake import json_text
from offsetlake.errors import ConfigError, KafkaSinkValueError, SchemaRegistryUnavailableError
from offsetlake.formats.registry import registry_url, sdk_client
from offsetlake.json_text import NON_FINITE_TEXT, finite_text, is_finite_number

if TYPE_CHECKING:
    from offsetlake.config import PipelineConfig

Encode = Callable[[Mapping[str, Any]], bytes]

REGISTRY_FORMATS = ("avro", "json_schema", "protobuf")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def json_value(value: Any) -> Any:
    """A column value JSON cannot write as itself: timestamps and dates ISO 8601, decimals as text,
    bytes base64."""
    if isinstance(value, datetime):
        return (value if value.tzinfo else value.replace(tzinfo=UTC)).isoformat()
    if isinstance(value, date):
        return value.isoformat()
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    return value


def encode_json(value: Mapping[str, Any]) -> bytes:
    """A row as a JSON object; a NaN or infinite double as the string ``"NaN"``, ``"Infinity"``
    or ``"-Infinity"`` (``json_text``: a bare ``NaN`` is not JSON, and a consumer's parser refuses it)."""
    return json_text.dumps(value, default=json_value).encode()


_JSON_ROW = json.JSONEncoder(allow_nan=False).encode
_UTC_NAMES = frozenset({"UTC", "Etc/UTC", "+00:00", "Z", "GMT", "Etc/GMT"})


def json_values(rows: pa.Table) -> list[bytes] | None:
    """Every row of ``rows`` as ``encode_json`` writes it, byte for byte, without turning a row
    into Python objects first: timestamps, dates and decimals become their JSON text in Arrow,
    each column becomes one Python list, and Python's C JSON encoder writes each row. None when a
    column has a type this cannot prepare exactly (binary, nested, a timestamp outside UTC or
    years outside 1000 to 9999): then encode row by row. A row holding a NaN or an infinity is written by
    ``encode_json`` itself (the string spellings)."""
    columns: list[list[Any]] = []
    for field, column in zip(rows.schema, rows.columns, strict=True):
        prepared = _json_column(field.type, column)
        if prepared is None:
            return None
        columns.append(prepared.to_pylist())
    names = rows.column_names
    out = []
    for values in zip(*columns, strict=True):
        row = dict(zip(names, values, strict=True))
        try:
            out.append(_JSON_ROW(row).encode())
        except ValueError:  # a non-finite float: its string spelling
            out.append(encode_json(row))
    return out


def _json_column(t: pa.DataType, column: Any) -> Any:
    """``column`` with values whose Python form ``json.dumps`` writes as ``json_value`` would, or
    None."""
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t) or pa.types.is_null(t):
        return column
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return column
    if pa.types.is_decimal(t):  # Arrow's text is str(Decimal)'s, exponent form (0E-10) included
        return column.cast(pa.string())
    if pa.types.is_date(t):
        days = column.cast(pa.date32()).cast(pa.timestamp("s"))
        return None if not _four_digit_years(days) else pc.strftime(days, format="%Y-%m-%d")
    if pa.types.is_timestamp(t) and t.unit != "ns" and (t.tz is None or t.tz in _UTC_NAMES):
        micros = column.cast(pa.timestamp("us", tz="UTC"))
        if not _four_digit_years(micros):
            return None
        # datetime.isoformat: seconds, then microseconds only when there are any, then the offset
        text = pc.replace_substring_regex(pc.strftime(micros, format="%Y-%m-%dT%H:%M:%S"), r"\.000000$", "")
        return pc.binary_join_element_wise(text, "+00:00", "")
    return None


def _four_digit_years(column: Any) -> bool:
    bounds = pc.min_max(pc.year(column))
    low, high = bounds["min"].as_py(), bounds["max"].as_py()
    return low is None or (low >= 1000 and high <= 9999)


def value_encoder(config: PipelineConfig, columns: pa.Schema) -> Encode:
    """The encoder of the sink's ``format`` for rows with ``columns`` (the value's columns: no
    record coordinates). For a registry format the schema is registered (or looked up) now, so a
    refusal fails the batch before its transaction. Raises ConfigError naming the field."""
    sink = config.kafka_sink
    if sink.format == "json":
        return encode_json
    plain = _plain_rows(columns)
    settings = sink_registry_settings(config)
    subject = sink.subject or f"{sink.topic}-value"
    name = _record_name(sink.topic)
    if sink.format == "avro":
        encode = _avro(config, settings, subject, avro_schema(columns, name, config.name))
    elif sink.format == "json_schema":
        encode = _json_schema(config, settings, subject, json_schema(columns, name, config.name))
    else:
        encode = _protobuf(config, settings, subject, columns, name)
    return encode if plain is None else lambda row: encode(plain(row))


def _plain_rows(columns: pa.Schema) -> Callable[[Mapping[str, Any]], dict[str, Any]] | None:
    """Arrow hands a map column over as (key, value) pairs; the serializers take a dict. None when
    no column holds a map (rows go as they are)."""

    def convert(t: pa.DataType) -> Callable[[Any], Any] | None:
        if pa.types.is_map(t):
            inner = convert(t.item_type)
            return lambda v: None if v is None else {k: (x if inner is None or x is None else inner(x)) for k, x in v}
        if pa.types.is_list(t) or pa.types.is_large_list(t):
            inner = convert(t.value_type)
            return None if inner is None else lambda v: None if v is None else [None if x is None else inner(x) for x in v]
        if pa.types.is_struct(t):
            inner_fields = {f.name: c for f in t if (c := convert(f.type)) is not None}
            return None if not inner_fields else lambda v: None if v is None else _converted(v, inner_fields)
        return None

    fields = {f.name: c for f in columns if (c := convert(f.type)) is not None}
    return None if not fields else lambda row: _converted(row, fields)


def _converted(row: Mapping[str, Any], fields: dict[str, Callable[[Any], Any]]) -> dict[str, Any]:
    out = dict(row)
    for name, convert in fields.items():
        if out.get(name) is not None:
            out[name] = convert(out[name])
    return out


def sink_registry_settings(config: PipelineConfig) -> dict[str, str]:
    """The registry a Kafka sink's values go through: ``sink.schema_registry``, else the value
    format's (and either one's Airflow connection)."""
    settings = dict(config.kafka_sink.schema_registry) or dict(getattr(config.format, "schema_registry", {}) or {})
    if not settings.get("url"):
        raise ConfigError(
            f"sink.format {config.kafka_sink.format} writes through a Schema Registry but none is set: give "
            f"sink.schema_registry.url (or format.schema_registry), or an Airflow connection schema_registry_{config.name} "
            "(or schema_registry_default)",
            pipeline=config.name,
            field="sink.schema_registry",
        )
    return settings


def _record_name(topic: str) -> str:
    """The topic as a schema name: Avro and Protobuf names are letters, digits and ``_``."""
    name = re.sub(r"[^A-Za-z0-9_]", "_", topic)
    return name if not name[0].isdigit() else f"_{name}"


def _checked_name(name: str, pipeline: str) -> str:
    if not _NAME.fullmatch(name):
        raise ConfigError(
            f"column {name!r} cannot be a field of an Avro or Protobuf record (letters, digits and _, not starting "
            "with a digit); rename it in the transform, or use sink.format json",
            pipeline=pipeline,
            field="sink.format",
        )
    return name


# ---- Avro -----------------------------------------------------------------------------------------
def avro_schema(columns: pa.Schema, name: str, pipeline: str) -> dict[str, Any]:
    """The Avro record schema of ``columns``: a nullable column is a union with null (default
    null); timestamps are timestamp-micros, dates date, decimals bytes with their precision."""
    return {"type": "record", "name": name, "namespace": "offsetlake", "fields": _avro_fields(columns, name, pipeline)}


def _avro_fields(fields: Any, path: str, pipeline: str) -> list[dict[str, Any]]:
    out = []
    for field in fields:
        kind = _avro_type(field.type, f"{path}_{field.name}", pipeline, field.name)
        entry: dict[str, Any] = {"name": _checked_name(field.name, pipeline), "type": kind}
        if field.nullable:
            entry = {"name": entry["name"], "type": ["null", kind], "default": None}
        out.append(entry)
    return out


def _avro_type(t: pa.DataType, path: str, pipeline: str, column: str) -> Any:
    if pa.types.is_boolean(t):
        return "boolean"
    if pa.types.is_integer(t):
        return "long" if t.bit_width == 64 else "int"
    if pa.types.is_float32(t):
        return "float"
    if pa.types.is_floating(t):
        return "double"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "string"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return "bytes"
    if pa.types.is_timestamp(t):
        return {"type": "long", "logicalType": "timestamp-micros"}
    if pa.types.is_date(t):
        return {"type": "int", "logicalType": "date"}
    if pa.types.is_decimal(t):
        return {"type": "bytes", "logicalType": "decimal", "precision": t.precision, "scale": t.scale}
    if pa.types.is_struct(t):
        return {"type": "record", "name": path, "fields": _avro_fields(list(t), path, pipeline)}
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        item = _avro_type(t.value_type, f"{path}_item", pipeline, column)
        return {"type": "array", "items": ["null", item] if t.value_field.nullable else item}
    if pa.types.is_map(t) and (pa.types.is_string(t.key_type) or pa.types.is_large_string(t.key_type)):
        item = _avro_type(t.item_type, f"{path}_value", pipeline, column)
        return {"type": "map", "values": ["null", item] if t.item_field.nullable else item}
    raise ConfigError(
        f"column {column} is {t}, which sink.format avro cannot write; cast it in the transform, or use sink.format json",
        pipeline=pipeline,
        field="sink.format",
    )


def _avro(config: PipelineConfig, settings: dict[str, str], subject: str, schema: dict[str, Any]) -> Encode:
    from confluent_kafka.schema_registry.avro import AvroSerializer

    serializer = AvroSerializer(sdk_client(settings), json.dumps(schema), conf=_serde_conf(config, subject))
    return _framed(config, settings, subject, serializer, lambda row: row)


# ---- JSON Schema ----------------------------------------------------------------------------------
def json_schema(columns: pa.Schema, name: str, pipeline: str) -> dict[str, Any]:
    """The JSON Schema (draft 7) of ``columns``: every column a property, the non-nullable ones
    required, no others; timestamps date-time text, dates date text, decimals text, bytes base64."""
    body = _json_object(list(columns), pipeline)
    return {"$schema": "http://json-schema.org/draft-07/schema#", "title": name, **body}


def _json_object(fields: list[pa.Field], pipeline: str) -> dict[str, Any]:
    props = {f.name: _json_nullable(_json_type(f.type, pipeline, f.name), f.nullable) for f in fields}
    required = [f.name for f in fields if not f.nullable]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def _json_nullable(schema: dict[str, Any], nullable: bool) -> dict[str, Any]:
    if not nullable:
        return schema
    return {"oneOf": [{"type": "null"}, schema]}


def _json_type(t: pa.DataType, pipeline: str, column: str) -> dict[str, Any]:
    if pa.types.is_boolean(t):
        return {"type": "boolean"}
    if pa.types.is_integer(t):
        return {"type": "integer"}
    if pa.types.is_floating(t):
        # a NaN or infinite double is written as its string (``json_text``), as in JSON
        return {"oneOf": [{"type": "number"}, {"enum": _NON_FINITE}]}
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return {"type": "string"}
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return {"type": "string", "contentEncoding": "base64"}
    if pa.types.is_timestamp(t):
        return {"type": "string", "format": "date-time"}
    if pa.types.is_date(t):
        return {"type": "string", "format": "date"}
    if pa.types.is_decimal(t):
        return {"type": "string", "pattern": r"^-?[0-9]+(\.[0-9]+)?$"}
    if pa.types.is_struct(t):
        return _json_object(list(t), pipeline)
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return {"type": "array", "items": _json_nullable(_json_type(t.value_type, pipeline, column), t.value_field.nullable)}
    if pa.types.is_map(t) and (pa.types.is_string(t.key_type) or pa.types.is_large_string(t.key_type)):
        return {"type": "object", "additionalProperties": _json_nullable(_json_type(t.item_type, pipeline, column), t.item_field.nullable)}
    raise ConfigError(
        f"column {column} is {t}, which sink.format json_schema cannot write; cast it in the transform, or use sink.format json",
        pipeline=pipeline,
        field="sink.format",
    )


_NON_FINITE = sorted(NON_FINITE_TEXT.values())


def _json_ready(value: Any) -> Any:
    """A row as the JSON it is written as (what the JSON Schema is checked against)."""
    if isinstance(value, float) and not is_finite_number(value):
        return finite_text(value)
    if isinstance(value, dict):
        return {k: _json_ready(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_ready(v) for v in value]
    return json_value(value)


def _json_schema(config: PipelineConfig, settings: dict[str, str], subject: str, schema: dict[str, Any]) -> Encode:
    from confluent_kafka.schema_registry.json_schema import JSONSerializer

    serializer = JSONSerializer(json.dumps(schema), sdk_client(settings), conf=_serde_conf(config, subject))
    return _framed(config, settings, subject, serializer, _json_row)


def _json_row(row: Mapping[str, Any]) -> Any:
    return {k: _json_ready(v) for k, v in row.items()}


# ---- Protobuf -------------------------------------------------------------------------------------
def _protobuf(config: PipelineConfig, settings: dict[str, str], subject: str, columns: pa.Schema, name: str) -> Encode:
    from confluent_kafka.schema_registry.protobuf import ProtobufSerializer

    message_class = protobuf_message(columns, name, config.name)
    conf = {**_serde_conf(config, subject), "use.deprecated.format": False}
    serializer = ProtobufSerializer(message_class, sdk_client(settings), conf=conf)

    def to_message(row: Mapping[str, Any]) -> Any:
        message = message_class()
        _fill(message, row)
        return message

    return _framed(config, settings, subject, serializer, to_message)


def protobuf_message(columns: pa.Schema, name: str, pipeline: str) -> Any:
    """A proto3 message class for ``columns``, fields numbered in column order: a nullable scalar
    is ``optional`` (null stays null), timestamps google.protobuf.Timestamp, dates their ISO text,
    decimals their text, structs nested messages, lists repeated, maps map<string, ...>."""
    from google.protobuf import descriptor_pb2, descriptor_pool, timestamp_pb2
    from google.protobuf.message_factory import GetMessageClass

    file = descriptor_pb2.FileDescriptorProto(name=f"offsetlake/{name}.proto", package="offsetlake", syntax="proto3")
    file.dependency.append("google/protobuf/timestamp.proto")
    message = file.message_type.add(name=name)
    _proto_fields(message, list(columns), pipeline)
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(timestamp_pb2.DESCRIPTOR.serialized_pb)
    pool.Add(file)
    return GetMessageClass(pool.FindMessageTypeByName(f"offsetlake.{name}"))


def _proto_fields(message: Any, fields: list[pa.Field], pipeline: str) -> None:
    from google.protobuf import descriptor_pb2

    fd = descriptor_pb2.FieldDescriptorProto
    for number, field in enumerate(fields, start=1):
        _checked_name(field.name, pipeline)
        entry = message.field.add(name=field.name, number=number, label=fd.LABEL_OPTIONAL)
        t = field.type
        if pa.types.is_list(t) or pa.types.is_large_list(t):
            entry.label = fd.LABEL_REPEATED
            _proto_scalar(message, entry, t.value_type, f"{field.name}_item", pipeline, field.name)
            continue
        if pa.types.is_map(t):
            if not (pa.types.is_string(t.key_type) or pa.types.is_large_string(t.key_type)):
                raise ConfigError(
                    f"column {field.name}: sink.format protobuf writes maps with string keys", pipeline=pipeline, field="sink.format"
                )
            entry_name = f"{field.name[:1].upper()}{field.name[1:]}Entry"
            nested = message.nested_type.add(name=entry_name)
            nested.options.map_entry = True
            nested.field.add(name="key", number=1, label=fd.LABEL_OPTIONAL, type=fd.TYPE_STRING)
            value = nested.field.add(name="value", number=2, label=fd.LABEL_OPTIONAL)
            _proto_scalar(message, value, t.item_type, f"{field.name}_value", pipeline, field.name)
            entry.label = fd.LABEL_REPEATED
            entry.type = fd.TYPE_MESSAGE
            entry.type_name = entry_name
            continue
        _proto_scalar(message, entry, t, f"{field.name}_msg", pipeline, field.name)
        if field.nullable and entry.type != fd.TYPE_MESSAGE:  # proto3 optional: a synthetic oneof
            entry.proto3_optional = True
            entry.oneof_index = len(message.oneof_decl)
            message.oneof_decl.add(name=f"_{field.name}")


def _proto_scalar(message: Any, entry: Any, t: pa.DataType, path: str, pipeline: str, column: str) -> None:
    from google.protobuf import descriptor_pb2

    fd = descriptor_pb2.FieldDescriptorProto
    simple = (
        (pa.types.is_boolean, fd.TYPE_BOOL),
        (lambda x: pa.types.is_integer(x) and x.bit_width == 64, fd.TYPE_INT64),
        (pa.types.is_integer, fd.TYPE_INT32),
        (pa.types.is_float32, fd.TYPE_FLOAT),
        (pa.types.is_floating, fd.TYPE_DOUBLE),
        (lambda x: pa.types.is_string(x) or pa.types.is_large_string(x), fd.TYPE_STRING),
        (lambda x: pa.types.is_binary(x) or pa.types.is_large_binary(x), fd.TYPE_BYTES),
        (lambda x: pa.types.is_date(x) or pa.types.is_decimal(x), fd.TYPE_STRING),
    )
    for test, kind in simple:
        if test(t):
            entry.type = kind
            return
    if pa.types.is_timestamp(t):
        entry.type = fd.TYPE_MESSAGE
        entry.type_name = ".google.protobuf.Timestamp"
        return
    if pa.types.is_struct(t):
        nested = message.nested_type.add(name=path)
        _proto_fields(nested, list(t), pipeline)
        entry.type = fd.TYPE_MESSAGE
        entry.type_name = path
        return
    raise ConfigError(
        f"column {column} is {t}, which sink.format protobuf cannot write; cast it in the transform, or use sink.format json",
        pipeline=pipeline,
        field="sink.format",
    )


def _fill(message: Any, row: Mapping[str, Any]) -> None:
    """Set ``message``'s fields from ``row``; a null leaves its field unset."""
    for field in message.DESCRIPTOR.fields:
        value = row.get(field.name)
        if value is None:
            continue
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            target = getattr(message, field.name)
            value_field = field.message_type.fields_by_name["value"]
            for k, v in value.items():
                if v is None:
                    continue
                if value_field.message_type is not None:
                    _set_message(target[k], value_field, v)
                else:
                    target[k] = _proto_scalar_value(v)
        elif field.is_repeated:
            target = getattr(message, field.name)
            for item in value:
                if item is None:
                    continue
                if field.message_type is not None:
                    _set_message(target.add(), field, item)
                else:
                    target.append(_proto_scalar_value(item))
        elif field.message_type is not None:
            _set_message(getattr(message, field.name), field, value)
        else:
            setattr(message, field.name, _proto_scalar_value(value))


def _set_message(target: Any, field: Any, value: Any) -> None:
    if field.message_type.full_name == "google.protobuf.Timestamp":
        target.FromDatetime(value if value.tzinfo else value.replace(tzinfo=UTC))
    else:
        _fill(target, value)


def _proto_scalar_value(value: Any) -> Any:
    if isinstance(value, datetime | date | Decimal):
        return json_value(value)
    return value


# ---- the registry ---------------------------------------------------------------------------------
def _serde_conf(config: PipelineConfig, subject: str) -> dict[str, Any]:
    return {"auto.register.schemas": config.kafka_sink.register_schema, "subject.name.strategy": lambda ctx, record_name: subject}


def _framed(config: PipelineConfig, settings: dict[str, str], subject: str, serializer: Any, prepare: Callable[[Any], Any]) -> Encode:
    """The serializer as an encoder. Its first call registers (or looks up) the schema: the sink
    encodes a batch's rows before its transaction begins, so a refusal fails the batch with
    nothing produced."""
    import httpx
    from confluent_kafka.schema_registry.error import SchemaRegistryError
    from confluent_kafka.serialization import MessageField, SerializationContext

    ctx = SerializationContext(config.kafka_sink.topic, MessageField.VALUE)

    def encode(row: Mapping[str, Any]) -> bytes:
        try:
            out = serializer(prepare(row), ctx)
        except SchemaRegistryError as err:
            raise _registry_refusal(config, settings, subject, err) from None
        except (httpx.HTTPError, OSError) as err:
            raise SchemaRegistryUnavailableError(
                f"the Schema Registry at {registry_url(settings)} could not be reached while writing subject {subject} "
                f"({type(err).__name__}: {err}); nothing was produced, run again once it answers",
                pipeline=config.name,
            ) from None
        except Exception as err:  # the serializers raise SerializationError, ValueError, TypeError
            raise KafkaSinkValueError(
                f"a row cannot be written as sink.format {config.kafka_sink.format} under subject {subject}: "
                f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}; nothing was produced",
                pipeline=config.name,
                field="sink.format",
            ) from None
        assert out is not None
        return out

    return encode


def _registry_refusal(config: PipelineConfig, settings: dict[str, str], subject: str, err: Any) -> Exception:
    what = f"sink.format {config.kafka_sink.format} of topic {config.kafka_sink.topic}"
    if err.http_status_code == 409:
        return ConfigError(
            f"the Schema Registry at {registry_url(settings)} refused the schema of the output columns under subject "
            f"{subject}: it is not compatible with the subject's versions ({err.error_message}); change the transform, "
            "or the subject's compatibility level; nothing was produced",
            pipeline=config.name,
            field="sink.subject",
        )
    if err.http_status_code == 404 and not config.kafka_sink.register_schema:
        return ConfigError(
            f"subject {subject} at {registry_url(settings)} does not hold the schema of the output columns "
            f"({err.error_message}) and sink.register is false; register it, or set sink.register: true; "
            "nothing was produced",
            pipeline=config.name,
            field="sink.register",
        )
    if err.http_status_code in (400, 422):
        return ConfigError(
            f"the Schema Registry at {registry_url(settings)} refused the schema of {what} under subject {subject} "
            f"(HTTP {err.http_status_code}, error {err.error_code}: {err.error_message}); nothing was produced",
            pipeline=config.name,
            field="sink.format",
        )
    return SchemaRegistryUnavailableError(
        f"the Schema Registry at {registry_url(settings)} answered HTTP {err.http_status_code} "
        f"(error {err.error_code}: {err.error_message}) while writing {what} under subject {subject}; nothing was "
        "produced, run again once it answers",
        pipeline=config.name,
    )
