"""Generated `orders` events for the demo, the tests and the benchmarks.

Produces JSON orders (keyed by customer), optionally some malformed values and one aborted and
one committed transaction, so every path of a batch is exercised on the embedded default.
"""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime, timedelta
from typing import Any

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewPartitions, NewTopic

CURRENCIES = ("EUR", "USD", "GBP", "INR")


def ensure_topic(
    bootstrap: str, topic: str, partitions: int, extra: dict[str, str] | None = None, config: dict[str, str] | None = None
) -> None:
    """Create ``topic`` with ``partitions`` (and the topic ``config``), or add partitions up to
    that many; ``extra`` is admin-client config."""
    admin = AdminClient({"bootstrap.servers": bootstrap, **(extra or {})})
    existing = admin.list_topics(timeout=15).topics
    if topic in existing:
        have = len(existing[topic].partitions)
        if have < partitions:
            admin.create_partitions([NewPartitions(topic, partitions)])[topic].result(15)
        return
    admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1, config=config or {})])[topic].result(15)


def order_event(order_id: int, rng: random.Random, base: datetime, customer: bool = True) -> bytes:
    created = base + timedelta(seconds=order_id % 86_400 * 3)
    name = f"c{rng.randrange(5000):05d}"
    return json.dumps(
        {
            "order_id": order_id,
            "customer": name if customer else None,
            "amount": round(rng.uniform(1, 500), 2),
            "currency": rng.choice(CURRENCIES),
            "created_at": created.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "note": "x" * rng.randrange(40, 80),
        }
    ).encode()


def produce_orders(
    bootstrap: str,
    topic: str,
    count: int,
    first_id: int = 0,
    malformed_every: int = 0,
    partition: int | None = None,
    seed: int = 7,
    extra: dict[str, str] | None = None,
    null_customer_every: int = 0,
) -> int:
    """Produce ``count`` records; returns the next order id.

    Every ``malformed_every``-th value (i % n == n - 1) is truncated JSON, and every
    ``null_customer_every``-th order (i % n == 0) has ``"customer": null``, which parses but
    fails a not-null expectation.
    """
    rng = random.Random(seed + first_id)
    base = datetime(2026, 11, 1, tzinfo=UTC)
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "batch.num.messages": 10_000, **(extra or {})})
    for i in range(count):
        order_id = first_id + i
        malformed = malformed_every and i % malformed_every == malformed_every - 1
        no_customer = bool(null_customer_every) and i % null_customer_every == 0
        value = (
            b'{"order_id": ' + str(order_id).encode() + b', "broken'
            if malformed
            else order_event(order_id, rng, base, customer=not no_customer)
        )
        key = f"c{order_id % 997}".encode()
        kwargs: dict[str, Any] = {"partition": partition} if partition is not None else {}
        while True:
            try:
                producer.produce(topic, value=value, key=key, headers=[("source", b"sample")], **kwargs)
                break
            except BufferError:
                producer.poll(0.2)
        if i % 20_000 == 0:
            producer.poll(0)
    remaining = producer.flush(60)
    if remaining:
        raise RuntimeError(f"{remaining} records to {topic} were not acknowledged")
    return first_id + count


def produce_transaction(
    bootstrap: str, topic: str, count: int, first_id: int, commit: bool, transactional_id: str, partition: int | None = None
) -> int:
    """Produce ``count`` orders in one transaction, committed or aborted."""
    rng = random.Random(first_id)
    base = datetime(2026, 11, 1, tzinfo=UTC)
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": transactional_id})
    producer.init_transactions(30)
    producer.begin_transaction()
    for i in range(count):
        kwargs: dict[str, Any] = {"partition": partition} if partition is not None else {}
        producer.produce(topic, value=order_event(first_id + i, rng, base), key=f"c{(first_id + i) % 997}".encode(), **kwargs)
    producer.flush(30)
    if commit:
        producer.commit_transaction(30)
    else:
        producer.abort_transaction(30)
    return first_id + count


def produce_customer_changes(
    bootstrap: str, topic: str, customers: int = 2000, changes: int = 8000, seed: int = 11
) -> tuple[dict[int, dict], set[int]]:
    """Change events of a ``customers`` table (id, name, tier) as Debezium's Postgres connector
    writes them with the JsonConverter: a snapshot (``op`` r) of ``customers`` rows, then
    ``changes`` creates, updates and deletes, each delete followed by a tombstone; keyed by
    ``{"id": ...}``, so a customer's changes share a partition and keep their order. Returns the
    table the source database holds afterwards (id -> row: what an upsert sink must show) and the
    ids it deleted and did not create again (what it must not)."""
    rng = random.Random(seed)
    live: dict[int, dict] = {}
    deleted: set[int] = set()
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20})
    lsn = 10_000

    def send(key: int, value: dict | None) -> None:
        while True:
            try:
                body = json.dumps(value).encode() if value is not None else None
                producer.produce(topic, key=json.dumps({"id": key}).encode(), value=body)
                return
            except BufferError:
                producer.poll(0.2)

    def change(op: str, before: dict | None, after: dict | None) -> None:
        nonlocal lsn
        lsn += 8
        ts = 1_796_000_000_000 + lsn
        source = {"connector": "postgresql", "db": "shop", "table": "customers", "ts_ms": ts - 5, "lsn": lsn}
        key = (after or before or {})["id"]
        send(key, {"before": before, "after": after, "op": op, "ts_ms": ts, "source": source})

    for i in range(customers):
        live[i] = {"id": i, "name": f"customer {i}", "tier": rng.randrange(3)}
        change("r", None, live[i])
    for _ in range(changes):
        i = rng.randrange(customers + customers // 4)
        if i not in live:
            live[i] = {"id": i, "name": f"customer {i}", "tier": 0}
            deleted.discard(i)
            change("c", None, live[i])
        elif rng.random() < 0.2:
            change("d", live.pop(i), None)
            deleted.add(i)
            send(i, None)  # the tombstone Debezium writes after a delete, for log compaction
        else:
            before = live[i]
            live[i] = {**before, "tier": before["tier"] + 1}
            change("u", before, live[i])
    remaining = producer.flush(60)
    if remaining:
        raise RuntimeError(f"{remaining} records to {topic} were not acknowledged")
    return live, deleted
