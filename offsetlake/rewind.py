"""Rewind: put a pipeline's sink back to its state right after an earlier batch, to reprocess from there.

What retained checkpoints give Flink users: after a bug in the last hours of processing,
``rewind_pipeline(config, to_batch=k)`` makes ONE sink commit (invariant 2) that

* removes every data file added after batch k's commit version and re-adds the files that
  version had and later commits removed (so the live rows equal time travel to that version),
* sets each partition's txn (appId ``<pipeline>:<topic>:<partition>``) back to its version as
  of batch k, so the next run plans from batch k's ends and reprocesses everything after,
* carries a ledger entry (``kind: rewind``) in ``userMetadata`` naming the rewound batch ids,
  the target batch and version, who asked and why, and every txn move.

Partitions that had no txn at batch k's version (added to the topic later, or first planned
after batch k under ``start: latest``) cannot lose their txn (Delta has no txn removal), so it is
set to the start of the first range any commit recorded for that partition: the offset the
pipeline's ``start`` setting made it begin from. The next run reprocesses that partition from
there, as the first run did; offsets retention took since then fail the run (invariant 7).

Every offsetlake commit after batch k that a rewind has not already undone is rewound: ingest,
gap and backfill batches alike (a later backfill's replaced rows revert too; repeat it after
the rewind if it is still wanted). The ledger learns it from sink history: ``Ledger.reconcile``
and ``Ledger.rebuild`` mark every batch a rewind commit lists as ``rewound``, which outranks
``committed``, and a rewound batch's plan is never executed again.

Refused with RewindError (naming pipeline and batch): an unknown batch id, a batch that never
committed (planned, failed, superseded), a batch already rewound, a rewind commit, a batch
committed before a topic's latest epoch commit (``offsetlake topic reset-epoch``: its offsets
belong to a topic Kafka no longer has, invariant 16), and a rewind whose files are gone from
disk (vacuumed): then nothing is written, never a half restore.
Rewinding to the latest live batch changes nothing and says so. Any batch kind may be the
target (ingest, gap or backfill): the target is the table version that batch committed.

Dead letters go back with the sink: the rewind commit's entry says ``dead_letter_restore:
{to_sink_version}``, and the dead-letter table is then restored to its version as of batch k in
one commit on that table (``offsetlake.dead_letters``): dead letters later batches wrote go,
and those a later backfill had replaced come back. Delta has no multi-table commit, so if the
process dies in between, the next run, stream, Airflow task, maintenance or rewind applies the
pending restore first. Dead-letter files of batch k's version that are gone (vacuumed) refuse
the rewind before anything is written, as for the sink.

Run it while no ingest or backfill of the pipeline is running: the commit is made with no
retries on the table object it was computed from, so a concurrent commit makes it fail cleanly
(nothing written; run it again).
"""

from __future__ import annotations

import getpass
import logging
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

import pyarrow.compute as pc
from deltalake import DeltaTable, Transaction

from offsetlake import dead_letters, failpoints, foreign, state_table, storage
from offsetlake.config import PipelineConfig
from offsetlake.config.sink_kinds import Capability, sink_kind
from offsetlake.entry import LedgerEntry, RewindEntry, for_plan
from offsetlake.errors import ForeignCommitError, RewindError
from offsetlake.history import (
    SinkCommit,
    current_epochs,
    epoch_change,
    latest_epoch_commit,
    refuse_foreign_sink,
    rewound_batches,
    sink_commits,
)
from offsetlake.ledger import Ledger, reconcile_ledger
from offsetlake.log_lines import log_line
from offsetlake.plan import OFFSET_MOVING_KINDS, BatchKind, BatchPlan, OffsetRange, RunContext, new_batch_id
from offsetlake.sink import CommitActions, commit_once, committed_end, live_files, open_table, readd_actions, remove_actions, txns

log = logging.getLogger("offsetlake.rewind")

DEFAULT_REASON = "no reason given"
_SHOW_FILES = 20


@dataclass
class TxnMove:
    topic: str
    partition: int
    current: int | None
    target: int
    why: str  # "as of batch k" or "no txn at batch k: first recorded start"


@dataclass
class RewindPlan:
    """What a rewind changes (what ``--dry-run`` prints), computed from one sink snapshot."""

    pipeline: str
    to_batch: str
    to_version: int
    sink_version: int  # the snapshot the plan was computed from
    rewound: list[dict] = field(default_factory=list)  # batch_id, kind, version
    remove_files: list[str] = field(default_factory=list)
    readd_files: list[str] = field(default_factory=list)
    txn: list[TxnMove] = field(default_factory=list)
    dead_letters: dict[str, int] = field(default_factory=dict)  # rewound batch id -> its dead letters that go
    dead_letters_readded: int = 0  # dead letters later batches (backfills) had replaced, that come back
    # columns later batches added: they stay (Delta drops a column only with column mapping, a table
    # feature these tables keep off), and read null in the restored rows
    kept_columns: list[str] = field(default_factory=list)

    @property
    def noop(self) -> bool:
        return not self.rewound

    def as_dict(self) -> dict:
        return {**asdict(self), "noop": self.noop}


@dataclass
class RewindResult:
    plan: RewindPlan
    dry_run: bool
    rewind_id: str | None = None
    rewind_version: int | None = None
    dead_letters_removed: int = 0
    reason: str = DEFAULT_REASON

    def as_dict(self) -> dict:
        return {
            "pipeline": self.plan.pipeline,
            "dry_run": self.dry_run,
            "rewind_id": self.rewind_id,
            "rewind_version": self.rewind_version,
            "dead_letters_removed": self.dead_letters_removed,
            "reason": self.reason,
            **self.plan.as_dict(),
        }

    def text(self) -> str:
        p = self.plan
        head = f"pipeline {p.pipeline}: rewind to batch {p.to_batch} (sink version {p.to_version})"
        if p.noop:
            lines = [f"{head}: batch {p.to_batch} is already the latest live batch; nothing to rewind"]
            if self.dead_letters_removed:
                lines.append(f"applied the pending dead-letter restore of an earlier rewind ({self.dead_letters_removed} rows)")
            return "\n".join(lines)
        verb = "would" if self.dry_run else "did"
        lines = [
            f"{head}{' [dry run: nothing written]' if self.dry_run else f' = sink version {self.rewind_version}'}",
            f"reason: {self.reason}",
            f"batches rewound ({len(p.rewound)}):",
        ]
        lines += [f"  {b['batch_id']}  {b['kind']}  sink version {b['version']}" for b in p.rewound]
        for label, files in (("remove", p.remove_files), ("re-add", p.readd_files)):
            lines.append(f"files to {label}: {len(files)}")
            lines += [f"  {f}" for f in files[:_SHOW_FILES]]
            if len(files) > _SHOW_FILES:
                lines.append(f"  ... {len(files) - _SHOW_FILES} more")
        lines.append("txn versions (committed ends):")
        lines += [f"  {m.topic}[{m.partition}]  {m.current} -> {m.target}  ({m.why})" for m in p.txn]
        lines.append(
            f"dead letters {verb} remove: {sum(p.dead_letters.values())}" + "".join(f"\n  {b}: {n}" for b, n in p.dead_letters.items() if n)
        )
        lines.append(f"dead letters {verb} come back (later batches had replaced them): {p.dead_letters_readded}")
        if p.kept_columns:
            lines.append(
                f"schema: the columns {', '.join(p.kept_columns)} came after batch {p.to_batch} and stay in the "
                "sink's schema (Delta drops a column only with column mapping, a table feature these tables keep "
                "off); the restored rows read null there, and batches read again later fill them"
            )
        return "\n".join(lines)


def refused(config: PipelineConfig, to_batch: str, text: str, **where: Any) -> RewindError:
    """The rewind to ``to_batch`` refused because ``text``; the pipeline, the batch and ``where``
    (the topic it is about) as the error's fields."""
    return RewindError(f"cannot rewind to batch {to_batch}: {text}", pipeline=config.name, batch_id=to_batch, **where)


def plan_rewind(config: PipelineConfig, to_batch: str, table: DeltaTable | None = None) -> RewindPlan:
    """Work out what rewinding to ``to_batch`` changes; reads only Delta, writes nothing.

    Raises RewindError for an unknown, uncommitted or rewound batch, a rewind commit, a batch
    before a topic's latest epoch commit (``_refuse_past_epoch``), or files of the target version
    that are gone from disk (nothing could be restored whole then).
    """
    config.check_storage()
    table = table if table is not None else open_table(config.layout.sink)
    if table is None:
        raise refused(config, to_batch, f"the sink {config.sink_path} does not exist")
    commits = sink_commits(table, config.name)
    undone = rewound_batches(commits)
    target = _target(config, commits, undone, to_batch)
    _refuse_past_epoch(config, commits, target)
    plan = RewindPlan(config.name, to_batch, target.version, table.version())
    later = [c for c in commits if c.version > target.version and c.kind != BatchKind.REWIND and c.batch_id not in undone]
    plan.rewound = [{"batch_id": c.batch_id, "kind": str(c.kind), "version": c.version} for c in later]
    plan.dead_letters = dead_letters.count_by_batch(config, [c.batch_id for c in later])
    if plan.noop:
        return plan

    then = storage.table(config.layout.sink, version=target.version)
    _plan_files(config, plan, table, then)
    plan.txn = _txn_moves(config, table, then, commits)
    return plan


def _target(config: PipelineConfig, commits: list[SinkCommit], undone: dict[str, SinkCommit], to_batch: str) -> SinkCommit:
    """The commit of ``to_batch``; RewindError if it is unknown, never committed, a rewind commit
    or itself rewound."""
    target = next((c for c in commits if c.batch_id == to_batch), None)
    if target is None:
        status = _ledger_status(config, to_batch)
        if status is None:
            raise refused(
                config, to_batch, f"no such batch in the sink's history or the ledger (`offsetlake ledger {config.name}` lists the batches)"
            )
        raise refused(config, to_batch, f"that batch is {status} and never committed; rewind to a committed batch")
    if target.kind == BatchKind.REWIND:
        raise refused(
            config,
            to_batch,
            "that is a rewind commit, not a batch; rewind to the batch it rewound to "
            f"({target.entry.to_batch if isinstance(target.entry, RewindEntry) else None})",
        )
    if to_batch in undone:
        raise refused(
            config,
            to_batch,
            f"that batch was itself rewound by {undone[to_batch].batch_id} "
            f"(sink version {undone[to_batch].version}); its data is no longer in the sink",
        )
    return target


def _plan_files(config: PipelineConfig, plan: RewindPlan, table: DeltaTable, then: DeltaTable) -> None:
    """The sink files and dead letters the rewind removes and re-adds (``plan`` gains them);
    RewindError if a file of the target version is gone from disk (nothing could be restored whole)."""
    before = set(then.schema().to_arrow().names)
    plan.kept_columns = [name for name in table.schema().to_arrow().names if name not in before]
    now_files = _files(table)
    then_files = _files(then)
    plan.remove_files = sorted(set(now_files) - set(then_files))
    plan.readd_files = sorted(set(then_files) - set(now_files))
    missing = [f for f in plan.readd_files if not storage.exists(storage.data_file(config.layout.sink, f))]
    if state_table.pinned_version(then) is None and state_table.pinned_version(table) is not None:
        raise refused(
            config,
            plan.to_batch,
            f"sink version {plan.to_version} kept its keyed state inside the sink table, before the state moved to "
            f"{state_table.location(config)}; rewind to the state_move batch or a later one, or backfill the range instead",
        )
    missing += _missing_state_files(config, then)
    if missing:
        raise refused(
            config,
            plan.to_batch,
            f"{len(missing)} data files of sink version {plan.to_version} are gone from disk "
            f"(vacuumed?), e.g. {', '.join(missing[:5])}; nothing was changed",
        )
    dead_version = dead_letters.version_as_of(config, plan.to_version)
    if dead_version is not None:
        gone = dead_letters.missing_files_as_of(config, dead_version)
        if gone:
            raise refused(
                config,
                plan.to_batch,
                f"{len(gone)} dead-letter files of that batch's state are gone from disk (vacuumed?), "
                f"e.g. {', '.join(gone[:5])}; nothing was changed",
            )
        plan.dead_letters_readded = dead_letters.rows_readded_by_restore(config, dead_version)


def _refuse_past_epoch(config: PipelineConfig, commits: list[SinkCommit], target: SinkCommit) -> None:
    """Invariant 16: RewindError when ``target`` was committed before the latest live epoch
    commit of any topic (``offsetlake topic reset-epoch``). Undoing that commit would put back the
    old topic's committed ends: its offsets name records Kafka no longer has, so they could never
    be read again, and planning would read the re-created topic from those ends, skipping its
    records below them (a broker that names no topic id cannot tell). A batch at or after the
    epoch commit is inside the current epoch and rewinds as before."""
    for topic in sorted(current_epochs(commits)):
        opened = latest_epoch_commit(commits, topic)
        if opened is None or target.version >= opened.version:
            continue
        change = epoch_change(opened)
        old = change.previous_topic_id if change is not None else None
        raise refused(
            config,
            target.batch_id,
            f"it was committed (sink version {target.version}) before topic {topic} started a new epoch in "
            f"sink version {opened.version} (batch {opened.batch_id}, `offsetlake topic reset-epoch`); its offsets "
            f"belong to topic {f'id {old}' if old else 'the topic before it was re-created'}, which Kafka no longer "
            f"has. Nothing was changed. Rewind to batch {opened.batch_id} or a later one; the rows of the earlier epoch "
            "stay in the sink",
            topic=topic,
        )


def rewind_pipeline(
    config: PipelineConfig,
    to_batch: str,
    reason: str | None = None,
    requested_by: str | None = None,
    dry_run: bool = False,
    run: RunContext | None = None,
    restore_deleted: bool = False,
) -> RewindResult:
    """Restore the sink to its state right after ``to_batch`` in ONE commit (see the module doc).

    A commit offsetlake did not make after ``to_batch`` that deleted rows (a user's GDPR delete)
    refuses the rewind (ForeignCommitError naming it), since restoring the earlier files would
    bring those rows back; ``restore_deleted`` says that is what is wanted.

    The commit is the only one a rewind makes on the sink, and together with the txn actions it
    is the only place offsets move backwards (invariant 2). ``dry_run`` computes the same plan and
    writes nothing. Raises RewindError when refused and CommitConflictError when another writer
    committed meanwhile; nothing is written then.
    """
    reason = (reason or "").strip() or DEFAULT_REASON
    requested_by = requested_by or _user()
    run = run or RunContext(run_id=f"cli-rewind-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S')}")
    started = time.monotonic()
    sink_kind(config).refuse_unless(config, Capability.REWIND, lambda why: refused(config, to_batch, why))
    table = open_table(config.layout.sink)
    if table is None:
        raise refused(config, to_batch, f"the sink {config.sink_path} does not exist")
    plan = plan_rewind(config, to_batch, table)
    result = RewindResult(plan, dry_run, reason=reason)
    if not restore_deleted and not plan.noop:
        _refuse_undoing_foreign_deletes(config, table, plan)
    if dry_run:
        return result
    if not plan.noop:
        result.rewind_id = new_batch_id(config.name)
        entry = _entry(config, plan, result.rewind_id, reason, requested_by, run, started)
        result.rewind_version = _commit(table, config, plan, entry)
        log_line(
            log,
            "rewind",
            pipeline=config.name,
            rewind=result.rewind_id,
            to_batch=to_batch,
            rewound=len(plan.rewound),
            removed_files=len(plan.remove_files),
            readded_files=len(plan.readd_files),
            sink_version=result.rewind_version,
            duration_ms=int((time.monotonic() - started) * 1000),
        )
        failpoints.failpoint("after_commit")
    # Second commit, on the dead-letter table (and any restore an earlier rewind left pending).
    before = dead_letters.row_count(config)
    dead_letters.apply_pending(config)
    if plan.noop:
        result.dead_letters_removed = max(0, before - dead_letters.row_count(config))
    reconcile_ledger(config, Ledger.of(config))
    return result


def _refuse_undoing_foreign_deletes(config: PipelineConfig, table: DeltaTable, plan: RewindPlan) -> None:
    """A rewind restores earlier files: rows a commit offsetlake did not make deleted after the
    target would come back (docs/design.md, "Foreign commits": a deletion a user made stays deleted
    unless they ask otherwise)."""
    try:
        after = [c for c in foreign.foreign_changes(table, config.name, since_version=plan.to_version) if c.removed]
    except ForeignCommitError as err:
        raise ForeignCommitError(
            f"rewinding to batch {plan.to_batch}: {err.text}, so whether the rewind would bring back rows it deleted cannot "
            "be told; nothing was changed. Rewind with --restore-deleted to restore the earlier rows whatever it deleted",
            pipeline=config.name,
        ) from None
    if not after:
        return
    said = "; ".join(c.describe() for c in after[:3])
    raise ForeignCommitError(
        f"rewinding to batch {plan.to_batch} (sink version {plan.to_version}) would bring back rows that commits offsetlake "
        f"did not make deleted after it: {said}. Nothing was changed. To restore them too, rewind with --restore-deleted; "
        "to keep them deleted, correct the rows with a backfill instead (a backfill keeps them deleted)",
        pipeline=config.name,
    )


def _entry(
    config: PipelineConfig, plan: RewindPlan, rewind_id: str, reason: str, requested_by: str, run: RunContext, started: float
) -> LedgerEntry:
    rewound = [b["batch_id"] for b in plan.rewound]
    # per partition, the offsets whose processing was undone: [new committed end, old one)
    undone = tuple(OffsetRange(m.topic, m.partition, m.target, m.current) for m in plan.txn if m.current is not None)
    batch = BatchPlan(config.name, rewind_id, BatchKind.REWIND, undone, run)
    return for_plan(
        batch,
        started=started,
        to_batch=plan.to_batch,
        to_version=plan.to_version,
        rewound=tuple(rewound),
        reason=reason,
        requested_by=requested_by,
        files_removed=len(plan.remove_files),
        files_readded=len(plan.readd_files),
        kept_columns=tuple(plan.kept_columns),
        restore_to_sink_version=plan.to_version,
        message=f"rewound {len(rewound)} batches ({', '.join(rewound)}) to batch {plan.to_batch} "
        f"(sink version {plan.to_version}) for {requested_by}: {reason}",
    )


def _commit(table: DeltaTable, config: PipelineConfig, plan: RewindPlan, entry: LedgerEntry) -> int:
    """ONE commit: removes + re-adds + one txn per partition + the entry, on the snapshot the plan
    read, with no retries: a concurrent writer makes it fail instead of rebasing a stale diff.
    Refused (SinkOwnedError) on a table that holds another pipeline's commits: restoring a version
    would undo that pipeline's later commits while its txns stay (invariant 16)."""
    refuse_foreign_sink(table, config.name)
    live = {f["path"]: f for f in live_files(table)}
    then = {f["path"]: f for f in live_files(storage.table(config.layout.sink, version=plan.to_version))}
    partition_by = config.sink.partition_by
    actions = CommitActions(
        files=[
            *remove_actions([live[p] for p in plan.remove_files], partition_by),
            *readd_actions(config.layout.sink, [then[p] for p in plan.readd_files], partition_by),
        ],
        txns=[*txns(config, (((m.topic, m.partition), m.target) for m in plan.txn)), *_state_pin(config, plan.to_version)],
    )
    lost = (
        f"rewind to batch {plan.to_batch} lost to a concurrent commit on the sink "
        f"(version {plan.sink_version} was read); nothing was changed, run the rewind again"
    )
    return commit_once(table, config, actions, entry, conflict=lost)


def _state_pin(config: PipelineConfig, to_version: int) -> list[Transaction]:
    """A keyed sink's state goes back with it: the pin of the target version (``offsetlake.state_table``)."""
    version = state_table.pinned_version(storage.table(config.layout.sink, version=to_version))
    return [state_table.pin(version)] if version is not None else []


def _missing_state_files(config: PipelineConfig, then: DeltaTable) -> list[str]:
    """The files of the state the target version pins that are gone from disk (vacuumed)."""
    state = state_table.pinned(config, then)
    if state is None:
        return []
    return [f for f in _files(state) if not storage.exists(storage.data_file(state_table.location(config), f))]


def _files(table: DeltaTable) -> list[str]:
    return [f["path"] for f in live_files(table)]


def _txn_moves(config: PipelineConfig, now: DeltaTable, then: DeltaTable, commits: list[SinkCommit]) -> list[TxnMove]:
    first_start: dict[tuple[str, int], int] = {}
    for c in sorted(commits, key=lambda c: c.version):
        if c.kind in OFFSET_MOVING_KINDS:
            for r in c.entry.ranges:
                first_start.setdefault((r.topic, r.partition), r.start)
    moves = []
    for topic, partition in sorted(first_start):
        current, target = committed_end(now, config, topic, partition), committed_end(then, config, topic, partition)
        why = "as of the target batch"
        if target is None:
            target, why = first_start[(topic, partition)], "no txn at the target batch: its first recorded start"
        moves.append(TxnMove(topic, partition, current, target, why))
    return moves


def _ledger_status(config: PipelineConfig, batch_id: str) -> str | None:
    rows = Ledger.of(config).batches(pc.field("batch_id") == batch_id)
    return rows[0]["status"] if rows else None


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown user"
