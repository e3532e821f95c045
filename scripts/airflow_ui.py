"""`make airflow`: the Airflow UI and services on 127.0.0.1 for the embedded default.

Reuses the demo's broker data (.kafka/) and lake (lake/), so after `make demo` the orders DAGs,
runs and ledger are there to click through. Prints the URL and login; Ctrl-C stops every
service it started, by PID.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from local_airflow import LocalAirflow  # noqa: E402

from offsetlake.embedded.local_broker import LocalBroker  # noqa: E402


def main() -> int:
    os.environ.setdefault("OFFSETLAKE_LAKE", str(ROOT / "lake"))
    os.environ.setdefault("OFFSETLAKE_PIPELINES_DIR", str(ROOT / "pipelines"))
    home = ROOT / ".airflow"
    home.mkdir(exist_ok=True)
    login = home / "login.txt"
    if not login.exists():
        login.write_text(secrets.token_urlsafe(12))
    password = login.read_text().strip()
    broker = None
    if not os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        broker = LocalBroker(ROOT / ".kafka" / "data", log_path=ROOT / ".kafka" / "broker.log").start()
        os.environ["KAFKA_BOOTSTRAP_SERVERS"] = broker.bootstrap
    airflow = LocalAirflow(home, int(os.environ.get("AIRFLOW_PORT", "8080")), password=password)
    stop = {"now": False}

    def request_stop(*_: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    try:
        airflow.start()
        print(f"\nAirflow UI: {airflow.url}   login: admin / {password}   (password kept in {login})")
        print(f"Kafka: {os.environ['KAFKA_BOOTSTRAP_SERVERS']}   lake: {os.environ['OFFSETLAKE_LAKE']}")
        print("Ctrl-C stops Airflow and the broker.", flush=True)
        while not stop["now"]:
            signal.pause()
    finally:
        airflow.stop()
        if broker is not None:
            broker.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
