"""What a batch loop decides (``LoopPolicy``): ``runs.run_pipeline`` and the stream run the same
``runs.BatchLoop`` and differ only in this value (docs/design.md, "One loop, two policies")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from offsetlake.plan import BatchKind, BatchResult

# ---- the batch loop ---------------------------------------------------------------------------
# A run re-plans a batch that lost its commit at most this many times, then fails (Airflow retries
# it): a run is bounded work and should end with an answer.
MAX_CONFLICT_REPLANS = 5


class CaughtUp(StrEnum):
    """What a loop does when planning finds nothing new."""

    STOP = "stop"  # a run: it is done
    WAIT = "wait"  # a stream: keep the session warm, sleep the trigger interval, plan again


class OffsetLimit(StrEnum):
    """How far a loop's plans may reach."""

    LSO_AT_START = "lso_at_start"  # a run: the LSO read when it starts, so it ends under steady produce
    NONE = "none"  # a stream: each plan up to the LSO of its own moment


@dataclass(frozen=True)
class Backoff:
    """How a transient error (``errors.is_transient``: the broker, a slow read, the registry) is
    waited out: the batch is recorded ``failed``, then the loop sleeps ``first_s``, doubling up to
    ``max_s``, and plans again from the committed ends; after ``max_retries`` in a row (no batch
    result or idle check in between) the error is raised."""

    max_retries: int = 8
    first_s: float = 1.0
    max_s: float = 30.0

    def pause(self, attempt: int) -> float | None:
        """Seconds to wait before retry ``attempt`` (1 for the first in a row); None once they are spent."""
        if attempt > self.max_retries:
            return None
        return min(self.max_s, self.first_s * 2.0 ** (attempt - 1))


def _nothing() -> None:
    pass


def _drop(result: BatchResult) -> None:
    pass


@dataclass(frozen=True)
class LoopPolicy:
    """Everything a ``BatchLoop`` decides, in one value: ``run_pipeline`` and the stream differ only here.

    ``max_conflict_replans``: how many superseded batches (invariants 3, 10) the loop re-plans in
    all before it raises the last one; None re-plans without a cap. A batch is superseded when
    another writer's commit landed first (delta-rs reported the conflict, or the committed ends
    moved past the plan's start) or the sink table was replaced; the next plan starts from the new
    ends, so the loop re-plans only as often as others make progress. A run caps it anyway (it is
    bounded work; Airflow retries it); the stream must not: it lives for days beside the other
    writers of its sink table, any of which may win one of its commits, and a cap would stop it
    for losing a few of those races.

    ``backoff`` None raises a transient error at once (a run: Airflow or the operator retries it);
    else it is waited out. ``before_commit`` runs right before each sink commit (raising there
    commits nothing). ``emit`` gets each batch's result (committed, or found already held).
    ``trigger_interval``: seconds from one batch's start to the next, and between checks when
    caught up under ``CaughtUp.WAIT``; 0 paces nothing.
    """

    kind: BatchKind = BatchKind.INGEST
    max_batches: int | None = None
    offset_limit: OffsetLimit = OffsetLimit.LSO_AT_START
    resume_unfinished: bool = True  # first re-execute the plan this run id left planned or failed (invariant 3)
    max_conflict_replans: int | None = MAX_CONFLICT_REPLANS
    backoff: Backoff | None = None
    when_caught_up: CaughtUp = CaughtUp.STOP
    trigger_interval: float = 0.0
    before_commit: Callable[[], None] = _nothing
    emit: Callable[[BatchResult], None] = _drop

    def may_replan(self, replans: int) -> bool:
        """Whether the loop re-plans after its ``replans``-th superseded batch."""
        return self.max_conflict_replans is None or replans <= self.max_conflict_replans
