"""Record-level transforms: the built-in JSON-with-schema parser and the pipeline's own function.

Every output row keeps the Kafka coordinates of the record it came from (``_kafka_topic``,
``_kafka_partition``, ``_kafka_offset``, ``_kafka_timestamp``), which is what lets a backfill
replace exactly its range (invariant 6). Records that cannot be parsed are split off with a
reason for the dead-letter table (invariant 8), never dropped.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

import pyarrow as pa
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from offsetlake.config import COORDINATE_COLUMNS, PipelineConfig
from offsetlake.errors import TransformError

REASON = "_dead_letter_reason"
PARSED_IN_READ = "_parsed_in_read"
_CORRUPT = "_corrupt_record"
_MIN_PIECE = 64  # below this a failing piece of a chunk is left to Spark's from_json

# Spark types whose JSON reading pyarrow does the same way, or refuses (then Spark parses).
_ARROW_TYPES = {
    "string": pa.string(), "long": pa.int64(), "bigint": pa.int64(), "int": pa.int32(), "integer": pa.int32(),
    "short": pa.int16(), "byte": pa.int8(), "double": pa.float64(), "float": pa.float32(), "boolean": pa.bool_(),
    "timestamp": pa.timestamp("us", tz="UTC"),
}


def parsed_struct_type(config: PipelineConfig) -> pa.StructType | None:
    """The Arrow type of a parsed value (the declared fields plus the corrupt-record column), or
    None when a declared type is one the read tasks leave to Spark (date, decimal, nested...)."""
    fields = []
    for name, type_name in config.format.schema_.items():
        arrow_type = _ARROW_TYPES.get(type_name.strip().lower())
        if arrow_type is None:
            return None
        fields.append(pa.field(name, arrow_type))
    return pa.struct([*fields, pa.field(_CORRUPT, pa.string())])


def parse_json_values(values: list[bytes | None], struct: pa.StructType) -> pa.StructArray:
    """Parse a read chunk's values with pyarrow's JSON reader, inside the read task.

    Why: Spark's ``from_json`` cost the JVM about 4 µs per record, a third of a batch's CPU;
    pyarrow's reader takes about 1.4 µs. The result is null for every record pyarrow did not
    parse; ``parse_json`` hands exactly those to ``from_json``, so every record is parsed by one
    of the two and the dead-letter rules stay Spark's. pyarrow is stricter than Spark (no single
    quotes, no number where a string is declared, no epoch-number timestamps), and where it
    refuses a piece the piece is halved until the bad records are isolated. A piece is used only
    when it is valid UTF-8, has one line per record, each starting with ``{`` (leading blanks
    leave a record to Spark), and parses to exactly that many rows;
    ``test_values_parsed_in_the_read_tasks_get_exactly_sparks_answers`` holds the two parsers to
    the same answers.
    """
    import pyarrow.json as pj

    schema = pa.schema(list(struct)[:-1])
    options = pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    read_options = pj.ReadOptions(use_threads=False, block_size=1 << 26)
    pieces: list[pa.StructArray] = []

    def parse(start: int, end: int) -> None:
        piece = values[start:end]
        ok = None not in piece
        if ok:
            joined = b"\n".join(piece)
            # one line per record, each an object: pyarrow reads a line "null" as an empty row
            lines = len(piece) - 1
            ok = joined[:1] == b"{" and joined.count(b"\n") == lines and joined.count(b"\n{") == lines
        if ok:
            try:
                joined.decode("utf-8")  # pyarrow's reader lets invalid UTF-8 in strings through
                table = pj.read_json(pa.BufferReader(joined), read_options=read_options, parse_options=options)
                ok = table.num_rows == len(piece)
            except (pa.ArrowInvalid, UnicodeDecodeError):
                ok = False
        if ok:
            columns = [table.column(f.name).combine_chunks() for f in schema]
            pieces.append(pa.StructArray.from_arrays([*columns, pa.nulls(len(piece), pa.string())], fields=list(struct)))
        elif end - start <= _MIN_PIECE:
            pieces.append(pa.nulls(end - start, struct))
        else:
            middle = (start + end) // 2
            parse(start, middle)
            parse(middle, end)

    if values:
        parse(0, len(values))
    return pa.concat_arrays(pieces) if pieces else pa.nulls(0, struct)


def parse_json(raw: DataFrame, config: PipelineConfig) -> DataFrame:
    """Parse ``value`` with the declared schema; adds REASON (null for good rows).

    Keeps the raw columns so dead letters can hold the original bytes. A value is a dead letter
    when it is null (tombstone), not UTF-8, not a JSON object matching the schema, or lacks a
    required field. Values the read task already parsed (``PARSED_IN_READ``, see
    ``parse_json_values``) skip ``from_json`` and the checks that only a failed parse needs.
    """
    fmt = config.format
    ddl = f"{fmt.ddl()}, `{_CORRUPT}` string"
    text = F.col("value").cast("string")
    from_json = F.from_json(text, ddl, {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": _CORRUPT})
    in_read = PARSED_IN_READ in raw.columns
    parsed = raw.withColumn("_parsed", F.coalesce(F.col(PARSED_IN_READ), from_json) if in_read else from_json)
    by_spark = F.col(PARSED_IN_READ).isNull() if in_read else F.lit(True)
    utf8_ok = F.try_validate_utf8(text).isNotNull() if hasattr(F, "try_validate_utf8") else F.lit(True)
    reason: Column = (
        F.when(F.col("value").isNull(), F.lit("tombstone: record has a null value"))
        .when(by_spark & ~utf8_ok, F.lit("value is not valid UTF-8"))
        # from_json turns an array or plain text into a "corrupt" object, not a null: say what it is
        .when(by_spark & (F.col("_parsed").isNull() | ~text.rlike(r"^\s*\{")), F.lit("value is not a JSON object"))
        .when(
            F.col(f"_parsed.{_CORRUPT}").isNotNull(),
            F.lit("value does not parse as JSON matching the declared schema"),
        )
    )
    for name in fmt.required:
        reason = reason.when(F.col(f"_parsed.`{name}`").isNull(), F.lit(f"required field '{name}' is missing or null"))
    parsed = parsed.withColumn(REASON, reason)
    return parsed.drop(PARSED_IN_READ) if in_read else parsed


def good_rows(parsed: DataFrame, config: PipelineConfig) -> DataFrame:
    """Parsed records as sink rows: declared fields plus the coordinate columns."""
    fields = [F.col(f"_parsed.`{name}`").alias(name) for name in config.format.schema_]
    return parsed.where(F.col(REASON).isNull()).select(
        *fields,
        F.col("topic").alias("_kafka_topic"),
        F.col("partition").alias("_kafka_partition"),
        F.col("offset").alias("_kafka_offset"),
        F.col("timestamp").alias("_kafka_timestamp"),
    )


def dead_letter_rows(parsed: DataFrame, config: PipelineConfig, batch_id: str) -> DataFrame:
    return parsed.where(F.col(REASON).isNotNull()).select(
        F.col("topic").alias("_kafka_topic"),
        F.col("partition").alias("_kafka_partition"),
        F.col("offset").alias("_kafka_offset"),
        F.col("timestamp").alias("_kafka_timestamp"),
        "key",
        "value",
        "headers",
        F.col(REASON).alias("reason"),
        F.lit(config.name).alias("pipeline"),
        F.lit(batch_id).alias("batch_id"),
    )


def load_transform(config: PipelineConfig) -> Callable[[DataFrame], DataFrame] | None:
    """Import the ``module:function`` named in the YAML, from the folder holding the YAML."""
    if not config.transform:
        return None
    module_name, function_name = config.transform.split(":")
    folder = str(config.transform_dir)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # import errors of user code: say which file
        raise TransformError(
            f"pipeline {config.name}: cannot import transform module '{module_name}' from {folder}: {err}"
        ) from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise TransformError(f"pipeline {config.name}: {module_name}.py has no function '{function_name}'")
    return function


def apply_transform(rows: DataFrame, config: PipelineConfig) -> DataFrame:
    """Run the pipeline's transform; it must keep the four coordinate columns."""
    function = load_transform(config)
    if function is None:
        return rows
    try:
        result = function(rows)
    except Exception as err:
        raise TransformError(f"pipeline {config.name}: transform {config.transform} failed: {err}") from err
    if not isinstance(result, DataFrame):
        raise TransformError(f"pipeline {config.name}: transform {config.transform} returned {type(result).__name__}, not a DataFrame")
    missing = [c for c in COORDINATE_COLUMNS if c not in result.columns]
    if missing:
        raise TransformError(
            f"pipeline {config.name}: transform {config.transform} dropped {', '.join(missing)}; transforms are "
            "record-level and must keep the Kafka coordinate columns"
        )
    for column in config.sink.partition_by:
        if column not in result.columns:
            raise TransformError(f"pipeline {config.name}: partition column '{column}' is not in the transformed rows")
    return result
