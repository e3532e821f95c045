"""Two checkouts side by side: 1,000 new records through `offsetlake run` by default.

    .venv/bin/python bench/paired_small_runs.py BEFORE_CHECKOUT AFTER_CHECKOUT [--pairs 7] [--partitions 6]

Each checkout runs with its own project home (so its own warm Spark server, started by its first
run and stopped at the end), lake and pipeline; both read the same 1,000 new records of one
private Apache Kafka broker per pair, and which goes first alternates. Prints each run's time and
step durations, then the medians and the ratio after / before. A checkout needs its `.jars`
(a link to this one's will do) and the same venv.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from offsetlake_bench import PY, write_pipeline  # noqa: E402

from offsetlake import spark_server  # noqa: E402
from offsetlake.embedded.local_broker import broker_for  # noqa: E402
from offsetlake.embedded.sample_data import ensure_topic, produce_orders  # noqa: E402

DEFAULT = {"OFFSETLAKE_SPARK_SERVER": "auto", "OFFSETLAKE_SPARK_SERVER_IDLE": "30m"}


def run(checkout: Path, pipeline: Path) -> tuple[float, dict[str, int]]:
    started = time.monotonic()
    done = subprocess.run(
        [PY, "-m", "offsetlake", "run", str(pipeline)],
        capture_output=True,
        text=True,
        env={**os.environ, **DEFAULT, "OFFSETLAKE_HOME": str(checkout)},
        cwd=checkout,
    )
    if done.returncode != 0:
        raise RuntimeError(f"offsetlake run in {checkout} failed:\n{done.stderr[-3000:]}")
    steps = {m.group(1): int(m.group(2)) for m in re.finditer(r"step=(\w+).*?duration_ms=(\d+)", done.stderr)}
    return time.monotonic() - started, steps


def main() -> int:
    parser = argparse.ArgumentParser(prog="paired_small_runs", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--partitions", type=int, default=6)
    args = parser.parse_args()
    checkouts = {"before": args.before.resolve(), "after": args.after.resolve()}
    work = Path(tempfile.mkdtemp(prefix="paired-small-runs-"))
    times: dict[str, list[float]] = {k: [] for k in checkouts}
    reads: dict[str, list[int]] = {k: [] for k in checkouts}
    try:
        with broker_for(work / "broker") as (bootstrap, _):
            topic = "paired_small_runs"
            ensure_topic(bootstrap, topic, args.partitions)
            next_id = produce_orders(bootstrap, topic, 1_000)
            pipelines = {k: write_pipeline(work / f"p_{k}", f"paired_{k}", topic, bootstrap, work / f"lake_{k}") for k in checkouts}
            for k in checkouts:  # starts each side's server: not a run's cost
                run(checkouts[k], pipelines[k])
            for i in range(args.pairs):
                next_id = produce_orders(bootstrap, topic, 1_000, first_id=next_id)
                for k in list(checkouts) if i % 2 == 0 else list(reversed(checkouts)):
                    seconds, steps = run(checkouts[k], pipelines[k])
                    times[k].append(round(seconds, 2))
                    reads[k].append(steps.get("read", -1))
                    print(k, i, round(seconds, 2), json.dumps(steps), flush=True)
    finally:
        for checkout in checkouts.values():
            spark_server.stop(checkout)
    medians = {k: {"run_s": statistics.median(v), "read_ms": statistics.median(reads[k]), "samples_s": v} for k, v in times.items()}
    print(json.dumps(medians))
    print("after / before", round(medians["after"]["run_s"] / medians["before"]["run_s"], 3))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OFFSETLAKE_SPARK_SERVER", "off")  # this process starts no Spark of its own
    sys.exit(main())
