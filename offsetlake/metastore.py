"""The pipelines' tables by name for any Spark session: Spark's Hive-compatible catalog with an
embedded metastore under the project's home (issue 53).

``settings()`` is what a session needs to see them: the pinned Delta jars and extension, Spark's
Hive catalog, and a Derby metastore in ``<home>/.offsetlake/metastore/`` (home:
``$OFFSETLAKE_HOME``, else the working directory; git-ignored) — or, with ``$OFFSETLAKE_METASTORE``
(``--metastore``) set to ``thrift://HOST:PORT``, an existing Hive Metastore server that every
session of a team reaches. ``register`` names every committed table of the given pipelines there as
an external Delta table whose location is its folder in the lake (``PIPELINE``,
``PIPELINE_dead_letters``, ``PIPELINE_ledger`` in the ``default`` database), in a Spark session of
its own. The Delta log stays the truth: a name only points at a folder, so a table made anew in the
same folder (an epoch reset, a rebuilt sink) needs nothing, and a pipeline whose lake moved is named
again (``catalog.register``). A lake on S3 is named at ``s3a://`` and the conf file carries S3A's
per-bucket settings from the pipelines' ``storage:`` (a 0600 file: they hold credentials). Derby
lets one process open the metastore at a time: register while no other session holds it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from offsetlake import jars
from offsetlake.catalog import NamedTable, hadoop_settings, named_tables, s3_buckets
from offsetlake.catalog import register as name_tables
from offsetlake.config import PipelineConfig
from offsetlake.errors import OffsetlakeError
from offsetlake.project import home, private


def folder(project: Path | None = None) -> Path:
    return private("metastore", project=(project or home()).resolve())


# Where the tables are named: the project's embedded metastore, or a Hive Metastore server
ENV = "OFFSETLAKE_METASTORE"
_THRIFT = re.compile(r"^thrift://[^/:\s]+:\d+$")


def server(given: str | None = None) -> str | None:
    """The Hive Metastore server the tables are named in (``thrift://HOST:PORT``, several
    comma-separated for a metastore behind more than one address), from ``given`` (``--metastore``)
    or ``$OFFSETLAKE_METASTORE``; None for the project's embedded metastore (``embedded`` or unset)."""
    value = (given if given is not None else os.environ.get(ENV, "")).strip()
    if value in ("", "embedded"):
        return None
    uris = [uri.strip() for uri in value.split(",")]
    wrong = [uri for uri in uris if not _THRIFT.match(uri)]
    if wrong:
        raise OffsetlakeError(
            f"metastore {wrong[0]!r} (--metastore or ${ENV}) is not a Hive Metastore address: give thrift://HOST:PORT "
            "(comma-separated for several), or `embedded` for the project's own",
            field="metastore",
        )
    return ",".join(uris)


def settings(project: Path | None = None, metastore: str | None = None) -> dict[str, str]:
    """The Spark settings of a session that sees the registered tables by name: the Delta jars
    and extension, Spark's Hive catalog, and either the Hive Metastore server ``metastore``
    (``thrift://…``) or the project's embedded Derby metastore."""
    common = {"spark.jars": jars.spark_jars(), **jars.DELTA_CONF, "spark.sql.catalogImplementation": "hive"}
    if metastore:
        return {**common, "spark.hadoop.hive.metastore.uris": metastore}
    where = folder(project)
    return {
        **common,
        "spark.sql.warehouse.dir": str(where / "warehouse"),
        "spark.hadoop.javax.jdo.option.ConnectionURL": f"jdbc:derby:;databaseName={where / 'metastore_db'};create=true",
        "spark.hadoop.datanucleus.schema.autoCreateAll": "true",
        "spark.hadoop.hive.metastore.schema.verification": "false",
        "spark.driver.extraJavaOptions": f"-Dderby.system.home={where}",  # derby.log there, not in the working directory
    }


def conf_dir(project: Path | None = None) -> Path:
    """A Spark configuration folder holding ``settings()`` as its ``spark-defaults.conf``: any
    ``pyspark``, ``spark-sql`` or ``spark-submit`` started with ``SPARK_CONF_DIR`` set to it (or a
    Python session whose pyspark starts its own JVM) sees the tables."""
    return folder(project) / "conf"


def write_conf(project: Path | None = None, configs: list[PipelineConfig] | None = None, metastore: str | None = None) -> Path:
    """Write ``settings()`` and the S3A settings of ``configs``' lakes (``object_storage``) as the
    folder's ``spark-defaults.conf``, readable by its owner only (the S3A settings hold
    credentials). Buckets named by an earlier ``register`` and not by ``configs`` keep theirs."""
    where = conf_dir(project)
    where.mkdir(parents=True, exist_ok=True)
    target = where / "spark-defaults.conf"
    mine = object_storage(configs or [])
    buckets = tuple(f"{_S3A}{bucket}." for bucket in s3_buckets(named_tables(configs or [])))
    earlier = {k: v for k, v in _read_conf(target).items() if k.startswith(_S3A) and not k.startswith(buckets)}
    text = "".join(f"{key} {value}\n" for key, value in {**settings(project, metastore), **earlier, **mine}.items())
    partial = where / "spark-defaults.conf.partial"
    partial.unlink(missing_ok=True)
    with os.fdopen(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as out:
        out.write("# written by `offsetlake catalog register`: the pipelines' tables by name\n" + text)
    partial.replace(target)
    return where


_S3A = "spark.hadoop.fs.s3a.bucket."


def object_storage(configs: list[PipelineConfig]) -> dict[str, str]:
    """The Spark settings (``spark.hadoop.fs.s3a.bucket.<bucket>.*``) that reach ``configs``'
    lakes on S3 with their pipelines' storage settings; empty for local lakes."""
    return {f"spark.hadoop.{key}": value for key, value in hadoop_settings(named_tables(configs)).items()}


def shown(conf: dict[str, str]) -> dict[str, str]:
    """``conf`` for a terminal: S3A credentials as ``***`` (they are in the 0600 conf file)."""
    secret = (".access.key", ".secret.key", ".session.token")
    return {k: ("***" if k.startswith(_S3A) and k.endswith(secret) else v) for k, v in conf.items()}


def _read_conf(path: Path) -> dict[str, str]:
    if not path.exists():
        return {}
    pairs = (line.split(" ", 1) for line in path.read_text().splitlines() if line.strip() and not line.startswith("#"))
    return {pair[0]: pair[1] for pair in pairs if len(pair) == 2}


def register(
    configs: list[PipelineConfig], project: Path | None = None, metastore: str | None = None
) -> tuple[list[NamedTable], list[NamedTable]]:
    """Name every committed table of ``configs`` in the metastore (the Hive Metastore server
    ``metastore``, else the embedded one); (registered, skipped: no commit yet). Idempotent.
    Starts and stops a Spark session of its own (the warm server's catalog is its own, in memory)."""
    from offsetlake.spark import classic_builder

    folder(project).mkdir(parents=True, exist_ok=True)
    extra = {**settings(project, metastore), **object_storage(configs)}  # the metastore's Hive client reads the lake's folders too
    # a catalog.database this session creates gets its (empty: the tables are external) folder here, not in the
    # working directory; a team that wants it elsewhere creates the database first, and register keeps it
    extra.setdefault("spark.sql.warehouse.dir", str(folder(project) / "warehouse"))
    spark: Any = classic_builder(app_name="offsetlake-catalog", extra=extra).getOrCreate()
    # Spark warns for each table that Hive itself cannot read a Delta table: expected, and not Spark's readers' concern
    spark.sparkContext.setLogLevel("ERROR")
    try:
        named = name_tables(spark, configs)
        write_conf(project, configs, metastore)
        _remember(project, metastore, named[0])
        return named
    except Exception as err:
        text = str(err)
        if "Another instance of Derby may have already booted the database" in text or "XSDB6" in text:
            raise OffsetlakeError(
                f"the metastore at {folder(project)} is open in another Spark session (its embedded Derby database "
                "allows one process at a time): close that session, then register again"
            ) from None
        if metastore and ("SessionHiveMetaStoreClient" in text or "Could not connect to meta store" in text):
            raise OffsetlakeError(
                f"cannot reach the Hive Metastore at {metastore} (--metastore or ${ENV}): is it running and listening there?",
                field="metastore",
            ) from None
        raise
    finally:
        spark.stop()


# ---- following the pipelines' tables (after a run) -----------------------------------------------
# ``named.json`` beside the metastore: which table names this project gave which folder, per
# metastore (``embedded`` or the server's address). A run reads it to know, without a JVM, whether
# a table of its pipeline is new to the metastore (its first commit, a lake that moved). A name
# given from another machine is not in it: that costs one idempotent registration, nothing else.


def _named_path(project: Path | None) -> Path:
    return folder(project) / "named.json"


def _named(project: Path | None) -> dict[str, dict[str, str]]:
    import json

    path = _named_path(project)
    return json.loads(path.read_text()) if path.exists() else {}


def _remember(project: Path | None, metastore: str | None, tables: list[NamedTable]) -> None:
    import json

    known = _named(project)
    mine = known.setdefault(metastore or "embedded", {})
    mine.update({t.full_name: t.spark_location for t in tables})
    partial = _named_path(project).with_suffix(".partial")
    partial.write_text(json.dumps(known, indent=1, sort_keys=True))
    partial.replace(_named_path(project))


def unnamed(configs: list[PipelineConfig], project: Path | None = None, metastore: str | None = None) -> list[NamedTable]:
    """The committed tables of ``configs`` that this project has not named in the metastore at
    their folder (reads the tables' logs' existence only: no Spark)."""
    from offsetlake.catalog import committed

    known = _named(project).get(metastore or "embedded", {})
    return [t for t in named_tables(configs) if known.get(t.full_name) != t.spark_location and committed(t)]


def follow(config: PipelineConfig, source: str, pipelines_dir: Path | None = None, project: Path | None = None) -> str | None:
    """After a run of ``config`` (given to the command as ``source``, a name or a file): when
    ``$OFFSETLAKE_METASTORE`` names a Hive Metastore server, name the pipeline's tables that are
    new to it (a first commit, a lake that moved) with ``offsetlake catalog register`` in a process
    of its own: a JVM once per new table, nothing at all when every table is named. The embedded
    Derby metastore is left to ``catalog register``: it admits one process at a time, and a run
    must not wait for, or lock out, a colleague's open session. Never fails the run: returns what
    went wrong, or None."""
    import subprocess
    import sys

    try:
        metastore = server()
        if metastore is None:
            return None
        missing = unnamed([config], project, metastore)
        if not missing:
            return None
        command = [sys.executable, "-m", "offsetlake", *(["--pipelines-dir", str(pipelines_dir)] if pipelines_dir else [])]
        command += ["catalog", "register", "--pipeline", source]
        # a classic session of its own: not the run's Spark Connect server, nor the run's JVM (pyspark
        # leaves both in the environment of the process it ran in)
        inherited = ("SPARK_REMOTE", "SPARK_CONNECT_MODE_ENABLED", "PYSPARK_GATEWAY_PORT", "PYSPARK_GATEWAY_SECRET")
        env = {k: v for k, v in os.environ.items() if k not in inherited and k != "OFFSETLAKE_SPARK_REMOTE"}
        env.update({"OFFSETLAKE_HOME": str(project)} if project else {})
        done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    except (OffsetlakeError, OSError, subprocess.TimeoutExpired) as err:
        return f"the metastore was not told of the pipeline's new tables: {err}"
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or ["no message"])[-1]
        return f"naming {', '.join(t.label for t in missing)} in the metastore failed: {said}"
    return None
