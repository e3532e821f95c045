"""Write the lake the keyed upgrade test opens: an upsert sink with deletes and an hourly aggregate,
as an offsetlake that kept keyed state inside the sink table wrote them (issue 51 froze main
``7450f63``: delete markers, superseded rows, folded states and contributions as hidden rows),
plus the exact Kafka records they came from.

Run once with the code whose lake you want to freeze, from an export of one commit:

    git -C <main> archive 7450f63 | tar -x -C /tmp/main-7450f63
    PYTHONPATH=/tmp/main-7450f63 .venv/bin/python scripts/make_keyed_upgrade_lake.py tests/data/lake-keyed-v1

It starts the embedded broker in a temp folder, creates topic ``keyed_orders`` (2 partitions),
produces keyed orders with tombstones, and runs pipelines ``keyed_upsert`` and ``keyed_hourly``
through ingest batches, a backfill and more batches. It writes ``<out>/lake``,
``<out>/records.json`` (every record: partition, offset, timestamp, key, value) and
``<out>/expected.json`` (what the test checks).
"""

from __future__ import annotations

import base64
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

TOPIC = "keyed_orders"
MEASURES = {"revenue": {"sum": "amount"}, "orders": {"count": "*"}, "last_customer": {"last": "customer"}}
SINKS = {
    "keyed_upsert": {"mode": "upsert", "key": ["_kafka_key"]},
    "keyed_hourly": {"mode": "aggregate", "key": ["currency"], "window": {"on": "created_at", "size": "1h"}, "measures": MEASURES},
}
SCHEMA = {"order_id": "long", "customer": "string", "amount": "double", "currency": "string", "created_at": "timestamp"}


def pipeline_body(name: str, bootstrap: str, lake: str) -> dict:
    """The pipeline definition the lake was written with (the test writes the same one)."""
    return {
        "name": name,
        "topic": TOPIC,
        "kafka": {"bootstrap_servers": bootstrap},
        "lake": lake,
        "start": "earliest",
        "max_records_per_batch": 100,
        "read_timeout_seconds": 30,
        "key_format": {"type": "string"},
        "format": {"type": "json", "schema": SCHEMA, "required": ["order_id"]},
        "sink": SINKS[name],
    }


def produce(bootstrap: str, n: int, seed: int) -> None:
    """``n`` orders over 40 keys (a key always in one partition), some tombstones."""
    from confluent_kafka import Producer

    rng = random.Random(seed)
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    for _ in range(n):
        order_id = rng.randrange(40)
        key = str(order_id).encode()
        if rng.random() < 0.08:
            producer.produce(TOPIC, key=key, value=None, partition=order_id % 2)
            continue
        value = {
            "order_id": order_id,
            "customer": f"c{rng.randrange(9)}",
            "amount": round(rng.uniform(1, 100), 2),
            "currency": rng.choice(["EUR", "USD", "GBP"]),
            "created_at": f"2026-11-01T{rng.randrange(6):02d}:{rng.randrange(60):02d}:00Z",
        }
        producer.produce(TOPIC, key=key, value=json.dumps(value).encode(), partition=order_id % 2)
    assert producer.flush(30) == 0


def records(bootstrap: str) -> list[dict]:
    from kafka_truth import read_records

    return [
        {
            "partition": r.partition,
            "offset": r.offset,
            "timestamp_ms": r.timestamp_ms,
            "key": base64.b64encode(r.key).decode() if r.key is not None else None,
            "value": base64.b64encode(r.value).decode() if r.value is not None else None,
        }
        for r in read_records(bootstrap, TOPIC)
    ]


def _cli(file: Path, *args: str) -> None:
    command, *rest = args
    done = subprocess.run([sys.executable, "-m", "offsetlake", command, *rest, str(file)], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"offsetlake {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")


def main(out: Path) -> None:
    from deltalake import DeltaTable

    from offsetlake.embedded.local_broker import LocalBroker
    from offsetlake.embedded.sample_data import ensure_topic

    work = Path(tempfile.mkdtemp(prefix="keyed-upgrade-lake-"))
    broker = LocalBroker(work / "broker", log_path=work / "broker.log").start()
    try:
        files = {}
        for name in SINKS:
            files[name] = work / f"{name}.yaml"
            files[name].write_text(yaml.safe_dump(pipeline_body(name, broker.bootstrap, str(work / "lake")), sort_keys=False))
        ensure_topic(broker.bootstrap, TOPIC, 2)
        produce(broker.bootstrap, 300, seed=1)
        for file in files.values():
            _cli(file, "run")
            _cli(file, "backfill", "--partitions", "0", "--from-offset", "20", "--to-offset", "60")
        produce(broker.bootstrap, 100, seed=2)
        for file in files.values():
            _cli(file, "run")
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        shutil.copytree(work / "lake", out / "lake")
        from offsetlake.config import load_pipeline
        from offsetlake.kafka import topic_ids

        topic_id = topic_ids(load_pipeline(str(files["keyed_upsert"])), [TOPIC])[TOPIC]
        manifest = {"topic": TOPIC, "topic_id": topic_id, "partitions": 2, "records": records(broker.bootstrap)}
        (out / "records.json").write_text(json.dumps(manifest, indent=0))
        rows = {name: DeltaTable(str(work / "lake" / name)).to_pyarrow_dataset().count_rows() for name in SINKS}
        (out / "expected.json").write_text(json.dumps({"sink_rows_with_state": rows, "written_by": _version()}, indent=1, sort_keys=True))
        print(f"wrote {out}: {rows}")
    finally:
        broker.stop()
        shutil.rmtree(work, ignore_errors=True)


def _version() -> str:
    import offsetlake

    root = Path(offsetlake.__file__).resolve().parent.parent
    done = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else root.name.rsplit("-", 1)[-1]


if __name__ == "__main__":
    # Spark in this process, or a server this script starts itself: never the project's own warm
    # server, which commands use by default (offsetlake.spark_server)
    os.environ.setdefault("OFFSETLAKE_SPARK_SERVER", "off")
    main(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT / "tests" / "data" / "lake-keyed-v1")
