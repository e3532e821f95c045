"""One batch loop, two policies: a run re-plans a lost commit at most ``MAX_CONFLICT_REPLANS``
times and raises a transient error at once; the stream re-plans without a cap and waits an outage
out (1 s doubling to 30 s, 8 times in a row).

The policy arithmetic needs no service. The two loops are then driven with a real broker, Spark
and Delta; the lost commits come from a failpoint hook after each read that raises what delta-rs
raises through ``sink.commit_once`` when another writer won (``CommitConflictError``).
"""

from __future__ import annotations

import pytest
from crash_runs import assert_every_plan_has_an_outcome
from kafka_truth import assert_exactly_once, ledger_rows, read_topic

from offsetlake import failpoints
from offsetlake.embedded.sample_data import ensure_topic, produce_orders
from offsetlake.errors import CommitConflictError
from offsetlake.loop_policy import MAX_CONFLICT_REPLANS, Backoff, CaughtUp, LoopPolicy, OffsetLimit
from offsetlake.plan import BatchKind, RunContext
from offsetlake.runs import run_pipeline
from offsetlake.stream import MAX_TRANSIENT_RETRIES, StopControl, StreamOptions, run_stream


def test_the_back_off_doubles_from_one_second_to_thirty_and_is_spent_after_eight_in_a_row():
    backoff = Backoff(max_retries=MAX_TRANSIENT_RETRIES)
    assert [backoff.pause(n) for n in range(1, 10)] == [1, 2, 4, 8, 16, 30, 30, 30, None]
    assert Backoff(max_retries=2, first_s=0.5, max_s=1).pause(3) is None
    assert [Backoff(max_retries=3, first_s=0.5, max_s=1).pause(n) for n in (1, 2, 3)] == [0.5, 1, 1]


def test_a_run_re_plans_five_lost_commits_and_the_stream_any_number():
    run = LoopPolicy()
    assert [run.may_replan(n) for n in range(1, MAX_CONFLICT_REPLANS + 2)] == [True] * MAX_CONFLICT_REPLANS + [False]
    assert LoopPolicy(max_conflict_replans=None).may_replan(10**6)
    assert LoopPolicy(max_conflict_replans=0).may_replan(1) is False


def test_the_default_policy_is_a_runs():
    """``run_pipeline`` passes only ``max_batches`` and ``emit``: the rest of its policy is the default."""
    run = LoopPolicy()
    assert (run.kind, run.offset_limit, run.resume_unfinished, run.max_conflict_replans, run.backoff, run.when_caught_up) == (
        BatchKind.INGEST,
        OffsetLimit.LSO_AT_START,
        True,
        MAX_CONFLICT_REPLANS,
        None,
        CaughtUp.STOP,
    )


def _lose_commits(config, times: int, then=lambda: None):
    """A failpoint hook: the first ``times`` batches to finish their read lose their commit."""
    lost: list[int] = []

    def hook(_name: str) -> None:
        if len(lost) < times:
            lost.append(1)
            raise CommitConflictError("simulated: another writer committed these ranges first", pipeline=config.name)
        then()

    return hook, lost


def test_a_run_gives_up_after_five_re_plans_and_the_next_run_lands_the_records_once(pipeline, spark):
    config = pipeline.write()
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 300)
    hook, lost = _lose_commits(config, times=100)
    with failpoints.on("after_read", hook), pytest.raises(CommitConflictError, match="simulated"):
        run_pipeline(config, RunContext("loses-every-commit"), lambda: spark, emit=lambda _: None)
    assert len(lost) == MAX_CONFLICT_REPLANS + 1
    superseded = {r["batch_id"] for r in ledger_rows(config) if r["status"] == "superseded"}
    assert len(superseded) == MAX_CONFLICT_REPLANS + 1
    assert not [r for r in ledger_rows(config) if r["status"] == "committed"]
    assert_every_plan_has_an_outcome(config)

    results = run_pipeline(config, RunContext("after-the-losses"), lambda: spark, emit=lambda _: None)
    assert [r.status for r in results] == ["committed"]
    assert_exactly_once(config, read_topic(pipeline.bootstrap, pipeline.topic))


def test_a_stream_re_plans_every_lost_commit_and_then_commits(pipeline, spark):
    config = pipeline.write()
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 300)
    stop = StopControl()
    times = MAX_CONFLICT_REPLANS + 3  # more than a run would take
    hook, lost = _lose_commits(config, times, then=lambda: stop.request("test stop"))
    options = StreamOptions(trigger_interval=0.5, lease_ttl=6, run_id="loses-commits")
    with failpoints.on("after_read", hook):
        report = run_stream(config, options, lambda: spark, stop, lambda _: None)
    assert len(lost) == times
    assert (report.stop_reason, report.batches, report.abandoned) == ("test stop", 1, [])
    rows = [r for r in ledger_rows(config) if r["kind"] == "stream"]
    assert len({r["batch_id"] for r in rows if r["status"] == "superseded"}) == times
    assert len({r["batch_id"] for r in rows if r["status"] == "committed"}) == 1
    assert_every_plan_has_an_outcome(config)
    assert_exactly_once(config, read_topic(pipeline.bootstrap, pipeline.topic))
