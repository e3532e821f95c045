"""Named crash points for tests: ``OFFSETLAKE_FAILPOINT=<name>`` kills the process there.

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
    if os.environ.get("OFFSETLAKE_FAILPOINT") == name:
        logging.getLogger("offsetlake.failpoint").error("failpoint %s reached: killing pid %d", name, os.getpid())
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
