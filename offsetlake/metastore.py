"""The pipelines' tables by name for any Spark session: Spark's Hive-compatible catalog with an
embedded metastore under the project's home (issue 53).

``settings()`` is what a session needs to see them: the pinned Delta jars and extension, Spark's
Hive catalog, and a Derby metastore in ``<home>/.offsetlake/metastore/`` (home: ``$OFFSETLAKE_HOME``,
else the working directory; git-ignored). ``register`` names every committed table of the given
pipelines there as an external Delta table whose location is its folder in the lake (``PIPELINE``,
``PIPELINE_dead_letters``, ``PIPELINE_ledger`` in the ``default`` database), in a Spark session of
its own. The Delta log stays the truth: a name only points at a folder, so a table made anew in the
same folder (an epoch reset, a rebuilt sink) needs nothing, and a pipeline whose lake moved is named
again (``catalog.register``). Derby lets one process open the metastore at a time: register while
no other session holds it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from offsetlake import jars
from offsetlake.catalog import NamedTable
from offsetlake.catalog import register as name_tables
from offsetlake.config import PipelineConfig
from offsetlake.errors import OffsetlakeError


def folder(project: Path | None = None) -> Path:
    return (project or Path(os.environ.get("OFFSETLAKE_HOME") or os.getcwd())).resolve() / ".offsetlake" / "metastore"


def settings(project: Path | None = None) -> dict[str, str]:
    """The Spark settings of a session that sees the registered tables by name."""
    where = folder(project)
    return {
        "spark.jars": jars.spark_jars(),
        **jars.DELTA_CONF,
        "spark.sql.catalogImplementation": "hive",
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


def write_conf(project: Path | None = None) -> Path:
    where = conf_dir(project)
    where.mkdir(parents=True, exist_ok=True)
    text = "".join(f"{key} {value}\n" for key, value in settings(project).items())
    partial = where / "spark-defaults.conf.partial"
    partial.write_text("# written by `offsetlake catalog register`: the pipelines' tables by name\n" + text)
    partial.replace(where / "spark-defaults.conf")
    return where


def register(configs: list[PipelineConfig], project: Path | None = None) -> tuple[list[NamedTable], list[NamedTable]]:
    """Name every committed table of ``configs`` in the metastore; (registered, skipped: no
    commit yet). Idempotent. Starts and stops a Spark session of its own (the warm server's
    catalog is its own, in memory)."""
    from offsetlake.spark import classic_builder

    folder(project).mkdir(parents=True, exist_ok=True)
    spark: Any = classic_builder(app_name="offsetlake-catalog", extra=settings(project)).getOrCreate()
    # Spark warns for each table that Hive itself cannot read a Delta table: expected, and not Spark's readers' concern
    spark.sparkContext.setLogLevel("ERROR")
    try:
        named = name_tables(spark, configs)
        write_conf(project)
        return named
    except Exception as err:
        if "Another instance of Derby may have already booted the database" in str(err) or "XSDB6" in str(err):
            raise OffsetlakeError(
                f"the metastore at {folder(project)} is open in another Spark session (its embedded Derby database "
                "allows one process at a time): close that session, then register again"
            ) from None
        raise
    finally:
        spark.stop()
