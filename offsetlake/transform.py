"""The pipeline's own record-level transform: ``module:function`` next to the YAML.

A transform is a pure ``DataFrame -> DataFrame`` over the decoded sink rows (map / filter /
explode). Every output row keeps the Kafka coordinates of the record it came from
(``_kafka_topic``, ``_kafka_partition``, ``_kafka_offset``, ``_kafka_timestamp``), which is what
lets a backfill replace exactly its range (invariant 6). A record may become no row (filter) or
several (explode): the rows of a pipeline with a transform also get ``_kafka_row``, their index
among their record's rows, so that exactly once is checkable per row — (record, index) appears
once — and not only per record. The index is counted over consecutive rows of the same record
within a Spark partition, which map, filter and explode keep together. A transform whose analysed
plan is only projections and filters over its input makes at most one row per record: its index is
the constant 0, given in the JVM, and no row crosses into Python to be counted.
"""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa
from pyspark.sql import DataFrame

from offsetlake.config import PipelineConfig
from offsetlake.coordinates import COORDINATE_COLUMNS, OFFSET, PARTITION, ROW_INDEX, TOPIC
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
        raise TransformError(f"cannot import transform module '{module_name}' from {folder}: {err}", pipeline=config.name) from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise TransformError(f"{module_name}.py has no function '{function_name}'", pipeline=config.name)
    return function


def apply_transform(rows: DataFrame, config: PipelineConfig) -> DataFrame:
    """Run the pipeline's transform; it must keep the four coordinate columns."""
    function = load_transform(config)
    if function is None:
        return rows
    try:
        result = function(rows)
    except Exception as err:
        raise TransformError(f"transform {config.transform} failed: {err}", pipeline=config.name) from err
    if not isinstance(result, DataFrame):
        kind = f"{type(result).__module__.split('.')[0]}.{type(result).__name__}"
        raise TransformError(
            f"transform {config.transform} returned a {kind}; a transform "
            "returns a Spark DataFrame (pyspark.sql.DataFrame), e.g. rows.withColumn(...)",
            pipeline=config.name,
        )
    missing = [c for c in COORDINATE_COLUMNS if c not in result.columns]
    if missing:
        raise TransformError(
            f"transform {config.transform} dropped {', '.join(missing)}; transforms are "
            "record-level and must keep the Kafka coordinate columns",
            pipeline=config.name,
        )
    for column in config.sink.partition_by:
        if column not in result.columns:
            raise TransformError(f"partition column '{column}' is not in the transformed rows", pipeline=config.name)
    return result


def number_rows_per_record(rows: DataFrame, before: DataFrame | None = None) -> DataFrame:
    """``rows`` with ``_kafka_row``: 0, 1, ... over the consecutive rows of each source record.

    ``before``: the rows the transform was given. When ``rows`` is ``before`` under nothing but
    projections and filters (``at_most_one_row_per_record``), every index is 0 and is given as a
    constant in the JVM. Otherwise the rows are counted, vectorized over each Arrow batch (a
    running count that restarts where the record changes) and carried across the batches of a
    Spark partition; no shuffle.
    """
    from pyspark.sql import functions as F
    from pyspark.sql.pandas.types import to_arrow_schema
    from pyspark.sql.types import IntegerType, StructField, StructType

    source = rows.drop(ROW_INDEX) if ROW_INDEX in rows.columns else rows
    if before is not None and at_most_one_row_per_record(source, before):
        # a literal is not nullable: the same column type as the counted index below; a Python
        # round trip of every row cost the shipped orders pipeline a third of its write (bench)
        return source.withColumn(ROW_INDEX, F.lit(0).cast("int"))
    schema = StructType([*source.schema.fields, StructField(ROW_INDEX, IntegerType(), False)])
    arrow_schema = to_arrow_schema(schema, timezone="UTC", prefers_large_types=False)

    def number(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import numpy as np

        last_key: tuple | None = None
        last_index = -1
        for batch in batches:
            n = batch.num_rows
            if n == 0:
                continue
            topics = batch.column(TOPIC).to_numpy(zero_copy_only=False)
            partitions = batch.column(PARTITION).to_numpy(zero_copy_only=False)
            offsets = batch.column(OFFSET).to_numpy(zero_copy_only=False)
            starts = np.ones(n, dtype=bool)  # where a new record's rows begin
            starts[1:] = (offsets[1:] != offsets[:-1]) | (partitions[1:] != partitions[:-1]) | (topics[1:] != topics[:-1])
            first = (topics[0], int(partitions[0]), int(offsets[0]))
            starts[0] = first != last_key
            positions = np.arange(n)
            run_start = np.maximum.accumulate(np.where(starts, positions, 0))
            index = positions - run_start
            if not starts[0]:  # the first record continues from the previous batch
                head = run_start == 0
                index[head] += last_index + 1
            last_key = (topics[-1], int(partitions[-1]), int(offsets[-1]))
            last_index = int(index[-1])
            yield pa.RecordBatch.from_arrays([*batch.columns, pa.array(index, pa.int32())], schema=arrow_schema)

    return source.mapInArrow(number, schema)


# analysed-plan operators that give each input row at most one output row; anything else (a
# Generate of explode, a MapInPandas, a Union, a Join, an Aggregate, a Window, ...) is counted
_ROW_PRESERVING = frozenset({"Project", "Filter", "SubqueryAlias"})
_TREE_PREFIX = re.compile(r"^[ |:]*(?:[+:]- )?")
_EXPRESSION_ID = re.compile(r"#\d+L?")


def at_most_one_row_per_record(after: DataFrame, before: DataFrame) -> bool:
    """Whether ``after`` is ``before`` under only projections and filters, read from Spark's
    analysed plans (one analysis each, no job): the top of ``after``'s plan must be a chain of
    Project/Filter/SubqueryAlias nodes whose bottom is ``before``'s whole plan. Any doubt (a plan
    Spark prints differently, a subquery, a truncated plan) answers False, which only costs the
    counting; a wrong True would give two rows of one record the same index, so nothing else
    may answer True."""
    try:
        above, below = _analysed_plan_lines(after), _analysed_plan_lines(before)
    except Exception:  # a server or version that does not explain: count
        return False
    if not below or len(above) < len(below) or above[len(above) - len(below) :] != below:
        return False
    return all(line.split(" ", 1)[0] in _ROW_PRESERVING for line in above[: len(above) - len(below)])


def _analysed_plan_lines(frame: DataFrame) -> list[str]:
    """The nodes of ``frame``'s analysed logical plan, one per line, without the tree's drawing
    and expression ids (two analyses of one plan number its attributes differently)."""
    from offsetlake.spark import is_connect

    if is_connect(frame.sparkSession):
        connect_frame: Any = frame  # pyspark.sql.connect.dataframe.DataFrame: its explain, as a string
        explained: str = connect_frame._explain_string(mode="extended")
        section = explained.split("== Analyzed Logical Plan ==", 1)[1].split("== Optimized Logical Plan ==", 1)[0]
        lines = [line for line in section.splitlines() if line.strip()][1:]  # the first is the output schema
    else:
        lines = [line for line in frame._jdf.queryExecution().analyzed().toString().splitlines() if line.strip()]
    return [_EXPRESSION_ID.sub("", _TREE_PREFIX.sub("", line, count=1)) for line in lines]
