"""The pipeline's own record-level transform: ``module:function`` next to the YAML.

A transform is a pure ``DataFrame -> DataFrame`` over the decoded sink rows (map / filter /
explode). Every output row keeps the Kafka coordinates of the record it came from
(``_kafka_topic``, ``_kafka_partition``, ``_kafka_offset``, ``_kafka_timestamp``), which is what
lets a backfill replace exactly its range (invariant 6).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

from pyspark.sql import DataFrame

from offsetlake.config import PipelineConfig
from offsetlake.coordinates import COORDINATE_COLUMNS
from offsetlake.errors import TransformError


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
