"""Stream mode: produce-to-commit latency at a steady rate, and the highest rate it sustains.

    .venv/bin/python bench/stream_latency.py [--rate 1000] [--seconds 60] [--trigger 1s]
                                             [--rates 10000,20000,30000,40000] [--plain] [--out bench-stream.json]

One `offsetlake stream` process (its own Spark session, local[2]) ingests the `orders` pipeline
as shipped (transform + Great Expectations suite; ``--no-suite`` leaves the suite out, ``--plain`` the
transform, suite and partitioning, so every batch takes the direct path) from a 2-partition topic on a private Apache Kafka broker (or
KAFKA_BOOTSTRAP_SERVERS). A producer thread in this process writes orders at a steady rate in
bursts every 100 ms. A record's latency is the Delta commit time of the sink version holding it
(commit timestamp from the table history; the ranges of each version from its commit's ledger entry) minus
its Kafka CreateTime (stamped by the producer when it was produced). Both clocks are this
machine's. Records produced in the first ``--warmup`` seconds are left out.

Then, for each of ``--rates``, the producer runs at that rate for ``--seconds``/2 s and the
report says whether the stream kept up: its lag (LSO minus committed end) at the end of the
window, and the latency percentiles of that window. A stream that keeps up has the same latency
for the records of the window's last 5 s as for its first 5 s; one that falls behind gets slower
with every batch. The highest rate whose last-5-s median latency is at most 1 s above the
first-5-s median (with the producer on schedule) is reported as the sustained maximum. Each window
also lists the median step durations of its micro-batches, from the stream's JSON summaries.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import yaml
from deltalake import DeltaTable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from offsetlake.config import load_pipeline  # noqa: E402
from offsetlake.embedded.local_broker import broker_for  # noqa: E402
from offsetlake.embedded.sample_data import ensure_topic, produce_orders  # noqa: E402
from offsetlake.history import sink_commits  # noqa: E402
from offsetlake.ledger_view import partition_status  # noqa: E402


class SteadyProducer(threading.Thread):
    """``rate`` records/s in bursts every 100 ms until stopped; records the wall time span."""

    def __init__(self, bootstrap: str, topic: str, rate: int, first_id: int) -> None:
        super().__init__(daemon=True)
        self.bootstrap, self.topic, self.rate, self.next_id = bootstrap, topic, rate, first_id
        self.halt = threading.Event()
        self.behind_s = 0.0  # how far the producer itself fell behind its schedule

    def run(self) -> None:
        burst = max(1, self.rate // 10)
        started = time.monotonic()
        sent = 0
        while not self.halt.is_set():
            self.next_id = produce_orders(self.bootstrap, self.topic, burst, first_id=self.next_id)
            sent += burst
            due = started + sent / self.rate
            wait = due - time.monotonic()
            if wait > 0:
                self.halt.wait(wait)
            else:
                self.behind_s = max(self.behind_s, -wait)

    def stop(self) -> int:
        self.halt.set()
        self.join(60)
        return self.next_id


def write_pipeline(folder: Path, bootstrap: str, topic: str, lake: Path, suite: bool, plain: bool = False) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    body = yaml.safe_load((ROOT / "pipelines" / "orders.yaml").read_text().replace("${", "$${"))
    body.update(
        {
            "name": "bench_stream",
            "topic": topic,
            "lake": str(lake),
            "schedule": None,
            "validation": {"on_failure": "fail"},
            "kafka": {"bootstrap_servers": bootstrap, "options": {"client.id": "bench-stream"}},
        }
    )
    body.pop("storage", None)  # the shipped file's object-storage block (escaped above) is for an s3:// lake
    shutil.copy(ROOT / "pipelines" / "orders_transform.py", folder / "orders_transform.py")
    if plain:  # nothing that needs Spark: the batches take the direct path (offsetlake.direct)
        body.pop("transform")
        body.pop("sink")  # its partition column is the transform's
    if suite and not plain:
        shutil.copy(ROOT / "pipelines" / "orders.expectations.yaml", folder / "bench_stream.expectations.yaml")
    path = folder / "bench_stream.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path


def latencies(config, since_ms: int, until_ms: int) -> list[tuple[int, float]]:
    """(CreateTime ms, seconds from it to the commit of the sink version holding the record)."""
    table = DeltaTable(config.sink_path)
    commit_ms = {int(h["version"]): int(h["timestamp"]) for h in table.history()}
    # the sink's own commits say which ranges each version holds (the ledger table may lag)
    spans = [
        (r.partition, r.start, r.end, c.version) for c in sink_commits(table, config.name) if c.kind == "stream" for r in c.entry.ranges
    ]
    rows = table.to_pyarrow_table(columns=["_kafka_partition", "_kafka_offset", "_kafka_timestamp"]).to_pylist()
    out = []
    by_partition: dict[int, list[tuple[int, int, int]]] = {}
    for p, start, end, version in spans:
        by_partition.setdefault(p, []).append((start, end, version))
    for row in rows:
        created = int(row["_kafka_timestamp"].timestamp() * 1000)
        if not since_ms <= created < until_ms:
            continue
        version = next(v for s, e, v in by_partition[row["_kafka_partition"]] if s <= row["_kafka_offset"] < e)
        out.append((created, (commit_ms[version] - created) / 1000))
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def step_medians(log_path: Path, since_ms: int, until_ms: int) -> dict[str, int]:
    """Median duration of each step of the micro-batches committed in the window (stream stdout)."""
    steps: dict[str, list[int]] = {}
    for line in log_path.read_text().splitlines():
        if not line.startswith('{"pipeline"'):
            continue
        summary = json.loads(line)
        batch_ms = int(datetime.strptime(summary["batch_id"].rsplit("-", 2)[-2], "%Y%m%dT%H%M%S").replace(tzinfo=UTC).timestamp() * 1000)
        if since_ms <= batch_ms < until_ms:
            for step, ms in summary["timings_ms"].items():
                steps.setdefault(step, []).append(ms)
    return {step: int(statistics.median(ms)) for step, ms in steps.items()} | {"batches": len(next(iter(steps.values()), []))}


def window(config, producer_rate: int, seconds: float, bootstrap: str, topic: str, first_id: int, log_path: Path) -> tuple[dict, int]:
    producer = SteadyProducer(bootstrap, topic, producer_rate, first_id)
    since = int(time.time() * 1000)
    producer.start()
    time.sleep(seconds)
    next_id = producer.stop()
    until = int(time.time() * 1000)
    lag_at_end = sum(r["lag"] for r in partition_status(config))
    deadline = time.monotonic() + 120
    while sum(r["lag"] for r in partition_status(config)) > 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    timed = latencies(config, since, until)
    values = [latency for _, latency in timed]
    first = [latency for created, latency in timed if created < since + 5000]
    last = [latency for created, latency in timed if created >= until - 5000]
    figures = {
        "rate_per_s": producer_rate,
        "seconds": seconds,
        "records": len(values),
        "producer_behind_s": round(producer.behind_s, 2),
        "lag_at_end": lag_at_end,
        "p50_s": round(statistics.median(values), 3) if values else None,
        "p99_s": round(percentile(values, 0.99), 3) if values else None,
        "max_s": round(max(values), 3) if values else None,
        # a stream that keeps up has the same latency at the end of the window as at its start
        "p50_first_5s": round(statistics.median(first), 3) if first else None,
        "p50_last_5s": round(statistics.median(last), 3) if last else None,
        "batch_steps_ms": step_medians(log_path, since, until),
    }
    print(json.dumps(figures), flush=True)
    return figures, next_id


def main() -> int:
    parser = argparse.ArgumentParser(prog="stream_latency", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=int, default=1000, help="steady records/s for the latency figures (default 1000)")
    parser.add_argument("--seconds", type=float, default=60, help="length of the steady window (default 60)")
    parser.add_argument(
        "--warmup", type=float, default=30, help="seconds produced before the windows (then until caught up), left out (default 30)"
    )
    parser.add_argument("--trigger", default="1s", help="the stream's --trigger-interval (default 1s)")
    parser.add_argument(
        "--rates",
        default="10000,20000,30000,40000",
        help="comma-separated rates tried for the sustained maximum (default 10000,20000,30000,40000: issue 20's target is 40,000/s)",
    )
    parser.add_argument("--no-suite", action="store_true", help="leave out the Great Expectations suite")
    parser.add_argument(
        "--plain", action="store_true", help="the orders without transform, suite or partitioning: every batch takes the direct path"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench-stream.json", help="where to write the figures")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="offsetlake-stream-bench-"))
    results: dict = {"trigger": args.trigger, "suite": not (args.no_suite or args.plain), "plain": args.plain, "windows": []}
    try:
        with broker_for(work / "broker") as (bootstrap, _broker):
            topic = "bench_stream_orders"
            ensure_topic(bootstrap, topic, 2)
            config = load_pipeline(
                str(write_pipeline(work / "pipelines", bootstrap, topic, work / "lake", suite=not args.no_suite, plain=args.plain))
            )
            log = open(work / "stream.log", "w")
            stream = subprocess.Popen(
                [sys.executable, "-m", "offsetlake", "stream", "--trigger-interval", args.trigger, str(config.source_file)],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env=os.environ.copy(),
            )
            try:
                warm = SteadyProducer(bootstrap, topic, args.rate, 0)
                warm.start()
                time.sleep(args.warmup)  # Spark starts and the first (cold) micro-batches run
                deadline = time.monotonic() + 120
                while sum(r["lag"] for r in partition_status(config)) > 2 * args.rate and time.monotonic() < deadline:
                    time.sleep(0.5)
                next_id = warm.stop()
                log_path = work / "stream.log"
                steady, next_id = window(config, args.rate, args.seconds, bootstrap, topic, next_id, log_path)
                results["steady"] = steady
                for rate in (int(r) for r in args.rates.split(",") if r):
                    figures, next_id = window(config, rate, args.seconds / 2, bootstrap, topic, next_id, log_path)
                    results["windows"].append(figures)
            finally:
                os.kill(stream.pid, signal.SIGTERM)
                stream.wait(120)
                log.close()
            # kept up: the latency at the end of the window is at most 1 s worse than at its start,
            # and the producer itself met the rate (else the window says nothing)
            kept = [
                w
                for w in results["windows"]
                if w["p50_last_5s"] is not None and w["producer_behind_s"] < 1 and w["p50_last_5s"] <= w["p50_first_5s"] + 1
            ]
            results["sustained_max_rate_per_s"] = max((w["rate_per_s"] for w in kept), default=None)
            results["stream_exit_code"] = stream.returncode
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(
        json.dumps(
            {
                "summary": {
                    "p50_s": results["steady"]["p50_s"],
                    "p99_s": results["steady"]["p99_s"],
                    "sustained_max_rate_per_s": results["sustained_max_rate_per_s"],
                }
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    # Spark in this process, or a server this script starts itself: never the project's own warm
    # server, which commands use by default (offsetlake.spark_server)
    os.environ.setdefault("OFFSETLAKE_SPARK_SERVER", "off")
    sys.exit(main())
