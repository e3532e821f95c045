"""Named crash points: ``OFFSETLAKE_FAILPOINT=<name>`` kills the process there.

``OFFSETLAKE_FAILPOINT_FILE=<path>`` arms a failpoint once, across processes: when the file
names the step, it is deleted and the process dies. Airflow tests use it to fail only the
first try of a task while the scheduler's environment stays the same.

The kill is SIGKILL to ourselves, so no ``finally`` block, atexit hook or Spark shutdown runs:
what the next run sees is exactly what a power cut would leave. ``OFFSETLAKE_FAILPOINT_SIGNAL=SIGINT``
(or ``SIGTERM``) sends that signal instead and carries on: the process is asked to stop at that
step, as an operator's Ctrl-C or a supervisor's SIGTERM would, at a moment a test can name.

In-process tests attach a callback to a failpoint with ``on(name, callback)``: it runs when the
batch reaches that step (to stop a stream, run a compaction, or raise ``SimulatedCrash`` — a
BaseException no outcome handler catches, so the ledger and sink stay as a crash leaves them).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

NAMES = ("after_plan", "after_read", "after_files_written", "after_commit", "after_ledger")
# a Kafka sink's transaction (offsetlake.kafka_transactions): its records produced, flushed, committed
KAFKA_SINK_NAMES = ("after_produce", "after_flush", "after_kafka_commit")
# a keyed sink's batch between its two commits: its state committed (unpinned), the sink's files written
STATE_NAMES = ("after_state_commit",)
KNOWN = NAMES + KAFKA_SINK_NAMES + STATE_NAMES
_HOOKS: dict[str, list[Callable[[str], None]]] = {}


class SimulatedCrash(BaseException):
    """Raised by an in-process failpoint hook to stop a batch as a crash would."""


def failpoint(name: str) -> None:
    if name not in KNOWN:
        raise ValueError(f"unknown failpoint {name}")
    for callback in list(_HOOKS.get(name, ())):
        callback(name)
    if os.environ.get("OFFSETLAKE_FAILPOINT") == name or _armed_once(name):
        sig = signal.Signals[os.environ.get("OFFSETLAKE_FAILPOINT_SIGNAL") or "SIGKILL"]
        logging.getLogger("offsetlake.failpoint").error("failpoint %s reached: sending %s to pid %d", name, sig.name, os.getpid())
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), sig)


@contextmanager
def on(name: str, callback: Callable[[str], None]) -> Iterator[None]:
    """Run ``callback(name)`` each time this process reaches failpoint ``name``, inside the block."""
    if name not in KNOWN:
        raise ValueError(f"unknown failpoint {name}")
    _HOOKS.setdefault(name, []).append(callback)
    try:
        yield
    finally:
        _HOOKS[name].remove(callback)


def _armed_once(name: str) -> bool:
    path = os.environ.get("OFFSETLAKE_FAILPOINT_FILE")
    if not path:
        return False
    try:
        with open(path) as handle:
            armed = handle.read().strip()
    except FileNotFoundError:
        return False
    if armed != name:
        return False
    try:
        os.remove(path)
    except FileNotFoundError:  # another process fired it first
        return False
    return True
