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
id; it runs and backfills beside them, and its maintenance is checked to leave its files. After
EVERY step the invariants are checked twice. First against an independent model — what the
campaign itself produced, with offsets and timestamps from the producer's delivery reports —
and plain deltalake reads of the sink, dead letters and ledger:

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
  epoch and offset.

Then with offsetlake's own audit against Kafka (``audit_pipeline(against_kafka=True)``), which
reads every committed range back from the broker: the two checks are written apart, so a bug
shared by offsetlake and its audit still meets the model, and a model blind spot the audit.

    .venv/bin/python tests/fault_campaign.py --seed 7 --steps 2000      (or: make torture SEED=7 STEPS=2000)

The CI version (tests/test_fault_campaign.py) runs a fixed seed for 23 steps; the first steps
are one of each kind (records and a batch first, a rewind last, the rest in a seeded order), so
every kind of fault is exercised (23 steps cover them all).
"""

from __future__ import annotations

import argparse
import bisect
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
from confluent_kafka import Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewPartitions

from offsetlake import dead_letters, storage

ROOT = Path(__file__).resolve().parent.parent
FAILPOINTS = ("after_plan", "after_read", "after_files_written", "after_commit", "after_ledger")
MAX_PARTITIONS = 4
SCHEMA = {"order_id": "long", "customer": "string", "amount": "double"}
# The sink is partitioned by customer: null and "" (both the default partition folder, issue 35
# finding 1) and values Spark escapes in folder names, next to plain ones.
CUSTOMERS = ["a", "", None, "b", "q?r#s", "x%20y", "São Paulo", "k:v=1"]
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
        self, seed: int, steps: int, bootstrap: str, work: Path, restart_broker=None, log=print, kafka_audit_every: int = 1
    ) -> None:
        self.rng = random.Random(seed)
        self.seed, self.steps = seed, steps
        self.kafka_audit_every = kafka_audit_every
        self.bootstrap = bootstrap
        self.work = work
        self.restart_broker = restart_broker
        self.log = log
        self.model = Model()
        self.stats: Counter = Counter()
        self.open_txn: tuple[Producer, list[Record]] | None = None
        self.cli_run_seconds = 12.0  # how long an unkilled `offsetlake run` took, for kill timing
        suffix = uuid.uuid4().hex[:8]
        self.name, self.topic = f"torture_{suffix}", f"torture_{suffix}"
        self.keyed_name = f"{self.name}_keyed"
        self.engine_name = f"{self.name}_agg"
        self.folder = work / "pipelines"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.file = self.folder / f"{self.name}.yaml"
        self.keyed_file = self.folder / f"{self.keyed_name}.yaml"
        self.engine_file = self.folder / f"{self.engine_name}.yaml"
        self.with_extra_field = False
        self.model.epoch_incarnation = {self.name: [0], self.keyed_name: [0], self.engine_name: [0]}
        self.config = self._write_pipeline()
        self.keyed = self._write_keyed_pipeline()
        self.engine = self._write_engine_pipeline()
        admin = AdminClient({"bootstrap.servers": bootstrap})  # held: a dropped client cancels its futures
        admin.create_topics([_new_topic(self.topic, 2)])[self.topic].result(30)
        self.partitions = 2

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

    def _write_engine_pipeline(self):
        """The merge engine's pipeline: the same topic into an aggregate keyed by the record key's
        timestamp (tombstones and malformed records are its dead letters); small batches."""
        from offsetlake.config import load_pipeline

        measures = {f"{f}_id": {f: "order_id"} for f in ("sum", "min", "max", "first", "last")}
        self.engine_file.write_text(
            yaml.safe_dump(
                {
                    "name": self.engine_name,
                    "topic": self.topic,
                    "lake": str(self.work / "lake"),
                    "start": "earliest",
                    "kafka": {"bootstrap_servers": self.bootstrap, "options": {"client.id": "campaign-agg"}},
                    "max_records_per_batch": 250,
                    "read_timeout_seconds": 60,
                    "on_offsets_lost": "skip",
                    "key_format": {"type": "json", "schema": {"slot": "timestamp"}},
                    "format": {"type": "json", "schema": KEYED_SCHEMA, "required": ["order_id"]},
                    "sink": {"mode": "aggregate", "key": ["slot"], "measures": {"records": {"count": "*"}, **measures}, "file_rows": 8},
                },
                sort_keys=False,
            )
        )
        return load_pipeline(str(self.engine_file))

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
        }
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
        first = [k for k in kinds if k not in ("produce", "run", "rewind", "recreate_topic")]
        self.rng.shuffle(first)
        first = ["produce", "run", "recreate_topic", "produce", "run", *first, "rewind"]
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
                self.stats["steps"] += 1
                self.stats[f"step:{kind}"] += 1
                self.check(clean_run=kind == "run")
                self.check_keyed()
                self.check_engine()
                self.audit(against_kafka=(step + 1) % self.kafka_audit_every == 0)
            except InvariantBroken as broken:
                raise InvariantBroken(f"step {step + 1} ({kind}): {broken}") from None
            self.log(f"campaign seed={self.seed} step={step + 1}/{self.steps} kind={kind} took_ms={int((time.monotonic() - t) * 1000)} ok")
        self.finish_open_txn()
        self.run_in_process(to_the_end=True)
        self.check(clean_run=True, final=True)
        self.check_keyed(final=True)
        self.check_engine(final=True)
        self.audit()
        figures = self.figures(time.monotonic() - started)
        self.log("campaign figures " + json.dumps(figures))
        return figures

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
            "engine_backfills": self.stats["engine_backfills"],
            "partitions": self.partitions,
            "duplicates_found": self.stats["duplicates_found"],
            "records_lost": self.stats["records_lost"],
            "checks": self.stats["checks"],
            "checks_with_dead_letters_pending": self.stats["checks_with_dead_letters_pending"],
            "audits_against_kafka": self.stats["audits_against_kafka"],
            "audits_of_delta_only": self.stats["audits_of_delta_only"],
            "skipped_steps": {k.removeprefix("skipped:"): v for k, v in sorted(self.stats.items()) if k.startswith("skipped:")},
            "steps_by_kind": {k.removeprefix("step:"): v for k, v in sorted(self.stats.items()) if k.startswith("step:")},
        }

    # ---- steps: producing -----------------------------------------------------------------
    def _values(self, count: int, malformed_share: float, tombstone_share: float = 0.0) -> list[tuple[int | None, bytes | None, int]]:
        """(order id or None, value or None for a tombstone, key slot in microseconds) per record."""
        values: list[tuple[int | None, bytes | None, int]] = []
        for _ in range(count):
            order_id = self.model.next_id
            self.model.next_id += 1
            slot = self.rng.choice(SLOT_POOL_US)
            draw = self.rng.random()
            if draw < malformed_share:
                values.append((None, b'{"order_id": ' + str(order_id).encode() + b', "cut', slot))
            elif draw < malformed_share + tombstone_share:
                values.append((None, None, slot))
            else:
                body = {
                    "order_id": order_id,
                    "customer": self.rng.choice(CUSTOMERS),
                    "amount": order_id % 1000 / 10,
                    **nested_values(order_id),
                }
                values.append((order_id, json.dumps(body).encode(), slot))
        return values

    def _send(
        self, producer: Producer, count: int, state: str, malformed_share: float = 0.0, txn: str | None = None, tombstone_share: float = 0.0
    ) -> list[Record]:
        sent: list[Record] = []
        failures: list[str] = []
        incarnation = self.model.incarnation
        for order_id, value, slot in self._values(count, malformed_share, tombstone_share):
            partition = self.rng.randrange(self.partitions)

            def delivered(err, msg, order_id=order_id, slot=slot, tombstone=value is None):
                if err is not None:
                    failures.append(str(err))
                else:
                    sent.append(
                        Record(msg.partition(), msg.offset(), order_id, state, txn, msg.timestamp()[1], incarnation, slot, tombstone)
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

        for config in (self.config, self.keyed, self.engine):
            run_pipeline(
                config,
                RunContext(run_id=f"campaign-{uuid.uuid4().hex[:6]}"),
                spark_session,
                max_batches=None if to_the_end else self.rng.choice([1, 2, None]),
                emit=lambda _: None,
            )
        self.stats["runs"] += 1

    def _cli(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        full = {k: v for k, v in os.environ.items() if not k.startswith("OFFSETLAKE_FAILPOINT")}
        full.update(env or {})
        return subprocess.Popen(
            [sys.executable, "-m", "offsetlake", *args, str(self.file)],
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

    def _ensure_pending(self, timeout_s: float = 30.0) -> None:
        """Produce records unless some partition's last stable offset is past its committed end
        (or a gap is due), then wait until the broker reports them stable."""

        def pending() -> bool:
            ends = self._committed_ends()
            lso = _last_stable(self.bootstrap, self.topic, self.partitions)
            return any(lso[p] > (ends.get(p) or self.model.deleted_below.get(p, 0)) for p in lso)

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

        reports = [*maintain(self.config, retention_hours=1, vacuum=True), *maintain(self.keyed, retention_hours=1, vacuum=True)]
        engine_files = len(storage.table(self.engine.layout.sink).file_uris()) if storage.is_table(self.engine.layout.sink) else None
        for report in maintain(self.engine, retention_hours=1, vacuum=True):  # a merge engine's files stay as its merges wrote them
            if report.table == "sink" and (report.compacted_from or report.files_after != engine_files):
                raise InvariantBroken(f"maintenance changed the merge engine's files: {report.as_dict()}")
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

    def engine_backfill(self) -> None:
        """Backfill a random committed range of the merge engine's pipeline (current epoch): its
        contributions there are replaced, each touched key folded again from all of its own."""
        from offsetlake.backfill import plan_backfill
        from offsetlake.ledger import Ledger
        from offsetlake.plan import RunContext
        from offsetlake.runs import execute_recorded_batch
        from offsetlake.spark import spark_session

        ends = self._committed_ends(self.engine)
        candidates = [(p, e) for p, e in ends.items() if e and e > self.model.deleted_below.get(p, 0) + 1]
        if not candidates:
            self.stats["skipped:engine_backfill"] += 1
            return
        partition, end = self.rng.choice(candidates)
        start = self.rng.randrange(self.model.deleted_below.get(partition, 0), end - 1)
        stop = self.rng.randrange(start + 1, end + 1)
        plan = plan_backfill(self.engine, RunContext(run_id=f"campaign-ebackfill-{uuid.uuid4().hex[:6]}"), [partition], start, stop)
        Ledger.of(self.engine).record_plan(plan)
        result = execute_recorded_batch(self.engine, plan.batch_id, spark_session)
        if result.status != "committed":
            raise InvariantBroken(f"engine backfill {plan.describe()} ended {result.status}")
        self.stats["engine_backfills"] += 1

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
        }
        ends = {name: self._committed_ends(config) for name, (config, _) in pipelines.items()}
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
        self.stats["recreations"] += 1

    def restart(self) -> None:
        self.finish_open_txn()  # a transaction coordinator's state across restarts is not under test
        if not self.model.current():
            return  # noida-db (the earlier test broker) dropped a topic without records at a restart; Kafka does not
        self.restart_broker(wait_for_topics=[self.topic])

    # ---- the invariants -------------------------------------------------------------------
    def audit(self, against_kafka: bool = True) -> None:
        """offsetlake's own audit; against Kafka it reads every committed range back from the broker.

        That read costs about 0.5 s per committed range ending on a transaction marker (measured
        here: 6.1 s for 24 ranges after 6 runs, 14 s per step by step 58 of seed 3), so it grows
        with the batches committed: long campaigns may run it every N steps (``--kafka-audit-every``)
        and the Delta-only audit on the others.
        """
        from offsetlake.audit import audit_pipeline

        for config in (self.config, self.keyed, self.engine):
            if not storage.is_table(config.layout.sink):
                continue
            report = audit_pipeline(config, against_kafka=against_kafka)
            if not report.ok:
                raise InvariantBroken(
                    f"seed {self.seed} after {self.stats['steps']} steps: offsetlake's audit of "
                    f"{config.name}{' against Kafka' if against_kafka else ''} failed:\n{report.text()}"
                )
        self.stats["audits_against_kafka" if against_kafka else "audits_of_delta_only"] += 1

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
            data = dataset.to_table(columns=["_kafka_partition", "_kafka_offset", "order_id", "_kafka_timestamp", "addr", "lines", *extra])
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
            problems += self._nested_problems(row, record)
        for inc, p, o in dead:
            record = self.model.records.get((inc, p, o))
            if record is None or record.state != "visible" or record.order_id is not None:
                problems.append(f"dead letter {p}:{o} (topic creation {inc}) is not a committed malformed record or tombstone ({record})")

        gaps = self._gaps(self.name, live, epoch_of)
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
            if any(gi == inc and gp == p and a <= o < b for gi, gp, a, b in gaps):
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
        # the key's last record per topic-partition (a record of a later creation of the topic is later)
        state: dict[tuple[int, int], Record] = {}
        for (inc, p, o), record in self.model.records.items():
            end = self._ends_of(self.keyed_name, inc, ends).get(p)
            if record.state != "visible" or end is None or o >= end or (record.order_id is None and not record.tombstone):
                continue
            if any(gi == inc and gp == p and a <= o < b for gi, gp, a, b in gaps):
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
        from offsetlake.keyed import current_rows

        rows = current_rows(storage.table(self.keyed.layout.sink), ["slot", "order_id"])
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

    def check_engine(self, final: bool = False) -> None:
        """The merge engine's aggregate against the model: per key, the count, sum, min, max,
        first and last order id of its committed records, computed here from what the campaign
        produced, first and last by (record time, partition, epoch, offset)."""
        if not storage.is_table(self.engine.layout.sink):
            return
        ends = self._committed_ends(self.engine)
        _, _, live, epoch_of = self._history(self.engine)
        gaps = self._gaps(self.engine_name, live, epoch_of)
        epochs = self.model.epoch_incarnation[self.engine_name]
        by_key: dict[int, list[tuple[tuple, int]]] = {}
        for (inc, p, o), record in self.model.records.items():
            end = self._ends_of(self.engine_name, inc, ends).get(p)
            if record.state != "visible" or end is None or o >= end or record.order_id is None:
                continue
            if any(gi == inc and gp == p and a <= o < b for gi, gp, a, b in gaps) or inc not in epochs:
                continue
            rank = (record.timestamp_ms or 0, p, epochs.index(inc), o)
            by_key.setdefault(record.slot_us, []).append((rank, record.order_id))
        expected = {}
        for slot, ranked in by_key.items():
            ids = [i for _, i in sorted(ranked)]
            expected[slot] = (len(ids), sum(ids), min(ids), max(ids), ids[0], ids[-1])
        from offsetlake.keyed import current_rows

        columns = ["records", "sum_id", "min_id", "max_id", "first_id", "last_id"]
        rows = current_rows(storage.table(self.engine.layout.sink), ["slot", *columns])
        slots = pc.cast(rows["slot"], pa.int64()).to_pylist()
        got = {slot: tuple(r[c] for c in columns) for slot, r in zip(slots, rows.to_pylist(), strict=True)}
        problems = []
        if len(got) != len(slots):
            problems.append(f"the aggregate has {len(slots)} rows for {len(got)} keys")
        if got != expected:
            differ = sorted(k for k in set(got) | set(expected) if got.get(k) != expected.get(k))
            problems.append(
                f"the aggregate differs from the model on {len(differ)} keys: "
                + ", ".join(f"{_iso_us(k)}: sink {got.get(k)}, model {expected.get(k)}" for k in differ[:5])
            )
        self.stats["last_engine_keys"] = len(got)
        if final:
            lso = _last_stable(self.bootstrap, self.topic, self.partitions)
            behind = {p: (ends.get(p), lso[p]) for p in lso if (ends.get(p) or 0) < lso[p] and lso[p] > 0}
            if behind:
                problems.append(f"after the final run the merge engine's partitions are behind their LSO: {behind}")
        if problems:
            self.stats["engine_problems"] += len(problems)
            raise InvariantBroken(f"seed {self.seed} after {self.stats['steps']} steps, merge engine: " + "; ".join(problems[:6]))


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
        "--kafka-audit-every",
        type=int,
        default=1,
        metavar="N",
        help="audit against Kafka after every N-th step (default 1: every step), the Delta-only "
        "audit after the others; the final phase always audits against Kafka",
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
    with broker_for(work / "broker") as (bootstrap, broker):
        try:
            campaign = Campaign(
                args.seed,
                args.steps,
                bootstrap,
                work,
                broker.restart if broker else None,
                log=lambda line: print(line, flush=True),
                kafka_audit_every=args.kafka_audit_every,
            )
            figures = campaign.run(args.minutes)
        finally:
            stop_spark()
    if args.figures:
        with args.figures.open("a") as out:
            out.write(json.dumps(figures) + "\n")
    return 0


if __name__ == "__main__":
    from offsetlake.cli import exit_now

    exit_now(main())
