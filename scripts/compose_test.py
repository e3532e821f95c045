"""`make compose-test`: build the production stack's images here and drive it like a user.

1. Debian's docker.io, docker-compose and debootstrap are installed if missing
   (deploy/compose-test-packages.txt); the engine is started if it is not running, and only an
   engine this script started is stopped at the end (by its PID).
2. The Dockerfile's base: the official Python image if it is present or can be pulled, otherwise a
   stand-in built from Debian's packages (debootstrap of bookworm from the mirror this machine's
   apt uses, with its CA certificates, imported with `docker import`). The project image and a
   Debian PostgreSQL image (deploy/postgres.Dockerfile) are built on it.
3. docker-compose.yaml + deploy/compose-test.yaml come up on host networking, every service on
   127.0.0.1 and a free port. The override's services publish no ports (host networking has
   none to publish), so the merged file is written without them before `up`.
4. Through Airflow's REST API: the scheduled orders_ingest run (unpausing creates it), an
   orders_backfill of a range, and a manual orders_ingest run whose Spark driver is killed with
   SIGKILL mid-run and whose ingest task is then cleared, as the UI's Clear does.
5. Checks: `offsetlake audit --against-kafka` inside the Spark master container, an independent
   read of the topic (plain consumer) against the sink and dead letters (plain delta-rs), the
   ledger entries of each run, the Offset ledger view (401 without a token, the batches with one).
6. `docker-compose down -v`, then nothing of the project may remain: no container, network or
   volume (the images stay, as a build cache).

Phase times and what was checked are printed and written to .compose-test/result.json. Service logs are written to
.compose-test/logs/ before the stack goes down.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))

from local_airflow import AirflowApi  # noqa: E402

from offsetlake.embedded.local_broker import free_port  # noqa: E402

WORK = ROOT / ".compose-test"
PROJECT = "offsetlake-compose-test"
IMAGE = "offsetlake:compose-test"
POSTGRES_IMAGE = "offsetlake-postgres:compose-test"
STAND_IN_BASE = "offsetlake-base:bookworm"
PACKAGES = ROOT / "deploy" / "compose-test-packages.txt"
BINARIES = ("/usr/sbin/dockerd", "/usr/bin/docker-compose", "/usr/sbin/debootstrap")
PORTS = (
    "KAFKA",
    "S3",
    "POSTGRES",
    "REGISTRY",
    "SPARK",
    "SPARK_UI",
    "SPARK_WORKER_UI",
    "AIRFLOW",
    "SCHEDULER_HEALTH",
    "LOG_SERVER",
    "TRIGGER_LOG_SERVER",
)
TOPIC = "orders"
PASSWORD = "compose-test-admin"
S3_KEY, S3_SECRET = "offsetlake", "offsetlake-dev-secret"

timings: dict[str, float] = {}


def say(message: str) -> None:
    print(f"\n== {message}", flush=True)


@contextmanager
def phase(name: str) -> Iterator[None]:
    started = time.monotonic()
    say(name)
    try:
        yield
    finally:
        timings[name] = round(time.monotonic() - started, 1)
        print(f"   ({name}: {timings[name]:.1f}s)", flush=True)


def run(
    *command: str,
    check: bool = True,
    capture: bool = False,
    timeout: float = 1800,
    env: dict[str, str] | None = None,
    stdin: IO[bytes] | None = None,
) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=capture, timeout=timeout, env=env, stdin=stdin, text=capture)
    if check and done.returncode != 0:
        detail = f"\n{done.stdout}\n{done.stderr}" if capture else ""
        raise SystemExit(f"compose-test: `{' '.join(command)}` exited with {done.returncode}{detail}")
    return done


# ---- engine ------------------------------------------------------------------------------------
def engine_answers() -> bool:
    return run("docker", "info", check=False, capture=True, timeout=30).returncode == 0


def ensure_engine() -> subprocess.Popen | None:
    """Install the packages if missing; start dockerd unless an engine answers. Returns what we started."""
    run("bash", str(ROOT / "scripts" / "install_debian_packages.sh"), str(PACKAGES), *BINARIES)
    if engine_answers():
        print("a container engine is already running: using it, and leaving it running")
        return None
    WORK.mkdir(exist_ok=True)
    with open(WORK / "dockerd.log", "ab") as log:
        engine = subprocess.Popen(
            ["/usr/sbin/dockerd"], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    deadline = time.monotonic() + 90
    while not engine_answers():
        if engine.poll() is not None or time.monotonic() > deadline:
            stop_engine(engine)
            raise SystemExit(f"compose-test: dockerd did not start; see {WORK / 'dockerd.log'}")
        time.sleep(1)
    print(f"started dockerd (pid {engine.pid}); it is stopped at the end")
    return engine


def stop_engine(engine: subprocess.Popen | None) -> None:
    if engine is None or engine.poll() is not None:
        return
    engine.send_signal(signal.SIGTERM)  # dockerd stops its containerd and shims itself
    try:
        engine.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(engine.pid, signal.SIGKILL)
        engine.wait(30)
    print(f"stopped dockerd (pid {engine.pid})")


# ---- images ------------------------------------------------------------------------------------
def official_base() -> str:
    match = re.search(r"^ARG BASE=(\S+)$", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    if not match:
        raise SystemExit("compose-test: the Dockerfile has no `ARG BASE=<image>` line")
    return match.group(1)


def image_exists(name: str) -> bool:
    return run("docker", "image", "inspect", name, check=False, capture=True).returncode == 0


def apt_mirror() -> str:
    """The Debian archive this machine's apt uses (its sources name it; so does nothing here)."""
    sources = Path("/etc/apt/sources.list.d/debian.sources")
    if sources.exists():
        for stanza in sources.read_text().split("\n\n"):
            fields = dict(re.findall(r"^(\w[\w-]*):\s*(.+)$", stanza, re.MULTILINE))
            if "bookworm" in fields.get("Suites", "").split() and fields.get("URIs"):
                return fields["URIs"].split()[0]
    listing = Path("/etc/apt/sources.list")
    if listing.exists():
        for line in listing.read_text().splitlines():
            words = line.split()
            if len(words) >= 3 and words[0] == "deb" and words[2] == "bookworm":
                return words[1]
    raise SystemExit("compose-test: no bookworm archive in this machine's apt sources; cannot build the stand-in base")


def build_stand_in_base() -> None:
    """bookworm + Python 3.11 and venv from Debian's packages, trusting what this machine trusts."""
    mirror = apt_mirror()
    with tempfile.TemporaryDirectory(prefix="offsetlake-rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        print("debootstrap bookworm (minbase + python3.11, venv, ca-certificates) from this machine's apt archive")
        run(
            "debootstrap",
            "--variant=minbase",
            "--include=python3.11,python3.11-venv,python3-venv,python-is-python3,ca-certificates",
            "bookworm",
            str(rootfs),
            mirror,
            capture=True,
        )
        for deb in (rootfs / "var/cache/apt/archives").glob("*.deb"):
            deb.unlink()
        shutil.rmtree(rootfs / "var/lib/apt/lists", ignore_errors=True)
        (rootfs / "var/lib/apt/lists/partial").mkdir(parents=True)
        # The image's apt and TLS clients see what the host's see: its apt sources (incl. the
        # security suite) and the CA certificates it added locally (e.g. a proxy's).
        host_sources = Path("/etc/apt/sources.list.d/debian.sources")
        if host_sources.exists():
            (rootfs / "etc/apt/sources.list").unlink(missing_ok=True)
            shutil.copy(host_sources, rootfs / "etc/apt/sources.list.d/debian.sources")
        for cert in Path("/usr/local/share/ca-certificates").glob("*.crt"):
            shutil.copy(cert, rootfs / "usr/local/share/ca-certificates" / cert.name)
        run("chroot", str(rootfs), "update-ca-certificates", capture=True)
        tar = subprocess.Popen(["tar", "--numeric-owner", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        run(
            "docker",
            "import",
            "-c",
            "ENV LANG=C.UTF-8",
            "-c",
            "ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt",
            "-c",
            'CMD ["bash"]',
            "-",
            STAND_IN_BASE,
            capture=True,
            stdin=tar.stdout,
        )  # streamed, not held in memory
        if tar.wait() != 0:
            raise SystemExit("compose-test: tar of the stand-in root file system failed")


def base_image(rebuild: bool) -> str:
    official = official_base()
    if image_exists(official):
        return official
    if run("docker", "pull", official, check=False, capture=True, timeout=300).returncode == 0:
        return official
    print(f"{official} cannot be pulled here: using the stand-in {STAND_IN_BASE}, built from Debian's packages")
    if rebuild or not image_exists(STAND_IN_BASE):
        build_stand_in_base()
    else:
        print(f"{STAND_IN_BASE} exists (--rebuild-base to make it again)")
    return STAND_IN_BASE


def build_images(base: str) -> None:
    for tag, dockerfile in ((IMAGE, "Dockerfile"), (POSTGRES_IMAGE, "deploy/postgres.Dockerfile")):
        print(f"docker build {tag} from {dockerfile} on {base}")
        run(
            "docker",
            "build",
            "--network",
            "host",
            "--build-arg",
            f"BASE={base}",
            "-f",
            str(ROOT / dockerfile),
            "-t",
            tag,
            str(ROOT),
            capture=True,
            timeout=3600,
        )


# ---- the stack ---------------------------------------------------------------------------------
class Stack:
    def __init__(self) -> None:
        # a span of its own, below the test suite's: .ci/run runs this beside `make test`, and a port
        # picked here is bound only when the containers start, a minute later
        self.ports = {name: free_port(below=(16_000, 12_000)) for name in PORTS}
        self.env = {
            **os.environ,
            "OFFSETLAKE_IMAGE": IMAGE,
            "OFFSETLAKE_POSTGRES_IMAGE": POSTGRES_IMAGE,
            "OFFSETLAKE_AIRFLOW_ADMIN_PASSWORD": PASSWORD,
            **{f"OFFSETLAKE_CT_{name}_PORT": str(port) for name, port in self.ports.items()},
        }
        self.file = WORK / "compose.resolved.yaml"

    def resolve(self) -> None:
        merged = run(
            "docker-compose",
            "-f",
            str(ROOT / "docker-compose.yaml"),
            "-f",
            str(ROOT / "deploy/compose-test.yaml"),
            "config",
            capture=True,
            env=self.env,
        ).stdout
        config = yaml.safe_load(merged)
        for service in config["services"].values():
            if service.get("network_mode") == "host":
                service.pop("ports", None)
        self.file.write_text(yaml.safe_dump(config, sort_keys=False))

    def compose(self, *args: str, check: bool = True, capture: bool = False, timeout: float = 900) -> subprocess.CompletedProcess:
        return run(
            "docker-compose",
            "-p",
            PROJECT,
            "-f",
            str(self.file),
            "--project-directory",
            str(ROOT),
            *args,
            check=check,
            capture=capture,
            env=self.env,
            timeout=timeout,
        )

    def container(self, service: str) -> str:
        return self.compose("ps", "-q", service, capture=True).stdout.strip()

    def wait_healthy(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            ids = self.compose("ps", "-q", capture=True).stdout.split()
            states = json.loads(run("docker", "inspect", *ids, capture=True).stdout) if ids else []
            waiting = []
            for state in states:
                name, status = state["Name"].lstrip("/"), state["State"]
                health = (status.get("Health") or {}).get("Status")
                if status["Status"] == "exited" and status["ExitCode"] == 0 and health is None:
                    continue  # a one-shot (minio-init, airflow-init) that did its job
                if state["RestartCount"] >= 3 or (status["Status"] == "exited" and status["ExitCode"] != 0):
                    tail = run("docker", "logs", "--tail", "30", state["Id"], check=False, capture=True)
                    raise SystemExit(
                        f"compose-test: {name} keeps failing ({status['Status']}, exit {status['ExitCode']}, "
                        f"{state['RestartCount']} restarts); its last lines:\n{tail.stdout}{tail.stderr}"
                    )
                if status["Status"] != "running" or health not in (None, "healthy"):
                    waiting.append(f"{name}: {status['Status']}{'/' + health if health else ''}")
            if states and not waiting:
                print(f"{len(states)} containers up and healthy")
                return
            if time.monotonic() > deadline:
                raise SystemExit(f"compose-test: not healthy after {timeout_s:.0f}s: {waiting}")
            time.sleep(3)

    def exec(self, service: str, *command: str, check: bool = True) -> subprocess.CompletedProcess:
        return run("docker", "exec", self.container(service), *command, check=check, capture=True, timeout=600)

    def listeners_off_loopback(self) -> list[str]:
        """TCP listeners of this stack's processes on anything but loopback. With host networking
        a container's sockets are the host's, so `ss` sees them; /proc/<pid>/cgroup names the
        container a process runs in."""
        ids = set(self.compose("ps", "-q", capture=True).stdout.split())
        found = []
        for line in run("ss", "-Hltnp", capture=True).stdout.splitlines():
            local = line.split()[3]
            if local.rpartition(":")[0] in ("127.0.0.1", "[::1]", "[::ffff:127.0.0.1]"):
                continue
            for pid, name in {(pid, name) for name, pid in re.findall(r'\("([^"]+)",pid=(\d+)', line)}:
                try:
                    cgroup = Path(f"/proc/{pid}/cgroup").read_text()
                except OSError:
                    continue  # gone since ss looked
                if any(container_id in cgroup for container_id in ids):
                    found.append(f"{name} (pid {pid}) on {local}")
        return sorted(found)

    def save_logs(self) -> None:
        logs = WORK / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        for service in yaml.safe_load(self.file.read_text())["services"]:
            done = self.compose("logs", "--no-color", service, check=False, capture=True)
            (logs / f"{service}.log").write_text((done.stdout or "") + (done.stderr or ""))
        print(f"service logs: {logs}")

    def leftovers(self) -> list[str]:
        label = f"label=com.docker.compose.project={PROJECT}"
        found = []
        for kind, command in (
            ("container", ("docker", "ps", "-aq", "--filter", label)),
            ("network", ("docker", "network", "ls", "-q", "--filter", label)),
            ("volume", ("docker", "volume", "ls", "-q", "--filter", label)),
        ):
            found += [f"{kind} {item}" for item in run(*command, capture=True).stdout.split()]
        return found


# ---- what a user does --------------------------------------------------------------------------
def loopback_only(stack: Stack, result: dict, when: str) -> None:
    listeners = stack.listeners_off_loopback()
    result.setdefault("listeners_off_loopback", []).extend(listeners)
    if listeners:
        raise SystemExit(f"compose-test: {when} listen beyond loopback: {listeners}")
    print(f"{when}: every listening socket of the stack is on 127.0.0.1")


def pipeline_env(stack: Stack) -> None:
    """This process reads the stack's topic and lake as the containers do (orders.yaml's variables)."""
    os.environ.update(
        {
            "KAFKA_BOOTSTRAP_SERVERS": f"127.0.0.1:{stack.ports['KAFKA']}",
            "OFFSETLAKE_LAKE": "s3://offsetlake/lake",
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{stack.ports['S3']}",
            "AWS_REGION": "us-east-1",
            "AWS_ACCESS_KEY_ID": S3_KEY,
            "AWS_SECRET_ACCESS_KEY": S3_SECRET,
            "AWS_ALLOW_HTTP": "true",
        }
    )


def ledger_of_run(config, dag_run_id: str) -> list[dict]:
    from kafka_truth import ledger_rows

    return [row for row in ledger_rows(config) if row["run_id"] == dag_run_id]


def finished_run(api: AirflowApi, dag_id: str, run_id: str, expect: str = "success", timeout_s: float = 900) -> None:
    state = api.wait_for_run(dag_id, run_id, timeout_s)
    tasks = {task: f"{s}/try {n}" for task, (s, n) in api.task_states(dag_id, run_id).items()}
    print(f"{dag_id} {run_id}: {state} {tasks}")
    if state != expect:
        raise SystemExit(f"compose-test: {dag_id} run {run_id} ended {state}, expected {expect}")


def scheduled_run(api: AirflowApi, timeout_s: float = 300) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        runs = api.api("GET", "/dags/orders_ingest/dagRuns?run_type=scheduled")["dag_runs"]
        if runs:
            return runs[0]["dag_run_id"]
        time.sleep(2)
    raise SystemExit("compose-test: unpausing orders_ingest created no scheduled run")


def driver_pid(stack: Stack) -> int | None:
    """PID of the ingest job's spark-submit driver (a JVM) in the scheduler container, if running."""
    listing = stack.exec("airflow-scheduler", "ps", "-eo", "pid=,args=").stdout
    for line in listing.splitlines():
        pid, _, args = line.strip().partition(" ")
        if "org.apache.spark.deploy.SparkSubmit" in args and "ingest_job.py" in args:
            return int(pid)
    return None


def kill_and_clear(stack: Stack, api: AirflowApi, result: dict) -> tuple[str, str]:
    """Returns the run id and the batch id the killed try was writing."""
    run_id = api.trigger("orders_ingest")
    deadline = time.monotonic() + 600
    pid = None
    while pid is None:
        if time.monotonic() > deadline:
            raise SystemExit(f"compose-test: the ingest of {run_id} never started a Spark driver")
        state = api.task_states("orders_ingest", run_id).get("ingest", (None, 0))[0]
        pid = driver_pid(stack) if state == "running" else None
        time.sleep(0.5)
    # Into the job: its ranges are read (the files are written and committed next). The task log,
    # as the UI shows it, follows the job's step lines while it runs.
    while "step=read" not in api.task_log("orders_ingest", run_id, "ingest", 1):
        if time.monotonic() > deadline:
            raise SystemExit(f"compose-test: the ingest of {run_id} never logged its read step")
        time.sleep(0.2)
    loopback_only(stack, result, "the services and a running Spark job (driver, executors)")
    stack.exec("airflow-scheduler", "kill", "-9", str(pid))
    print(f"killed the ingest's Spark driver (pid {pid} in the scheduler container) with SIGKILL after its read step")
    while True:
        state, tries = api.task_states("orders_ingest", run_id)["ingest"]
        if state in ("up_for_retry", "failed"):
            break
        if state == "success":
            raise SystemExit("compose-test: the ingest succeeded although its driver was killed (killed too late?)")
        if time.monotonic() > deadline:
            raise SystemExit(f"compose-test: ingest of {run_id} still {state} after its driver was killed")
        time.sleep(1)
    steps = [line.strip() for line in api.task_log("orders_ingest", run_id, "ingest", tries).splitlines() if "step=" in line]
    print(f"ingest is {state} after try {tries}; the job's last step before the kill: {steps[-1] if steps else 'none'}")
    print("clearing it through the REST API, as the UI's Clear does")
    api.clear_task("orders_ingest", run_id, "ingest")
    finished_run(api, "orders_ingest", run_id)
    if api.task_states("orders_ingest", run_id)["ingest"][1] < 2:
        raise SystemExit("compose-test: the cleared ingest did not run a second try")
    planned = re.search(r"batch=(\S+)", steps[-1])
    return run_id, planned.group(1) if planned else ""


def ledger_view(api: AirflowApi) -> list[str]:
    url = f"{api.url}/offsetlake/api/pipelines/orders"
    try:
        urllib.request.urlopen(url, timeout=30)
        raise SystemExit("compose-test: the Offset ledger view answered without a token")
    except urllib.error.HTTPError as err:
        if err.code != 401:
            raise SystemExit(f"compose-test: the ledger view without a token answered {err.code}, not 401") from None
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api.token()}"})
    with urllib.request.urlopen(request, timeout=60) as response:
        body = json.loads(response.read())
    kinds = sorted({batch.get("kind") for batch in body.get("batches", [])})
    print(f"ledger view: 401 without a token; with one, {len(body.get('batches', []))} batches of kinds {kinds}")
    if not {"ingest", "backfill"} <= set(kinds):
        raise SystemExit(f"compose-test: the ledger view lists kinds {kinds}, not ingest and backfill")
    return kinds


def drive(stack: Stack, result: dict) -> None:
    from kafka_truth import assert_exactly_once, read_topic

    from offsetlake.config import load_pipeline
    from offsetlake.embedded.sample_data import ensure_topic, produce_orders, produce_transaction

    pipeline_env(stack)
    bootstrap = os.environ["KAFKA_BOOTSTRAP_SERVERS"]
    api = AirflowApi(stack.ports["AIRFLOW"], password=PASSWORD)
    config = load_pipeline("orders", ROOT / "pipelines")

    with phase("a scheduled orders_ingest run"):
        ensure_topic(bootstrap, TOPIC, 3)
        next_id = produce_orders(bootstrap, TOPIC, 30_000, malformed_every=500)
        next_id = produce_transaction(bootstrap, TOPIC, 300, next_id, commit=False, transactional_id="ct-aborted")
        next_id = produce_transaction(bootstrap, TOPIC, 300, next_id, commit=True, transactional_id="ct-committed")
        print("produced 30,000 orders (every 500th malformed), 300 aborted and 300 committed transactional ones")
        api.wait_for_dag("orders_ingest", timeout_s=300)  # unpauses it: the scheduler creates the last interval's run
        scheduled = scheduled_run(api)
        finished_run(api, "orders_ingest", scheduled)
        result["scheduled_run"] = scheduled
        kinds = sorted({(r["kind"], r["status"]) for r in ledger_of_run(config, scheduled)})
        print(f"ledger entries of {scheduled}: {kinds}")
        if ("ingest", "committed") not in kinds:
            raise SystemExit(f"compose-test: the scheduled run's ledger entries are {kinds}")

    with phase("an orders_backfill of orders[0] [1000, 3000)"):
        api.wait_for_dag("orders_backfill")
        backfill = api.trigger("orders_backfill", {"partitions": [0], "from_offset": 1000, "to_offset": 3000})
        finished_run(api, "orders_backfill", backfill)
        result["backfill_run"] = backfill
        entries = {(r["kind"], r["status"]) for r in ledger_of_run(config, backfill)}
        if ("backfill", "committed") not in entries:
            raise SystemExit(f"compose-test: the backfill run's ledger entries are {entries}")

    with phase("an orders_ingest run whose Spark driver is killed, then cleared"):
        produce_orders(bootstrap, TOPIC, 30_000, first_id=next_id, malformed_every=1000)
        killed, killed_batch = kill_and_clear(stack, api, result)
        result["killed_run"] = killed
        batches = {r["batch_id"] for r in ledger_of_run(config, killed) if r["status"] == "committed"}
        print(f"ledger: {len(batches)} committed batch for {killed}: {sorted(batches)}; the killed try read {killed_batch}")
        if batches != {killed_batch}:
            raise SystemExit(
                f"compose-test: run {killed} committed {sorted(batches)}, not the batch its killed try "
                f"read ({killed_batch}): the rerun did not reuse its plan"
            )

    with phase("audit and an independent read"):
        audit = stack.exec("spark-master", "offsetlake", "audit", "--against-kafka", "orders", check=False)
        print(audit.stdout.strip()[-2000:])
        if audit.returncode != 0:
            raise SystemExit(f"compose-test: `offsetlake audit --against-kafka orders` exited {audit.returncode}:\n{audit.stderr}")
        truth = read_topic(bootstrap, TOPIC)
        assert_exactly_once(config, truth)
        print(
            f"independent read: {len(truth.good)} good and {len(truth.bad)} malformed committed records; "
            f"the sink holds every good one once, the dead letters every malformed one once"
        )
        result.update(good=len(truth.good), malformed=len(truth.bad), ledger_view_kinds=ledger_view(api))


def clear_leftovers(stack: Stack) -> None:
    """Take down what an earlier run left (one killed before its `down -v`, as CI's time limit
    does): `up` would otherwise reuse its volumes, and Airflow's database would hold that run's
    scheduled run, already successful, with no lake behind it."""
    left = stack.leftovers()
    if not left:
        return
    print(f"an earlier run left {len(left)} containers, networks or volumes of the project: taking them down first")
    stack.compose("down", "-v", "--remove-orphans", check=False)
    still = stack.leftovers()
    if still:
        raise SystemExit(f"compose-test: an earlier run's {still} could not be removed; remove them and run again")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rebuild-base", action="store_true", help="debootstrap the stand-in base image again")
    parser.add_argument("--keep", action="store_true", help="leave the stack running at the end (no down -v)")
    args = parser.parse_args()
    WORK.mkdir(exist_ok=True)
    shutil.rmtree(WORK / "logs", ignore_errors=True)
    started = time.monotonic()
    engine = None
    stack: Stack | None = None
    result: dict = {}
    ok = False
    try:
        with phase("engine"):
            engine = ensure_engine()
        with phase("images"):
            build_images(base_image(args.rebuild_base))
        stack = Stack()
        stack.resolve()
        clear_leftovers(stack)
        with phase("up"):
            print(f"ports on 127.0.0.1: {stack.ports}")
            up = stack.compose("up", "-d", "--no-build", check=False)
            stack.wait_healthy()  # names a container that keeps failing, with its last log lines
            if up.returncode != 0:
                raise SystemExit(f"compose-test: `up` exited with {up.returncode}; see {WORK / 'logs'}")
            loopback_only(stack, result, "the services")
        drive(stack, result)
        ok = True
    except BaseException as err:
        print(f"\ncompose-test: FAILED: {err}", flush=True)
        raise
    finally:
        if stack is not None and stack.file.exists():
            stack.save_logs()
            if not args.keep:
                with phase("down -v"):
                    stack.compose("down", "-v", "--remove-orphans", check=False)
                    left = result["left_behind"] = stack.leftovers()
                    if left:
                        print(f"compose-test: left behind: {left}")
                        ok = False
                    else:
                        print("no container, network or volume of the project remains")
        if not args.keep:
            stop_engine(engine)
        timings["total"] = round(time.monotonic() - started, 1)
        result.update(passed=ok, engine_started=engine is not None, timings=timings)
        (WORK / "result.json").write_text(json.dumps(result, indent=2))
        print(f"\ntimings (s): {json.dumps(timings)}")
    print("compose-test: PASSED" if ok else "compose-test: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
