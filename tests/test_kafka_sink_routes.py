"""A Kafka sink with ``sink.routes`` on the real broker: each row goes to the topic its value (or
its source topic) maps, and the rest to ``sink.topic``, all of a batch in its one transaction.
Checked with a plain read_committed consumer of every topic (``kafka_truth``): each valid source
record once over all the output topics, in the topic its value maps, through a run crashed with
its records produced to every topic but not committed and one crashed after its Kafka commit."""

from __future__ import annotations

import json
import time
from collections import Counter

import pytest
from kafka_truth import read_records, source_orders

from offsetlake import failpoints
from offsetlake.audit import audit_pipeline
from offsetlake.embedded.sample_data import ensure_topic, produce_orders
from offsetlake.kafka_commit import kafka_sink_commits
from offsetlake.ledger import Ledger
from offsetlake.plan import BatchStatus, RunContext
from offsetlake.runs import run_pipeline


def _crash(_name: str) -> None:
    raise failpoints.SimulatedCrash()


def _where_each_source_record_is(bootstrap: str, topics: list[str]) -> dict[tuple[str, int, int], list[str]]:
    """(source topic, partition, offset) -> the output topics holding a record of it (ingest kind)."""
    found: dict[tuple[str, int, int], list[str]] = {}
    for topic in topics:
        for record in read_records(bootstrap, topic):
            h = dict(record.headers)
            if h["offsetlake.kind"].decode() == "ingest":
                at = (h["offsetlake.topic"].decode(), int(h["offsetlake.partition"]), int(h["offsetlake.offset"]))
                found.setdefault(at, []).append(topic)
                assert json.loads(record.value or b"")["order_id"] >= 0
    return found


def _settled(check, wait_s: float = 30):
    """``check()`` again while it fails, for up to ``wait_s``: a committed transaction's markers
    reach its partitions just after the commit returns."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return check()
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def test_rows_routed_by_a_column_reach_their_topics_once_through_crashes(pipeline, spark):
    out = f"{pipeline.topic}-out"
    eur, usd = f"{out}.eur", f"{out}.usd"
    ensure_topic(pipeline.bootstrap, pipeline.topic, 2)
    for topic in (out, eur, usd):
        ensure_topic(pipeline.bootstrap, topic, 2)
    routes = {"by": "currency", "topics": {eur: ["EUR"], usd: ["USD"]}}
    config = pipeline.write(max_records_per_batch=300, sink={"type": "kafka", "topic": out, "key": ["customer"], "routes": routes})
    assert config.sink.output_topics == [out, eur, usd]

    next_id = 0
    # after_flush: every topic holds the batch's records, uncommitted (the next runner's fence
    # aborts them); after_kafka_commit: committed in every topic, the ledger row not yet written
    for step in ("after_flush", "after_kafka_commit"):
        next_id = produce_orders(pipeline.bootstrap, pipeline.topic, 150, first_id=next_id, malformed_every=37)
        with failpoints.on(step, _crash), pytest.raises(failpoints.SimulatedCrash):
            run_pipeline(config, RunContext(f"crash-{step}"), lambda: spark)
    next_id = produce_orders(pipeline.bootstrap, pipeline.topic, 150, first_id=next_id, malformed_every=37)
    batches = run_pipeline(config, RunContext("recover"), lambda: spark)
    assert batches and all(b.status == BatchStatus.COMMITTED for b in batches)

    source = source_orders(pipeline.bootstrap, pipeline.topic)
    valid = {(pipeline.topic, p, o): v for (p, o), v in source.items() if v is not None}
    expected = {k: {"EUR": eur, "USD": usd}.get(v["currency"], out) for k, v in valid.items()}
    assert set(expected.values()) == {out, eur, usd}, "the orders hold every currency: each topic takes some"

    def every_row_once_in_its_topic() -> None:
        found = _where_each_source_record_is(pipeline.bootstrap, [out, eur, usd])
        assert set(found) == set(valid), f"missing {sorted(set(valid) - set(found))[:3]}, extra {sorted(set(found) - set(valid))[:3]}"
        twice = {k: v for k, v in found.items() if len(v) > 1}
        assert not twice, list(twice.items())[:3]
        wrong = {k: (v[0], expected[k]) for k, v in found.items() if v[0] != expected[k]}
        assert not wrong, list(wrong.items())[:3]

    _settled(every_row_once_in_its_topic)
    dead = Counter(
        (int(dict(r.headers)["offsetlake.partition"]), int(dict(r.headers)["offsetlake.offset"]))
        for r in read_records(pipeline.bootstrap, config.sink.dead_letters_to)
    )
    assert set(dead) == {k for k, v in source.items() if v is None} and max(dead.values()) == 1

    # one commit log for every topic: the batch killed after its Kafka commit (the first 300
    # records, its aborted predecessor's among them), which the ledger learned from it, and the last
    committed = {r["batch_id"] for r in Ledger.of(config).batches() if r["status"] == "committed"}
    assert committed == {c.batch_id for c in kafka_sink_commits(config)} and len(committed) == 2
    audit = audit_pipeline(config)
    assert audit.ok and audit.rows == len(valid) and audit.dead_letters == len(dead), audit.text()
    assert run_pipeline(config, RunContext("again"), lambda: spark) == []


def test_rows_routed_by_their_source_topic_and_a_column_the_rows_lack_is_named(pipeline, spark):
    second = f"{pipeline.topic}_b"
    out, from_b = f"{pipeline.topic}-all", f"{pipeline.topic}-from-b"
    for topic in (pipeline.topic, second, out, from_b):
        ensure_topic(pipeline.bootstrap, topic, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 40)
    produce_orders(pipeline.bootstrap, second, 30, first_id=1000)
    routes = {"by": "topic", "topics": {from_b: [second]}}
    config = pipeline.write(topic=None, topics=[pipeline.topic, second], sink={"type": "kafka", "topic": out, "routes": routes})
    assert [b.status for b in run_pipeline(config, RunContext("r"), lambda: spark)] == [BatchStatus.COMMITTED]

    def each_topic_holds_its_sources() -> None:
        found = _where_each_source_record_is(pipeline.bootstrap, [out, from_b])
        assert Counter(v[0] for v in found.values()) == {out: 40, from_b: 30}
        assert all((k[0] == second) == (v == [from_b]) for k, v in found.items())

    _settled(each_topic_holds_its_sources)
    assert audit_pipeline(config).ok

    # a transform that drops the route's column: the batch fails naming it, nothing is produced
    (pipeline.folder / "drop_currency.py").write_text("def transform(df):\n    return df.drop('currency')\n")
    routed = {"by": "currency", "topics": {from_b: ["EUR"]}}
    config = pipeline.write(
        topic=None,
        topics=[pipeline.topic, second],
        transform="drop_currency:transform",
        sink={"type": "kafka", "topic": out, "routes": routed},
    )
    produce_orders(pipeline.bootstrap, pipeline.topic, 5, first_id=2000)
    with pytest.raises(Exception, match="sink.routes.by: the rows have no column 'currency'"):
        run_pipeline(config, RunContext("no-column"), lambda: spark)
    _settled(each_topic_holds_its_sources)
