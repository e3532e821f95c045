"""The lake's tables by name in a Spark session: Delta Lake for Spark reads what offsetlake wrote.

Every classic session offsetlake starts has Delta's SQL extension and catalog (``offsetlake.spark``),
so a pipeline's tables are Delta tables to Spark: DataFrame API, SQL, time travel (``VERSION AS
OF``/``TIMESTAMP AS OF``), ``DESCRIBE HISTORY``. ``register`` names them in the session's catalog:

- ``<pipeline>``: the sink table;
- ``<pipeline>_dead_letters``: its dead letters;
- ``<pipeline>_ledger``: the offset ledger of the pipeline's lake (one table per lake, shared by
  the pipelines on it: filter on its ``pipeline`` column);

each in the pipeline's ``catalog.database`` (``default`` unless it says otherwise; created when
missing), so two lakes, or two teams, keep their names apart: ``sales.orders``.

The names are external tables over the lake's folders (``CREATE TABLE … USING delta LOCATION``):
registering reads only the tables' logs and changes nothing in them. The embedded default's
catalog lives in the session, so each ``offsetlake sql`` registers them again (idempotent). A table
that has no commit yet (no ``_delta_log``) is skipped and said so.

A lake on S3 is reached through Hadoop's S3A filesystem (``hadoop-aws``, pinned with the other
jars): its tables are named at ``s3a://bucket/...`` (the scheme Hadoop's S3 filesystem answers
to), and ``hadoop_settings`` turns the pipeline's ``storage:`` settings (object_store's keys, the
ones delta-rs takes) into S3A's per-bucket settings, so each lake is read with its own endpoint,
region and credentials. Other object stores (gs, az, abfss) are refused by name.
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
    where: storage.Location
    database: str = "default"

    @property
    def qualified(self) -> str:
        """The name as SQL writes it whatever the session's current database: `db`.`name`."""
        return f"`{self.database}`.`{self.name}`"

    @property
    def full_name(self) -> str:
        """database.name, as a reader types it and the catalog lists it."""
        return f"{self.database}.{self.name}"

    @property
    def label(self) -> str:
        """The name as offsetlake prints it: bare in ``default``, else database.name."""
        return self.name if self.database == "default" else self.full_name

    @property
    def location(self) -> str:
        return self.where.path

    @property
    def spark_location(self) -> str:
        """The folder as Spark reaches it: a local path (absolute), or the lake's URI with S3's
        scheme as Hadoop's S3A filesystem names it (``s3a://``)."""
        if not storage.is_uri(self.location) or self.location.startswith("file:"):
            return str(_local_path(self).resolve())
        kind = storage.scheme(self.location)
        if kind not in ("s3", "s3a"):
            raise OffsetlakeError(
                f"table {self.name} is at {self.location}: Spark here reaches local and S3 lakes (the pinned jars carry "
                f"Hadoop's S3A filesystem only); read a {kind}:// lake with delta-rs (`offsetlake ledger`, `audit`) or on a "
                f"cluster with that store's Hadoop connector",
                pipeline=self.pipeline,
            )
        return "s3a://" + self.location.split("://", 1)[1]


def named_tables(configs: list[PipelineConfig]) -> list[NamedTable]:
    """The Delta tables of ``configs`` by catalog name, in the pipelines' order (a Kafka sink's
    rows and dead letters are topics: its ledger alone)."""
    tables = []
    for config in configs:
        layout = config.layout
        database = config.catalog.database
        tables += [
            table
            for table in (
                NamedTable(config.name, config.name, "sink", layout.sink, database),
                NamedTable(f"{config.name}_dead_letters", config.name, "dead_letters", layout.dead_letters, database),
                NamedTable(f"{config.name}_ledger", config.name, "ledger", layout.ledger, database),
            )
            if table.kind in config.sink.delta_tables
        ]
    return tables


def committed(table: NamedTable) -> bool:
    """Whether the table has a Delta log (at least one commit); a table on a store Spark here
    cannot reach raises."""
    location = table.spark_location  # raises for a store Spark here cannot reach
    if location.startswith("s3a://"):
        return storage.is_table(table.where)
    return (Path(location) / "_delta_log").is_dir()


# object_store's keys (what a pipeline's ``storage:`` holds, lower-cased) -> S3A's per-bucket keys
_S3A_KEYS = {
    "aws_access_key_id": "access.key",
    "access_key_id": "access.key",
    "aws_secret_access_key": "secret.key",
    "secret_access_key": "secret.key",
    "aws_session_token": "session.token",
    "aws_token": "session.token",
    "session_token": "session.token",
    "token": "session.token",
    "aws_region": "endpoint.region",
    "region": "endpoint.region",
    "aws_default_region": "endpoint.region",
    "aws_endpoint_url": "endpoint",
    "aws_endpoint": "endpoint",
    "endpoint_url": "endpoint",
    "endpoint": "endpoint",
}


def _s3_bucket(table: NamedTable) -> str | None:
    location = table.spark_location
    return location[len("s3a://") :].split("/", 1)[0] if location.startswith("s3a://") else None


def s3_buckets(tables: list[NamedTable]) -> list[str]:
    """The S3 buckets ``tables`` live in, each once."""
    return list(dict.fromkeys(b for b in map(_s3_bucket, tables) if b is not None))


def hadoop_settings(tables: list[NamedTable]) -> dict[str, str]:
    """The Hadoop settings a Spark session needs to read ``tables``: for each S3 bucket, S3A's
    ``fs.s3a.bucket.<bucket>.*`` keys from the pipeline's storage settings (endpoint, region,
    keys, session token; path-style requests for a custom endpoint unless
    ``aws_virtual_hosted_style_request`` says otherwise, as object_store does). A bucket with no
    credentials in its settings is read with S3A's default chain (environment, profile, instance
    role), as delta-rs reads it. Values are secrets: they go to a session's conf or a 0600 file,
    never to a log line. Two pipelines on one bucket with different settings are refused: S3A
    settings are per bucket."""
    out: dict[str, str] = {}
    owner: dict[str, NamedTable] = {}
    for table in tables:
        bucket = _s3_bucket(table)
        if bucket is None:
            continue
        options = storage.normalized_options(table.where.options or {})
        prefix = f"fs.s3a.bucket.{bucket}."
        mine = {prefix + _S3A_KEYS[k]: v for k, v in options.items() if k in _S3A_KEYS}
        endpoint = mine.get(prefix + "endpoint")
        if endpoint:
            hosted = options.get("aws_virtual_hosted_style_request", options.get("virtual_hosted_style_request", "false"))
            mine[prefix + "path.style.access"] = "false" if hosted.lower() == "true" else "true"
            mine[prefix + "connection.ssl.enabled"] = "false" if endpoint.lower().startswith("http://") else "true"
        if prefix + "session.token" in mine:
            mine[prefix + "aws.credentials.provider"] = "org.apache.hadoop.fs.s3a.TemporaryAWSCredentialsProvider"
        first = owner.setdefault(bucket, table)
        clash = [k for k, v in mine.items() if out.get(k, v) != v]
        if clash:
            raise OffsetlakeError(
                f"pipelines {first.pipeline} and {table.pipeline} reach bucket {bucket} with different storage settings "
                f"({', '.join(sorted(k[len(prefix) :] for k in clash))}); a Spark session reads a bucket with one set of S3A "
                "settings: query them in separate calls (--pipeline)",
                pipeline=table.pipeline,
            )
        out.update(mine)
    return out


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
    tables = named_tables(configs)
    for key, value in hadoop_settings(tables).items():
        spark.conf.set(key, value)  # the session's Hadoop configuration: how Delta reads an s3a:// table
    databases = set()
    for table in tables:
        if not committed(table):
            skipped.append(table)
            continue
        if table.database not in databases:
            spark.sql(f"CREATE DATABASE IF NOT EXISTS `{table.database}`")
            databases.add(table.database)
        folder = table.spark_location
        location = folder.replace("'", "\\'")
        named = _named_location(spark, table)
        if named is not None and named[1] != folder:
            if named[0] != "EXTERNAL":
                raise OffsetlakeError(
                    f"the Spark catalog already has a {named[0].lower()} table {table.label} (at {named[1]}); offsetlake names "
                    f"{folder} so only where that name is free or names another folder. Drop or rename it, or query "
                    f"delta.`{folder}`",
                    field="sql",
                )
            spark.sql(f"DROP TABLE {table.qualified}")  # an external table: the name goes, the files stay
        try:
            spark.sql(f"CREATE TABLE IF NOT EXISTS {table.qualified} USING delta LOCATION '{location}'")
        except Exception as err:  # Spark's own (py4j, Connect, analysis): what it could not reach, in one line
            raise OffsetlakeError(
                f"Spark could not read table {table.label} at {folder} to name it: {_first_line(err)}"
                + (" (check the pipeline's storage: settings: endpoint, region, credentials)" if folder.startswith("s3a://") else ""),
                pipeline=table.pipeline,
            ) from None
        registered.append(table)
    return registered, skipped


def current_database(spark: Any, tables: list[NamedTable]) -> None:
    """Make the one database ``tables`` are named in the session's current one, so a statement
    names them unqualified (``FROM orders``) wherever they are; with several, it names them
    ``database.name``."""
    databases = {t.database for t in tables}
    if len(databases) == 1:
        spark.catalog.setCurrentDatabase(databases.pop())


def _first_line(err: Exception) -> str:
    """The first line of Spark's error text (for py4j, the Java exception's), with no stack."""
    text = str(getattr(err, "java_exception", None) or err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _named_location(spark: Any, table: NamedTable) -> tuple[str, str] | None:
    """(its type, its folder: a local path, or a URI) of ``table``'s name in its database, if
    that name exists."""
    if not spark.catalog.tableExists(table.full_name):
        return None
    rows = {r["col_name"]: r["data_type"] for r in spark.sql(f"DESCRIBE TABLE EXTENDED {table.qualified}").collect()}
    location = str(rows.get("Location") or "")
    if location.startswith("file:"):
        from urllib.parse import unquote, urlparse

        location = unquote(urlparse(location).path)
    return str(rows.get("Type") or "").upper(), location.rstrip("/")


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
        found = storage.open_table(table.where)
        if found is not None:
            versions[table.name] = found.version()
    return versions


def changes_since(tables: list[NamedTable], before: dict[str, int]) -> list[str]:
    """What was committed to ``tables`` after the versions ``before``: one line per new commit
    (table, version, operation, its metrics), for ``offsetlake sql --write`` to say what it changed."""
    from offsetlake.history import commit_infos

    lines = []
    for table in tables:
        found = storage.open_table(table.where)
        if found is None or found.version() <= before.get(table.name, -1):
            continue
        for info in commit_infos(found, before.get(table.name, -1) + 1, found.version()):
            metrics = {k: v for k, v in (info.get("operationMetrics") or {}).items() if str(v) not in ("0", "")}
            shown = ", ".join(f"{k}={v}" for k, v in sorted(metrics.items()) if k.startswith(("num", "rows")))
            lines.append(f"{table.name}: version {info['version']} {info.get('operation', '?')}" + (f" ({shown})" if shown else ""))
    return lines
