"""What an audit reports (``AuditReport``) and the pieces every audit reads the sink with."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from offsetlake.config import PipelineConfig
from offsetlake.config.sink_kinds import Role
from offsetlake.coordinates import OFFSET, PARTITION, RECORD_KEY, ROW_INDEX, TOPIC, TOPIC_EPOCH
from offsetlake.engines import CONTRIBUTION, WINDOW_START
from offsetlake.history import epoch_at
from offsetlake.keyed import HIDDEN
from offsetlake.schema_evolution import table_schema
from offsetlake.sink import open_table
from offsetlake.write_modes import Replay, write_mode

if TYPE_CHECKING:
    pass


_COORDS = list(RECORD_KEY)
EPOCH_OF = "_topic_epoch"  # the audit's own column: which epoch of its topic a row's record belongs to
_KEY = [*_COORDS, EPOCH_OF]
_SHOW = 10


@dataclass
class AuditReport:
    pipeline: str
    rows: int = 0  # rows readers see (an upsert sink's hidden state rows are not among them)
    dead_letters: int = 0
    hidden_rows: int = 0  # a keyed sink's state rows beside it (``offsetlake.state_table``): delete markers, contributions
    hidden_kind: str = "delete markers, superseded records"  # what the hidden rows are, for the text
    problems: list[str] = field(default_factory=list)
    committed: dict[tuple[str, int], int] = field(default_factory=dict)
    against_kafka: dict | None = None  # what the Kafka check read and found
    sink_topic: str | None = None  # a Kafka sink: what was read back (``audit_kafka_sink``)
    notes: list[str] = field(default_factory=list)  # found and said, but nothing is wrong (a group offset restored next run)
    batch_states: int = 0  # a merge engine's batch states compared with their contribution files (``audit.batch_states``)

    @property
    def ok(self) -> bool:
        return not self.problems

    def text(self) -> str:
        head = (
            f"audit of pipeline {self.pipeline}: {self.rows} sink rows, {self.dead_letters} dead letters, "
            f"{len(self.committed)} partitions committed"
        ) + (f"; {self.hidden_rows} hidden state rows ({self.hidden_kind})" if self.hidden_rows else "")
        if self.batch_states:
            head += f"; {self.batch_states} batch states compared with the fold of their contribution files"
        kafka = ""
        if self.against_kafka is not None:
            k = self.against_kafka
            kafka = (
                (
                    f"\nagainst Kafka: {k['records']} committed records read back and replayed by key: {k['keys']} keys "
                    f"with a row ({k['rows_checked']} rows compared with their key's newest record), {k['deleted_keys']} deleted; "
                    f"{k['past_retention']} committed offsets are past retention (not checked)"
                )
                if "keys" in k
                else (
                    f"\nagainst Kafka: {k['records']} committed records read back, {k['in_sink']} in the sink, "
                    f"{k['dead_letters']} dead letters, {k['in_gaps']} in recorded gaps, {k['filtered']} filtered by "
                    f"the transform, {k.get('deleted_by_others', 0)} deleted by commits offsetlake did not make; "
                    f"{k['past_retention']} committed offsets are past retention (not checked)"
                )
            )
            if "groups" in k:
                kafka += (
                    "; the merge engine's rows not compared with a replay (records past retention or of an earlier epoch)"
                    if k.get("groups_skipped")
                    else f"; {k['groups_checked']} of {k['groups']} groups compared with the record-by-record replay of their records"
                )
            if k.get("folded"):
                kafka += (
                    f"; {k['folded']} committed offsets lie below the engine's fold horizon (their records keep no contribution "
                    "of their own: checked through their groups' replay)"
                )
            if k.get("earlier_epochs"):
                kafka += (
                    f"; {k['earlier_epochs']} committed offsets belong to earlier epochs of a re-created topic "
                    "(their records are gone from Kafka: not checked)"
                )
        if self.ok and self.sink_topic is not None:
            ends = ", ".join(f"{t}[{p}]→{e}" for (t, p), e in sorted(self.committed.items()))
            return (
                f"audit of pipeline {self.pipeline}: {self.rows} records in {self.sink_topic}, {self.dead_letters} dead letters, "
                f"read back read_committed\nOK: the commit log's ranges follow each other, every record "
                f"belongs to a committed batch with the counts its entry gives, no source record in two batches, the ledger "
                f"holds every commit\ncommitted ends (commit log): {ends}{self._notes()}"
            )
        if self.ok:
            ends = ", ".join(f"{t}[{p}]→{e}" for (t, p), e in sorted(self.committed.items()))
            return (
                f"{head}\nOK: no duplicates, ranges contiguous, every row inside a committed range, "
                f"txn versions match the ledger{kafka}\ncommitted ends: {ends}{self._notes()}"
            )
        failed = f"{head}\nFAILED ({len(self.problems)} problems):\n" + "\n".join(f"  - {p}" for p in self.problems)
        return failed + kafka + self._notes()

    def _notes(self) -> str:
        return "".join(f"\nnote: {n}" for n in self.notes)


def _sink_keys(config: PipelineConfig) -> pa.Table:
    """Coordinates (and ``_kafka_row`` where the sink has it, -1 for rows without one) of every row,
    with the epoch of its topic its record belongs to (``EPOCH_OF``): the row's own
    ``coordinates.TOPIC_EPOCH`` (null or absent: epoch 0), which compaction and rewrites keep, so
    rows of a re-created topic's old records never stand for its new ones (invariant 16)."""
    table = write_mode(config).records_table(open_table(config.layout.sink))  # a keyed sink's: its state
    if table is None:
        return pa.table(
            {
                TOPIC: pa.array([], pa.string()),
                PARTITION: pa.array([], pa.int32()),
                OFFSET: pa.array([], pa.int64()),
                EPOCH_OF: pa.array([], pa.int32()),
                ROW_INDEX: pa.array([], pa.int32()),
            }
        )
    names = table_schema(table).names
    extra = [c for c in (ROW_INDEX, TOPIC_EPOCH) if c in names]
    engine = write_mode(config).replay is Replay.FOLD and HIDDEN in names
    if engine:  # an engine sink's records are its contribution rows (one per window)
        extra += [c for c in (WINDOW_START,) if c in names]
    # a folded row (``engine_merge.fold``) stands for many records and has no coordinates
    only = (pc.field(HIDDEN) == CONTRIBUTION) & pc.field(OFFSET).is_valid() if engine else None
    data = table.to_pyarrow_dataset().to_table(columns=[*_COORDS, *extra], filter=only)
    index = pc.fill_null(data[ROW_INDEX], -1) if ROW_INDEX in names else pa.array(np.full(data.num_rows, -1), pa.int32())
    epochs = pc.fill_null(data[TOPIC_EPOCH], 0) if TOPIC_EPOCH in names else pa.array(np.zeros(data.num_rows, np.int32), pa.int32())
    keys = data.select(_COORDS).append_column(EPOCH_OF, epochs.cast(pa.int32())).append_column(ROW_INDEX, index.cast(pa.int32()))
    return keys.append_column(WINDOW_START, data[WINDOW_START]) if engine and WINDOW_START in names else keys


def _with_epochs(table: pa.Table, starts: dict[str, list[int]], commits: list) -> pa.Table:
    """Dead letters (with ``batch_id``) with the epoch column: the epoch of the commit of the batch
    that wrote each (``offsetlake.history.epoch_at``), without ``batch_id``."""
    epochs = np.zeros(table.num_rows, np.int32)
    if starts:
        version_of = {c.batch_id: c.version for c in commits}
        for i, (topic, batch) in enumerate(zip(table[TOPIC].to_pylist(), table["batch_id"].to_pylist(), strict=True)):
            if topic in starts:
                epochs[i] = epoch_at(starts[topic], version_of.get(batch, -1))
    return table.drop_columns(["batch_id"]).append_column(EPOCH_OF, pa.array(epochs, pa.int32()))


def _current_epoch_only(table: pa.Table, starts: dict[str, list[int]]) -> pa.Table:
    """The rows of ``table`` whose record belongs to its topic's current epoch, without the epoch column."""
    current = pa.array([len(starts.get(t, [])) for t in table[TOPIC].to_pylist()], pa.int32())
    return table.filter(pc.equal(table[EPOCH_OF], current)).drop_columns([EPOCH_OF])


def _duplicates(keys: pa.Table, columns: list[str]) -> pa.Table:
    counted = keys.group_by(columns).aggregate([([], "count_all")])
    return counted.filter(pc.field("count_all") > 1)


class SinkAudit:
    """The audit of one kind of sink (a part its kind provides, ``config.sink_kinds``)."""

    @classmethod
    def run(cls, config: PipelineConfig, against_kafka: bool) -> AuditReport:
        raise NotImplementedError


AUDIT: Role[type[SinkAudit]] = Role("audit")  # what each kind of sink provides (``config.sink_kinds.SinkKind``)
