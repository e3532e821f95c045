"""The writing half of a sink: what ``offsetlake.runs``' one batch lifecycle asks a sink
(docs/design.md, "The sink seam").

``runs.execute_batch`` owns the order, for every sink: open the sink for the plan → already
committed? (reconcile, skip) → applies? (else superseded, recorded through ``record_outcome``)
→ process and validate → ``write`` (prepare, ``before_commit``, commit) → ``after_commit`` →
record the commit in the ledger. A sink implements each step and keeps its own ordering rule
where it opens: a Delta sink reads one snapshot of its table; a Kafka sink fences every earlier
runner first and only then reads its state.

A sink never imports the ledger (it is the sink's projection, invariant 4): what it needs of it
comes in as a ``Projection``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Protocol

from offsetlake.config import PipelineConfig
from offsetlake.config.sink_kinds import Role
from offsetlake.entry import LedgerEntry
from offsetlake.history import SinkCommit, covering_batch
from offsetlake.plan import BatchKind, BatchPlan


class Projection(Protocol):
    """What a sink may ask of the ledger: the batches it recorded committed, and to take the
    sink's commits it lacks (``offsetlake.ledger.Ledger``)."""

    def committed_batches(self, kinds: Iterable[BatchKind]) -> set[str]: ...

    def reconcile(
        self, commits: list[SinkCommit], committed_end: Callable[[str, int], int | None], abandon_after_s: float = ...
    ) -> int: ...

    def compact_if_fragmented(self) -> Any: ...


class SinkWriter(ABC):
    """One batch's way into a sink; opened by ``open``, closed by ``close`` (or ``with``)."""

    # what a batch does to this sink, for "nothing <done> by this batch"
    done: ClassVar[str] = "written"

    def __init__(self, config: PipelineConfig, ledger: Projection) -> None:
        self.config, self.ledger = config, ledger

    def __enter__(self) -> SinkWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:  # noqa: B027 - a sink that holds nothing open has nothing to release
        """Release what ``open`` holds."""

    @classmethod
    @abstractmethod
    def reconcile_pipeline(cls, config: PipelineConfig, ledger: Projection) -> None:
        """Invariant 4 before a run reads the projections: the ledger (and a Delta sink's
        dead-letter table) brought in line with the sink's history; refuses a sink that cannot
        be written safely (another pipeline's table, a Kafka sink whose records disagree)."""

    @abstractmethod
    def open(self, plan: BatchPlan) -> BatchPlan:
        """Read the sink's state for ``plan`` by this sink's ordering rule; returns the plan as it
        executes (a Delta sink stamps each topic's current epoch)."""

    @abstractmethod
    def commits(self) -> list[SinkCommit]:
        """The sink's history as ``open`` read it."""

    def committed(self, batch_id: str) -> SinkCommit | None:
        """The commit of ``batch_id`` if the sink holds it (a rerun or clear after the commit)."""
        return next((c for c in self.commits() if c.batch_id == batch_id), None)

    @abstractmethod
    def applies(self, plan: BatchPlan) -> bool:
        """Invariant 3: True if the plan applies, False if the sink holds every range of it;
        StalePlanError if a committed end moved part-way (or the sink was replaced)."""

    def winner(self, plan: BatchPlan) -> str:
        """The batch that committed ``plan``'s first range (a plan found held by another)."""
        first = next((r for r in plan.ranges if r.size > 0), plan.ranges[0])
        return covering_batch(self.commits(), first.topic, first.partition, first.start) or "unknown"

    @abstractmethod
    def reconcile(self) -> int:
        """Invariant 4 for a batch found committed: the ledger takes the commits it lacks."""

    def writes_in_read(self, plan: BatchPlan) -> bool:
        """Whether the read tasks may write the batch's files themselves (the direct path)."""
        return False

    def observes_gate(self, plan: BatchPlan) -> bool:
        """Whether ``write`` writes the batch's rows in one job and settles ``processed.gate``
        before its commit (``process_ranges``' ``observe_gate``)."""
        return False

    @abstractmethod
    def write(
        self, plan: BatchPlan, processed: Any, spark: Any, started: float, before_commit: Callable[[], None], restore_deleted: bool
    ) -> SinkCommit | None:
        """Prepare the batch's rows and dead letters, build its ledger entry, run
        ``before_commit`` (raising there commits nothing) and commit; None when the sink, read
        again, already holds the plan (then nothing was committed)."""

    @abstractmethod
    def advance(self, plan: BatchPlan, entry: LedgerEntry, before_commit: Callable[[], None]) -> int:
        """A ``gap`` batch: move the committed ends over lost offsets with no rows; the version."""

    def after_commit(self, plan: BatchPlan, processed: Any) -> None:  # noqa: B027 - most sinks have nothing to do here
        """After the sink commit, before the ledger row (a Delta sink applies its dead letters)."""


WRITER: Role[type[SinkWriter]] = Role("writer")  # what each kind of sink provides (``config.sink_kinds.SinkKind``)
