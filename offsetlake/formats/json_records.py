"""``format.type: json``: JSON objects parsed against the schema declared in the pipeline YAML.

Most records are parsed in the read tasks by pyarrow's JSON reader (``decode_chunk``); whatever
it does not parse is parsed by Spark's ``from_json`` (``decode_in_spark``), whose rules decide
what becomes a dead letter: null value (tombstone), invalid UTF-8, not a JSON object, a value
that does not match the schema, a required field missing or null.

Whether a record becomes a row or a dead letter never depends on the records around it (which
parser takes it follows chunk boundaries, and so fetch timing): where the two parsers would
answer differently, the read task decides for every record alike. It makes a dead letter of a
value nested deeper than ``MAX_DEPTH`` levels (Spark refuses those, pyarrow did not), a value
with more than one JSON value in it (``{"a":1}{"a":2}``: Spark kept the first and dropped the
rest silently), and a string holding an unpaired UTF-16 surrogate escape (``"\\ud800"``: Spark
turned it into ``?``, and UTF-8 cannot hold it). Size is decided before either parser runs
(``reader.record_size_problems``: above ``max_record_bytes`` a dead letter, ``record_too_large``),
and both parsers take any value below it: pyarrow's block grows to the longest value of a piece,
and Jackson's own string limit (20,000,000 characters) is lifted in every ``from_json``.
"""

from __future__ import annotations

import json
import re
import sys
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from offsetlake.formats import PARSED, PARSED_IN_READ, REASON, TOMBSTONE, DecodedChunk, reasons
from offsetlake.formats.base import Decoder, Format, register_format
from offsetlake.plan import ReaderSchema

if TYPE_CHECKING:
    from collections.abc import Callable

    from pyspark.sql import Column, DataFrame

    from offsetlake.config import JsonFormat, PipelineConfig

_CORRUPT = "_corrupt_record"
_MIN_PIECE = 64  # below this a failing piece of a chunk is left to Spark's from_json
_BLOCK_BYTES = 1 << 26  # pyarrow's parse block; a piece with a longer value gets a block that holds it
MAX_DEPTH = 1000  # Jackson's default nesting limit, which Spark's from_json keeps
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_ERROR_ROW = re.compile(r" in row (\d+)$")  # how pyarrow's JSON reader names the row a parse error is in

# Spark types whose JSON reading pyarrow does the same way, or refuses (then Spark parses).
_ARROW_TYPES = {
    "string": pa.string(),
    "long": pa.int64(),
    "bigint": pa.int64(),
    "int": pa.int32(),
    "integer": pa.int32(),
    "short": pa.int16(),
    "byte": pa.int8(),
    "double": pa.float64(),
    "float": pa.float32(),
    "boolean": pa.bool_(),
    "timestamp": pa.timestamp("us", tz="UTC"),
    "timestamp_ltz": pa.timestamp("us", tz="UTC"),
}


def yaml_reader_schema(fmt: JsonFormat) -> ReaderSchema:
    """The pipeline file's schema as a plan records it: its text, so a rerun decodes with it."""
    import hashlib

    text = json.dumps({"schema": fmt.schema_, "required": fmt.required}, separators=(",", ":"))  # field order kept
    return ReaderSchema(source="yaml", fingerprint="sha256:" + hashlib.sha256(text.encode()).hexdigest(), text=text)


def json_format_of(reader: ReaderSchema, current: JsonFormat) -> JsonFormat:
    """The JSON format a plan recorded (``current`` when the plan recorded none of its own)."""
    from offsetlake.config import JsonFormat

    if reader.source != "yaml" or not reader.text:
        return current
    recorded = json.loads(reader.text)
    return JsonFormat.model_validate({"type": "json", "schema": recorded["schema"], "required": recorded.get("required", [])})


class JsonDecoder:
    """The JSON-with-schema format of one pipeline."""

    rows_in_read = True

    def __init__(self, fmt: JsonFormat) -> None:
        self.schema = dict(fmt.schema_)
        self.required = list(fmt.required)
        self.ddl = fmt.ddl()
        self._read_type = _parsed_struct_type(self.schema)

    def fields(self) -> list[str]:
        return list(self.schema)

    def read_type(self) -> pa.StructType | None:
        return self._read_type

    def decode_chunk(self, values: list[bytes | None]) -> DecodedChunk:
        parsed = parse_json_values(values, self._read_type) if self._read_type is not None else None
        undecided = range(len(values)) if parsed is None else [i for i, n in enumerate(parsed.is_null().to_pylist()) if n]
        problems: list[str | None] | None = None
        for i in undecided:
            problem = structure_problem(values[i])
            if problem is not None:
                problems = problems or [None] * len(values)
                problems[i] = problem
        settled = None
        if parsed is not None:
            valid = parsed.is_valid()
            for name in self.required:
                valid = pc.and_(valid, parsed.field(name).is_valid())
            settled = valid.to_pylist()
            if problems is not None:
                settled = [s and p is None for s, p in zip(settled, problems, strict=True)]
        return DecodedChunk(parsed, problems, settled)

    def decode_in_spark(self, raw: DataFrame) -> DataFrame:
        return parse_json(raw, self.ddl, self.required)

    def check_types(self, where: str) -> None:
        """Each declared type through Spark's own parser (a session must be running); raises
        ConfigError naming the field, where Spark's ``from_json`` would name the wrong one."""
        from pyspark.sql.types import _parse_datatype_string

        from offsetlake.errors import ConfigError

        for name, type_name in self.schema.items():
            try:
                _parse_datatype_string(type_name)
            except Exception as err:
                first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise ConfigError(f"{where}: format.schema.{name}: Spark cannot read the type '{type_name}': {first}") from None


def _parsed_struct_type(schema: dict[str, str]) -> pa.StructType | None:
    """The Arrow type of a parsed value (the declared fields plus the corrupt-record column), or
    None when a declared type is one the read tasks leave to Spark (date, decimal, nested...)."""
    fields = []
    for name, type_name in schema.items():
        arrow_type = _ARROW_TYPES.get(type_name.strip().lower())
        if arrow_type is None:
            return None
        fields.append(pa.field(name, arrow_type))
    return pa.struct([*fields, pa.field(_CORRUPT, pa.string())])


def structure_problem(value: bytes | None) -> str | None:
    """The dead-letter reason of a value the read task decides on, or None to leave it to Spark."""
    if value is None:
        return None  # a tombstone: Spark's reason
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        return None  # Spark's reason
    if len(value) > MAX_DEPTH and value.count(b"{") + value.count(b"[") > MAX_DEPTH:
        depth = nesting_depth(value)
        if depth > MAX_DEPTH:
            return reasons.undecodable(f"value nests JSON {depth} levels deep, more than the {MAX_DEPTH} the sink's parser reads")
    limit = sys.getrecursionlimit()
    try:
        # parsing and re-encoding a value up to MAX_DEPTH deep both recurse once per level
        sys.setrecursionlimit(max(limit, MAX_DEPTH * 3))
        parsed = json.loads(text)
        lone_surrogate = _SURROGATE_ESCAPE.search(value) is not None and _has_lone_surrogate(parsed)
    except json.JSONDecodeError as err:
        if err.msg == "Extra data":
            return reasons.undecodable(f"value holds more than one JSON value (more text after character {err.pos})")
        return None  # not JSON by Python's rules (single quotes, ...): Spark's rules decide
    except (RecursionError, ValueError):
        return None
    finally:
        sys.setrecursionlimit(limit)
    if lone_surrogate:
        return reasons.undecodable("value holds an unpaired UTF-16 surrogate escape (\\ud800-\\udfff), which UTF-8 text cannot hold")
    return None


def structure_suspects(value: Column) -> Column:
    """In the JVM (the ``jvm`` data path, ``offsetlake.kafka_source``): true for every value that
    ``structure_problem`` may find fault with, and for few others; the read path asks
    ``structure_problem`` about exactly these, so a record's fate is the same on every path.

    Jackson reads one value and stops, so "more than one JSON value" is found by reading the value
    inside an array and inside an object: text after a complete value makes one of the two fail
    (after ``]`` only the object does, after ``,`` the array counts two). Nesting deeper than
    ``MAX_DEPTH`` fails both (Jackson's own limit), and a surrogate escape is found by its text.
    """
    from pyspark.sql import functions as F

    text = value.cast("string")
    in_array = F.json_array_length(F.concat(F.lit("["), text, F.lit("]")))
    in_object = F.json_object_keys(F.concat(F.lit('{"_":'), text, F.lit("}")))
    suspect = F.coalesce(in_array != 1, F.lit(True)) | in_object.isNull() | text.rlike(_SURROGATE_ESCAPE.pattern.decode())
    return value.isNotNull() & suspect


def nesting_depth(value: bytes) -> int:
    """The deepest nesting of JSON objects and arrays in ``value`` (brackets inside strings ignored)."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in value:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x7B, 0x5B):
            depth += 1
            deepest = max(deepest, depth)
        elif byte in (0x7D, 0x5D):
            depth -= 1
    return deepest


def _has_lone_surrogate(parsed: object) -> bool:
    try:
        json.dumps(parsed, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _too_deep(piece: list[bytes]) -> bool:
    """Whether a record of ``piece`` may nest deeper than MAX_DEPTH (pyarrow would parse it)."""
    return any(len(v) > MAX_DEPTH and v.count(b"{") + v.count(b"[") > MAX_DEPTH and nesting_depth(v) > MAX_DEPTH for v in piece)


def parse_json_values(values: list[bytes | None], struct: pa.StructType) -> pa.StructArray:
    """Parse a read chunk's values with pyarrow's JSON reader, inside the read task.

    Why: Spark's ``from_json`` cost the JVM about 4 µs per record, a third of a batch's CPU;
    pyarrow's reader takes about 1.4 µs. The result is null for every record pyarrow did not
    parse; ``parse_json`` hands exactly those to ``from_json``, so every record is parsed by one
    of the two and the dead-letter rules stay Spark's. pyarrow is stricter than Spark (no single
    quotes, no number where a string is declared, no epoch-number timestamps). A piece is used
    only when it is valid UTF-8, has one line per record, each starting with ``{`` (leading
    blanks leave a record to Spark), and parses to exactly that many rows;
    ``test_what_a_value_becomes_never_depends_on_the_values_around_it`` holds the two parsers
    to the same answers.

    A chunk pyarrow refuses whole is taken apart so that only its bad records reach Spark: the
    values that cannot be an object on one line (a tombstone, a cut record) are left out without
    a parse and the others are parsed together (``_parse_in_pieces``). Before, a refused chunk
    was halved down to pieces of 64 records and a piece with a bad record went to Spark whole,
    so a chunk a few percent bad settled nothing in the read tasks (RELIABILITY.md, round 18).
    """
    import pyarrow.json as pj

    schema = pa.schema(list(struct)[:-1])
    options = pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    whole = _parse_piece(values, struct, options)
    if not values or isinstance(whole, pa.StructArray):
        return whole if isinstance(whole, pa.StructArray) else pa.nulls(0, struct)
    kept = [i for i, value in enumerate(values) if _may_be_one_line_object(value)]
    if len(kept) == len(values):
        return _parse_in_pieces(values, struct, options)
    parsed = _parse_in_pieces([values[i] for i in kept], struct, options) if kept else pa.nulls(0, struct)
    at: list[int | None] = [None] * len(values)  # where each value's row is in ``parsed``: none for the left out
    for row, i in enumerate(kept):
        at[i] = row
    return parsed.take(pa.array(at, pa.int64()))


def _parse_piece(piece: list[bytes | None], struct: pa.StructType, options: Any) -> pa.StructArray | int | None:
    """``piece`` parsed by pyarrow, or why not: the row of the piece a parse error names, or
    None (the piece cannot be used whole, and no row is to blame)."""
    import pyarrow.json as pj

    if None in piece:
        return None
    joined = b"\n".join(piece)  # type: ignore[arg-type]  # no None: checked above
    # one line per record, each an object: pyarrow reads a line "null" as an empty row
    lines = len(piece) - 1
    if not (joined[:1] == b"{" and joined.count(b"\n") == lines and joined.count(b"\n{") == lines):
        return None
    # the read task decides on too-deep values for every record alike (see the module doc)
    if len(joined) > MAX_DEPTH and _too_deep(piece):  # type: ignore[arg-type]
        return None
    # a value longer than the block fails the whole piece ("straddling object"), and it was then
    # left to Jackson with its neighbours (issue 35): the block holds the longest
    block = max(_BLOCK_BYTES, max(map(len, piece)) + 2)  # type: ignore[arg-type]  # no None
    try:
        joined.decode("utf-8")  # pyarrow's reader lets invalid UTF-8 in strings through
        read_options = pj.ReadOptions(use_threads=False, block_size=block)
        table = pj.read_json(pa.BufferReader(joined), read_options=read_options, parse_options=options)
    except UnicodeDecodeError:
        return None
    except pa.ArrowInvalid as err:
        # a row number counts within a block: trusted only when the piece is one block
        named = _ERROR_ROW.search(str(err)) if len(joined) <= block else None
        return int(named.group(1)) if named is not None and int(named.group(1)) < len(piece) else None
    if table.num_rows != len(piece):
        return None
    schema = list(struct)[:-1]
    columns = [table.column(f.name).combine_chunks() for f in schema]
    return pa.StructArray.from_arrays([*columns, pa.nulls(len(piece), pa.string())], fields=list(struct))


def _parse_in_pieces(values: list[bytes | None], struct: pa.StructType, options: Any) -> pa.StructArray:
    """``values`` parsed piece by piece, null where pyarrow refused: a parse error that names its
    row leaves that row to Spark and the rest is parsed on; one that names none is halved down
    to ``_MIN_PIECE`` records, and a smaller piece that fails is left to Spark whole."""
    pieces: list[pa.Array] = []

    def halve(start: int, end: int) -> None:
        parsed = _parse_piece(values[start:end], struct, options)
        if isinstance(parsed, pa.StructArray):
            pieces.append(parsed)
        elif end - start <= _MIN_PIECE:
            pieces.append(pa.nulls(end - start, struct))
        else:
            middle = (start + end) // 2
            halve(start, middle)
            halve(middle, end)

    # after a named row, the next piece is a few times the gap before it, so that a chunk with
    # many bad records is not parsed again to its end for each one
    start, window = 0, len(values)
    while start < len(values):
        end = min(len(values), start + window)
        parsed = _parse_piece(values[start:end], struct, options)
        if isinstance(parsed, pa.StructArray):
            pieces.append(parsed)
            start, window = end, window * 2
            continue
        if parsed is None:
            halve(start, end)
            start = end
            continue
        if parsed:
            halve(start, start + parsed)
        pieces.append(pa.nulls(1, struct))
        start, window = start + parsed + 1, max(4 * _MIN_PIECE, 2 * (parsed + 1))
    return pa.concat_arrays(pieces) if pieces else pa.nulls(0, struct)


def _may_be_one_line_object(value: bytes | None) -> bool:
    """Whether pyarrow may take ``value`` in a piece: an object on one line (anything else,
    a tombstone or a cut record among them, is left to Spark without a parse)."""
    return value is not None and value[:1] == b"{" and value[-1:] == b"}" and b"\n" not in value


def spark_json_options(corrupt_column: str) -> dict[str, str]:
    """The options of every Spark ``from_json`` offsetlake runs (values and JSON keys).

    Jackson refuses a string longer than 20,000,000 characters by default, which made a valid
    50 MB record a dead letter "does not parse" when it reached Spark, and a row when pyarrow
    took it (issue 35); likewise a number of more than 1,000 digits (pyarrow reads it, as
    infinity for a double). Size is the read task's rule alone (``reader.record_size_problems``,
    whose largest limit is ``MAX_RECORD_BYTES_CEILING``; a record above the pipeline's limit
    never reaches ``from_json``), so Jackson may take any string or number up to that ceiling.
    Checked on Spark 4.2: both options reach Jackson's StreamReadConstraints.
    """
    from offsetlake.config import MAX_RECORD_BYTES_CEILING

    ceiling = str(MAX_RECORD_BYTES_CEILING)
    return {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": corrupt_column, "maxStringLen": ceiling, "maxNumLen": ceiling}


def parse_json(raw: DataFrame, ddl: str, required: list[str]) -> DataFrame:
    """Parse ``value`` with the declared schema (``ddl``); adds PARSED and REASON (null for good rows).

    Keeps the raw columns so dead letters can hold the original bytes. A value is a dead letter
    when it is null (tombstone), not UTF-8, not a JSON object matching the schema, or lacks a
    required field. Values the read task already parsed (``PARSED_IN_READ``, see
    ``parse_json_values``) skip ``from_json`` and the checks that only a failed parse needs.
    """
    from pyspark.sql import functions as F

    text = F.col("value").cast("string")
    # a record with a read problem (too large among them) is a dead letter already: never parsed
    from_json = F.when(F.col("read_problem").isNull(), F.from_json(text, f"{ddl}, `{_CORRUPT}` string", spark_json_options(_CORRUPT)))
    in_read = PARSED_IN_READ in raw.columns
    parsed = raw.withColumn(PARSED, F.coalesce(F.col(PARSED_IN_READ), from_json) if in_read else from_json)
    by_spark = F.col(PARSED_IN_READ).isNull() if in_read else F.lit(True)
    utf8_ok = F.try_validate_utf8(text).isNotNull() if hasattr(F, "try_validate_utf8") else F.lit(True)
    reason: Column = (
        F.when(F.col("value").isNull(), F.lit(TOMBSTONE))
        .when(by_spark & ~utf8_ok, F.lit(reasons.undecodable("value is not valid UTF-8")))
        # from_json turns an array or plain text into a "corrupt" object, not a null: say what it is
        .when(by_spark & (F.col(PARSED).isNull() | ~text.rlike(r"^\s*\{")), F.lit(reasons.undecodable("value is not a JSON object")))
        .when(
            F.col(f"{PARSED}.{_CORRUPT}").isNotNull(),
            F.lit(reasons.undecodable("value does not parse as JSON matching the declared schema")),
        )
    )
    for name in required:
        reason = reason.when(F.col(f"{PARSED}.`{name}`").isNull(), F.lit(reasons.required_missing(name)))
    parsed = parsed.withColumn(REASON, reason)
    return parsed.drop(PARSED_IN_READ) if in_read else parsed


def _decoder(config: PipelineConfig, reader: ReaderSchema) -> JsonDecoder:
    return JsonDecoder(json_format_of(reader, config.format))  # type: ignore[arg-type]


def _envelope_decoder(config: PipelineConfig, reader: ReaderSchema, where: str, needs_before: Callable[[list[str]], bool]) -> Decoder:
    """Debezium envelopes in JSON: the envelope's own JSON schema around the rows' (``debezium``)."""
    from offsetlake.formats.debezium import EnvelopeDecoder, envelope_json_format

    fmt = json_format_of(reader, config.format)  # type: ignore[arg-type]
    fields = list(fmt.schema_)
    return EnvelopeDecoder(JsonDecoder(envelope_json_format(fmt)), fields, list(fmt.required), where, needs_before(fields))


register_format(Format("json", lambda config: yaml_reader_schema(config.format), _decoder, _envelope_decoder))  # type: ignore[arg-type]
