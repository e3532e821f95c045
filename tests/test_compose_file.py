"""docker-compose.yaml, checked without a container engine.

No Docker runs on this machine or in CI, so the production stack is checked structurally: the
file is validated against the part of the Compose specification it uses (service keys, their
types, dependency conditions; an unknown key such as a misspelt ``healthcheck`` fails), then the
wiring the pipelines rely on is asserted: every service exists, dependencies and named volumes
resolve, the lake is one MinIO bucket (kept on a named volume, created by a one-shot service that
Airflow waits for) at one URI on every Spark and Airflow node, the Airflow storage connection
reaches MinIO with its root credentials (checked through Airflow's and offsetlake's own parsing),
``spark_default`` and ``kafka_default`` point at the services that exist, Kafka is reachable from
containers and from the host, and nothing is published beyond 127.0.0.1. Values are read after
Compose-style interpolation with the file's own defaults, i.e. as ``docker compose up`` with no
.env sees them.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"

KAFKA = "kafka"
POSTGRES = "postgres"
MINIO = "minio"
MINIO_INIT = "minio-init"
SPARK_MASTER = "spark-master"
SPARK_WORKER = "spark-worker"
AIRFLOW_INIT = "airflow-init"
AIRFLOW_SERVICES = (AIRFLOW_INIT, "airflow-apiserver", "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer")
SPARK_SERVICES = (SPARK_MASTER, SPARK_WORKER)
SCHEMA_REGISTRY = "schema-registry"
REQUIRED_SERVICES = (KAFKA, SCHEMA_REGISTRY, POSTGRES, MINIO, MINIO_INIT, *SPARK_SERVICES, *AIRFLOW_SERVICES)
REGISTRY_CONNECTION_ENV = "AIRFLOW_CONN_SCHEMA_REGISTRY_DEFAULT"
STORAGE_CONNECTION_ENV = "AIRFLOW_CONN_OFFSETLAKE_STORAGE_DEFAULT"
MINIO_DEFAULT_API_PORT = 9000  # `minio server` without --address
SPARK_MASTER_URL = "spark://spark-master:7077"
LOOPBACK = "127.0.0.1"

_STRING_LIST = {"type": "array", "items": {"type": "string"}}
_STRING_OR_LIST = {"oneOf": [{"type": "string"}, _STRING_LIST]}
_DURATION = {"type": "string", "pattern": r"^(\d+(\.\d+)?(us|ms|s|m|h))+$"}
_EXTENSIONS = {"^x-": {}}

# The subset of the Compose specification (compose-spec.io, compose-spec.json) that this stack
# uses, with the spec's types. additionalProperties=false makes unknown or misspelt keys fail.
COMPOSE_SUBSET_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["services"],
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z0-9][a-z0-9_-]*$"},
        "services": {
            "type": "object",
            "minProperties": 1,
            "propertyNames": {"pattern": "^[a-zA-Z0-9._-]+$"},
            "additionalProperties": {"$ref": "#/definitions/service"},
        },
        "volumes": {
            "type": "object",
            "propertyNames": {"pattern": "^[a-zA-Z0-9._-]+$"},
            "additionalProperties": {"type": ["object", "null"]},
        },
        "networks": {"type": "object"},
    },
    "patternProperties": _EXTENSIONS,
    "additionalProperties": False,
    "definitions": {
        "service": {
            "type": "object",
            "properties": {
                "image": {"type": "string", "minLength": 1},
                "build": {
                    "oneOf": [
                        {"type": "string"},
                        {
                            "type": "object",
                            "properties": {"context": {"type": "string"}, "dockerfile": {"type": "string"}, "args": {"type": "object"}},
                            "additionalProperties": False,
                        },
                    ]
                },
                "command": _STRING_OR_LIST,
                "entrypoint": _STRING_OR_LIST,
                "hostname": {"type": "string"},
                "container_name": {"type": "string"},
                "user": {"type": "string"},
                "working_dir": {"type": "string"},
                "environment": {
                    "oneOf": [
                        {"type": "object", "additionalProperties": {"type": ["string", "number", "boolean", "null"]}},
                        _STRING_LIST,
                    ]
                },
                "env_file": _STRING_OR_LIST,
                "ports": {
                    "type": "array",
                    "items": {
                        "oneOf": [
                            {"type": ["string", "number"]},
                            {
                                "type": "object",
                                "properties": {
                                    "target": {"type": "integer"},
                                    "published": {"type": ["string", "integer"]},
                                    "host_ip": {"type": "string"},
                                    "protocol": {"type": "string"},
                                },
                                "required": ["target"],
                                "additionalProperties": False,
                            },
                        ]
                    },
                },
                "volumes": {
                    "type": "array",
                    "items": {
                        "oneOf": [
                            {"type": "string"},
                            {
                                "type": "object",
                                "required": ["type", "target"],
                                "properties": {"type": {"enum": ["bind", "volume", "tmpfs"]}},
                            },
                        ]
                    },
                },
                "depends_on": {
                    "oneOf": [
                        {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
                        {
                            "type": "object",
                            "additionalProperties": {
                                "type": "object",
                                "properties": {
                                    "condition": {"enum": ["service_started", "service_healthy", "service_completed_successfully"]},
                                    "restart": {"type": "boolean"},
                                    "required": {"type": "boolean"},
                                },
                                "required": ["condition"],
                                "additionalProperties": False,
                            },
                        },
                    ]
                },
                "healthcheck": {
                    "type": "object",
                    "properties": {
                        "test": _STRING_OR_LIST,
                        "interval": _DURATION,
                        "timeout": _DURATION,
                        "start_period": _DURATION,
                        "start_interval": _DURATION,
                        "retries": {"type": "integer", "minimum": 1},
                        "disable": {"type": "boolean"},
                    },
                    "additionalProperties": False,
                },
                "restart": {"type": "string", "pattern": "^(no|always|unless-stopped|on-failure(:[0-9]+)?)$"},
                "networks": {"type": ["object", "array"]},
                "profiles": _STRING_LIST,
            },
            "patternProperties": _EXTENSIONS,
            "additionalProperties": False,
        }
    },
}

_VARIABLE = re.compile(r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?-)(?P<default>[^}]*))?\}")


def _interpolate(value: Any) -> Any:
    """Compose interpolation with no environment: ``${VAR:-default}`` -> default, ``$$`` -> ``$``."""
    if isinstance(value, dict):
        return {key: _interpolate(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_interpolate(item) for item in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        if match.group("op") is None:
            raise AssertionError(f"{match.group(0)} has no default: `docker compose up` without an .env would leave it empty")
        return match.group("default")

    return _VARIABLE.sub(substitute, value)


@pytest.fixture(scope="module")
def raw_compose() -> dict[str, Any]:
    with COMPOSE_FILE.open(encoding="utf-8") as handle:
        loaded = yaml.safe_load(handle)
    assert isinstance(loaded, dict), f"{COMPOSE_FILE} is not a YAML mapping"
    return loaded


@pytest.fixture(scope="module")
def compose(raw_compose: dict[str, Any]) -> dict[str, Any]:
    return _interpolate(raw_compose)


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def _environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, None) for item in env)
    return {key: None if value is None else str(value) for key, value in env.items()}


def _depends_on(service: dict[str, Any]) -> list[str]:
    return list(service.get("depends_on") or [])


def _volume_mounts(service: dict[str, Any]) -> list[tuple[str | None, str, str]]:
    """(source, target, type) of each mount; short syntax ``src:dst[:mode]`` or long syntax."""
    mounts = []
    for volume in service.get("volumes") or []:
        if isinstance(volume, dict):
            mounts.append((volume.get("source"), volume["target"], volume["type"]))
            continue
        parts = volume.split(":")
        if len(parts) == 1:
            mounts.append((None, parts[0], "volume"))  # anonymous volume
            continue
        source, target = parts[0], parts[1]
        kind = "bind" if source.startswith(("/", ".", "~")) else "volume"
        mounts.append((source, target, kind))
    return mounts


def _published_ports(service: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(host_ip, published, target) of each port; host_ip is '' when bound to every interface."""
    published = []
    for port in service.get("ports") or []:
        if isinstance(port, dict):
            published.append((port.get("host_ip", ""), str(port.get("published", "")), str(port["target"])))
            continue
        parts = str(port).split(":")
        if len(parts) == 3:
            published.append((parts[0], parts[1], parts[2]))
        elif len(parts) == 2:
            published.append(("", parts[0], parts[1]))
        else:
            published.append(("", "", parts[0]))
    return published


def _command_words(service: dict[str, Any]) -> list[str]:
    command = service.get("command") or []
    return shlex.split(command) if isinstance(command, str) else [str(word) for word in command]


def _option(words: list[str], flag: str) -> str:
    assert flag in words, f"{flag} missing from {words}"
    return words[words.index(flag) + 1]


def _airflow_init_commands(services: dict[str, dict[str, Any]]) -> list[list[str]]:
    """The shell lines the init service runs, as argv lists (the script is `bash -c <script>`)."""
    words = _command_words(services[AIRFLOW_INIT])
    script = words[-1]
    return [shlex.split(line) for line in script.splitlines() if line.strip()]


def _connection_add(services: dict[str, dict[str, Any]], conn_id: str) -> list[str]:
    adds = [argv for argv in _airflow_init_commands(services) if argv[:3] == ["airflow", "connections", "add"] and argv[3:4] == [conn_id]]
    assert len(adds) == 1, f"{AIRFLOW_INIT} must create connection {conn_id} exactly once, found {len(adds)}"
    return adds[0]


def test_file_matches_the_compose_specification_subset(raw_compose: dict[str, Any]) -> None:
    jsonschema.validate(raw_compose, COMPOSE_SUBSET_SCHEMA)


def test_every_variable_has_a_default(raw_compose: dict[str, Any]) -> None:
    _interpolate(raw_compose)  # raises on a ${VAR} without a default


def test_the_stack_has_every_service_it_needs(services: dict[str, dict[str, Any]]) -> None:
    missing = [name for name in REQUIRED_SERVICES if name not in services]
    assert not missing, f"services missing from {COMPOSE_FILE.name}: {missing}"


def test_every_service_has_an_image_or_a_build(services: dict[str, dict[str, Any]]) -> None:
    without = [name for name, service in services.items() if not service.get("image") and not service.get("build")]
    assert not without, f"services with neither image nor build: {without}"


def test_every_dependency_names_a_defined_service(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        for dependency in _depends_on(service):
            assert dependency in services, f"{name} depends on undefined service {dependency}"
            assert dependency != name, f"{name} depends on itself"


def test_dependencies_have_no_cycle(services: dict[str, dict[str, Any]]) -> None:
    finished: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"dependency cycle: {' -> '.join((*path, name))}"
        if name in finished:
            return
        for dependency in _depends_on(services[name]):
            visit(dependency, (*path, name))
        finished.add(name)

    for name in services:
        visit(name, ())


def test_airflow_services_start_after_a_successful_migration(services: dict[str, dict[str, Any]]) -> None:
    assert services[AIRFLOW_INIT]["depends_on"][POSTGRES]["condition"] == "service_healthy"
    assert "healthcheck" in services[POSTGRES]
    for name in AIRFLOW_SERVICES[1:]:
        conditions = services[name].get("depends_on") or {}
        assert isinstance(conditions, dict) and AIRFLOW_INIT in conditions, f"{name} must wait for {AIRFLOW_INIT}"
        assert conditions[AIRFLOW_INIT]["condition"] == "service_completed_successfully", name
    init_lines = _airflow_init_commands(services)
    assert ["airflow", "db", "migrate"] in init_lines


def test_every_named_volume_is_declared(compose: dict[str, Any], services: dict[str, dict[str, Any]]) -> None:
    declared = set((compose.get("volumes") or {}).keys())
    for name, service in services.items():
        for source, target, kind in _volume_mounts(service):
            if kind == "volume" and source is not None:
                assert source in declared, f"{name} mounts volume {source} at {target}, not declared under top-level volumes"


def _minio_ports(services: dict[str, dict[str, Any]]) -> tuple[int, int]:
    """(S3 API port, console port) inside the minio container, from its `minio server` command."""
    words = _command_words(services[MINIO])
    api = int(_option(words, "--address").rsplit(":", 1)[1]) if "--address" in words else MINIO_DEFAULT_API_PORT
    console = int(_option(words, "--console-address").rsplit(":", 1)[1])
    return api, console


def _minio_root(services: dict[str, dict[str, Any]]) -> tuple[str, str]:
    env = _environment(services[MINIO])
    return env["MINIO_ROOT_USER"], env["MINIO_ROOT_PASSWORD"]


def _lake(services: dict[str, dict[str, Any]]) -> str:
    return _environment(services["airflow-scheduler"])["OFFSETLAKE_LAKE"]


def _minio_init_commands(services: dict[str, dict[str, Any]]) -> list[list[str]]:
    """The lines minio-init's shell runs (``sh -c <script>``), as argv lists, with $VAR / ${VAR}
    taken from the service's environment (what the shell expands)."""
    service = services[MINIO_INIT]
    entrypoint = service.get("entrypoint") or []
    words = [*(shlex.split(entrypoint) if isinstance(entrypoint, str) else entrypoint), *_command_words(service)]
    assert words[:2] in (["/bin/sh", "-c"], ["sh", "-c"], ["/bin/bash", "-c"], ["bash", "-c"]), f"{MINIO_INIT}: {words}"
    env = _environment(service)

    def expand(word: str) -> str:
        return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: env.get(m.group(1)) or "", word)

    return [[expand(word) for word in shlex.split(line)] for line in words[2].splitlines() if line.strip()]


def _storage_connection(services: dict[str, dict[str, Any]], name: str) -> dict[str, Any]:
    value = _environment(services[name]).get(STORAGE_CONNECTION_ENV)
    assert value, f"{name} has no {STORAGE_CONNECTION_ENV}"
    try:
        connection = json.loads(value)
    except json.JSONDecodeError as err:
        raise AssertionError(f"{name}: {STORAGE_CONNECTION_ENV} is not JSON ({err}): {value}") from None
    assert isinstance(connection, dict), f"{name}: {STORAGE_CONNECTION_ENV} must be a JSON object"
    return connection


def test_minio_keeps_its_data_on_a_named_volume_behind_a_healthcheck(compose: dict[str, Any], services: dict[str, dict[str, Any]]) -> None:
    minio = services[MINIO]
    repository, _, tag = minio["image"].partition(":")
    assert repository == "minio/minio"
    assert re.fullmatch(r"RELEASE\.\d{4}-\d{2}-\d{2}T\d{2}-\d{2}-\d{2}Z", tag), f"pin a MinIO release, not {tag!r}"
    words = _command_words(minio)
    assert words[0] == "server", f"{MINIO} must run `minio server`: {words}"
    option_values = {i + 1 for i, word in enumerate(words) if word.startswith("--") and "=" not in word}
    data_dirs = [word for i, word in enumerate(words) if i > 0 and i not in option_values and not word.startswith("-")]
    assert len(data_dirs) == 1, f"{MINIO}: expected one data folder in {words}"
    data_dir = data_dirs[0]
    mounts = {target: (source, kind) for source, target, kind in _volume_mounts(minio)}
    assert data_dir in mounts, f"{MINIO} serves {data_dir}, which is not mounted: the lake would die with the container"
    source, kind = mounts[data_dir]
    assert kind == "volume" and source in (compose.get("volumes") or {}), f"{MINIO}: {data_dir} must be a declared named volume"
    healthcheck = minio.get("healthcheck") or {}
    assert healthcheck.get("test") and not healthcheck.get("disable"), f"{MINIO} needs a healthcheck (minio-init waits for it)"
    user, password = _minio_root(services)
    assert len(user) >= 3 and len(password) >= 8, "MinIO refuses a root user under 3 or a password under 8 characters"
    assert minio.get("restart") == "unless-stopped"


def test_the_lake_is_one_minio_bucket_at_one_uri_on_every_spark_and_airflow_node(services: dict[str, dict[str, Any]]) -> None:
    lakes = {name: _environment(services[name]).get("OFFSETLAKE_LAKE") for name in (*SPARK_SERVICES, *AIRFLOW_SERVICES)}
    assert len(set(lakes.values())) == 1 and None not in lakes.values(), f"OFFSETLAKE_LAKE differs between nodes: {lakes}"
    lake = urlsplit(_lake(services))
    assert lake.scheme == "s3" and lake.netloc and lake.path.strip("/"), f"the lake must be s3://<bucket>/<prefix>, not {_lake(services)}"


def test_minio_init_creates_the_lakes_bucket_and_airflow_waits_for_it(services: dict[str, dict[str, Any]]) -> None:
    init = services[MINIO_INIT]
    repository, _, tag = init["image"].partition(":")
    assert repository == "minio/mc" and re.fullmatch(r"RELEASE\.[0-9TZ-]+", tag), init["image"]
    assert init["depends_on"][MINIO]["condition"] == "service_healthy"
    assert init.get("restart", "no") == "no", f"{MINIO_INIT} is one-shot: restarted, it never completes"
    lines = _minio_init_commands(services)
    aliases = {argv[3]: argv[4:] for argv in lines if argv[:3] == ["mc", "alias", "set"]}
    buckets = [argv[-1] for argv in lines if argv[:2] == ["mc", "mb"]]
    assert buckets, f"{MINIO_INIT} creates no bucket: {lines}"
    assert all("--ignore-existing" in argv or "-p" in argv for argv in lines if argv[:2] == ["mc", "mb"]), (
        f"{MINIO_INIT} must not fail when the bucket exists (every `up` runs it again)"
    )
    bucket = urlsplit(_lake(services)).netloc
    made = {target.split("/", 1)[1].rstrip("/"): target.split("/", 1)[0] for target in buckets}
    assert bucket in made, f"{MINIO_INIT} creates {sorted(made)}, the lake is in bucket {bucket}"
    alias = made[bucket]
    assert alias in aliases, f"{MINIO_INIT} uses alias {alias} without `mc alias set {alias}`"
    url, *credentials = aliases[alias]
    api_port, _ = _minio_ports(services)
    assert (urlsplit(url).hostname, urlsplit(url).port) == (MINIO, api_port), f"alias {alias} is {url}, not {MINIO}:{api_port}"
    assert tuple(credentials[:2]) == _minio_root(services), f"alias {alias} does not log in as MinIO's root user"
    for name in AIRFLOW_SERVICES:
        conditions = services[name].get("depends_on") or {}
        assert isinstance(conditions, dict) and MINIO_INIT in conditions, f"{name} must wait for {MINIO_INIT}"
        assert conditions[MINIO_INIT]["condition"] == "service_completed_successfully", name


def test_every_airflow_service_reaches_minio_through_the_storage_connection(services: dict[str, dict[str, Any]]) -> None:
    connections = {name: _storage_connection(services, name) for name in AIRFLOW_SERVICES}
    assert all(c == connections[AIRFLOW_INIT] for c in connections.values()), f"{STORAGE_CONNECTION_ENV} differs: {connections}"
    connection = connections[AIRFLOW_INIT]
    host = urlsplit(connection.get("host") or "")
    api_port, _ = _minio_ports(services)
    assert host.scheme == "http", f"give the endpoint's scheme (a bare host becomes https://): {connection.get('host')}"
    assert (host.hostname, connection.get("port")) == (MINIO, api_port), (
        f"the connection points at {connection.get('host')}:{connection.get('port')}, MinIO serves S3 on {MINIO}:{api_port}"
    )
    assert (connection.get("login"), connection.get("password")) == _minio_root(services), "not MinIO's root user/password"
    extra = connection.get("extra") or {}
    assert str(extra.get("AWS_ALLOW_HTTP")).lower() == "true", "a plain-http endpoint needs AWS_ALLOW_HTTP=true"
    assert extra.get("AWS_REGION"), "delta-rs needs a region, also for MinIO"


def test_airflow_and_offsetlake_read_the_storage_connection_as_minio(services: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    """The real chain, in a child process with the scheduler's values: Airflow parses the env var
    connection, offsetlake_airflow.connections maps it, pipelines/orders.yaml loads with it."""
    scheduler = _environment(services["airflow-scheduler"])
    env = {key: value for key, value in os.environ.items() if not key.startswith(("AWS_", "AIRFLOW", "OFFSETLAKE_"))}
    env.update(
        {
            "AIRFLOW_HOME": str(tmp_path),
            "PYTHONPATH": str(ROOT),
            "OFFSETLAKE_PIPELINES_DIR": str(ROOT / "pipelines"),  # /opt/offsetlake/pipelines in the image
            "OFFSETLAKE_LAKE": scheduler["OFFSETLAKE_LAKE"],
            STORAGE_CONNECTION_ENV: scheduler[STORAGE_CONNECTION_ENV],
        }
    )
    script = (
        "import json; from offsetlake_airflow.connections import load_config; c = load_config('orders'); "
        "print('RESULT ' + json.dumps({'lake': c.lake_path, 'storage': c.storage}))"
    )
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(next(line[7:] for line in run.stdout.splitlines() if line.startswith("RESULT ")))
    user, password = _minio_root(services)
    api_port, _ = _minio_ports(services)
    assert result["lake"] == scheduler["OFFSETLAKE_LAKE"]
    assert result["storage"] == {
        "AWS_ENDPOINT_URL": f"http://{MINIO}:{api_port}",
        "AWS_ACCESS_KEY_ID": user,
        "AWS_SECRET_ACCESS_KEY": password,
        "AWS_REGION": "us-east-1",
        "AWS_ALLOW_HTTP": "true",
    }
    for name in SPARK_SERVICES:  # the same settings as plain variables, for spark-submit by hand
        spark = _environment(services[name])
        shown = {key: spark.get(key) for key in result["storage"]}
        assert shown == result["storage"], f"{name}: AWS_* differ from the Airflow connection: {shown}"


def test_stream_process_logs_stay_on_a_volume_airflow_shares(services: dict[str, dict[str, Any]]) -> None:
    """With the lake on object storage, an Airflow stream task writes its process's output under
    $OFFSETLAKE_LOG_DIR (offsetlake.config.stream_log_path): on the task-log volume, not in the
    container's writable layer."""
    for name in AIRFLOW_SERVICES:
        log_dir = _environment(services[name]).get("OFFSETLAKE_LOG_DIR")
        assert log_dir, f"{name}: OFFSETLAKE_LOG_DIR unset (stream output would go to ~/.offsetlake in the container)"
        volumes = [target for source, target, kind in _volume_mounts(services[name]) if kind == "volume" and source]
        assert any(log_dir == target or log_dir.startswith(target.rstrip("/") + "/") for target in volumes), (
            f"{name}: OFFSETLAKE_LOG_DIR={log_dir} is on no named volume ({volumes})"
        )


def test_spark_and_airflow_nodes_run_one_image_with_one_python(services: dict[str, dict[str, Any]]) -> None:
    nodes = (*SPARK_SERVICES, *AIRFLOW_SERVICES)
    images = {name: services[name].get("image") for name in nodes}
    assert len(set(images.values())) == 1 and None not in images.values(), f"Spark and Airflow must share the project image: {images}"
    pythons = {name: _environment(services[name]).get("PYSPARK_PYTHON") for name in nodes}
    assert set(pythons.values()) == {"/opt/venv/bin/python"}, pythons
    for name in nodes:
        env = _environment(services[name])
        assert env.get("OFFSETLAKE_PIPELINES_DIR") == "/opt/offsetlake/pipelines", name
        assert env.get("KAFKA_BOOTSTRAP_SERVERS") == "kafka:9092", name


def test_kafka_is_the_official_image_with_a_pinned_tag(services: dict[str, dict[str, Any]]) -> None:
    repository, _, tag = services[KAFKA]["image"].partition(":")
    assert repository == "apache/kafka"
    assert re.fullmatch(r"\d+\.\d+\.\d+", tag), f"pin a concrete Kafka version, not {tag!r}"


def _names_registry_host(image: str) -> bool:
    """Docker reads the first path component as a registry host when it has a '.' or ':' or is localhost."""
    first, slash, _ = image.partition("/")
    return bool(slash) and ("." in first or ":" in first or first == "localhost")


def _has_pinned_tag(image: str) -> bool:
    tag = image.rpartition("/")[2].partition(":")[2]
    return bool(tag) and tag != "latest"


def test_no_image_names_a_registry_host_or_floats(services: dict[str, dict[str, Any]]) -> None:
    images = {name: service["image"] for name, service in services.items() if service.get("image")}
    text = DOCKERFILE.read_text(encoding="utf-8")
    arg_defaults = dict(re.findall(r"^ARG\s+(\w+)=(\S+)", text, flags=re.MULTILINE))
    # FROM ${BASE}: the base is a build argument (make compose-test passes a Debian-built one);
    # its default is what `docker compose build` uses, so that is what must be pinned.
    dockerfile_bases = [
        re.sub(r"\$\{(\w+)\}", lambda m: arg_defaults.get(m.group(1), m.group(0)), base)
        for base in re.findall(r"^FROM\s+(\S+)", text, flags=re.MULTILINE)
    ]
    assert dockerfile_bases, f"{DOCKERFILE.name} has no FROM"
    images.update({f"{DOCKERFILE.name} FROM": base for base in dockerfile_bases})
    for where, image in images.items():
        assert not _names_registry_host(image), f"{where}: {image} names a registry host"
        assert _has_pinned_tag(image), f"{where}: {image} has no pinned tag"


def test_kafka_serves_containers_and_the_host_and_keeps_transactions_on_one_node(services: dict[str, dict[str, Any]]) -> None:
    env = _environment(services[KAFKA])
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller", "single-node KRaft"
    listeners = dict(item.split("://", 1) for item in env["KAFKA_LISTENERS"].split(","))
    advertised = dict(item.split("://", 1) for item in env["KAFKA_ADVERTISED_LISTENERS"].split(","))
    protocols = dict(item.split(":", 1) for item in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(","))
    by_address = {address: listener for listener, address in advertised.items()}
    assert "kafka:9092" in by_address, f"containers need an advertised kafka:9092, got {advertised}"
    assert f"{LOOPBACK}:9092" in by_address, f"the host needs an advertised {LOOPBACK}:9092, got {advertised}"
    for address, listener in by_address.items():
        assert protocols[listener] == "PLAINTEXT", f"{listener} ({address})"
    host_listener_port = listeners[by_address[f"{LOOPBACK}:9092"]].rsplit(":", 1)[1]
    assert (LOOPBACK, "9092", host_listener_port) in _published_ports(services[KAFKA]), (
        f"{LOOPBACK}:9092 must be published to the host listener's container port {host_listener_port}"
    )
    assert listeners[by_address["kafka:9092"]].rsplit(":", 1)[1] == "9092"
    assert env["KAFKA_CONTROLLER_LISTENER_NAMES"] in listeners
    single_node_settings = (
        "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR",
        "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR",
        "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR",
    )
    for setting in single_node_settings:
        assert env.get(setting) == "1", f"{setting} must be 1 on a single broker, got {env.get(setting)}"


def test_spark_default_points_at_the_spark_master(services: dict[str, dict[str, Any]]) -> None:
    argv = _connection_add(services, "spark_default")
    uri = urlsplit(_option(argv, "--conn-uri"))
    assert f"{uri.scheme}://{uri.hostname}:{uri.port}" == SPARK_MASTER_URL
    master = urlsplit(SPARK_MASTER_URL)
    master_words = _command_words(services[SPARK_MASTER])
    assert "org.apache.spark.deploy.master.Master" in master_words
    assert _option(master_words, "--host") == master.hostname == SPARK_MASTER
    assert _option(master_words, "--port") == str(master.port)
    worker_words = _command_words(services[SPARK_WORKER])
    assert "org.apache.spark.deploy.worker.Worker" in worker_words
    assert SPARK_MASTER_URL in worker_words, f"the worker must join {SPARK_MASTER_URL}: {worker_words}"
    assert SPARK_MASTER in _depends_on(services[SPARK_WORKER])


def test_spark_services_run_spark_class_from_the_images_spark_home(services: dict[str, dict[str, Any]]) -> None:
    match = re.search(r"SPARK_HOME=(\S+)", DOCKERFILE.read_text(encoding="utf-8"))
    assert match, f"{DOCKERFILE.name} does not set SPARK_HOME"
    for name in SPARK_SERVICES:
        assert _command_words(services[name])[0] == f"{match.group(1)}/bin/spark-class", name


def test_kafka_default_uses_the_brokers_container_listener(services: dict[str, dict[str, Any]]) -> None:
    argv = _connection_add(services, "kafka_default")
    connection = json.loads(_option(argv, "--conn-json"))
    assert connection["conn_type"] == "kafka"
    tasks_bootstrap = _environment(services["airflow-scheduler"])["KAFKA_BOOTSTRAP_SERVERS"]
    assert connection["extra"]["bootstrap.servers"] == tasks_bootstrap == "kafka:9092"


def test_airflow_services_share_one_configuration(services: dict[str, dict[str, Any]]) -> None:
    shared = (
        "AIRFLOW__CORE__EXECUTOR",
        "AIRFLOW__CORE__FERNET_KEY",
        "AIRFLOW__API_AUTH__JWT_SECRET",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN",
        "AIRFLOW__CORE__DAGS_FOLDER",
        "AIRFLOW__CORE__PLUGINS_FOLDER",
        "AIRFLOW__CORE__PARALLELISM",
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL",
    )
    envs = {name: _environment(services[name]) for name in AIRFLOW_SERVICES}
    for key in shared:
        values = {name: env.get(key) for name, env in envs.items()}
        assert len(set(values.values())) == 1 and None not in values.values(), f"{key} differs between Airflow services: {values}"
    env = envs["airflow-scheduler"]
    assert env["AIRFLOW__CORE__EXECUTOR"] == "LocalExecutor"
    assert env["AIRFLOW__CORE__DAGS_FOLDER"] == "/opt/offsetlake/dags"
    assert env["AIRFLOW__CORE__PLUGINS_FOLDER"] == "/opt/offsetlake/plugins"
    assert env["AIRFLOW__CORE__PARALLELISM"] == "4"
    assert urlsplit(env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]).hostname == POSTGRES
    assert urlsplit(env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"]).hostname == "airflow-apiserver"
    commands = {name: _command_words(services[name]) for name in AIRFLOW_SERVICES[1:]}
    assert commands["airflow-scheduler"] == ["airflow", "scheduler"]
    assert commands["airflow-dag-processor"] == ["airflow", "dag-processor"]
    assert commands["airflow-triggerer"] == ["airflow", "triggerer"]
    assert "exec airflow api-server" in commands["airflow-apiserver"][-1]


def test_published_ports_bind_to_loopback_only(services: dict[str, dict[str, Any]]) -> None:
    published = {name: _published_ports(service) for name, service in services.items() if service.get("ports")}
    assert (LOOPBACK, "8080", "8080") in published.get("airflow-apiserver", []), "the Airflow UI/API must be on 127.0.0.1:8080"
    api_port, console_port = _minio_ports(services)
    minio_targets = {target for _, _, target in published.get(MINIO, [])}
    assert {str(api_port), str(console_port)} <= minio_targets, f"publish MinIO's S3 API and console: {published.get(MINIO)}"
    owners: dict[str, str] = {}
    for name, ports in published.items():
        for host_ip, host_port, target in ports:
            assert host_ip == LOOPBACK, f"{name} publishes {host_port or target} on {host_ip or 'every interface'}, not {LOOPBACK}"
            # found by the first real `up`: the Spark master's UI and the Schema Registry both took 8081
            assert host_port not in owners, f"{name} and {owners.get(host_port)} both publish 127.0.0.1:{host_port}"
            owners[host_port] = name


def test_the_file_has_no_top_level_name_that_compose_v1_rejects(raw_compose: dict[str, Any]) -> None:
    """Debian's docker-compose (1.29) refuses the file with a top-level ``name``; the project name
    comes from ``-p`` / COMPOSE_PROJECT_NAME instead (README)."""
    assert "name" not in raw_compose


def test_the_schema_registry_keeps_its_schemas_in_kafka_and_airflow_reaches_it(services: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    """Avro pipelines without a registry in their YAML take ``schema_registry_default``: Airflow
    parses the env var connection and offsetlake_airflow.connections maps it to the registry's URL."""
    registry = services[SCHEMA_REGISTRY]
    repository, _, tag = registry["image"].partition(":")
    assert repository == "confluentinc/cp-schema-registry" and re.fullmatch(r"\d+\.\d+\.\d+", tag)
    env = _environment(registry)
    assert env["SCHEMA_REGISTRY_KAFKASTORE_BOOTSTRAP_SERVERS"] == "PLAINTEXT://kafka:9092"
    assert registry["depends_on"][KAFKA]["condition"] == "service_healthy"
    listener = urlsplit(env["SCHEMA_REGISTRY_LISTENERS"])
    scheduler = _environment(services["airflow-scheduler"])
    child_env = {key: value for key, value in os.environ.items() if not key.startswith(("AIRFLOW", "OFFSETLAKE_"))}
    child_env.update({"AIRFLOW_HOME": str(tmp_path), "PYTHONPATH": str(ROOT), REGISTRY_CONNECTION_ENV: scheduler[REGISTRY_CONNECTION_ENV]})
    script = (
        "import json; from offsetlake_airflow.connections import registry_overrides; "
        "print('RESULT ' + json.dumps(registry_overrides('any_pipeline')))"
    )
    run = subprocess.run([sys.executable, "-c", script], env=child_env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(next(line[7:] for line in run.stdout.splitlines() if line.startswith("RESULT ")))
    assert result == {"url": f"http://{SCHEMA_REGISTRY}:{listener.port}"}
    assert all(_environment(services[name]).get(REGISTRY_CONNECTION_ENV) == scheduler[REGISTRY_CONNECTION_ENV] for name in AIRFLOW_SERVICES)
