"""`make demo`: the CLI path on the embedded default, unattended.

Starts the noida-db broker (data in .noida/, or uses $KAFKA_BOOTSTRAP_SERVERS), creates the
`orders` topic with ~100k events including malformed ones, an aborted and a committed
transaction, runs `offsetlake run orders` twice with new events in between, then prints the
status, the ledger, the row counts and the audit result.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from offsetlake.local_broker import LocalBroker  # noqa: E402
from offsetlake.sample_data import ensure_topic, produce_orders, produce_transaction  # noqa: E402


def offsetlake(*args: str, check: bool = True) -> int:
    print(f"\n$ offsetlake {' '.join(args)}", flush=True)
    done = subprocess.run([sys.executable, "-m", "offsetlake", *args], cwd=ROOT, env=os.environ)
    if check and done.returncode != 0:
        raise SystemExit(f"offsetlake {' '.join(args)} exited {done.returncode}")
    return done.returncode


def main() -> int:
    lake = ROOT / "lake"
    os.environ.setdefault("OFFSETLAKE_LAKE", str(lake))
    os.environ.setdefault("OFFSETLAKE_PIPELINES_DIR", str(ROOT / "pipelines"))
    broker = None
    if not os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        import shutil

        shutil.rmtree(ROOT / ".noida", ignore_errors=True)
        shutil.rmtree(lake, ignore_errors=True)
        broker = LocalBroker(ROOT / ".noida" / "data", log_path=ROOT / ".noida" / "broker.log").start()
        os.environ["KAFKA_BOOTSTRAP_SERVERS"] = broker.bootstrap
        print(f"started noida-db broker on {broker.bootstrap} (pid {broker.process.pid})")
    bootstrap = os.environ["KAFKA_BOOTSTRAP_SERVERS"]
    topic = os.environ.setdefault("ORDERS_TOPIC", "orders")
    try:
        ensure_topic(bootstrap, topic, 3)
        next_id = produce_orders(bootstrap, topic, 60_000, malformed_every=500)
        next_id = produce_transaction(bootstrap, topic, 500, next_id, commit=False, transactional_id="demo-aborted")
        next_id = produce_transaction(bootstrap, topic, 500, next_id, commit=True, transactional_id="demo-committed")
        print(f"produced 60,000 events (every 500th malformed), 500 aborted and 500 committed transactional events to '{topic}'")
        offsetlake("status", "orders")
        offsetlake("run", "orders")
        produce_orders(bootstrap, topic, 40_000, first_id=next_id, malformed_every=1000)
        print("\nproduced 40,000 more events")
        offsetlake("run", "orders")
        offsetlake("status", "orders")
        offsetlake("ledger", "orders")
        from deltalake import DeltaTable

        sink = DeltaTable(str(lake / "orders"))
        dead = DeltaTable(str(lake / "_dead_letters" / "orders"))
        print(f"\nsink rows: {sink.count()}  dead letters: {dead.count()}  sink version: {sink.version()}")
        code = offsetlake("audit", "orders", check=False)
        print(f"\ntables: {lake}/orders, {lake}/_dead_letters/orders, {lake}/_offset_ledger")
        if broker is not None:
            print(f"broker log: {broker.log_path}")
        return code
    finally:
        if broker is not None:
            broker.stop()


if __name__ == "__main__":
    sys.exit(main())
