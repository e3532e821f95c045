"""Write the lake the upgrade test opens: a pipeline's sink, ledger and dead letters as a given
offsetlake version wrote them, plus the exact Kafka records they came from.

Run once with the code whose lake you want to freeze, from an export of one commit (a checkout
that changes while it runs mixes two versions in Spark's tasks). Issue 36 froze main ``3e10e68``,
the last version that wrote ledger entries with only the ``offsetlake: 1`` marker:

    git -C <main> archive 3e10e68 | tar -x -C /tmp/main-3e10e68
    PYTHONPATH=/tmp/main-3e10e68 .venv/bin/python scripts/make_upgrade_lake.py tests/data/lake-v1

It starts the embedded broker in a temp folder, creates topic ``upgrade_orders`` (2 partitions),
and runs the pipeline ``upgrade`` through ingest batches (with dead letters), an offset backfill,
a rewind (that undoes it), another backfill, a gap (records deleted under the ``skip`` policy),
more ingest batches, and a last batch whose run is killed right after its sink commit (its dead
letters staged but not applied, its ledger row still ``planned``: what a crash leaves). It writes
``<out>/lake`` (the sink, ledger and dead-letter tables; Delta stores file paths relative to each
table, so the folder works from anywhere), ``<out>/records.json`` (every record with partition,
offset, timestamp, key and value, and each partition's log start) and ``<out>/expected.json``
(what the test checks). The test re-produces the records into a fresh topic, so offsets and
timestamps are the same, and continues the pipeline with the code under test.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

TOPIC = "upgrade_orders"
PIPELINE = "upgrade"


def pipeline_body(bootstrap: str, lake: str) -> dict:
    """The pipeline definition the lake was written with (the test writes the same one)."""
    return {
        "name": PIPELINE,
        "topic": TOPIC,
        "kafka": {"bootstrap_servers": bootstrap},
        "lake": lake,
        "start": "earliest",
        "max_records_per_batch": 150,
        "read_timeout_seconds": 30,
        "on_offsets_lost": "skip",
        "format": {
            "type": "json",
            "schema": {"order_id": "long", "customer": "string", "amount": "double", "currency": "string", "created_at": "timestamp"},
            "required": ["order_id"],
        },
    }


def _cli(file: Path, *args: str, env: dict[str, str] | None = None, dies: bool = False) -> str:
    command, *rest = args
    done = subprocess.run(
        [sys.executable, "-m", "offsetlake", command, *rest, str(file)],
        capture_output=True,
        text=True,
        cwd=_code_root(),
        timeout=600,
        env={**os.environ, **(env or {})},
    )
    if dies:
        if done.returncode != -9:
            raise SystemExit(f"offsetlake {' '.join(args)} was to die at its failpoint: {done.returncode}\n{done.stderr}")
        return done.stdout
    if done.returncode != 0:
        raise SystemExit(f"offsetlake {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def topic_records(bootstrap: str) -> dict[tuple[int, int], dict]:
    """Every record the topic holds now (from each partition's log start up to its end)."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
    from kafka_truth import last_stable_offsets

    ends = last_stable_offsets(bootstrap, TOPIC)
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": "make-upgrade-lake",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "auto.offset.reset": "earliest",
        }
    )
    consumer.assign([TopicPartition(TOPIC, p, OFFSET_BEGINNING) for p in ends])
    out: dict[tuple[int, int], dict] = {}
    done = {p for p, end in ends.items() if end == 0}
    while len(done) < len(ends):
        for m in consumer.consume(500, 1.0):
            if m.error() or m.offset() >= ends[m.partition()]:
                continue
            out[(m.partition(), m.offset())] = {
                "partition": m.partition(),
                "offset": m.offset(),
                "timestamp_ms": m.timestamp()[1],
                "key": base64.b64encode(m.key()).decode() if m.key() is not None else None,
                "value": base64.b64encode(m.value()).decode() if m.value() is not None else None,
            }
            if m.offset() + 1 >= ends[m.partition()]:
                done.add(m.partition())
    consumer.close()
    return out


def main(out: Path) -> None:
    from confluent_kafka import TopicPartition
    from confluent_kafka.admin import AdminClient

    from offsetlake.config import load_pipeline
    from offsetlake.embedded.local_broker import LocalBroker
    from offsetlake.embedded.sample_data import ensure_topic, produce_orders
    from offsetlake.ledger import Ledger

    work = Path(tempfile.mkdtemp(prefix="upgrade-lake-"))
    broker = LocalBroker(work / "broker", log_path=work / "broker.log").start()
    try:
        file = work / f"{PIPELINE}.yaml"
        file.write_text(yaml.safe_dump(pipeline_body(broker.bootstrap, str(work / "lake")), sort_keys=False))
        ensure_topic(broker.bootstrap, TOPIC, 2)
        for p in (0, 1):  # every 97th value is truncated JSON: a dead letter
            produce_orders(broker.bootstrap, TOPIC, 300, first_id=p * 10_000, partition=p, malformed_every=97)
        _cli(file, "run")  # ingest batches of at most 150 records
        _cli(file, "backfill", "--partitions", "0", "--from-offset", "50", "--to-offset", "120")
        for p in (0, 1):
            produce_orders(broker.bootstrap, TOPIC, 100, first_id=p * 10_000 + 300, partition=p, malformed_every=97)
        config = load_pipeline(str(file))
        before = {r["batch_id"] for r in Ledger.of(config).batches() if r["status"] == "committed"}
        _cli(file, "run")
        batches = Ledger.of(config).batches()
        newest = [r for r in batches if r["status"] == "committed" and r["batch_id"] not in before]
        target = max((r for r in batches if r["batch_id"] in before and r["kind"] == "ingest"), key=lambda r: r["sink_version"])
        assert newest, "the second run committed nothing"
        _cli(file, "rewind", "--to-batch", target["batch_id"], "--reason", "upgrade test data: a rewind")
        _cli(file, "backfill", "--partitions", "1", "--from-offset", "10", "--to-offset", "60")  # one that stays
        records = topic_records(broker.bootstrap)  # before the delete below takes some
        for p in (0, 1):
            produce_orders(broker.bootstrap, TOPIC, 60, first_id=p * 10_000 + 400, partition=p)
        records.update(topic_records(broker.bootstrap))
        admin = AdminClient({"bootstrap.servers": broker.bootstrap})
        deleted = {1: 450}  # past partition 1's committed end: the next run records a gap
        for f in admin.delete_records([TopicPartition(TOPIC, p, o) for p, o in deleted.items()]).values():
            f.result(30)
        _cli(file, "run")
        for p in (0, 1):  # a last batch whose run dies right after its sink commit (SIGKILL): its dead
            # letters are staged and named in its entry but not applied, and its ledger row says planned
            produce_orders(broker.bootstrap, TOPIC, 30, first_id=p * 10_000 + 500, partition=p, malformed_every=7)
        records.update(topic_records(broker.bootstrap))
        _cli(file, "run", env={"OFFSETLAKE_FAILPOINT": "after_commit"}, dies=True)
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        shutil.copytree(work / "lake", out / "lake")  # before anything reads it: status repairs what it finds
        ledger = Ledger.of(config).batches()
        status = json.loads(_cli(file, "status", "--json"))
        (out / "records.json").write_text(
            json.dumps(
                {
                    "topic": TOPIC,
                    "partitions": 2,
                    "log_start": {str(p): o for p, o in deleted.items()},
                    "records": [records[k] for k in sorted(records)],
                },
                indent=0,
            )
        )
        kinds: dict[str, int] = {}
        for r in {(r["batch_id"], r["kind"], r["status"]) for r in ledger}:
            kinds[f"{r[1]}/{r[2]}"] = kinds.get(f"{r[1]}/{r[2]}", 0) + 1
        (out / "expected.json").write_text(
            json.dumps(
                {
                    "pipeline": PIPELINE,
                    "topic": TOPIC,
                    "committed_ends": {str(p["partition"]): p["committed_end"] for p in status["partitions"]},
                    "batches_by_kind_and_status": dict(sorted(kinds.items())),
                    "sink_rows": _row_count(config.sink_path),
                    "written_by": _version(),
                },
                indent=1,
                sort_keys=True,
            )
        )
        print(f"wrote {out}: {json.dumps(kinds, sort_keys=True)}")
    finally:
        broker.stop()
        shutil.rmtree(work, ignore_errors=True)


def _row_count(path: str) -> int:
    from deltalake import DeltaTable

    return int(DeltaTable(path).to_pyarrow_dataset().count_rows())


def _code_root() -> Path:
    """The checkout whose ``offsetlake`` this script imported (``-m`` runs from there too)."""
    import offsetlake

    return Path(offsetlake.__file__).resolve().parent.parent


def _version() -> str:
    """The commit the code was exported from (``/tmp/main-<commit>``), or the checkout's HEAD."""
    root = _code_root()
    done = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else root.name.rsplit("-", 1)[-1]


if __name__ == "__main__":
    # Spark in this process, or a server this script starts itself: never the project's own warm
    # server, which commands use by default (offsetlake.spark_server)
    os.environ.setdefault("OFFSETLAKE_SPARK_SERVER", "off")
    main(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT / "tests" / "data" / "lake-v1")
