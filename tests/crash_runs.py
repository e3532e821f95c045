"""A CLI run killed at each failpoint in turn, and what the ledger must say afterwards: shared by
the crash tests of an in-process session and of runs attached to `offsetlake spark-server`."""

from __future__ import annotations

import signal
import subprocess

from kafka_truth import ledger_rows

from offsetlake import storage
from offsetlake.embedded.sample_data import produce_orders
from offsetlake.failpoints import NAMES


def crash_at_every_failpoint(pipeline, config, records_per_step: int, *run_args: str) -> list[subprocess.CompletedProcess]:
    """Before each failpoint, produce ``records_per_step`` orders (some malformed), then kill an
    `offsetlake run` there: each crashed run first recovers from the previous crash, then dies at
    the next step. Returns the crashed runs."""
    crashed_runs = []
    next_id = 0
    for failpoint in NAMES:
        next_id = produce_orders(pipeline.bootstrap, pipeline.topic, records_per_step, first_id=next_id, malformed_every=250)
        planned_before = (
            {r["batch_id"] for r in ledger_rows(config) if r["status"] == "planned"} if storage.is_table(config.layout.ledger) else set()
        )
        crashed = pipeline.cli("run", *run_args, env={"OFFSETLAKE_FAILPOINT": failpoint})
        assert crashed.returncode == -signal.SIGKILL, (failpoint, crashed.stderr[-2000:])
        assert f"failpoint {failpoint} reached" in crashed.stderr
        planned_now = {r["batch_id"] for r in ledger_rows(config) if r["status"] == "planned"}
        assert planned_now - planned_before, f"the run killed at {failpoint} planned no batch"
        crashed_runs.append(crashed)
    return crashed_runs


def assert_every_plan_has_an_outcome(config) -> list[dict]:
    """No planned ledger row without a later outcome; returns the ledger rows."""
    rows = ledger_rows(config)
    outcomes = {(r["batch_id"], r["partition"]) for r in rows if r["status"] != "planned"}
    dangling = {(r["batch_id"], r["partition"]) for r in rows if r["status"] == "planned"} - outcomes
    assert not dangling, f"planned ledger rows without an outcome: {sorted(dangling)}"
    return rows


def rewind_to_a_random_live_batch(config, rng) -> None:
    """Rewind to one of the pipeline's live batches, drawn by ``rng`` (none: nothing); a rewind
    the pipeline refuses (a batch before a topic's new epoch) changes nothing."""
    from offsetlake.errors import RewindError
    from offsetlake.history import rewound_batches, sink_commits
    from offsetlake.rewind import rewind_pipeline

    commits = sink_commits(storage.open_table(config.layout.sink), config.name)
    undone = rewound_batches(commits)
    live = [c.batch_id for c in commits if c.kind != "rewind" and c.batch_id not in undone]
    if live:
        try:
            rewind_pipeline(config, rng.choice(live), reason="property")
        except RewindError:
            pass


def crash_in_a_run(rng, run, keyed: bool = False) -> None:
    """``run()`` (an in-process ingest) with a simulated crash at a failpoint drawn by ``rng``
    (``keyed``: a keyed sink's, between its state commit and its sink commit, too)."""
    import pytest

    from offsetlake import failpoints

    def crash(_name: str) -> None:
        raise failpoints.SimulatedCrash()

    names = failpoints.NAMES + (failpoints.STATE_NAMES if keyed else ())
    with failpoints.on(rng.choice(names), crash), pytest.raises(failpoints.SimulatedCrash):
        run()
