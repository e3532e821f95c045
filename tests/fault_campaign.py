"""Randomized fault campaign: hunt for the interleaving that breaks exactly-once.

A seeded sequence of steps over a real broker, real Spark and real Delta tables: produce
records (plain with some malformed, transactional committed, aborted, or left open), run
batches, run a CLI batch that dies at a random failpoint, SIGKILL a running ``offsetlake run``
at a random moment, backfill a random range of offsets or of record times, rewind to an
earlier batch, compact/checkpoint/vacuum, add or drop a nullable field of the pipeline's schema,
add partitions, delete records (with ``on_offsets_lost: skip``) and restart the broker. After
EVERY step the invariants are checked twice. First against an independent model — what the
campaign itself produced, with offsets and timestamps from the producer's delivery reports —
and plain deltalake reads of the sink, dead letters and ledger:

* every sink row is a committed record, at most once, with its own order id and record time;
  none is aborted or still in an open transaction; a field no record carries reads null;
* every committed record below a partition's committed end is in the sink exactly once (or,
  if malformed, in the dead letters exactly once), unless it lies in a recorded gap;
* gaps are recorded only over offsets the campaign deleted while no live batch held them
  (never ingested, or ingested by a batch a rewind undid);
* the sink's live committed ranges (those no rewind undid) per partition are contiguous, and
  after every clean run the ledger's committed ranges equal them.

Then with offsetlake's own audit against Kafka (``audit_pipeline(against_kafka=True)``), which
reads every committed range back from the broker: the two checks are written apart, so a bug
shared by offsetlake and its audit still meets the model, and a model blind spot the audit.

    .venv/bin/python tests/fault_campaign.py --seed 7 --steps 2000      (or: make torture SEED=7 STEPS=2000)

The CI version (tests/test_fault_campaign.py) runs a fixed seed for 20 steps; the first steps
are one of each kind (records and a batch first, a rewind last, the rest in a seeded order), so
every kind of fault is exercised.
"""

from __future__ import annotations

import argparse
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


class InvariantBroken(AssertionError):
    pass


@dataclass
class Record:
    partition: int
    offset: int
    order_id: int | None  # None: a malformed value (a dead letter)
    state: str  # visible | aborted | open
    txn: str | None = None  # the transactional producer's id, for records sent in a transaction
    timestamp_ms: int | None = None  # the record time the delivery report gave


@dataclass
class Model:
    """What the campaign produced and deleted: the truth the tables are checked against."""

    records: dict[tuple[int, int], Record] = field(default_factory=dict)
    deleted_below: dict[int, int] = field(default_factory=dict)  # partition -> log start we set
    next_id: int = 0


class Campaign:
    def __init__(self, seed: int, steps: int, bootstrap: str, work: Path, restart_broker=None, log=print,
                 kafka_audit_every: int = 1) -> None:
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
        self.folder = work / "pipelines"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.file = self.folder / f"{self.name}.yaml"
        self.with_extra_field = False
        self.config = self._write_pipeline()
        admin = AdminClient({"bootstrap.servers": bootstrap})  # held: a dropped client cancels its futures
        admin.create_topics([_new_topic(self.topic, 2)])[self.topic].result(30)
        self.partitions = 2

    def _write_pipeline(self):
        """(Re)write the pipeline YAML, with or without the extra field, and load it as the CLI
        steps will: they read the same file."""
        from offsetlake.config import load_pipeline

        schema = {**SCHEMA, **dict([EXTRA_FIELD] if self.with_extra_field else [])}
        self.file.write_text(yaml.safe_dump({
            "name": self.name, "topic": self.topic, "lake": str(self.work / "lake"), "start": "earliest",
            "kafka": {"bootstrap_servers": self.bootstrap, "options": {"client.id": "campaign"}},
            "max_records_per_batch": 400, "read_timeout_seconds": 60, "on_offsets_lost": "skip",
            "format": {"type": "json", "schema": schema, "required": ["order_id"]},
            "sink": {"partition_by": ["customer"]},
        }, sort_keys=False))
        return load_pipeline(str(self.file))

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
            "add_partition": (1, self.add_partition),
            "delete_records": (1, self.delete_records),
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
        first = [k for k in kinds if k not in ("produce", "run", "rewind")]
        self.rng.shuffle(first)
        first = ["produce", "run", *first, "rewind"]
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
                self.audit(against_kafka=(step + 1) % self.kafka_audit_every == 0)
            except InvariantBroken as broken:
                raise InvariantBroken(f"step {step + 1} ({kind}): {broken}") from None
            self.log(f"campaign seed={self.seed} step={step + 1}/{self.steps} kind={kind} "
                     f"took_ms={int((time.monotonic() - t) * 1000)} ok")
        self.finish_open_txn()
        self.run_in_process(to_the_end=True)
        self.check(clean_run=True, final=True)
        self.audit()
        figures = self.figures(time.monotonic() - started)
        self.log("campaign figures " + json.dumps(figures))
        return figures

    def figures(self, seconds: float) -> dict:
        visible = [r for r in self.model.records.values() if r.state == "visible"]
        return {
            "seed": self.seed, "steps": self.stats["steps"], "seconds": round(seconds, 1),
            "records_produced": len(self.model.records), "records_committed_in_kafka": len(visible),
            "records_in_sink": self.stats["last_sink_rows"], "dead_letters": self.stats["last_dead_letters"],
            "records_in_recorded_gaps": self.stats["last_in_gaps"],
            "batches_committed": self.stats["commits:ingest"], "runs_in_process": self.stats["runs"],
            "sink_commits": {k.removeprefix("commits:"): v for k, v in sorted(self.stats.items()) if k.startswith("commits:")},
            "failpoint_crashes": self.stats["failpoint_crashes"], "sigkills": self.stats["sigkills"],
            "backfills": self.stats["backfills"], "backfills_by_time": self.stats["backfills_by_time"],
            "rewinds": self.stats["rewinds"], "batches_rewound": self.stats["batches_rewound"],
            "rewinds_refused": self.stats["rewinds_refused"], "maintenance_runs": self.stats["maintenance_runs"],
            "files_vacuumed": self.stats["files_vacuumed"], "schema_changes": self.stats["schema_changes"],
            "broker_restarts": self.stats["step:restart_broker"],
            "partitions": self.partitions, "duplicates_found": self.stats["duplicates_found"],
            "records_lost": self.stats["records_lost"], "checks": self.stats["checks"],
            "checks_with_dead_letters_pending": self.stats["checks_with_dead_letters_pending"],
            "audits_against_kafka": self.stats["audits_against_kafka"],
            "audits_of_delta_only": self.stats["audits_of_delta_only"],
            "skipped_steps": {k.removeprefix("skipped:"): v for k, v in sorted(self.stats.items()) if k.startswith("skipped:")},
            "steps_by_kind": {k.removeprefix("step:"): v for k, v in sorted(self.stats.items()) if k.startswith("step:")},
        }

    # ---- steps: producing -----------------------------------------------------------------
    def _values(self, count: int, malformed_share: float) -> list[tuple[int | None, bytes]]:
        values = []
        for _ in range(count):
            order_id = self.model.next_id
            self.model.next_id += 1
            if self.rng.random() < malformed_share:
                values.append((None, b'{"order_id": ' + str(order_id).encode() + b', "cut'))
            else:
                values.append((order_id, json.dumps({"order_id": order_id, "customer": self.rng.choice(CUSTOMERS),
                                                     "amount": order_id % 1000 / 10}).encode()))
        return values

    def _send(self, producer: Producer, count: int, state: str, malformed_share: float = 0.0,
              txn: str | None = None) -> list[Record]:
        sent: list[Record] = []
        failures: list[str] = []
        for order_id, value in self._values(count, malformed_share):
            partition = self.rng.randrange(self.partitions)

            def delivered(err, msg, order_id=order_id):
                if err is not None:
                    failures.append(str(err))
                else:
                    sent.append(Record(msg.partition(), msg.offset(), order_id, state, txn, msg.timestamp()[1]))

            producer.produce(self.topic, value=value, partition=partition, on_delivery=delivered)
        producer.flush(60)
        if failures or len(sent) != count:
            raise InvariantBroken(f"produce: {len(sent)} of {count} delivered: {failures[:3]}")
        for record in sent:
            self.model.records[(record.partition, record.offset)] = record
        return sent

    def produce(self) -> None:
        producer = Producer({"bootstrap.servers": self.bootstrap, "linger.ms": 5})
        self._send(producer, self.rng.randint(1, 300), "visible", malformed_share=0.03)
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

        run_pipeline(self.config, RunContext(run_id=f"campaign-{uuid.uuid4().hex[:6]}"), spark_session,
                     max_batches=None if to_the_end else self.rng.choice([1, 2, None]), emit=lambda _: None)
        self.stats["runs"] += 1

    def _cli(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        full = {k: v for k, v in os.environ.items() if not k.startswith("OFFSETLAKE_FAILPOINT")}
        full.update(env or {})
        return subprocess.Popen([sys.executable, "-m", "offsetlake", *args, str(self.file)], cwd=ROOT, env=full,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)

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
        plan = plan_backfill(self.config, RunContext(run_id=f"campaign-backfill-{uuid.uuid4().hex[:6]}"),
                             [partition], start, stop)
        Ledger(self.config.ledger_path, self.config.name).record_plan(plan)
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
        for r in self.model.records.values():
            end = ends.get(r.partition)
            if (r.state == "visible" and r.timestamp_ms is not None and end is not None
                    and self.model.deleted_below.get(r.partition, 0) <= r.offset < end):
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
            plan = plan_backfill(self.config, RunContext(run_id=f"campaign-backfill-time-{uuid.uuid4().hex[:6]}"),
                                 [partition], from_time=_iso_ms(from_ms), to_time=_iso_ms(to_ms))
        except BackfillParamsError as err:
            if "selects no committed offsets" not in str(err):
                raise
            self.log(f"campaign: backfill by time skipped: {err}")
            self.stats["skipped:backfill_by_time"] += 1
            return
        Ledger.of(self.config).record_plan(plan)
        result = execute_recorded_batch(self.config, plan.batch_id, spark_session)
        (reprocessed,) = plan.ranges
        expected = [r for r in timed[partition] if reprocessed.start <= r.offset < reprocessed.end
                    and from_ms <= (r.timestamp_ms or 0) < to_ms]
        done = result.total("rows_written") + result.total("dead_letters")
        if result.status != "committed" or done != len(expected):
            raise InvariantBroken(
                f"backfill by time {plan.describe()} ended {result.status} with {result.total('rows_written')} rows and "
                f"{result.total('dead_letters')} dead letters; the model has {len(expected)} committed records of "
                f"{partition}:[{reprocessed.start}, {reprocessed.end}) timed in [{from_ms}, {to_ms}) ms")
        self.stats["backfills_by_time"] += 1

    def rewind(self) -> None:
        """Rewind the pipeline to a random earlier live batch, in this process, as `offsetlake
        rewind` does. Later runs read the rewound offsets again; the model needs no change,
        because it only expects records below each partition's committed end."""
        from offsetlake.errors import RewindError
        from offsetlake.history import rewound_batches, sink_commits
        from offsetlake.plan import BatchKind
        from offsetlake.rewind import rewind_pipeline
        from offsetlake.storage import open_table

        commits = sink_commits(open_table(self.config.sink_path), self.config.name)
        undone = rewound_batches(commits)
        live = [c for c in commits if c.kind != BatchKind.REWIND and c.batch_id not in undone]
        candidates = live[:-1]  # rewinding to the latest live batch changes nothing: no fault
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

        reports = maintain(self.config, retention_hours=1, vacuum=True)
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

        noida-db forgets an aborted transaction once delete_records moves the log start past its
        first record, and then serves its remaining records to read_committed consumers (checked
        here; Apache Kafka keeps the transaction index). That is the test broker's bug, not one
        offsetlake can see, so the campaign never deletes into the middle of an aborted transaction.
        """
        spans: dict[str, tuple[int, int]] = {}
        for record in self.model.records.values():
            if record.partition == partition and record.state == "aborted" and record.txn:
                low, high = spans.get(record.txn, (record.offset, record.offset))
                spans[record.txn] = (min(low, record.offset), max(high, record.offset))
        return {t for low, high in spans.values() for t in range(low + 1, high + 1)}

    def _model_matches_a_consumer(self, lso: dict[int, int]) -> list[str]:
        """The model itself, checked against what a plain read_committed consumer reads now."""
        expected = {(p, o): r.order_id for (p, o), r in self.model.records.items()
                    if r.state == "visible" and o >= self.model.deleted_below.get(p, 0) and o < lso.get(p, 0)}
        seen = _consumer_view(self.bootstrap, self.topic, lso)
        if seen == expected:
            return []
        only_model = sorted(set(expected) - set(seen))[:5]
        only_kafka = sorted(set(seen) - set(expected))[:5]
        differ = sorted(k for k in set(seen) & set(expected) if seen[k] != expected[k])[:5]
        return [f"the campaign's model and a plain consumer disagree: only in the model {only_model}, "
                f"only in Kafka {only_kafka}, different values {differ}"]

    def restart(self) -> None:
        self.finish_open_txn()  # a transaction coordinator's state across restarts is not under test
        if not self.model.records:
            return  # noida-db drops a topic that holds no records when it restarts; Kafka does not
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

        report = audit_pipeline(self.config, against_kafka=against_kafka)
        self.stats["audits_against_kafka" if against_kafka else "audits_of_delta_only"] += 1
        if not report.ok:
            raise InvariantBroken(f"seed {self.seed} after {self.stats['steps']} steps: offsetlake's audit"
                                  f"{' against Kafka' if against_kafka else ''} failed:\n{report.text()}")

    def _committed_ends(self) -> dict[int, int | None]:
        if not storage.is_table(self.config.sink_path):
            return {p: None for p in range(self.partitions)}
        sink = storage.table(self.config.sink_path)
        return {p: sink.transaction_version(self.config.app_id(self.topic, p)) for p in range(self.partitions)}

    def check(self, clean_run: bool, final: bool = False) -> None:
        self.stats["checks"] += 1
        ends = self._committed_ends()
        problems: list[str] = []
        sink_rows: list[tuple[int, int, int, int | None]] = []  # partition, offset, order id, record time (ms)
        commits: list[dict] = []  # the ledger entries of the sink's commits, each with its "version"
        if storage.is_table(self.config.sink_path):
            sink = storage.table(self.config.sink_path)
            dataset = sink.to_pyarrow_dataset()
            extra = [EXTRA_FIELD[0]] if EXTRA_FIELD[0] in dataset.schema.names else []
            data = dataset.to_table(columns=["_kafka_partition", "_kafka_offset", "order_id", "_kafka_timestamp", *extra])
            micros = pc.cast(data["_kafka_timestamp"], pa.int64()).to_pylist()
            sink_rows = list(zip(data["_kafka_partition"].to_pylist(), data["_kafka_offset"].to_pylist(),
                                 data["order_id"].to_pylist(), [None if t is None else t // 1000 for t in micros],
                                 strict=True))
            if extra and pc.count(data[EXTRA_FIELD[0]]).as_py():
                problems.append(f"{pc.count(data[EXTRA_FIELD[0]]).as_py()} sink rows hold a value in "
                                f"'{EXTRA_FIELD[0]}', which no record carries")
            for info in sink.history():
                meta = info.get("userMetadata")
                if meta:
                    commits.append({**json.loads(meta), "version": int(info["version"])})
        # A rewind commit lists the batches it undid: their ranges no longer count (they are read again).
        rewound = {b for c in commits if c.get("kind") == "rewind" for b in c.get("rewound", [])}
        live = [c for c in commits if c.get("kind") != "rewind" and c.get("batch_id") not in rewound]
        dead: list[tuple[int, int]] = []
        # The dead-letter table follows the sink one commit behind at most: a crash between a sink
        # commit and its dead-letter commit leaves that change for the next run to apply (its txn
        # "sink:<sink table id>" says which sink version it holds). Meanwhile the audit counts the pending change.
        changes = [c["version"] for c in commits if "dead_letter_files" in c or "dead_letter_restore" in c]
        dead_pending = bool(changes)
        if storage.is_table(self.config.dead_letter_path):
            dead_table = storage.table(self.config.dead_letter_path)
            d = dead_table.to_pyarrow_dataset().to_table(columns=["_kafka_partition", "_kafka_offset"])
            dead = list(zip(d["_kafka_partition"].to_pylist(), d["_kafka_offset"].to_pylist(), strict=True))
            sink_id = str(storage.table(self.config.sink_path).metadata().id) if changes else ""
            applied = dead_table.transaction_version(dead_letters.applied_app_id(sink_id)) if changes else None
            dead_pending = bool(changes) and (applied is None or applied < max(changes))
        if dead_pending:
            self.stats["checks_with_dead_letters_pending"] += 1

        sink_count = Counter((p, o) for p, o, _, _ in sink_rows)
        dead_count = Counter(dead)
        duplicates = [k for k, n in sink_count.items() if n > 1] + [k for k, n in dead_count.items() if n > 1]
        if duplicates:
            self.stats["duplicates_found"] += len(duplicates)
            problems.append(f"duplicates (partition, offset): {sorted(duplicates)[:10]}")
        for p, o, order_id, time_ms in sink_rows:
            record = self.model.records.get((p, o))
            if record is None or record.state != "visible" or record.order_id != order_id:
                problems.append(f"sink row {p}:{o} order {order_id} is not a committed record ({record})")
            elif ends.get(p) is None or o >= ends[p]:
                problems.append(f"sink row {p}:{o} lies beyond the committed end {ends.get(p)}")
            elif record.timestamp_ms is not None and time_ms != record.timestamp_ms:
                problems.append(f"sink row {p}:{o} has record time {time_ms} ms, the record {record.timestamp_ms} ms")
        for p, o in dead:
            record = self.model.records.get((p, o))
            if record is None or record.state != "visible" or record.order_id is not None:
                problems.append(f"dead letter {p}:{o} is not a committed malformed record ({record})")

        gaps = [(r["partition"], r["start"], r["end"]) for c in live if c.get("kind") == "gap" for r in c["ranges"]]
        for p, a, b in gaps:
            if b > self.model.deleted_below.get(p, 0):
                problems.append(f"gap {p}:[{a}, {b}) covers offsets the campaign never deleted (log start "
                                f"{self.model.deleted_below.get(p, 0)})")
        in_gaps = 0
        lost = []
        for (p, o), record in self.model.records.items():
            if record.state != "visible" or ends.get(p) is None or o >= ends[p]:
                continue
            found = dead_count[(p, o)] if record.order_id is None else sink_count[(p, o)]
            if any(gp == p and a <= o < b for gp, a, b in gaps):
                in_gaps += 1
                if found:
                    problems.append(f"record {p}:{o} is in a recorded gap and also in the tables")
                continue
            if found == 0 and not (record.order_id is None and dead_pending):
                lost.append((p, o))
        if lost:
            self.stats["records_lost"] += len(lost)
            problems.append(f"{len(lost)} committed records below the committed end are missing: {lost[:10]}")

        ranges: dict[int, list[tuple[int, int]]] = {}
        for c in live:
            if c.get("kind") in ("ingest", "gap"):
                for r in c["ranges"]:
                    if r["end"] > r["start"]:
                        ranges.setdefault(r["partition"], []).append((r["start"], r["end"]))
        for p, spans in ranges.items():
            spans.sort()
            for (a1, b1), (a2, b2) in zip(spans, spans[1:], strict=False):
                if a2 != b1:
                    problems.append(f"partition {p}: committed ranges [{a1}, {b1}) and [{a2}, {b2}) are not contiguous")
            if spans[-1][1] != ends.get(p):
                problems.append(f"partition {p}: last committed range ends at {spans[-1][1]}, txn version {ends.get(p)}")
        if clean_run and storage.is_table(self.config.ledger_path):
            ledger = [r for r in storage.table(self.config.ledger_path).to_pyarrow_dataset().to_table().to_pylist()
                      if r["pipeline"] == self.name]
            # the ledger is a log of events: a rewound batch keeps its committed event and gains a rewound one
            rewound_in_ledger = {r["batch_id"] for r in ledger if r["status"] == "rewound"}
            if rewound != rewound_in_ledger:
                problems.append(f"the ledger's rewound batches differ from the sink's rewind commits: only in ledger "
                                f"{sorted(rewound_in_ledger - rewound)[:5]}, only in sink {sorted(rewound - rewound_in_ledger)[:5]}")
            mine = [r for r in ledger if r["status"] in ("committed", "gap") and r["batch_id"] not in rewound_in_ledger
                    and r["kind"] in ("ingest", "gap") and r["end_offset"] > r["start_offset"]]
            ledger_spans = {(r["partition"], r["start_offset"], r["end_offset"]) for r in mine}
            sink_spans = {(p, a, b) for p, spans in ranges.items() for a, b in spans}
            if ledger_spans != sink_spans:
                problems.append(f"ledger committed ranges differ from the sink's: only in ledger "
                                f"{sorted(ledger_spans - sink_spans)[:5]}, only in sink {sorted(sink_spans - ledger_spans)[:5]}")
        for kind, count in Counter(c.get("kind") for c in commits).items():
            self.stats[f"commits:{kind}"] = count
        self.stats["last_sink_rows"] = len(sink_rows)
        self.stats["last_dead_letters"] = len(dead)
        self.stats["last_in_gaps"] = in_gaps
        if final:
            if dead_pending:
                problems.append("after the final run the dead-letter table still lacks a sink commit's change")
            # caught up: a dead letter at or past the committed end was left by a batch that never committed
            beyond = [(p, o) for p, o in dead if ends.get(p) is None or o >= ends[p]]
            if beyond:
                problems.append(f"dead letters beyond the committed end after the final run: {sorted(beyond)[:10]}")
            lso = _last_stable(self.bootstrap, self.topic, self.partitions)
            behind = {p: (ends.get(p), lso[p]) for p in lso if (ends.get(p) or 0) < lso[p] and lso[p] > 0}
            if behind:
                problems.append(f"after the final run partitions are behind their LSO: {behind}")
            problems += self._model_matches_a_consumer(lso)
        if problems:
            raise InvariantBroken(f"seed {self.seed} after {self.stats['steps']} steps: " + "; ".join(problems[:8]))


def _consumer_view(bootstrap: str, topic: str, lso: dict[int, int], timeout_s: float = 120) -> dict[tuple[int, int], int | None]:
    """(partition, offset) -> order id (None: malformed) of every record a plain read_committed
    consumer sees from each partition's log start to its LSO."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"campaign-truth-{uuid.uuid4().hex[:8]}",
                         "enable.auto.commit": False, "isolation.level": "read_committed",
                         "enable.partition.eof": True, "receive.message.max.bytes": 200_000_000})
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
    if commit:
        producer.commit_transaction(30)
    else:
        producer.abort_transaction(30)
    for record in sent:
        record.state = "visible" if commit else "aborted"


def _iso_ms(ms: int) -> str:
    """A Kafka record time (ms) as the ISO-8601 UTC string a backfill by time takes, exactly."""
    return (datetime(1970, 1, 1, tzinfo=UTC) + timedelta(milliseconds=ms)).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _new_topic(topic: str, partitions: int):
    from confluent_kafka.admin import NewTopic

    return NewTopic(topic, num_partitions=partitions, replication_factor=1)


def _last_stable(bootstrap: str, topic: str, partitions: int) -> dict[int, int]:
    from confluent_kafka import IsolationLevel
    from confluent_kafka.admin import OffsetSpec

    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.list_offsets({TopicPartition(topic, p): OffsetSpec.latest() for p in range(partitions)},
                                 isolation_level=IsolationLevel.READ_COMMITTED)
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
    parser.add_argument("--kafka-audit-every", type=int, default=1, metavar="N",
                        help="audit against Kafka after every N-th step (default 1: every step), the Delta-only "
                             "audit after the others; the final phase always audits against Kafka")
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
            campaign = Campaign(args.seed, args.steps, bootstrap, work, broker.restart if broker else None,
                                log=lambda line: print(line, flush=True), kafka_audit_every=args.kafka_audit_every)
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
