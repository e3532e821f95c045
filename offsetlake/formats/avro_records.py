"""``format.type: avro``: Avro values decoded in the read tasks, each with its own writer schema,
resolved to the batch's reader schema (the one its plan recorded, invariant 12).

Three encodings: ``confluent`` (the Confluent wire format: magic byte 0, a 4-byte big-endian
schema id, the Avro binary; writer schemas fetched from the Schema Registry by id), ``binary``
(plain Avro binary written with the pipeline's ``.avsc``) and ``single_object`` (Avro's
single-object encoding: ``C3 01``, the writer schema's 8-byte CRC-64-AVRO fingerprint, the binary).

A record that cannot become a row is a dead letter with its reason (invariant 8): a null value,
a missing or wrong header, a schema id the registry does not hold, a payload that does not
decode or leaves bytes over, a writer schema that does not resolve to the reader schema. A
registry that cannot be reached fails the batch instead (``offsetlake.formats.registry``).

The Avro-to-Arrow mapping (``arrow_type``) is the table in docs/guides/formats-and-registry.md; what has no Delta type
this project writes (a union of several non-null types, a field of type null) is refused when
the batch is planned, naming the field.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from offsetlake.errors import ConfigError
from offsetlake.formats import PARSED, PARSED_IN_READ, REASON, TOMBSTONE, DecodedChunk, reasons
from offsetlake.formats import registry as sr
from offsetlake.formats.avro_columns import ChunkBuffer, ColumnReader, full_name
from offsetlake.formats.base import Format, register_format
from offsetlake.plan import ReaderSchema

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from offsetlake.config import AvroFormat, PipelineConfig

_SINGLE_OBJECT = b"\xc3\x01"
# Logical types decoded as their underlying number and converted in Arrow (one cast per chunk
# instead of a Python datetime per value: fastavro's datetimes cost more than the decode itself).
_CAST_IN_ARROW = {"date", "timestamp-millis", "timestamp-micros"}
_KEPT_AS_NUMBER = {
    "time-millis",
    "time-micros",
    "timestamp-nanos",
    "local-timestamp-millis",
    "local-timestamp-micros",
    "local-timestamp-nanos",
}
_UTC_MICROS = pa.timestamp("us", tz="UTC")
_STREAM_NAME = re.compile(r" from <_io\.BytesIO object at 0x[0-9a-fA-F]+>")


def fingerprint(text: str) -> str:
    """A stable name for a schema text (its canonical JSON's SHA-256)."""
    try:
        canonical = json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
    except ValueError:
        canonical = text
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def resolve_reader_schema(config: PipelineConfig) -> ReaderSchema:
    """The reader schema a new plan records: the subject's latest (or pinned) version from the
    registry, or the local ``.avsc``. Raises SchemaRegistryUnavailableError, ConfigError."""
    fmt: AvroFormat = config.format  # type: ignore[assignment]
    if fmt.schema_file:
        text = (config.transform_dir / fmt.schema_file).read_text()
        schema = ReaderSchema(source="file", fingerprint=fingerprint(text), text=text)
    else:
        schema = sr.registry_reader_schema(config, "AVRO", fingerprint, "or a local format.schema_file")
    AvroDecoder(config, schema).fields()  # its types map to Delta's, or ConfigError now, before anything is read
    return schema


def strip_logical_types(schema: Any) -> Any:
    """The schema with the logical types that Arrow converts faster removed (see _CAST_IN_ARROW)."""
    if isinstance(schema, list):
        return [strip_logical_types(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strip_logical_types(v) for k, v in schema.items() if k not in ("fields", "items", "values")}
    if out.get("logicalType") in _CAST_IN_ARROW | _KEPT_AS_NUMBER | {"uuid"}:
        out.pop("logicalType")
    if "fields" in schema:
        out["fields"] = [{**f, "type": strip_logical_types(f["type"])} for f in schema["fields"]]
    for key in ("items", "values"):
        if key in schema:
            out[key] = strip_logical_types(schema[key])
    return out


class ArrowTypes:
    """Arrow types of an Avro schema: the final column types and the raw types fastavro's
    values (logical types stripped) are built into before one cast per chunk."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.named: dict[str, tuple[pa.DataType, pa.DataType]] = {}

    def of(self, schema: Any, path: str, namespace: str | None = None) -> tuple[pa.DataType, pa.DataType]:
        if isinstance(schema, str):
            return self._named_or_primitive(schema, path, namespace)
        if isinstance(schema, list):
            members = [s for s in schema if s != "null"]
            if len(members) != 1:
                raise ConfigError(
                    f"{self.where}: field '{path}' is a union of {len(members)} non-null types "
                    f"({', '.join(_type_name(m) for m in members)}); a sink column has one type. "
                    "Ways forward: a [null, T] union in the reader schema, or a transform"
                )
            return self.of(members[0], path, namespace)
        kind = schema.get("type")
        logical = schema.get("logicalType")
        if kind == "record" or kind == "error":
            name = full_name(schema, namespace)
            ns = name.rpartition(".")[0] or None
            fields = [(f["name"], self.of(f["type"], f"{path}.{f['name']}" if path else f["name"], ns)) for f in schema["fields"]]
            result = (pa.struct([(n, t[0]) for n, t in fields]), pa.struct([(n, t[1]) for n, t in fields]))
            self.named[name] = result
            return result
        if kind == "enum":
            self.named[full_name(schema, namespace)] = (pa.string(), pa.string())
            return pa.string(), pa.string()
        if kind == "fixed":
            result = self._decimal(schema, path) if logical == "decimal" else (pa.binary(), pa.binary())
            self.named[full_name(schema, namespace)] = result
            return result
        if kind == "array":
            item = self.of(schema["items"], f"{path}[]", namespace)
            return pa.list_(item[0]), pa.list_(item[1])
        if kind == "map":
            value = self.of(schema["values"], f"{path}{{}}", namespace)
            return pa.map_(pa.string(), value[0]), pa.map_(pa.string(), value[1])
        if logical == "decimal" and kind == "bytes":
            return self._decimal(schema, path)
        base = self._named_or_primitive(kind, path, namespace)
        if logical == "date" and kind == "int":
            return pa.date32(), pa.date32()
        if logical in ("timestamp-millis", "timestamp-micros") and kind == "long":
            return _UTC_MICROS, pa.timestamp("ms" if logical == "timestamp-millis" else "us", tz="UTC")
        return base

    def _decimal(self, schema: dict, path: str) -> tuple[pa.DataType, pa.DataType]:
        precision, scale = int(schema.get("precision", 0)), int(schema.get("scale", 0))
        if not 1 <= precision <= 38:
            raise ConfigError(f"{self.where}: field '{path}' is a decimal of precision {precision}; Delta's decimals hold 1 to 38 digits")
        return pa.decimal128(precision, scale), pa.decimal128(precision, scale)

    def _named_or_primitive(self, name: str, path: str, namespace: str | None) -> tuple[pa.DataType, pa.DataType]:
        primitive = {
            "boolean": pa.bool_(),
            "int": pa.int32(),
            "long": pa.int64(),
            "float": pa.float32(),
            "double": pa.float64(),
            "bytes": pa.binary(),
            "string": pa.string(),
        }.get(name)
        if primitive is not None:
            return primitive, primitive
        if name == "null":
            raise ConfigError(f"{self.where}: field '{path}' has type null; a sink column needs a type")
        for candidate in (name, f"{namespace}.{name}" if namespace else name):
            if candidate in self.named:
                return self.named[candidate]
        raise ConfigError(f"{self.where}: field '{path}' names type '{name}', which the schema does not define")


def _type_name(schema: Any) -> str:
    if isinstance(schema, dict):
        return str(schema.get("name") or schema.get("type"))
    return str(schema)


@dataclass(frozen=True)
class _Writer:
    """A writer schema as the read task uses it: parsed for fastavro, with its columnar reader
    (None: fastavro decodes its records), or the dead-letter reason of every record carrying it."""

    parsed: Any
    problem: str | None
    columns: ColumnReader | None = None


class AvroDecoder:
    """The Avro format of one pipeline, decoding into one reader schema."""

    rows_in_read = True

    def __init__(self, config: PipelineConfig, reader: ReaderSchema) -> None:
        fmt: AvroFormat = config.format  # type: ignore[assignment]
        self.pipeline = config.name
        self.where = config.source_file or config.name
        self.settings = dict(fmt.schema_registry)
        self.encoding = fmt.encoding or ("binary" if fmt.schema_file else "confluent")
        self.reader = reader
        self._reader_text = reader.text if reader.text is not None else self._registry_text(reader.id)
        types = ArrowTypes(f"{self.where}: reader schema {reader.describe()}")
        schema = json.loads(self._reader_text)
        if not isinstance(schema, dict) or schema.get("type") != "record":
            raise ConfigError(f"{self.where}: reader schema {reader.describe()} is not an Avro record; a sink row needs named fields")
        final, raw = types.of(schema, "")
        assert isinstance(final, pa.StructType) and isinstance(raw, pa.StructType)
        self._final, self._raw = final, raw
        self._names = [f["name"] for f in schema["fields"]]
        self._runtime: dict[str, Any] | None = None

    def _registry_text(self, schema_id: int | None) -> str:
        if schema_id is None:
            raise ConfigError("a registry reader schema without an id", pipeline=self.pipeline)
        found = sr.schema_by_id(self.pipeline, self.settings, schema_id)
        return _with_references(self.pipeline, self.settings, found)

    def __getstate__(self) -> dict[str, Any]:  # shipped to Spark tasks without parsed schemas
        return {**self.__dict__, "_runtime": None}

    def fields(self) -> list[str]:
        return list(self._names)

    def read_type(self) -> pa.StructType:
        return self._final

    def check_types(self, where: str) -> None:
        """The types were mapped when the decoder was made (ConfigError naming the field then)."""

    def decode_in_spark(self, raw: DataFrame) -> DataFrame:
        from pyspark.sql import functions as F

        # every record was decided in the read task: problems are in read_problem
        return raw.withColumnRenamed(PARSED_IN_READ, PARSED).withColumn(REASON, F.lit(None).cast("string"))

    # ---- in the read task ---------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        if self._runtime is None:
            import fastavro

            reader_json = strip_logical_types(json.loads(self._reader_text))
            raw_reader = fastavro.parse_schema(reader_json, named_schemas={})
            self._runtime = {"reader": raw_reader, "reader_json": reader_json, "writers": {}}
            if self.encoding != "confluent":
                parsed = fastavro.parse_schema(json.loads(self._reader_text), named_schemas={})
                own = fastavro.parse_schema(reader_json, named_schemas={})
                self._runtime["own"] = _Writer(own, None, ColumnReader.plan(reader_json, reader_json, self._raw))
                # the 8 bytes of the single-object header (fastavro gives them in that order)
                canonical = fastavro.schema.to_parsing_canonical_form(parsed)
                crc64 = fastavro.schema.fingerprint(canonical, "CRC-64-AVRO")
                self._runtime["fingerprint"] = bytes.fromhex(crc64)
        return self._runtime

    def _writer(self, schema_id: int) -> _Writer:
        """The writer schema of ``schema_id`` (stripped like the reader, parsed by fastavro, and its
        columnar reader when it has one), or the reason a record carrying it is a dead letter."""
        import fastavro

        state = self._state()
        writers = state["writers"]
        if schema_id not in writers:
            try:
                found = sr.schema_by_id(self.pipeline, self.settings, schema_id)
            except sr.SchemaNotFound:
                writers[schema_id] = _Writer(None, reasons.schema_mismatch(f"schema id {schema_id} is not in the Schema Registry"))
            else:
                if found.schema_type != "AVRO":
                    writers[schema_id] = _Writer(
                        None, reasons.schema_mismatch(f"schema id {schema_id} is a {found.schema_type} schema, not Avro")
                    )
                else:
                    stripped = strip_logical_types(json.loads(_with_references(self.pipeline, self.settings, found)))
                    try:
                        parsed = fastavro.parse_schema(stripped, named_schemas={})
                    except Exception as err:
                        writers[schema_id] = _Writer(
                            None, reasons.schema_mismatch(f"writer schema id {schema_id} is not a schema Avro reads: {err}")
                        )
                    else:
                        columns = ColumnReader.plan(stripped, state["reader_json"], self._raw)
                        writers[schema_id] = _Writer(parsed, None, columns)
        return writers[schema_id]

    def decode_chunk(self, values: list[bytes | None]) -> DecodedChunk:
        """Headers of the whole chunk at once (numpy over one joined buffer), then the payloads of
        each writer schema together (``avro_columns``); fastavro decodes what that path does not
        take and every record it found wrong, and names the reason."""
        state = self._state()
        count = len(values)
        problems: list[str | None] = [None] * count
        present = np.fromiter((v is not None for v in values), bool, count)
        for missing in np.flatnonzero(~present):
            problems[missing] = TOMBSTONE
        rows = np.flatnonzero(present)
        chunk = ChunkBuffer([v for v in values if v is not None])
        header = {"confluent": 5, "single_object": 10}.get(self.encoding, 0)
        good, keys = self._headers(state, values, rows, chunk, problems)
        pieces = self._decoded_by_writer(state, values, rows, chunk, header, good, keys, problems)
        parsed = self._assemble(count, pieces, problems)
        settled = [p is None for p in problems]
        return DecodedChunk(parsed, problems if any(p is not None for p in problems) else None, settled)

    def _headers(
        self, state: dict, values: list[bytes | None], rows: np.ndarray, chunk: ChunkBuffer, problems: list[str | None]
    ) -> tuple[np.ndarray, np.ndarray]:
        """Per present value: whether its header is good and its writer schema's key (-1: the
        schema file's, -2: none); a bad header's or a wrong fingerprint's reason goes to ``problems``."""
        if self.encoding == "confluent":
            good = (chunk.sizes >= 5) & (chunk.byte(0) == 0)
            keys = np.where(good, chunk.big_endian_u32(1), -1)
            bad_reason = reasons.undecodable(
                "value does not start with the Confluent wire-format header (magic byte 0 and a 4-byte schema id)"
            )
        elif self.encoding == "single_object":
            good = (chunk.sizes >= 10) & (chunk.byte(0) == 0xC3) & (chunk.byte(1) == 0x01)
            keys = np.where(good, -1, -2)
            bad_reason = reasons.undecodable("value does not start with the Avro single-object header (C3 01 and a fingerprint)")
            wrong = good & ~chunk.equals(2, state["fingerprint"])
            for j in np.flatnonzero(wrong):
                found = values[rows[j]][2:10]
                problems[rows[j]] = reasons.schema_mismatch(
                    f"writer schema fingerprint {found.hex()} is not the schema file's ({state['fingerprint'].hex()})"
                )
            keys = np.where(wrong, -2, keys)
            good &= ~wrong
        else:
            good = np.ones(len(rows), bool)
            keys = np.full(len(rows), -1)
            bad_reason = ""
        for j in np.flatnonzero(~good):
            problems[rows[j]] = problems[rows[j]] or bad_reason
        return good, keys

    def _decoded_by_writer(
        self,
        state: dict,
        values: list[bytes | None],
        rows: np.ndarray,
        chunk: ChunkBuffer,
        header: int,
        good: np.ndarray,
        keys: np.ndarray,
        problems: list[str | None],
    ) -> list[tuple[pa.StructArray, list[int | None]]]:
        """The payloads of each writer schema together (``avro_columns``), with fastavro for what
        that path does not take; each piece is raw arrays and each row's record."""
        pieces: list[tuple[pa.StructArray, list[int | None]]] = []  # raw arrays, each row's record
        slow_rows: list[int | None] = []
        slow_records: list[dict | None] = []
        for key in np.unique(keys[good]).tolist():
            members = np.flatnonzero(good & (keys == key))
            writer = state["own"] if key == -1 else self._writer(key)
            described = "the schema file" if key == -1 else f"writer schema id {key}"
            if writer.problem is not None:
                for j in members:
                    problems[rows[j]] = writer.problem
                continue
            ok = None
            if writer.columns is not None:
                decoded, ok = writer.columns.decode_at(chunk, members, header)
                pieces.append((decoded, [int(rows[j]) if ok[n] else None for n, j in enumerate(members)]))
            for n, j in enumerate(members):
                if ok is None or not ok[n]:
                    at = int(rows[j])
                    payload = values[at][header:]  # type: ignore[index]
                    record, problems[at] = self._decode_one(payload, writer.parsed, state["reader"], described)
                    if record is not None:
                        slow_rows.append(at)
                        slow_records.append(record)
        if slow_records:
            pieces.append((self._raw_from_dicts(slow_records), slow_rows))
        return pieces

    def _decode_one(self, payload: bytes, writer: Any, reader: Any, described: str) -> tuple[dict | None, str | None]:
        """One payload through fastavro: its record, or why it is a dead letter."""
        from fastavro import schemaless_reader
        from fastavro._read_common import SchemaResolutionError

        stream = io.BytesIO(payload)
        try:
            decoded = schemaless_reader(stream, writer, reader)
        except SchemaResolutionError as err:
            return None, reasons.schema_mismatch(f"{described} does not resolve to the reader schema ({self.reader.describe()}): {err}")
        except EOFError:
            return None, reasons.undecodable(f"payload ends before the Avro record does ({described})")
        except Exception as err:
            said = _STREAM_NAME.sub("", str(err))  # the same reason for the same bytes, run after run
            return None, reasons.undecodable(f"payload does not decode as Avro with {described}: {type(err).__name__}: {said}")
        left = len(payload) - stream.tell()
        if left:
            return None, reasons.undecodable(f"payload has {left} bytes left after the Avro record ({described})")
        if not isinstance(decoded, dict):
            return None, reasons.undecodable(f"payload does not decode to an Avro record with {described}")
        return decoded, None

    def _assemble(self, count: int, pieces: list[tuple[pa.StructArray, list[int | None]]], problems: list[str | None]) -> pa.StructArray:
        """The chunk's records in their order, in the reader's final type (null for a dead letter),
        out of raw pieces whose rows belong to the given records; a record whose value the final
        type cannot hold (a timestamp past what microseconds hold) gets its reason in ``problems``."""
        finals = []
        index = np.zeros(count, np.int64)
        valid = np.zeros(count, bool)
        offset = 0
        for raw, rows in pieces:
            final, bad = self._to_final(raw)
            finals.append(final)
            for row, i in enumerate(rows):
                if i is None:
                    continue
                if row in bad:
                    problems[i] = bad[row]
                    continue
                index[i], valid[i] = offset + row, True
            offset += len(raw)
        if not finals:
            return pa.nulls(count, self._final)
        merged = pa.concat_arrays(finals) if len(finals) > 1 else finals[0]
        return merged.take(pa.array(index, mask=~valid))

    def _raw_from_dicts(self, records: list[dict | None]) -> pa.StructArray:
        """fastavro's records as the reader's raw struct type, built column by column."""
        raw_type = self._raw
        mask = pa.array([r is None for r in records], pa.bool_())
        columns = [pa.array([r[f.name] if r is not None else None for r in records], f.type) for f in raw_type]
        return pa.StructArray.from_arrays(columns, fields=list(raw_type), mask=mask)

    def _to_final(self, raw: pa.StructArray) -> tuple[pa.StructArray, dict[int, str]]:
        """``raw`` cast to the final type in one go; when a value does not fit (a timestamp in
        milliseconds beyond what microseconds hold), its row becomes a dead letter instead of
        failing the chunk."""
        try:
            return raw.cast(self._final), {}
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            bad: dict[int, str] = {}
            for row in range(len(raw)):
                try:
                    raw.slice(row, 1).cast(self._final)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as err:
                    bad[row] = reasons.value_range(f"a value does not fit its sink column type: {err}")
            keep = pa.array([row not in bad for row in range(len(raw))], pa.bool_())
            return _cast_valid(raw, self._final, keep), bad


def _cast_valid(raw: pa.StructArray, final: pa.DataType, keep: pa.BooleanArray) -> pa.StructArray:
    """Cast with the rows not kept replaced by nulls all the way down (their values may not fit)."""
    import pyarrow.compute as pc

    nulls = pa.nulls(len(raw), raw.type)
    return pc.if_else(keep, raw, nulls).cast(final)


def _with_references(pipeline: str, settings: dict[str, str], schema: sr.RegisteredText) -> str:
    """The schema text with the named types it references inlined where first used, so fastavro
    (and the type mapping) see one self-contained schema."""
    if not schema.references:
        return schema.text
    named: dict[str, Any] = {}
    for ref in sr.referenced(pipeline, settings, schema):
        parsed = json.loads(ref.text)
        if isinstance(parsed, dict) and "name" in parsed:
            named[full_name(parsed, None)] = parsed
            named.setdefault(parsed["name"], parsed)
    used: set[str] = set()

    def inline(node: Any) -> Any:
        if isinstance(node, str) and node in named and node not in used:
            used.add(node)
            return inline(named[node])
        if isinstance(node, list):
            return [inline(n) for n in node]
        if isinstance(node, dict):
            return {k: inline(v) if k in ("type", "items", "values", "fields") else v for k, v in node.items()}
        return node

    top = json.loads(schema.text)
    if isinstance(top, dict) and "fields" in top:
        top["fields"] = [{**f, "type": inline(f["type"])} for f in top["fields"]]
    return json.dumps(top)


register_format(Format("avro", resolve_reader_schema, AvroDecoder))
