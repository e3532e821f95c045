"""Real Airflow (SQLite home, `airflow dags test`): the factory's DAGs and an ingest run.

`dags test` writes the DAG file's DAGs to the metadata database itself (Airflow 3's ``DAG.test``
syncs the bundle on every call), so a test runs it without a `dags reserialize` first: about 12 s
of each `dags test` is Airflow's own start (its in-process execution API among it), so each one
a test can do without counts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from kafka_truth import assert_exactly_once, ledger_rows, read_topic

from offsetlake import storage
from offsetlake.embedded.sample_data import ensure_topic, produce_orders

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def airflow_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Airflow's environment: a SQLite home, the project's DAGs, and the ingest task attached to
    the test session's warm Spark server (connection spark_connect_default; ``cold`` leaves it out)."""
    from conftest import warm_spark_server

    home = tmp_path_factory.mktemp("airflow_home")
    pipelines = tmp_path_factory.mktemp("airflow_pipelines")
    venv_bin = str(Path(sys.executable).parent)
    env = {
        **os.environ,
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__PARALLELISM": "2",
        "AIRFLOW_CONN_SPARK_DEFAULT": '{"conn_type": "spark", "host": "local[2]"}',
        "AIRFLOW_CONN_SPARK_CONNECT_DEFAULT": _connect(warm_spark_server()),
        "OFFSETLAKE_PIPELINES_DIR": str(pipelines),
        "OFFSETLAKE_TASK_RETRIES": "0",
        "PATH": f"{venv_bin}:{os.environ.get('PATH', '')}",
    }
    migrate = subprocess.run([f"{venv_bin}/airflow", "db", "migrate"], env=env, capture_output=True, text=True, timeout=300)
    assert migrate.returncode == 0, migrate.stderr[-3000:]
    return env


def _connect(url: str) -> str:
    import json

    host, port = url.removeprefix("sc://").rsplit(":", 1)
    return json.dumps({"conn_type": "spark_connect", "host": host, "port": int(port)})


def cold(env: dict[str, str]) -> dict[str, str]:
    """``env`` without the warm server: the ingest task runs spark-submit, a JVM of its own."""
    return {k: v for k, v in env.items() if k != "AIRFLOW_CONN_SPARK_CONNECT_DEFAULT"}


def airflow(env: dict[str, str], *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(Path(sys.executable).parent / "airflow"), *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def test_every_pipeline_file_becomes_an_ingest_dag_without_import_errors(airflow_env, pipeline):
    import shutil

    folder = Path(airflow_env["OFFSETLAKE_PIPELINES_DIR"])
    shutil.copy(pipeline.file, folder / pipeline.file.name)
    shutil.copy(ROOT / "pipelines" / "orders.yaml", folder / "orders.yaml")
    shutil.copy(ROOT / "pipelines" / "orders_transform.py", folder / "orders_transform.py")
    assert airflow(airflow_env, "dags", "reserialize").returncode == 0
    listed = airflow(airflow_env, "dags", "list", "-o", "plain")
    assert listed.returncode == 0, listed.stderr[-2000:]
    for name in ("orders", pipeline.name):
        assert f"{name}_ingest" in listed.stdout and f"{name}_backfill" in listed.stdout, listed.stdout
    errors = airflow(airflow_env, "dags", "list-import-errors", "-o", "plain")
    assert "offsetlake_dags.py" not in errors.stdout, errors.stdout


@pytest.mark.local_lake
def test_ingest_dag_run_lands_topic_exactly_once_and_caught_up_run_skips_spark(airflow_env, pipeline):
    import json
    import shutil

    # The YAML names a dead broker; the Airflow connection kafka_<pipeline> holds the real one,
    # so the run only works if plan, the spark-submit job and publish all take Kafka from it.
    # Its extra also carries a marker password that must not reach any log or table.
    import uuid

    marker = f"MARKER-{uuid.uuid4().hex}"
    host, port = pipeline.bootstrap.rsplit(":", 1)
    airflow_env = {
        **cold(airflow_env),  # the cold path: the ingest job through spark-submit, a JVM of its own
        f"AIRFLOW_CONN_KAFKA_{pipeline.name.upper()}": json.dumps(
            {
                "conn_type": "generic",
                "host": host,
                "port": int(port),
                "extra": {"client.id": "from-airflow-connection", "sasl.username": "svc", "sasl.password": marker},
            }
        ),
    }
    pipeline.write(schedule=None, kafka={"bootstrap_servers": "127.0.0.1:1"})
    shutil.copy(pipeline.file, Path(airflow_env["OFFSETLAKE_PIPELINES_DIR"]) / pipeline.file.name)
    config = pipeline.config().with_kafka_overrides(pipeline.bootstrap, {})
    ensure_topic(pipeline.bootstrap, pipeline.topic, 3)
    produce_orders(pipeline.bootstrap, pipeline.topic, 6_000, malformed_every=301)
    dag_id = f"{pipeline.name}_ingest"

    run = airflow(airflow_env, "dags", "test", dag_id)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    assert "attached to the Spark server" not in run.stdout + run.stderr, "the cold path must run spark-submit"
    assert_exactly_once(config, read_topic(pipeline.bootstrap, pipeline.topic))
    committed = [r for r in ledger_rows(config) if r["status"] == "committed"]
    assert committed and all(r["dag_id"] == dag_id and r["run_id"].startswith("manual__") for r in committed)

    again = airflow(airflow_env, "dags", "test", dag_id)
    output = again.stdout + again.stderr
    assert again.returncode == 0, output[-4000:]
    assert "caught up with the last stable offsets" in output
    assert "spark-submit" not in output.replace("Spark not started", "")

    # `dags test` prints the task logs; the metadata DB holds rendered fields, XComs and the DAG runs
    assert marker not in run.stdout + run.stderr + output, "the connection's password reached the task logs"
    written = [p for folder in (Path(airflow_env["AIRFLOW_HOME"]), pipeline.lake) for p in folder.rglob("*") if p.is_file()]
    assert any(p.name == "airflow.db" for p in written) and any("_delta_log" in str(p) for p in written)
    leaked = [str(p) for p in written if marker.encode() in p.read_bytes()]
    assert not leaked, f"the connection's password was written to {leaked}"


def test_backfill_dag_replaces_a_range_and_bad_params_fail_in_plan(airflow_env, pipeline, spark_server):
    """The ingest task attaches to the Spark server of the provider's Spark Connect connection
    (spark_connect_default: a plain process, no spark-submit, no JVM of its own); then
    ``<p>_backfill`` replaces a range, ``<p>_outbox`` publishes each commit once."""
    import json
    import shutil

    host, port = spark_server.removeprefix("sc://").rsplit(":", 1)
    assert json.loads(airflow_env["AIRFLOW_CONN_SPARK_CONNECT_DEFAULT"]) == {"conn_type": "spark_connect", "host": host, "port": int(port)}
    outbox = f"{pipeline.topic}-outbox"
    config = pipeline.write(schedule=None, outbox={"topic": outbox, "key": ["order_id"]})
    shutil.copy(pipeline.file, Path(airflow_env["OFFSETLAKE_PIPELINES_DIR"]) / pipeline.file.name)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    ensure_topic(pipeline.bootstrap, outbox, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 1_000)
    run = airflow(airflow_env, "dags", "test", f"{pipeline.name}_ingest")
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    assert f"attached to the Spark server at sc://{host}:{port}" in output, output[-4000:]
    assert "spark-submit" not in output and "Using Spark's default log4j profile" not in output, output[-4000:]
    assert_exactly_once(config, read_topic(pipeline.bootstrap, pipeline.topic))
    assert {r["dag_id"] for r in ledger_rows(config) if r["status"] == "committed"} == {f"{pipeline.name}_ingest"}
    rows_before = storage.table(config.layout.sink).count()
    dag_id = f"{pipeline.name}_backfill"
    version = storage.table(config.layout.sink).version()

    bad = airflow(airflow_env, "dags", "test", dag_id, "-c", json.dumps({"partitions": [0], "from_offset": 50, "to_offset": 10}))
    bad_output = bad.stdout + bad.stderr
    assert "to_offset 10 must be greater than from_offset 50" in bad_output, bad_output[-3000:]
    assert storage.table(config.layout.sink).version() == version, "bad params must commit nothing"

    good = airflow(airflow_env, "dags", "test", dag_id, "-c", json.dumps({"partitions": [0], "from_offset": 10, "to_offset": 60}))
    assert good.returncode == 0, (good.stdout + good.stderr)[-4000:]
    assert storage.table(config.layout.sink).version() == version + 1
    assert storage.table(config.layout.sink).count() == rows_before
    backfills = [r for r in ledger_rows(config) if r["kind"] == "backfill" and r["status"] == "committed"]
    assert [(r["partition"], r["start_offset"], r["end_offset"], r["dag_id"]) for r in backfills] == [(0, 10, 60, dag_id)]
    assert_exactly_once(config, read_topic(pipeline.bootstrap, pipeline.topic))

    # <p>_outbox publishes the ingest and the backfill, each once (that a second publish adds
    # nothing is test_outbox's, without a DAG run's half minute)
    from offsetlake.embedded.checker import check_outbox

    published = airflow(airflow_env, "dags", "test", f"{pipeline.name}_outbox")
    assert published.returncode == 0, (published.stdout + published.stderr)[-4000:]
    assert check_outbox(pipeline.bootstrap, outbox, config.sink_path, pipeline.name) == {"commits": 2, "records": 1_000 + 50}


@pytest.mark.torture
def test_ingest_dag_of_a_topic_pattern_picks_up_a_new_topic_and_status_shows_each_topics_lag(airflow_env, pipeline):
    """Issue 19: the DAGs are unchanged for a pipeline over several topics (a pattern here, into
    a keyed sink): every committed record of the topics it matched, the one created between runs
    too, lands once; ledger rows and lag are per topic-partition.

    In ``make torture`` (about 110 s on CI's machine): ``make test`` covers its ground with
    tests/test_many_topics.py (a pattern that picks up a new topic, per-topic ranges) and the
    other ingest DAG tests here (the DAG is the same for one topic or many)."""
    import json
    import shutil

    a, b, c = (f"{pipeline.topic}_{s}" for s in "abc")
    for topic in (a, b):
        ensure_topic(pipeline.bootstrap, topic, 2)
    next_id = produce_orders(pipeline.bootstrap, a, 400)
    next_id = produce_orders(pipeline.bootstrap, b, 300, first_id=next_id)
    config = pipeline.write(
        schedule=None, topic=None, topic_pattern=f"{pipeline.topic}_[a-z]", sink={"mode": "upsert", "key": ["order_id"]}
    )
    shutil.copy(pipeline.file, Path(airflow_env["OFFSETLAKE_PIPELINES_DIR"]) / pipeline.file.name)
    dag_id = f"{pipeline.name}_ingest"
    run = airflow(airflow_env, "dags", "test", dag_id)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]

    ensure_topic(pipeline.bootstrap, c, 1)  # starts matching between runs
    produce_orders(pipeline.bootstrap, c, 200, first_id=next_id)
    status = pipeline.cli("status", "--json")
    lag = {(r["topic"], r["partition"]): r["lag"] for r in json.loads(status.stdout)["partitions"]}
    assert lag[(c, 0)] == 200 and all(v == 0 for k, v in lag.items() if k[0] != c), lag
    run = airflow(airflow_env, "dags", "test", dag_id)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]

    ids = storage.table(config.layout.sink).to_pyarrow_table(columns=["order_id"])["order_id"].to_pylist()
    assert len(ids) == len(set(ids)), "one row per key"
    expected = {i for t in (a, b, c) for i in read_topic(pipeline.bootstrap, t).good.values()}
    assert set(ids) == expected
    committed = {(r["topic"], r["partition"]) for r in ledger_rows(config) if r["status"] == "committed"}
    assert committed == {(a, 0), (a, 1), (b, 0), (b, 1), (c, 0)}
    status = pipeline.cli("status", "--json")
    assert json.loads(status.stdout)["total_lag"] == 0
    from offsetlake.audit import audit_pipeline

    report = audit_pipeline(config, against_kafka=True)
    assert report.ok, report.text()


@pytest.mark.torture
def test_a_kafka_sink_through_airflow_survives_a_job_killed_after_its_kafka_commit(airflow_env, pipeline):
    """``<p>_ingest`` of a Kafka-sink pipeline: a job killed between the Kafka commit and its ledger
    row fails its run; the next run learns the batch from the commit log and goes on; each valid
    record once in the output topic. ``<p>_backfill`` needs the Param republish.

    In ``make torture`` (about 110 s on CI's machine): ``make test`` covers its ground with
    tests/test_kafka_sink.py (a run crashed at every step, the Kafka commit among them, learns
    its batch from the commit log) and the other ingest DAG tests here."""
    import json
    import shutil
    from collections import Counter

    from kafka_truth import read_records

    out = f"{pipeline.topic}-by-customer"
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    ensure_topic(pipeline.bootstrap, out, 2)
    config = pipeline.write(schedule=None, max_records_per_batch=500, sink={"type": "kafka", "topic": out, "key": ["customer"]})
    shutil.copy(pipeline.file, Path(airflow_env["OFFSETLAKE_PIPELINES_DIR"]) / pipeline.file.name)
    produce_orders(pipeline.bootstrap, pipeline.topic, 800)
    dag_id = f"{pipeline.name}_ingest"

    killed = airflow({**airflow_env, "OFFSETLAKE_FAILPOINT": "after_kafka_commit"}, "dags", "test", dag_id)
    assert "failpoint after_kafka_commit reached" in killed.stdout + killed.stderr, (killed.stdout + killed.stderr)[-4000:]
    assert not [r for r in ledger_rows(config) if r["status"] == "committed"], "the job died before its ledger row"
    run = airflow(airflow_env, "dags", "test", dag_id)  # learns the killed batch from the commit log, ingests the rest
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    committed = {r["batch_id"] for r in ledger_rows(config) if r["status"] == "committed"}
    assert len(committed) == 2
    seen = Counter(
        (int(dict(r.headers)["offsetlake.partition"]), int(dict(r.headers)["offsetlake.offset"]))
        for r in read_records(pipeline.bootstrap, out)
    )
    assert len(seen) == 800 and set(seen.values()) == {1}, "each source record once in the output topic"

    backfill = f"{pipeline.name}_backfill"
    refused = airflow(airflow_env, "dags", "test", backfill, "-c", json.dumps({"partitions": [0], "from_offset": 0, "to_offset": 10}))
    assert "Say so with --republish (Airflow: the Param republish)" in refused.stdout + refused.stderr
    marked = airflow(
        airflow_env, "dags", "test", backfill, "-c", json.dumps({"partitions": [0], "from_offset": 0, "to_offset": 10, "republish": True})
    )
    assert marked.returncode == 0, (marked.stdout + marked.stderr)[-4000:]
    kinds = Counter(dict(r.headers)["offsetlake.kind"].decode() for r in read_records(pipeline.bootstrap, out))
    assert kinds == {"ingest": 800, "backfill": 10}


@pytest.mark.local_lake
@pytest.mark.torture
def test_ingest_task_by_default_attaches_to_the_projects_own_spark_server(airflow_env, pipeline):
    """No spark_connect_default, a local spark_default: the ingest job attaches to the project's own
    server (``offsetlake.spark_server``), which the first task starts and the next one reuses.

    In ``make torture`` (about 60 s on CI's machine): ``make test`` covers its ground with
    tests/test_spark_server_by_default.py (a run starts the project's server, the next reuses it)
    and the other ingest DAG tests here, which attach through the Spark Connect connection.
    """
    import shutil

    from offsetlake import spark_server

    env = {**cold(airflow_env), "OFFSETLAKE_SPARK_SERVER": "auto", "OFFSETLAKE_SPARK_SERVER_IDLE": "10m"}
    config = pipeline.write(schedule=None)
    shutil.copy(pipeline.file, Path(env["OFFSETLAKE_PIPELINES_DIR"]) / pipeline.file.name)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    dag_id = f"{pipeline.name}_ingest"
    try:
        servers = []
        for records in (600, 400):
            produce_orders(pipeline.bootstrap, pipeline.topic, records)
            run = airflow(env, "dags", "test", dag_id)
            output = run.stdout + run.stderr
            assert run.returncode == 0, output[-4000:]
            assert "attached to the project's own Spark server" in output, output[-4000:]
            assert "spark-submit" not in output and "Using Spark's default log4j profile" not in output, output[-4000:]
            servers.append(spark_server.current(ROOT))  # the job runs in the project folder: its server is there
        assert servers[0] is not None and servers[0] == servers[1], "the second ingest did not reuse the server"
        assert_exactly_once(config, read_topic(pipeline.bootstrap, pipeline.topic))
    finally:
        spark_server.stop(ROOT)
