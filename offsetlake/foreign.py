"""Commits on a sink that offsetlake did not make: what they changed, row by row.

A sink table is a Delta table, and lakehouse users write to Delta tables: a GDPR delete from
Databricks or ``spark-sql``, an UPDATE that fixes a value, ``offsetlake sql --write``. Such a
commit carries no ledger entry, so offsetlake's history (``history.foreign_commits``) tells it
apart from its own, and its add and remove actions say which data files it replaced. This module
reads those files and says what changed: the rows it removed and added, by row identity (the
source record's coordinates, the row's index among its record's rows, the topic epoch), and how
many of them lie inside committed ranges.

What offsetlake does with them (docs/design.md, "Foreign commits"):

* ``run``, ``status`` and ``audit`` recognise them and report what they changed, by version and
  engine; the plain audit counts the rows they removed against the batches' entries, so a
  foreign delete is explained, not taken for a lost row;
* a backfill keeps a foreign delete: a row a foreign commit removed, and that is still absent,
  is not written again by a backfill of its range unless ``--restore-deleted`` asks for it
  (``still_deleted``); a rewind that would bring such rows back is refused unless asked;
* the outbox publishes their changes like any other commit's (``offsetlake.outbox``).

The removed files must still exist (vacuum keeps them for its retention, 7 days by default);
when they are gone, what the commit deleted cannot be known and ``ForeignCommitError`` says so.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import DeltaTable

from offsetlake import storage
from offsetlake.coordinates import OFFSET, PARTITION, ROW_INDEX, TOPIC, TOPIC_EPOCH
from offsetlake.errors import ForeignCommitError
from offsetlake.history import ForeignCommit, foreign_commits
from offsetlake.log_lines import log_line

log = logging.getLogger("offsetlake.foreign")

# what identifies a row: its record, its index among its record's rows (-1 without a transform),
# and its topic's epoch (0: the first)
Identity = tuple[str, int, int, int, int]
IDENTITY_COLUMNS = (TOPIC, PARTITION, OFFSET, ROW_INDEX, TOPIC_EPOCH)


@dataclass(frozen=True)
class ForeignChange:
    """What one foreign commit changed: the identities of the rows in the files it removed and
    in the files it added (a row it left alone is in both)."""

    commit: ForeignCommit
    before: Counter[Identity]
    after: Counter[Identity]

    @property
    def removed(self) -> Counter[Identity]:
        """Rows it deleted (an UPDATE removes and adds the same identity: not among them)."""
        return self.before - self.after

    @property
    def added(self) -> Counter[Identity]:
        return self.after - self.before

    def rewritten(self) -> int:
        """Rows whose identity it kept while rewriting their file (an UPDATE's, or untouched)."""
        return sum((self.before & self.after).values())

    def summary(self) -> dict[str, Any]:
        return {
            "version": self.commit.version,
            "operation": self.commit.operation,
            "engine": self.commit.engine,
            "rows_removed": sum(self.removed.values()),
            "rows_added": sum(self.added.values()),
        }

    def describe(self) -> str:
        s = self.summary()
        return f"{self.commit.describe()}: {s['rows_removed']} row(s) removed, {s['rows_added']} added"


def foreign_changes(table: DeltaTable | None, pipeline: str, since_version: int = -1) -> list[ForeignChange]:
    """What each foreign commit on ``table`` after ``since_version`` changed, oldest first.
    Raises ForeignCommitError when a file one of them removed is gone (vacuumed)."""
    if table is None:
        return []
    root = storage.table_place(table)
    return [_change(root, pipeline, c) for c in foreign_commits(table, pipeline) if c.version > since_version]


def still_deleted(table: DeltaTable | None, pipeline: str, present: Iterable[Identity]) -> set[Identity]:
    """The rows foreign commits deleted that are still absent: not among ``present`` (the
    identities the table holds now, in the ranges asked about). What a backfill does not write
    again unless asked (module docstring): a row a foreign commit deleted and an offsetlake
    backfill brought back (``--restore-deleted``) is present, and stays."""
    gone: set[Identity] = set()
    for change in foreign_changes(table, pipeline):
        gone |= set(change.removed)
        gone -= set(change.added)
    return gone - set(present)


def summaries(table: DeltaTable | None, pipeline: str) -> list[dict[str, Any]]:
    """Every foreign commit's ``ForeignChange.summary`` (what ``status`` shows); a commit whose
    files are gone says so instead of row counts."""
    out: list[dict[str, Any]] = []
    for commit in foreign_commits(table, pipeline) if table is not None else []:
        try:
            out.append(_change(storage.table_place(table), pipeline, commit).summary())  # type: ignore[arg-type]
        except ForeignCommitError:
            out.append({"version": commit.version, "operation": commit.operation, "engine": commit.engine, "files_gone": True})
    return out


def report(table: DeltaTable | None, pipeline: str, since_version: int = -1) -> list[ForeignChange]:
    """``foreign_changes``, each logged as a warning (what every run and ``status`` say); a
    commit whose files are gone is reported by version and engine alone."""
    changes = []
    for commit in foreign_commits(table, pipeline) if table is not None else []:
        if commit.version <= since_version:
            continue
        try:
            change = _change(storage.table_place(table), pipeline, commit)  # type: ignore[arg-type]
        except ForeignCommitError as err:
            log_line(log, "foreign_commit", str(err), level=logging.WARNING, pipeline=pipeline, version=commit.version)
            continue
        changes.append(change)
        log_line(
            log,
            "foreign_commit",
            "a commit offsetlake did not make changed the sink",
            level=logging.WARNING,
            pipeline=pipeline,
            **change.summary(),
        )
    return changes


def identities(rows: pa.Table) -> Counter[Identity]:
    """The row identities of ``rows`` (coordinate columns; the row index and epoch where present)."""
    n = rows.num_rows
    index = rows.column(ROW_INDEX).to_pylist() if ROW_INDEX in rows.column_names else [-1] * n
    epoch = rows.column(TOPIC_EPOCH).to_pylist() if TOPIC_EPOCH in rows.column_names else [0] * n
    return Counter(
        (t, p, o, -1 if i is None else i, e or 0)
        for t, p, o, i, e in zip(
            rows.column(TOPIC).to_pylist(), rows.column(PARTITION).to_pylist(), rows.column(OFFSET).to_pylist(), index, epoch, strict=True
        )
    )


def read_change(root: storage.Location, pipeline: str, commit: ForeignCommit) -> ForeignChange:
    """What ``commit`` changed, read from its files under the table folder ``root``."""
    return _change(root, pipeline, commit)


def _change(root: storage.Location, pipeline: str, commit: ForeignCommit) -> ForeignChange:
    return ForeignChange(
        commit, _identities_in(root, pipeline, commit, commit.removed), _identities_in(root, pipeline, commit, commit.added)
    )


def _identities_in(root: storage.Location, pipeline: str, commit: ForeignCommit, paths: tuple[str, ...]) -> Counter[Identity]:
    found: Counter[Identity] = Counter()
    for path in paths:
        place = storage.data_file(root, path)
        fs, where = storage.filesystem(place)
        try:
            with fs.open_input_file(where) as handle:
                names = pq.read_schema(handle).names
                handle.seek(0)
                rows = pq.read_table(handle, columns=[c for c in IDENTITY_COLUMNS if c in names])
        except FileNotFoundError:
            raise ForeignCommitError(
                f"the sink's {commit.describe()} was not made by offsetlake, and the file {path} it names is gone "
                "(vacuumed): which rows it changed cannot be known any more",
                pipeline=pipeline,
            ) from None
        found += identities(rows)
    return found
