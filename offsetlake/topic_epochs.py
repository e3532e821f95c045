"""A topic's epochs: which Kafka topic (by its id) the pipeline's committed offsets belong to.

Invariant 16: an offset means something only for one topic's identity. A topic deleted and
created again with the same name, the same name on another cluster (a fail-over, a MirrorMaker
migration), or a log an unclean leader election truncated below the committed end: the same
offsets then name other records, and planning from the old committed ends would skip them.

So every batch's plan records the Kafka topic id of each topic it reads (``BatchPlan.topic_ids``,
in its ledger entry's ``topic_ids``; entries written before that have none, and a broker that
names no id — before Kafka 2.8, or one that answers the all-zero id — gives none), and
``check_topic_identity`` refuses, naming topic, partition and both offsets (or both ids), when a
committed end is past its partition's log end (the LSO) or the topic's id is not the recorded
one. Planning, ``offsetlake status`` and ``audit --against-kafka`` call it. Without ids only the
first sign is seen: a re-created topic that already holds more records than the committed end
looks like the old one.

The only way on is the operator's ``reset_topic_epoch`` (``offsetlake topic reset-epoch``): ONE
sink commit that moves the topic's committed ends (txn versions) to its new log start and
carries an ``epoch`` entry naming the old and new id, every move, who asked and why. It starts
a new epoch of the topic (``history.epoch_starts`` lists them). The rows already in the sink
stay, and the same offsets now name other records, so every row of a topic in epoch 1 or later
carries its epoch as data (``coordinates.TOPIC_EPOCH``, ``_offsetlake_epoch``; null = epoch 0),
a column the epoch commit adds to the sink's schema. That survives compaction and rewrites, and
every operation reads it: the audit keeps the epochs apart (rows and committed ranges of an old
epoch never stand for records of the new one), a backfill replaces only the current epoch's rows,
and a keyed merge takes a later epoch's record as newer (``offsetlake.keyed``). A rewind to a
batch before a topic's latest epoch commit is refused (``offsetlake.rewind``): that batch's
offsets belong to a topic Kafka no longer has, and undoing the epoch commit would plan the new
topic from the old committed ends.
"""

from __future__ import annotations

import getpass
import time
from dataclasses import dataclass, field

import pyarrow as pa
from deltalake import DeltaTable

from offsetlake.config import PipelineConfig
from offsetlake.config.sink_kinds import Capability, sink_kind
from offsetlake.coordinates import TOPIC_EPOCH, TOPIC_EPOCH_TYPE
from offsetlake.entry import EpochChange, LedgerEntry, for_plan
from offsetlake.errors import KafkaUnavailableError, TopicEpochError, TopicIdentityError
from offsetlake.history import (
    SinkCommit,
    epoch_change,
    refuse_foreign_sink,
    rewound_batches,
    sink_commits,
)
from offsetlake.kafka import current_offsets, topic_ids
from offsetlake.ledger import Ledger, reconcile_ledger
from offsetlake.plan import OFFSET_MOVING_KINDS, BatchKind, BatchPlan, OffsetRange, PartitionOffsets, RunContext, new_batch_id
from offsetlake.schema_evolution import table_schema
from offsetlake.sink import CommitActions, commit_once, committed_end, open_table, txns

TopicPartitionKey = tuple[str, int]


# ---- what history says ------------------------------------------------------------------------
def _live(commits: list[SinkCommit]) -> list[SinkCommit]:
    rewound = rewound_batches(commits)
    return [c for c in sorted(commits, key=lambda c: c.version) if c.batch_id not in rewound]


def recorded_topic_ids(commits: list[SinkCommit]) -> dict[str, str]:
    """The Kafka topic id each topic's committed offsets belong to: the newest one a live commit
    recorded since the topic's last epoch commit (topics with none recorded are left out)."""
    ids: dict[str, str] = {}
    for c in _live(commits):
        change = epoch_change(c)
        if change is not None:
            ids.pop(change.topic, None)
            if change.topic_id:
                ids[change.topic] = change.topic_id
        elif c.kind in OFFSET_MOVING_KINDS:
            ids.update(c.entry.topic_ids)
    return ids


# ---- the check --------------------------------------------------------------------------------
def identity_problems(
    ends: dict[TopicPartitionKey, int | None],
    offsets: dict[TopicPartitionKey, PartitionOffsets],
    recorded: dict[str, str],
    current: dict[str, str | None],
) -> list[str]:
    """Each partition whose committed end does not belong to the topic Kafka has now: past the
    log end (LSO), or under another topic id; one line each, naming both offsets or both ids."""
    problems = []
    for (topic, partition), end in sorted(ends.items()):
        if end is None or (topic, partition) not in offsets:
            continue
        now = offsets[(topic, partition)]
        was_id, now_id = recorded.get(topic), current.get(topic)
        if was_id is not None and now_id is not None and was_id != now_id:
            problems.append(
                f"{topic}[{partition}]: the committed end {end} belongs to topic id {was_id}, but the topic's "
                f"id is now {now_id} (its log end is {now.last_stable}, log start {now.log_start})"
            )
        elif end > now.last_stable:
            problems.append(
                f"{topic}[{partition}]: the committed end is {end} but the partition's log end is "
                f"{now.last_stable} (log start {now.log_start})"
            )
    return problems


def check_topic_identity(
    config: PipelineConfig,
    commits: list[SinkCommit],
    ends: dict[TopicPartitionKey, int | None],
    offsets: dict[TopicPartitionKey, PartitionOffsets],
    current: dict[str, str | None],
) -> None:
    """Invariant 16: raise TopicIdentityError when any committed end does not belong to the topic
    Kafka has now (``identity_problems``), naming every such partition and the way on."""
    problems = identity_problems(ends, offsets, recorded_topic_ids(commits), current)
    if not problems:
        return
    topics = sorted({p.split("[", 1)[0] for p in problems})
    raise TopicIdentityError(
        f"the topic was re-created or truncated; {'; '.join(problems)}. The offsets below the "
        "committed end now name other records than the ones committed, so nothing was read. If the topic was deleted "
        "and created again, the cluster changed or the log was truncated, record it and go on from the new log start "
        f"with `offsetlake topic reset-epoch {config.name} --topic {topics[0]} --reason '...'` (one commit that moves "
        "its committed ends; the rows already in the sink stay); otherwise point the pipeline back at the right cluster",
        pipeline=config.name,
        topic=topics[0] if len(topics) == 1 else None,
    )


def check_pipeline_identity(
    config: PipelineConfig, table: DeltaTable | None, offsets: dict[TopicPartitionKey, PartitionOffsets]
) -> dict[str, str | None]:
    """``check_topic_identity`` against Kafka now, for the committed ends the sink ``table`` holds;
    returns each topic's current id (None where the broker names none), for a plan to record."""
    ends = {key: committed_end(table, config, *key) for key in offsets}
    current = topic_ids(config, sorted({t for t, _ in offsets}))
    check_topic_identity(config, sink_commits(table, config.name), ends, offsets, current)
    return current


# ---- the operator action ----------------------------------------------------------------------
@dataclass
class EpochReset:
    """What ``reset_topic_epoch`` did (or would do)."""

    pipeline: str
    topic: str
    previous_topic_id: str | None
    topic_id: str | None
    moves: list[dict] = field(default_factory=list)  # {partition, from, to}
    batch_id: str | None = None
    sink_version: int | None = None

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    def text(self) -> str:
        moved = ", ".join(f"{self.topic}[{m['partition']}] {m['from']} -> {m['to']}" for m in self.moves)
        return (
            f"pipeline {self.pipeline}: topic {self.topic} starts a new epoch (topic id {self.previous_topic_id or 'unknown'} "
            f"-> {self.topic_id or 'unknown'}) in sink version {self.sink_version} (batch {self.batch_id}); "
            f"committed ends moved: {moved}"
        )


def reset_topic_epoch(config: PipelineConfig, topic: str, reason: str | None = None, force: bool = False) -> EpochReset:
    """The operator's way on after a topic was re-created or truncated (invariant 16): ONE sink
    commit that moves the committed end of every partition of ``topic`` the pipeline committed to
    the partition's log start now (0 for a partition Kafka no longer has: it begins there if it is
    added again), with an ``epoch`` ledger entry naming the old and new topic id, every move, who
    asked and why; the ledger learns it from that commit. Rows already in the sink stay; the
    commit adds ``coordinates.TOPIC_EPOCH`` to the sink's schema if it lacks it (nullable: the
    rows there read null, epoch 0), and the new epoch's rows carry its number.

    Refused with TopicEpochError when the pipeline committed nothing of ``topic``, or when the
    check sees nothing wrong (``force`` records the new epoch anyway: a broker that names no
    topic id cannot show a re-created topic that holds more records than the committed end). A
    concurrent commit fails it with CommitConflictError; nothing is written then.
    """
    config.check_storage()
    sink_kind(config).refuse_unless(config, Capability.EPOCH_RESET, lambda why: TopicEpochError(why, pipeline=config.name, topic=topic))
    started = time.monotonic()
    table = open_table(config.layout.sink)
    commits = sink_commits(table, config.name)
    mine = sorted({r.partition for c in commits for r in c.entry.ranges if r.topic == topic})
    if table is None or not mine:
        raise TopicEpochError(f"it has committed nothing of topic {topic}; nothing to reset", pipeline=config.name, topic=topic)
    offsets = _topic_offsets(config, topic)
    current = topic_ids(config, [topic]).get(topic)
    ends = {(topic, p): committed_end(table, config, topic, p) for p in mine}
    problems = identity_problems(ends, offsets, recorded_topic_ids(commits), {topic: current})
    if not problems and not force:
        raise TopicEpochError(
            f"topic {topic} looks unchanged (every committed end is within its log, and its "
            f"topic id is {current or 'not named by the broker'}); nothing was written. If you know it was re-created "
            "(a broker without topic ids cannot show it), run again with --force",
            pipeline=config.name,
            topic=topic,
        )
    targets = {p: offsets[(topic, p)].log_start if (topic, p) in offsets else 0 for p in mine}
    moves = [{"partition": p, "from": ends[(topic, p)], "to": targets[p]} for p in mine]
    result = EpochReset(config.name, topic, recorded_topic_ids(commits).get(topic), current, moves)
    plan = BatchPlan(
        config.name,
        new_batch_id(config.name),
        BatchKind.EPOCH,
        tuple(OffsetRange(topic, p, to, to) for p, to in targets.items()),
        RunContext(f"reset-epoch-{topic}"),
        topic_ids={topic: current} if current else {},
    )
    requested_by = _user()
    entry = for_plan(
        plan,
        started=started,
        reason=reason or "no reason given",
        requested_by=requested_by,
        message=f"topic {topic} starts a new epoch for {requested_by}: {reason or 'no reason given'}; "
        + ("; ".join(problems) if problems else "forced: the check saw nothing wrong"),
        epoch=EpochChange(topic, result.previous_topic_id, current, tuple(moves), tuple(problems)),
    )
    actions = CommitActions(txns=txns(config, (((topic, p), to) for p, to in targets.items())))
    result.batch_id, result.sink_version = plan.batch_id, _commit_epoch(config, table, plan, entry, actions)
    reconcile_ledger(config, Ledger.of(config))
    return result


def _topic_offsets(config: PipelineConfig, topic: str) -> dict[tuple[str, int], PartitionOffsets]:
    """Kafka's offsets of ``topic``'s partitions now; TopicEpochError if Kafka cannot say or does
    not list the topic (a new epoch starts only on a topic that exists)."""
    try:
        offsets = {key: o for key, o in current_offsets(config).items() if key[0] == topic}
    except KafkaUnavailableError as err:
        raise TopicEpochError(f"topic {topic} must exist in Kafka to start a new epoch: {err}", pipeline=config.name, topic=topic) from None
    if not offsets:
        raise TopicEpochError(
            f"Kafka does not list topic {topic} for this pipeline; create it (or fix topic_pattern) first",
            pipeline=config.name,
            topic=topic,
        )
    return offsets


def _commit_epoch(config: PipelineConfig, table: DeltaTable, plan: BatchPlan, entry: LedgerEntry, actions: CommitActions) -> int:
    """The epoch commit (txns only, the schema gains the epoch column), on this pipeline's own
    table (invariant 16), under the lost-answer rule (``sink.commit_once``); CommitConflictError
    if a concurrent commit won and ours did not land. Returns the sink version that holds it."""
    topic = plan.ranges[0].topic
    refuse_foreign_sink(table, config.name)  # invariant 16: the txns it moves are this pipeline's, on its own table
    return commit_once(
        table,
        config,
        actions,
        entry,
        conflict=f"the new epoch of topic {topic} lost to a concurrent commit on the sink; "
        "nothing was changed, run it again while no run of the pipeline is going on",
        topic=topic,
        schema=_with_epoch_column(table_schema(table)),
    )


def _with_epoch_column(schema: pa.Schema) -> pa.Schema | None:
    """The sink's schema with ``TOPIC_EPOCH`` (nullable int) appended, None if it has it."""
    if TOPIC_EPOCH in schema.names:
        return None
    return schema.append(pa.field(TOPIC_EPOCH, TOPIC_EPOCH_TYPE, nullable=True))


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown user"
