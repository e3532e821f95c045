"""`offsetlake catalog register` names the pipelines' tables in the embedded metastore, and a
plain Spark session (no offsetlake in it) started with its settings, as Spark reads them from
``$SPARK_CONF_DIR``, queries them by name and sees what the lake holds (issue 53): a local lake
named in the project's embedded metastore, and a lake on the embedded S3 server named in a Hive
Metastore server (Apache Hive's own, by ``$OFFSETLAKE_METASTORE=thrift://…``), where a new
pipeline's run names its tables itself and ``offsetlake sql`` reads the lake by name too. One test for both saves a broker, a lake and three
JVMs per case."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from offsetlake import storage
from offsetlake.embedded.local_metastore import LocalMetastore
from offsetlake.embedded.sample_data import ensure_topic, produce_orders

ROOT = Path(__file__).resolve().parent.parent

# a user's own session: pyspark only, with the printed settings
PLAIN_SESSION = """
import json, sys
from pyspark.sql import SparkSession
spark = SparkSession.builder.master("local[1]").getOrCreate()  # its settings: $SPARK_CONF_DIR/spark-defaults.conf
counts = {name: spark.sql(f"SELECT count(*) AS n FROM {name}").collect()[0]["n"] for name in sys.argv[1:]}
print(json.dumps(counts))
"""


def _offsetlake(home: Path, folder: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OFFSETLAKE_HOME": str(home), **(env or {})}
    argv = [sys.executable, "-m", "offsetlake", "--pipelines-dir", str(folder), *args]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)


@pytest.mark.also_on_s3
def test_registered_tables_are_queried_by_name_from_a_plain_spark_session(pipeline, tmp_path: Path, request) -> None:
    home = tmp_path / "home"
    # the local lake's names in a database of their own (catalog.database), made by register
    database = "default" if pipeline.lake_uri else "lake_local"
    config = pipeline.write(catalog={"database": database})
    prefix = "" if database == "default" else f"{database}."
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    produce_orders(pipeline.bootstrap, pipeline.topic, 40)
    assert pipeline.cli("run").returncode == 0

    hive = LocalMetastore(tmp_path / "hive").start() if pipeline.lake_uri else None
    request.addfinalizer(lambda: hive.stop() if hive else None)
    chosen = {"OFFSETLAKE_METASTORE": hive.uri} if hive else {}  # the one setting that names the tables in a metastore server

    registered = _offsetlake(home, pipeline.folder, "catalog", "register", env=chosen)
    assert registered.returncode == 0, registered.stderr[-3000:]
    assert "registered 3 tables" in registered.stdout and f"{prefix}{pipeline.name}_dead_letters" in registered.stdout, registered.stdout
    # the names are where the setting says: the project's own Derby, or the server's (and nothing left beside it)
    assert (home / ".offsetlake" / "metastore" / "metastore_db").is_dir() is (hive is None)
    if hive:
        assert hive.uri in registered.stdout and (tmp_path / "hive" / "metastore_db").is_dir()

    settings = _offsetlake(home, pipeline.folder, "catalog", "settings", env=chosen)
    assert settings.returncode == 0, settings.stderr[-2000:]
    if hive:
        assert f"--conf spark.hadoop.hive.metastore.uris={hive.uri}" in settings.stdout.splitlines(), settings.stdout
    conf_dir = home / ".offsetlake" / "metastore" / "conf"
    assert f"SPARK_CONF_DIR={conf_dir} .venv/bin/pyspark" in settings.stdout, settings.stdout
    assert "--conf spark.sql.catalogImplementation=hive" in settings.stdout.splitlines()
    conf_file = conf_dir / "spark-defaults.conf"
    assert conf_file.stat().st_mode & 0o077 == 0, "the conf file may hold S3 credentials: its owner's only"
    if pipeline.lake_uri:  # the lake's bucket reached with the pipeline's own settings, its secrets kept off the terminal
        bucket = pipeline.lake_uri.split("/")[2]
        assert f"--conf spark.hadoop.fs.s3a.bucket.{bucket}.secret.key=***" in settings.stdout.splitlines(), settings.stdout
        assert pipeline.storage["AWS_SECRET_ACCESS_KEY"] not in settings.stdout
        assert f"spark.hadoop.fs.s3a.bucket.{bucket}.endpoint {pipeline.storage['AWS_ENDPOINT_URL']}" in conf_file.read_text()

    def counts(*names: str) -> dict[str, int]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OFFSETLAKE_")}
        env["SPARK_CONF_DIR"] = str(conf_dir)  # as `catalog settings` says: Spark reads spark-defaults.conf there
        done = subprocess.run(
            [sys.executable, "-c", PLAIN_SESSION, *names], capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    names = [f"{prefix}{pipeline.name}", f"{prefix}{pipeline.name}_dead_letters"]
    expected = [40, 0]
    if hive:  # with a metastore server, a run names its pipeline's new tables itself (metastore.follow)
        second = dataclasses.replace(pipeline, name=f"{pipeline.name}_two")
        second.write(catalog={"database": "sales"})  # and its names in another database, created by the run's registration
        with_server = {**chosen, "OFFSETLAKE_HOME": str(home)}
        ran = second.cli("run", env=with_server)
        assert ran.returncode == 0, ran.stderr[-3000:]
        named = home / ".offsetlake" / "metastore" / "named.json"
        assert f"sales.{second.name}_dead_letters" in json.loads(named.read_text())[hive.uri], named.read_text()
        before = named.stat().st_mtime_ns
        again = second.cli("run", env=with_server)  # nothing new to name: no registration, no JVM for it
        assert again.returncode == 0 and named.stat().st_mtime_ns == before, again.stderr[-2000:]
        names += [f"sales.{second.name}", f"sales.{second.name}_dead_letters"]
        expected += [40, 0]
    ledger_rows = storage.table(config.layout.ledger).to_pyarrow_table().num_rows
    names.append(f"{prefix}{pipeline.name}_ledger")
    expected.append(ledger_rows)
    assert counts(*names) == dict(zip(names, expected, strict=True))

    # `offsetlake sql` on a warm Spark Connect server (as by default) reads the lake by name too (an S3 lake through
    # S3A). Unqualified names: the local pipeline's one database is the session's current one; with the S3 case's
    # two databases, `default` stays current and the other is named database.table
    query = f"SELECT (SELECT count(*) FROM {pipeline.name}) AS sink, (SELECT count(*) FROM {pipeline.name}_ledger) AS ledger"
    query += f", (SELECT count(*) FROM sales.{pipeline.name}_two) AS second" if hive else ""
    shown = _offsetlake(home, pipeline.folder, "sql", "--json", "--remote", request.getfixturevalue("spark_server"), query)
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert json.loads(shown.stdout.strip().splitlines()[-1]) == {"sink": 40, "ledger": ledger_rows, **({"second": 40} if hive else {})}
