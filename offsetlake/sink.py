"""The sink Delta table: its committed ends, its data file actions, and the one commit.

Invariant 2: a batch's data files, its offset advance (one ``txn`` per topic-partition, version =
exclusive end offset) and its ledger entry (``commitInfo.userMetadata``) are ONE Delta commit.
``commit`` is the only function that commits to a sink, ``commit_once`` the one that applies the
lost-answer rule around it for every kind, and ``commit_batch`` the only place offsets advance;
``committed_end`` is the only reader of txn versions. Invariant 10: the txn versions are checked
on the same ``DeltaTable`` object the commit is made on, so a concurrent writer's commit of the
same partitions makes delta-rs reject ours.

Every kind of batch composes its commit from the same parts — ``add_actions_for`` for the files it
wrote, ``remove_actions`` / ``readd_actions`` for files it replaces or restores, ``txns`` for
the ends it moves — so a new sink mode (upsert) adds a composition, not a new commit path.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import date, datetime
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable, PostCommitHookProperties, Transaction
from deltalake.exceptions import CommitFailedError
from deltalake.transaction import AddAction, RemoveAction
from pyarrow import fs as pafs

from offsetlake import storage
from offsetlake.config import PipelineConfig
from offsetlake.entry import AppliedChange, LedgerEntry
from offsetlake.errors import CommitConflictError, OffsetlakeError, StagedFilesError, StalePlanError
from offsetlake.file_stats import delta_stats
from offsetlake.history import (
    commit_version,
    covering_batch,
    creation_metadata,
    landed_version,
    refuse_foreign_sink,
    sink_commits,
)
from offsetlake.plan import BatchPlan, OffsetRange
from offsetlake.schema_evolution import dotted, schema_diff, table_schema

# The commit history is the ledger's source of truth (invariant 4): delta-rs must never delete
# old commit files when it writes a checkpoint (by default it does after 30 days).
KEEP_HISTORY = {"delta.enableExpiredLogCleanup": "false"}

log = logging.getLogger(__name__)

open_table = storage.open_table


@dataclass(frozen=True)
class StagedFile:
    """One file a task wrote, as the task reports it; the commit checks the file against it."""

    path: str  # relative to the table root, unescaped (what an AddAction takes)
    rows: int
    counts: dict[tuple[str, int], int]  # rows inside the plan's ranges, per topic-partition
    size: int  # bytes the task wrote
    empty_as_null: int = 0  # rows whose "" partition value the folder stores as null (``storage.partition_folder``)


@dataclass(frozen=True)
class WrittenFiles:
    """The data files one attempt staged: their add actions (with stats), rows and schema."""

    actions: list[AddAction]
    rows: int
    schema: pa.Schema

    @staticmethod
    def none() -> WrittenFiles:
        return WrittenFiles(actions=[], rows=0, schema=pa.schema([]))


# ---- committed ends ---------------------------------------------------------------------------
def committed_end(table: DeltaTable | None, config: PipelineConfig, topic: str, partition: int) -> int | None:
    """The exclusive end committed for one topic-partition: the sink's txn version for its appId
    (``<pipeline>:<topic>:<partition>``), None if nothing was ever committed. The only reader of
    txn versions: every question about committed ends comes here."""
    if table is None:
        return None
    return table.transaction_version(config.app_id(topic, partition))


def committed_ends(table: DeltaTable | None, config: PipelineConfig, topic: str, partitions: Iterable[int]) -> dict[int, int | None]:
    return {p: committed_end(table, config, topic, p) for p in partitions}


def committed_end_lookup(table: DeltaTable | None, config: PipelineConfig) -> Callable[[str, int], int | None]:
    """``committed_end`` bound to one table snapshot, for code that asks per topic-partition."""
    return lambda topic, partition: committed_end(table, config, topic, partition)


def check_plan_applies(table: DeltaTable | None, config: PipelineConfig, plan: BatchPlan) -> bool:
    """Invariant 3: True if the plan still applies, False if the sink already holds it.

    Raises StalePlanError when another batch moved a partition's committed end part-way,
    naming that batch, or when the sink is no longer the table the plan was made on: a plan made
    on a table later deleted or replaced would otherwise start the new table in the middle of
    each partition (a missing committed end looks like "applies"; issue 35, finding 8's follow-up).
    """
    if plan.sink_table_id is not None and table_id(table) != plan.sink_table_id:
        now = f"table {table_id(table)}" if table is not None else "no table"
        raise StalePlanError(
            f"batch {plan.batch_id} ({plan.describe()}) was planned on sink table "
            f"{plan.sink_table_id} at {config.sink_path}, which now holds {now} (deleted, re-created or replaced); "
            "its ranges start from that table's committed ends, so it was not applied; plan anew",
            pipeline=config.name,
            batch_id=plan.batch_id,
        )
    done = 0
    for r in plan.ranges:
        committed = committed_end(table, config, r.topic, r.partition)
        if committed is None or committed == r.start:
            continue
        if committed >= r.end and r.size > 0:
            done += 1
            continue
        winner = covering_batch(sink_commits(table, config.name), r.topic, r.partition, r.start)
        raise StalePlanError(
            f"batch {plan.batch_id} planned this range but the committed end is now "
            f"{committed} (moved by batch {winner or 'unknown'}); the plan is stale and was not applied",
            pipeline=config.name,
            batch_id=plan.batch_id,
            topic=r.topic,
            partition=r.partition,
            start=r.start,
            end=r.end,
        )
    sized = [r for r in plan.ranges if r.size > 0]
    return not (sized and done == len(sized))


def table_id(table: DeltaTable | None) -> str | None:
    """The sink table's identity: its Delta table id (None when there is no table)."""
    return None if table is None else str(table.metadata().id)


# ---- tables -----------------------------------------------------------------------------------
def create_table_once(
    location: storage.Location, schema: pa.Schema, partition_by: list[str], description: str, created_by: str | None = None
) -> DeltaTable:
    """Open ``location``, creating an empty table (protocol 1/2) first if there is none; its
    create commit names the pipeline ``created_by`` when given (a sink, see ``ensure_table``).

    Two processes may race to create it; the loser's error is ignored and it opens the winner's.
    """
    table = open_table(location)
    if table is not None:
        return table
    created = CommitProperties(custom_metadata=creation_metadata(created_by)) if created_by else None
    try:
        storage.create_table(
            location,
            schema,
            partition_by=partition_by or None,
            mode="ignore",
            description=description,
            configuration=KEEP_HISTORY,
            commit_properties=created,
        )
    except Exception:
        if open_table(location) is None:
            raise
    return storage.table(location)


def ensure_table(config: PipelineConfig, schema: pa.Schema) -> DeltaTable:
    """Open the sink, creating it from the first batch's schema if needed (its create commit names
    the pipeline: of two first runs racing on one table, the loser is refused, invariant 16)."""
    return create_table_once(
        config.layout.sink,
        schema,
        config.sink.partition_by,
        f"offsetlake sink of pipeline {config.name} ({config.topic_label})",
        created_by=config.name,
    )


def staging_dir(config: PipelineConfig, batch_id: str) -> str:
    """A fresh folder inside the table for one attempt's files (uncommitted files are inert)."""
    return storage.child(config.sink_path, "data", f"{batch_id}-{uuid.uuid4().hex[:8]}")


# ---- file actions -----------------------------------------------------------------------------
def add_actions_for(table_root: storage.Where, staged: Sequence[StagedFile]) -> WrittenFiles:
    """Add actions (with stats from each footer) for exactly the files the tasks reported
    (``staged``, paths relative to the table, unescaped); empty files are left out.

    Refuses the batch (StagedFilesError, nothing committed) when two reported files share a
    path, or a file is missing or differs in bytes or rows from what its task reported: such a
    file was overwritten or cut after its task closed it, and committing it would lose rows
    while the ledger counts them (issue 15, bug 1; issue 35, finding 1).
    """
    fs, root = storage.filesystem(table_root)
    shown = str(table_root)  # the table's path (a Location shows its path, never its settings)
    seen: set[str] = set()
    actions: list[AddAction] = []
    rows = 0
    for file in staged:
        if file.path in seen:
            raise StagedFilesError(shown, file.path, "two files a task reported have this path")
        seen.add(file.path)
        path = f"{root.rstrip('/')}/{file.path}"
        info = fs.get_file_info(path)
        if info.type != pafs.FileType.File:
            raise StagedFilesError(shown, file.path, "it is missing")
        with fs.open_input_file(path) as handle:
            metadata = pq.read_metadata(handle)
        if info.size != file.size or metadata.num_rows != file.rows:
            raise StagedFilesError(
                shown,
                file.path,
                f"it holds {metadata.num_rows} rows in {info.size} bytes, its task wrote {file.rows} rows in {file.size} bytes",
            )
        if metadata.num_rows == 0:
            continue
        actions.append(
            AddAction(
                path=file.path,  # the real relative path: delta-rs encodes it for the log
                size=info.size,
                partition_values=storage.partition_values_from_path(file.path),
                modification_time=int(info.mtime.timestamp() * 1000) if info.mtime else int(time.time() * 1000),
                data_change=True,
                stats=delta_stats(metadata),
            )
        )
        rows += metadata.num_rows
    return WrittenFiles(actions=actions, rows=rows, schema=pa.schema([]))


def live_files(table: DeltaTable) -> list[dict[str, Any]]:
    """The table's live data files as ``get_add_actions(flatten=True)`` rows: ``path`` as the log
    stores it, ``size_bytes``, ``modification_time``, ``partition.<col>``, ``min.<col>``..."""
    return pa.table(table.get_add_actions(flatten=True)).to_pylist()


def _partition_text(value: object) -> str | None:
    if value is None:
        return None
    return value.isoformat() if isinstance(value, date | datetime) else str(value)


def _partition_values(file: dict[str, Any], partition_by: list[str]) -> dict[str, str | None]:
    return {c: _partition_text(file.get(f"partition.{c}")) for c in partition_by}


def remove_actions(files: Iterable[dict[str, Any]], partition_by: list[str]) -> list[RemoveAction]:
    """Remove actions for ``live_files`` rows (their log paths decoded once, as the actions take them)."""
    now = int(time.time() * 1000)
    return [
        RemoveAction(
            path=storage.file_path_from_log(f["path"]),
            data_change=True,
            deletion_timestamp=now,
            size=f["size_bytes"],
            partition_values=_partition_values(f, partition_by) or None,
        )
        for f in files
    ]


def readd_actions(table_root: storage.Location, files: Iterable[dict[str, Any]], partition_by: list[str]) -> list[AddAction]:
    """Add actions that bring back files an earlier version had (``live_files`` rows of that
    version), with their statistics read again from the files' footers."""
    fs, _ = storage.filesystem(table_root)
    actions = []
    for f in files:
        _, path = storage.filesystem(storage.data_file(table_root, f["path"]))
        with fs.open_input_file(path) as handle:
            stats = delta_stats(pq.read_metadata(handle))
        actions.append(
            AddAction(
                path=storage.file_path_from_log(f["path"]),
                size=f["size_bytes"],
                partition_values=_partition_values(f, partition_by),
                modification_time=_millis(f["modification_time"]),
                data_change=True,
                stats=stats,
            )
        )
    return actions


def _millis(value: Any) -> int:
    return int(value.timestamp() * 1000) if isinstance(value, datetime) else int(value)


# ---- the commit -------------------------------------------------------------------------------
@dataclass
class CommitActions:
    """What one sink commit holds besides its entry: file actions and txn moves."""

    files: list[AddAction | RemoveAction] = field(default_factory=list)
    txns: list[Transaction] = field(default_factory=list)


def txns(config: PipelineConfig, ends: Iterable[tuple[OffsetRange | tuple[str, int], int]]) -> list[Transaction]:
    """One txn action per topic-partition (appId ``<pipeline>:<topic>:<partition>``), version =
    its new committed end."""
    out = []
    for where, end in ends:
        topic, partition = (where.topic, where.partition) if isinstance(where, OffsetRange) else where
        out.append(Transaction(config.app_id(topic, partition), end))
    return out


def txns_for(app_versions: Iterable[tuple[str, int]]) -> list[Transaction]:
    """Txn actions for other appIds (the dead-letter table's applied sink version)."""
    return [Transaction(app_id, version) for app_id, version in app_versions]


def commit(
    table: DeltaTable,
    actions: CommitActions,
    entry: LedgerEntry | AppliedChange,
    *,
    partition_by: list[str] | None,
    max_commit_retries: int | None = None,
    schema: pa.Schema | None = None,
) -> None:
    """The one shape of every offsetlake commit (ingest, stream, gap, backfill, rewind on the
    sink; applied changes on the dead-letter table): file actions, txn actions and the ledger
    entry (with offsetlake's marker, see ``offsetlake.entry``; the dead-letter table's commits carry an
    ``AppliedChange``) in ONE Delta commit, with a
    checkpoint and never a log cleanup.

    ``schema``, when given, is the table's new schema (``evolved_schema``): the commit then also
    carries the metaData action that changes it, so a column appears in the same commit as the
    first rows that have it (invariant 12). delta-rs writes that action only for an "overwrite"
    commit, so this one is an overwrite whose partition filter (``in []``) selects no file: it
    removes nothing (checked here: rows, txns and userMetadata as for an append) and takes no
    remove actions.

    Raises delta-rs's CommitFailedError on a conflict; sink commits go through ``commit_once``, which asks
    whether it landed anyway and says what losing means for the caller's kind.
    """
    properties = CommitProperties(
        custom_metadata={"userMetadata": entry.to_json()},
        app_transactions=actions.txns or None,
        max_commit_retries=max_commit_retries,
    )
    hooks = PostCommitHookProperties(create_checkpoint=True, cleanup_expired_logs=False)
    if schema is None:
        table.create_write_transaction(
            actions.files,
            mode="append",
            schema=table.schema(),
            partition_by=partition_by or None,
            commit_properties=properties,
            post_commithook_properties=hooks,
        )
        return
    if any(isinstance(a, RemoveAction) for a in actions.files):
        raise ValueError("a commit that changes the schema cannot remove files")
    nothing: Any = [(schema.names[0], "in", [])]
    table.create_write_transaction(
        actions.files,
        mode="overwrite",
        schema=schema,
        partition_by=partition_by or None,
        partition_filters=nothing,
        commit_properties=properties,
        post_commithook_properties=hooks,
    )


def commit_once(
    table: DeltaTable,
    config: PipelineConfig,
    actions: CommitActions,
    entry: LedgerEntry,
    *,
    conflict: str,
    topic: str | None = None,
    max_commit_retries: int = 0,
    schema: pa.Schema | None = None,
) -> int:
    """Make one sink commit (``commit``) and return the version that holds ``entry``'s batch.

    The lost-answer rule, for every commit on a sink (ingest, stream, gap, backfill, rewind,
    epoch): when delta-rs reports a conflict, the table is asked whether the commit holding
    ``entry.batch_id`` landed anyway (``history.landed_version``: on object storage a commit's
    answer can be lost after the store applied it, and the client's retried put-if-absent then
    fails as a conflict). If it landed, it stands; if not, nothing was committed and this raises
    CommitConflictError with ``conflict`` (what losing means for the caller's kind) and delta-rs's
    reason (invariant 10), carrying the pipeline, ``entry``'s batch and ``topic`` (a commit about
    a whole topic, an epoch) as fields. ``max_commit_retries`` defaults to none: a commit that removes or
    restores files, or moves txns backwards, must not be rebased onto a newer version.
    """
    try:
        commit(table, actions, entry, partition_by=config.sink.partition_by, max_commit_retries=max_commit_retries, schema=schema)
    except CommitFailedError as err:
        if landed_version(config.layout.sink, entry.batch_id) is None:
            raise CommitConflictError(f"{conflict}: {err}", pipeline=config.name, batch_id=entry.batch_id, topic=topic) from None
        log.warning(
            "pipeline %s: batch %s: the store applied the commit but its answer was lost (%s); it stands",
            config.name,
            entry.batch_id,
            str(err).splitlines()[0],
        )
    return commit_version(config.layout.sink, entry.batch_id)


def add_columns_first(table: DeltaTable, config: PipelineConfig, schema: pa.Schema, plan: BatchPlan) -> DeltaTable:
    """Add the columns and nested fields of ``schema`` that ``table`` lacks (nullable) in a
    metadata-only commit, for a batch that also removes files: delta-rs writes a schema change
    only with an overwrite, which cannot carry removes. Dying right after leaves an empty new
    column or field and nothing else. Raises CommitConflictError if another writer committed
    meanwhile (the files the batch read may have changed); returns ``table`` at its new version,
    the object the batch then commits on."""
    from deltalake.schema import Field as DeltaField

    current = table_schema(table)
    diff = schema_diff(current, schema)
    # a column that gains nested fields is given whole: delta-rs merges it into the one it has
    grown = [f for f in schema if f.name not in current.names or schema_diff(pa.schema([current.field(f.name)]), pa.schema([f])).added]
    before = table.version()
    table.alter.add_columns([DeltaField.from_arrow(f) for f in grown])
    if table.version() != before + 1:
        raise CommitConflictError(
            f"batch {plan.batch_id}: another writer committed to the sink while the batch added "
            f"{', '.join(map(dotted, diff.added))}; nothing of the batch was committed",
            pipeline=config.name,
            batch_id=plan.batch_id,
        )
    log.info("pipeline=%s batch=%s step=schema added=%s", config.name, plan.batch_id, ",".join(map(dotted, diff.added)))
    return table


def commit_batch(
    table: DeltaTable,
    config: PipelineConfig,
    plan: BatchPlan,
    files: WrittenFiles,
    entry: LedgerEntry,
    schema: pa.Schema | None = None,
    removed: list[dict[str, Any]] | None = None,
    pins: Sequence[Transaction] = (),
) -> int:
    """Commit data files + one txn per partition + the ledger entry as ONE Delta commit (with the
    sink's new ``schema`` when the batch adds columns, see ``commit``; with removes of the live
    files a keyed batch's merge rewrote, ``removed``, as ``live_files`` rows; with ``pins``, the
    txn naming the state a keyed batch committed, ``offsetlake.state_table``).

    The only place offsets advance (invariant 2). ``table`` must be the object whose txn
    versions ``check_plan_applies`` just read: delta-rs then rejects this commit if another
    writer committed any of these appIds meanwhile (invariant 10), raising CommitConflictError
    unless the commit landed and only its answer was lost (``commit_once``). A commit with
    removes is never retried on a newer version: delta-rs does not flag removes of files a
    concurrent commit already removed (see ``backfill.commit_replace``), so any commit
    since ``table``'s version fails it. Raises SinkOwnedError, committing nothing, when the table
    belongs to another pipeline (invariant 16). Returns the new table version.
    """
    refuse_foreign_sink(table, config.name)
    removes = remove_actions(removed or [], config.sink.partition_by)
    actions = CommitActions(files=[*removes, *files.actions], txns=[*txns(config, ((r, r.end) for r in plan.ranges)), *pins])
    lost = f"batch {plan.batch_id} lost the commit race for {plan.describe()}"
    version = commit_once(table, config, actions, entry, conflict=lost, max_commit_retries=0 if removes else 5, schema=schema)
    after = storage.table(config.layout.sink, version=version)
    behind = [r for r in plan.ranges if committed_end(after, config, r.topic, r.partition) != r.end]
    if behind:
        # Never expected. Not a lost race (CommitConflictError would be recorded as superseded, and
        # the loop would re-plan and commit the same records again): the batch fails and the run stops.
        raise OffsetlakeError(
            f"commit {version} of batch {plan.batch_id} did not record committed ends for "
            f"{', '.join(str(r) for r in behind)}; stopping instead of re-reading them: run `offsetlake audit` before running again",
            pipeline=config.name,
            batch_id=plan.batch_id,
        )
    return version
