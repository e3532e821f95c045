"""The read tasks' JSON parse of one chunk (``json_records.parse_json_values``), clean and with bad
records mixed in: how long a chunk takes and how many of its good records the task settles itself
(the rest go to Spark's ``from_json``). No broker, no Spark: the function alone, in one process.

    .venv/bin/python bench/json_chunk_parse.py [--records 10000] [--runs 7]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import pyarrow as pa

from offsetlake.formats.json_records import parse_json_values

# the decoder's struct: the record's fields, then the column that holds a value Spark could not parse
STRUCT = pa.struct([("order_id", pa.int64()), ("customer", pa.string()), ("amount", pa.float64()), ("_corrupt_record", pa.string())])


def values(n: int, bad: float, seed: int = 7) -> tuple[list[bytes | None], int]:
    """``n`` values, a fraction ``bad`` of them cut short or tombstones (half each); how many are good."""
    rng = random.Random(seed)
    out: list[bytes | None] = []
    good = 0
    for i in range(n):
        text = json.dumps({"order_id": i, "customer": f"c{rng.randrange(9)}", "amount": round(rng.uniform(1, 500), 2)}).encode()
        roll = rng.random()
        if roll < bad / 2:
            out.append(text[: len(text) // 2])  # cut short
        elif roll < bad:
            out.append(None)  # a tombstone
        else:
            out.append(text)
            good += 1
    return out, good


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    print(f"| chunk of {args.records:,} | min | median | good records settled in the task |")
    print("| --- | ---: | ---: | ---: |")
    for bad in (0.0, 0.01, 0.07):
        chunk, good = values(args.records, bad)
        times = []
        for _ in range(args.runs):
            t = time.perf_counter()
            parsed = parse_json_values(chunk, STRUCT)
            times.append(time.perf_counter() - t)
        settled = len(parsed) - parsed.null_count
        print(f"| {bad:.0%} bad | {min(times) * 1e3:.1f} ms | {statistics.median(times) * 1e3:.1f} ms | {settled:,} of {good:,} |")


if __name__ == "__main__":
    main()
