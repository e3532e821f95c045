"""Orders with keys, nulls and tombstones on a real topic, what they decode to, and how a keyed
sink's rows are compared with an oracle: shared by the merge-engine tests and the readers test."""

from __future__ import annotations

import json
import math
import random
from datetime import UTC, datetime

from confluent_kafka import Producer
from kafka_truth import read_records

from offsetlake.backfill import plan_backfill
from offsetlake.coordinates import OFFSET, PARTITION, TIMESTAMP, TOPIC
from offsetlake.formats import CHANGE, DELETE
from offsetlake.ledger import Ledger
from offsetlake.plan import RunContext
from offsetlake.runs import execute_recorded_batch


def produce(bootstrap: str, topic: str, n: int, seed: int, keys: int = 40, nulls: float = 0.0, deletes: float = 0.0) -> None:
    """``n`` orders over ``keys`` ids, each id in one partition (keyed), event times spread over
    six hours and out of order, some fields null (``nulls``), some tombstones (``deletes``)."""
    rng = random.Random(seed)
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    for _ in range(n):
        order_id = rng.randrange(keys)
        if rng.random() < deletes:
            producer.produce(topic, key=str(order_id).encode(), value=None)
            continue
        value = {
            "order_id": order_id,
            "customer": None if rng.random() < nulls else f"c{rng.randrange(9)}",
            "amount": None if rng.random() < nulls else round(rng.uniform(1, 100), 2),
            "currency": rng.choice(["EUR", "USD", "GBP"]),
            "created_at": f"2026-11-01T{rng.randrange(6):02d}:{rng.randrange(60):02d}:00Z",
        }
        producer.produce(topic, key=str(order_id).encode(), value=json.dumps(value).encode())
    assert producer.flush(30) == 0


def committed_rows(pipeline) -> list[dict]:
    """Every record the topic holds, decoded as the pipeline's JSON format does, with its coordinates."""
    rows = []
    for r in read_records(pipeline.bootstrap, pipeline.topic):
        at = datetime.fromtimestamp(r.timestamp_ms / 1000, UTC)
        row = {TOPIC: pipeline.topic, PARTITION: r.partition, OFFSET: r.offset, TIMESTAMP: at}
        if r.value is None:
            rows.append({**row, "_kafka_key": r.key.decode(), CHANGE: DELETE})
            continue
        value = json.loads(r.value)
        value["created_at"] = datetime.fromisoformat(value["created_at"].replace("Z", "+00:00"))
        rows.append({**row, "_kafka_key": r.key.decode(), **value})
    return rows


def same(expected: dict, actual: dict, columns: list[str]) -> None:
    assert set(actual) == set(expected), f"groups differ: {sorted(set(actual) ^ set(expected), key=str)[:6]}"
    for group, row in expected.items():
        for column in columns:
            want, got = row.get(column), actual[group].get(column)
            if isinstance(want, float) and isinstance(got, float):
                assert math.isclose(want, got, rel_tol=1e-9), (group, column, want, got)
            else:
                assert want == got, (group, column, want, got)


def backfill(config, spark, start: int, end: int) -> None:
    """What ``offsetlake backfill --from-offset --to-offset`` does, in this process."""
    plan = plan_backfill(config, RunContext(f"backfill-{start}-{end}"), from_offset=start, to_offset=end)
    Ledger.of(config).record_plan(plan)
    execute_recorded_batch(config, plan.batch_id, lambda: spark)
