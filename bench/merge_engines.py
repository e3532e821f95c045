"""Merge engines against the append sink (issue 38): time per batch, state size, a 1% backfill.

    .venv/bin/python bench/merge_engines.py [--records 2000000] [--keys 10000] [--batch 200000]
                                            [--out bench-merge-engines.json]

Produces ``--records`` orders over 6 partitions whose order_id is drawn (seeded) from ``--keys``
ids, on a private Apache Kafka broker (or $KAFKA_BOOTSTRAP_SERVERS). One warm Spark session then
drains the topic in batches of ``--batch`` into three sinks in turn, one fresh lake each:

append     the plain sink (every record a row);
aggregate  an hourly aggregate keyed by order_id (window on created_at, 1h): revenue (sum),
           orders (count), largest (max), last customer (last_non_null);
first_row  dedup: each order_id's first record;
aggregate_folded, first_row_folded
           the same with ``sink.fold_after: 1s``: every batch folds the contributions of the
           batches before it, so the state stays within the groups plus one batch.

Per sink: the median batch time (the ledger entries' ``duration_ms``, batches 2 to n) and every
batch's time (does it grow with the table?), the table's rows and bytes (visible rows and
state), and then one backfill of 1% of the range over every partition (its first offsets;
with folding its last ones, as the first ones are folded and a backfill there is refused),
timed as a whole, and the same backfill once more (the first in the process pays the JIT of the
Spark code only a backfill runs; a user's backfill attaches to the project's warm Spark server),
then a third time with ``data_path: spark`` (an engine's backfill read on the Spark path until
session 24; its read tasks read it since).
Prints one JSON line per sink and writes every figure to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from offsetlake_bench import produce_order_ids, write_pipeline  # noqa: E402

from offsetlake import state_segments, state_table, storage  # noqa: E402
from offsetlake.backfill import plan_backfill  # noqa: E402
from offsetlake.config import load_pipeline  # noqa: E402
from offsetlake.embedded.local_broker import broker_for  # noqa: E402
from offsetlake.embedded.sample_data import ensure_topic  # noqa: E402
from offsetlake.history import sink_commits  # noqa: E402
from offsetlake.ledger import Ledger  # noqa: E402
from offsetlake.plan import RunContext  # noqa: E402
from offsetlake.runs import execute_recorded_batch, run_pipeline  # noqa: E402
from offsetlake.spark import spark_session, stop_spark  # noqa: E402

TOPIC = "bench_engines"
PARTITIONS = 6
SINKS: dict[str, dict[str, Any]] = {
    "append": {},
    "aggregate": {
        "mode": "aggregate",
        "key": ["order_id"],
        "window": {"on": "created_at", "size": "1h"},
        "measures": {
            "revenue": {"sum": "amount"},
            "orders": {"count": "*"},
            "largest": {"max": "amount"},
            "last_customer": {"last_non_null": "customer"},
        },
    },
    "first_row": {"mode": "first_row", "key": ["order_id"]},
}
SINKS["aggregate_folded"] = {**SINKS["aggregate"], "fold_after": "1s"}
SINKS["first_row_folded"] = {**SINKS["first_row"], "fold_after": "1s"}


def drain(work: Path, bootstrap: str, label: str, batch: int) -> dict[str, Any]:
    """The whole topic into a fresh sink of kind ``label``; its batches' figures and size."""
    sink = SINKS[label]

    def pipeline(**more: Any) -> Any:
        lake = work / f"lake_{label}"
        return load_pipeline(
            str(write_pipeline(work / "p", f"bench_{label}", TOPIC, bootstrap, lake, max_records_per_batch=batch, sink=sink, **more))
        )

    config = pipeline()
    t = time.monotonic()
    run_pipeline(config, RunContext(f"bench-{label}"), spark_session, emit=lambda _: None)
    drained = time.monotonic() - t
    table = storage.table(config.layout.sink)
    entries = [c.entry for c in sink_commits(table, config.name)]
    batch_s = [round((e.duration_ms or 0) / 1000, 2) for e in entries]
    state = state_table.pinned(config, table)  # a keyed sink's state lives beside it (offsetlake.state_table)
    figures = {
        "sink": label,
        "batches": len(entries),
        "drain_s": round(drained, 2),
        "batch_s_median": statistics.median(batch_s[1:]) if len(batch_s) > 1 else batch_s[0],
        "batch_s": batch_s,
        "table_rows": table.to_pyarrow_dataset().count_rows(),  # what a plain reader sees
        "table_bytes": sum(f["size_bytes"] for f in _files(table)),
        "state_rows": state.to_pyarrow_dataset().count_rows() if state is not None else 0,
        "state_bytes": sum(f["size_bytes"] for f in _files(state)) if state is not None else 0,
    }
    segments = state_segments.listed(config.layout.state)  # the batch states kept beside it, for backfills
    figures["segments"], figures["segment_rows"] = len(segments), sum(s.rows for s in segments)
    figures["backfill_1pct_s"], figures["backfill_1pct_records"] = backfill_one_percent(config, last="fold_after" in sink)
    # the same backfill again: the first in a process pays the JIT of the Spark code a backfill
    # runs and no ingest did; a user's backfill attaches to the project's warm Spark server
    figures["backfill_1pct_again_s"], _ = backfill_one_percent(config, last="fold_after" in sink)
    # the same backfill a third time on the Spark path (``data_path: spark``), as every backfill
    # read its range before session 24: the read tasks' gain, side by side on the same lake
    figures["backfill_1pct_spark_path_s"], _ = backfill_one_percent(pipeline(data_path="spark"), last="fold_after" in sink)
    return figures


def _files(table: Any) -> list[dict]:
    import pyarrow as pa

    return pa.table(table.get_add_actions(flatten=True)).to_pylist()


def backfill_one_percent(config: Any, last: bool = False) -> tuple[float, int]:
    """ONE backfill of 1% of the committed records, as a user runs it (``offsetlake backfill
    --from-offset A --to-offset B``): the same offsets in every partition, the first ones
    (``last``: the last ones below the smallest committed end, above every fold horizon; a
    partition whose unfolded records are too few for its share, as when the last batch read
    none of it, is left out and the others take its share), timed as a whole."""
    table = storage.table(config.layout.sink)
    ends = {p: table.transaction_version(config.app_id(TOPIC, p)) or 0 for p in range(PARTITIONS)}
    below = {p: h for (t, _, p), h in state_table.folded_below(state_table.pinned(config, table)).items() if t == TOPIC}
    want = sum(ends.values()) // 100
    partitions = sorted(ends, key=lambda p: ends[p] - below.get(p, 0), reverse=True)
    for n in range(len(partitions), 0, -1):
        chosen, size = partitions[:n], max(1, want // n)
        end = min(ends[p] for p in chosen)
        start, stop = (end - size, end) if last else (0, size)
        if all(below.get(p, 0) <= start for p in chosen):
            break
    t = time.monotonic()
    plan = plan_backfill(config, RunContext("bench-backfill"), sorted(chosen), start, stop)
    Ledger.of(config).record_plan(plan)
    execute_recorded_batch(config, plan.batch_id, spark_session)
    return round(time.monotonic() - t, 2), size * len(chosen)


def main() -> int:
    parser = argparse.ArgumentParser(prog="merge_engines", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=2_000_000, help="orders to produce (default 2,000,000)")
    parser.add_argument("--keys", type=int, default=10_000, help="distinct order ids they are drawn from (default 10,000)")
    parser.add_argument("--batch", type=int, default=200_000, help="max_records_per_batch (default 200,000)")
    parser.add_argument("--only", nargs="*", choices=list(SINKS), help="these sinks only (append is always run: the ratios' base)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench-merge-engines.json", help="where to write every figure as JSON")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    work = Path(tempfile.mkdtemp(prefix="offsetlake-engines-"))
    figures: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    try:
        with broker_for(work / "broker") as (bootstrap, _):
            ensure_topic(bootstrap, TOPIC, PARTITIONS)
            rng = random.Random(38)
            produce_order_ids(bootstrap, TOPIC, [rng.randrange(args.keys) for _ in range(args.records)])
            spark_session()
            chosen = [label for label in SINKS if not args.only or label == "append" or label in args.only]
            for label in chosen:
                figures[label] = drain(work, bootstrap, label, args.batch)
                print(json.dumps(figures[label]), flush=True)
            base = figures["append"]["batch_s_median"]
            figures["ratios"] = {label: round(figures[label]["batch_s_median"] / base, 2) for label in chosen}
            figures["backfill_ratios"] = {
                label: round(figures[label]["backfill_1pct_s"] / figures[label]["batch_s_median"], 2) for label in chosen
            }
            figures["backfill_again_ratios"] = {
                label: round(figures[label]["backfill_1pct_again_s"] / figures[label]["batch_s_median"], 2) for label in chosen
            }
            figures["backfill_spark_path_ratios"] = {
                label: round(figures[label]["backfill_1pct_spark_path_s"] / figures[label]["batch_s_median"], 2) for label in chosen
            }
            said = {"again": figures["backfill_again_ratios"], "on the spark path": figures["backfill_spark_path_ratios"]}
            print(json.dumps({"backfill_ratios": figures["backfill_ratios"], **said}), flush=True)
            print(json.dumps(figures["ratios"]), flush=True)
            stop_spark()
    finally:
        args.out.write_text(json.dumps(figures, indent=1) + "\n")
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    # Spark in this process, or a server this script starts itself: never the project's own warm
    # server, which commands use by default (offsetlake.spark_server)
    os.environ.setdefault("OFFSETLAKE_SPARK_SERVER", "off")
    sys.exit(main())
