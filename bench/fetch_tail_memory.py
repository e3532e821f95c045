"""Why peak RSS grows with the backlog on noida-db: a read task's memory follows the partition's
tail, not the range it reads.

Reads the same 75,000-record range ``[0, 75000)`` with offsetlake's reader from a partition that
holds exactly 75,000 records and from one that holds 300,000, in a fresh process each, and prints
each process's peak RSS. A broker that honours ``fetch.max.bytes`` / ``max.partition.fetch.bytes``
(offsetlake's reader asks for 16 MiB / 4 MiB) answers both with the same bounded fetches; noida-db
answers a fetch with everything after the fetch offset, so the second read buffers the whole tail.

    .venv/bin/python bench/fetch_tail_memory.py
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RANGE = 75_000


def read_once(bootstrap: str, topic: str) -> None:
    from offsetlake.kafka import read_range

    records = sum(len(chunk) for chunk in read_range({"bootstrap.servers": bootstrap}, "bench", topic, 0, 0, RANGE, 60))
    assert records == RANGE, records
    print(json.dumps({"topic": topic, "records": records, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10}))


def main() -> int:
    if len(sys.argv) == 3:
        read_once(sys.argv[1], sys.argv[2])
        return 0
    from offsetlake.embedded.local_broker import broker_for
    from offsetlake.embedded.sample_data import ensure_topic, produce_orders

    with tempfile.TemporaryDirectory(prefix="offsetlake-fetch-tail-") as work, broker_for(Path(work) / "broker") as (bootstrap, _):
        for topic, size in (("tail_75k", RANGE), ("tail_300k", 4 * RANGE)):
            ensure_topic(bootstrap, topic, 1)
            produce_orders(bootstrap, topic, size)
        for _ in range(3):
            for topic in ("tail_75k", "tail_300k"):
                subprocess.run([sys.executable, __file__, bootstrap, topic], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
