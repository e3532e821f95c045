"""Planning: which half-open offset range of each partition the next batch covers.

The plan is fixed before anything is read (invariant 3) and is recorded in the ledger table
with status ``planned``. ``start`` is the sink's committed end for the partition (its Delta txn
version); ``end`` is at most the Last Stable Offset seen when planning.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from datetime import UTC, datetime

from offsetlake.kafka import PartitionOffsets


@dataclass(frozen=True, order=True)
class OffsetRange:
    """``[start, end)`` of one topic-partition."""

    topic: str
    partition: int
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start

    def __str__(self) -> str:
        return f"{self.topic}[{self.partition}] [{self.start}, {self.end})"


@dataclass(frozen=True)
class RunContext:
    """Who asked for a batch: a CLI run or an Airflow dag run / try."""

    run_id: str
    dag_id: str | None = None
    try_number: int | None = None


@dataclass(frozen=True)
class BatchPlan:
    pipeline: str
    batch_id: str
    kind: str  # ingest | stream | backfill | gap | rewind
    ranges: tuple[OffsetRange, ...]
    run: RunContext
    planned_at: datetime = field(default_factory=lambda: datetime.now(UTC))

    @property
    def is_empty(self) -> bool:
        return all(r.size == 0 for r in self.ranges)

    @property
    def offsets(self) -> int:
        return sum(r.size for r in self.ranges)

    def describe(self) -> str:
        return ", ".join(str(r) for r in self.ranges if r.size) or "nothing"


def new_batch_id(pipeline: str) -> str:
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    return f"{pipeline}-{stamp}-{secrets.token_hex(3)}"


def share_fairly(pending: dict[int, int], budget: int) -> dict[int, int]:
    """Split ``budget`` offsets across partitions: equal shares, unused shares go to the rest.

    Water-filling, so a nearly caught-up partition never starves a lagging one and no partition
    gets more than it has pending. Deterministic: leftover units go to the lowest partition ids.
    """
    grant = {p: 0 for p in pending}
    open_parts = sorted(p for p, n in pending.items() if n > 0)
    remaining = budget
    while open_parts and remaining > 0:
        share, extra = divmod(remaining, len(open_parts))
        still_open = []
        for index, p in enumerate(open_parts):
            want = pending[p] - grant[p]
            give = min(want, share + (1 if index < extra else 0))
            grant[p] += give
            remaining -= give
            if grant[p] < pending[p]:
                still_open.append(p)
        if len(still_open) == len(open_parts) and share == 0 and extra == 0:
            break
        open_parts = still_open
    return grant


def plan_ranges(
    topic: str,
    committed_ends: dict[int, int | None],
    offsets: dict[int, PartitionOffsets],
    start_policy: str,
    max_records: int,
) -> list[OffsetRange]:
    """Ranges for the next ingest batch; empty ranges mean the partition is caught up.

    A partition with no committed end (new pipeline, or a partition added to the topic later)
    starts at its log start (``earliest``) or its LSO (``latest``). The caller checks the log
    start offset for loss (invariant 7) before calling.
    """
    starts: dict[int, int] = {}
    for p, info in offsets.items():
        committed = committed_ends.get(p)
        if committed is None:
            committed = info.log_start if start_policy == "earliest" else info.last_stable
        starts[p] = committed
    pending = {p: max(0, offsets[p].last_stable - starts[p]) for p in offsets}
    grant = share_fairly(pending, max_records)
    return [OffsetRange(topic, p, starts[p], starts[p] + grant[p]) for p in sorted(offsets)]
