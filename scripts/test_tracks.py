"""``make test``'s main tier in two pytest processes side by side, one per track.

    .venv/bin/python scripts/test_tracks.py [pytest options...]

The suite is waits as much as work: Airflow's scheduler and task processes, broker restarts,
Spark jobs of a few hundred rows. Run one test at a time, the two cores were busy about two
thirds of the time (sampled from /proc/stat), and the tier took 56 minutes. The second track
(``tests/conftest.py`` marks it ``second_track``) holds the tests that drive Airflow and those
that start brokers or Spark clusters of their own; the first track everything else. Each track
is a pytest session with its own broker, Spark session, warm Spark server and temp folders; no
test of one touches a service or a file of the other (the tests that name tables in the
project's Derby metastore, which one process may open at a time, are all on the first track).

The first track prints as it runs; the second writes ``test-second-track.log`` and is printed
after it. The exit status is the first track's, or the second's if only that one failed. If this
process is stopped, it stops the second track's process group, which it started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOG = ROOT / "test-second-track.log"
MAIN_TIER = "not fast and not stack"


def _pytest(marker: str, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", "tests", "-m", f"{MAIN_TIER} and {marker}", "-p", "no:cacheprovider", *extra]


def main(extra: list[str]) -> int:
    started = time.monotonic()
    with LOG.open("w") as log:
        second = subprocess.Popen(_pytest("second_track", extra), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        first_code = subprocess.call(_pytest("not second_track", extra), cwd=ROOT)
        first_s = time.monotonic() - started
        second_code = second.wait()
    except BaseException:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGTERM)  # its own session: the group is the process we started and its children
        raise
    total_s = time.monotonic() - started
    print(f"\n======== the second track (tests/conftest.py SECOND_TRACK), from {LOG.name} ========", flush=True)
    sys.stdout.write(LOG.read_text(errors="replace"))
    print(
        f"\nmain tier: first track {first_s / 60:.1f} min (exit {first_code}), both tracks {total_s / 60:.1f} min "
        f"(second track exit {second_code})",
        flush=True,
    )
    return first_code or second_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
