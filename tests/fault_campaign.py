"""Randomized fault campaign: hunt for the interleaving that breaks exactly-once.

A seeded sequence of steps over a real broker, real Spark and real Delta tables: produce
records (plain with some malformed, transactional committed, aborted, or left open), run
batches, run a CLI batch that dies at a random failpoint, SIGKILL a running ``offsetlake run``
at a random moment, backfill a random range of offsets or of record times, rewind to an
earlier batch, compact/checkpoint/vacuum, add or drop a nullable field of the pipeline's schema,
add a field inside a struct or an array of structs, add partitions, delete records (with
``on_offsets_lost: skip``), delete the topic and create it again (runs must refuse until
``offsetlake topic reset-epoch``) and restart the broker. A second pipeline reads the same topic
into a keyed sink (``sink.mode: upsert``) whose key is a timestamp with sub-millisecond digits
taken from the record key, with tombstones that delete keys; it runs, backfills and is compacted
beside the first. A third pipeline reads the same topic into a merge engine (``sink.mode:
aggregate``) keyed by the same timestamp: per key the count, sum, min, max, first and last order
id; it runs and backfills beside them, and its maintenance is checked to leave its files. Two
more do the same into the other merge engines: ``first_row`` (tombstones are its dead letters)
and ``partial_update`` (tombstones delete the key), and one more into the same aggregate keyed by
the value's customer instead (its batches take the direct path: the read tasks fold the
contributions, ``offsetlake.engine_arrow``; a null customer is a dead letter). A fourth pipeline reads the same topic into a
Kafka topic (``sink: {type: kafka}``, one Kafka transaction per batch): it runs in this process,
crashed one time in three at a step of its batch, and republishes committed ranges (a backfill with
``republish``); after a re-creation of the topic its group is deleted and it writes to a new output
topic, as its user would (a Kafka sink's epoch cannot be reset). An outbox publishes the first
pipeline's sink commits to a topic (``offsetlake.outbox``), its publisher crashed one time in three. After EVERY step the
invariants are checked twice. First against an independent model — what the campaign itself
produced, with offsets and timestamps from the producer's delivery reports — and plain deltalake reads of the sink, dead letters and ledger:

* every sink row is a committed record, at most once, with its own order id and record time;
  none is aborted or still in an open transaction; a field no record carries reads null;
* every committed record below a partition's committed end is in the sink exactly once (or,
  if malformed, in the dead letters exactly once), unless it lies in a recorded gap;
* gaps are recorded only over offsets the campaign deleted while no live batch held them
  (never ingested, or ingested by a batch a rewind undid);
* the sink's live committed ranges (those no rewind undid) per partition and epoch of the topic
  are contiguous, and after every clean run the ledger's committed ranges equal them;
* a nested field added to the schema reads null in rows written before, and the record's value in
  every row of a record past the committed end when it was added; other nested values are the record's;
* records of a deleted topic stay in the tables as they were, beside the new topic's records at
  the same offsets;
* the keyed sink holds, per key, the newest committed record by offsetlake's ordering rule (the
  key's last record per topic-partition, a later epoch's record being later, then the latest of
  those by record time, partition, epoch and offset), and no row for a key whose newest record is a tombstone;
* the aggregate holds, per key, the count, sum, min, max, first and last order id of the key's
  committed records (not malformed, not tombstones), first and last by record time, partition,
  epoch and offset; first_row each key's first committed record; partial_update, per column, the
  newest non-null value since the key's newest tombstone, and no row where that tombstone is its
  newest record;
* the Kafka sink's output topics hold every committed valid record of the current topic below
  its group's committed offsets exactly once among their ingest records, each in the topic its
  customer routes to (every other output is routed by ``sink.routes`` to a second topic), and its
  dead-letter topic every malformed one exactly once, but for offsets delete_records took before
  the pipeline read them; nothing else (read with plain read_committed consumers, tests/kafka_truth.py);
* the outbox topic holds, per sink commit up to its progress, the rows of that commit's ranges in
  the table at its version (or one record per batch a rewind undid), once each, in version order.

Then with offsetlake's own audit against Kafka (``audit_pipeline(against_kafka=True)``), which
reads every committed range back from the broker: the two checks are written apart, so a bug
shared by offsetlake and its audit still meets the model, and a model blind spot the audit.
Between the audits against Kafka, each pipeline's Delta-only audit runs after every step that
changed what it reads (``Campaign._audit_inputs``); ``--verify-audit-skips`` runs the skipped
ones too and fails if one says anything else than the last.

    .venv/bin/python tests/fault_campaign.py --seed 7 --steps 2000      (or: make torture SEED=7 STEPS=2000)

The CI version (tests/test_fault_campaign.py) runs a fixed seed for 25 steps; the first steps
are one of each kind (records and a batch first, a rewind last, the rest in a seeded order), so
every kind of fault is exercised (25 steps cover them all).
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import yaml
from confluent_kafka import KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewPartitions
from kafka_truth import delete_topic, group_offsets, last_stable_offsets, read_records

from offsetlake import dead_letters, failpoints, state_table, storage

ROOT = Path(__file__).resolve().parent.parent
FAILPOINTS = ("after_plan", "after_read", "after_files_written", "after_commit", "after_ledger")
# where an in-process run of the Kafka-sink pipeline crashes (tests/test_kafka_sink.py's steps), and a publish of the outbox
KAFKA_SINK_CRASH_STEPS = ("after_plan", "after_read", "after_produce", "after_flush", "after_kafka_commit", "after_ledger")
OUTBOX_CRASH_STEPS = ("after_produce", "after_kafka_commit")
OUTBOX_KEY = ["order_id"]  # the outbox's record key: the row's order id
MAX_PARTITIONS = 4
SCHEMA = {"order_id": "long", "customer": "string", "amount": "double"}
# The sink is partitioned by customer: null and "" (both the default partition folder, issue 35
# finding 1) and values Spark escapes in folder names, next to plain ones.
CUSTOMERS = ["a", "", None, "b", "q?r#s", "x%20y", "São Paulo", "k:v=1"]
# The routed pipeline (issue 53) sends the plain records by customer to two tables; the other
# customers (and a null one) are mapped to none: dead letters of the first table, coded unrouted.
ROUTES = {"a": ["a", "São Paulo"], "b": ["b", "", "q?r#s"]}
EXTRA_FIELD = ("note", "string")  # what schema_change adds and drops: nullable, no record carries it
# Nested values every record carries (derived from its order id, see ``nested_values``); the
# schema starts without some of them and ``nested_field`` adds them one stage at a time: a field
# inside a struct, inside an array of structs, inside a struct inside a struct.
NESTED_STAGES = [
    {"addr": "struct<city: string>", "lines": "array<struct<sku: string>>"},
    {"addr": "struct<city: string, zip: string>", "lines": "array<struct<sku: string>>"},
    {"addr": "struct<city: string, zip: string>", "lines": "array<struct<sku: string, qty: int>>"},
    {"addr": "struct<city: string, zip: string, geo: struct<lat: double>>", "lines": "array<struct<sku: string, qty: int>>"},
]
NESTED_ADDED = ["addr.zip", "lines.qty", "addr.geo.lat"]  # the field stage i + 1 adds
# The keyed pipeline's key: a timestamp from the record key, drawn from few values that share
# milliseconds and differ below them (Delta's statistics keep milliseconds: issue 35 finding 2).
SLOT_BASE_US = 1_795_000_000_000_000
SLOT_POOL_US = [SLOT_BASE_US + ms * 1000 + us for ms in range(6) for us in (0, 1, 499, 999)]
KEYED_SCHEMA = {"order_id": "long", "customer": "string", "amount": "double"}
TOMBSTONE_SHARE = 0.04  # of plain records: a null value, the keyed sink's delete (a dead letter in the other)


def amount_of(order_id: int) -> float:
    """The amount of record ``order_id``: mostly plain, and now and then NaN or an infinity (issue
    48, finding 1: a non-finite double is a row, and every table stays readable)."""
    return {5: float("inf"), 11: float("-inf"), 17: float("nan")}.get(order_id % 37, order_id % 1000 / 10)


def amount_json(order_id: int) -> str:
    """``amount_of`` as the record's JSON text: overflowing numbers (1e400) and the bare tokens
    Spark's parser takes (NaN, -Infinity)."""
    return {5: "1e400", 11: "-Infinity", 17: "NaN"}.get(order_id % 37, repr(order_id % 1000 / 10))


def amount_published(order_id: int) -> object:
    """``amount_of`` as a Kafka sink's JSON value holds it: non-finite numbers as strings."""
    return {5: "Infinity", 11: "-Infinity", 17: "NaN"}.get(order_id % 37, order_id % 1000 / 10)


def nested_values(order_id: int) -> dict:
    """The nested fields of record ``order_id``: a pure function, so the check needs no copy."""
    return {
        "addr": {"city": f"c{order_id % 5}", "zip": f"z{order_id}", "geo": {"lat": order_id / 8}},
        "lines": [{"sku": f"s{order_id}-{i}", "qty": i + order_id % 3} for i in range(order_id % 3)],
    }


class InvariantBroken(AssertionError):
    pass


@dataclass
class Record:
    partition: int
    offset: int
    order_id: int | None  # None: a malformed value or a tombstone (a dead letter of the plain pipeline)
    state: str  # visible | aborted | open
    txn: str | None = None  # the transactional producer's id, for records sent in a transaction
    timestamp_ms: int | None = None  # the record time the delivery report gave
    incarnation: int = 0  # which creation of the topic the record was produced to
    slot_us: int = 0  # its key: the keyed sink's key column (a timestamp, in microseconds)
    tombstone: bool = False  # a null value: deletes its key in the keyed sink
    customer: str | None = None  # the customer field of a valid record (the Kafka sink's record key)


@dataclass
class Incarnation:
    """A creation of the topic the campaign deleted since: where each pipeline's committed ends
    stood when it was deleted, and the log starts the campaign had set on it."""

    ends: dict[str, dict[int, int | None]]  # pipeline name -> partition -> committed end
    deleted_below: dict[int, int]


@dataclass
class Model:
    """What the campaign produced and deleted: the truth the tables are checked against."""

    records: dict[tuple[int, int, int], Record] = field(default_factory=dict)  # (incarnation, partition, offset)
    deleted_below: dict[int, int] = field(default_factory=dict)  # partition -> log start we set (this incarnation)
    next_id: int = 0
    incarnation: int = 0  # the topic's current creation
    past: list[Incarnation] = field(default_factory=list)  # index: incarnation
    # per pipeline, the incarnation each of its epochs reads (an epoch outlives a re-creation when
    # the pipeline had committed nothing of the old topic: it needs no reset-epoch then)
    epoch_incarnation: dict[str, list[int]] = field(default_factory=dict)
    nested_stage: int = 0
    # when each nested field was added: (incarnation, the plain pipeline's committed ends then)
    nested_added: list[tuple[int, dict[int, int | None]]] = field(default_factory=list)

    def current(self) -> list[Record]:
        return [r for (inc, _, _), r in self.records.items() if inc == self.incarnation]


class Campaign:
    def __init__(
        self,
        seed: int,
        steps: int,
        bootstrap: str,
        work: Path,
        restart_broker=None,
        log=print,
        kafka_audit_every: int = 1,
        verify_audit_skips: bool = False,
        kafka_sinks: bool = False,
        spark_remote: str | None = None,
    ) -> None:
        self.rng = random.Random(seed)
        # the Kafka sink's and the outbox's steps and checks (issue 39): in `make torture` (main);
        # the CI test keeps to the steps that fit its time
        self.kafka_sinks = kafka_sinks
        self.seed, self.steps = seed, steps
        self.kafka_audit_every = kafka_audit_every
        # the CLI runs it crashes and kills attach to this Spark server (OFFSETLAKE_SPARK_REMOTE)
        # when given, as Airflow's tasks do; else each starts a JVM of its own (the long campaign)
        self.spark_remote = spark_remote
        self.bootstrap = bootstrap
        self.work = work
        self.restart_broker = restart_broker
        self.log = log
        self.model = Model()
        self.stats: Counter = Counter()
        # pipeline -> (the inputs, the report) of its last passing Delta-only audit (_audit_inputs)
        self.audited: dict[str, tuple[tuple, str]] = {}
        self.verify_audit_skips = verify_audit_skips
        self.open_txn: tuple[Producer, list[Record]] | None = None
        self.cli_run_seconds = 12.0  # how long an unkilled `offsetlake run` took, for kill timing
        suffix = uuid.uuid4().hex[:8]
        self.name, self.topic = f"torture_{suffix}", f"torture_{suffix}"
        self.keyed_name = f"{self.name}_keyed"
        self.engine_name = f"{self.name}_agg"
        self.first_name, self.partial_name = f"{self.name}_first", f"{self.name}_partial"
        self.customer_name = f"{self.name}_cust"
        self.folder = work / "pipelines"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.file = self.folder / f"{self.name}.yaml"
        self.keyed_file = self.folder / f"{self.keyed_name}.yaml"
        self.engine_file = self.folder / f"{self.engine_name}.yaml"
        self.first_file, self.partial_file = self.folder / f"{self.first_name}.yaml", self.folder / f"{self.partial_name}.yaml"
        self.customer_file = self.folder / f"{self.customer_name}.yaml"
        self.kafka_name = f"{self.name}_kafka"
        self.kafka_file = self.folder / f"{self.kafka_name}.yaml"
        self.with_extra_field = False
        self.routed_name = f"{self.name}_rt"
        self.routed_file = self.folder / f"{self.routed_name}.yaml"
        self.routes = self._write_routed_pipeline()
        self.model.epoch_incarnation = {
            n: [0]
            for n in (
                self.name,
                self.keyed_name,
                self.engine_name,
                self.first_name,
                self.partial_name,
                self.customer_name,
                *self._route_names(),
            )
        }
        self.config = self._write_pipeline()
        self.keyed = self._write_keyed_pipeline()
        self.engine = self._write_engine_pipeline()
        self.first = self._write_engine_pipeline(self.first_name, self.first_file, {"mode": "first_row", "key": ["slot"], "file_rows": 8})
        # partial_update folds the contributions of records older than a minute (bounded state):
        # its backfills below the folded offsets are refused and start at the horizon instead
        self.partial = self._write_engine_pipeline(
            self.partial_name, self.partial_file, {"mode": "partial_update", "key": ["slot"], "file_rows": 8, "fold_after": "1m"}
        )
        # the aggregate again, keyed by a value column (customer): its batches take the direct path,
        # whose read tasks fold the contributions (offsetlake.engine_arrow); a null customer is a dead letter
        self.by_customer = self._write_engine_pipeline(self.customer_name, self.customer_file, by_customer=True)
        # every merge engine's pipeline: the aggregate, first_row and partial_update (tombstones delete)
        self.engines = (self.engine, self.first, self.partial, self.by_customer)
        admin = AdminClient({"bootstrap.servers": bootstrap})  # held: a dropped client cancels its futures
        admin.create_topics([_new_topic(self.topic, 2)])[self.topic].result(30)
        self.partitions = 2
        # The Kafka-sink pipeline writes to a new output topic per creation of the source topic (a
        # re-created topic cannot have its epoch reset under a Kafka sink: its user deletes the
        # group and starts a new output topic). Offsets of the current topic it lost to
        # delete_records before reading them (its gap batches), per partition: [start, end) spans.
        self.kafka_generation = 0
        self.kafka_lost: dict[int, list[tuple[int, int]]] = {}
        self.kafka = self._new_kafka_output()
        # The outbox publishes the plain pipeline's Delta sink to one topic (one partition: its
        # order is the publish order); expected records per sink version, computed once each.
        self.outbox_topic = f"{self.topic}-outbox"
        admin.create_topics([_new_topic(self.outbox_topic, 1)])[self.outbox_topic].result(30)
        self._outbox_verified = -1  # the last sink version a replay of the outbox was compared at
        self._outbox_checked_at: tuple | None = None
        self._kafka_checked_at: tuple | None = None

    def _write_pipeline(self):
        """(Re)write the pipeline YAML, with or without the extra field and with the nested
        fields of the current stage, and load it as the CLI steps will: they read the same file."""
        from offsetlake.config import load_pipeline

        schema = {**SCHEMA, **NESTED_STAGES[self.model.nested_stage], **dict([EXTRA_FIELD] if self.with_extra_field else [])}
        self.file.write_text(
            yaml.safe_dump(
                {
                    "name": self.name,
                    "topic": self.topic,
                    "lake": str(self.work / "lake"),
                    "start": "earliest",
                    "kafka": {"bootstrap_servers": self.bootstrap, "options": {"client.id": "campaign"}},
                    "max_records_per_batch": 400,
                    "read_timeout_seconds": 60,
                    "on_offsets_lost": "skip",
                    "key_format": "none",
                    "format": {"type": "json", "schema": schema, "required": ["order_id"]},
                    "sink": {"partition_by": ["customer"]},
                },
                sort_keys=False,
            )
        )
        return load_pipeline(str(self.file))

    def _write_routed_pipeline(self) -> list:
        """The routed pipeline (issue 53): the plain records by customer into two tables, each a
        pipeline of its own (``<file>_a``, ``<file>_b``); small batches."""
        from offsetlake.config import load_pipeline

        self.routed_file.write_text(
            yaml.safe_dump(
                {
                    "name": self.routed_name,
                    "topic": self.topic,
                    "lake": str(self.work / "lake"),
                    "start": "earliest",
                    "kafka": {"bootstrap_servers": self.bootstrap, "options": {"client.id": "campaign-routed"}},
                    "max_records_per_batch": 350,
                    "read_timeout_seconds": 60,
                    "on_offsets_lost": "skip",
                    "key_format": "none",
                    "format": {"type": "json", "schema": SCHEMA, "required": ["order_id"]},
                    "routes": {"by": "customer", "tables": ROUTES},
                },
                sort_keys=False,
            )
        )
        return [load_pipeline(f"{self.routed_name}_{table}", self.folder) for table in ROUTES]

    def _route_names(self) -> list[str]:
        return [f"{self.routed_name}_{table}" for table in ROUTES]

    def _write_keyed_pipeline(self):
        """The keyed pipeline: the same topic into an upsert sink keyed by the record key's
        timestamp; small files, so keys at both ends of many files' statistics meet the merge."""
        from offsetlake.config import load_pipeline

        self.keyed_file.write_text(
            yaml.safe_dump(
                {
                    "name": self.keyed_name,
                    "topic": self.topic,
                    "lake": str(self.work / "lake"),
                    "start": "earliest",
                    "kafka": {"bootstrap_servers": self.bootstrap, "options": {"client.id": "campaign-keyed"}},
                    "max_records_per_batch": 300,
                    "read_timeout_seconds": 60,
                    "on_offsets_lost": "skip",
                    "key_format": {"type": "json", "schema": {"slot": "timestamp"}},
                    "format": {"type": "json", "schema": KEYED_SCHEMA, "required": ["order_id"]},
                    "sink": {"mode": "upsert", "key": ["slot"], "file_rows": 8},
                },
                sort_keys=False,
            )
        )
        return load_pipeline(str(self.keyed_file))

    def _write_engine_pipeline(
        self, name: str | None = None, file: Path | None = None, sink: dict | None = None, by_customer: bool = False
    ):
        """A merge engine's pipeline: the same topic into an aggregate (or ``sink``: first_row,
        partial_update) keyed by the record key's timestamp (malformed records are its dead
        letters, tombstones too but for partial_update, whose tombstone deletes); small batches.
        ``by_customer``: the aggregate keyed by the value's customer instead, no record key read."""
        from offsetlake.config import load_pipeline

        measures = {f"{f}_id": {f: "order_id"} for f in ("sum", "min", "max", "first", "last")}
        name, file = name or self.engine_name, file or self.engine_file
        key = "customer" if by_customer else "slot"
        sink = sink or {"mode": "aggregate", "key": [key], "measures": {"records": {"count": "*"}, **measures}, "file_rows": 8}
        file.write_text(
            yaml.safe_dump(
                {
                    "name": name,
                    "topic": self.topic,
                    "lake": str(self.work / "lake"),
                    "start": "earliest",
                    "kafka": {"bootstrap_servers": self.bootstrap, "options": {"client.id": "campaign-agg"}},
                    "max_records_per_batch": 250,
                    "read_timeout_seconds": 60,
                    "on_offsets_lost": "skip",
                    "key_format": "none" if by_customer else {"type": "json", "schema": {"slot": "timestamp"}},
                    "format": {"type": "json", "schema": KEYED_SCHEMA, "required": ["order_id"]},
                    "sink": sink,
                },
                sort_keys=False,
            )
        )
        return load_pipeline(str(file))

    def _new_kafka_output(self):
        """Create the Kafka-sink pipeline's next output topic (2 partitions) and its dead-letter
        topic, and (re)write its YAML to produce there: keyed by customer, or (every other output
        topic) without a key and routed by customer (``sink.routes``) to a second topic as well.
        JSON like the plain pipeline's, small batches."""
        from offsetlake.config import load_pipeline

        out = f"{self.topic}-kout{self.kafka_generation}"
        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        # the dead-letter topic too: offsetlake would make it at its first batch, and reading it
        # before that (the check) must not auto-create it with the broker's default partitions
        routed = self.kafka_generation % 2 == 1  # every other output: routed by customer to a second topic
        made = [out, f"{out}.dead-letters", *([f"{out}.r"] if routed else [])]
        futures = admin.create_topics([_new_topic(t, 1 if t.endswith(".dead-letters") else 2) for t in made])
        for future in futures.values():
            future.result(30)
        sink = {"type": "kafka", "topic": out, **({"key": ["customer"]} if self.kafka_generation % 2 == 0 else {})}
        if routed:  # the customers of table a go to <out>.r in the batch's one transaction, the rest to <out>
            sink["routes"] = {"by": "customer", "topics": {f"{out}.r": ROUTES["a"]}}
        self.kafka_file.write_text(
            yaml.safe_dump(
                {
                    "name": self.kafka_name,
                    "topic": self.topic,
                    "lake": str(self.work / "lake"),
                    "start": "earliest",
                    "kafka": {"bootstrap_servers": self.bootstrap, "options": {"client.id": "campaign-kafka-sink"}},
                    "max_records_per_batch": 300,
                    "read_timeout_seconds": 60,
                    "on_offsets_lost": "skip",
                    "key_format": "none",
                    "format": {"type": "json", "schema": SCHEMA, "required": ["order_id"]},
                    "sink": sink,
                },
                sort_keys=False,
            )
        )
        return load_pipeline(str(self.kafka_file))

    # ---- the campaign ---------------------------------------------------------------------
    def kinds(self) -> dict[str, tuple[int, object]]:
        kinds = {
            "produce": (6, self.produce),
            "produce_txn_committed": (2, lambda: self.produce_txn(commit=True)),
            "produce_txn_aborted": (2, lambda: self.produce_txn(commit=False)),
            "open_txn": (1, self.begin_open_txn),
            "finish_open_txn": (2, self.finish_open_txn),
            "run": (6, self.run_in_process),
            # each of these starts a process with its own JVM (~10-20 s), so they are drawn less often
            "crash_at_failpoint": (1, self.crash_at_failpoint),
            "crash_keyed_at_failpoint": (1, self.crash_keyed_at_failpoint),
            "kill_cli_run": (1, self.kill_cli_run),
            "backfill": (2, self.backfill),
            "backfill_by_time": (1, self.backfill_by_time),
            # each rewind makes later runs read its batches again, so it is drawn as rarely as a crash
            "rewind": (1, self.rewind),
            "maintenance": (1, self.maintenance),
            "schema_change": (1, self.schema_change),
            "nested_field": (1, self.nested_field),
            "add_partition": (1, self.add_partition),
            "delete_records": (1, self.delete_records),
            "recreate_topic": (1, self.recreate_topic),
            "keyed_backfill": (1, self.keyed_backfill),
            "engine_backfill": (1, self.engine_backfill),
            "routed_crash_or_backfill": (1, self.routed_crash_or_backfill),
        }
        if self.kafka_sinks:
            kinds.update(
                {
                    "kafka_sink_run": (2, self.kafka_sink_run),
                    "kafka_sink_republish": (1, self.kafka_sink_republish),
                    "kafka_group_lost": (1, self.kafka_group_lost),
                    "outbox_publish": (1, self.outbox_publish),
                    "rewind_a_backfill": (1, self.rewind_a_backfill),
                }
            )
        if self.restart_broker is not None:
            kinds["restart_broker"] = (1, self.restart)
        return kinds

    def run(self, minutes: float | None = None) -> dict:
        """All steps (or as many as fit in ``minutes``), then the final phase; returns the figures."""
        kinds = self.kinds()
        # One of each kind first, so short campaigns cover every fault: after records and a batch
        # (the backfills, a rewind, a crash need something committed to act on), the others in a
        # seeded order, and the rewind last (it needs a live batch before the latest one).
        # The topic is re-created early, then fed and run again, so the steps after it (backfills
        # above all) act on the new topic's committed records rather than find none.
        # The Kafka sink runs right after those, so its republishing backfill finds a committed range.
        first = [k for k in kinds if k not in ("produce", "run", "rewind", "recreate_topic", "kafka_sink_run")]
        self.rng.shuffle(first)
        first = ["produce", "run", "recreate_topic", "produce", "run", *(["kafka_sink_run"] if self.kafka_sinks else []), *first, "rewind"]
        self.first_steps = len(first)
        names, weights = zip(*[(k, w) for k, (w, _) in kinds.items()], strict=True)
        started = time.monotonic()
        for step in range(self.steps):
            if minutes is not None and time.monotonic() - started > minutes * 60:
                self.log(f"campaign seed={self.seed}: time budget of {minutes} min spent after {step} steps")
                break
            kind = first[step] if step < len(first) else self.rng.choices(names, weights)[0]
            t = time.monotonic()
            try:
                kinds[kind][1]()
                acted = time.monotonic()
                self.stats["steps"] += 1
                self.stats[f"step:{kind}"] += 1
                self.stats[f"step_ms:{kind}"] += int((acted - t) * 1000)
                self._timed("checks_ms:sink", self.check, clean_run=kind == "run")
                self._timed("checks_ms:keyed", self.check_keyed)
                self._timed("checks_ms:engines", self.check_engine)
                self._timed("checks_ms:routes", self.check_routes)
                if self.kafka_sinks:
                    self._timed("checks_ms:kafka_sink", self.check_kafka_sink)
                    self._timed("checks_ms:outbox", self.check_outbox)
                self._timed("checks_ms:audit", self.audit, against_kafka=(step + 1) % self.kafka_audit_every == 0)
            except InvariantBroken as broken:
                raise InvariantBroken(f"step {step + 1} ({kind}): {broken}") from None
            done = time.monotonic()
            self.log(
                f"campaign seed={self.seed} step={step + 1}/{self.steps} kind={kind} "
                f"took_ms={int((done - t) * 1000)} checks_ms={int((done - acted) * 1000)} ok"
            )
        self.finish_open_txn()
        self.run_in_process(to_the_end=True)
        if self.kafka_sinks:
            self._run_kafka_sink(max_batches=None)
            self._publish_outbox()
        self.check(clean_run=True, final=True)
        self.check_keyed(final=True)
        self.check_engine(final=True)
        self.check_routes(final=True)
        if self.kafka_sinks:
            self.check_kafka_sink(final=True)
            self.check_outbox(final=True)
        self.audit(final=True)
        figures = self.figures(time.monotonic() - started)
        self.log("campaign figures " + json.dumps(figures))
        return figures

    def _timed(self, stat: str, check, **kwargs) -> None:
        """Run one check and add its time to ``stat``: the figures say where a step's time goes."""
        started = time.monotonic()
        try:
            check(**kwargs)
        finally:
            self.stats[stat] += int((time.monotonic() - started) * 1000)

    def figures(self, seconds: float) -> dict:
        visible = [r for r in self.model.records.values() if r.state == "visible"]
        return {
            "seed": self.seed,
            "steps": self.stats["steps"],
            "seconds": round(seconds, 1),
            "records_produced": len(self.model.records),
            "records_committed_in_kafka": len(visible),
            "records_in_sink": self.stats["last_sink_rows"],
            "dead_letters": self.stats["last_dead_letters"],
            "records_in_recorded_gaps": self.stats["last_in_gaps"],
            "batches_committed": self.stats["commits:ingest"],
            "runs_in_process": self.stats["runs"],
            "sink_commits": {k.removeprefix("commits:"): v for k, v in sorted(self.stats.items()) if k.startswith("commits:")},
            "failpoint_crashes": self.stats["failpoint_crashes"],
            "keyed_crashes": {k.removeprefix("keyed_crashes:"): v for k, v in sorted(self.stats.items()) if k.startswith("keyed_crashes:")},
            "sigkills": self.stats["sigkills"],
            "backfills": self.stats["backfills"],
            "backfills_by_time": self.stats["backfills_by_time"],
            "rewinds": self.stats["rewinds"],
            "batches_rewound": self.stats["batches_rewound"],
            "rewinds_refused": self.stats["rewinds_refused"],
            "rewinds_refused_earlier_epoch": self.stats["rewinds_refused_earlier_epoch"],
            "maintenance_runs": self.stats["maintenance_runs"],
            "files_vacuumed": self.stats["files_vacuumed"],
            "schema_changes": self.stats["schema_changes"],
            "broker_restarts": self.stats["step:restart_broker"],
            "topic_recreations": self.stats["recreations"],
            "epochs_reset": self.stats["epochs_reset"],
            "nested_fields_added": self.model.nested_stage,
            "keyed_rows": self.stats["last_keyed_rows"],
            "keyed_keys_deleted": self.stats["last_keyed_deleted"],
            "keyed_backfills": self.stats["keyed_backfills"],
            "keyed_backfills_refused": self.stats["keyed_backfills_refused"],
            "engine_keys": self.stats["last_engine_keys"],
            "first_row_keys": self.stats["last_engine_keys:first_row"],
            "partial_update_keys": self.stats["last_engine_keys:partial_update"],
            "customer_aggregate_keys": self.stats["last_engine_keys:aggregate:customer"],
            "engine_backfills": self.stats["engine_backfills"],
            "engine_backfills_by_pipeline": {
                k.removeprefix("engine_backfills:"): v for k, v in sorted(self.stats.items()) if k.startswith("engine_backfills:")
            },
            "engine_backfills_refused_below_fold": self.stats["engine_backfills_refused_below_fold"],
            "engine_backfills_from_segments": self.stats["engine_backfills_from_segments"],
            "engine_backfill_segments_used": self.stats["engine_backfill_segments_used"],
            "partial_update_folded_offsets": self.stats["last_folded_offsets"],
            "kafka_sink_batches": self._kafka_sink_batches(),
            "kafka_sink_runs": self.stats["kafka_sink_runs"],
            "kafka_sink_crashes": self.stats["kafka_sink_crashes"],
            "kafka_sink_republished": self.stats["kafka_sink_republished"],
            "kafka_sink_rows": self.stats["last_kafka_sink_rows"],
            "kafka_sink_dead_letters": self.stats["last_kafka_sink_dead"],
            "kafka_sink_lost_to_gaps": self.stats["last_kafka_sink_lost"],
            "kafka_sink_output_topics": self.kafka_generation + 1,
            "kafka_sink_refused_recreated_topic": self.stats["kafka_sink_refused_recreated"],
            "outbox_publishes": self.stats["outbox_publishes"],
            "outbox_commits_published": self.stats["last_outbox_commits_published"],
            "outbox_records": self.stats["last_outbox_records"],
            "outbox_crashes": self.stats["outbox_crashes"],
            "kafka_sink_and_outbox_checks_seconds": round((self.stats["checks_ms:kafka_sink"] + self.stats["checks_ms:outbox"]) / 1000, 1),
            # where the time went: each step kind's own work, and each check over all steps
            "step_seconds": {
                k.removeprefix("step_ms:"): round(v / 1000, 1) for k, v in sorted(self.stats.items()) if k.startswith("step_ms:")
            },
            "check_seconds": {
                k.removeprefix("checks_ms:"): round(v / 1000, 1) for k, v in sorted(self.stats.items()) if k.startswith("checks_ms:")
            },
            "routed_rows": self.stats["last_routed_rows"],
            "routed_dead_letters": self.stats["last_routed_dead"],
            "routed_unrouted": self.stats["last_routed_unrouted"],
            "routed_crashes": self.stats["routed_crashes"],
            "routed_backfills": self.stats["routed_backfills"],
            "partitions": self.partitions,
            "duplicates_found": self.stats["duplicates_found"],
            "records_lost": self.stats["records_lost"],
            "checks": self.stats["checks"],
            "checks_with_dead_letters_pending": self.stats["checks_with_dead_letters_pending"],
            "audits_against_kafka": self.stats["audits_against_kafka"],
            "audits_of_delta_only": self.stats["audits_of_delta_only"],
            "pipeline_audits_skipped_unchanged": self.stats["audits_skipped_unchanged"],
            "skipped_steps": {k.removeprefix("skipped:"): v for k, v in sorted(self.stats.items()) if k.startswith("skipped:")},
            "steps_by_kind": {k.removeprefix("step:"): v for k, v in sorted(self.stats.items()) if k.startswith("step:")},
        }

    # ---- steps: producing -----------------------------------------------------------------
    def _values(
        self, count: int, malformed_share: float, tombstone_share: float = 0.0
    ) -> list[tuple[int | None, bytes | None, int, str | None]]:
        """(order id or None, value or None for a tombstone, key slot in microseconds, customer) per record."""
        values: list[tuple[int | None, bytes | None, int, str | None]] = []
        for _ in range(count):
            order_id = self.model.next_id
            self.model.next_id += 1
            slot = self.rng.choice(SLOT_POOL_US)
            draw = self.rng.random()
            if draw < malformed_share:
                values.append((None, b'{"order_id": ' + str(order_id).encode() + b', "cut', slot, None))
            elif draw < malformed_share + tombstone_share:
                values.append((None, None, slot, None))
            else:
                body = {"order_id": order_id, "customer": self.rng.choice(CUSTOMERS), "amount": 0.0, **nested_values(order_id)}
                text = json.dumps(body).replace('"amount": 0.0', f'"amount": {amount_json(order_id)}', 1)
                values.append((order_id, text.encode(), slot, body["customer"]))
        return values

    def _send(
        self, producer: Producer, count: int, state: str, malformed_share: float = 0.0, txn: str | None = None, tombstone_share: float = 0.0
    ) -> list[Record]:
        sent: list[Record] = []
        failures: list[str] = []
        incarnation = self.model.incarnation
        for order_id, value, slot, customer in self._values(count, malformed_share, tombstone_share):
            partition = self.rng.randrange(self.partitions)

            def delivered(err, msg, order_id=order_id, slot=slot, tombstone=value is None, customer=customer):
                if err is not None:
                    failures.append(str(err))
                else:
                    sent.append(
                        Record(
                            msg.partition(), msg.offset(), order_id, state, txn, msg.timestamp()[1], incarnation, slot, tombstone, customer
                        )
                    )

            key = json.dumps({"slot": _iso_us(slot)}).encode()
            producer.produce(self.topic, key=key, value=value, partition=partition, on_delivery=delivered)
        producer.flush(60)
        if failures or len(sent) != count:
            raise InvariantBroken(f"produce: {len(sent)} of {count} delivered: {failures[:3]}")
        for record in sent:
            self.model.records[(incarnation, record.partition, record.offset)] = record
        return sent

    def produce(self) -> None:
        producer = Producer({"bootstrap.servers": self.bootstrap, "linger.ms": 5})
        self._send(producer, self.rng.randint(1, 300), "visible", malformed_share=0.03, tombstone_share=TOMBSTONE_SHARE)
        self.stats["produced_plain"] += 1

    def _txn_producer(self) -> tuple[Producer, str]:
        txn = f"campaign-{uuid.uuid4().hex[:8]}"
        producer = Producer({"bootstrap.servers": self.bootstrap, "transactional.id": txn})
        producer.init_transactions(30)
        producer.begin_transaction()
        return producer, txn

    def produce_txn(self, commit: bool) -> None:
        producer, txn = self._txn_producer()
        _end_transaction(producer, self._send(producer, self.rng.randint(1, 120), "open", txn=txn), commit)

    def begin_open_txn(self) -> None:
        if self.open_txn is not None:
            return self.finish_open_txn()
        producer, txn = self._txn_producer()
        self.open_txn = (producer, self._send(producer, self.rng.randint(1, 80), "open", txn=txn))

    def finish_open_txn(self) -> None:
        if self.open_txn is None:
            return
        producer, sent = self.open_txn
        self.open_txn = None
        _end_transaction(producer, sent, commit=self.rng.random() < 0.5)

    # ---- steps: running -------------------------------------------------------------------
    def run_in_process(self, to_the_end: bool = False) -> None:
        from offsetlake.plan import RunContext
        from offsetlake.runs import run_pipeline
        from offsetlake.spark import spark_session

        for config in (self.config, self.keyed, *self.engines, *self.routes):
            run_pipeline(
                config,
                RunContext(run_id=f"campaign-{uuid.uuid4().hex[:6]}"),
                spark_session,
                max_batches=None if to_the_end else self.rng.choice([1, 2, None]),
                emit=lambda _: None,
            )
        self.stats["runs"] += 1

    def _cli(self, *args: str, env: dict[str, str] | None = None, file: Path | None = None) -> subprocess.Popen:
        full = {k: v for k, v in os.environ.items() if not k.startswith("OFFSETLAKE_FAILPOINT")}
        if self.spark_remote:
            full["OFFSETLAKE_SPARK_REMOTE"] = self.spark_remote
        full.update(env or {})
        return subprocess.Popen(
            [sys.executable, "-m", "offsetlake", *args, str(file or self.file)],
            cwd=ROOT,
            env=full,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    def crash_at_failpoint(self) -> None:
        """A CLI run that dies at a random failpoint. The failpoint only fires in a batch, so
        the step first makes sure there is something to ingest: on a broker whose last stable
        offset lags a commit by some milliseconds (Apache Kafka), a step that ran on the
        campaign's timing alone often found nothing new and crashed nowhere."""
        name = self.rng.choice(FAILPOINTS)
        for attempt in range(3):
            self._ensure_pending()
            process = self._cli("run", "--max-batches", "1", env={"OFFSETLAKE_FAILPOINT": name})
            out, err = process.communicate(timeout=600)
            _kill_group(process.pid)
            if process.returncode == -signal.SIGKILL:
                self.stats["failpoint_crashes"] += 1
                return
            if process.returncode != 0:
                raise InvariantBroken(f"run with failpoint {name} exited {process.returncode}: {err[-2000:]}")
            self.log(f"campaign: failpoint {name} did not fire (attempt {attempt + 1}), nothing was pending")
        raise InvariantBroken(f"failpoint {name} never fired in 3 runs with records pending")

    def crash_keyed_at_failpoint(self) -> None:
        """A CLI run of a keyed pipeline (upsert or a merge engine) that dies at a failpoint: half
        the time between its state commit and its sink commit (``after_state_commit``: the state
        committed, no sink commit pins it yet), else at a batch failpoint. Records are produced
        first, so the batch has something to merge whatever that pipeline's committed ends are."""
        file = self.rng.choice([self.keyed_file, self.engine_file, self.first_file, self.partial_file, self.customer_file])
        name = failpoints.STATE_NAMES[0] if self.rng.random() < 0.5 else self.rng.choice(FAILPOINTS)
        for attempt in range(3):
            self.finish_open_txn()
            self.produce()
            self._ensure_pending()
            process = self._cli("run", "--max-batches", "1", env={"OFFSETLAKE_FAILPOINT": name}, file=file)
            out, err = process.communicate(timeout=600)
            _kill_group(process.pid)
            if process.returncode == -signal.SIGKILL:
                self.stats["failpoint_crashes"] += 1
                self.stats[f"keyed_crashes:{name}"] += 1
                return
            if process.returncode != 0:
                raise InvariantBroken(f"run of {file.stem} with failpoint {name} exited {process.returncode}: {err[-2000:]}")
            self.log(f"campaign: failpoint {name} of {file.stem} did not fire (attempt {attempt + 1})")
        raise InvariantBroken(f"failpoint {name} of {file.stem} never fired in 3 runs with records produced")

    def _ensure_pending(self, timeout_s: float = 30.0, ends=None) -> None:
        """Produce records unless some partition's last stable offset is past its committed end
        (or a gap is due), then wait until the broker reports them stable. With ``ends`` (a
        function: the Kafka sink's committed ends) records to read must be due, not only a gap."""

        def pending() -> bool:
            lso = _last_stable(self.bootstrap, self.topic, self.partitions)
            if ends is not None:
                committed = ends()
                return any(lso[p] > max(committed.get(p) or 0, self.model.deleted_below.get(p, 0)) for p in lso)
            committed = self._committed_ends()
            return any(lso[p] > (committed.get(p) or self.model.deleted_below.get(p, 0)) for p in lso)

        if pending():
            return
        self.finish_open_txn()  # an open transaction holds the last stable offset back
        self.produce()
        deadline = time.monotonic() + timeout_s
        while not pending():
            if time.monotonic() > deadline:
                raise InvariantBroken(f"records produced to {self.topic} did not become stable within {timeout_s}s")
            time.sleep(0.1)

    def kill_cli_run(self) -> None:
        """SIGKILL an `offsetlake run` somewhere in planning, Spark start-up, reading, writing or
        committing: at a random share of how long the last run that was left alone took."""
        started = time.monotonic()
        process = self._cli("run")
        time.sleep(self.rng.uniform(0.05, 1.0) * self.cli_run_seconds)
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            self.stats["sigkills"] += 1
        else:
            self.cli_run_seconds = time.monotonic() - started
        process.communicate(timeout=120)
        _kill_group(process.pid)
        if process.returncode not in (0, -signal.SIGKILL):
            raise InvariantBroken(f"offsetlake run exited {process.returncode}: {process.stderr}")

    def backfill(self) -> None:
        from offsetlake.backfill import plan_backfill
        from offsetlake.ledger import Ledger
        from offsetlake.plan import RunContext
        from offsetlake.runs import execute_recorded_batch
        from offsetlake.spark import spark_session

        ends = self._committed_ends()
        candidates = [(p, e) for p, e in ends.items() if e and e > self.model.deleted_below.get(p, 0) + 1]
        if not candidates:
            return
        partition, end = self.rng.choice(candidates)
        low = self.model.deleted_below.get(partition, 0)
        start = self.rng.randrange(low, end - 1)
        stop = self.rng.randrange(start + 1, end + 1)
        plan = plan_backfill(self.config, RunContext(run_id=f"campaign-backfill-{uuid.uuid4().hex[:6]}"), [partition], start, stop)
        Ledger(self.config.layout.ledger, self.config.name).record_plan(plan)
        execute_recorded_batch(self.config, plan.batch_id, spark_session)
        self.stats["backfills"] += 1

    def backfill_by_time(self) -> None:
        """Backfill a random window of record times of one partition, chosen among the record
        times the model holds below the committed end; the batch must have reprocessed exactly
        the model's records of that window inside its range (a window off by a millisecond, or
        records outside it replaced, shows here, not in the exactly-once checks)."""
        from offsetlake.backfill import plan_backfill
        from offsetlake.errors import BackfillParamsError
        from offsetlake.ledger import Ledger
        from offsetlake.plan import RunContext
        from offsetlake.runs import execute_recorded_batch
        from offsetlake.spark import spark_session

        ends = self._committed_ends()
        timed: dict[int, list[Record]] = {}
        for r in self.model.current():
            end = ends.get(r.partition)
            if (
                r.state == "visible"
                and r.timestamp_ms is not None
                and end is not None
                and self.model.deleted_below.get(r.partition, 0) <= r.offset < end
            ):
                timed.setdefault(r.partition, []).append(r)
        if not timed:
            self.stats["skipped:backfill_by_time"] += 1
            return
        partition = self.rng.choice(sorted(timed))
        records = sorted(timed[partition], key=lambda r: r.offset)
        first = self.rng.randrange(len(records))
        last = self.rng.randrange(first, len(records))
        times = sorted((records[first].timestamp_ms or 0, records[last].timestamp_ms or 0))
        from_ms, to_ms = times[0], times[1] + 1
        try:
            plan = plan_backfill(
                self.config,
                RunContext(run_id=f"campaign-backfill-time-{uuid.uuid4().hex[:6]}"),
                [partition],
                from_time=_iso_ms(from_ms),
                to_time=_iso_ms(to_ms),
            )
        except BackfillParamsError as err:
            if "selects no committed offsets" not in str(err):
                raise
            self.log(f"campaign: backfill by time skipped: {err}")
            self.stats["skipped:backfill_by_time"] += 1
            return
        Ledger.of(self.config).record_plan(plan)
        result = execute_recorded_batch(self.config, plan.batch_id, spark_session)
        (reprocessed,) = plan.ranges
        expected = [
            r for r in timed[partition] if reprocessed.start <= r.offset < reprocessed.end and from_ms <= (r.timestamp_ms or 0) < to_ms
        ]
        done = result.total("rows_written") + result.total("dead_letters")
        if result.status != "committed" or done != len(expected):
            raise InvariantBroken(
                f"backfill by time {plan.describe()} ended {result.status} with {result.total('rows_written')} rows and "
                f"{result.total('dead_letters')} dead letters; the model has {len(expected)} committed records of "
                f"{partition}:[{reprocessed.start}, {reprocessed.end}) timed in [{from_ms}, {to_ms}) ms"
            )
        self.stats["backfills_by_time"] += 1

    def rewind(self) -> None:
        """Rewind the pipeline to a random earlier live batch, in this process, as `offsetlake
        rewind` does. Later runs read the rewound offsets again; the model needs no change,
        because it only expects records below each partition's committed end. A batch of an
        earlier epoch of the topic (before a reset-epoch) must be refused: its offsets name
        records of a topic Kafka no longer has. With fewer than two live batches in the current
        epoch the step first makes two (produce, run one batch, twice), so a rewind happens."""
        from offsetlake.errors import RewindError
        from offsetlake.history import rewound_batches, sink_commits
        from offsetlake.plan import BatchKind, RunContext
        from offsetlake.rewind import rewind_pipeline
        from offsetlake.runs import run_pipeline
        from offsetlake.spark import spark_session
        from offsetlake.storage import open_table

        def live_batches() -> tuple[list, int]:
            commits = (
                sink_commits(open_table(self.config.layout.sink), self.config.name) if storage.is_table(self.config.layout.sink) else []
            )
            undone = rewound_batches(commits)
            live = [c for c in commits if c.kind not in (BatchKind.REWIND, BatchKind.EPOCH) and c.batch_id not in undone]
            epoch_start = max((c.version for c in commits if c.kind == BatchKind.EPOCH and c.batch_id not in undone), default=-1)
            return live, epoch_start

        live, epoch_start = live_batches()
        for _ in range(2):
            if len([c for c in live if c.version > epoch_start]) >= 2:
                break
            self._ensure_pending()
            run_pipeline(
                self.config, RunContext(run_id=f"campaign-{uuid.uuid4().hex[:6]}"), spark_session, max_batches=1, emit=lambda _: None
            )
            live, epoch_start = live_batches()
        earlier = [c for c in live if c.version < epoch_start]
        if earlier and self.rng.random() < 0.5:  # a batch of the topic before it was re-created: refused
            target = self.rng.choice(earlier)
            try:
                rewind_pipeline(self.config, target.batch_id, reason="campaign")
            except RewindError:
                self.stats["rewinds_refused_earlier_epoch"] += 1
            else:
                raise InvariantBroken(
                    f"rewind to batch {target.batch_id} (sink version {target.version}) went through, "
                    f"but it lies before the topic's epoch commit at version {epoch_start}"
                )
        # rewinding to the latest live batch changes nothing: no fault
        candidates = [c for c in live if c.version > epoch_start][:-1]
        if not candidates:
            self.stats["skipped:rewind"] += 1
            return
        target = self.rng.choice(candidates)
        try:
            result = rewind_pipeline(self.config, target.batch_id, reason="campaign")
        except RewindError as refused:  # files of the target's version were vacuumed: refused whole
            self.log(f"campaign: rewind refused: {refused}")
            self.stats["rewinds_refused"] += 1
            return
        self.stats["rewinds"] += 1
        self.stats["batches_rewound"] += len(result.plan.rewound)

    def maintenance(self) -> None:
        """Compact, checkpoint and vacuum all three tables; with a 1 h retention nothing a batch
        or a rewind of this campaign still needs is deleted unless the campaign is that old."""
        from offsetlake.maintenance import maintain

        reports = [
            *maintain(self.config, retention_hours=1, vacuum=True),
            *maintain(self.keyed, retention_hours=1, vacuum=True),
            *(r for route in self.routes for r in maintain(route, retention_hours=1, vacuum=True)),
        ]
        for engine in self.engines:
            # the sink holds rows and is compacted; the state table keeps the pinned state's files
            # as the merges wrote them (an unpinned commit a crash left is healed away)
            pinned = state_table.pinned(engine, storage.open_table(engine.layout.sink))
            before = sorted(pinned.file_uris()) if pinned is not None else None
            maintain(engine, retention_hours=1, vacuum=True)
            if before is not None and sorted(storage.table(engine.layout.state).file_uris()) != before:
                raise InvariantBroken(f"maintenance changed the state files of merge engine {engine.name}")
        self.stats["maintenance_runs"] += 1
        self.stats["files_vacuumed"] += sum(r.vacuumed for r in reports)

    def schema_change(self) -> None:
        """Add the nullable extra field to the pipeline's schema, or drop it again. The sink takes
        the column in the commit of the first batch that has it; rows of batches without it, and
        of records without it (all of them), read null. A changed type of an existing column is
        refused by offsetlake (SchemaChangeError) and so never drawn here."""
        self.with_extra_field = not self.with_extra_field
        self.config = self._write_pipeline()
        self.stats["schema_changes"] += 1

    def nested_field(self) -> None:
        """Add the next nested field (``NESTED_STAGES``) to the plain pipeline's schema: inside a
        struct, inside an array of structs, inside a struct in a struct. Every record carries all
        of them, so rows written from now on hold them; older rows read null."""
        if self.model.nested_stage + 1 >= len(NESTED_STAGES):
            self.stats["skipped:nested_field"] += 1
            return
        self.model.nested_added.append((self.model.incarnation, self._committed_ends()))
        self.model.nested_stage += 1
        self.config = self._write_pipeline()

    def keyed_backfill(self) -> None:
        """Backfill a random committed range of the keyed pipeline (current epoch). A keyed
        backfill may be refused (BackfillParamsError) when the range no longer holds a key's
        state: that is counted, anything else fails the campaign."""
        from offsetlake.backfill import plan_backfill
        from offsetlake.errors import BackfillParamsError
        from offsetlake.ledger import Ledger
        from offsetlake.plan import RunContext
        from offsetlake.runs import execute_recorded_batch
        from offsetlake.spark import spark_session

        ends = self._committed_ends(self.keyed)
        candidates = [(p, e) for p, e in ends.items() if e and e > self.model.deleted_below.get(p, 0) + 1]
        if not candidates:
            self.stats["skipped:keyed_backfill"] += 1
            return
        partition, end = self.rng.choice(candidates)
        start = self.rng.randrange(self.model.deleted_below.get(partition, 0), end - 1)
        stop = self.rng.randrange(start + 1, end + 1)
        try:
            plan = plan_backfill(self.keyed, RunContext(run_id=f"campaign-kbackfill-{uuid.uuid4().hex[:6]}"), [partition], start, stop)
            Ledger.of(self.keyed).record_plan(plan)
            result = execute_recorded_batch(self.keyed, plan.batch_id, spark_session)
        except BackfillParamsError as refused:
            self.log(f"campaign: keyed backfill refused: {str(refused)[:300]}")
            self.stats["keyed_backfills_refused"] += 1
            return
        if result.status != "committed":
            raise InvariantBroken(f"keyed backfill {plan.describe()} ended {result.status}")
        self.stats["keyed_backfills"] += 1

    def _folded_below(self, engine, partition: int, start: int, refused: Exception) -> int:
        """A backfill from ``start`` refused: only right when the pinned state's horizon (the
        current epoch's) lies above ``start``; the horizon, where the backfill may start instead."""
        from offsetlake.history import current_epochs, sink_commits

        sink = storage.table(engine.layout.sink)
        epoch = current_epochs(sink_commits(sink, engine.name)).get(self.topic, 0)
        below = state_table.folded_below(state_table.pinned(engine, sink)).get((self.topic, epoch, partition))
        if below is None or below <= start or "fold_after" not in str(refused):
            raise InvariantBroken(f"engine backfill from {start} refused, but the state's horizon is {below}: {refused}")
        self.stats["engine_backfills_refused_below_fold"] += 1
        return below

    def engine_backfill(self) -> None:
        """Backfill a random committed range of a merge engine's pipeline, picked at random
        (current epoch): its contributions there are replaced, each touched key folded again from
        all of its own. Below a folded horizon it is refused and starts at the horizon instead."""
        from offsetlake.backfill import plan_backfill
        from offsetlake.errors import BackfillParamsError
        from offsetlake.ledger import Ledger
        from offsetlake.plan import RunContext
        from offsetlake.runs import execute_recorded_batch
        from offsetlake.spark import spark_session

        # the direct pipeline (the aggregate by customer) half the time: it is the one whose batches
        # write batch states, so its backfills are the ones that fold from them instead of files
        engine = self.rng.choices(self.engines, weights=(1, 1, 1, 3))[0]
        ends = self._committed_ends(engine)
        candidates = [(p, e) for p, e in ends.items() if e and e > self.model.deleted_below.get(p, 0) + 1]
        if not candidates:
            self.stats["skipped:engine_backfill"] += 1
            return
        partition, end = self.rng.choice(candidates)
        start = self.rng.randrange(self.model.deleted_below.get(partition, 0), end - 1)
        stop = self.rng.randrange(start + 1, end + 1)
        run = RunContext(run_id=f"campaign-ebackfill-{uuid.uuid4().hex[:6]}")
        try:
            plan = plan_backfill(engine, run, [partition], start, stop)
        except BackfillParamsError as refused:
            start = self._folded_below(engine, partition, start, refused)
            if start >= stop:
                return
            plan = plan_backfill(engine, run, [partition], start, stop)
        Ledger.of(engine).record_plan(plan)
        with self._counting_segments():
            result = execute_recorded_batch(engine, plan.batch_id, spark_session)
        if result.status != "committed":
            raise InvariantBroken(f"engine backfill {plan.describe()} ended {result.status}")
        self.stats["engine_backfills"] += 1
        self.stats[f"engine_backfills:{engine.name}"] += 1

    @contextlib.contextmanager
    def _counting_segments(self):
        """Count the batch states (``state_segments``) a backfill folds from instead of their
        contribution files, so the campaign's figures say the replay checked that path too."""
        from offsetlake import engine_merge

        real = engine_merge._segments_of

        def counted(*args, **kwargs):
            found = real(*args, **kwargs)
            self.stats["engine_backfill_segments_used"] += found[0]
            self.stats["engine_backfills_from_segments"] += 1 if found[0] else 0
            return found

        engine_merge._segments_of = counted
        try:
            yield
        finally:
            engine_merge._segments_of = real

    # ---- steps: the Kafka sink and the outbox ---------------------------------------------------
    def routed_crash_or_backfill(self) -> None:
        """One table of the routed pipeline: a run that dies at a random failpoint (in process, as
        a crash leaves it) with records pending, or a backfill of a random range of its own."""
        from offsetlake.backfill import plan_backfill
        from offsetlake.ledger import Ledger
        from offsetlake.plan import RunContext
        from offsetlake.runs import execute_recorded_batch, run_pipeline
        from offsetlake.spark import spark_session

        route = self.rng.choice(self.routes)
        ends = self._committed_ends(route)
        candidates = [(p, e) for p, e in ends.items() if e and e > self.model.deleted_below.get(p, 0) + 1]
        if candidates and self.rng.random() < 0.5:
            partition, end = self.rng.choice(candidates)
            start = self.rng.randrange(self.model.deleted_below.get(partition, 0), end - 1)
            plan = plan_backfill(route, RunContext(run_id=f"campaign-routed-{uuid.uuid4().hex[:6]}"), [partition], start, end)
            Ledger(route.layout.ledger, route.name).record_plan(plan)
            execute_recorded_batch(route, plan.batch_id, spark_session)
            self.stats["routed_backfills"] += 1
            return
        name = self.rng.choice(FAILPOINTS)
        for attempt in range(3):
            self.finish_open_txn()
            self.produce()
            self._ensure_pending(ends=lambda: self._committed_ends(route))
            with failpoints.on(name, _simulated_crash):
                try:
                    done = run_pipeline(
                        route, RunContext(run_id=f"campaign-{uuid.uuid4().hex[:6]}"), spark_session, max_batches=1, emit=lambda _: None
                    )
                except failpoints.SimulatedCrash:
                    self.stats["routed_crashes"] += 1
                    self.stats[f"routed_crashes:{name}"] += 1
                    return
            self.log(f"campaign: failpoint {name} of {route.name} did not fire (attempt {attempt + 1}): {[r.status for r in done]}")
        raise InvariantBroken(f"failpoint {name} of {route.name} never fired in 3 runs with records produced")

    def check_routes(self, final: bool = False) -> None:
        """The routed pipeline's tables as a plain reader sees them: each holds only the rows of
        its customers, each valid record below its committed end once; the first table's dead
        letters hold the records that do not decode and those of customers no table maps, the
        other's none; no order in both tables."""
        from offsetlake import routing

        problems: list[str] = []
        by_order = {r.order_id: r for r in self.model.records.values() if r.order_id is not None}
        mapped = {c for customers in ROUTES.values() for c in customers}
        orders: Counter = Counter()
        rows_total = dead_total = unrouted_total = 0
        for route in self.routes:
            name, mine, owner = route.name, set(ROUTES[route.route]), routing.owns_the_rest(route)
            ends = self._committed_ends(route)
            commits, _, live, epoch_of = self._history(route)
            incarnations = self.model.epoch_incarnation[name]
            rows: list[dict] = []
            if storage.is_table(route.layout.sink):
                rows = _plain_rows(route.layout.sink, ["_kafka_partition", "_kafka_offset", "order_id", "customer"]).to_pylist()
            held = Counter(r["order_id"] for r in rows)
            orders.update(held.keys())
            if any(n > 1 for n in held.values()):
                self.stats["duplicates_found"] += sum(n - 1 for n in held.values() if n > 1)
                problems.append(f"{name}: orders twice in the table: {[k for k, n in held.items() if n > 1][:5]}")
            for row in rows:
                record = by_order.get(row["order_id"])
                if (
                    record is None
                    or record.state != "visible"
                    or (record.partition, record.offset) != (row["_kafka_partition"], row["_kafka_offset"])
                ):
                    problems.append(f"{name}: row {row} is not a committed record ({record})")
                elif row["customer"] not in mine:
                    problems.append(f"{name}: row of order {row['order_id']} has customer {row['customer']!r}, not one of {sorted(mine)}")
            dead: Counter = Counter()
            codes: Counter = Counter()
            changes = [c["version"] for c in commits if "dead_letter_files" in c or "dead_letter_restore" in c]
            dead_pending = bool(changes)
            if storage.is_table(route.layout.dead_letters):
                table = storage.table(route.layout.dead_letters)
                d = table.to_pyarrow_dataset().to_table(columns=["_kafka_partition", "_kafka_offset", "batch_id", "reason_code"])
                version_of = {c.get("batch_id"): c["version"] for c in commits}
                for p, o, b, code in zip(*(d[c].to_pylist() for c in d.column_names), strict=True):
                    dead[(incarnations[min(epoch_of(version_of.get(b, 1 << 62)), len(incarnations) - 1)], p, o)] += 1
                    codes[code] += 1
                sink_id = str(storage.table(route.layout.sink).metadata().id) if changes else ""
                applied = table.transaction_version(dead_letters.applied_app_id(sink_id)) if changes else None
                dead_pending = bool(changes) and (applied is None or applied < max(changes))
            if dead and not owner:
                problems.append(f"{name}: {sum(dead.values())} dead letters in a table that does not own them (codes {dict(codes)})")
            if any(n > 1 for n in dead.values()):
                self.stats["duplicates_found"] += 1
                problems.append(f"{name}: dead letters twice: {[k for k, n in dead.items() if n > 1][:5]}")
            gaps = self._gaps(name, live, epoch_of)
            in_gap = _in_gaps(gaps)
            lost = []
            for (inc, p, o), record in self.model.records.items():
                end = self._ends_of(name, inc, ends).get(p)
                if record.state != "visible" or end is None or o >= end or in_gap(inc, p, o):
                    continue
                if record.order_id is not None and record.customer in mine:
                    found = held[record.order_id]
                elif owner and (record.order_id is None or record.customer not in mapped):
                    found = dead[(inc, p, o)] or (1 if dead_pending else 0)
                else:
                    continue
                if not found:
                    lost.append((name, inc, p, o))
            for key in dead:
                record = self.model.records.get(key)
                if record is None or record.state != "visible" or (record.order_id is not None and record.customer in mapped):
                    problems.append(f"{name}: dead letter {key} is not a malformed, tombstone or unrouted record ({record})")
            if lost:
                self.stats["records_lost"] += len(lost)
                problems.append(f"{len(lost)} records below {name}'s committed end are missing: {lost[:8]}")
            if final:
                lso = _last_stable(self.bootstrap, self.topic, self.partitions)
                behind = {p: (ends.get(p), lso[p]) for p in lso if (ends.get(p) or 0) < lso[p] and lso[p] > 0}
                if behind:
                    problems.append(f"{name}: after the final run partitions are behind their LSO: {behind}")
                if dead_pending:
                    problems.append(f"{name}: after the final run the dead-letter table still lacks a sink commit's change")
            rows_total += len(rows)
            dead_total += sum(dead.values())
            unrouted_total += codes["unrouted"]
        both = [o for o, n in orders.items() if n > 1]
        if both:
            self.stats["duplicates_found"] += len(both)
            problems.append(f"orders in both routed tables: {both[:5]}")
        self.stats["last_routed_rows"], self.stats["last_routed_dead"] = rows_total, dead_total
        self.stats["last_routed_unrouted"] = unrouted_total
        if problems:
            raise InvariantBroken(f"seed {self.seed} after {self.stats['steps']} steps: " + "; ".join(problems[:8]))

    def _kafka_ends(self) -> dict[int, int | None]:
        """The Kafka-sink pipeline's committed ends: what its commit log (topic
        offsetlake-commits-<pipeline>) records, as a plain read_committed consumer reads it
        (kafka_truth, not offsetlake): per partition, the end of its last ingest, stream or gap."""
        ends: dict[int, int | None] = dict.fromkeys(range(self.partitions))
        log_topic = f"offsetlake-commits-{self.kafka_name}"
        if log_topic not in AdminClient({"bootstrap.servers": self.bootstrap}).list_topics(timeout=30).topics:
            return ends
        for record in read_records(self.bootstrap, log_topic):
            entry = json.loads(record.value or b"null") or {}
            if entry.get("pipeline") != self.kafka_name or entry.get("kind", "ingest") not in ("ingest", "stream", "gap"):
                continue
            for r in entry.get("ranges", ()):
                if r["topic"] == self.topic and r["partition"] in ends:
                    ends[r["partition"]] = max(r["end"], ends[r["partition"]] or 0)
        return ends

    def _kafka_group_offsets(self) -> dict[int, int | None]:
        """The Kafka-sink pipeline's group offsets (Kafka's copy of its ends, which expire)."""
        not_ready = (KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_LOAD_IN_PROGRESS, KafkaError.COORDINATOR_NOT_AVAILABLE)
        deadline = time.monotonic() + 60
        while True:
            try:
                return group_offsets(self.bootstrap, f"offsetlake-{self.kafka_name}", self.topic, list(range(self.partitions)))
            except KafkaException as err:  # a coordinator still loading (a new broker, one just restarted)
                if time.monotonic() > deadline or not (err.args[0].retriable() or err.args[0].code() in not_ready):
                    raise
                time.sleep(0.5)

    def kafka_group_lost(self) -> None:
        """The Kafka sink's group deleted by an operator (what offsets.retention.minutes does to an
        idle pipeline's group, which the torture broker also lets happen after a minute): the next
        run must neither publish anything again nor lose its place (issue 48, finding 2)."""
        group = f"offsetlake-{self.kafka_name}"
        admin = AdminClient({"bootstrap.servers": self.bootstrap})  # held: a dropped client cancels its futures
        try:
            admin.delete_consumer_groups([group], request_timeout=30)[group].result(60)
            self.stats["kafka_groups_deleted"] += 1
        except KafkaException as err:  # never committed yet, or already expired
            self.stats["kafka_groups_not_deleted"] += 1
            self.log(f"campaign: group {group} not deleted: {err.args[0].str()}")

    def _run_kafka_sink(self, max_batches: int | None) -> None:
        from offsetlake.plan import RunContext
        from offsetlake.runs import run_pipeline
        from offsetlake.spark import spark_session

        run_pipeline(
            self.kafka, RunContext(run_id=f"campaign-k-{uuid.uuid4().hex[:6]}"), spark_session, max_batches=max_batches, emit=lambda _: None
        )
        self.stats["kafka_sink_runs"] += 1

    def kafka_sink_run(self) -> None:
        """Run the Kafka-sink pipeline in this process; one time in three it crashes (SimulatedCrash,
        as tests/test_kafka_sink.py does) at a random step of its batch: planned, read, produced,
        flushed, committed in Kafka, recorded in the ledger. Before a crash the step makes sure a
        batch is due (a failpoint fires only in a batch; a gap batch does not read: tried again)."""
        if self.rng.random() >= 1 / 3:
            return self._run_kafka_sink(self.rng.choice([1, 2, None]))
        step = self.rng.choice(KAFKA_SINK_CRASH_STEPS)
        for attempt in range(3):
            self._ensure_pending(ends=self._kafka_ends)
            try:
                with failpoints.on(step, _simulated_crash):
                    self._run_kafka_sink(max_batches=1)
            except failpoints.SimulatedCrash:
                self.stats["kafka_sink_crashes"] += 1
                return
            self.log(f"campaign: Kafka sink failpoint {step} did not fire (attempt {attempt + 1})")
        raise InvariantBroken(f"Kafka sink failpoint {step} never fired in 3 runs with records pending")

    def kafka_sink_republish(self) -> None:
        """A republishing backfill of a random committed range of partition 0 of the Kafka-sink
        pipeline (plan_backfill(republish=True), executed as recorded): the records of that batch
        are exactly the model's committed records of the range, valid ones in the output topic and
        malformed ones in the dead-letter topic, once each, marked ``backfill``."""
        from offsetlake.backfill import plan_backfill
        from offsetlake.ledger import Ledger
        from offsetlake.plan import RunContext
        from offsetlake.runs import execute_recorded_batch
        from offsetlake.spark import spark_session

        end = self._kafka_ends().get(0)
        low = self.model.deleted_below.get(0, 0)
        if end is None or end <= low + 1:
            self.stats["skipped:kafka_sink_republish"] += 1
            return
        start = self.rng.randrange(low, end - 1)
        stop = self.rng.randrange(start + 1, end + 1)
        plan = plan_backfill(self.kafka, RunContext(run_id=f"campaign-kbf-{uuid.uuid4().hex[:6]}"), [0], start, stop, republish=True)
        Ledger.of(self.kafka).record_plan(plan)
        result = execute_recorded_batch(self.kafka, plan.batch_id, spark_session)
        if result.status != "committed":
            raise InvariantBroken(f"Kafka sink republish {plan.describe()} ended {result.status}")
        (done,) = plan.ranges
        want = {
            (r.partition, r.offset): r
            for r in self.model.current()
            if r.state == "visible" and r.partition == 0 and done.start <= r.offset < done.end
        }
        problems = []
        sink = self.kafka.sink
        for topics, valid in ((sink.output_topics, True), ([sink.dead_letters_to], False)):
            topic = ", ".join(topics)
            expected = {k for k, r in want.items() if (r.order_id is not None) == valid}
            # the last stable offset passes a committed transaction once the coordinator has written
            # its markers, which Apache Kafka does after answering the commit: read again until the
            # batch's records are in, or 30 s
            deadline = time.monotonic() + 30
            while True:
                got = Counter(
                    (int(h["offsetlake.partition"]), int(h["offsetlake.offset"]))
                    for h in (_headers(r) for t in topics for r in read_records(self.bootstrap, t))
                    if h.get("offsetlake.batch") == plan.batch_id
                )
                if set(got) >= expected or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            if set(got) != expected or any(n > 1 for n in got.values()):
                problems.append(
                    f"{topic}: only republished {sorted(set(got) - expected)[:5]}, only in the model {sorted(expected - set(got))[:5]}, "
                    f"twice {sorted(k for k, n in got.items() if n > 1)[:5]}"
                )
        if problems:
            raise InvariantBroken(f"Kafka sink republish {plan.describe()} (batch {plan.batch_id}): " + "; ".join(problems))
        self.stats["kafka_sink_republished"] += 1

    def _publish_outbox(self, max_batches: int | None = None) -> None:
        from offsetlake.outbox import publish

        publish(self.config, self.outbox_topic, OUTBOX_KEY, max_batches=max_batches)
        self.stats["outbox_publishes"] += 1

    def outbox_publish(self) -> None:
        """Publish the plain pipeline's sink commits to the outbox topic (offsetlake.outbox); one
        time in three the publisher crashes (SimulatedCrash) after producing a commit's records or
        after its Kafka commit. With nothing left to publish no failpoint is reached: counted."""
        max_batches = self.rng.choice([1, 3, None])
        if self.rng.random() >= 1 / 3:
            return self._publish_outbox(max_batches)
        step = self.rng.choice(OUTBOX_CRASH_STEPS)
        try:
            with failpoints.on(step, _simulated_crash):
                self._publish_outbox(max_batches)
        except failpoints.SimulatedCrash:
            self.stats["outbox_crashes"] += 1
        else:
            self.stats["outbox_crash_nothing_pending"] += 1

    # ---- steps: the topic and the broker ------------------------------------------------------
    def add_partition(self) -> None:
        if self.partitions >= MAX_PARTITIONS:
            return
        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        admin.create_partitions([NewPartitions(self.topic, self.partitions + 1)])[self.topic].result(30)
        self.partitions += 1

    def delete_records(self) -> None:
        """Move a partition's log start; beyond the committed end the next run records a gap."""
        ends = self._committed_ends()
        lso = _last_stable(self.bootstrap, self.topic, self.partitions)
        candidates = [p for p, e in ends.items() if e is not None and lso[p] > self.model.deleted_below.get(p, 0)]
        if not candidates:
            return
        partition = self.rng.choice(candidates)
        low = self.model.deleted_below.get(partition, 0)
        inside = self._inside_aborted_transactions(partition)
        targets = [t for t in range(low + 1, lso[partition] + 1) if t not in inside]
        if not targets:
            return
        target = self.rng.choice(targets)
        # The Kafka sink has not read below ``target`` past its group's offset: those offsets are
        # lost to it (its next run commits a gap over them, or starts at the new log start).
        kafka_end = self._kafka_ends().get(partition) or 0
        if kafka_end < target:
            self.kafka_lost.setdefault(partition, []).append((kafka_end, target))
        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        futures = admin.delete_records([TopicPartition(self.topic, partition, target)])
        for future in futures.values():
            future.result(30)
        self.model.deleted_below[partition] = target

    def _inside_aborted_transactions(self, partition: int) -> set[int]:
        """Offsets after the first record of an aborted transaction, up to its last record.

        noida-db (the test broker before Apache Kafka) forgot an aborted transaction once delete_records moves the log start past its
        first record, and then served its remaining records to read_committed consumers (checked
        here; Apache Kafka keeps the transaction index). That is the test broker's bug, not one
        offsetlake can see, so the campaign never deletes into the middle of an aborted transaction.
        """
        spans: dict[str, tuple[int, int]] = {}
        for record in self.model.current():
            if record.partition == partition and record.state == "aborted" and record.txn:
                low, high = spans.get(record.txn, (record.offset, record.offset))
                spans[record.txn] = (min(low, record.offset), max(high, record.offset))
        return {t for low, high in spans.values() for t in range(low + 1, high + 1)}

    def _model_matches_a_consumer(self, lso: dict[int, int]) -> list[str]:
        """The model itself, checked against what a plain read_committed consumer reads now."""
        expected = {
            (r.partition, r.offset): r.order_id
            for r in self.model.current()
            if r.state == "visible" and self.model.deleted_below.get(r.partition, 0) <= r.offset < lso.get(r.partition, 0)
        }
        seen = _consumer_view(self.bootstrap, self.topic, lso)
        if seen == expected:
            return []
        only_model = sorted(set(expected) - set(seen))[:5]
        only_kafka = sorted(set(seen) - set(expected))[:5]
        differ = sorted(k for k in set(seen) & set(expected) if seen[k] != expected[k])[:5]
        return [
            f"the campaign's model and a plain consumer disagree: only in the model {only_model}, "
            f"only in Kafka {only_kafka}, different values {differ}"
        ]

    def recreate_topic(self) -> None:
        """Delete the topic and create it again (same name, same partitions), then run each
        pipeline at once: one that committed anything on the topic must refuse until ``offsetlake
        topic reset-epoch``, run as the CLI (Apache Kafka names topic ids, and the pipeline's
        commits recorded the old one; with ends of 0 too, e.g. right after an epoch reset); one
        that committed nothing reads the new topic from its start. The old topic's records stay
        in the tables; those past a pipeline's committed end are gone."""
        from offsetlake.errors import TopicIdentityError
        from offsetlake.plan import RunContext
        from offsetlake.runs import run_pipeline
        from offsetlake.spark import spark_session

        self.finish_open_txn()
        pipelines = {
            self.name: (self.config, self.file),
            self.keyed_name: (self.keyed, self.keyed_file),
            self.engine_name: (self.engine, self.engine_file),
            self.first_name: (self.first, self.first_file),
            self.partial_name: (self.partial, self.partial_file),
            self.customer_name: (self.by_customer, self.customer_file),
            **{route.name: (route, route.name) for route in self.routes},  # a routed table: by its name
        }
        ends = {name: self._committed_ends(config) for name, (config, _) in pipelines.items()}
        kafka_ends = self._kafka_ends()
        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        admin.delete_topics([self.topic])[self.topic].result(30)
        deadline = time.monotonic() + 60
        while self.topic in admin.list_topics(timeout=10).topics:
            if time.monotonic() > deadline:
                raise InvariantBroken(f"{self.topic} still listed 60 s after its deletion")
            time.sleep(0.2)
        admin.create_topics([_new_topic(self.topic, self.partitions)])[self.topic].result(30)
        self.model.past.append(Incarnation(ends, dict(self.model.deleted_below)))
        self.model.incarnation += 1
        self.model.deleted_below = {}
        for name, (config, file) in pipelines.items():
            epochs = self.model.epoch_incarnation[name]
            if all(end is None for end in ends[name].values()):  # nothing committed on the topic: no epoch to end
                epochs[-1] = self.model.incarnation
                continue
            try:
                run_pipeline(
                    config, RunContext(run_id=f"campaign-{uuid.uuid4().hex[:6]}"), spark_session, max_batches=1, emit=lambda _: None
                )
            except TopicIdentityError as refused:
                if "the topic was re-created or truncated" not in str(refused):
                    raise InvariantBroken(f"{name}: the refusal does not say what happened: {refused}") from None
            else:
                raise InvariantBroken(
                    f"{name} ran on the re-created topic {self.topic} from the old committed ends {ends[name]} instead of refusing"
                )
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "offsetlake",
                    "--pipelines-dir",
                    str(self.folder),
                    "topic",
                    "reset-epoch",
                    "--topic",
                    self.topic,
                    "--reason",
                    "campaign re-created the topic",
                    str(file),
                ],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=300,
            )
            if done.returncode != 0:
                raise InvariantBroken(f"{name}: offsetlake topic reset-epoch exited {done.returncode}: {done.stderr[-2000:]}")
            epochs.append(self.model.incarnation)
            self.stats["epochs_reset"] += 1
        if self.kafka_sinks:
            self._recover_kafka_sink(any(end is not None for end in kafka_ends.values()))
        self.stats["recreations"] += 1

    def _recover_kafka_sink(self, committed: bool) -> None:
        """The Kafka-sink pipeline after its source topic was re-created. Its epoch cannot be reset
        (offsetlake refuses: a Kafka log cannot hold two epochs); planning on the new topic from the
        old commit log must refuse. Its user starts the pipeline afresh as the refusal says: deletes
        its commit log and group, rebuilds its ledger, and sends the new topic's records to a new
        output topic, where the check starts afresh."""
        from offsetlake.errors import TopicEpochError, TopicIdentityError
        from offsetlake.ledger import Ledger
        from offsetlake.plan import RunContext
        from offsetlake.planner import plan_next_batch
        from offsetlake.topic_epochs import reset_topic_epoch

        try:
            reset_topic_epoch(self.kafka, self.topic, reason="campaign re-created the topic")
        except TopicEpochError as refused:
            if "ledger rebuild" not in str(refused):
                raise InvariantBroken(f"{self.kafka_name}: the epoch refusal gives no way forward: {refused}") from None
        else:
            raise InvariantBroken(f"{self.kafka_name}: reset_topic_epoch went through for a Kafka sink")
        if committed:
            try:
                plan_next_batch(self.kafka, RunContext(run_id=f"campaign-kprobe-{uuid.uuid4().hex[:6]}"))
            except TopicIdentityError:
                self.stats["kafka_sink_refused_recreated"] += 1
            else:
                raise InvariantBroken(f"{self.kafka_name}: planned on the re-created topic from the old commit log's ends")
        group = f"offsetlake-{self.kafka_name}"
        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        deadline = time.monotonic() + 60
        while True:
            try:
                admin.delete_consumer_groups([group], request_timeout=30)[group].result(30)
                break
            except KafkaException as err:
                if err.args[0].code() == KafkaError.GROUP_ID_NOT_FOUND:
                    break
                if time.monotonic() > deadline or not err.args[0].retriable():
                    raise InvariantBroken(f"deleting group {group} failed: {err}") from None
                time.sleep(0.5)
        log_topic = f"offsetlake-commits-{self.kafka_name}"
        if log_topic in admin.list_topics(timeout=30).topics:
            delete_topic(self.bootstrap, log_topic)
        Ledger.of(self.kafka).rebuild([])  # what `offsetlake ledger rebuild` does with the empty commit log
        left = {p: e for p, e in self._kafka_ends().items() if e is not None}
        if left:
            raise InvariantBroken(f"the commit log of {self.kafka_name} still has ends {left} on {self.topic} after its deletion")
        self.kafka_generation += 1
        self.kafka_lost = {}
        self.kafka = self._new_kafka_output()

    def restart(self) -> None:
        self.finish_open_txn()  # a transaction coordinator's state across restarts is not under test
        if not self.model.current():
            return  # noida-db (the earlier test broker) dropped a topic without records at a restart; Kafka does not
        self.restart_broker(wait_for_topics=[self.topic])

    # ---- the invariants -------------------------------------------------------------------
    def audit(self, against_kafka: bool = True, final: bool = False) -> None:
        """offsetlake's own audit; against Kafka it reads every committed range back from the broker.

        That read costs about 0.5 s per committed range ending on a transaction marker (measured
        here: 6.1 s for 24 ranges after 6 runs, 14 s per step by step 58 of seed 3), so it grows
        with the batches committed: long campaigns may run it every N steps (``--kafka-audit-every``)
        and the Delta-only audit on the others.
        """
        from offsetlake.audit import audit_pipeline

        # the routed tables against Kafka every third audit (each decodes and routes the records
        # it does not hold); the model checks them after every step (check_routes)
        routes_too = final or self.stats["audits_against_kafka"] % 3 == 0
        ledger_files = self._ledger_files()
        for config in (self.config, self.keyed, *self.engines, *self.routes):
            if not storage.is_table(config.layout.sink):
                continue
            kafka = against_kafka and (config not in self.routes or routes_too)
            inputs = self._audit_inputs(config, ledger_files)
            unchanged = not kafka and not final and config.name in self.audited and self.audited[config.name][0] == inputs
            if unchanged and not self.verify_audit_skips:
                self.stats["audits_skipped_unchanged"] += 1  # the same inputs passed the last audit
                continue
            report = audit_pipeline(config, against_kafka=kafka)
            if not report.ok:
                raise InvariantBroken(
                    f"seed {self.seed} after {self.stats['steps']} steps: offsetlake's audit of "
                    f"{config.name}{' against Kafka' if against_kafka else ''} failed:\n{report.text()}"
                )
            if unchanged:  # --verify-audit-skips: the audit the campaign would skip says what the last one said
                if report.text() != self.audited[config.name][1]:
                    raise InvariantBroken(
                        f"seed {self.seed} after {self.stats['steps']} steps: the audit of {config.name} changed with "
                        f"unchanged inputs, so skipping it would hide something:\n{self.audited[config.name][1]}\n---\n{report.text()}"
                    )
                self.stats["audits_skipped_unchanged"] += 1
            if not kafka:
                self.audited[config.name] = (inputs, report.text())
        self.stats["audits_against_kafka" if against_kafka else "audits_of_delta_only"] += 1

    def _ledger_files(self) -> dict[str, frozenset[str]]:
        """The ledger's files per pipeline: what of the lake-wide ledger a pipeline's audit reads
        (``Ledger.rows`` prunes to its partition)."""
        ledger = storage.open_table(self.config.layout.ledger)
        if ledger is None:
            return {}
        actions = pa.table(ledger.get_add_actions(flatten=True)).to_pydict()
        files: dict[str, set[str]] = {}
        for path, pipeline in zip(actions["path"], actions["partition.pipeline"], strict=True):
            files.setdefault(pipeline, set()).add(path)
        return {p: frozenset(f) for p, f in files.items()}

    def _audit_inputs(self, config, ledger_files: dict[str, frozenset[str]]) -> tuple:
        """Everything offsetlake's Delta-only audit of ``config`` reads, as a value: the latest
        commit of each of its tables (sink, dead letters, state; a routed pipeline's every route),
        its ledger files, and the steps that change what Kafka says of the topic (its identity,
        partitions and log start, which the audit's identity check asks). An audit of the same
        inputs reads the same bytes and says the same: the campaign skips it, and so it audits
        after each step exactly the pipelines the step changed (round 15 spent 47 of its 125
        minutes re-auditing unchanged tables)."""
        layouts = [r.layout for r in self.routes] if config in self.routes else [config.layout]
        tables = sorted({str(t) for layout in layouts for t in (layout.sink, layout.dead_letters, layout.state)})
        kafka_steps = tuple(self.stats[f"step:{k}"] for k in ("recreate_topic", "add_partition", "delete_records", "restart_broker"))
        names = [config.name, *([self.routed_name, *self._route_names()] if config in self.routes else [])]
        return (tuple((t, _latest_commit(t)) for t in tables), tuple(ledger_files.get(n) for n in names), kafka_steps)

    def _committed_ends(self, config=None) -> dict[int, int | None]:
        config = config or self.config
        if not storage.is_table(config.layout.sink):
            return {p: None for p in range(self.partitions)}
        sink = storage.table(config.layout.sink)
        return {p: sink.transaction_version(config.app_id(self.topic, p)) for p in range(self.partitions)}

    def _history(self, config) -> tuple[list[dict], set[str], list[dict], callable]:
        """The sink's commits (ledger entries with their "version"), the rewound batch ids, the
        live commits, and a function from a sink version to the epoch of the topic it belongs to
        (the number of live epoch commits at or before it)."""
        commits: list[dict] = []
        if storage.is_table(config.layout.sink):
            for info in storage.table(config.layout.sink).history():
                meta = info.get("userMetadata")
                if meta:
                    commits.append({**json.loads(meta), "version": int(info["version"])})
        commits.sort(key=lambda c: c["version"])
        # A rewind commit lists the batches it undid: their ranges no longer count (they are read again).
        rewound = {b for c in commits if c.get("kind") == "rewind" for b in c.get("rewound", [])}
        live = [c for c in commits if c.get("kind") != "rewind" and c.get("batch_id") not in rewound]
        starts = [c["version"] for c in live if c.get("kind") == "epoch"]
        return commits, rewound, live, lambda version: bisect.bisect_right(starts, version)

    def _ends_of(self, name: str, incarnation: int, current: dict[int, int | None]) -> dict[int, int | None]:
        """Where pipeline ``name``'s committed ends stand for records of ``incarnation``: now for
        the current topic, as they stood when it was deleted for an earlier one."""
        return current if incarnation == self.model.incarnation else self.model.past[incarnation].ends[name]

    def _deleted_below(self, incarnation: int) -> dict[int, int]:
        return self.model.deleted_below if incarnation == self.model.incarnation else self.model.past[incarnation].deleted_below

    def _gaps(self, name: str, live: list[dict], epoch_of) -> list[tuple[int, int, int, int]]:
        """(incarnation, partition, start, end) of each live gap commit of pipeline ``name``."""
        incarnations = self.model.epoch_incarnation[name]
        return [
            (incarnations[epoch_of(c["version"])], r["partition"], r["start"], r["end"])
            for c in live
            if c.get("kind") == "gap"
            for r in c["ranges"]
        ]

    def check(self, clean_run: bool, final: bool = False) -> None:
        self.stats["checks"] += 1
        ends = self._committed_ends()
        problems: list[str] = []
        commits, rewound, live, epoch_of = self._history(self.config)
        incarnations = self.model.epoch_incarnation[self.name]
        by_order = {r.order_id: r for r in self.model.records.values() if r.order_id is not None}
        sink_rows: list[dict] = []
        if storage.is_table(self.config.layout.sink):
            dataset = storage.table(self.config.layout.sink).to_pyarrow_dataset()
            extra = [EXTRA_FIELD[0]] if EXTRA_FIELD[0] in dataset.schema.names else []
            data = dataset.to_table(
                columns=["_kafka_partition", "_kafka_offset", "order_id", "amount", "_kafka_timestamp", "addr", "lines", *extra]
            )
            micros = pc.cast(data["_kafka_timestamp"], pa.int64()).to_pylist()
            sink_rows = data.drop_columns(["_kafka_timestamp"]).to_pylist()
            for row, t in zip(sink_rows, micros, strict=True):
                row["time_ms"] = None if t is None else t // 1000
            if extra and pc.count(data[EXTRA_FIELD[0]]).as_py():
                problems.append(
                    f"{pc.count(data[EXTRA_FIELD[0]]).as_py()} sink rows hold a value in '{EXTRA_FIELD[0]}', which no record carries"
                )
        # The dead-letter table follows the sink one commit behind at most: a crash between a sink
        # commit and its dead-letter commit leaves that change for the next run to apply (its txn
        # "sink:<sink table id>" says which sink version it holds). Meanwhile the audit counts the pending change.
        changes = [c["version"] for c in commits if "dead_letter_files" in c or "dead_letter_restore" in c]
        dead_pending = bool(changes)
        dead: list[tuple[int, int, int]] = []  # incarnation, partition, offset
        if storage.is_table(self.config.layout.dead_letters):
            dead_table = storage.table(self.config.layout.dead_letters)
            d = dead_table.to_pyarrow_dataset().to_table(columns=["_kafka_partition", "_kafka_offset", "batch_id"])
            version_of = {c.get("batch_id"): c["version"] for c in commits}
            # a dead letter belongs to the epoch of the batch that wrote it
            dead = [
                (incarnations[min(epoch_of(version_of.get(b, 1 << 62)), len(incarnations) - 1)], p, o)
                for p, o, b in zip(
                    d["_kafka_partition"].to_pylist(), d["_kafka_offset"].to_pylist(), d["batch_id"].to_pylist(), strict=True
                )
            ]
            sink_id = str(storage.table(self.config.layout.sink).metadata().id) if changes else ""
            applied = dead_table.transaction_version(dead_letters.applied_app_id(sink_id)) if changes else None
            dead_pending = bool(changes) and (applied is None or applied < max(changes))
        if dead_pending:
            self.stats["checks_with_dead_letters_pending"] += 1

        sink_count = Counter(row["order_id"] for row in sink_rows)
        dead_count = Counter(dead)
        duplicates = [("order", k) for k, n in sink_count.items() if n > 1] + [k for k, n in dead_count.items() if n > 1]
        if duplicates:
            self.stats["duplicates_found"] += len(duplicates)
            problems.append(f"duplicates (order id, or dead letter (incarnation, partition, offset)): {sorted(duplicates, key=str)[:10]}")
        for row in sink_rows:
            p, o, order_id = row["_kafka_partition"], row["_kafka_offset"], row["order_id"]
            record = by_order.get(order_id)
            if record is None or record.state != "visible" or (record.partition, record.offset) != (p, o):
                problems.append(f"sink row {p}:{o} order {order_id} is not a committed record ({record})")
                continue
            end = self._ends_of(self.name, record.incarnation, ends).get(p)
            if end is None or o >= end:
                problems.append(f"sink row {p}:{o} (topic creation {record.incarnation}) lies beyond the committed end {end}")
            elif record.timestamp_ms is not None and row["time_ms"] != record.timestamp_ms:
                problems.append(f"sink row {p}:{o} has record time {row['time_ms']} ms, the record {record.timestamp_ms} ms")
            want = amount_of(order_id)
            if not (row["amount"] == want or (row["amount"] != row["amount"] and want != want)):  # NaN equals NaN here
                problems.append(f"sink row {p}:{o} has amount {row['amount']}, the record {want}")
            problems += self._nested_problems(row, record)
        for inc, p, o in dead:
            record = self.model.records.get((inc, p, o))
            if record is None or record.state != "visible" or record.order_id is not None:
                problems.append(f"dead letter {p}:{o} (topic creation {inc}) is not a committed malformed record or tombstone ({record})")

        gaps = self._gaps(self.name, live, epoch_of)
        in_gap = _in_gaps(gaps)
        for inc, p, a, b in gaps:
            if b > self._deleted_below(inc).get(p, 0):
                problems.append(
                    f"gap {p}:[{a}, {b}) of topic creation {inc} covers offsets the campaign never deleted "
                    f"(log start {self._deleted_below(inc).get(p, 0)})"
                )
        in_gaps = 0
        lost = []
        for (inc, p, o), record in self.model.records.items():
            end = self._ends_of(self.name, inc, ends).get(p)
            if record.state != "visible" or end is None or o >= end:
                continue
            found = dead_count[(inc, p, o)] if record.order_id is None else sink_count[record.order_id]
            if in_gap(inc, p, o):
                in_gaps += 1
                if found:
                    problems.append(f"record {p}:{o} (topic creation {inc}) is in a recorded gap and also in the tables")
                continue
            if found == 0 and not (record.order_id is None and dead_pending):
                lost.append((inc, p, o))
        if lost:
            self.stats["records_lost"] += len(lost)
            problems.append(
                f"{len(lost)} committed records below the committed end are missing (topic creation, partition, offset): {lost[:10]}"
            )

        ranges: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (epoch, partition) -> spans
        for c in live:
            if c.get("kind") in ("ingest", "gap"):
                for r in c["ranges"]:
                    if r["end"] > r["start"]:
                        ranges.setdefault((epoch_of(c["version"]), r["partition"]), []).append((r["start"], r["end"]))
        current_epoch = len(incarnations) - 1
        for (epoch, p), spans in ranges.items():
            spans.sort()
            for (a1, b1), (a2, b2) in zip(spans, spans[1:], strict=False):
                if a2 != b1:
                    problems.append(f"partition {p} epoch {epoch}: committed ranges [{a1}, {b1}) and [{a2}, {b2}) are not contiguous")
            want = self._ends_of(self.name, incarnations[epoch], ends).get(p)
            if spans[-1][1] != want:
                problems.append(
                    f"partition {p} epoch {epoch}: last committed range ends at {spans[-1][1]}, "
                    f"the committed end {'is' if epoch == current_epoch else 'was'} {want}"
                )
        if clean_run and storage.is_table(self.config.layout.ledger):
            ledger = [
                r
                for r in storage.table(self.config.layout.ledger).to_pyarrow_dataset().to_table().to_pylist()
                if r["pipeline"] == self.name
            ]
            # the ledger is a log of events: a rewound batch keeps its committed event and gains a rewound one
            rewound_in_ledger = {r["batch_id"] for r in ledger if r["status"] == "rewound"}
            if rewound != rewound_in_ledger:
                problems.append(
                    f"the ledger's rewound batches differ from the sink's rewind commits: only in ledger "
                    f"{sorted(rewound_in_ledger - rewound)[:5]}, only in sink {sorted(rewound - rewound_in_ledger)[:5]}"
                )
            mine = [
                r
                for r in ledger
                if r["status"] in ("committed", "gap")
                and r["batch_id"] not in rewound_in_ledger
                and r["kind"] in ("ingest", "gap")
                and r["end_offset"] > r["start_offset"]
            ]
            ledger_spans = Counter((r["partition"], r["start_offset"], r["end_offset"]) for r in mine)
            sink_spans = Counter((p, a, b) for (_, p), spans in ranges.items() for a, b in spans)
            if ledger_spans != sink_spans:
                problems.append(
                    f"ledger committed ranges differ from the sink's: only in ledger "
                    f"{sorted((ledger_spans - sink_spans).elements())[:5]}, only in sink "
                    f"{sorted((sink_spans - ledger_spans).elements())[:5]}"
                )
        for kind, count in Counter(c.get("kind") for c in commits).items():
            self.stats[f"commits:{kind}"] = count
        self.stats["last_sink_rows"] = len(sink_rows)
        self.stats["last_dead_letters"] = len(dead)
        self.stats["last_in_gaps"] = in_gaps
        if final:
            if dead_pending:
                problems.append("after the final run the dead-letter table still lacks a sink commit's change")
            # caught up: a dead letter at or past the committed end was left by a batch that never committed
            beyond = [(p, o) for inc, p, o in dead if inc == self.model.incarnation and (ends.get(p) is None or o >= ends[p])]
            if beyond:
                problems.append(f"dead letters beyond the committed end after the final run: {sorted(beyond)[:10]}")
            lso = _last_stable(self.bootstrap, self.topic, self.partitions)
            behind = {p: (ends.get(p), lso[p]) for p in lso if (ends.get(p) or 0) < lso[p] and lso[p] > 0}
            if behind:
                problems.append(f"after the final run partitions are behind their LSO: {behind}")
            problems += self._model_matches_a_consumer(lso)
        if problems:
            raise InvariantBroken(f"seed {self.seed} after {self.stats['steps']} steps: " + "; ".join(problems[:8]))

    def _nested_problems(self, row: dict, record: Record) -> list[str]:
        """A row's nested values are its record's; a nested field added to the schema is null in
        rows written before (or the record's value, if a backfill or rewind wrote it again) and
        the record's value in every row of a record past the committed end when it was added."""
        want = nested_values(record.order_id)
        addr, lines = row["addr"] or {}, row["lines"] or []
        got = {
            "addr.zip": addr.get("zip"),
            "addr.geo.lat": (addr.get("geo") or {}).get("lat"),
            "lines.qty": [line.get("qty") for line in lines] if lines else None,
        }
        expected = {
            "addr.zip": want["addr"]["zip"],
            "addr.geo.lat": want["addr"]["geo"]["lat"],
            "lines.qty": [line["qty"] for line in want["lines"]] if want["lines"] else None,
        }
        where = f"sink row {record.partition}:{record.offset} (order {record.order_id})"
        problems = []
        if addr.get("city") != want["addr"]["city"] or [line.get("sku") for line in lines] != [line["sku"] for line in want["lines"]]:
            problems.append(f"{where} holds addr {addr} and lines {lines}; the record has {want}")
        for stage, name in enumerate(NESTED_ADDED):
            if stage >= self.model.nested_stage:
                if got[name] not in (None, [None] * len(lines)):
                    problems.append(f"{where}: {name} = {got[name]} before the schema has it")
                continue
            inc, ends_then = self.model.nested_added[stage]
            end_then = ends_then.get(record.partition) if inc == record.incarnation else None
            written_after = record.incarnation > inc or (record.incarnation == inc and record.offset >= (end_then or 0))
            empty = got[name] is None or (name == "lines.qty" and got[name] == [None] * len(lines))
            if empty and written_after and expected[name] is not None:
                problems.append(
                    f"{where}: {name} is null, but the record lies past the committed end "
                    f"{end_then} when the field was added (it should hold {expected[name]})"
                )
            elif not empty and got[name] != expected[name]:
                problems.append(f"{where}: {name} = {got[name]}, the record's is {expected[name]}")
        return problems

    def check_keyed(self, final: bool = False) -> None:
        """The keyed sink against the model: per key (the record key's timestamp), the newest
        committed record by the ordering rule, computed here from the records the campaign
        produced; no row for a key whose newest record is a tombstone; one row per key."""
        if not storage.is_table(self.keyed.layout.sink):
            return
        ends = self._committed_ends(self.keyed)
        _, _, live, epoch_of = self._history(self.keyed)
        gaps = self._gaps(self.keyed_name, live, epoch_of)
        in_gap = _in_gaps(gaps)
        # the key's last record per topic-partition (a record of a later creation of the topic is later)
        state: dict[tuple[int, int], Record] = {}
        for (inc, p, o), record in self.model.records.items():
            end = self._ends_of(self.keyed_name, inc, ends).get(p)
            if record.state != "visible" or end is None or o >= end or (record.order_id is None and not record.tombstone):
                continue
            if in_gap(inc, p, o):
                continue
            held = state.get((record.slot_us, p))
            if held is None or (inc, o) > (held.incarnation, held.offset):
                state[(record.slot_us, p)] = record
        newest: dict[int, Record] = {}
        for (slot, _), record in state.items():
            held = newest.get(slot)
            rank = (record.timestamp_ms or 0, record.partition, record.incarnation, record.offset)
            if held is None or rank > (held.timestamp_ms or 0, held.partition, held.incarnation, held.offset):
                newest[slot] = record
        expected = {slot: r.order_id for slot, r in newest.items() if not r.tombstone}
        rows = _plain_rows(self.keyed.layout.sink, ["slot", "order_id"])
        slots = pc.cast(rows["slot"], pa.int64()).to_pylist()
        got: dict[int, int] = {}
        problems = []
        for slot, order_id in zip(slots, rows["order_id"].to_pylist(), strict=True):
            if slot in got:
                problems.append(f"key {_iso_us(slot)} has two rows: orders {got[slot]} and {order_id}")
            got[slot] = order_id
        if got != expected:
            differ = sorted(k for k in set(got) | set(expected) if got.get(k) != expected.get(k))
            problems.append(
                f"the keyed sink differs from the model on {len(differ)} keys: "
                + ", ".join(f"{_iso_us(k)}: sink order {got.get(k)}, model {expected.get(k)} ({newest.get(k)})" for k in differ[:5])
            )
        self.stats["last_keyed_rows"] = len(got)
        self.stats["last_keyed_deleted"] = sum(r.tombstone for r in newest.values())
        if final:
            lso = _last_stable(self.bootstrap, self.topic, self.partitions)
            behind = {p: (ends.get(p), lso[p]) for p in lso if (ends.get(p) or 0) < lso[p] and lso[p] > 0}
            if behind:
                problems.append(f"after the final run the keyed pipeline's partitions are behind their LSO: {behind}")
        if problems:
            self.stats["keyed_problems"] += len(problems)
            raise InvariantBroken(f"seed {self.seed} after {self.stats['steps']} steps, keyed sink: " + "; ".join(problems[:6]))

    def _engine_records(self, config) -> dict[object, list[tuple[tuple, Record]]]:
        """Per key (the slot; the customer for the aggregate by customer), the committed records a
        merge engine's pipeline holds (valid ones and tombstones; malformed ones, and those of a
        null customer, are dead letters), ranked as the engines order them: (record time,
        partition, epoch, offset)."""
        name = config.name
        by_customer = name == self.customer_name
        ends = self._committed_ends(config)
        _, _, live, epoch_of = self._history(config)
        gaps = self._gaps(name, live, epoch_of)
        in_gap = _in_gaps(gaps)
        epochs = self.model.epoch_incarnation[name]
        by_key: dict[int, list[tuple[tuple, Record]]] = {}
        for (inc, p, o), record in self.model.records.items():
            end = self._ends_of(name, inc, ends).get(p)
            if record.state != "visible" or end is None or o >= end or (record.order_id is None and not record.tombstone):
                continue
            if in_gap(inc, p, o) or inc not in epochs:
                continue
            if by_customer and (record.order_id is None or record.customer is None):
                continue
            rank = (record.timestamp_ms or 0, p, epochs.index(inc), o)
            by_key.setdefault(record.customer if by_customer else record.slot_us, []).append((rank, record))
        return {slot: sorted(ranked, key=lambda r: r[0]) for slot, ranked in by_key.items()}

    def check_engine(self, final: bool = False) -> None:
        """Each merge engine against the model, computed here from what the campaign produced,
        in the engines' order (record time, partition, epoch, offset): the aggregate holds per key
        the count, sum, min, max, first and last order id of its committed records; first_row
        each key's first record; partial_update per column the newest non-null value since the key's
        newest tombstone (its delete), no row where the newest record is one. Tombstones are dead letters of the other two."""

        def aggregate(ranked: list[tuple[tuple, Record]]) -> tuple | None:
            ids = [r.order_id for _, r in ranked if r.order_id is not None]
            return (len(ids), sum(ids), min(ids), max(ids), ids[0], ids[-1]) if ids else None

        def first_row(ranked: list[tuple[tuple, Record]]) -> tuple | None:
            ids = [r.order_id for _, r in ranked if r.order_id is not None]
            return (ids[0], ranked_customer(ranked, ids[0])) if ids else None

        def partial_update(ranked: list[tuple[tuple, Record]]) -> tuple | None:
            # each column: the newest non-null value of the records after the key's newest delete
            if ranked[-1][1].tombstone:
                return None
            deleted = max((i for i, (_, r) in enumerate(ranked) if r.tombstone), default=-1)
            after = [r for _, r in ranked[deleted + 1 :]]
            return (after[-1].order_id, next((r.customer for r in reversed(after) if r.customer is not None), None))

        def ranked_customer(ranked: list[tuple[tuple, Record]], order_id: int) -> str | None:
            return next(r.customer for _, r in ranked if r.order_id == order_id)

        columns = {
            self.engine_name: (["records", "sum_id", "min_id", "max_id", "first_id", "last_id"], aggregate),
            self.first_name: (["order_id", "customer"], first_row),
            self.partial_name: (["order_id", "customer"], partial_update),
            self.customer_name: (["records", "sum_id", "min_id", "max_id", "first_id", "last_id"], aggregate),
        }
        problems = []
        for engine in self.engines:
            if not storage.is_table(engine.layout.sink):
                continue
            wanted, model = columns[engine.name]
            expected = {slot: row for slot, ranked in self._engine_records(engine).items() if (row := model(ranked)) is not None}
            key = engine.sink.key[0]
            rows = _plain_rows(engine.layout.sink, [key, *wanted])
            slots = pc.cast(rows[key], pa.int64()).to_pylist() if key == "slot" else rows[key].to_pylist()
            got = {slot: tuple(r[c] for c in wanted) for slot, r in zip(slots, rows.to_pylist(), strict=True)}
            if len(got) != len(slots):
                problems.append(f"{engine.name} has {len(slots)} rows for {len(got)} keys")
            if got != expected:
                differ = sorted(k for k in set(got) | set(expected) if got.get(k) != expected.get(k))
                problems.append(
                    f"{engine.name} differs from the model on {len(differ)} keys: "
                    + ", ".join(f"{_shown(k, key)}: sink {got.get(k)}, model {expected.get(k)}" for k in differ[:5])
                )
            self.stats[f"last_engine_keys:{engine.sink.mode}{':customer' if key == 'customer' else ''}"] = len(got)
            if engine.sink.fold_after_seconds is not None and engine.sink.fold_after:
                state = state_table.pinned(engine, storage.table(engine.layout.sink))
                self.stats["last_folded_offsets"] = sum(state_table.folded_below(state).values())
            if final:
                ends = self._committed_ends(engine)
                lso = _last_stable(self.bootstrap, self.topic, self.partitions)
                behind = {p: (ends.get(p), lso[p]) for p in lso if (ends.get(p) or 0) < lso[p] and lso[p] > 0}
                if behind:
                    problems.append(f"after the final run {engine.name}'s partitions are behind their LSO: {behind}")
        self.stats["last_engine_keys"] = self.stats["last_engine_keys:aggregate"]
        if problems:
            self.stats["engine_problems"] += len(problems)
            raise InvariantBroken(f"seed {self.seed} after {self.stats['steps']} steps, merge engines: " + "; ".join(problems[:6]))

    def check_kafka_sink(self, final: bool = False) -> None:
        """The Kafka-sink pipeline against the model, read back with plain read_committed
        consumers (kafka_truth): every committed record of the current topic below the group's
        committed offset is in the output topic exactly once among the records marked ingest or
        stream (valid ones: its order id, customer, amount; keyed by its customer when the sink
        has that key) or exactly once in the dead-letter topic (malformed ones and tombstones,
        with a reason), unless delete_records took it before the pipeline read it; nothing else
        is there. Republished (``backfill``) records are committed records of the model too."""
        ends = self._kafka_ends()
        sink = self.kafka.sink
        # Unchanged topics, group offsets and lost offsets give the same outcome: the model's
        # records below the group's offsets never change (an open transaction's lie above them).
        marks = (
            sink.topic,
            [last_stable_offsets(self.bootstrap, t) for t in sink.output_topics],
            last_stable_offsets(self.bootstrap, sink.dead_letters_to),
            ends,
            repr(self.kafka_lost),
        )
        if marks == self._kafka_checked_at and not final:
            return
        by_coords = {(r.partition, r.offset): r for r in self.model.current()}
        problems: list[str] = []
        counted: dict[bool, Counter] = {True: Counter(), False: Counter()}  # valid (output topic) / malformed (dead letters)
        routed = sink.routes.mapping() if sink.routes is not None else {}
        for valid, topic in [*((True, t) for t in sink.output_topics), (False, sink.dead_letters_to)]:
            for record in read_records(self.bootstrap, topic):
                h = _headers(record)
                kind = h.get("offsetlake.kind")
                try:
                    coords = (int(h["offsetlake.partition"]), int(h["offsetlake.offset"]))
                except (KeyError, TypeError, ValueError):
                    problems.append(f"{topic} {record.partition}:{record.offset} has no source coordinates in its headers: {h}")
                    continue
                if h.get("offsetlake.topic") != self.topic:
                    problems.append(f"{topic} {record.partition}:{record.offset} names source topic {h.get('offsetlake.topic')}")
                if kind in ("ingest", "stream"):
                    counted[valid][coords] += 1
                elif kind != "backfill":
                    problems.append(f"{topic} {record.partition}:{record.offset} is marked {kind}")
                source = by_coords.get(coords)
                if source is None or source.state != "visible" or (source.order_id is not None) != valid:
                    what = "valid" if valid else "malformed"
                    problems.append(f"{topic} holds source record {coords} ({kind}), which is not a committed {what} record ({source})")
                    continue
                if not valid:
                    if not h.get("offsetlake.reason"):
                        problems.append(f"dead letter of {coords} carries no reason")
                    continue
                belongs = routed.get(source.customer, sink.topic) if source.customer is not None else sink.topic
                if topic != belongs:
                    problems.append(f"{topic} holds the record of {coords} (customer {source.customer!r}), which routes to {belongs}")
                value = json.loads(record.value or b"null") or {}
                want = {"order_id": source.order_id, "customer": source.customer, "amount": amount_published(source.order_id)}
                if {k: value.get(k) for k in want} != want:
                    problems.append(f"{topic} record of {coords} holds {value}, the record {want}")
                if not sink.key or source.customer is None:
                    keys: set = {None}
                else:  # an empty key may come back as no key
                    keys = {source.customer.encode(), *([None] if source.customer == "" else [])}
                if record.key not in keys:
                    problems.append(f"{topic} record of {coords} has key {record.key!r}, the record's customer is {source.customer!r}")
        expected: dict[bool, set] = {True: set(), False: set()}
        lost = 0
        for r in self.model.current():
            end = ends.get(r.partition)
            if r.state != "visible" or end is None or r.offset >= end:
                continue
            if any(a <= r.offset < b for a, b in self.kafka_lost.get(r.partition, ())):
                lost += 1
                continue
            expected[r.order_id is not None].add((r.partition, r.offset))
        for valid, label in ((True, "output topic"), (False, "dead-letter topic")):
            got, want = counted[valid], expected[valid]
            missing, extra = sorted(want - set(got)), sorted(set(got) - want)
            twice = sorted(k for k, n in got.items() if n > 1)
            if missing or extra or twice:
                self.stats["records_lost"] += len(missing)
                self.stats["duplicates_found"] += len(twice)
                problems.append(
                    f"the {label} ({len(got)} records) differs from the model below the group's offsets {ends} "
                    f"(lost to deletes {self.kafka_lost}): missing {len(missing)} {missing[:5]}, beyond {len(extra)} {extra[:5]}, "
                    f"twice {len(twice)} {twice[:5]}"
                )
        self.stats["last_kafka_sink_rows"] = sum(counted[True].values())
        self.stats["last_kafka_sink_dead"] = sum(counted[False].values())
        self.stats["last_kafka_sink_lost"] = lost
        group = self._kafka_group_offsets()
        wrong = {p: (g, ends.get(p)) for p, g in group.items() if g is not None and g != ends.get(p)}
        if wrong:  # expired or deleted (None) is Kafka's to do; anything else must equal the commit log
            problems.append(f"the Kafka sink's group offsets differ from its commit log's ends (group, log): {wrong}")
        if final:
            lso = _last_stable(self.bootstrap, self.topic, self.partitions)
            behind = {
                p: (ends.get(p), lso[p])
                for p in lso
                if (ends.get(p) if ends.get(p) is not None else self.model.deleted_below.get(p, 0)) < lso[p]
            }
            if behind:
                problems.append(f"after the final run the Kafka sink's commit log is behind the LSO: {behind}")
        if problems:
            raise InvariantBroken(f"seed {self.seed} after {self.stats['steps']} steps, Kafka sink: " + "; ".join(problems[:6]))
        self._kafka_checked_at = marks

    def check_outbox(self, final: bool = False) -> None:
        """The outbox topic replayed as its guide tells a consumer to (per source record, the rows
        of the highest sink version seen: offsetlake.embedded.checker, plain confluent-kafka and
        deltalake) equals the plain pipeline's sink table at every version it has published; its
        record keys are the rows' order ids; it is in sink version order, and after the final
        publish its progress is the sink's last version. Versions checked once stay checked (what
        a published version holds never changes)."""
        from offsetlake.embedded.checker import outbox_replay, read_committed, sink_view
        from offsetlake.outbox import PROGRESS_TOPIC

        if not storage.is_table(self.config.layout.sink):
            return
        if PROGRESS_TOPIC not in AdminClient({"bootstrap.servers": self.bootstrap}).list_topics(timeout=30).topics:
            marks: tuple = (None, None)
        else:
            marks = (last_stable_offsets(self.bootstrap, self.outbox_topic), last_stable_offsets(self.bootstrap, PROGRESS_TOPIC))
        if marks == self._outbox_checked_at and not final:
            return
        key = f"{self.name}>{self.outbox_topic}".encode()
        progress = -1
        if marks[1] is not None:
            for record in read_records(self.bootstrap, PROGRESS_TOPIC):
                if record.key == key and record.value:
                    progress = int(json.loads(record.value)["version"])
        seen = list(read_committed(self.bootstrap, self.outbox_topic))
        problems = []
        for record in seen:
            if record.headers.get("offsetlake.op") == "row":
                order_id = (json.loads(record.value or b"null") or {}).get("order_id")
                if record.key is None or order_id is None or int(record.key) != order_id:
                    problems.append(f"outbox record {record.offset}: key {record.key!r}, order id {order_id}")
        versions = [int(r.headers["offsetlake.sink_version"]) for r in seen]
        if versions != sorted(versions):
            problems.append(f"the outbox is not in sink version order: {[v for v, w in itertools.pairwise(versions) if w < v][:5]}")
        if max(versions, default=-1) > progress:
            problems.append(f"the outbox holds records of sink version {max(versions)}, past its progress {progress}")
        sink = self.config.layout.sink
        for version in range(self._outbox_verified + 1, progress + 1):
            replayed, table = outbox_replay(seen, version), sink_view(sink.path, version, dict(sink.options) if sink.options else None)
            if replayed != table:
                missing, stale = sorted(set(table) - set(replayed)), sorted(set(replayed) - set(table))
                differ = sorted(c for c in set(table) & set(replayed) if table[c] != replayed[c])
                self.stats["records_lost"] += len(missing)
                self.stats["duplicates_found"] += sum(max(len(replayed[c]) - len(table[c]), 0) for c in differ)
                problems.append(
                    f"a consumer of the outbox differs from the sink at version {version}: missing {len(missing)} {missing[:3]}, "
                    f"stale {len(stale)} {stale[:3]}, differing {len(differ)} {differ[:3]}"
                )
                break
            self._outbox_verified = version
        last = storage.table(sink).version()
        if final and progress < last and any(c.version > progress for c in self._sink_data_commits()):
            problems.append(f"after the final publish the outbox's progress is sink version {progress}, the sink's last {last}")
        self.stats["last_outbox_commits_published"] = len(set(versions))
        self.stats["last_outbox_records"] = len(seen)
        if problems:
            raise InvariantBroken(f"seed {self.seed} after {self.stats['steps']} steps, outbox: " + "; ".join(problems[:6]))
        self._outbox_checked_at = marks

    def _sink_data_commits(self) -> list:
        """The plain pipeline's sink commits that the outbox publishes (offsetlake's; no foreign writes here)."""
        from offsetlake.history import sink_commits

        return sink_commits(storage.table(self.config.layout.sink), self.name)

    def rewind_a_backfill(self) -> None:
        """A backfill of a committed range of the plain pipeline, then a rewind to the batch before
        it, which undoes the backfill and restores the rows it replaced; then the outbox publishes
        both (issue 48, finding 3: a consumer lost the restored rows)."""
        from offsetlake.errors import RewindError
        from offsetlake.history import live_commits, sink_commits
        from offsetlake.rewind import rewind_pipeline

        if not storage.is_table(self.config.layout.sink):
            self.stats["skipped:rewind_a_backfill"] += 1
            return
        before = [c for c in live_commits(sink_commits(storage.table(self.config.layout.sink), self.name)) if str(c.kind) == "ingest"]
        if not before:
            self.stats["skipped:rewind_a_backfill"] += 1
            return
        self.backfill()
        try:
            rewind_pipeline(self.config, before[-1].batch_id, reason="campaign: undo a backfill")
        except RewindError as refused:  # of an earlier epoch, or its files vacuumed
            self.log(f"campaign: rewind of a backfill refused: {refused}")
            self.stats["rewinds_refused"] += 1
        else:
            self.stats["rewinds_of_backfills"] += 1
        self._publish_outbox()

    def _kafka_sink_batches(self) -> int:
        """The Kafka sink's committed ingest batches, from its commit log (for the figures)."""
        from offsetlake.kafka_commit import kafka_sink_commits

        return sum(1 for c in kafka_sink_commits(self.kafka) if str(c.kind) in ("ingest", "stream"))


def _consumer_view(bootstrap: str, topic: str, lso: dict[int, int], timeout_s: float = 120) -> dict[tuple[int, int], int | None]:
    """(partition, offset) -> order id (None: malformed) of every record a plain read_committed
    consumer sees from each partition's log start to its LSO."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"campaign-truth-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "enable.partition.eof": True,
            "receive.message.max.bytes": 200_000_000,
        }
    )
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in lso])
    seen: dict[tuple[int, int], int | None] = {}
    done = {p for p, end in lso.items() if end == 0}
    deadline = time.monotonic() + timeout_s
    try:
        while len(done) < len(lso):
            if time.monotonic() > deadline:
                raise InvariantBroken(f"a plain consumer did not reach the LSO {lso} of {topic} in {timeout_s}s")
            for message in consumer.consume(1000, 0.5):
                p = message.partition()
                if message.error():
                    if message.error().code() == KafkaError._PARTITION_EOF and message.offset() >= lso[p]:
                        done.add(p)
                    continue
                if message.offset() >= lso[p]:
                    done.add(p)
                    continue
                try:
                    seen[(p, message.offset())] = int(json.loads(message.value())["order_id"])
                except (ValueError, TypeError, KeyError):
                    seen[(p, message.offset())] = None
                if message.offset() + 1 >= lso[p]:
                    done.add(p)
    finally:
        consumer.close()
    return seen


def _latest_commit(table: str) -> int | None:
    """The version of a local Delta table's latest commit, from its log's file names (None: no table)."""
    try:
        names = os.listdir(Path(table) / "_delta_log")
    except FileNotFoundError:
        return None
    versions = [int(n.split(".")[0]) for n in names if n.endswith(".json") and n.split(".")[0].isdigit()]
    return max(versions, default=None)


def _in_gaps(gaps: list[tuple[int, int, int, int]]):
    """A test of (incarnation, partition, offset) against gaps as ``_gaps`` lists them: the model
    loops run it for every record, so the gaps are grouped by (incarnation, partition) first."""
    spans: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for inc, p, a, b in gaps:
        spans.setdefault((inc, p), []).append((a, b))
    return lambda inc, p, o: any(a <= o < b for a, b in spans.get((inc, p), ()))


def _simulated_crash(_name: str) -> None:
    raise failpoints.SimulatedCrash()


def _headers(record) -> dict[str, str | None]:
    """A record's headers as text (kafka_truth.Record)."""
    return {k: (v.decode() if isinstance(v, bytes) else v) for k, v in record.headers}


def _end_transaction(producer: Producer, sent: list[Record], commit: bool) -> None:
    """Commit or abort; a transaction left open past its ``transaction.timeout.ms`` (librdkafka's
    default, 60 s: an open transaction spans steps) was aborted by the broker's coordinator, which
    fenced this producer: its records are aborted, as a read_committed consumer sees them."""
    from confluent_kafka import KafkaError, KafkaException

    try:
        if commit:
            producer.commit_transaction(30)
        else:
            producer.abort_transaction(30)
    except KafkaException as err:
        fenced = (KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH)
        if not err.args or err.args[0].code() not in fenced:
            raise
        commit = False
    for record in sent:
        record.state = "visible" if commit else "aborted"


def _iso_ms(ms: int) -> str:
    """A Kafka record time (ms) as the ISO-8601 UTC string a backfill by time takes, exactly."""
    return (datetime(1970, 1, 1, tzinfo=UTC) + timedelta(milliseconds=ms)).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _shown(key: object, column: str) -> str:
    """A merge engine's key as a message shows it: a slot as its time, a customer quoted."""
    return _iso_us(key) if column == "slot" else repr(key)  # type: ignore[arg-type]


def _iso_us(us: int) -> str:
    """A key slot (microseconds since the epoch) as the ISO-8601 UTC text a JSON key carries."""
    return (datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=us)).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _new_topic(topic: str, partitions: int):
    from confluent_kafka.admin import NewTopic

    return NewTopic(topic, num_partitions=partitions, replication_factor=1)


def _last_stable(bootstrap: str, topic: str, partitions: int) -> dict[int, int]:
    from confluent_kafka import IsolationLevel
    from confluent_kafka.admin import OffsetSpec

    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.list_offsets(
        {TopicPartition(topic, p): OffsetSpec.latest() for p in range(partitions)}, isolation_level=IsolationLevel.READ_COMMITTED
    )
    return {tp.partition: f.result().offset for tp, f in futures.items()}


def _kill_group(pgid: int) -> None:
    """Leftovers of a killed run (its Spark JVM) go with its process group."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=int(os.environ.get("SEED", "1")))
    parser.add_argument("--steps", type=int, default=int(os.environ.get("STEPS", "200")))
    parser.add_argument("--work", type=Path, help="folder for the lake and broker data (default: a temp folder)")
    parser.add_argument("--figures", type=Path, help="append the final figures as a JSON line to this file")
    parser.add_argument("--minutes", type=float, help="draw no new step after this long; the final phase still runs")
    parser.add_argument(
        "--no-kafka-sinks", action="store_true", help="leave out the Kafka sink's and the outbox's steps and checks (the CI test does)"
    )
    parser.add_argument(
        "--kafka-audit-every",
        type=int,
        default=1,
        metavar="N",
        help="audit against Kafka after every N-th step (default 1: every step), the Delta-only "
        "audit after the others; the final phase always audits against Kafka",
    )
    parser.add_argument(
        "--verify-audit-skips",
        action="store_true",
        help="run the Delta-only audits the campaign skips because their inputs did not change, and fail if one "
        "says anything else than the last audit of those inputs (the check of that skipping)",
    )
    args = parser.parse_args()
    import faulthandler
    import logging
    import resource
    import tempfile

    faulthandler.enable()  # a crash in native code (librdkafka, delta-rs, Arrow) prints every thread's stack
    # ... and leaves a core file (this process and the CLI runs it starts) for gdb's native stack:
    # where the kernel puts it is /proc/sys/kernel/core_pattern ("core": the crashed process's folder).
    _, hard = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (hard, hard))

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    sys.path.insert(0, str(ROOT))
    from offsetlake.embedded.local_broker import broker_for
    from offsetlake.spark import stop_spark

    work = args.work or Path(tempfile.mkdtemp(prefix="offsetlake-torture-"))
    # Group offsets of a memberless group (the Kafka sink's) expire a minute after their last
    # commit here, not after 7 days: the campaign meets what an idle week does (issue 48, finding 2)
    expiry = {} if args.no_kafka_sinks else {"offsets.retention.minutes": "1", "offsets.retention.check.interval.ms": "5000"}
    with broker_for(work / "broker", settings=expiry) as (bootstrap, broker):
        try:
            campaign = Campaign(
                args.seed,
                args.steps,
                bootstrap,
                work,
                broker.restart if broker else None,
                log=lambda line: print(line, flush=True),
                kafka_audit_every=args.kafka_audit_every,
                kafka_sinks=not args.no_kafka_sinks,
                verify_audit_skips=args.verify_audit_skips,
            )
            figures = campaign.run(args.minutes)
        finally:
            stop_spark()
    if args.figures:
        with args.figures.open("a") as out:
            out.write(json.dumps(figures) + "\n")
    return 0


def _plain_rows(sink, columns: list[str]):
    """A keyed sink's rows as a plain ``deltalake`` reader sees them, with no filter: a column
    only offsetlake should see (the state, hidden markers) is itself a problem."""
    table = storage.table(sink)
    private = [c for c in table.schema().to_arrow().names if c in ("_offsetlake_hidden", "_offsetlake_state")]
    if private:
        raise AssertionError(f"the sink {sink} has offsetlake-private columns {private}: a plain reader sees them")
    return table.to_pyarrow_dataset().to_table(columns=columns)


if __name__ == "__main__":
    from offsetlake.cli import exit_now

    exit_now(main())
