"""Merge engines under random sequences (hypothesis, issue 38): produce (keys with resends,
out-of-order Kafka timestamps and event times, nulls, tombstones), ingest, backfill a random
range with a schema that accepts or rejects records without an amount, rewind to a random
batch, crash at a random failpoint. After every operation each engine's visible rows equal the
record-by-record replay (``offsetlake.engine_replay``) of the rows a model says are committed:
each record as the decoding of the batch that last processed it gave it (or a dead letter).

``make test`` runs a fixed sequence with every kind of step (the model starts with records and an
ingest) for every engine; ``make torture`` sets ``OFFSETLAKE_PROPERTY_EXAMPLES``: the fixed
sequence and that many drawn ones."""

from __future__ import annotations

import json
import math
import os
import random
import uuid
from datetime import UTC, datetime, timedelta

import pytest
import yaml
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic
from crash_runs import crash_in_a_run, rewind_to_a_random_live_batch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from kafka_truth import keyed_sink_rows, read_records

from offsetlake import storage
from offsetlake.backfill import plan_backfill
from offsetlake.config import PipelineConfig, load_pipeline
from offsetlake.coordinates import OFFSET, PARTITION, TIMESTAMP, TOPIC
from offsetlake.engine_replay import replay
from offsetlake.engines import group_columns
from offsetlake.errors import BackfillParamsError
from offsetlake.formats import CHANGE, DELETE
from offsetlake.history import sink_commits
from offsetlake.ledger import Ledger
from offsetlake.plan import RunContext
from offsetlake.runs import execute_recorded_batch, run_pipeline

# make test: the fixed sequence alone (EXAMPLES 0) for every engine; make torture: it and EXAMPLES drawn ones
EXAMPLES = int(os.environ.get("OFFSETLAKE_PROPERTY_EXAMPLES", "0"))
pytestmark = pytest.mark.timeout(max(600, 60 * EXAMPLES))
BASE = datetime(2026, 11, 1, tzinfo=UTC)
PARTITIONS = 2
ENGINES = {
    "aggregate": {
        "mode": "aggregate",
        "key": ["currency"],
        "window": {"on": "created_at", "size": "1h", "slide": "30m"},
        "measures": {
            "revenue": {"sum": "amount"},
            "orders": {"count": "*"},
            "paid": {"count": "amount"},
            "smallest": {"min": "amount"},
            "first_customer": {"first": "customer"},
            "last_customer": {"last": "customer"},
            "known_customer": {"last_non_null": "customer"},
        },
    },
    "partial_update": {"mode": "partial_update", "key": ["_kafka_key"]},
    "first_row": {"mode": "first_row", "key": ["_kafka_key"]},
    # record times are spread over 100 s out of order: episodes start anew, late records refold
    "first_row_within": {"mode": "first_row", "key": ["_kafka_key"], "within": "20s"},
}
operations = st.lists(st.sampled_from(["produce", "ingest", "backfill", "strict", "rewind", "crash"]), min_size=4, max_size=9)


class Model:
    """One example: its topic, pipeline, and which decoding each committed record last got."""

    def __init__(self, spark, bootstrap: str, folder, engine: str, seed: int) -> None:
        self.spark, self.bootstrap, self.folder, self.engine = spark, bootstrap, folder, engine
        self.rng = random.Random(seed)
        self.name = self.topic = f"eprop_{uuid.uuid4().hex[:8]}"
        admin = AdminClient({"bootstrap.servers": bootstrap})
        topic = NewTopic(self.topic, num_partitions=PARTITIONS, replication_factor=1, config={"retention.ms": "-1"})
        admin.create_topics([topic])[self.topic].result(30)
        self.strict = False
        # the records' timestamps are weeks old: with fold_after every ingest folds the batches
        # before it and a backfill below them is refused; an odd seed keeps every contribution
        self.fold_after = "never" if seed % 2 else "7d"
        self.config = self.write()
        self.records: dict[tuple[int, int], dict] = {}  # (partition, offset) -> the raw record, as read back
        self.applied: dict[tuple[int, int], dict | None] = {}  # committed records: their row, or None
        self.snapshots: dict[str, dict[tuple[int, int], dict | None]] = {}  # batch id -> applied after it
        self.seen = 0  # sink commits already folded into the model

    def write(self) -> PipelineConfig:
        body = {
            "name": self.name,
            "topic": self.topic,
            "kafka": {"bootstrap_servers": self.bootstrap},
            "lake": str(self.folder / "lake"),
            "max_records_per_batch": self.rng.choice([15, 40, 90]),
            "read_timeout_seconds": 30,
            "key_format": {"type": "string"},
            "format": {
                "type": "json",
                "schema": {"order_id": "long", "customer": "string", "amount": "double", "currency": "string", "created_at": "timestamp"},
                "required": ["order_id", "amount"] if self.strict else ["order_id"],
            },
            "sink": {**ENGINES[self.engine], **({"fold_after": self.fold_after} if "within" not in ENGINES[self.engine] else {})},
        }
        path = self.folder / "pipelines" / f"{self.name}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(body, sort_keys=False))
        return load_pipeline(str(path))

    # ---- operations ------------------------------------------------------------------------
    def produce(self) -> None:
        producer = Producer({"bootstrap.servers": self.bootstrap})
        for _ in range(self.rng.randint(10, 60)):
            key = f"k{self.rng.randrange(8)}"
            draw = self.rng.random()
            value = None
            if draw > 0.1 or self.engine != "partial_update":  # tombstones for the engine that deletes
                value = {
                    "order_id": self.rng.randrange(1000),
                    "customer": None if self.rng.random() < 0.3 else f"c{self.rng.randrange(4)}",
                    "amount": None if self.rng.random() < 0.25 else round(self.rng.uniform(1, 50), 2),
                    "currency": self.rng.choice(["EUR", "USD"]),
                    "created_at": (BASE + timedelta(minutes=self.rng.randrange(180))).strftime("%Y-%m-%dT%H:%M:%SZ"),
                }
            stamp = 1_790_000_000_000 + self.rng.randrange(-50_000, 50_000)  # out of order on purpose
            producer.produce(
                self.topic,
                key=key.encode(),
                value=json.dumps(value).encode() if value is not None else None,
                partition=self.rng.randrange(PARTITIONS),
                timestamp=stamp,
            )
        assert producer.flush(30) == 0

    def ingest(self, name: str = "eprop-ingest") -> None:
        run_pipeline(self.config, RunContext(name), lambda: self.spark, emit=lambda _: None)

    def backfill(self) -> None:
        table = storage.open_table(self.config.layout.sink)
        if table is None:
            return
        ends = {p: table.transaction_version(self.config.app_id(self.topic, p)) or 0 for p in range(PARTITIONS)}
        candidates = [(p, e) for p, e in ends.items() if e > 1]
        if not candidates:
            return
        partition, end = self.rng.choice(candidates)
        start = self.rng.randrange(0, end - 1)
        stop = self.rng.randrange(start + 1, end + 1)
        try:
            plan = plan_backfill(self.config, RunContext("eprop-backfill"), [partition], start, stop)
        except BackfillParamsError:
            return
        Ledger.of(self.config).record_plan(plan)
        execute_recorded_batch(self.config, plan.batch_id, lambda: self.spark)

    def toggle_strict(self) -> None:
        self.strict = not self.strict
        self.config = self.write()

    def rewind(self) -> None:
        rewind_to_a_random_live_batch(self.config, self.rng)

    def crash(self) -> None:
        self.produce()
        crash_in_a_run(self.rng, lambda: self.ingest("eprop-crash"), keyed=True)

    # ---- the model -------------------------------------------------------------------------
    def follow(self) -> None:
        """Fold the sink's new commits into the model: an ingest or backfill decodes its ranges
        with the pipeline's current decoding; a rewind restores the model as of its target."""
        commits = sink_commits(storage.open_table(self.config.layout.sink), self.config.name)
        for commit in commits[self.seen :]:
            entry = commit.entry
            if commit.kind == "rewind":
                self.applied = dict(self.snapshots[entry.to_batch])
            else:
                for r in entry.ranges:
                    for offset in range(r.start, r.end):
                        if (r.partition, offset) in self.records:
                            self.applied[(r.partition, offset)] = self.decoded(self.records[(r.partition, offset)])
            self.snapshots[commit.batch_id] = dict(self.applied)
        self.seen = len(commits)

    def read_back(self) -> None:
        for r in read_records(self.bootstrap, self.topic):
            self.records.setdefault((r.partition, r.offset), {"r": r})

    def decoded(self, raw: dict) -> dict | None:
        """The row this pipeline's current decoding makes of a record, None for a dead letter."""
        r = raw["r"]
        row = {
            TOPIC: self.topic,
            PARTITION: r.partition,
            OFFSET: r.offset,
            TIMESTAMP: datetime.fromtimestamp(r.timestamp_ms / 1000, UTC),
            "_kafka_key": r.key.decode(),
        }
        if r.value is None:
            return {**row, CHANGE: DELETE} if self.engine == "partial_update" else None  # else a tombstone dead letter
        value = json.loads(r.value)
        if self.strict and value["amount"] is None:
            return None
        value["created_at"] = datetime.fromisoformat(value["created_at"].replace("Z", "+00:00"))
        return {**row, **value}

    def check(self) -> None:
        rows = [row for row in self.applied.values() if row is not None]
        expected = replay(self.config, rows)
        group = group_columns(self.config)
        actual = {tuple(r[c] for c in group): r for r in keyed_sink_rows(self.config.layout.sink)}
        assert set(actual) == set(expected), f"groups differ: {sorted(set(actual) ^ set(expected), key=repr)[:5]}"
        for key, want in expected.items():
            for column, value in want.items():
                got = actual[key].get(column)
                same = math.isclose(value, got, rel_tol=1e-9) if isinstance(value, float) and isinstance(got, float) else value == got
                assert same, (self.engine, key, column, value, got)


@settings(
    max_examples=max(EXAMPLES, 1),
    phases=[Phase.explicit, *([Phase.generate, Phase.shrink] if EXAMPLES else [])],
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
# every engine: make test runs the fixed sequence below, make torture that and EXAMPLES drawn ones
@pytest.mark.parametrize("engine", sorted(ENGINES))
@given(steps=operations, seed=st.integers(0, 2**16))
# every kind of step, whatever hypothesis draws first (its first example is often the simplest)
@example(steps=["crash", "backfill", "strict", "produce", "backfill", "rewind", "ingest"], seed=7)
def test_an_engine_equals_the_replay_of_what_is_committed_after_every_operation(spark, broker, tmp_path_factory, engine, steps, seed):
    model = Model(spark, broker.bootstrap, tmp_path_factory.mktemp("eprop"), engine, seed)
    model.produce()
    model.ingest()
    model.read_back()
    model.follow()
    model.check()
    for step in steps:
        if step == "produce":
            model.produce()
        elif step == "ingest":
            model.ingest()
        elif step == "backfill":
            model.backfill()
        elif step == "strict":
            model.toggle_strict()
        elif step == "rewind":
            model.rewind()
        else:
            model.crash()
        model.read_back()
        model.follow()
        if storage.open_table(model.config.layout.sink) is not None:
            model.check()
