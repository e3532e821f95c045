"""The lake's tables by name in a Spark session: Delta Lake for Spark reads what offsetlake wrote.

Every classic session offsetlake starts has Delta's SQL extension and catalog (``offsetlake.spark``),
so a pipeline's tables are Delta tables to Spark: DataFrame API, SQL, time travel (``VERSION AS
OF``/``TIMESTAMP AS OF``), ``DESCRIBE HISTORY``. ``register`` names them in the session's catalog:

- ``<pipeline>``: the sink table;
- ``<pipeline>_dead_letters``: its dead letters;
- ``<pipeline>_ledger``: the offset ledger of the pipeline's lake (one table per lake, shared by
  the pipelines on it: filter on its ``pipeline`` column).

The names are external tables over the lake's folders (``CREATE TABLE … USING delta LOCATION``):
registering reads only the tables' logs and changes nothing in them. The embedded default's
catalog lives in the session, so each ``offsetlake sql`` registers them again (idempotent). A table
that has no commit yet (no ``_delta_log``) is skipped and said so. Lakes on object storage are
not registered: the pinned jars carry no S3 filesystem for Spark (delta-rs reads those lakes).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from offsetlake import storage
from offsetlake.config import PipelineConfig
from offsetlake.errors import OffsetlakeError


@dataclass(frozen=True)
class NamedTable:
    """One of a pipeline's Delta tables and the name it gets in the catalog."""

    name: str
    pipeline: str
    kind: str  # sink | dead_letters | ledger
    location: str


def named_tables(configs: list[PipelineConfig]) -> list[NamedTable]:
    """The tables of ``configs`` by catalog name, in the pipelines' order."""
    tables = []
    for config in configs:
        layout = config.layout
        tables += [
            NamedTable(config.name, config.name, "sink", str(layout.sink)),
            NamedTable(f"{config.name}_dead_letters", config.name, "dead_letters", str(layout.dead_letters)),
            NamedTable(f"{config.name}_ledger", config.name, "ledger", str(layout.ledger)),
        ]
    return tables


def committed(table: NamedTable) -> bool:
    """Whether the table has a Delta log (at least one commit); object-storage tables raise."""
    if storage.is_uri(table.location) and not table.location.startswith("file:"):
        raise OffsetlakeError(
            f"table {table.name} is at {table.location}: Spark here reads local lakes only (the pinned jars carry no "
            "S3 filesystem for Spark); read it with delta-rs (`offsetlake ledger`, `audit`) or on a cluster with hadoop-aws",
            pipeline=table.pipeline,
        )
    return (_local_path(table) / "_delta_log").is_dir()


def _local_path(table: NamedTable) -> Path:
    """The table's folder on this machine (a plain path, or a ``file:`` URI with its escapes)."""
    if table.location.startswith("file:"):
        from urllib.parse import unquote, urlparse

        return Path(unquote(urlparse(table.location).path))
    return Path(table.location)


def register(spark: Any, configs: list[PipelineConfig]) -> tuple[list[NamedTable], list[NamedTable]]:
    """Name every committed table of ``configs`` in ``spark``'s catalog; (registered, skipped
    because they have no commit yet). A name already in the catalog is left as it is: nothing
    here ever drops a table."""
    registered, skipped = [], []
    for table in named_tables(configs):
        if not committed(table):
            skipped.append(table)
            continue
        location = str(_local_path(table).resolve()).replace("'", "\\'")
        spark.sql(f"CREATE TABLE IF NOT EXISTS `{table.name}` USING delta LOCATION '{location}'")
        registered.append(table)
    return registered, skipped
