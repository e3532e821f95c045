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

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from offsetlake.config import COORDINATE_COLUMNS, PipelineConfig
from offsetlake.errors import TransformError

REASON = "_dead_letter_reason"
_CORRUPT = "_corrupt_record"


def parse_json(raw: DataFrame, config: PipelineConfig) -> DataFrame:
    """Parse ``value`` with the declared schema; adds REASON (null for good rows).

    Keeps the raw columns so dead letters can hold the original bytes. A value is a dead letter
    when it is null (tombstone), not UTF-8, not a JSON object matching the schema, or lacks a
    required field.
    """
    fmt = config.format
    ddl = f"{fmt.ddl()}, `{_CORRUPT}` string"
    text = F.col("value").cast("string")
    parsed = raw.withColumn(
        "_parsed",
        F.from_json(text, ddl, {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": _CORRUPT}),
    )
    utf8_ok = F.try_validate_utf8(text).isNotNull() if hasattr(F, "try_validate_utf8") else F.lit(True)
    reason: Column = (
        F.when(F.col("value").isNull(), F.lit("tombstone: record has a null value"))
        .when(~utf8_ok, F.lit("value is not valid UTF-8"))
        # from_json turns an array or plain text into a "corrupt" object, not a null: say what it is
        .when(F.col("_parsed").isNull() | ~text.rlike(r"^\s*\{"), F.lit("value is not a JSON object"))
        .when(
            F.col(f"_parsed.{_CORRUPT}").isNotNull(),
            F.lit("value does not parse as JSON matching the declared schema"),
        )
    )
    for name in fmt.required:
        reason = reason.when(F.col(f"_parsed.`{name}`").isNull(), F.lit(f"required field '{name}' is missing or null"))
    return parsed.withColumn(REASON, reason)


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
