"""The one Spark session of a process, configured for files delta-rs will commit.

Classic (a driver JVM in this process, local or on a cluster through spark-submit) or Spark
Connect (``remote``/``$OFFSETLAKE_SPARK_REMOTE``: a thin client of a long-lived server, e.g.
``offsetlake spark-server``, so a run pays no JVM start-up). The rest of offsetlake asks this
module, not the session's type, for what differs between the two.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession

from offsetlake import jars, spark_server
from offsetlake.errors import SparkServerUnavailableError
from offsetlake.project import home, private

_SESSION: Any = None
_ADDED_FILES: set[str] = set()

# SQL settings every session needs, whoever started the JVM (also set on a Connect session, whose
# server may be somebody else's)
SQL_CONF = {
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
}


def remote_url(remote: str | None = None) -> str | None:
    """The Spark Connect server to attach to, if any: ``remote``, else ``$OFFSETLAKE_SPARK_REMOTE``."""
    return remote or os.environ.get("OFFSETLAKE_SPARK_REMOTE") or None


def spark_session(master: str | None = None, app_name: str = "offsetlake", remote: str | None = None) -> Any:
    """Create (once) or return the process's Spark session.

    With a Spark Connect URL (``remote`` or ``$OFFSETLAKE_SPARK_REMOTE``, e.g.
    ``sc://127.0.0.1:15002``) the session is a client of that server and no JVM starts here.
    Given neither a URL nor a master, and not under spark-submit, it is a client of the project's
    own server (``offsetlake.spark_server``: started on first use, stopped when idle) unless
    ``$OFFSETLAKE_SPARK_SERVER`` is ``off``. Otherwise ``master`` defaults to ``$OFFSETLAKE_SPARK_MASTER`` or ``local[2]``; under
    spark-submit the master given there wins. Timestamps are UTC and written as TIMESTAMP_MICROS
    because delta-rs commits these files; RawLocalFileSystem avoids ``.crc`` side files in table
    folders. Every classic session has Delta Lake for Spark and Spark's Kafka source (the pinned
    jars, ``offsetlake.jars``).
    """
    global _SESSION
    if _SESSION is not None:
        return _SESSION
    url = remote_url(remote)
    if not url and spark_server.wanted(master):
        url = spark_server.attach()
    if url:
        check_reachable(url)
        session = SparkSession.builder.remote(url).appName(app_name).getOrCreate()
        for key, value in SQL_CONF.items():
            session.conf.set(key, value)
        _SESSION = session
        return _SESSION
    _SESSION = classic_builder(master, app_name).getOrCreate()
    _SESSION.sparkContext.setLogLevel(os.environ.get("OFFSETLAKE_SPARK_LOG_LEVEL", "WARN"))
    return _SESSION


def check_reachable(url: str, timeout_s: float = 10.0) -> None:
    """Fail at once, naming the server, when nothing listens at a Spark Connect URL (the client
    itself would retry for minutes before saying anything)."""
    import socket

    found = re.fullmatch(r"sc://\[?([^/\]]+?)\]?:(\d+)(?:/.*)?", url.split(";")[0])
    if not found:
        raise SparkServerUnavailableError(f"'{url.split(';')[0]}' is not a Spark Connect URL like sc://host:15002")
    host, port = found.group(1), int(found.group(2))
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as err:
        raise SparkServerUnavailableError(
            f"cannot reach the Spark Connect server at sc://{host}:{port} ({err.strerror or err}); start it with "
            "`offsetlake spark-server`, or unset --remote / $OFFSETLAKE_SPARK_REMOTE to start Spark in this process"
        ) from None


def classic_builder(master: str | None = None, app_name: str = "offsetlake", extra: dict[str, str] | None = None) -> Any:
    """The builder of a session whose driver JVM runs in this process (``extra``: more conf)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # local mode stays on loopback
    builder = SparkSession.builder.appName(app_name)
    if not os.environ.get("PYSPARK_GATEWAY_PORT"):  # under spark-submit its --master wins
        builder = builder.master(master or os.environ.get("OFFSETLAKE_SPARK_MASTER", "local[2]"))
    conf = {
        **SQL_CONF,
        **jars.DELTA_CONF,
        # the pinned jars (Delta, Spark's Kafka source, spark-avro) from .jars/spark: files, never
        # --packages, so a session starts offline
        "spark.jars": jars.spark_jars(),
        "spark.sql.shuffle.partitions": os.environ.get("OFFSETLAKE_SHUFFLE_PARTITIONS", "4"),
        # delta-spark rebuilds a table's snapshot (its log replayed) in this many tasks each time
        # it first reads a table or a new version of it: Delta's default of 50 tasks made every
        # first read of a small table 4-7 s on two cores (1.3-2 s with 4; see BENCHMARKS.md)
        "spark.databricks.delta.snapshotPartitions": os.environ.get("OFFSETLAKE_SHUFFLE_PARTITIONS", "4"),
        "spark.hadoop.fs.file.impl": "org.apache.hadoop.fs.RawLocalFileSystem",
        "spark.hadoop.fs.file.impl.disable.cache": "true",
        "spark.hadoop.mapreduce.fileoutputcommitter.marksuccessfuljobs": "false",
        "spark.ui.enabled": os.environ.get("OFFSETLAKE_SPARK_UI", "false"),
        "spark.driver.memory": os.environ.get("OFFSETLAKE_DRIVER_MEMORY", "2g"),
        "spark.ui.showConsoleProgress": "false",
        # a database `offsetlake sql` names tables in (catalog.database) and a user's managed table get their folders
        # in the project's home, not in whatever directory a command (or the warm server) was started from
        "spark.sql.warehouse.dir": str(private("warehouse", project=home().resolve())),
        **(extra or {}),
    }
    for key, value in conf.items():
        builder = builder.config(key, value)
    return builder


def serve_connect(host: str, port: int, master: str | None = None) -> str:
    """Start this process's session with the Spark Connect plugin listening on ``host:port``;
    returns the URL clients attach with. The session's settings (``classic_builder``) become the
    defaults of every client's session."""
    global _SESSION
    if _SESSION is not None:
        raise RuntimeError("a Spark session is already running in this process")
    _SESSION = classic_builder(
        master,
        "offsetlake-spark-server",
        extra={
            "spark.plugins": "org.apache.spark.sql.connect.SparkConnectPlugin",
            "spark.connect.grpc.binding.address": host,
            "spark.connect.grpc.binding.port": str(port),
        },
    ).getOrCreate()
    _SESSION.sparkContext.setLogLevel(os.environ.get("OFFSETLAKE_SPARK_LOG_LEVEL", "WARN"))
    return f"sc://{host}:{port}"


def is_connect(spark: Any) -> bool:
    """Whether ``spark`` is a Spark Connect client session (no SparkContext, no JVM here)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def default_parallelism(spark: Any) -> int:
    """How many tasks keep every core busy: the SparkContext's figure, or for a Connect session
    (no SparkContext here) the server's ``spark.default.parallelism`` if set, else the cores of
    its ``local[N]`` master, else 2."""
    if not is_connect(spark):
        return int(spark.sparkContext.defaultParallelism)
    configured = spark.conf.get("spark.default.parallelism", None)
    if configured:
        return max(1, int(configured))
    found = re.fullmatch(r"local\[(\d+|\*)(?:,\d+)?\]", spark.conf.get("spark.master", "") or "")
    if found:
        return (os.cpu_count() or 2) if found.group(1) == "*" else int(found.group(1))
    return 2


def add_python_file(spark: Any, path: str) -> None:
    """Ship a Python module (a pipeline's transform) to the tasks, once per session."""
    if path in _ADDED_FILES:
        return
    if is_connect(spark):
        spark.addArtifacts(path, pyfile=True)
    else:
        spark.sparkContext.addPyFile(path)
    _ADDED_FILES.add(path)


def tag_jobs(spark: Any, tag: str) -> None:
    """Tag the jobs this thread starts from now on, so ``cancel_tagged`` can stop them mid-task."""
    if is_connect(spark):
        spark.addTag(tag)
    else:
        spark.sparkContext.setInterruptOnCancel(True)
        spark.sparkContext.addJobTag(tag)


def untag_jobs(spark: Any, tag: str) -> None:
    if is_connect(spark):
        spark.removeTag(tag)
    else:
        spark.sparkContext.removeJobTag(tag)


def cancel_tagged(spark: Any, tag: str) -> None:
    """Cancel (from any thread) the running jobs tagged ``tag``."""
    if is_connect(spark):
        spark.interruptTag(tag)
    else:
        spark.sparkContext.cancelJobsWithTag(tag)


def keep_alive(spark: Any) -> None:
    """An idle loop's touch of its session: a Spark Connect server drops a session that sends no
    RPC for ``spark.connect.session.manager.defaultSessionTimeout`` (60 min by default), which
    would fail a stream's next batch after a quiet hour. A classic session needs nothing."""
    if is_connect(spark):
        spark.conf.get("spark.sql.session.timeZone")


# A full GC between batches after a batch that read at least this many records, or when the last
# one is this old (``release_memory``)
RELEASE_AFTER_RECORDS = 50_000
RELEASE_EVERY_SECONDS = 30.0
_released_at: float | None = None


def release_memory(records: int) -> bool:
    """Between batches: a full GC of the driver JVM (and of this Python), if Spark is up, after a
    batch that read ``records`` >= ``RELEASE_AFTER_RECORDS`` or ``RELEASE_EVERY_SECONDS`` after
    the last one; whether it ran.

    G1 grows the heap while a batch allocates and keeps it; without this, each batch of a long
    drain started from a bigger heap than the one before, so peak RSS grew with the backlog
    (bench: 683 -> 1,038 MiB for the JVM at 10x the batch cap). A full GC lets G1 give the
    memory back, but it costs 240-310 ms with this process's Python (GX's modules) and heap: a
    quarter of a stream's micro-batch at 1,000 records/s, where the heap barely grows.
    """
    import gc
    import time

    global _released_at
    now = time.monotonic()
    if records < RELEASE_AFTER_RECORDS and _released_at is not None and now - _released_at < RELEASE_EVERY_SECONDS:
        return False
    gc.collect()
    jvm = _SESSION.sparkContext._jvm if _SESSION is not None and not is_connect(_SESSION) else None
    if jvm is not None:
        jvm.System.gc()
    _released_at = time.monotonic()
    return True


def stop_spark() -> None:
    global _SESSION
    if _SESSION is not None:
        _SESSION.stop()
        _SESSION = None
        _ADDED_FILES.clear()
    spark_server.release()


def dataframe_from_arrow(spark: SparkSession, table: pa.Table) -> DataFrame:
    """A DataFrame holding every row of ``table``.

    Seen here with PySpark 4.2: ``createDataFrame`` of a table whose first chunks are empty (as
    a filtered dataset read returns) gave a DataFrame with no rows at all, so a backfill lost the
    rows it was meant to keep. One chunk avoids it. And on Spark Connect a table of no rows is
    refused ("Can not infer schema from an empty dataset", the fault campaign's merge engine on
    the direct path): its schema is given instead.
    """
    if table.num_rows == 0:
        from pyspark.sql.pandas.types import from_arrow_schema

        return spark.createDataFrame([], schema=from_arrow_schema(table.schema))
    return spark.createDataFrame(table.combine_chunks())
