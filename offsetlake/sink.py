"""The sink Delta table: committed ends, parquet files written by Spark, and the one commit.

Invariant 2: a batch's data files, its offset advance (one ``txn`` per topic-partition, version =
exclusive end offset) and its ledger entry (``commitInfo.userMetadata``) are ONE Delta commit.
``commit_batch`` is the only place offsets advance. Invariant 10: the txn versions are checked
on the same ``DeltaTable`` object the commit is made on, so a concurrent writer's commit of the
same partitions makes delta-rs reject ours.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from dataclasses import dataclass
from datetime import date, datetime
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable, PostCommitHookProperties, Transaction
from deltalake.exceptions import CommitFailedError, TableNotFoundError
from deltalake.transaction import AddAction
from pyarrow import fs as pafs

from offsetlake.config import PipelineConfig
from offsetlake.errors import CommitConflictError, StalePlanError
from offsetlake.ledger import SinkCommit, covering_batch, ledger_entry_json
from offsetlake.plan import BatchPlan

log = logging.getLogger("offsetlake.sink")
_MARKER = "offsetlake"
_STAT_TYPES = (
    pa.types.is_integer, pa.types.is_floating, pa.types.is_date, pa.types.is_timestamp, pa.types.is_string, pa.types.is_boolean,
)


@dataclass(frozen=True)
class WrittenFiles:
    actions: list[AddAction]
    rows: int
    schema: pa.Schema


def open_table(path: str) -> DeltaTable | None:
    try:
        return DeltaTable(path)
    except TableNotFoundError:
        return None


def committed_ends(table: DeltaTable | None, config: PipelineConfig, topic: str, partitions: list[int]) -> dict[int, int | None]:
    """The exclusive end committed per partition: the sink's txn version for its appId."""
    if table is None:
        return {p: None for p in partitions}
    return {p: table.transaction_version(config.app_id(topic, p)) for p in partitions}


def sink_commits(table: DeltaTable | None, pipeline: str) -> list[SinkCommit]:
    """offsetlake's commits on the sink (oldest first), each with its ledger entry.

    Commits never change once written, so the ones already seen are kept in a cache file inside
    the table folder (``_offsetlake_history/``: Delta and vacuum ignore paths starting with ``_``)
    and only newer versions are read from the log: every plan reconciles with this history, and
    reading all of it made planning slower with every batch. The cache is only an accelerator,
    keyed by the table's id; when it is missing, unreadable or from another table, the whole
    history is read.
    """
    if table is None:
        return []
    version = table.version()
    table_id = table.metadata().id
    cache_file = _history_cache_file(table, pipeline)
    cached = _read_history_cache(cache_file, table_id, version)
    if cached is None:
        seen, commits = -1, _commits_in(table.history(), pipeline)
    else:
        seen, commits = cached
        commits = commits + _commits_in(table.history(version - seen) if version > seen else [], pipeline, after=seen)
    if cache_file is not None and version > seen:
        _write_history_cache(cache_file, table_id, version, commits)
    return commits


def _commits_in(history: list[dict], pipeline: str, after: int = -1) -> list[SinkCommit]:
    commits = []
    for info in history:
        raw = info.get("userMetadata")
        if not raw or int(info["version"]) <= after:
            continue
        try:
            entry = json.loads(raw)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get(_MARKER) == 1 and entry.get("pipeline") == pipeline:
            commits.append(SinkCommit(version=int(info["version"]), entry=entry))
    return sorted(commits, key=lambda c: c.version)


def _history_cache_file(table: DeltaTable, pipeline: str) -> str | None:
    uri = table.table_uri
    root = unquote(uri[len("file://"):]) if uri.startswith("file://") else uri
    return os.path.join(root, "_offsetlake_history", f"{pipeline}.json") if os.path.isdir(root) else None


def _read_history_cache(path: str | None, table_id: str, version: int) -> tuple[int, list[SinkCommit]] | None:
    if path is None:
        return None
    try:
        with open(path) as f:
            data = json.load(f)
        if data["table_id"] != table_id or data["version"] > version:
            return None
        return data["version"], [SinkCommit(version=v, entry=e) for v, e in data["commits"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_history_cache(path: str, table_id: str, version: int, commits: list[SinkCommit]) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temporary = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
        with open(temporary, "w") as f:
            json.dump({"table_id": table_id, "version": version, "commits": [[c.version, c.entry] for c in commits]}, f)
        os.replace(temporary, path)  # atomic: readers see the old or the new cache, never half of one
    except OSError as err:
        log.debug("history cache not written at %s: %s", path, err)


def staging_dir(config: PipelineConfig, batch_id: str) -> str:
    """A fresh folder inside the table for one attempt's files (uncommitted files are inert)."""
    return f"{config.sink_path}/data/{batch_id}-{uuid.uuid4().hex[:8]}"


def collect_written_files(table_root: str, folder: str) -> WrittenFiles:
    """Add actions (with stats) for every non-empty parquet file Spark wrote under ``folder``."""
    filesystem, root = pafs.FileSystem.from_uri(_uri(table_root))
    _, base = pafs.FileSystem.from_uri(_uri(folder))
    infos = filesystem.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
    actions: list[AddAction] = []
    rows = 0
    schema: pa.Schema | None = None
    for info in infos:
        if info.type != pafs.FileType.File or not info.base_name.endswith(".parquet"):
            continue
        with filesystem.open_input_file(info.path) as handle:
            metadata = pq.read_metadata(handle)
        if metadata.num_rows == 0:
            continue
        schema = schema or metadata.schema.to_arrow_schema()
        relative = info.path[len(root.rstrip("/")) + 1:]
        partition_values = {
            unquote(k): (None if v == "__HIVE_DEFAULT_PARTITION__" else unquote(v))
            for k, _, v in (seg.partition("=") for seg in relative.split("/")[:-1] if "=" in seg)
        }
        actions.append(
            AddAction(
                path=relative,
                size=info.size,
                partition_values=partition_values,
                modification_time=int(info.mtime.timestamp() * 1000) if info.mtime else int(time.time() * 1000),
                data_change=True,
                stats=json.dumps(file_stats(metadata)),
            )
        )
        rows += metadata.num_rows
    return WrittenFiles(actions=actions, rows=rows, schema=schema or pa.schema([]))


def file_stats(metadata: pq.FileMetaData) -> dict:
    """Delta file statistics from the parquet footer: numRecords, nullCount, min/max."""
    arrow_schema = metadata.schema.to_arrow_schema()
    mins: dict = {}
    maxs: dict = {}
    nulls: dict = {}
    for index, field in enumerate(arrow_schema):
        if not any(check(field.type) for check in _STAT_TYPES):
            continue
        null_count = 0
        low = high = None
        complete = True
        for rg in range(metadata.num_row_groups):
            stats = metadata.row_group(rg).column(index).statistics
            if stats is None or not stats.has_null_count:
                complete = False
                break
            null_count += stats.null_count
            if stats.has_min_max:
                low = stats.min if low is None else min(low, stats.min)
                high = stats.max if high is None else max(high, stats.max)
        if not complete:
            continue
        nulls[field.name] = null_count
        # Every column with values needs min and max: delta-rs turns a missing bound into a null
        # guarantee and its pyarrow dataset then prunes the file for any filter on that column
        # (seen here: a filter on _kafka_topic matched no rows).
        if low is not None:
            mins[field.name], maxs[field.name] = _stat_value(low), _stat_value(high)
    return {"numRecords": metadata.num_rows, "minValues": mins, "maxValues": maxs, "nullCount": nulls}


def _stat_value(value: object) -> object:
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    if isinstance(value, date):
        return value.isoformat()
    return value


def _uri(path: str) -> str:
    return path if "://" in path else f"file://{os.path.abspath(path)}"


# The commit history is the ledger's source of truth (invariant 4): delta-rs must never delete
# old commit files when it writes a checkpoint (by default it does after 30 days).
KEEP_HISTORY = {"delta.enableExpiredLogCleanup": "false"}


def create_table_once(path: str, schema: pa.Schema, partition_by: list[str], description: str) -> DeltaTable:
    """Open ``path``, creating an empty table (protocol 1/2) first if there is none.

    Two processes may race to create it; the loser's error is ignored and it opens the winner's.
    """
    table = open_table(path)
    if table is not None:
        return table
    try:
        DeltaTable.create(path, schema, partition_by=partition_by or None, mode="ignore", description=description,
                          configuration=KEEP_HISTORY)
    except Exception:  # noqa: BLE001 - a concurrent create; the open below decides
        if open_table(path) is None:
            raise
    return DeltaTable(path)


def ensure_table(config: PipelineConfig, schema: pa.Schema) -> DeltaTable:
    """Open the sink, creating it from the first batch's schema if needed."""
    return create_table_once(
        config.sink_path, schema, config.sink.partition_by,
        f"offsetlake sink of pipeline {config.name} (topic {config.topic})",
    )


def check_plan_applies(table: DeltaTable | None, config: PipelineConfig, plan: BatchPlan) -> bool:
    """Invariant 3: True if the plan still applies, False if the sink already holds it.

    Raises StalePlanError when another batch moved a partition's committed end part-way,
    naming that batch.
    """
    done = 0
    for r in plan.ranges:
        committed = table.transaction_version(config.app_id(r.topic, r.partition)) if table else None
        if committed is None or committed == r.start:
            continue
        if committed >= r.end and r.size > 0:
            done += 1
            continue
        winner = covering_batch(sink_commits(table, config.name), r.topic, r.partition, r.start)
        raise StalePlanError(
            f"pipeline {config.name}: batch {plan.batch_id} planned {r} but the committed end is now "
            f"{committed} (moved by batch {winner or 'unknown'}); the plan is stale and was not applied"
        )
    sized = [r for r in plan.ranges if r.size > 0]
    return not (sized and done == len(sized))


def commit_batch(
    table: DeltaTable,
    config: PipelineConfig,
    plan: BatchPlan,
    files: WrittenFiles,
    entry: dict,
) -> int:
    """Commit data files + one txn per partition + the ledger entry as ONE Delta commit.

    The only place offsets advance (invariant 2). ``table`` must be the object whose txn
    versions ``check_plan_applies`` just read: delta-rs then rejects this commit if another
    writer committed any of these appIds meanwhile (invariant 10), raising CommitConflictError.
    Returns the new table version.
    """
    transactions = [Transaction(config.app_id(r.topic, r.partition), r.end) for r in plan.ranges]
    try:
        commit_actions(table, config, files.actions, entry, transactions, max_commit_retries=5)
    except CommitFailedError as err:
        raise CommitConflictError(
            f"pipeline {config.name}: batch {plan.batch_id} lost the commit race for {plan.describe()}: {err}"
        ) from None
    version = committed_version(config.sink_path, plan.batch_id)
    after = DeltaTable(config.sink_path, version=version)
    behind = [r for r in plan.ranges if after.transaction_version(config.app_id(r.topic, r.partition)) != r.end]
    if behind:
        # Never expected; without this a run would re-plan the same ranges forever.
        raise CommitConflictError(
            f"pipeline {config.name}: commit {version} of batch {plan.batch_id} did not record committed ends for "
            f"{', '.join(str(r) for r in behind)}; stopping instead of re-reading them"
        )
    return version


def commit_actions(
    table: DeltaTable,
    config: PipelineConfig,
    actions: list,
    entry: dict,
    transactions: list[Transaction] | None = None,
    max_commit_retries: int | None = None,
) -> None:
    """The one shape of every offsetlake sink commit (ingest, backfill, rewind): file actions,
    txn actions and the ledger entry (marked as offsetlake's, for ``sink_commits``) in ONE Delta
    commit, with a checkpoint and never a log cleanup. Raises delta-rs's CommitFailedError on a
    conflict; callers say what that means for their kind of commit."""
    table.create_write_transaction(
        actions,
        mode="append",
        schema=table.schema(),
        partition_by=config.sink.partition_by or None,
        commit_properties=CommitProperties(
            custom_metadata={"userMetadata": ledger_entry_json({**entry, _MARKER: 1})},
            app_transactions=transactions or None,
            max_commit_retries=max_commit_retries,
        ),
        post_commithook_properties=PostCommitHookProperties(create_checkpoint=True, cleanup_expired_logs=False),
    )


def committed_version(path: str, batch_id: str) -> int:
    """The table version holding ``batch_id``'s commit (the DeltaTable object does not tell)."""
    fresh = DeltaTable(path)
    for limit in (20, None):
        for info in fresh.history(limit):
            raw = info.get("userMetadata") or ""
            if f'"batch_id":"{batch_id}"' in raw:
                return int(info["version"])
    raise RuntimeError(f"commit of batch {batch_id} not found in the history of {path}")
