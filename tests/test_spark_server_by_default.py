"""The project's own warm Spark server (``offsetlake.spark_server``): a command given neither a
server nor a master attaches to it, the first one starts it, it stops when idle, and a crashed,
stale or foreign one is dealt with. A test of how a server starts, stops, dies or is retired has a
home of its own and stops what it started; the tests that only need one running (at the end of the
file) share one home and its server (``served``), since a server start is ~13 s of JVM. For the
same reason a lifecycle test goes on from the server its previous step left, where that server is
as good as a fresh one: the racing start goes on to the lease that outlives the idle time, and the
crash's replacement is the server then retired, whose replacement the CLI shows and stops."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from kafka_truth import assert_exactly_once, read_topic

from offsetlake import spark_server
from offsetlake.embedded.sample_data import ensure_topic, produce_orders

pytestmark = pytest.mark.slow  # each test starts a Spark server, or uses the one ``served`` started

ROOT = Path(__file__).resolve().parent.parent
JVM_STARTED = "Using Spark's default log4j profile"  # what every classic session start prints

# a command that needs Spark: attaches as any offsetlake command does, and may hold on until told
CLIENT = """
import json, os, sys, time
from pathlib import Path
from offsetlake import spark_server
from offsetlake.spark import is_connect, spark_session
spark = spark_session()
count = spark.range(int(sys.argv[1])).count()
server = spark_server.current()
print(json.dumps({"count": count, "connect": is_connect(spark), "server": server.pid if server else None}), flush=True)
hold = Path(sys.argv[2]) if len(sys.argv) > 2 else None
while hold is not None and not hold.exists():
    time.sleep(0.2)
"""


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    spark_server.stop(tmp_path)


def _env(home: Path, idle: str = "3s", **more: str) -> dict[str, str]:
    return {**os.environ, "OFFSETLAKE_SPARK_SERVER": "auto", "OFFSETLAKE_HOME": str(home), "OFFSETLAKE_SPARK_SERVER_IDLE": idle, **more}


def _client(home: Path, rows: int = 5, hold: Path | None = None, **env: str) -> subprocess.Popen:
    argv = [sys.executable, "-c", CLIENT, str(rows), *([str(hold)] if hold else [])]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(home, **env), cwd=ROOT)


def _result(process: subprocess.Popen, timeout: float = 240) -> dict:
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not spark_server._is_server(pid):
            return True
        time.sleep(0.5)
    return False


def test_two_commands_racing_start_one_server_which_a_command_in_flight_keeps_past_its_idle_time(home: Path) -> None:
    hold = home / "release"
    # both at once: one starts it, the other waits on the lock; the first then holds on, attached
    first, second = _client(home, 5, hold=hold, idle="1s"), _client(home, 7, idle="1s")
    line = first.stdout.readline() if first.stdout else ""
    assert line, first.stderr.read()[-3000:] if first.stderr else ""
    a, b = json.loads(line), _result(second)
    assert (a["count"], b["count"]) == (5, 7)
    assert a["connect"] and b["connect"], "a command with no master ran Spark in its own process"
    assert a["server"] == b["server"] is not None
    log = (home / ".offsetlake" / "spark-server" / "server.log").read_text()
    assert log.count("step=spark_server ") == 1, log[-3000:]  # one JVM for both
    server = spark_server.current(home)
    assert server is not None and server.pid == a["server"]
    assert oct((home / ".offsetlake" / "spark-server" / "server.json").stat().st_mode & 0o777) == "0o600"  # it holds the token
    assert list((home / ".offsetlake" / "spark-server" / "leases").glob(f"{first.pid}.*")), "the holding command has no lease"
    time.sleep(4)  # four idle periods with only the holding command attached: the lease, not the clock, keeps it
    assert spark_server.current(home) == server, "the server stopped under a command that was still attached"
    later = _result(_client(home, 4, idle="1s"))  # a third command meanwhile uses the same one
    assert later["server"] == server.pid
    hold.touch()
    _, err = first.communicate(timeout=240)
    assert first.returncode == 0, err[-3000:]
    # nobody uses it now: it stops by itself after $OFFSETLAKE_SPARK_SERVER_IDLE
    assert _gone(server.pid, 90), "the server outlived its last command by more than its idle time"
    assert spark_server.current(home) is None and not (home / ".offsetlake" / "spark-server" / "server.json").exists()


def test_a_crashed_or_retired_server_is_replaced_and_the_cli_shows_and_stops_it(home: Path) -> None:
    cli = [sys.executable, "-m", "offsetlake", "spark-server"]
    none = subprocess.run([*cli, "--status"], capture_output=True, text=True, env=_env(home), timeout=60)
    assert none.returncode == 1 and json.loads(none.stdout)["spark_server"] is None

    first = _result(_client(home, idle="10m"))
    os.killpg(first["server"], signal.SIGKILL)  # its own process group (start_new_session): the server and its JVM
    assert _gone(first["server"], 30)
    old = _result(_client(home, 6, idle="10m"))
    assert old["count"] == 6 and old["server"] not in (None, first["server"]), "a crashed server was not replaced"

    path = spark_server.state_dir(home) / "server.json"
    named = json.loads(path.read_text())
    path.write_text(json.dumps({**named, "code": "an-older-offsetlake"}))  # as after an upgrade or an edit
    # started from a process that used Spark Connect before (an Airflow task, a campaign, a
    # notebook): pyspark leaves SPARK_CONNECT_MODE_ENABLED=1 in its environment, which the server
    # it starts must not inherit (its own session is a classic one; it failed, "CONNECT_URL_NOT_SET")
    new = _result(_client(home, idle="10m", SPARK_CONNECT_MODE_ENABLED="1"))
    assert new["server"] not in (None, old["server"])
    assert _gone(old["server"], 60), "a retired server with no command attached did not stop"
    assert spark_server.current(home) is not None and spark_server.current(home).pid == new["server"]

    status = subprocess.run([*cli, "--status"], capture_output=True, text=True, env=_env(home), timeout=60)
    assert status.returncode == 0, status.stderr
    shown = json.loads(status.stdout)
    assert shown["pid"] == new["server"] and "token" not in status.stdout
    stopped = subprocess.run([*cli, "--stop"], capture_output=True, text=True, env=_env(home), timeout=120)
    assert json.loads(stopped.stdout) == {"spark_server": "stopped", "pid": new["server"]}
    assert _gone(new["server"], 30) and spark_server.current(home) is None


# --- the tests below need a running server, not a lifecycle of their own: they share ``served`` ---


@dataclass(frozen=True)
class Served:
    """The shared home (``path``), what the command that started its server printed (``first``),
    and the live process (``stranger``, not a server) its ``server.json`` named before that."""

    path: Path
    first: dict
    stranger: subprocess.Popen


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One home whose server the tests below attach to (idle 10m; stopped by its PID at the end of
    the module). Its start is itself a test's fault: ``server.json`` first names a living process
    that is not a server, as after a crash and a reused PID (test_a_pid_that_is_no_longer_the_server_is_left_alone)."""
    home = tmp_path_factory.mktemp("served_home")
    stranger = subprocess.Popen(["sleep", "600"])
    try:
        folder = spark_server.state_dir(home)
        folder.mkdir(parents=True)
        (folder / "server.json").write_text(
            json.dumps({"url": "sc://localhost:1/;token=x", "pid": stranger.pid, "code": spark_server.code_fingerprint(), "started": 0})
        )
        first = _result(_client(home, idle="10m"))
        yield Served(home, first, stranger)
    finally:
        spark_server.stop(home)
        stranger.kill()
        stranger.wait()


def test_a_pid_that_is_no_longer_the_server_is_left_alone(served: Served) -> None:
    got = served.first  # the first command in a home whose server.json named the stranger
    assert got["count"] == 5 and got["server"] not in (None, served.stranger.pid)
    assert served.stranger.poll() is None, "offsetlake killed a process that was not its server"


def test_the_server_refuses_a_client_without_its_token(served: Served) -> None:
    from pyspark.errors.exceptions.connect import SparkConnectGrpcException

    server = spark_server.current(served.path)
    assert server is not None and server.pid == served.first["server"]
    probe = f"from pyspark.sql import SparkSession\nSparkSession.builder.remote('sc://127.0.0.1:{server.port}').create().range(1).count()\n"
    env = {k: v for k, v in os.environ.items() if k != spark_server.TOKEN_ENV}
    refused = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert refused.returncode != 0 and "No authentication token provided" in refused.stderr, refused.stderr[-2000:]
    assert SparkConnectGrpcException.__name__ in refused.stderr


def _server_starts(home: Path) -> int:
    return (spark_server.state_dir(home) / "server.log").read_text().count("step=spark_server ")


@pytest.mark.local_lake
def test_offsetlake_run_by_default_attaches_to_one_server_and_no_server_keeps_spark_in_the_run(
    pipeline, served: Served, tmp_path: Path
) -> None:
    config = pipeline.write(max_records_per_batch=400)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    env = {"OFFSETLAKE_SPARK_SERVER": "auto", "OFFSETLAKE_HOME": str(served.path), "OFFSETLAKE_SPARK_SERVER_IDLE": "10m"}
    starts = _server_starts(served.path)
    produce_orders(pipeline.bootstrap, pipeline.topic, 500)
    first = pipeline.cli("run", env=env, cold=True)
    assert first.returncode == 0, first.stderr[-3000:]
    assert JVM_STARTED not in first.stderr, "the run started Spark in its own process"
    server = spark_server.current(served.path)
    assert server is not None
    produce_orders(pipeline.bootstrap, pipeline.topic, 300)
    second = pipeline.cli("run", env=env, cold=True)
    assert second.returncode == 0, second.stderr[-3000:]
    assert spark_server.current(served.path) == server, "the second run did not reuse the server"
    assert _server_starts(served.path) == starts, "a run started a server of its own while one served"
    # a home of its own, never used: --no-server must leave it untouched, as it must leave any server alone
    alone = tmp_path / "no_server_home"
    alone.mkdir()
    produce_orders(pipeline.bootstrap, pipeline.topic, 100)
    try:
        own = pipeline.cli("run", "--no-server", env={**env, "OFFSETLAKE_HOME": str(alone)}, cold=True)
    finally:
        spark_server.stop(alone)  # had it attached after all, the server it started
    assert own.returncode == 0 and JVM_STARTED in own.stderr, own.stderr[-3000:]  # Spark in the run's own process
    assert not spark_server.state_dir(alone).exists(), "--no-server touched the project's server"
    assert_exactly_once(config, read_topic(pipeline.bootstrap, pipeline.topic))


@pytest.mark.local_lake
def test_sql_on_the_shared_server_follows_a_pipeline_whose_lake_moved(pipeline, served: Served, tmp_path: Path) -> None:
    """The server's catalog outlives each `offsetlake sql`: a name it holds from an earlier call
    must follow the pipeline to its new lake, not keep answering from the old folder."""
    import dataclasses

    env = _env(served.path, idle="10m")
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)

    def count() -> int:
        argv = [
            sys.executable,
            "-m",
            "offsetlake",
            "--pipelines-dir",
            str(pipeline.folder),
            "sql",
            f"SELECT count(*) AS n FROM {pipeline.name}",
            "--json",
        ]
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
        assert done.returncode == 0, done.stderr[-3000:]
        assert JVM_STARTED not in done.stderr, "sql started Spark in its own process"
        return int(json.loads(done.stdout.strip().splitlines()[-1])["n"])

    pipeline.write()
    produce_orders(pipeline.bootstrap, pipeline.topic, 30)
    # the runs attach to the same server (not the session's: no JVM of their own when this file runs alone)
    assert pipeline.cli("run", env=env, cold=True).returncode == 0
    assert count() == 30
    moved = dataclasses.replace(pipeline, lake=tmp_path / "lake_elsewhere")
    moved.write()  # the same pipeline, its lake made anew in another folder: it ingests the topic again
    produce_orders(pipeline.bootstrap, pipeline.topic, 20)
    assert moved.cli("run", env=env, cold=True).returncode == 0
    server = spark_server.current(served.path)
    assert count() == 50
    assert spark_server.current(served.path) == server  # the same server, so the same catalog, answered both
