"""The CI version of the randomized fault campaign (tests/fault_campaign.py): a fixed seed,
every kind of step at least once, invariants checked by an independent model after each step."""

from __future__ import annotations

import os

from fault_campaign import Campaign

SEED = int(os.environ.get("OFFSETLAKE_CAMPAIGN_SEED", "20261122"))
STEPS = int(os.environ.get("OFFSETLAKE_CAMPAIGN_STEPS", "20"))


def test_fixed_seed_campaign_keeps_every_record_exactly_once(broker, spark, tmp_path):
    restart = broker.local.restart if broker.local is not None else None
    campaign = Campaign(SEED, STEPS, broker.bootstrap, tmp_path, restart, log=print)
    figures = campaign.run()
    assert figures["duplicates_found"] == 0 and figures["records_lost"] == 0
    assert figures["steps"] == STEPS and figures["checks"] == STEPS + 1
    kinds = set(figures["steps_by_kind"])
    expected = {"produce", "produce_txn_committed", "produce_txn_aborted", "open_txn", "finish_open_txn", "run",
                "crash_at_failpoint", "kill_cli_run", "backfill", "add_partition", "delete_records"}
    assert expected <= kinds, f"every kind of step must run at least once: missing {expected - kinds}"
    assert figures["records_in_sink"] > 0 and figures["batches_committed"] > 0
    assert figures["failpoint_crashes"] > 0 and figures["backfills"] > 0, "the faults must have happened, not been no-ops"
