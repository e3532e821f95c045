"""The first delta-spark read of a small table, with Delta's default snapshot tasks and with offsetlake's.

    .venv/bin/python bench/delta_snapshot_tasks.py [--tables 8] [--commits 20] [--out bench-delta-snapshot.json]

delta-spark rebuilds a table's snapshot (its log replayed into the set of live files) in
``spark.databricks.delta.snapshotPartitions`` tasks each time it first reads the table or a new
version of it. Delta's default is 50; offsetlake's sessions (``offsetlake.spark.classic_builder``)
use ``$OFFSETLAKE_SHUFFLE_PARTITIONS`` (4). This writes ``--tables`` small tables of ``--commits``
commits each with delta-rs, as offsetlake's sinks are written, then reads each table once in one
warm local[2] session, alternating the two settings table by table (a table is read only once, so
every read is a first read), and prints the medians side by side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import pyarrow as pa
from deltalake import write_deltalake

from offsetlake.spark import spark_session

SETTINGS = {"delta default (50)": "50", "offsetlake (4)": "4"}


def _table(path: Path, commits: int) -> None:
    for i in range(commits):
        rows = pa.table({"id": pa.array(range(i * 20, i * 20 + 20), pa.int64()), "v": pa.array([f"r{i}"] * 20)})
        write_deltalake(str(path), rows, mode="append")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=int, default=8, help="tables per setting (each read once)")
    parser.add_argument("--commits", type=int, default=20, help="commits per table")
    parser.add_argument("--out", default="bench-delta-snapshot.json")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="offsetlake-bench-snapshot-"))
    spark = spark_session("local[2]", app_name="bench-delta-snapshot")
    warm = work / "warm"
    _table(warm, 3)
    spark.read.format("delta").load(str(warm)).collect()  # the JVM warmed on a table not measured
    seconds: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for i in range(args.tables):
        for name, tasks in SETTINGS.items():
            path = work / f"{tasks}-{i}"
            _table(path, args.commits)
            spark.conf.set("spark.databricks.delta.snapshotPartitions", tasks)
            t = time.perf_counter()
            rows = spark.read.format("delta").load(str(path)).collect()
            seconds[name].append(time.perf_counter() - t)
            assert len(rows) == args.commits * 20
    result = {
        "tables_per_setting": args.tables,
        "commits_per_table": args.commits,
        "seconds": seconds,
        "median_s": {name: statistics.median(s) for name, s in seconds.items()},
    }
    medians = result["median_s"]
    result["ratio_default_over_offsetlake"] = medians["delta default (50)"] / medians["offsetlake (4)"]
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"| first read of a table of {args.commits} commits | median | min | max |")
    print("| --- | --- | --- | --- |")
    for name, s in seconds.items():
        print(f"| {name} | {statistics.median(s):.2f} s | {min(s):.2f} s | {max(s):.2f} s |")
    print(f"ratio {result['ratio_default_over_offsetlake']:.2f}x")


if __name__ == "__main__":
    main()
