"""Named crash points for tests: ``OFFSETLAKE_FAILPOINT=<name>`` kills the process there.

``OFFSETLAKE_FAILPOINT_FILE=<path>`` arms a failpoint once, across processes: when the file
names the step, it is deleted and the process dies. Airflow tests use it to fail only the
first try of a task while the scheduler's environment stays the same.

The kill is SIGKILL to ourselves, so no ``finally`` block, atexit hook or Spark shutdown runs:
what the next run sees is exactly what a power cut would leave.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

NAMES = ("after_plan", "after_read", "after_files_written", "after_commit", "after_ledger")


def failpoint(name: str) -> None:
    if name not in NAMES:
        raise ValueError(f"unknown failpoint {name}")
    if os.environ.get("OFFSETLAKE_FAILPOINT") == name or _armed_once(name):
        logging.getLogger("offsetlake.failpoint").error("failpoint %s reached: killing pid %d", name, os.getpid())
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)


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
