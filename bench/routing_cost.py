"""What routes cost: one topic into one table, against the same topic routed by a column into three
tables (EUR, USD, and every other currency: ``unmapped: other``), every record a row of one table.

    .venv/bin/python bench/routing_cost.py [--records 500000] [--repeats 3]

Produces ``--records`` orders once (2 partitions, a private Apache Kafka broker unless
KAFKA_BOOTSTRAP_SERVERS is set; currencies EUR, USD, GBP, INR in equal shares), then per repeat,
into fresh lakes, alternating which goes first: the plain pipeline (no transform, no suite: the
direct path), and the routed file's three tables run one after the other (each reads every
record; the read tasks route a text column's rows, the direct path too). One warm Spark session (local[2]) serves
every run, after a small warm-up. Prints one JSON line per run and a summary with medians: seconds
for one table, for each routed table and for all three, and the ratio of all three to one table.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from offsetlake import storage  # noqa: E402
from offsetlake.config import load_pipeline  # noqa: E402
from offsetlake.embedded.local_broker import broker_for  # noqa: E402
from offsetlake.embedded.sample_data import ensure_topic, produce_orders  # noqa: E402
from offsetlake.history import sink_commits  # noqa: E402
from offsetlake.plan import RunContext  # noqa: E402
from offsetlake.runs import run_pipeline  # noqa: E402
from offsetlake.spark import spark_session, stop_spark  # noqa: E402

SCHEMA = {"order_id": "long", "customer": "string", "amount": "double", "currency": "string", "created_at": "timestamp"}
ROUTES = {"by": "currency", "tables": {"eur": ["EUR"], "usd": ["USD"]}, "unmapped": "other"}
TABLES = ("eur", "usd", "other")


def write_pipeline(folder: Path, name: str, topic: str, bootstrap: str, lake: Path, records: int, routed: bool) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    body = {
        "name": name,
        "topic": topic,
        "kafka": {"bootstrap_servers": bootstrap, "options": {"client.id": "bench"}},
        "lake": str(lake),
        "max_records_per_batch": records,
        "read_timeout_seconds": 600,
        "format": {"type": "json", "schema": SCHEMA, "required": ["order_id"]},
        **({"routes": ROUTES} if routed else {}),
    }
    (folder / f"{name}.yaml").write_text(yaml.safe_dump(body, sort_keys=False))


def timed(name: str, folder: Path) -> float:
    config = load_pipeline(name, folder)
    started = time.monotonic()
    results = run_pipeline(config, RunContext(f"bench-{name}"), spark_session, emit=lambda _: None)
    seconds = time.monotonic() - started
    rows = sum(sum(c.get("rows_written", 0) for c in r.per_range.values()) for r in results)
    paths = sorted({c.entry.data_path or "none" for c in sink_commits(storage.table(config.layout.sink), config.name)})
    print(json.dumps({"pipeline": name, "seconds": round(seconds, 2), "batches": len(results), "rows": rows, "paths": paths}), flush=True)
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=500_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    work = Path(tempfile.mkdtemp(prefix="offsetlake-routing-bench-"))
    with broker_for(work / "broker") as (bootstrap, _):
        topic = f"routing_bench_{os.getpid()}"
        ensure_topic(bootstrap, topic, 2)
        produce_orders(bootstrap, topic, args.records)
        folder = work / "pipelines"
        write_pipeline(folder, "warmup", topic, bootstrap, work / "lake_warmup", 20_000, routed=True)
        run_pipeline(load_pipeline("warmup_eur", folder), RunContext("warmup"), spark_session, max_batches=1, emit=lambda _: None)
        one: list[float] = []
        routed: dict[str, list[float]] = {t: [] for t in TABLES}
        for repeat in range(args.repeats):
            lake = work / f"lake_{repeat}"
            write_pipeline(folder, f"plain_{repeat}", topic, bootstrap, lake, args.records, routed=False)
            write_pipeline(folder, f"routed_{repeat}", topic, bootstrap, lake, args.records, routed=True)
            order = ["plain", "routed"] if repeat % 2 == 0 else ["routed", "plain"]
            for which in order:
                if which == "plain":
                    one.append(timed(f"plain_{repeat}", folder))
                else:
                    for table in TABLES:
                        routed[table].append(timed(f"routed_{repeat}_{table}", folder))
        stop_spark()
    every = [sum(times) for times in zip(*routed.values(), strict=True)]
    summary = {
        "records": args.records,
        "repeats": args.repeats,
        "one_table_s": round(statistics.median(one), 2),
        **{f"routed_{t}_s": round(statistics.median(routed[t]), 2) for t in TABLES},
        "routed_all_s": round(statistics.median(every), 2),
        "all_over_one": round(statistics.median(every) / statistics.median(one), 2),
        "samples": {"one": [round(x, 2) for x in one], "all": [round(x, 2) for x in every]},
    }
    print(json.dumps({"summary": summary}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
