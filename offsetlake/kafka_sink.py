"""A Kafka topic as a pipeline's sink (``sink: {type: kafka, topic, key}``, invariant 15).

A batch is planned from the ends the commit log records and recorded in the ledger before
it reads, as for a Delta sink. Its rows then go out in ONE Kafka transaction
(``offsetlake.kafka_commit.TransactionalWriter``) together with:

* the batch's source end offsets, committed for the pipeline's group
  (``send_offsets_to_transaction``): a copy of the committed ends for Kafka's tools (restored from
  the commit log when they expire or are deleted; planning never reads them);
* its dead letters, to the dead-letter topic, each with the reason in its headers;
* its ledger entry, to the pipeline's commit log (``offsetlake-commits-<pipeline>``): the sink's
  history, read back the way a Delta sink's commits are, and the record of its committed ends.

With ``sink.routes`` the rows go to several topics, each to the one its value (or source topic)
maps and the rest to ``sink.topic``, all in that one transaction: one pipeline, one commit log,
one set of ends, so a batch is in every output topic or in none.

The transaction is the commit point: read_committed consumers see the rows, the dead letters, the
entry and the new ends together or nothing. The ledger row follows it; a runner that dies between
the two leaves the batch committed in Kafka, and the next run's ``reconcile`` records it from the
commit log (``Ledger.reconcile``, the same code as for a Delta sink's commits).

Every transaction starts by fencing: the writer's ``init_transactions`` (one ``transactional.id``
per pipeline) aborts whatever an earlier runner left open and makes its producer unusable, and
only then is the state read and the plan checked against it. So a second runner (a retry, an
Airflow clear, a zombie) either finds the batch in the commit log (a no-op), finds the ends moved
(superseded), or commits it once; the fenced one's commit fails and shows nothing.

A backfill re-publishes its range, marked ``backfill`` in every record's headers, and never moves
the committed ends; a Kafka log cannot have rows replaced, so consumers that keep one row per
source record replace by the coordinates. Rewinds and topic-epoch commits are refused.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from offsetlake.config import PipelineConfig
from offsetlake.config.sink_kinds import KafkaSinkKind
from offsetlake.coordinates import OFFSET, PARTITION, TOPIC
from offsetlake.entry import LedgerEntry
from offsetlake.errors import ConfigError, KafkaSinkProgressError, StalePlanError
from offsetlake.history import SinkCommit, covering_batch
from offsetlake.kafka import current_offsets, group_id
from offsetlake.kafka_commit import commit_log_ends, commit_log_topic, group_offsets, kafka_sink_commits
from offsetlake.kafka_transactions import NOT_IN_VALUES, OutputRecord, TransactionalWriter, ensure_topics, table_records
from offsetlake.log_lines import log_line, log_step
from offsetlake.plan import OFFSET_MOVING_KINDS, BatchKind, BatchPlan
from offsetlake.sink_values import value_encoder
from offsetlake.sinks.writing import WRITER, Projection, SinkWriter

log = logging.getLogger("offsetlake.kafka_sink")

COMMIT_LOG_SETTINGS = {"cleanup.policy": "compact"}  # one key per batch: compaction keeps every entry


@dataclass(frozen=True)
class KafkaSinkState:
    """What a Kafka sink holds now: its commits (from the commit log), the committed ends they
    say, and the pipeline group's offsets (Kafka's copy of those ends, which can expire)."""

    commits: list[SinkCommit]
    ends: dict[tuple[str, int], int | None]
    group: dict[tuple[str, int], int | None]

    @classmethod
    def read(cls, config: PipelineConfig, keys: list[tuple[str, int]]) -> KafkaSinkState:
        """The group's offsets first, then the commit log: a batch committing in between makes the
        group look behind (restored, harmlessly), never ahead."""
        group = group_offsets(config.kafka_client_config(), config.name, sorted(keys))
        commits = kafka_sink_commits(config)
        return cls(commits, commit_log_ends(commits, keys), group)

    def commit_of(self, batch_id: str) -> SinkCommit | None:
        return next((c for c in self.commits if c.batch_id == batch_id), None)

    def end(self, topic: str, partition: int) -> int | None:
        return self.ends.get((topic, partition))

    def group_behind(self) -> dict[tuple[str, int], int]:
        """The ends whose group offset is missing (expired, deleted) or lower: to restore."""
        return {k: end for k, end in self.ends.items() if end is not None and (self.group.get(k) is None or self.group[k] < end)}  # type: ignore[operator]

    def group_ahead(self) -> dict[tuple[str, int], tuple[int, int | None]]:
        """(group offset, commit-log end) where the group is past what the commit log records."""
        return {k: (g, self.ends.get(k)) for k, g in self.group.items() if g is not None and g > (self.ends.get(k) or 0)}


def read_state(config: PipelineConfig, keys: list[tuple[str, int]], ledger: Projection | None = None) -> KafkaSinkState:
    """The sink's state, refused (``KafkaSinkProgressError``, nothing produced) when its records
    of progress disagree in a way that must not be guessed: the group's offsets past the commit
    log, or a commit log without batches the ledger recorded committed.

    Read in the order the records are written, followers first: the ledger (which follows the
    commit log), then the group's offsets, then the commit log, so a batch committing meanwhile
    can only make the commit log look ahead, never behind. The group past the log can also be the
    moment a commit's markers reach the two topics one after the other, so the log is read again
    for a few seconds before refusing."""
    recorded = ledger.committed_batches(OFFSET_MOVING_KINDS) if ledger is not None else set()
    state = KafkaSinkState.read(config, keys)
    deadline = time.monotonic() + _SETTLE_S
    while state.group_ahead() and time.monotonic() < deadline:
        time.sleep(0.5)
        commits = kafka_sink_commits(config)
        state = KafkaSinkState(commits, commit_log_ends(commits, keys), state.group)
    ahead = state.group_ahead()
    if ahead:
        (topic, partition), (group, logged) = sorted(ahead.items())[0]
        raise KafkaSinkProgressError(
            f"the group {group_id(config.name)} has committed offset {group} here, past the end the sink's commit log "
            f"{commit_log_topic(config.name)} records ({logged if logged is not None else 'none'}): something other than this "
            "pipeline's transactions moved the group (a reset with kafka-consumer-groups?), or the commit log lost entries. "
            "The commit log is the record of what was published, and nothing was produced. To go on from the commit log, "
            f"delete the group's offsets (kafka-consumer-groups --delete-offsets --group {group_id(config.name)} --topic {topic}) "
            "and run again: they are restored from the commit log",
            pipeline=config.name,
            topic=topic,
            partition=partition,
        )
    lost = sorted(recorded - {c.batch_id for c in state.commits})
    if lost:
        raise KafkaSinkProgressError(
            f"the sink's commit log {commit_log_topic(config.name)} lacks {len(lost)} batch(es) the ledger recorded committed "
            f"(first: {lost[0]}): the topic was deleted, re-created or lost by the broker. Planning from it would publish their "
            "records again, so nothing was produced. To publish from the commit log as it stands (every source record after "
            f"its last entry, again), rebuild the ledger from it first: offsetlake ledger rebuild {config.name}",
            pipeline=config.name,
        )
    return state


_SETTLE_S = 5.0


def reconcile(config: PipelineConfig, ledger: Projection) -> int:
    """Invariant 4 for a Kafka sink: the ledger gets the commits it lacks (a runner died between
    the Kafka commit and its ledger row) and the outcomes of plans the committed ends moved past.
    Group offsets that expired or were deleted are restored from the commit log (``restore_group_offsets``)."""
    keys = sorted(current_offsets(config))
    state = read_state(config, keys, ledger)
    if state.group_behind():
        restore_group_offsets(config, keys, ledger)
    return ledger.reconcile(state.commits, state.end)


def restore_group_offsets(config: PipelineConfig, keys: list[tuple[str, int]], ledger: Projection) -> dict[tuple[str, int], int]:
    """Commit the commit log's ends for the pipeline's group where its offsets are missing or
    behind, in a transaction of their own after fencing every other runner (so the log is read
    whole); returns what was restored. Only Kafka's tools read them: planning reads the log."""
    client = config.kafka_client_config()
    with TransactionalWriter(client, config.name) as writer:
        behind = read_state(config, keys, ledger).group_behind()
        if behind:
            writer.commit("restore-group-offsets", "restore", config.kafka_sink.topic, [], behind)
            log_line(
                log,
                "kafka_sink",
                "group offsets restored from the commit log",
                level=logging.WARNING,
                pipeline=config.name,
                group=group_id(config.name),
                restored=", ".join(f"{t}[{p}]={e}" for (t, p), e in sorted(behind.items())),
            )
    return behind


class KafkaSinkWriter(SinkWriter):
    """One batch into the Kafka sink: ONE transaction holds its records, its dead letters, its
    source ends (for the group) and its ledger entry (to the commit log).

    ``open`` fences first: the transactional producer's ``init_transactions`` aborts whatever an
    earlier runner left open and makes its producer unusable; only then is the state read, so a
    second runner (a retry, an Airflow clear, a zombie) finds the batch in the commit log, finds
    the ends moved (superseded), or commits it once. A backfill publishes its range again and never
    moves the ends. Raises KafkaSinkAbortedError when the transaction failed and was aborted
    (transient: running again commits it once), KafkaSinkFencedError when another runner took over.
    """

    done = "produced"
    _writer: TransactionalWriter | None = None
    _state: KafkaSinkState | None = None

    @classmethod
    def reconcile_pipeline(cls, config: PipelineConfig, ledger: Projection) -> None:
        reconcile(config, ledger)

    def open(self, plan: BatchPlan) -> BatchPlan:
        client = self.config.kafka_client_config()
        made = {commit_log_topic(self.config.name): COMMIT_LOG_SETTINGS, self.config.kafka_sink.dead_letters_to: {}}
        ensure_topics(client, self.config.name, self.config.kafka_sink.output_topics, made)
        self._writer = TransactionalWriter(client, self.config.name)  # fences every earlier runner first
        self._state = read_state(self.config, [(r.topic, r.partition) for r in plan.ranges], self.ledger)
        return plan

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    @property
    def state(self) -> KafkaSinkState:
        assert self._state is not None, "open the sink first"
        return self._state

    def commits(self) -> list[SinkCommit]:
        return self.state.commits

    def applies(self, plan: BatchPlan) -> bool:
        """Invariant 3 against the commit log's ends: False if another batch committed exactly the
        plan's ranges; StalePlanError if an end moved part-way."""
        held = 0
        for r in plan.ranges:
            end = self.state.end(r.topic, r.partition)
            if end is None or end == r.start:
                continue
            if end >= r.end and r.size > 0:
                held += 1
                continue
            winner = covering_batch(self.state.commits, r.topic, r.partition, r.start) or "unknown"
            raise StalePlanError(
                f"batch {plan.batch_id} ({plan.describe()}): {r.topic}[{r.partition}] is committed up to {end} "
                f"(by batch {winner}), not {r.start} as planned; superseded, plan anew from the committed ends",
                pipeline=self.config.name,
                batch_id=plan.batch_id,
            )
        return held == 0

    def reconcile(self) -> int:
        return self.ledger.reconcile(self.state.commits, self.state.end)

    def write(
        self, plan: BatchPlan, processed: Any, spark: Any, started: float, before_commit: Callable[[], None], restore_deleted: bool
    ) -> SinkCommit:
        per_range = processed.per_range
        records = list(_output_records(self.config, processed))
        for record in records:
            counts = per_range.get((record.topic or "", record.partition))
            if counts is not None:
                counts["rows_written"] = counts.get("rows_written", 0) + 1
        dead = list(_dead_letter_records(self.config, processed, str(plan.kind)))
        entry = processed.entry(plan, started, staged=())  # its dead letters go out in the transaction
        return self._commit(plan, entry, records, dead, before_commit, processed.timings_ms)

    def advance(self, plan: BatchPlan, entry: LedgerEntry, before_commit: Callable[[], None]) -> int:
        return self._commit(plan, entry, [], [], before_commit, {}).version

    def _commit(
        self,
        plan: BatchPlan,
        entry: LedgerEntry,
        records: list[OutputRecord],
        dead: list[tuple],
        before_commit: Callable[[], None],
        timings: dict[str, int],
    ) -> SinkCommit:
        """The one transaction. A backfill re-publishes below the committed ends and never moves
        them; group offsets that expired or were deleted go back to the commit log's ends in it."""
        assert self._writer is not None
        moved = {} if plan.kind == BatchKind.BACKFILL else {(r.topic, r.partition): r.end for r in plan.ranges}
        ends = {**self.state.group_behind(), **moved}
        t = time.monotonic()
        before_commit()
        log_entry = (commit_log_topic(self.config.name), plan.batch_id.encode(), entry.to_json().encode())
        done = self._writer.commit(plan.batch_id, str(plan.kind), self.config.kafka_sink.topic, records, ends, also=[*dead, log_entry])
        version = done.also_offsets[-1]
        timings["commit"] = log_step(
            "commit",
            plan,
            t,
            topic=", ".join(self.config.kafka_sink.output_topics),
            records=done.records,
            dead_letters=len(dead),
            commit_log_offset=version,
        )
        return SinkCommit(version, entry)


_ROUTE = "_offsetlake_route"  # a row's route value as text, for the driver only (never produced)


def _output_records(config: PipelineConfig, processed: Any) -> Iterator[OutputRecord]:
    """The batch's rows as records, in source order (topic, partition, offset): a key's records
    keep their order in the output topic. With ``sink.routes`` each record names its topic: the
    one its value (or source topic) maps, else ``sink.topic``. The rows come to the driver as Arrow and are sorted
    there (a batch is at most ``max_records_per_batch`` rows, all of them produced from this
    process anyway), which costs far less than a sort in Spark."""
    if processed is None or processed.rows is None:
        return
    frame, routes = processed.rows, config.kafka_sink.routes
    if routes is not None and not routes.by_topic:
        if routes.by not in frame.columns:
            raise ConfigError(
                f"sink.routes.by: the rows have no column '{routes.by}' (they have {', '.join(frame.columns)}); "
                "route by a column the transform returns; nothing was produced",
                pipeline=config.name,
                field="sink.routes.by",
            )
        from pyspark.sql import functions as F

        # compared as text, as Spark casts it (a table route's rule): 1.0 is "1.0", true is "true"
        frame = frame.withColumn(_ROUTE, F.col(routes.by).cast("string"))
    rows = frame.toArrow()
    if rows.num_rows == 0:
        return
    rows = rows.sort_by([(TOPIC, "ascending"), (PARTITION, "ascending"), (OFFSET, "ascending")])
    to = None
    if routes is not None:
        mapping, default = routes.mapping(), config.kafka_sink.topic
        to = [mapping.get(v, default) if v is not None else default for v in rows.column(TOPIC if routes.by_topic else _ROUTE).to_pylist()]
        if _ROUTE in rows.column_names:
            rows = rows.drop_columns([_ROUTE])
    columns = pa.schema([f for f in rows.schema if f.name not in NOT_IN_VALUES])
    encode = value_encoder(config, columns)  # a registry format: the schema is registered now
    yield from table_records(rows, config.sink.key, encode, to)


def _dead_letter_records(config: PipelineConfig, processed: Any, kind: str) -> Iterator[tuple]:
    """The batch's dead letters (``ProcessedBatch.dead_letters``, as ``process_ranges`` found them)
    as records of the dead-letter topic: the original key, value and headers, with the reason and
    source coordinates added."""
    if processed.dead_letters is None:
        return
    for row in processed.dead_letters.to_pylist():
        headers = [(h["key"], h["value"]) for h in row.get("headers") or ()]
        headers += [
            ("offsetlake.reason", (row.get("reason") or "").encode()),
            ("offsetlake.reason_code", (row.get("reason_code") or "").encode()),
            ("offsetlake.topic", str(row[TOPIC]).encode()),
            ("offsetlake.partition", str(row[PARTITION]).encode()),
            ("offsetlake.offset", str(row[OFFSET]).encode()),
            ("offsetlake.batch", str(row.get("batch_id") or "").encode()),
            ("offsetlake.kind", kind.encode()),
        ]
        yield (config.kafka_sink.dead_letters_to, row.get("key"), row.get("value"), headers)


KafkaSinkKind.provides(WRITER, KafkaSinkWriter)
