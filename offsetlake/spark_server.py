"""The project's warm Spark session, by default: started on first use, shared, stopped when idle.

A command that needs Spark and is told neither a server (``--remote``, ``$OFFSETLAKE_SPARK_REMOTE``)
nor a master (``--master``, ``$OFFSETLAKE_SPARK_MASTER``, spark-submit's) attaches to the project's
own Spark Connect server, which the first such command starts. A JVM start is most of a small
batch's time (1,000 records: 9.5 s cold, 1.9 s attached); with this, only the first command after an
idle spell pays it. ``$OFFSETLAKE_SPARK_SERVER=off`` (``--no-server``) starts Spark in the command's
own process, as before.

Its files, under ``<home>/.offsetlake/spark-server/`` (home: ``$OFFSETLAKE_HOME``, else the working
directory; one server per home):

- ``lock``: an ``flock`` held while a command finds, starts or leases the server, and while the
  server decides to stop. So two commands racing to start it start one, and a server never stops
  between a command finding it and leasing it.
- ``server.json`` (mode 0600, it holds the token): the running server's URL, PID, code and start
  time. The server writes it when its session is up and removes it when it stops.
- ``leases/<command pid>.<server pid>``: a command attached to it. The server stops once no living
  command holds a lease and none has for ``$OFFSETLAKE_SPARK_SERVER_IDLE`` (default 15 minutes).
- ``server.log``: its output.

It listens on loopback only and refuses a client without its token (Spark Connect's
``SPARK_CONNECT_AUTHENTICATE_TOKEN``). A server found dead (its PID gone, or the PID is no longer
an offsetlake server) is replaced; one alive but not answering on its port is stopped by its PID and
replaced; one started from other code (an upgrade, an edit, another virtualenv or Spark settings) is
retired: it stops on its own when its last command ends, and a new one serves from then on.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from offsetlake.durations import seconds
from offsetlake.errors import OffsetlakeError
from offsetlake.project import home as project_home
from offsetlake.project import private

MODE_ENV = "OFFSETLAKE_SPARK_SERVER"
IDLE_ENV = "OFFSETLAKE_SPARK_SERVER_IDLE"
TOKEN_ENV = "SPARK_CONNECT_AUTHENTICATE_TOKEN"
DEFAULT_IDLE_S = 15 * 60.0
# what the server's session is made of besides the code: a change starts a new server
_SETTINGS_ENV = (
    "OFFSETLAKE_SHUFFLE_PARTITIONS",
    "OFFSETLAKE_DRIVER_MEMORY",
    "OFFSETLAKE_SPARK_UI",
    "OFFSETLAKE_SPARK_LOG_LEVEL",
    "OFFSETLAKE_JARS_DIR",
    "JAVA_HOME",
)

_LEASES: list[Path] = []


@dataclass(frozen=True)
class Server:
    url: str
    pid: int
    code: str
    started: float

    @property
    def port(self) -> int:
        return int(self.url.removeprefix("sc://").split("/")[0].rpartition(":")[2])


def home() -> Path:
    return project_home()


def state_dir(project: Path | None = None) -> Path:
    return private("spark-server", project=project)


def enabled() -> bool:
    """Whether a command with no server and no master attaches to the project's server."""
    value = os.environ.get(MODE_ENV, "auto").strip().lower()
    if value in ("", "auto", "on", "1", "true"):
        return True
    if value in ("off", "0", "false", "no"):
        return False
    raise OffsetlakeError(f"${MODE_ENV}={value!r} is neither 'auto' (the default: one warm server per project) nor 'off'", field=MODE_ENV)


def wanted(master: str | None) -> bool:
    """A command attaches when it is given no master and does not run under spark-submit."""
    if master or os.environ.get("OFFSETLAKE_SPARK_MASTER") or os.environ.get("PYSPARK_GATEWAY_PORT"):
        return False
    return enabled()


def idle_seconds() -> float:
    raw = os.environ.get(IDLE_ENV, "").strip()
    if not raw:
        return DEFAULT_IDLE_S
    try:
        return seconds(raw)
    except ValueError as err:
        raise OffsetlakeError(f"${IDLE_ENV}: {err}", field=IDLE_ENV) from None


def code_fingerprint() -> str:
    """What the server's Python workers would import and how its session is set: offsetlake's
    files (their sizes and times), the interpreter, and the settings above."""
    package = Path(__file__).resolve().parent
    digest = hashlib.sha256(sys.executable.encode())
    for path in sorted(package.rglob("*.py")):
        stat = path.stat()
        digest.update(f"{path.relative_to(package)}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    for name in _SETTINGS_ENV:
        digest.update(f"{name}={os.environ.get(name, '')};".encode())
    return digest.hexdigest()[:16]


# --- the command's side ------------------------------------------------------------------------


def attach(project: Path | None = None, start_timeout_s: float = 180.0) -> str:
    """The URL (with its token) of the project's server, started if none serves; this process
    holds a lease on it until it exits or calls ``release``."""
    folder = state_dir(project)
    (folder / "leases").mkdir(parents=True, exist_ok=True)
    with _locked(folder, timeout_s=start_timeout_s + 60):
        server = _serving(folder)
        if server is None:
            server = _start(folder, project or home(), start_timeout_s)
        lease = folder / "leases" / f"{os.getpid()}.{server.pid}"
        lease.touch()
    if not _LEASES:
        atexit.register(release)
    _LEASES.append(lease)
    return server.url


def release() -> None:
    """End this process's leases (at exit, or when it stops its Spark session)."""
    while _LEASES:
        with contextlib.suppress(OSError):
            _LEASES.pop().unlink()


def current(project: Path | None = None) -> Server | None:
    """The server ``server.json`` names, if its process is an offsetlake server that is alive."""
    server = _read(state_dir(project))
    return server if server is not None and _is_server(server.pid) else None


def stop(project: Path | None = None, timeout_s: float = 60.0) -> Server | None:
    """Stop the project's server by its PID (SIGTERM: it stops Spark and exits); the whole process
    group is SIGKILLed if it is still there after ``timeout_s``. Returns the server it stopped."""
    folder = state_dir(project)
    if not folder.exists():
        return None
    with _locked(folder, timeout_s=timeout_s):
        server = current(project)
        with contextlib.suppress(OSError):
            (folder / "server.json").unlink()
    if server is not None:
        _terminate(server.pid, timeout_s)
    return server


def _serving(folder: Path) -> Server | None:
    """Under the lock: the server to lease, or None after clearing away whatever is not one."""
    server = _read(folder)
    if server is None:
        return None
    if not _is_server(server.pid):  # died (crash, OOM, a reboot), or its PID now belongs to another program
        (folder / "server.json").unlink(missing_ok=True)
        return None
    if server.code != code_fingerprint():  # other code: retire it; it stops when its last command ends
        (folder / "server.json").unlink(missing_ok=True)
        return None
    if not _answers(server.port):  # alive but deaf: a hung JVM helps nobody
        (folder / "server.json").unlink(missing_ok=True)
        _terminate(server.pid, 10.0)
        return None
    return server


_STARTERS_SPARK_ENV = ("PYSPARK_GATEWAY_PORT", "PYSPARK_GATEWAY_SECRET", "SPARK_CONNECT_MODE_ENABLED", "SPARK_REMOTE", "SPARK_LOCAL_REMOTE")


def _start(folder: Path, project: Path, timeout_s: float) -> Server:
    for lease in (folder / "leases").glob("*.*"):  # those of servers that are gone
        if not _alive(int(lease.name.split(".")[1])):
            lease.unlink(missing_ok=True)
    token = secrets.token_hex(24)
    port = _free_port()
    # the server runs a classic local session: nothing of a Spark session its starter had goes
    # with it (a gateway, or Spark Connect, which pyspark marks in the environment of a process that
    # used it: SPARK_CONNECT_MODE_ENABLED=1 made the server's own session ask for a remote URL)
    env = {k: v for k, v in os.environ.items() if k not in _STARTERS_SPARK_ENV}
    env[TOKEN_ENV] = token
    with open(folder / "server.log", "a") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "offsetlake", "spark-server", "--host", "127.0.0.1", "--port", str(port), "--managed", str(folder)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env=env,
            cwd=project,
            start_new_session=True,  # its own process group: it outlives this command, and is stopped by its PID
        )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        server = _read(folder)
        if server is not None and server.pid == process.pid:
            return server
        if process.poll() is not None:
            break
        time.sleep(0.2)
    code = process.poll()
    if code is None:
        _terminate(process.pid, 10.0)
    tail = (folder / "server.log").read_text(errors="replace")[-2000:]
    how = f"exited with {code}" if code is not None else f"was not up after {timeout_s:.0f} s"
    raise OffsetlakeError(
        f"the project's Spark server (offsetlake spark-server on 127.0.0.1:{port}) {how}; its log is "
        f"{folder / 'server.log'}. Run with --no-server ($OFFSETLAKE_SPARK_SERVER=off) to start Spark in this process.\n{tail}"
    )


# --- the server's side -------------------------------------------------------------------------


def publish(folder: Path, port: int) -> Server:
    """The server, once its session is up: ``server.json`` names it (written whole, then renamed)."""
    url = f"sc://localhost:{port}/;token={os.environ[TOKEN_ENV]}"
    server = Server(url=url, pid=os.getpid(), code=code_fingerprint(), started=time.time())
    text = json.dumps({"url": server.url, "pid": server.pid, "code": server.code, "started": server.started})
    partial = folder / f"server.json.{os.getpid()}"
    partial.write_text("")
    partial.chmod(0o600)
    partial.write_text(text)
    partial.replace(folder / "server.json")
    return server


def watch(folder: Path, idle_s: float, stopped: threading.Event, poll_s: float = 1.0) -> None:
    """The server's watchdog (a thread): sets ``stopped`` when no living command has held a lease
    for ``idle_s``, or at once when it is retired (``server.json`` names another server, or none)
    and no command holds one. The last decision is taken under the lock, after removing
    ``server.json``, so no command can lease it in between."""
    me = os.getpid()
    last_used = time.monotonic()
    while not stopped.wait(poll_s):
        if _leased(folder, me):
            last_used = time.monotonic()
            continue
        named = _read(folder)
        retired = named is None or named.pid != me
        if not retired and time.monotonic() - last_used < idle_s:
            continue
        try:
            with _locked(folder, timeout_s=0):
                if _leased(folder, me):
                    continue
                named = _read(folder)
                if named is not None and named.pid == me:
                    (folder / "server.json").unlink(missing_ok=True)
                stopped.set()
        except TimeoutError:
            continue  # a command holds the lock: decide at the next look


def retire(folder: Path) -> None:
    """The server, stopping (idle, retired, or told to): ``server.json`` no longer names it."""
    with contextlib.suppress(TimeoutError), _locked(folder, timeout_s=10.0):
        named = _read(folder)
        if named is not None and named.pid == os.getpid():
            (folder / "server.json").unlink(missing_ok=True)


def _leased(folder: Path, server_pid: int) -> bool:
    held = False
    for lease in (folder / "leases").glob(f"*.{server_pid}"):
        holder = int(lease.name.split(".")[0])
        if _alive(holder):
            held = True
        else:  # a command that died without releasing
            lease.unlink(missing_ok=True)
    return held


# --- shared ------------------------------------------------------------------------------------


@contextlib.contextmanager
def _locked(folder: Path, timeout_s: float) -> Iterator[None]:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "lock", "a") as handle:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{folder / 'lock'} is held by another command") from None
                time.sleep(0.1)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _read(folder: Path) -> Server | None:
    try:
        data = json.loads((folder / "server.json").read_text())
        return Server(url=str(data["url"]), pid=int(data["pid"]), code=str(data["code"]), started=float(data["started"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_server(pid: int) -> bool:
    """Alive, and still an ``offsetlake spark-server --managed`` (a PID may be reused)."""
    if not _alive(pid):
        return False
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"spark-server" in argv and b"--managed" in argv


def _answers(port: int, timeout_s: float = 5.0) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=timeout_s).close()
    except OSError:
        return False
    return True


def _terminate(pid: int, timeout_s: float) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.2)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # reap it if this process started it
    if _alive(pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)  # its own session: the group id is its PID


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
