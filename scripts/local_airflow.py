"""Airflow 3 on the embedded default: SQLite home, LocalExecutor, services on 127.0.0.1.

Used by `make airflow`, the Airflow part of `make demo` and the rerun tests. Every service is
started in its own session and stopped by its PID (process group), never by name. ``AirflowApi``
is the REST client alone, for an Airflow that something else runs (`make compose-test`'s containers).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVICES = ("api-server", "scheduler", "dag-processor", "triggerer")  # the triggerer runs asset watchers


LOCKED_ATTEMPTS = 4
# how often a wait asks the API again: a run's tasks take about a second each, so a 2 s poll added
# a second to every wait on average; a GET costs the api-server a few milliseconds
POLL_S = 0.5


def _database_busy(status: int, detail: str) -> bool:
    """A request Airflow refused because its SQLite database was locked.

    Airflow says so with 503 "Database is locked" (backfills) or 500 "Database error" (the
    other endpoints); the request was rolled back, so it may be sent again. One exception: a new
    Backfill is committed before its runs are created, and when creating them meets the lock,
    Airflow's removal of it is best effort (``airflow.models.backfill._create_backfill``). A
    backfill left so has no runs and blocks every other one of its DAG ("There is already a
    running backfill") until the scheduler completes it two minutes later; ``api`` cancels it.
    """
    return (status == 503 and "Database is locked" in detail) or (status == 500 and "Database error" in detail)


class AirflowApi:
    """Airflow's REST API as a user drives it: a token from /auth/token, then /api/v2."""

    def __init__(self, port: int, password: str = "admin") -> None:
        self.port = port
        self.password = password

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # ---- REST API ------------------------------------------------------------------------
    def token(self) -> str:
        body = json.dumps({"username": "admin", "password": self.password}).encode()
        request = urllib.request.Request(f"{self.url}/auth/token", data=body, method="POST", headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())["access_token"]

    def api(self, method: str, path: str, body: dict | None = None) -> dict:
        request = urllib.request.Request(
            f"{self.url}/api/v2{path}",
            method=method,
            data=json.dumps(body).encode() if body is not None else None,
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.token()}"},
        )
        sent = time.time()
        busy = False
        for attempt in range(LOCKED_ATTEMPTS):
            try:
                with urllib.request.urlopen(request, timeout=90) as response:
                    return json.loads(response.read() or b"{}")
            except urllib.error.HTTPError as err:
                detail = err.read().decode()[:2000]
                if attempt + 1 < LOCKED_ATTEMPTS and _database_busy(err.code, detail):
                    busy = True
                    time.sleep(2 * (attempt + 1))
                    continue
                dag_id = (body or {}).get("dag_id") if busy and err.code == 409 and (method, path) == ("POST", "/backfills") else None
                if dag_id and attempt + 1 < LOCKED_ATTEMPTS and self._cancel_backfills_left(dag_id, since=sent):
                    continue
                raise RuntimeError(f"{method} {path} -> {err.code}: {detail}") from None
        raise AssertionError("unreachable")

    def _cancel_backfills_left(self, dag_id: str, since: float) -> bool:
        """Cancel the backfills of ``dag_id`` that a refused ``POST /backfills`` sent at ``since``
        left active (``_database_busy``): those created after it and not completed. Whether
        there was one."""
        from datetime import datetime

        listed = self.api("GET", f"/backfills?dag_id={dag_id}&limit=100")["backfills"]
        created = {b["id"]: datetime.fromisoformat(b["created_at"].replace("Z", "+00:00")).timestamp() for b in listed}
        left = [b for b in listed if b["completed_at"] is None and created[b["id"]] >= since - 1]
        for backfill in left:
            self.api("PUT", f"/backfills/{backfill['id']}/cancel")
        return bool(left)

    def wait_for_dag(self, dag_id: str, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                self.api("PATCH", f"/dags/{dag_id}", {"is_paused": False})
                return
            except RuntimeError:
                time.sleep(POLL_S)
        raise RuntimeError(f"DAG {dag_id} was not parsed within {timeout_s:.0f}s")

    def trigger(self, dag_id: str, conf: dict | None = None) -> str:
        run = self.api("POST", f"/dags/{dag_id}/dagRuns", {"logical_date": None, "conf": conf or {}})
        return run["dag_run_id"]

    def wait_for_run(self, dag_id: str, run_id: str, timeout_s: float = 600) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}")["state"]
            if state in ("success", "failed"):
                return state
            time.sleep(POLL_S)
        raise RuntimeError(f"dag run {dag_id}/{run_id} did not finish within {timeout_s:.0f}s")

    def clear(self, dag_id: str, run_id: str, only_failed: bool = True) -> None:
        """What the UI's Clear on a dag run does: POST .../dagRuns/{run}/clear."""
        self.api("POST", f"/dags/{dag_id}/dagRuns/{run_id}/clear", {"dry_run": False, "only_failed": only_failed})

    def clear_task(self, dag_id: str, run_id: str, task_id: str) -> None:
        """What the UI's Clear on one task instance does (downstream included)."""
        self.api(
            "POST",
            f"/dags/{dag_id}/clearTaskInstances",
            {
                "dry_run": False,
                "dag_run_id": run_id,
                "task_ids": [task_id],
                "only_failed": False,
                "include_downstream": True,
            },
        )

    def task_log(self, dag_id: str, run_id: str, task_id: str, try_number: int) -> str:
        """The task's log as the UI shows it: one line per event."""
        body = self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/logs/{try_number}?full_content=true")
        lines = []
        for item in body.get("content") or []:
            lines.append(str(item.get("event", "")) if isinstance(item, dict) else str(item))
        return "\n".join(lines)

    def task_states(self, dag_id: str, run_id: str) -> dict[str, tuple[str, int]]:
        items = self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances")["task_instances"]
        return {ti["task_id"]: (ti["state"], ti["try_number"]) for ti in items}


class LocalAirflow(AirflowApi):
    def __init__(self, home: Path, port: int, extra_env: dict[str, str] | None = None, password: str = "admin") -> None:
        super().__init__(port, password)
        self.home = Path(home)
        self.processes: dict[str, subprocess.Popen] = {}
        bin_dir = str(Path(sys.executable).parent)
        secret_file = self.home / ".jwt_secret"
        self.home.mkdir(parents=True, exist_ok=True)
        if not secret_file.exists():
            secret_file.write_text(secrets.token_hex(32))
        self.env = {
            **os.environ,
            "AIRFLOW_HOME": str(self.home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__PARALLELISM": "2",
            # wait for SQLite's write lock instead of failing a request after sqlite3's 5 s
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS": "offsetlake_airflow.sqlite_db.SQLITE_CONNECT_ARGS",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS_ASYNC": "offsetlake_airflow.sqlite_db.SQLITE_CONNECT_ARGS",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{port}/execution/",
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": str(port),
            "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{port}",
            "AIRFLOW__API__WORKERS": "1",
            "AIRFLOW__API_AUTH__JWT_SECRET": secret_file.read_text(),
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "5",
            "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK": "False",
            "AIRFLOW__TRIGGERER__CAPACITY": "50",
            "AIRFLOW_CONN_SPARK_DEFAULT": '{"conn_type": "spark", "host": "local[2]"}',
            "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
            **(extra_env or {}),
        }
        self.airflow = str(Path(bin_dir) / "airflow")

    def migrate(self) -> None:
        (self.home / "simple_auth_manager_passwords.json.generated").write_text(json.dumps({"admin": self.password}))
        done = subprocess.run([self.airflow, "db", "migrate"], env=self.env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"airflow db migrate failed:\n{done.stderr[-3000:]}")

    def start(self, timeout_s: float = 180) -> LocalAirflow:
        self.migrate()
        logs = self.home / "service-logs"
        logs.mkdir(exist_ok=True)
        for service in SERVICES:
            with open(logs / f"{service}.log", "ab") as log:
                self.processes[service] = subprocess.Popen(
                    [self.airflow, service],
                    env=self.env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    cwd=ROOT,
                )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for service, process in self.processes.items():
                if process.poll() is not None:
                    raise RuntimeError(f"airflow {service} exited with {process.returncode}; see {logs / (service + '.log')}")
            try:
                with urllib.request.urlopen(f"{self.url}/api/v2/monitor/health", timeout=5) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"the Airflow API server did not answer on {self.url} within {timeout_s:.0f}s; see {logs}")

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)
        self.processes.clear()
