"""The lake on S3-compatible object storage (the embedded moto server): exactly once, safe
commits, and clear errors for storage settings that cannot work (issue 17)."""

from __future__ import annotations

import json

import obstore
import pyarrow as pa
import pytest
import yaml
from deltalake import CommitProperties, Transaction, write_deltalake
from deltalake.exceptions import CommitFailedError
from kafka_truth import assert_exactly_once, ledger_rows, read_topic
from obstore.exceptions import AlreadyExistsError
from s3_tools import S3Proxy

from offsetlake import storage
from offsetlake.config import load_pipeline
from offsetlake.embedded.local_s3 import LocalS3
from offsetlake.embedded.sample_data import ensure_topic, produce_orders
from offsetlake.errors import ConfigError, StorageError
from offsetlake.plan import RunContext
from offsetlake.runs import run_pipeline


def _on_s3(pipeline, s3, **overrides):
    bucket = s3.bucket()
    return pipeline.write(lake=f"s3://{bucket}/lake", storage=s3.options(), **overrides)


def test_the_embedded_server_refuses_a_second_put_if_absent_and_a_stale_delta_commit(s3, tmp_path):
    bucket = s3.bucket()
    options = {k.lower(): v for k, v in s3.options().items()}
    where = storage.Location.of(f"s3://{bucket}/t", options)
    root = where.path
    store = storage._object_store(root, dict(where.options or {}))
    obstore.put(store, "k", b"first", mode="create")
    with pytest.raises(AlreadyExistsError):
        obstore.put(store, "k", b"second", mode="create")
    assert bytes(obstore.get(store, "k").bytes()) == b"first"

    import pyarrow as pa

    write_deltalake(root, pa.table({"a": [0]}), storage_options=dict(where.options or {}))
    first, second = storage.table(where), storage.table(where)  # both at version 0
    write_deltalake(
        first,
        pa.table({"a": [1]}),
        mode="append",
        commit_properties=CommitProperties(app_transactions=[Transaction("app", 1)], max_commit_retries=0),
    )
    with pytest.raises(CommitFailedError):
        write_deltalake(
            second,
            pa.table({"a": [2]}),
            mode="append",
            commit_properties=CommitProperties(app_transactions=[Transaction("app", 1)], max_commit_retries=0),
        )
    assert sorted(storage.table(where).to_pyarrow_table()["a"].to_pylist()) == [0, 1]


@pytest.mark.parametrize("case", ["unknown bucket", "unreachable endpoint"])
def test_storage_that_cannot_work_is_named_before_kafka_is_read(pipeline, s3, case):
    options = s3.options()
    lake = f"s3://{s3.bucket()}/lake"
    if case == "unknown bucket":
        lake, said = "s3://no-such-bucket-here/lake", "bucket 'no-such-bucket-here' does not exist"
    else:
        options["AWS_ENDPOINT_URL"], said = "http://127.0.0.1:9", "cannot reach the object store at http://127.0.0.1:9"
    pipeline.write(lake=lake, storage=options)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 10)
    run = pipeline.cli("run", timeout=120)
    assert run.returncode == 2, run.stdout + run.stderr
    assert f"pipeline {pipeline.name}" in run.stderr and said in run.stderr, run.stderr
    assert "Traceback" not in run.stderr and s3.secret_key not in run.stderr


def test_credentials_the_store_refuses_are_named(pipeline, tmp_path):
    server = LocalS3(tmp_path / "auth-s3.log", auth=True).start()
    try:
        bucket = server.bucket()
        pipeline.write(lake=f"s3://{bucket}/lake", storage={**server.options(), "AWS_SECRET_ACCESS_KEY": "wrong"})
        run = pipeline.cli("run", timeout=120)
        assert run.returncode == 2, run.stdout + run.stderr
        assert "the credentials were refused" in run.stderr and pipeline.name in run.stderr, run.stderr
        assert "wrong" not in run.stderr
    finally:
        server.stop()


def test_settings_that_make_commits_unsafe_are_refused(pipeline, s3):
    for key, value in (("AWS_S3_ALLOW_UNSAFE_RENAME", "true"), ("aws_conditional_put", "disabled")):
        with pytest.raises(ConfigError, match=f"storage: {key}: "):
            pipeline.write(lake=f"s3://{s3.bucket()}/lake", storage={**s3.options(), key: value})
    with S3Proxy(s3.endpoint, forget_conditions=True) as proxy:
        config = pipeline.write(lake=f"s3://{s3.bucket()}/lake", storage={**s3.options(), "AWS_ENDPOINT_URL": proxy.endpoint})
        with pytest.raises(StorageError, match="accepted a second put-if-absent"):
            config.check_storage()
    report = json.dumps(config.redacted_storage_options())
    assert s3.secret_key not in report and "***" in report


def _behind(proxy, pipeline, s3, **overrides):
    """A pipeline whose lake is reached through ``proxy``, with short store timeouts."""
    bucket = s3.bucket()
    settings = {
        **s3.options(),
        "AWS_ENDPOINT_URL": proxy.endpoint,
        "max_retries": "1",
        "retry_timeout": "5s",
        "timeout": "5s",
        "connect_timeout": "2s",
    }
    return bucket, pipeline.write(lake=f"s3://{bucket}/lake", storage=settings, **overrides)


@pytest.mark.parametrize("moment", ["after_read", "after_files_written"])  # mid-batch: the files; mid-commit
def test_the_store_going_down_mid_batch_fails_the_run_and_the_next_run_lands_everything_once(pipeline, spark, s3, moment):
    from offsetlake import failpoints

    with S3Proxy(s3.endpoint) as proxy:
        _, config = _behind(proxy, pipeline, s3, max_records_per_batch=2_000)
        ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
        produce_orders(pipeline.bootstrap, pipeline.topic, 3_000, malformed_every=101)

        def stop_the_store(_: str) -> None:
            proxy.down = True

        with failpoints.on(moment, stop_the_store), pytest.raises(Exception) as failed:
            run_pipeline(config, RunContext("s3-outage"), lambda: spark)
        assert proxy.down, failed.value
        assert isinstance(failed.value, StorageError), failed.value
        said = str(failed.value)
        assert f"pipeline {pipeline.name}" in said and "the object store" in said and "failed" in said and proxy.endpoint in said, said
        proxy.down = False
        rows_before = storage.table(config.layout.sink).count() if storage.is_table(config.layout.sink) else 0
        run_pipeline(config, RunContext("s3-after-outage"), lambda: spark)
        truth = read_topic(pipeline.bootstrap, pipeline.topic)
        assert_exactly_once(config, truth)
        assert storage.table(config.layout.sink).count() > rows_before
        audit = pipeline.cli("audit", "--against-kafka")
        assert audit.returncode == 0, audit.stdout + audit.stderr


def test_a_commit_applied_but_unanswered_is_never_applied_twice(pipeline, spark, s3):
    with S3Proxy(s3.endpoint) as proxy:
        bucket, config = _behind(proxy, pipeline, s3, max_records_per_batch=1_500)
        ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
        produce_orders(pipeline.bootstrap, pipeline.topic, 1_000)
        run_pipeline(config, RunContext("s3-first"), lambda: spark)
        produce_orders(pipeline.bootstrap, pipeline.topic, 1_000, first_id=5_000)
        proxy.lose_next_commit_answer(f"/{bucket}/lake/{pipeline.name}/_delta_log/")
        run_pipeline(config, RunContext("s3-lost-answer"), lambda: spark)  # learns its commit landed
        assert proxy.answer_lost, f"no commit answer was lost (commits seen: {proxy.commits_seen})"
        lost = [r for r in ledger_rows(config) if r["run_id"] == "s3-lost-answer"]
        assert {r["status"] for r in lost} == {"planned", "committed"}, lost  # its commit stands: not "superseded"
        run_pipeline(config, RunContext("s3-after"), lambda: spark)
        assert_exactly_once(config, read_topic(pipeline.bootstrap, pipeline.topic))
        audit = pipeline.cli("audit", "--against-kafka")
        assert audit.returncode == 0, audit.stdout + audit.stderr
        status = pipeline.cli("status")  # shows the store, never its secret
        assert status.returncode == 0 and bucket in status.stdout, status.stdout + status.stderr
        assert s3.secret_key not in status.stdout + status.stderr + audit.stdout + audit.stderr


def test_the_writer_that_loses_the_commit_race_is_recorded_superseded(pipeline, spark, s3):
    """Two runs on one pipeline: the second plans, reads and commits the same ranges while the
    first is between writing its files and committing them. The second's commit stands; the first
    commits nothing, is recorded ``superseded`` naming the winner and re-plans; nothing twice."""
    from offsetlake import failpoints

    config = _on_s3(pipeline, s3, max_records_per_batch=5_000)
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    produce_orders(pipeline.bootstrap, pipeline.topic, 2_000, malformed_every=97)
    raced: list[str] = []

    def the_other_writer_commits_first(_: str) -> None:
        if not raced:
            raced.append("rival")
            assert [r.status for r in run_pipeline(config, RunContext("rival"), lambda: spark)] == ["committed"]

    with failpoints.on("after_files_written", the_other_writer_commits_first):
        lost = run_pipeline(config, RunContext("loser"), lambda: spark)  # then re-plans: nothing left
    assert [r.status for r in lost] == ["superseded"], lost
    statuses = {(r["run_id"], r["status"]) for r in ledger_rows(config) if r["status"] != "planned"}
    assert statuses == {("rival", "committed"), ("loser", "superseded")}, statuses
    loser = next(r for r in ledger_rows(config) if r["run_id"] == "loser" and r["status"] == "superseded")
    rival = next(r["batch_id"] for r in ledger_rows(config) if r["run_id"] == "rival")
    assert f"already committed by batch {rival}" in loser["message"], loser  # names the winner
    assert_exactly_once(config, read_topic(pipeline.bootstrap, pipeline.topic))


def test_runs_racing_on_a_store_without_conditional_writes_are_both_refused_at_start(pipeline, s3):
    """A store that would let the second of two racing commits overwrite the first is refused
    by every run before it reads Kafka or writes the lake: no race can happen on it."""
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 100)
    with S3Proxy(s3.endpoint, forget_conditions=True) as proxy:
        bucket = s3.bucket()
        config = pipeline.write(lake=f"s3://{bucket}/lake", storage={**s3.options(), "AWS_ENDPOINT_URL": proxy.endpoint})
        racers = [pipeline.cli_start("run"), pipeline.cli_start("run")]
        for racer in racers:
            _, err = racer.communicate(timeout=300)
            assert racer.returncode == 2, err[-3000:]
            assert "accepted a second put-if-absent" in err and pipeline.name in err, err[-3000:]
        assert not storage.is_table(config.layout.sink) and not storage.is_table(config.layout.ledger)


def test_a_stream_lease_taken_whose_answer_was_lost_is_held(pipeline, s3):
    """Taking a stream's lease is a commit too: one the store applied without answering must
    leave its writer holding the lease, not waiting for itself to expire."""
    from urllib.parse import urlsplit

    from offsetlake.lease import StreamLease, current_lease

    with S3Proxy(s3.endpoint) as proxy:
        _, config = _behind(proxy, pipeline, s3)
        first = StreamLease(config, "first-owner", "test", ttl_seconds=30)
        first.acquire(wait_seconds=5)
        first.release()
        lease = urlsplit(config.stream_lease_path)
        proxy.lose_next_commit_answer(f"/{lease.netloc}{lease.path}/_delta_log/")
        state = StreamLease(config, "second-owner", "test", ttl_seconds=30).acquire(wait_seconds=5)
        assert proxy.answer_lost
        assert state.owner == "second-owner" and current_lease(config).owner == "second-owner"


def test_two_pipelines_on_one_lake_root_each_reach_it_with_their_own_credentials(pipeline, tmp_path):
    """Storage settings travel with each pipeline's lake value: loading a second pipeline on the
    same lake root with other credentials changes nothing for the first (a process-wide registry
    keyed by lake root let the last pipeline loaded win for both)."""
    server = LocalS3(tmp_path / "auth-s3.log", auth=True).start()
    try:
        lake = f"s3://{server.bucket()}/lake"
        pipeline.write(lake=lake, storage=server.options())
        body = yaml.safe_load(pipeline.file.read_text())
        other = f"{pipeline.name}_other"
        body.update(name=other, storage={**server.options(), "AWS_SECRET_ACCESS_KEY": "wrong"})
        (pipeline.folder / f"{other}.yaml").write_text(yaml.safe_dump(body))

        mine = load_pipeline(pipeline.name, pipeline.folder)
        theirs = load_pipeline(other, pipeline.folder)  # loaded last, same lake root
        assert mine.layout.lake.path == theirs.layout.lake.path == lake

        mine.check_storage()  # the right credentials pass the probe, whoever loaded last
        storage.create_table(mine.layout.sink, pa.schema([("a", pa.int64())]))
        storage.append(mine.layout.sink, pa.table({"a": [1]}))
        assert storage.table(mine.layout.sink).to_pyarrow_table()["a"].to_pylist() == [1]

        with pytest.raises(StorageError, match="the credentials were refused") as refused:
            theirs.check_storage()  # its own wrong secret, though the same root passed for the first
        assert other in str(refused.value) and "wrong" not in str(refused.value)
    finally:
        server.stop()
