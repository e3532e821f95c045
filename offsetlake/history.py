"""The sink's commit history: the source of truth of what every batch committed (invariant 4).

Each offsetlake commit on a sink carries its batch's **ledger entry** in
``commitInfo.userMetadata`` (invariant 2), marked as offsetlake's; ``offsetlake.entry`` owns that
entry (its types, JSON and versions). This module reads sink history: ``sink_commits`` lists a
pipeline's commits (with a cache, see there), ``commit_version`` finds the version of one batch's
commit, and ``covering_batch`` / ``rewound_batches`` answer "which
batch committed this offset" and "which batches did a rewind undo" from that history alone, and
``refuse_foreign_sink`` keeps a sink table to the one pipeline whose commits it holds.
``offsetlake.sink`` (the commit) and ``offsetlake.ledger`` (the projection) both build on it.
"""

from __future__ import annotations

import bisect
import json
import logging
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from deltalake import DeltaTable
from pyarrow import fs as pafs

from offsetlake import storage
from offsetlake.entry import EntryFormatError, EpochChange, EpochEntry, LedgerEntry, RewindEntry, from_dict, parse
from offsetlake.errors import SinkOwnedError
from offsetlake.plan import BatchKind

log = logging.getLogger("offsetlake.history")

CACHE_FOLDER = "_offsetlake_history"  # inside the table folder: Delta and vacuum ignore "_" paths
CREATED_BY = "offsetlake_sink_of"  # userMetadata key of a sink's create commit: the pipeline that created it
DATA_CHANGE = "_offsetlake_data_change"  # key of a commit_infos row: the data files its actions added and removed


@dataclass(frozen=True)
class SinkCommit:
    """One offsetlake commit found in the sink table's history."""

    version: int
    entry: LedgerEntry  # the ledger entry stored as userMetadata

    @property
    def batch_id(self) -> str:
        return self.entry.batch_id

    @property
    def kind(self) -> BatchKind:
        return self.entry.kind


@dataclass(frozen=True)
class ForeignCommit:
    """A commit on the sink that offsetlake did not make and that changed rows: a user's DELETE,
    UPDATE or MERGE from Spark, delta-rs or any other engine (``offsetlake sql --write`` among
    them). What it changed is in the files it removed and added (``offsetlake.foreign``)."""

    version: int
    operation: str  # commitInfo.operation: DELETE, UPDATE, MERGE, WRITE, ...
    engine: str  # commitInfo.engineInfo (or clientVersion): who made it
    timestamp_ms: int | None
    removed: tuple[str, ...]  # log paths of the data files it removed (dataChange)
    added: tuple[str, ...]

    def describe(self) -> str:
        return f"version {self.version} ({self.operation} by {self.engine})"

    def as_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "operation": self.operation,
            "engine": self.engine,
            "timestamp_ms": self.timestamp_ms,
            "removed": list(self.removed),
            "added": list(self.added),
        }

    @staticmethod
    def from_dict(data: dict[str, Any]) -> ForeignCommit:
        return ForeignCommit(
            int(data["version"]),
            str(data["operation"]),
            str(data["engine"]),
            data.get("timestamp_ms"),
            tuple(data["removed"]),
            tuple(data["added"]),
        )


# ---- the ledger entry (``offsetlake.entry``) --------------------------------------------------
def _marked_entry(info: dict) -> LedgerEntry | None:
    """The ledger entry a commit's ``userMetadata`` holds, if the commit is offsetlake's."""
    return parse(info.get("userMetadata"))


def creation_metadata(pipeline: str) -> dict[str, str]:
    """The ``userMetadata`` of a sink's create commit: which pipeline created it (not a ledger
    entry: no batch, no marker). Two first runs racing to create one table cannot both win the
    create, so the loser finds the winner's name here before it commits (invariant 16)."""
    return {"userMetadata": json.dumps({CREATED_BY: pipeline}, separators=(",", ":"))}


def _owner_of(info: dict) -> str | None:
    """The pipeline a commit belongs to: its ledger entry's, or the creator named by a create commit."""
    entry = _marked_entry(info)
    if entry is not None:
        return entry.pipeline
    raw = info.get("userMetadata")
    if not raw or CREATED_BY not in raw:
        return None
    try:
        meta = json.loads(raw)
    except ValueError:
        return None
    return str(meta[CREATED_BY]) if isinstance(meta, dict) and meta.get(CREATED_BY) else None


# ---- reading history --------------------------------------------------------------------------
@dataclass(frozen=True)
class _History:
    """What one read of a sink's log says: a pipeline's commits, and every pipeline that owns any
    commit of the table (name -> first version), for the ownership check."""

    commits: list[SinkCommit]
    owners: dict[str, int]
    foreign: list[ForeignCommit] = field(default_factory=list)


def sink_commits(table: DeltaTable | None, pipeline: str) -> list[SinkCommit]:
    """offsetlake's commits on the sink (oldest first), each with its ledger entry.

    Commits never change once written, so the ones already seen are kept in a cache file inside
    the table folder (``_offsetlake_history/<pipeline>.json``) and only newer versions are read
    from the log: every plan reconciles with this history, and reading all of it made planning
    slower with every batch. The cache is only an accelerator, keyed by the table's id; when it
    is missing, unreadable or from another table, the whole history is read.
    """
    return _history(table, pipeline).commits


def foreign_commits(table: DeltaTable | None, pipeline: str) -> list[ForeignCommit]:
    """The sink's commits that offsetlake did not make and that changed rows (oldest first): a
    commit without an offsetlake ledger entry whose actions add or remove data files with
    ``dataChange`` (compaction and vacuum change no rows; offsetlake's own create commit adds none).
    Read with ``sink_commits`` and kept in the same cache."""
    return _history(table, pipeline).foreign


def _history(table: DeltaTable | None, pipeline: str) -> _History:
    if table is None:
        return _History([], {})
    version = table.version()
    table_id = table.metadata().id
    cache = storage.table_place(table).child(CACHE_FOLDER, f"{pipeline}.json")
    cached = _read_cache(cache, table_id, version)
    seen, history = (-1, _History([], {})) if cached is None else cached
    infos = [i for i in commit_infos(table, seen + 1, version) if int(i["version"]) > seen]
    owners = dict(history.owners)
    for info in infos:
        owner = _owner_of(info)
        if owner is not None:
            owners.setdefault(owner, int(info["version"]))
    history = _History(history.commits + _commits_in(infos, pipeline), owners, history.foreign + _foreign_in(infos))
    if version > seen:
        _write_cache(cache, table_id, version, history)
    return history


def refuse_foreign_sink(table: DeltaTable | None, pipeline: str) -> None:
    """Invariant 16: a sink table belongs to one pipeline. Raises SinkOwnedError, naming both
    pipelines and the table, when ``table``'s history holds another pipeline's commits (or it was
    created by another pipeline); nothing is committed then.

    Called right before every commit on a sink (``sink.commit_batch``, the backfill and rewind
    commits) on the very snapshot the commit is made on, and at the start of a run. Cheap: it
    reads the cached history (see ``sink_commits``), so only commits newer than the cache.
    Why refuse rather than share: rewind, backfill, maintenance and the audit work on a table's
    versions and files, so one pipeline's rewind would undo the other's commits while their txns
    stay (issue 35, finding 6). Merging topics into one table is one pipeline with ``topics:``.
    """
    if table is None:
        return
    others = {name: v for name, v in _history(table, pipeline).owners.items() if name != pipeline}
    if not others:
        return
    name, since = min(others.items(), key=lambda item: item[1])
    more = f" (and {', '.join(sorted(set(others) - {name}))})" if len(others) > 1 else ""
    raise SinkOwnedError(
        f"the sink table {storage.table_location(table)} belongs to pipeline {name}{more}: its "
        f"history holds {name}'s commits from version {since}. A sink table belongs to one pipeline: a rewind, "
        f"backfill or maintenance of one would change the other's rows. Nothing was committed. To write several "
        f"topics into one table, use one pipeline with `topics:`; otherwise give pipeline {pipeline} its own sink.table",
        pipeline=pipeline,
    )


def _foreign_in(infos: list[dict]) -> list[ForeignCommit]:
    found = []
    for info in infos:
        change = info.get(DATA_CHANGE)
        if not change or not (change["add"] or change["remove"]) or _marked_entry(info) is not None:
            continue
        engine = info.get("engineInfo") or info.get("clientVersion") or "an unnamed engine"
        found.append(
            ForeignCommit(
                int(info["version"]),
                str(info.get("operation") or "?"),
                str(engine),
                info.get("timestamp"),
                tuple(change["remove"]),
                tuple(change["add"]),
            )
        )
    return found


def _commits_in(history: list[dict], pipeline: str) -> list[SinkCommit]:
    commits = []
    for info in history:
        entry = _marked_entry(info)
        if entry is not None and entry.pipeline == pipeline:
            commits.append(SinkCommit(version=int(info["version"]), entry=entry))
    return sorted(commits, key=lambda c: c.version)


def _read_cache(location: storage.Location, table_id: object, version: int) -> tuple[int, _History] | None:
    try:
        fs, path = storage.filesystem(location)
        with fs.open_input_stream(path) as handle:
            data = json.loads(handle.read())
        if data["table_id"] != table_id or data["version"] > version:
            return None
        owners = {str(k): int(v) for k, v in data["owners"].items()}  # a cache without owners is read again
        foreign = [ForeignCommit.from_dict(f) for f in data["foreign"]]  # nor one without foreign commits
        return data["version"], _History([SinkCommit(version=v, entry=from_dict(e)) for v, e in data["commits"]], owners, foreign)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, EntryFormatError):
        return None


def _write_cache(location: storage.Location, table_id: object, version: int, history: _History) -> None:
    body = json.dumps(
        {
            "table_id": table_id,
            "version": version,
            "owners": history.owners,
            "commits": [[c.version, c.entry.as_dict()] for c in history.commits],
            "foreign": [f.as_dict() for f in history.foreign],
        }
    )
    try:
        fs, path = storage.filesystem(location)
        fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
        if isinstance(fs, pafs.LocalFileSystem):
            # readers see the old or the new cache, never half of one: write aside, then rename
            temporary = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
            with fs.open_output_stream(temporary) as out:
                out.write(body.encode())
            fs.move(temporary, path)
        else:  # object stores replace a whole object at once
            with fs.open_output_stream(path) as out:
                out.write(body.encode())
    except OSError as err:
        log.debug("history cache not written at %s: %s", location, err)


def commit_infos(table: DeltaTable, first: int, last: int) -> list[dict[str, Any]]:
    """The ``commitInfo`` of versions ``first``..``last`` (each with its ``version`` and, read from
    the commit file, ``DATA_CHANGE``: the paths its add and remove actions with ``dataChange`` name),
    oldest first.

    Read from the commit files ``_delta_log/<version>.json`` themselves: delta-rs 1.6.6's
    ``history()`` returns nothing for a table whose path holds ``#`` or ``?`` (checked here, while
    reads, writes, optimize and vacuum work), and sinks keep every commit file (``KEEP_HISTORY``).
    A commit file that is gone (log cleanup on a table offsetlake did not create) is taken from
    ``history()``.
    """
    if last < first:
        return []
    log_dir = storage.table_place(table).child("_delta_log")
    fs, root = storage.filesystem(log_dir)
    infos: list[dict[str, Any]] = []
    missing = []
    for version in range(max(first, 0), last + 1):
        try:
            with fs.open_input_stream(f"{root}/{version:020d}.json") as handle:
                text = handle.read().decode("utf-8")
        except FileNotFoundError:
            missing.append(version)
            continue
        info: dict[str, Any] = {}
        change: dict[str, list[str]] = {"add": [], "remove": []}
        for line in text.splitlines():
            if line.startswith('{"commitInfo"'):
                info = json.loads(line)["commitInfo"]
            elif line.startswith(('{"add"', '{"remove"')):
                action_kind, action = next(iter(json.loads(line).items()))
                if action.get("dataChange", True):
                    change[action_kind].append(action["path"])
        infos.append({**info, "version": version, DATA_CHANGE: change})
    if missing:
        known = {int(h["version"]): h for h in table.history()}
        infos += [known[v] for v in missing if v in known]
    return sorted(infos, key=lambda i: int(i["version"]))


def latest_commit_info(table: DeltaTable) -> dict[str, Any] | None:
    """The ``commitInfo`` of the table's newest commit (which may be newer than ``table``'s version)."""
    version = table.version()
    fs, root = storage.filesystem(storage.table_place(table).child("_delta_log"))
    while fs.get_file_info(f"{root}/{version + 1:020d}.json").type != pafs.FileType.NotFound:
        version += 1
    infos = commit_infos(table, version, version)
    return infos[0] if infos else None


def commit_version(location: storage.Location, batch_id: str) -> int:
    """The version of the sink commit holding ``batch_id``'s entry (a DeltaTable does not say
    which version its own commit got); raises RuntimeError if there is none."""
    version = landed_version(location, batch_id)
    if version is None:
        raise RuntimeError(f"commit of batch {batch_id} not found in the history of {location}")
    return version


def landed_version(location: storage.Location, batch_id: str) -> int | None:
    """The version of the sink commit holding ``batch_id``'s entry, or None.

    Also how a writer whose commit failed learns that it landed after all: on object storage a
    commit's answer can be lost after the store applied it (a dropped connection); the client
    retries the put-if-absent, the store refuses it as a duplicate, and delta-rs reports a
    conflict, with the writer's own commit on the table."""
    fresh = storage.table(location)
    newest = fresh.version()
    for first in (max(0, newest - 20), 0):
        for info in reversed(commit_infos(fresh, first, newest)):
            entry = _marked_entry(info)
            if entry is not None and entry.batch_id == batch_id:
                return int(info["version"])
    return None


# ---- questions answered from history ----------------------------------------------------------
def rewound_batches(commits: Iterable[SinkCommit]) -> dict[str, SinkCommit]:
    """Batch id -> the rewind commit that undid it, from the ``rewound`` list every rewind commit
    carries in its entry. Sink history is the truth (invariant 4): this is how the ledger learns
    which committed batches no longer count."""
    undone: dict[str, SinkCommit] = {}
    for commit in sorted(commits, key=lambda c: c.version):
        if isinstance(commit.entry, RewindEntry):
            for batch_id in commit.entry.rewound:
                undone.setdefault(batch_id, commit)
    return undone


def covering_batch(commits: Iterable[SinkCommit], topic: str, partition: int, offset: int) -> str | None:
    """The first commit whose ranges hold ``offset`` (rewound batches skipped: a rewind commit
    covering it is named instead)."""
    commits = list(commits)
    rewound = rewound_batches(commits)
    for commit in commits:
        if commit.batch_id in rewound:
            continue
        for r in commit.entry.ranges:
            if r.topic == topic and r.partition == partition and r.start <= offset < r.end:
                return commit.batch_id
    return None


def live_commits(commits: Iterable[SinkCommit]) -> list[SinkCommit]:
    """The commits that still count: not rewind commits, not undone by one."""
    commits = list(commits)
    rewound = rewound_batches(commits)
    return [c for c in commits if c.kind != BatchKind.REWIND and c.batch_id not in rewound]


# ---- topic epochs (invariant 16) ---------------------------------------------------------------
def epoch_starts(commits: list[SinkCommit]) -> dict[str, list[int]]:
    """Per topic, the sink versions of its live epoch commits (``offsetlake topic reset-epoch``),
    ascending; a topic without any has one epoch. Offsets of different epochs of one topic name
    different records (the topic was re-created or truncated). A rewind never undoes an epoch
    commit (``offsetlake.rewind`` refuses), but one made before that rule may have."""
    rewound = rewound_batches(commits)
    out: dict[str, list[int]] = {}
    for c in sorted(commits, key=lambda c: c.version):
        change = epoch_change(c)
        if change is not None and c.batch_id not in rewound:
            out.setdefault(change.topic, []).append(c.version)
    return out


def epoch_at(starts: list[int], version: int) -> int:
    """The epoch (0 = the first) a commit at sink ``version`` belongs to, given a topic's
    ``epoch_starts``: an epoch commit opens the epoch it belongs to."""
    return bisect.bisect_right(starts, version)


def current_epochs(commits: list[SinkCommit]) -> dict[str, int]:
    """Each topic's current epoch, for the topics that have had an epoch commit (others are in
    epoch 0): what a batch's rows carry (``coordinates.TOPIC_EPOCH``) and what it may replace."""
    return {topic: len(versions) for topic, versions in epoch_starts(commits).items()}


def latest_epoch_commit(commits: list[SinkCommit], topic: str) -> SinkCommit | None:
    """The live epoch commit that opened ``topic``'s current epoch (None: it is in epoch 0)."""
    rewound = rewound_batches(commits)
    found = [c for c in commits if c.batch_id not in rewound and (change := epoch_change(c)) is not None and change.topic == topic]
    return max(found, key=lambda c: c.version) if found else None


def epoch_change(commit: SinkCommit) -> EpochChange | None:
    """What an epoch commit moved (None for every other commit)."""
    return commit.entry.epoch if isinstance(commit.entry, EpochEntry) else None
