"""Test harness: a real broker, one real Spark session, real Delta tables in temp folders.

The broker is Apache Kafka (the pinned jars) started on a free loopback port with a temp data folder, unless
KAFKA_BOOTSTRAP_SERVERS points at another broker (then every test runs against that one
unchanged: topics get unique names). Pipelines are written as YAML into a temp folder, as a
user would, and loaded through the normal loader.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
# Each test says where its Spark runs: the session's warm server (``attached``) or a JVM of its own
# (``cold``). The project's own server, which commands start by default, would be one JVM per test
# home left running until idle; tests/test_spark_server_by_default.py sets ``auto`` and tests it.
os.environ["OFFSETLAKE_SPARK_SERVER"] = "off"

from offsetlake.config import PipelineConfig, load_pipeline  # noqa: E402
from offsetlake.embedded.local_broker import LocalBroker  # noqa: E402


@dataclass
class Broker:
    bootstrap: str
    local: LocalBroker | None


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    external = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if external:
        yield Broker(external, None)
        return
    folder = tmp_path_factory.mktemp("broker")
    local = LocalBroker(folder / "data", log_path=folder / "broker.log").start()
    try:
        yield Broker(local.bootstrap, local)
    finally:
        local.stop()


@dataclass
class Registry:
    """The Schema Registry the tests use: the harness's own (``local``), or a real one when
    SCHEMA_REGISTRY_URL is set (with SCHEMA_REGISTRY_USER_INFO as user:password if it needs it)."""

    settings: dict[str, str]  # the client options a pipeline's format.schema_registry takes
    local: object | None  # tests/schema_registry_server.LocalSchemaRegistry, or None for a real registry

    def client(self):
        from confluent_kafka.schema_registry import SchemaRegistryClient

        return SchemaRegistryClient(dict(self.settings))


@pytest.fixture(scope="session")
def schema_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    external = os.environ.get("SCHEMA_REGISTRY_URL")
    if external:
        user_info = os.environ.get("SCHEMA_REGISTRY_USER_INFO")
        yield Registry({"url": external, **({"basic.auth.user.info": user_info} if user_info else {})}, None)
        return
    from schema_registry_server import LocalSchemaRegistry

    folder = tmp_path_factory.mktemp("schema_registry")
    local = LocalSchemaRegistry(
        folder / "registry.log", user="offsetlake", password="registry-secret", state_file=folder / "state.json"
    ).start()
    try:
        yield Registry(local.client_config(), local)
    finally:
        local.stop()


@pytest.fixture(scope="session")
def spark():
    from offsetlake.spark import spark_session, stop_spark

    session = spark_session("local[2]", app_name="offsetlake-tests")
    yield session
    stop_spark()


# The test session's warm Spark Connect server (issue 49): CLI runs attach to it instead of starting
# a JVM and a Spark session each (about 10 s before any work), as Airflow tasks do through the
# connection spark_connect_default. Started on first use, stopped at the end of the session by PID.
_WARM: dict[str, object] = {}
SPARK_COMMANDS = frozenset({"run", "backfill", "stream"})  # the commands that start Spark (sql keeps its own: its parser)


def warm_spark_server() -> str:
    """The URL of the session's `offsetlake spark-server` (its own JVM, as a user starts it)."""
    if "url" not in _WARM:
        import tempfile

        from offsetlake.embedded.local_spark_server import LocalSparkServer

        log = Path(tempfile.mkdtemp(prefix="offsetlake-spark-server-")) / "server.log"
        server = LocalSparkServer(log, cwd=ROOT).start()
        _WARM.update(url=server.url, server=server)
    return str(_WARM["url"])


def stop_warm_spark_server() -> None:
    server = _WARM.pop("server", None)
    _WARM.pop("url", None)
    if server is not None:
        server.stop()  # type: ignore[attr-defined]


def attached(command: str, args: tuple[str, ...], env: dict[str, str] | None, cold: bool) -> dict[str, str]:
    """The environment of a CLI command: a Spark command attaches to the warm server unless the
    test asks for the cold path (``cold``), names its own ``--remote``, or sets the variable itself."""
    full = {**os.environ, **(env or {})}
    if command in SPARK_COMMANDS and not cold and "--remote" not in args and "OFFSETLAKE_SPARK_REMOTE" not in (env or {}):
        full["OFFSETLAKE_SPARK_REMOTE"] = warm_spark_server()
    return full


@pytest.fixture(scope="session")
def spark_server() -> Iterator[str]:
    """The warm `offsetlake spark-server` for the tests that attach to it by name."""
    yield warm_spark_server()


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory):
    """The embedded S3-compatible server (moto), started once for the tests that use it."""
    from offsetlake.embedded.local_s3 import LocalS3

    server = LocalS3(tmp_path_factory.mktemp("s3") / "s3.log").start()
    try:
        yield server
    finally:
        server.stop()


@dataclass
class Pipeline:
    """A pipeline under test: its YAML file, topic, lake and broker."""

    name: str
    topic: str
    folder: Path
    lake: Path  # the local lake folder; with OFFSETLAKE_TEST_LAKE=s3 the lake is ``lake_uri`` instead
    bootstrap: str
    lake_uri: str | None = None  # s3://bucket/lake on the embedded S3 server
    storage: dict[str, str] | None = None  # that server's settings

    @property
    def file(self) -> Path:
        return self.folder / f"{self.name}.yaml"

    def write(self, **overrides: object) -> PipelineConfig:
        body = {
            "name": self.name,
            "topic": self.topic,
            "kafka": {"bootstrap_servers": self.bootstrap, "options": {"client.id": f"test-{self.name}"}},
            "lake": self.lake_uri or str(self.lake),
            **({"storage": self.storage} if self.storage else {}),
            "start": "earliest",
            "max_records_per_batch": 100_000,
            "read_timeout_seconds": 30,
            "format": {
                "type": "json",
                "schema": {"order_id": "long", "customer": "string", "amount": "double", "currency": "string", "created_at": "timestamp"},
                "required": ["order_id"],
            },
        }
        if "lake" in overrides and "storage" not in overrides:
            body.pop("storage", None)  # a test that names its own lake names its own storage
        body.update(overrides)
        self.file.write_text(yaml.safe_dump(on_the_test_data_path(body), sort_keys=False))
        return self.config() if "routes" not in overrides else self.route(next(iter(overrides["routes"]["tables"])))  # type: ignore[index]

    def route(self, table: str) -> PipelineConfig:
        """One table's pipeline of a file with ``routes:`` (``<name>_<table>``)."""
        return load_pipeline(f"{self.name}_{table}", self.folder)

    def config(self) -> PipelineConfig:
        return load_pipeline(str(self.file))

    def cli(self, *args: str, env: dict[str, str] | None = None, timeout: float = 300, cold: bool = False) -> subprocess.CompletedProcess:
        """Run `offsetlake <command> <pipeline file>` in a fresh process, as a user would: a Spark
        command attached to the session's warm Spark server, or with a Spark of its own (``cold``)."""
        command, *rest = args
        full_env = attached(command, tuple(rest), env, cold)
        full_env.pop("OFFSETLAKE_FAILPOINT", None) if not (env and "OFFSETLAKE_FAILPOINT" in env) else None
        return subprocess.run(
            [sys.executable, "-m", "offsetlake", command, *rest, str(self.file)],
            capture_output=True,
            text=True,
            env=full_env,
            timeout=timeout,
            cwd=ROOT,
        )

    def cli_start(self, *args: str, env: dict[str, str] | None = None, cold: bool = False) -> subprocess.Popen:
        command, *rest = args
        return subprocess.Popen(
            [sys.executable, "-m", "offsetlake", command, *rest, str(self.file)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=attached(command, tuple(rest), env, cold),
            cwd=ROOT,
        )


# ``make test-jvm``: every pipeline a test writes without a data_path of its own takes this one
# when it can (the jvm path reads plain JSON with client settings the Java client takes)
TEST_DATA_PATH = os.environ.get("OFFSETLAKE_TEST_DATA_PATH")


def on_the_test_data_path(body: dict) -> dict:
    """``body`` (a pipeline file's mapping) with ``data_path: $OFFSETLAKE_TEST_DATA_PATH`` when
    that is set, the test names no path of its own, and the pipeline can take it."""
    if not TEST_DATA_PATH or "data_path" in body:
        return body
    if TEST_DATA_PATH == "jvm":
        from offsetlake.kafka_source import java_options

        fmt, key = body.get("format") or {}, body.get("key_format") or {}
        options = {"bootstrap.servers": "-", **((body.get("kafka") or {}).get("options") or {})}
        if fmt.get("type") != "json" or fmt.get("envelope") or key.get("type") in ("avro", "protobuf") or java_options(options)[1]:
            return body
    return {**body, "data_path": TEST_DATA_PATH}


TEST_LAKE = os.environ.get("OFFSETLAKE_TEST_LAKE", "local")  # "s3": every pipeline's lake on the embedded S3
ALSO_ON_S3_KINDS = [k.strip() for k in os.environ.get("OFFSETLAKE_ALSO_ON_S3_KINDS", "s3").split(",") if k.strip()]
if not ALSO_ON_S3_KINDS or set(ALSO_ON_S3_KINDS) - {"local", "s3"}:
    raise pytest.UsageError(
        f"OFFSETLAKE_ALSO_ON_S3_KINDS must name local, s3 or both (comma-separated), not {os.environ['OFFSETLAKE_ALSO_ON_S3_KINDS']!r}"
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "fast: needs no service (set by pytest_collection_modifyitems); make test-fast runs these")
    config.addinivalue_line("markers", "slow: needs no session service but starts something itself; kept out of the fast tier")
    config.addinivalue_line("markers", "local_lake: the test looks at the lake's files on disk; its lake stays local")
    config.addinivalue_line(
        "markers",
        "torture: run by make torture, not make test (CI's 90 minutes): its docstring names the make test tests that cover its ground",
    )
    config.addinivalue_line(
        "markers",
        "stack: builds and runs the production stack (docker images, compose); `make test-stack` (not in .ci/run)",
    )
    config.addinivalue_line(
        "markers",
        "also_on_s3: make test runs it with its lake on the embedded S3, make torture local (OFFSETLAKE_ALSO_ON_S3_KINDS)",
    )


SERVICES = frozenset({"broker", "own_broker", "schema_registry", "spark", "spark_server", "s3", "running_airflow", "pipeline"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that needs none of the session's services (broker, registry, Spark, S3, Airflow) is
    in the fast tier (``make test-fast``, run first by ``.ci/run``) unless it is marked ``slow``
    (it starts something itself)."""
    for item in items:
        if not SERVICES & set(getattr(item, "fixturenames", ())) and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.fast)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Tests marked ``also_on_s3`` hold on both lakes (issue 17: the exactly-once, crash, race,
    backfill, rewind, maintenance and rebuild tests). ``make test`` runs each once, with its lake on
    the embedded S3: the local lake is what every other test of the suite writes, so the local twin
    repeated their ground and cost CI about a third of a minute per test (2026-12-01: 20 tests).
    ``make torture`` runs the local twins (OFFSETLAKE_ALSO_ON_S3_KINDS=local); ``local,s3`` runs both."""
    marker = metafunc.definition.get_closest_marker("also_on_s3")
    if marker is not None and TEST_LAKE == "local":
        metafunc.fixturenames.append("lake_kind")
        metafunc.parametrize("lake_kind", ALSO_ON_S3_KINDS, indirect=True)


@pytest.fixture
def lake_kind(request: pytest.FixtureRequest) -> str:
    """Where this test's pipeline lake lives: OFFSETLAKE_TEST_LAKE, or the test's parameter."""
    return getattr(request, "param", TEST_LAKE)


@pytest.fixture
def pipeline(broker: Broker, tmp_path: Path, request: pytest.FixtureRequest, lake_kind: str) -> Pipeline:
    suffix = uuid.uuid4().hex[:8]
    folder = tmp_path / "pipelines"
    folder.mkdir()
    p = Pipeline(name=f"p_{suffix}", topic=f"t_{suffix}", folder=folder, lake=tmp_path / "lake", bootstrap=broker.bootstrap)
    if lake_kind == "s3" and request.node.get_closest_marker("local_lake") is None:
        server = request.getfixturevalue("s3")
        p.lake_uri, p.storage = f"s3://{server.bucket()}/lake", server.options()
    p.write()
    return p


_AIRFLOW: dict = {}  # the running Airflow shared by consecutive tests that ask for it


@pytest.fixture
def running_airflow(tmp_path_factory: pytest.TempPathFactory, broker: Broker):
    """Real Airflow (api-server, scheduler, dag-processor; SQLite, LocalExecutor) on a free port,
    reading pipelines from its own folder; ``failpoint_file`` arms a one-shot crash in a task.

    Started once for a run of consecutive tests that use it (its start costs about half a
    minute; the modules using it are named test_airflow_r*/s* so they run one after another) and stopped after the
    last of them, so its services do not compete for the two cores with the other tests. Each
    test copies its own uniquely named pipeline into ``pipelines`` and waits for its DAGs."""
    if "instance" in _AIRFLOW:
        return _AIRFLOW["instance"]
    sys.path.insert(0, str(ROOT / "scripts"))
    from local_airflow import LocalAirflow

    from offsetlake.embedded.local_broker import free_port

    tmp_path = tmp_path_factory.mktemp("running_airflow")
    folder = tmp_path / "airflow_pipelines"
    folder.mkdir()
    dags = tmp_path / "dags"  # the project's DAG file, and the DAGs a test adds (downstream of an asset)
    dags.mkdir()
    shutil.copy(ROOT / "dags" / "offsetlake_dags.py", dags / "offsetlake_dags.py")
    host, port = warm_spark_server().removeprefix("sc://").rsplit(":", 1)
    airflow = LocalAirflow(
        tmp_path / "airflow_home",
        free_port(),
        extra_env={
            # ingest tasks attach to the session's warm Spark server (no spark-submit JVM per task);
            # test_airflow_ingest_dag runs one through spark-submit, the cold path
            "AIRFLOW_CONN_SPARK_CONNECT_DEFAULT": json.dumps({"conn_type": "spark_connect", "host": host, "port": int(port)}),
            "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
            "OFFSETLAKE_PIPELINES_DIR": str(folder),
            "OFFSETLAKE_TASK_RETRIES": "0",
            "OFFSETLAKE_FAILPOINT_FILE": str(tmp_path / "failpoint"),
            # OpenLineage events of every task, through the provider's file transport
            "AIRFLOW__OPENLINEAGE__TRANSPORT": json.dumps(
                {"type": "file", "log_file_path": str(tmp_path / "openlineage.jsonl"), "append": True}
            ),
            "AIRFLOW__OPENLINEAGE__NAMESPACE": "offsetlake-tests",
        },
    )
    airflow.pipelines = folder
    airflow.dags_folder = dags
    airflow.lineage_file = tmp_path / "openlineage.jsonl"
    airflow.failpoint_file = tmp_path / "failpoint"
    airflow.start()
    _AIRFLOW["instance"] = airflow
    return airflow


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if "instance" in _AIRFLOW and (nextitem is None or "running_airflow" not in getattr(nextitem, "fixturenames", ())):
        _AIRFLOW.pop("instance").stop()


# Seen here: a Python process that used delta-rs datasets can abort during interpreter teardown
# ("terminate called without an active exception") after all its work is done. The session's
# fixtures have finished (broker stopped, Spark stopped) by pytest_unconfigure, so leave with
# pytest's own exit status instead of letting teardown turn a green run into exit 134.
_SESSION_EXIT: dict[str, int] = {}


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _SESSION_EXIT["status"] = int(exitstatus)
    stop_warm_spark_server()


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    if "status" in _SESSION_EXIT:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_SESSION_EXIT["status"])
