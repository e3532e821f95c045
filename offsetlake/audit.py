"""An independent check that the sink is exactly once and agrees with its ledger.

Reads only Delta (sink, dead letters, ledger) through delta-rs and pyarrow, never Spark, so it
also works as a quick check on a laptop. ``offsetlake audit`` exits 0 only if every check holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from offsetlake.config import PipelineConfig
from offsetlake.coordinates import RECORD_KEY
from offsetlake.history import rewound_batches, sink_commits
from offsetlake.ledger import Ledger
from offsetlake.plan import OFFSET_MOVING_KINDS, BatchKind, BatchStatus
from offsetlake.sink import committed_end, open_table

_COORDS = list(RECORD_KEY)
_SHOW = 10


@dataclass
class AuditReport:
    pipeline: str
    rows: int = 0
    dead_letters: int = 0
    problems: list[str] = field(default_factory=list)
    committed: dict[tuple[str, int], int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def text(self) -> str:
        head = (
            f"audit of pipeline {self.pipeline}: {self.rows} sink rows, {self.dead_letters} dead letters, "
            f"{len(self.committed)} partitions committed"
        )
        ends = ", ".join(f"{t}[{p}]→{e}" for (t, p), e in sorted(self.committed.items()))
        if self.ok:
            return (
                f"{head}\nOK: no duplicates, ranges contiguous, every row inside a committed range, "
                f"txn versions match the ledger\ncommitted ends: {ends}"
            )
        return f"{head}\nFAILED ({len(self.problems)} problems):\n" + "\n".join(f"  - {p}" for p in self.problems)


def _coordinates(path: str) -> pa.Table:
    table = open_table(path)
    if table is None:
        return pa.table({"_kafka_topic": pa.array([], pa.string()), "_kafka_partition": pa.array([], pa.int32()),
                         "_kafka_offset": pa.array([], pa.int64())})
    return table.to_pyarrow_dataset().to_table(columns=_COORDS)


def _duplicates(coords: pa.Table) -> pa.Table:
    counted = coords.group_by(_COORDS).aggregate([([], "count_all")])
    return counted.filter(pc.field("count_all") > 1)


def audit_pipeline(config: PipelineConfig) -> AuditReport:
    report = AuditReport(config.name)
    sink = open_table(config.sink_path)
    commits = sink_commits(sink, config.name)
    rows = _coordinates(config.sink_path)
    dead = _coordinates(config.dead_letter_path)
    report.rows, report.dead_letters = rows.num_rows, dead.num_rows

    # 1. no two sink rows (or a sink row and a dead letter) share coordinates
    for label, table in (("sink", rows), ("sink + dead letters", pa.concat_tables([rows, dead.cast(rows.schema)]))):
        dupes = _duplicates(table)
        for d in dupes.slice(0, _SHOW).to_pylist():
            report.problems.append(
                f"duplicate in {label}: {d['_kafka_topic']}[{d['_kafka_partition']}] offset {d['_kafka_offset']} "
                f"appears {d['count_all']} times"
            )
        if dupes.num_rows > _SHOW:
            report.problems.append(f"... {dupes.num_rows - _SHOW} more duplicated coordinates in {label}")
        if dupes.num_rows:
            break

    # 2. committed ranges per partition are contiguous with no overlap (ingest and gap batches;
    # batches a later rewind commit undid no longer count: their offsets are read again)
    rewound = rewound_batches(commits)
    by_tp: dict[tuple[str, int], list[tuple[int, int, str, str]]] = {}
    for c in commits:
        if c.kind not in OFFSET_MOVING_KINDS or c.batch_id in rewound:
            continue
        for r in c.entry["ranges"]:
            by_tp.setdefault((r["topic"], r["partition"]), []).append((r["start"], r["end"], c.batch_id, c.kind))
    covered: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for tp, ranges in by_tp.items():
        ranges.sort()
        previous = None
        for start, end, batch, kind in ranges:
            if previous is not None and start != previous[1]:
                word = "overlap" if start < previous[1] else "gap"
                report.problems.append(
                    f"{word} in committed ranges of {tp[0]}[{tp[1]}]: batch {previous[2]} ends at {previous[1]}, "
                    f"batch {batch} starts at {start}"
                )
            if kind != BatchKind.GAP:
                covered.setdefault(tp, []).append((start, end))
            previous = (start, end, batch)

    # 3. every sink row and dead letter lies inside a committed (non-gap) range
    for label, table in (("sink row", rows), ("dead letter", dead)):
        for (topic, partition), group in _group_offsets(table).items():
            stray = _outside(group, covered.get((topic, partition), []))
            if stray:
                report.problems.append(
                    f"{len(stray)} {label}(s) of {topic}[{partition}] outside every committed range, "
                    f"e.g. offsets {', '.join(map(str, stray[:5]))}"
                )

    # 4. txn versions equal the ledger's last committed ends
    ledger_ends: dict[tuple[str, int], int] = {}
    for row in Ledger.of(config).batches():
        if BatchStatus(row["status"]).committed and row["kind"] in OFFSET_MOVING_KINDS:
            key = (row["topic"], row["partition"])
            ledger_ends[key] = max(ledger_ends.get(key, -1), row["end_offset"])
    for tp in sorted(set(by_tp) | set(ledger_ends)):
        txn = committed_end(sink, config, *tp)
        if txn is not None:
            report.committed[tp] = txn
        if txn != ledger_ends.get(tp):
            report.problems.append(
                f"{tp[0]}[{tp[1]}]: sink txn version is {txn} but the ledger's last committed end is "
                f"{ledger_ends.get(tp)} (run `offsetlake ledger rebuild {config.name}` if the ledger was lost)"
            )
    return report


def _outside(offsets: np.ndarray, spans: list[tuple[int, int]]) -> list[int]:
    if not spans:
        return offsets.tolist()
    spans = sorted(spans)
    starts = np.array([s for s, _ in spans])
    ends = np.array([e for _, e in spans])
    index = np.searchsorted(starts, offsets, side="right") - 1
    inside = (index >= 0) & (offsets < ends[np.clip(index, 0, None)])
    return offsets[~inside].tolist()


def _group_offsets(table: pa.Table) -> dict[tuple[str, int], np.ndarray]:
    if table.num_rows == 0:
        return {}
    out: dict[tuple[str, int], np.ndarray] = {}
    keys = table.group_by(["_kafka_topic", "_kafka_partition"]).aggregate([]).to_pylist()
    for key in keys:
        mask = pc.and_(
            pc.equal(table["_kafka_topic"], key["_kafka_topic"]), pc.equal(table["_kafka_partition"], key["_kafka_partition"])
        )
        out[(key["_kafka_topic"], key["_kafka_partition"])] = table.filter(mask)["_kafka_offset"].to_numpy()
    return out
