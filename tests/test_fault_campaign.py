"""The fixed-seed version of the randomized fault campaign (tests/fault_campaign.py): a fixed seed,
every kind of step at least once, invariants checked after each step by an independent model
and by offsetlake's audit (against Kafka after every third step and at the end). Its CLI runs,
crashed at failpoints and killed, attach to the session's warm Spark server; `make torture`'s
runs start a JVM each. The Kafka sink's and the outbox's steps (issue 39) run in
the long campaign (tests/fault_campaign.py's main), which this run would not fit.

It restarts its broker, so it runs on a private Apache Kafka broker (restarting the session broker
would make it save and reload every other test's data), or on KAFKA_BOOTSTRAP_SERVERS without
the restart steps.

In ``make torture`` (about 4.7 min on CI's machine, which made it CI's costliest test): it runs
there before the long campaign (tests/fault_campaign.py's main); ``make test`` covers each kind of
step with its own test (failpoints, kills, backfills by offset and time, rewinds, maintenance,
topic re-creation, keyed and engine backfills, routes).
"""

from __future__ import annotations

import os

import pytest
from fault_campaign import Campaign

from offsetlake.embedded.local_broker import broker_for

SEED = int(os.environ.get("OFFSETLAKE_CAMPAIGN_SEED", "20261122"))
STEPS = int(os.environ.get("OFFSETLAKE_CAMPAIGN_STEPS", "24"))
# offsetlake's audit against Kafka after every third step and at the end (the Delta-only audit and
# the model's checks after every step): each reads every committed range of five pipelines back
# from the broker, a cost that grows with the batches committed
KAFKA_AUDIT_EVERY = int(os.environ.get("OFFSETLAKE_CAMPAIGN_KAFKA_AUDIT_EVERY", "3"))


pytestmark = pytest.mark.torture


def test_fixed_seed_campaign_keeps_every_record_exactly_once(spark, spark_server, tmp_path):
    with broker_for(tmp_path / "broker") as (bootstrap, own):
        campaign = Campaign(
            SEED,
            STEPS,
            bootstrap,
            tmp_path,
            own.restart if own else None,
            log=print,
            kafka_audit_every=KAFKA_AUDIT_EVERY,
            spark_remote=spark_server,
        )
        figures = campaign.run()
    assert figures["duplicates_found"] == 0 and figures["records_lost"] == 0
    assert figures["steps"] == STEPS and figures["checks"] == STEPS + 1
    assert figures["audits_against_kafka"] == STEPS // KAFKA_AUDIT_EVERY + 1
    assert figures["audits_of_delta_only"] == STEPS - STEPS // KAFKA_AUDIT_EVERY
    kinds = set(figures["steps_by_kind"])
    expected = {
        "produce",
        "produce_txn_committed",
        "produce_txn_aborted",
        "open_txn",
        "finish_open_txn",
        "run",
        "crash_at_failpoint",
        "crash_keyed_at_failpoint",
        "kill_cli_run",
        "backfill",
        "backfill_by_time",
        "rewind",
        "maintenance",
        "schema_change",
        "add_partition",
        "delete_records",
        "nested_field",
        "recreate_topic",
        "keyed_backfill",
        "engine_backfill",
        "routed_crash_or_backfill",
    }
    assert expected <= kinds, f"every kind of step must run at least once: missing {expected - kinds}"
    assert figures["records_in_sink"] > 0 and figures["batches_committed"] > 0
    assert figures["failpoint_crashes"] > 0 and figures["backfills"] > 0, "the faults must have happened, not been no-ops"
    assert figures["rewinds"] > 0 and figures["batches_rewound"] > 0, f"no rewind happened: {figures['skipped_steps']}"
    assert figures["backfills_by_time"] > 0, f"no backfill by time happened: {figures['skipped_steps']}"
    assert figures["maintenance_runs"] > 0 and figures["schema_changes"] > 0
    assert figures["topic_recreations"] > 0 and figures["epochs_reset"] > 0, "the topic was never re-created under a pipeline"
    assert figures["nested_fields_added"] > 0 and figures["keyed_rows"] > 0
    assert figures["keyed_backfills"] + figures["keyed_backfills_refused"] > 0
    assert sum(figures["keyed_crashes"].values()) > 0, "a keyed pipeline's run must have crashed at a failpoint"
    assert figures["engine_keys"] > 0 and figures["engine_backfills"] > 0, "the merge engine must have rows and a backfill"
    assert figures["routed_rows"] > 0 and figures["routed_unrouted"] > 0, "the routed tables must hold rows and unrouted dead letters"
    assert figures["routed_crashes"] + figures["routed_backfills"] > 0, "a routed table must have crashed or been backfilled"
