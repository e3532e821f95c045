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
    because they have no commit yet).

    The catalog may outlive this command: a warm server's (the project's own, shared by every
    command) keeps the names an earlier ``sql`` gave. A name that already points at the table's
    folder is kept; one that points at another folder (the pipeline's lake moved, or was made
    anew elsewhere) is an external table's catalog entry and is dropped and named again: dropping
    it removes only the name, never a file. A managed table of that name (its data in the
    catalog's warehouse) is refused, not dropped."""
    registered, skipped = [], []
    for table in named_tables(configs):
        if not committed(table):
            skipped.append(table)
            continue
        folder = _local_path(table).resolve()
        location = str(folder).replace("'", "\\'")
        named = _named_location(spark, table.name)
        if named is not None and named[1] != folder:
            if named[0] != "EXTERNAL":
                raise OffsetlakeError(
                    f"the Spark catalog already has a {named[0].lower()} table `{table.name}` (at {named[1]}); offsetlake names "
                    f"{folder} so only where that name is free or names another folder. Drop or rename it, or query "
                    f"delta.`{folder}`",
                    field="sql",
                )
            spark.sql(f"DROP TABLE `{table.name}`")  # an external table: the name goes, the files stay
        spark.sql(f"CREATE TABLE IF NOT EXISTS `{table.name}` USING delta LOCATION '{location}'")
        registered.append(table)
    return registered, skipped


def _named_location(spark: Any, name: str) -> tuple[str, Path] | None:
    """(its type, its folder) of table ``name`` in ``spark``'s current database, if it exists."""
    if not spark.catalog.tableExists(name):
        return None
    rows = {r["col_name"]: r["data_type"] for r in spark.sql(f"DESCRIBE TABLE EXTENDED `{name}`").collect()}
    location = str(rows.get("Location") or "")
    if location.startswith("file:"):
        from urllib.parse import unquote, urlparse

        location = unquote(urlparse(location).path)
    return str(rows.get("Type") or "").upper(), Path(location)


# ---- what a statement may do (``offsetlake sql`` is read-only unless asked) ----------------------
# Commands (Spark's ``Command`` plans) that only read: everything else that is a command, and every
# statement that writes without being one (INSERT, RESTORE, ...), needs ``--write``.
_READING_COMMANDS = frozenset(
    {
        "ShowTables",
        "ShowTablesExtended",
        "ShowColumns",
        "ShowTableProperties",
        "ShowCreateTable",
        "ShowPartitions",
        "ShowFunctions",
        "ShowNamespaces",
        "ShowViews",
        "ShowCatalogs",
        "DescribeRelation",
        "DescribeColumn",
        "DescribeNamespace",
        "DescribeFunction",
        "DescribeDeltaHistory",
        "DescribeDeltaDetail",
        "ExplainCommand",
        "SetCommand",
        "ResetCommand",
    }
)
_WRITING_STATEMENTS = ("Insert", "Restore", "Clone", "Statement")  # plans that write but are not commands
_WRITE_WORDS = r"\b(INSERT|DELETE|UPDATE|MERGE|DROP|ALTER|CREATE|REPLACE|TRUNCATE|RESTORE|OPTIMIZE|VACUUM|CONVERT|REORG|CLONE)\b"


def writes(spark: Any, statement: str) -> bool:
    """Whether ``statement`` may change a table (or the catalog) rather than only read.

    In a classic session Spark's own parser decides: any node of the parsed plan that is a
    ``Command`` other than the reading ones (SHOW, DESCRIBE, DESCRIBE HISTORY, EXPLAIN, SET), or an
    INSERT or RESTORE (plans that write without being commands) writes; a WITH around an INSERT is
    walked into. Attached to a Spark Connect server, whose parser is out of reach, any writing
    keyword outside quotes counts (a column named ``update`` then needs --write too)."""
    java = getattr(spark, "_jsparkSession", None)
    if java is None:
        import re

        unquoted = re.sub(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|`[^`]*`", "''", statement)
        return re.search(_WRITE_WORDS, unquoted, re.IGNORECASE) is not None
    plan = java.sessionState().sqlParser().parsePlan(statement)
    command = spark._jvm.java.lang.Class.forName("org.apache.spark.sql.catalyst.plans.logical.Command")
    pending = [plan]
    while pending:
        node = pending.pop()
        name = node.getClass().getSimpleName()
        if command.isInstance(node) and name not in _READING_COMMANDS:
            return True
        if not command.isInstance(node) and any(part in name for part in _WRITING_STATEMENTS):
            return True
        pending += list(_scala_seq(node.children())) + list(_scala_seq(node.innerChildren()))
    return False


def _scala_seq(seq: Any) -> list[Any]:
    iterator = seq.iterator()
    out = []
    while iterator.hasNext():
        out.append(iterator.next())
    return out


def refuse_write(statement: str, number: int, write: bool, tables: list[NamedTable]) -> None:
    """Without ``--write`` a writing statement is refused; with it, one that names a dead-letter
    or ledger table is refused still: those are offsetlake's own records (the ledger is rebuilt
    from the sinks' history, dead letters follow their sink), written only by offsetlake."""
    import re

    if not write:
        raise OffsetlakeError(
            f"statement {number} would change a table, and offsetlake sql only reads unless asked: add --write to run it "
            "(a change to a sink is a commit offsetlake did not make: runs, status and audit report it, and backfills "
            "keep the rows it deletes deleted; see docs/design.md, 'Foreign commits')"
        )
    own = [
        t.name
        for t in tables
        if t.kind != "sink" and re.search(rf"(?<![\w`]){re.escape(t.name)}(?![\w`])|`{re.escape(t.name)}`", statement)
    ]
    if own:
        raise OffsetlakeError(
            f"statement {number} names {', '.join(own)}, which only offsetlake writes (the ledger is rebuilt from the sinks' "
            "history with `offsetlake ledger rebuild`, dead letters follow their sink); nothing was run"
        )


def table_versions(tables: list[NamedTable]) -> dict[str, int]:
    """Each table's current Delta version (delta-rs: nothing is read but the log)."""
    versions = {}
    for table in tables:
        found = storage.open_table(table.location)
        if found is not None:
            versions[table.name] = found.version()
    return versions


def changes_since(tables: list[NamedTable], before: dict[str, int]) -> list[str]:
    """What was committed to ``tables`` after the versions ``before``: one line per new commit
    (table, version, operation, its metrics), for ``offsetlake sql --write`` to say what it changed."""
    from offsetlake.history import commit_infos

    lines = []
    for table in tables:
        found = storage.open_table(table.location)
        if found is None or found.version() <= before.get(table.name, -1):
            continue
        for info in commit_infos(found, before.get(table.name, -1) + 1, found.version()):
            metrics = {k: v for k, v in (info.get("operationMetrics") or {}).items() if str(v) not in ("0", "")}
            shown = ", ".join(f"{k}={v}" for k, v in sorted(metrics.items()) if k.startswith(("num", "rows")))
            lines.append(f"{table.name}: version {info['version']} {info.get('operation', '?')}" + (f" ({shown})" if shown else ""))
    return lines
