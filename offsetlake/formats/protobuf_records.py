"""``format.type: protobuf``: Protobuf values in the Confluent wire format, decoded in the read
tasks, each with its own writer schema, and mapped onto the columns of the batch's reader message.

The wire format: magic byte 0, a 4-byte big-endian schema id, the message indexes (a zigzag
varint count, then that many zigzag varints, the path to the message inside the schema's file:
``[2, 0]`` is the first message nested in the file's third; the single byte 0 means ``[0]``), then
the serialized message. Schemas come from the registry as ``FileDescriptorProto``s
(``fmt=serialized``), their references as the files they import; each writer schema gets a
descriptor pool of its own (two versions of one file declare the same names).

The reader message is ``format.message`` (a full name), or the first message of the reader
schema (the subject version recorded in the plan, invariant 12). Its fields are the columns
(``arrow_type``, the table in docs/guides/formats-and-registry.md). A record is decoded with its writer message, then each
reader field takes the writer field of the same name (Protobuf's wire compatibility goes by field
number; a column goes by name): a field the writer lacks is null, one the reader lacks is not
kept, one whose type differs (other than int32 -> int64 or float -> double) makes every record of
that writer schema a dead letter naming the field and both types. A field with presence
(``optional``, a message, a oneof member, proto2) that is not set is null; a proto3 field without
presence reads its default (0, "", false), as Protobuf itself answers.

Dead letters (invariant 8): a null value, no wire-format header, message indexes cut short, an
unknown schema id, a schema of another type, indexes naming no message, a message of another name
than the reader's, a payload that does not parse, a writer that does not resolve, a value its
column type cannot hold. A registry that cannot be reached fails the batch
(``offsetlake.formats.registry``).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from offsetlake.errors import ConfigError
from offsetlake.formats import PARSED, PARSED_IN_READ, REASON, TOMBSTONE, DecodedChunk, reasons
from offsetlake.formats import registry as sr
from offsetlake.formats.avro_records import fingerprint
from offsetlake.formats.base import Format, register_format
from offsetlake.plan import ReaderSchema

if TYPE_CHECKING:
    from google.protobuf.descriptor import Descriptor, FieldDescriptor
    from google.protobuf.message import Message
    from pyspark.sql import DataFrame

    from offsetlake.config import PipelineConfig, ProtobufFormat

_NO_HEADER = reasons.undecodable(
    "value does not start with the Confluent wire-format header (magic byte 0, a 4-byte schema id, message indexes)"
)
_UTC_MICROS = pa.timestamp("us", tz="UTC")
_TIMESTAMP = "google.protobuf.Timestamp"
_WRAPPERS = {
    "google.protobuf.DoubleValue": pa.float64(),
    "google.protobuf.FloatValue": pa.float32(),
    "google.protobuf.Int64Value": pa.int64(),
    "google.protobuf.UInt64Value": pa.decimal128(20, 0),
    "google.protobuf.Int32Value": pa.int32(),
    "google.protobuf.UInt32Value": pa.int64(),
    "google.protobuf.BoolValue": pa.bool_(),
    "google.protobuf.StringValue": pa.string(),
    "google.protobuf.BytesValue": pa.binary(),
}
_AS_JSON = {"google.protobuf.Struct", "google.protobuf.Value", "google.protobuf.ListValue"}
_WIDENS = {(pa.int32(), pa.int64()), (pa.float32(), pa.float64())}


def _scalars() -> dict[int, pa.DataType]:
    from google.protobuf.descriptor import FieldDescriptor as F

    return {
        F.TYPE_DOUBLE: pa.float64(),
        F.TYPE_FLOAT: pa.float32(),
        F.TYPE_INT64: pa.int64(),
        F.TYPE_SINT64: pa.int64(),
        F.TYPE_SFIXED64: pa.int64(),
        F.TYPE_UINT64: pa.decimal128(20, 0),
        F.TYPE_FIXED64: pa.decimal128(20, 0),
        F.TYPE_INT32: pa.int32(),
        F.TYPE_SINT32: pa.int32(),
        F.TYPE_SFIXED32: pa.int32(),
        F.TYPE_UINT32: pa.int64(),
        F.TYPE_FIXED32: pa.int64(),
        F.TYPE_BOOL: pa.bool_(),
        F.TYPE_STRING: pa.string(),
        F.TYPE_BYTES: pa.binary(),
        F.TYPE_ENUM: pa.string(),
    }


def _is_message(field: FieldDescriptor) -> bool:
    return field.message_type is not None


def _is_map(field: FieldDescriptor) -> bool:
    return field.is_repeated and _is_message(field) and field.message_type.GetOptions().map_entry


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _type_text(kind: pa.DataType) -> str:
    return str(kind).replace("timestamp[us, tz=UTC]", "timestamp")


def arrow_type(message: Descriptor, where: str, path: str = "", within: tuple[str, ...] = ()) -> pa.StructType:
    """The Arrow struct a message's fields become (the table in docs/guides/formats-and-registry.md); ConfigError naming the
    field for a message that contains itself (a column type is finite)."""
    if message.full_name in within:
        raise ConfigError(
            f"{where}: field '{path}' is a {message.full_name}, which contains itself; a column type "
            "cannot nest without end. Ways forward: a reader message without the recursion, or a transform"
        )
    inside = (*within, message.full_name)
    return pa.struct([pa.field(f.name, _field_type(f, where, _join(path, f.name), inside)) for f in message.fields])


def _field_type(field: FieldDescriptor, where: str, path: str, within: tuple[str, ...]) -> pa.DataType:
    if _is_map(field):
        entry = field.message_type
        key = _value_type(entry.fields_by_name["key"], where, f"{path}{{key}}", within)
        return pa.map_(key, _value_type(entry.fields_by_name["value"], where, f"{path}{{}}", within))
    value = _value_type(field, where, f"{path}[]" if field.is_repeated else path, within)
    return pa.list_(value) if field.is_repeated else value


def _value_type(field: FieldDescriptor, where: str, path: str, within: tuple[str, ...]) -> pa.DataType:
    if not _is_message(field):
        return _scalars()[field.type]
    name = field.message_type.full_name
    if name == _TIMESTAMP:
        return _UTC_MICROS
    if name in _WRAPPERS:
        return _WRAPPERS[name]
    if name in _AS_JSON:
        return pa.string()
    return arrow_type(field.message_type, where, path, within)


class _Unresolvable(Exception):
    pass


class _Resolver:
    """Getters that turn a writer message into the reader's Python values, field by field."""

    def __init__(self, described: str, reader: str) -> None:
        self.described = described
        self.reader = reader

    def _mismatch(self, path: str, writer: str, reader: pa.DataType) -> _Unresolvable:
        return _Unresolvable(
            f"{self.described} does not resolve to the reader schema ({self.reader}): field '{path}' "
            f"is {writer} in the writer and {_type_text(reader)} in the reader"
        )

    def getters(self, message: Descriptor, reader: pa.StructType, path: str = "") -> list[Callable[[Message], Any]]:
        out: list[Callable[[Message], Any]] = []
        for column in reader:
            field = message.fields_by_name.get(column.name)
            out.append(_absent if field is None else self.field(field, column.type, _join(path, column.name)))
        return out

    def field(self, field: FieldDescriptor, reader: pa.DataType, path: str) -> Callable[[Message], Any]:
        name = field.name
        if _is_map(field):
            if not pa.types.is_map(reader):
                raise self._mismatch(path, "a map", reader)
            entry = field.message_type
            key = self.value(entry.fields_by_name["key"], reader.key_type, f"{path}{{key}}")
            value = self.value(entry.fields_by_name["value"], reader.item_type, f"{path}{{}}")
            if key is None and value is None:
                return lambda m: list(getattr(m, name).items())
            return lambda m: [(key(k) if key else k, value(v) if value else v) for k, v in getattr(m, name).items()]
        if field.is_repeated:
            if not pa.types.is_list(reader):
                raise self._mismatch(path, "a repeated field", reader)
            item = self.value(field, reader.value_type, f"{path}[]")
            if item is None:
                return lambda m: list(getattr(m, name))
            return lambda m: [item(v) for v in getattr(m, name)]
        convert = self.value(field, reader, path)
        if field.has_presence:
            if convert is None:
                return lambda m: getattr(m, name) if m.HasField(name) else None
            return lambda m: convert(getattr(m, name)) if m.HasField(name) else None
        if convert is None:
            return lambda m: getattr(m, name)
        return lambda m: convert(getattr(m, name))

    def value(self, field: FieldDescriptor, reader: pa.DataType, path: str) -> Callable[[Any], Any] | None:
        """How one value of ``field`` becomes the reader's (None: as it is)."""
        if not _is_message(field):
            writer = _scalars()[field.type]
            if field.enum_type is not None:
                if reader != pa.string():
                    raise self._mismatch(path, f"enum {field.enum_type.full_name}", reader)
                symbols = {number: v.name for number, v in field.enum_type.values_by_number.items()}
                return lambda v: symbols.get(v) or str(v)
            if writer != reader and (writer, reader) not in _WIDENS:
                raise self._mismatch(path, _type_text(writer), reader)
            return None
        kind = field.message_type.full_name
        if kind == _TIMESTAMP:
            if reader != _UTC_MICROS:
                raise self._mismatch(path, kind, reader)
            return _micros
        if kind in _WRAPPERS:
            if _WRAPPERS[kind] != reader and (_WRAPPERS[kind], reader) not in _WIDENS:
                raise self._mismatch(path, kind, reader)
            return _unwrap
        if kind in _AS_JSON:
            if reader != pa.string():
                raise self._mismatch(path, kind, reader)
            return _as_json
        if not pa.types.is_struct(reader):
            raise self._mismatch(path, f"message {kind}", reader)
        getters = self.getters(field.message_type, reader, path)
        names = [column.name for column in reader]
        return lambda m: dict(zip(names, [get(m) for get in getters], strict=True))


def _absent(_message: Message) -> None:
    return None


def _micros(stamp: Any) -> int:
    return stamp.seconds * 1_000_000 + stamp.nanos // 1000


def _unwrap(wrapper: Any) -> Any:
    return wrapper.value


def _as_json(message: Any) -> str:
    from google.protobuf import json_format

    return json.dumps(json_format.MessageToDict(message), separators=(",", ":"), sort_keys=True)


def _indexes(value: bytes, at: int) -> tuple[tuple[int, ...], int] | None:
    """The message indexes starting at ``at`` and where the message starts, or None if cut short."""

    def varint(pos: int) -> tuple[int, int] | None:
        result = shift = 0
        while pos < len(value) and shift < 64:
            byte = value[pos]
            result |= (byte & 0x7F) << shift
            pos += 1
            if not byte & 0x80:
                return (result >> 1) ^ -(result & 1), pos
            shift += 7
        return None

    first = varint(at)
    if first is None or not 0 <= first[0] <= 100_000:
        return None
    count, pos = first
    if count == 0:
        return (0,), pos
    out = []
    for _ in range(count):
        read = varint(pos)
        if read is None:
            return None
        out.append(read[0])
        pos = read[1]
    return tuple(out), pos


def _proto(text: str, name: str) -> Any:
    from google.protobuf import descriptor_pb2

    proto = descriptor_pb2.FileDescriptorProto()
    proto.ParseFromString(base64.b64decode(text.encode("ascii"), validate=True))
    proto.name = name
    return proto


def _pool() -> Any:
    """A descriptor pool with the well-known types a schema imports without a registry reference."""
    from google.protobuf import (
        any_pb2,
        api_pb2,
        duration_pb2,
        empty_pb2,
        field_mask_pb2,
        source_context_pb2,
        struct_pb2,
        timestamp_pb2,
        type_pb2,
        wrappers_pb2,
    )
    from google.protobuf.descriptor_pool import DescriptorPool

    pool = DescriptorPool()
    for module in (
        any_pb2,
        source_context_pb2,
        type_pb2,
        api_pb2,
        duration_pb2,
        empty_pb2,
        field_mask_pb2,
        struct_pb2,
        timestamp_pb2,
        wrappers_pb2,
    ):
        pool.AddSerializedFile(module.DESCRIPTOR.serialized_pb)
    return pool


@dataclass(frozen=True)
class _File:
    """A registry schema loaded into a pool of its own: its proto (for message indexes) and pool."""

    proto: Any
    pool: Any


def _load(pipeline: str, settings: dict[str, str], schema_id: int) -> _File | str:
    """Schema id ``schema_id`` with its references in a pool of their own, or the reason its
    records are dead letters. Raises SchemaRegistryUnavailableError."""
    from google.protobuf.message import DecodeError

    try:
        found = sr.schema_by_id(pipeline, settings, schema_id, fmt="serialized")
    except sr.SchemaNotFound:
        return f"schema id {schema_id} is not in the Schema Registry"
    if found.schema_type != "PROTOBUF":
        return f"schema id {schema_id} is a {found.schema_type} schema, not Protobuf"
    pool = _pool()
    try:
        for ref in sr.referenced(pipeline, settings, found, fmt="serialized"):
            name = ref.import_name or f"{ref.subject}.proto"
            try:
                pool.FindFileByName(name)
                continue  # a well-known type the pool already holds
            except KeyError:
                pool.AddSerializedFile(_proto(ref.text, name).SerializeToString())
        proto = _proto(found.text, f"offsetlake_schema_{schema_id}.proto")
        pool.AddSerializedFile(proto.SerializeToString())
    except (ValueError, TypeError, DecodeError) as err:  # a text schema, or a file the pool refuses
        return f"schema id {schema_id} is not a Protobuf schema this reader can load: {type(err).__name__}: {err}"
    return _File(proto, pool)


def message_name(proto: Any, indexes: tuple[int, ...]) -> str | None:
    """The full name of the message ``indexes`` name in a file, or None."""
    names: list[str] = []
    messages = proto.message_type
    for index in indexes:
        if not 0 <= index < len(messages):
            return None
        names.append(messages[index].name)
        messages = messages[index].nested_type
    return ".".join(([proto.package] if proto.package else []) + names)


def resolve_reader_schema(config: PipelineConfig) -> ReaderSchema:
    """The subject's latest (or pinned) Protobuf schema; ConfigError now if the reader message is
    not in it or has no column mapping."""
    schema = sr.registry_reader_schema(config, "PROTOBUF", fingerprint)
    ProtobufDecoder(config, schema).fields()
    return schema


@dataclass
class _Writer:
    """One (schema id, message indexes) as the read task uses it: the message class and the
    getters of the reader's columns, or the reason its records are dead letters."""

    message: Any
    getters: list[Callable[[Message], Any]] | None
    problem: str | None


class ProtobufDecoder:
    """The Protobuf format of one pipeline, decoding into one reader message."""

    rows_in_read = True

    def __init__(self, config: PipelineConfig, reader: ReaderSchema) -> None:
        fmt: ProtobufFormat = config.format  # type: ignore[assignment]
        self.pipeline = config.name
        self.settings, schema_id, where = sr.decoder_setting(config, reader)
        self.reader = reader
        loaded = _load(self.pipeline, self.settings, schema_id)
        if isinstance(loaded, str):
            raise ConfigError(f"{where}: {loaded}")
        everything = [message_name(loaded.proto, path) for path in _message_paths(loaded.proto.message_type)]
        if not everything:
            raise ConfigError(f"{where}: declares no message; a sink row needs a message's fields")
        self.message = fmt.message or everything[0]
        if self.message not in everything:
            raise ConfigError(
                f"{where}: format.message {self.message} is not a message of it (it has: {', '.join(str(n) for n in everything)})"
            )
        self._final = arrow_type(loaded.pool.FindMessageTypeByName(self.message), where)
        if not len(self._final):
            raise ConfigError(f"{where}: message {self.message} has no fields; a sink row needs named fields")
        self._writers: dict[tuple[int, tuple[int, ...]], _Writer] | None = None
        self._files: dict[int, _File | str] | None = None

    def __getstate__(self) -> dict[str, Any]:  # shipped to Spark tasks without pools and classes
        return {**self.__dict__, "_writers": None, "_files": None}

    def fields(self) -> list[str]:
        return [f.name for f in self._final]

    def read_type(self) -> pa.StructType:
        return self._final

    def check_types(self, where: str) -> None:
        """The types were mapped when the decoder was made (ConfigError naming the field then)."""

    def decode_in_spark(self, raw: DataFrame) -> DataFrame:
        from pyspark.sql import functions as F

        # every record was decided in the read task: problems are in read_problem
        return raw.withColumnRenamed(PARSED_IN_READ, PARSED).withColumn(REASON, F.lit(None).cast("string"))

    # ---- in the read task ---------------------------------------------------------------------
    def _writer(self, schema_id: int, indexes: tuple[int, ...]) -> _Writer:
        from google.protobuf.message_factory import GetMessageClass

        if self._writers is None or self._files is None:
            self._writers, self._files = {}, {}
        key = (schema_id, indexes)
        if key not in self._writers:
            if schema_id not in self._files:
                self._files[schema_id] = _load(self.pipeline, self.settings, schema_id)
            loaded = self._files[schema_id]
            described = f"writer schema id {schema_id}"
            if isinstance(loaded, str):
                self._writers[key] = _Writer(None, None, reasons.schema_mismatch(loaded))
                return self._writers[key]
            name = message_name(loaded.proto, indexes)
            if name is None:
                self._writers[key] = _Writer(
                    None, None, reasons.schema_mismatch(f"message indexes {list(indexes)} name no message in {described}")
                )
            elif name != self.message:
                self._writers[key] = _Writer(
                    None, None, reasons.schema_mismatch(f"{described} message {name} is not the reader's message {self.message}")
                )
            else:
                descriptor = loaded.pool.FindMessageTypeByName(name)
                try:
                    getters = _Resolver(described, self.reader.describe()).getters(descriptor, self._final)
                except _Unresolvable as err:
                    self._writers[key] = _Writer(None, None, reasons.schema_mismatch(str(err)))
                else:
                    self._writers[key] = _Writer(GetMessageClass(descriptor), getters, None)
        return self._writers[key]

    def decode_chunk(self, values: list[bytes | None]) -> DecodedChunk:
        """Each record through its writer message class, then the reader's columns, built once
        per chunk."""
        from google.protobuf.message import DecodeError

        count = len(values)
        problems: list[str | None] = [None] * count
        rows: list[tuple | None] = [None] * count
        for i, value in enumerate(values):
            if value is None:
                problems[i] = TOMBSTONE
                continue
            if len(value) < 6 or value[0] != 0:
                problems[i] = _NO_HEADER
                continue
            schema_id = int.from_bytes(value[1:5], "big")
            found = _indexes(value, 5)
            if found is None:
                problems[i] = reasons.undecodable(f"the message indexes after schema id {schema_id} are cut short or malformed")
                continue
            indexes, start = found
            writer = self._writer(schema_id, indexes)
            if writer.problem is not None:
                problems[i] = writer.problem
                continue
            try:
                message = writer.message.FromString(value[start:])
            except DecodeError as err:
                problems[i] = reasons.undecodable(
                    f"payload does not parse as Protobuf message {self.message} with writer schema id {schema_id}: {err}"
                )
                continue
            rows[i] = tuple(get(message) for get in writer.getters)  # type: ignore[union-attr]
        parsed = self._columns(rows, problems)
        return DecodedChunk(parsed, problems if any(p is not None for p in problems) else None, [p is None for p in problems])

    def _columns(self, rows: list[tuple | None], problems: list[str | None]) -> pa.StructArray:
        """The rows as the reader's struct, one Arrow array per column; a row whose value its
        column type cannot hold (a Timestamp past what microseconds hold) becomes a dead letter."""
        try:
            return self._struct(rows)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
            for i, row in enumerate(rows):
                if row is None:
                    continue
                try:
                    self._struct([row])
                except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as err:
                    problems[i] = reasons.value_range(f"a value does not fit its sink column type: {err}")
                    rows[i] = None
            return self._struct(rows)

    def _struct(self, rows: list[tuple | None]) -> pa.StructArray:
        mask = pa.array([row is None for row in rows], pa.bool_())
        columns = [pa.array([row[n] if row is not None else None for row in rows], column.type) for n, column in enumerate(self._final)]
        return pa.StructArray.from_arrays(columns, fields=list(self._final), mask=mask)


def _message_paths(messages: Any, prefix: tuple[int, ...] = ()) -> list[tuple[int, ...]]:
    """Index paths of every message in a file, top-level first, map entries left out."""
    out = [(*prefix, i) for i in range(len(messages))]
    for i, message in enumerate(messages):
        out += [p for p in _message_paths(message.nested_type, (*prefix, i)) if not _entry(messages[i], p[len(prefix) + 1 :])]
    return out


def _entry(message: Any, path: tuple[int, ...]) -> bool:
    for index in path:
        message = message.nested_type[index]
    return bool(message.options.map_entry)


register_format(Format("protobuf", resolve_reader_schema, ProtobufDecoder))
