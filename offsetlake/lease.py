"""Stream ownership: at most one live ``offsetlake stream`` per pipeline.

The lease is a small Delta table next to the ledger, ``<lake>/_stream_leases/<pipeline>``. Every
change of the lease (acquire, heartbeat, release) is ONE empty commit whose
``commitInfo.userMetadata`` holds the lease as JSON and whose ``txn`` action (appId ``lease``)
holds the lease's generation. A change is made on the very ``DeltaTable`` object whose
generation was read, so of two processes changing the same generation, delta-rs rejects the
second (the same compare-and-set the sink relies on, ARCHITECTURE.md invariant 10).

The lease is advisory for batch runs: a scheduled ingest skips while a live lease exists, and a
stream whose lease was lost stops before its next commit. What keeps data exactly once is still
the sink's commit check: a stream that paused past its expiry and wakes up after a scheduled
run moved the committed ends finds its plan stale and commits nothing.

A lease follows the pipeline, not a sink table: it holds no sink version and names no table (its
generation counts lease changes only), so a new or re-created sink table (invariant 16) has
nothing to inherit from it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from typing import NoReturn

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, PostCommitHookProperties, Transaction
from deltalake.exceptions import CommitFailedError

from offsetlake import storage
from offsetlake.config import PipelineConfig
from offsetlake.errors import LeaseHeldError, LeaseLostError, OffsetlakeError, StreamOwnsPipelineError
from offsetlake.history import latest_commit_info
from offsetlake.log_lines import log_line

log = logging.getLogger("offsetlake.lease")

HELD, RELEASED = "held", "released"
_APP_ID = "lease"
# the lease has no history worth keeping: old commit files go after an hour, at checkpoints
_TABLE_CONFIG = {"delta.logRetentionDuration": "interval 1 hours", "delta.checkpointInterval": "50"}
DEFAULT_TTL_SECONDS = 30.0


@dataclass(frozen=True)
class LeaseState:
    pipeline: str
    owner: str
    label: str
    state: str  # held | released
    generation: int
    acquired_at: str
    heartbeat_at: str
    expires_at: str
    ttl_seconds: float

    @property
    def expires(self) -> datetime:
        return datetime.fromisoformat(self.expires_at)

    def live(self, now: datetime | None = None) -> bool:
        return self.state == HELD and (now or datetime.now(UTC)) < self.expires

    def describe(self) -> str:
        return f"stream {self.owner} ({self.label}), last heartbeat {self.heartbeat_at}, lease expires {self.expires_at}"

    def as_dict(self) -> dict:
        return {**asdict(self), "live": self.live()}


def _read(path: storage.Location) -> tuple[DeltaTable | None, LeaseState | None]:
    """The lease table at one version and the lease state that version holds.

    The state comes from the newest commit's userMetadata, which may be newer than the loaded
    version if a commit raced the read: the generation (txn version) tells, and we read again.
    """
    for _ in range(20):
        table = storage.open_table(path)
        if table is None:
            return None, None
        generation = table.transaction_version(_APP_ID)
        if generation is None:
            return table, None
        info = latest_commit_info(table)
        raw = info.get("userMetadata") if info else None
        state = LeaseState(**json.loads(raw)) if raw else None
        if state is not None and state.generation == generation:
            return table, state
        time.sleep(0.05)
    raise OffsetlakeError(f"the stream lease at {path} changed 20 times while being read; try again")


def current_lease(config: PipelineConfig) -> LeaseState | None:
    """The pipeline's lease as last written (live or not), None if no stream ever ran."""
    return _read(config.layout.stream_leases)[1]


def live_lease(config: PipelineConfig) -> LeaseState | None:
    lease = current_lease(config)
    return lease if lease is not None and lease.live() else None


def refuse_if_stream_owns(config: PipelineConfig) -> None:
    """For batch runs (scheduled ingest, ``offsetlake run``): raise StreamOwnsPipelineError while
    a live stream owns the pipeline. Backfills and rewinds do not ask."""
    lease = live_lease(config)
    if lease is not None:
        raise StreamOwnsPipelineError(
            f"it is owned by a live {lease.describe()}; this batch run skips and ingests "
            f"nothing. The stream commits these offsets; batch runs take over once it stops or its lease expires",
            pipeline=config.name,
        )


def default_owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class StreamLease:
    """The lease as one stream holds it: acquire, heartbeat in a background thread, release."""

    def __init__(self, config: PipelineConfig, owner: str, label: str, ttl_seconds: float = DEFAULT_TTL_SECONDS):
        if ttl_seconds < 3:
            raise OffsetlakeError(f"a stream lease must last at least 3 s, not {ttl_seconds}", pipeline=config.name)
        self.config, self.owner, self.label, self.ttl = config, owner, label, ttl_seconds
        self.path = config.layout.stream_leases
        self.state: LeaseState | None = None
        self.lost: str | None = None  # why the lease was lost, once it is
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # ---- acquiring -----------------------------------------------------------------------
    def acquire(self, wait_seconds: float | None = None) -> LeaseState:
        """Take the lease, waiting up to ``wait_seconds`` (default: one TTL plus 5 s) for a
        holder to release it or let it expire. A holder that keeps it alive for the whole wait
        means another stream is running: LeaseHeldError names it."""
        wait = self.ttl + 5 if wait_seconds is None else wait_seconds
        deadline = time.monotonic() + wait
        announced = None
        while True:
            table, current = _read(self.path)
            if current is None or not current.live():
                if table is None:
                    table = self._create()
                if self._write(table, current, HELD, acquired=True):
                    if current is not None and current.state == HELD:
                        log_line(
                            log,
                            "lease",
                            f"took over the expired lease of {current.describe()}",
                            level=logging.WARNING,
                            pipeline=self.config.name,
                            owner=self.owner,
                        )
                    assert self.state is not None  # _write set it
                    log_line(
                        log,
                        "lease",
                        "acquired",
                        pipeline=self.config.name,
                        owner=self.owner,
                        generation=self.state.generation,
                        ttl_s=self.ttl,
                    )
                    return self.state
                continue  # another process changed the lease between our read and write
            if time.monotonic() >= deadline:
                raise LeaseHeldError(
                    f"it is owned by a live {current.describe()}; waited {wait:.0f} s "
                    f"for it to stop or expire. Stop that stream first (at most one stream per pipeline)",
                    pipeline=self.config.name,
                )
            if announced != current.owner:
                log_line(
                    log,
                    "lease",
                    f"waiting up to {deadline - time.monotonic():.0f} s for {current.describe()} to release or expire",
                    level=logging.WARNING,
                    pipeline=self.config.name,
                )
                announced = current.owner
            time.sleep(min(1.0, max(0.1, deadline - time.monotonic())))

    def _create(self) -> DeltaTable:
        try:
            storage.create_table(
                self.path,
                pa.schema([("unused", pa.int8())]),
                mode="ignore",
                description=f"offsetlake stream lease of pipeline {self.config.name}",
                configuration=_TABLE_CONFIG,
            )
        except Exception:
            if storage.open_table(self.path) is None:
                raise
        return storage.table(self.path)

    def _write(self, table: DeltaTable, previous: LeaseState | None, state: str, acquired: bool = False) -> bool:
        """Compare-and-set the lease from ``previous`` (read from ``table``); False if we lost."""
        now = datetime.now(UTC)
        generation = (previous.generation if previous else 0) + 1
        new = LeaseState(
            pipeline=self.config.name,
            owner=self.owner,
            label=self.label,
            state=state,
            generation=generation,
            acquired_at=now.isoformat() if acquired or self.state is None else self.state.acquired_at,
            heartbeat_at=now.isoformat(),
            expires_at=(now + timedelta(seconds=self.ttl)).isoformat() if state == HELD else now.isoformat(),
            ttl_seconds=self.ttl,
        )
        try:
            table.create_write_transaction(
                [],
                mode="append",
                schema=table.schema(),
                commit_properties=CommitProperties(
                    custom_metadata={"userMetadata": json.dumps(asdict(new), separators=(",", ":"))},
                    app_transactions=[Transaction(_APP_ID, generation)],
                    max_commit_retries=3,
                ),
                post_commithook_properties=PostCommitHookProperties(create_checkpoint=True, cleanup_expired_logs=True),
            )
        except CommitFailedError:
            landed = _read(self.path)[1]  # on object storage the store may have applied it and lost the answer
            if landed is None or (landed.owner, landed.generation, landed.state) != (self.owner, generation, state):
                return False
        self.state = new
        return True

    # ---- holding -------------------------------------------------------------------------
    def heartbeat(self) -> None:
        """Extend the lease; records why in ``lost`` (and raises LeaseLostError) if it is gone."""
        with self._lock:
            if self.lost:
                raise LeaseLostError(self.lost, pipeline=self.config.name)
            table, current = _read(self.path)
            if table is None or current is None or current.owner != self.owner or current.state != HELD:
                self._lose(f"now {current.describe() if current else 'missing'}")
            if not self._write(table, current, HELD):
                self._lose("another process changed it while this stream renewed it")

    def _lose(self, why: str) -> NoReturn:
        self.lost = f"stream {self.owner} lost its lease ({why}); it stops without committing again"
        log_line(log, "lease", self.lost, level=logging.ERROR, pipeline=self.config.name)
        raise LeaseLostError(self.lost, pipeline=self.config.name)

    def check(self) -> None:
        """Before each commit: raise LeaseLostError unless the lease is ours and unexpired."""
        if self.lost:
            raise LeaseLostError(self.lost, pipeline=self.config.name)
        if self.state is None or datetime.now(UTC) >= self.state.expires:
            self._lose(f"its last heartbeat at {self.state.heartbeat_at if self.state else 'never'} has expired")

    def start_heartbeats(self) -> None:
        """Renew every third of the TTL in a background thread, so long batches keep the lease."""

        def beat() -> None:
            while not self._stop.wait(self.ttl / 3):
                try:
                    self.heartbeat()
                except LeaseLostError:
                    return
                except Exception as err:
                    log_line(log, "lease", "heartbeat failed, retrying", level=logging.WARNING, pipeline=self.config.name, reason=str(err))

        self._thread = threading.Thread(target=beat, name="offsetlake-lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Give the lease up (a clean stop), so a batch run can take over at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.ttl)
        with self._lock:
            if self.lost or self.state is None:
                return
            for _ in range(5):
                table, current = _read(self.path)
                if table is None or current is None or current.owner != self.owner:
                    return
                if self._write(table, current, RELEASED):
                    log_line(log, "lease", "released", pipeline=self.config.name, owner=self.owner)
                    return
