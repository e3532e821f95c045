"""Merge engines without services (issue 38): the YAML's rules, each refusal naming the file and
field, and the replay oracle's own rules on hand-made records."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import yaml

from offsetlake.config import load_pipeline
from offsetlake.coordinates import OFFSET, PARTITION, TIMESTAMP, TOPIC
from offsetlake.engine_replay import replay, windows_of
from offsetlake.errors import ConfigError
from offsetlake.formats import CHANGE, DELETE

BASE = {
    "name": "hourly",
    "topic": "orders",
    "kafka": {"bootstrap_servers": "127.0.0.1:9092"},
    "format": {"type": "json", "schema": {"order_id": "long", "amount": "double", "currency": "string", "created_at": "timestamp"}},
}
AGGREGATE = {"mode": "aggregate", "key": ["currency"], "measures": {"revenue": {"sum": "amount"}}}
T0 = datetime(2026, 11, 1, tzinfo=UTC)


def _load(tmp_path, sink: dict, text: str | None = None, **more):
    path = tmp_path / "hourly.yaml"
    path.write_text(text if text is not None else yaml.safe_dump({**BASE, **more, "sink": sink}))
    return load_pipeline(str(path))


def test_an_unquoted_yaml_on_names_the_window_column(tmp_path):
    body = yaml.safe_dump({**BASE, "sink": {**AGGREGATE, "window": {"size": "1h"}}}).replace("size: 1h", "size: 1h\n    on: created_at")
    assert "'on'" not in body and "on: created_at" in body  # YAML 1.1 reads this key as true
    config = _load(tmp_path, {}, text=body)
    assert config.sink.window is not None and config.sink.window.on == "created_at"


@pytest.mark.parametrize(
    ("sink", "field", "words"),
    [
        ({"mode": "aggregate", "key": ["currency"]}, "sink", "needs measures"),
        ({**AGGREGATE, "measures": {"r": {"avg": "amount"}}}, "sink", "unknown function 'avg'"),
        ({**AGGREGATE, "measures": {"r": {"sum": "*"}}}, "sink", "only count takes '\\*'"),
        ({**AGGREGATE, "measures": {"currency": {"max": "amount"}}}, "sink", "measure currency has the name of a key column"),
        ({**AGGREGATE, "allowed_lateness": "1h"}, "sink", "allowed_lateness needs a window"),
        ({**AGGREGATE, "window": {"on": "created_at", "size": "1h", "slide": "7m"}}, "sink.window", "must divide size"),
        ({**AGGREGATE, "window": {"on": "created_at", "size": "an hour"}}, "sink.window", "not a duration"),
        ({"mode": "first_row", "key": ["order_id"], "measures": {"r": {"sum": "amount"}}}, "sink", "measures applies to mode: aggregate"),
        ({"mode": "partial_update"}, "sink", "mode partial_update needs key"),
        (
            {"mode": "aggregate", "key": ["currency"], "measures": {"r": {"sum": "amount"}}, "within": "1d"},
            "sink",
            "within applies to mode: first_row",
        ),
        ({"mode": "first_row", "key": ["order_id"], "within_on": "created_at"}, "sink", "within_on needs within"),
        ({"mode": "first_row", "key": ["order_id"], "within": "a week"}, "sink", "not a duration"),
    ],
)
def test_engine_settings_are_refused_at_load_naming_the_field(tmp_path, sink, field, words):
    with pytest.raises(ConfigError, match=words) as err:
        _load(tmp_path, sink)
    assert str(tmp_path / "hourly.yaml") in str(err.value) and field in str(err.value)


def test_a_debezium_envelope_is_refused_for_the_engines_that_take_no_deletes(tmp_path):
    fmt = {**BASE["format"], "envelope": "debezium"}
    with pytest.raises(ConfigError, match="mode first_row takes no deletes"):
        _load(tmp_path, {"mode": "first_row", "key": ["order_id"]}, format=fmt)
    assert _load(tmp_path, {"mode": "partial_update", "key": ["order_id"]}, format=fmt).sink.deletes


def _row(offset: int, seconds: int, partition: int = 0, **values) -> dict:
    return {TOPIC: "t", PARTITION: partition, OFFSET: offset, TIMESTAMP: T0 + timedelta(seconds=seconds), **values}


def test_a_sliding_window_counts_a_record_in_each_window_that_holds_it(tmp_path):
    config = _load(tmp_path, {**AGGREGATE, "window": {"on": "created_at", "size": "1h", "slide": "20m"}})
    at = T0 + timedelta(minutes=50)
    assert [start.minute for start, _ in windows_of(config, {"created_at": at})] == [0, 20, 40]
    assert all(start <= at < end and end - start == timedelta(hours=1) for start, end in windows_of(config, {"created_at": at}))
    assert [(s.hour, s.minute) for s, _ in windows_of(config, {"created_at": T0 + timedelta(hours=1)})] == [(0, 20), (0, 40), (1, 0)]


def test_the_replay_orders_by_record_time_and_keeps_non_null_fields(tmp_path):
    config = _load(tmp_path, {"mode": "partial_update", "key": ["order_id"]})
    rows = [
        _row(0, 10, order_id=1, amount=5.0, currency="EUR"),
        _row(1, 5, order_id=1, amount=7.0, currency=None),  # earlier in time: applied first
        _row(2, 20, order_id=1, amount=None, currency="USD"),
        _row(3, 30, order_id=2, amount=1.0, currency="EUR"),
        _row(4, 40, order_id=2, **{CHANGE: DELETE}),
        _row(5, 50, order_id=2, amount=None, currency="GBP"),  # after the delete: a fresh row
    ]
    got = replay(config, rows)
    assert got[(1,)]["amount"] == 5.0 and got[(1,)]["currency"] == "USD"
    assert got[(2,)]["amount"] is None and got[(2,)]["currency"] == "GBP"
    assert replay(config, rows[:5]) == {(1,): got[(1,)]}  # a delete last: no row


def test_the_replay_aggregates_every_measure(tmp_path):
    measures = {
        "total": {"sum": "amount"},
        "n": {"count": "*"},
        "paid": {"count": "amount"},
        "low": {"min": "amount"},
        "high": {"max": "amount"},
        "first": {"first": "amount"},
        "last": {"last": "amount"},
        "known": {"last_non_null": "amount"},
    }
    config = _load(tmp_path, {"mode": "aggregate", "key": ["currency"], "measures": measures})
    rows = [_row(0, 30, currency="EUR", amount=3.0), _row(1, 10, currency="EUR", amount=None), _row(2, 20, currency="EUR", amount=9.0)]
    assert replay(config, rows)[("EUR",)] == {
        "total": 12.0,
        "n": 3,
        "paid": 2,
        "low": 3.0,
        "high": 9.0,
        "first": None,
        "last": 3.0,
        "known": 3.0,
    }


def test_a_horizon_lets_a_key_in_again_once_its_episode_is_over(tmp_path):
    config = _load(tmp_path, {"mode": "first_row", "key": ["order_id"], "within": "1m"})
    rows = [
        _row(0, 0, order_id=1, amount=1.0),
        _row(1, 59, order_id=1, amount=2.0),  # a resend inside the horizon
        _row(2, 61, order_id=1, amount=3.0),  # past it: a new episode, its first is the row
        _row(3, 90, order_id=1, amount=4.0),  # inside the new episode
        _row(4, 30, order_id=2, amount=5.0),
        _row(5, 10, order_id=2, amount=6.0),  # earlier in time: the first of key 2
    ]
    got = replay(config, rows)
    assert got[(1,)]["amount"] == 3.0 and got[(2,)]["amount"] == 6.0
    assert replay(config, rows[:2])[(1,)]["amount"] == 1.0
    on_event_time = _load(tmp_path, {"mode": "first_row", "key": ["order_id"], "within": "1m", "within_on": "created_at"})
    events = [
        _row(0, 0, order_id=1, amount=1.0, created_at=T0),
        _row(1, 500, order_id=1, amount=2.0, created_at=T0 + timedelta(seconds=30)),
    ]
    assert replay(on_event_time, events)[(1,)]["amount"] == 1.0  # 30 s apart by event time, whatever the record times
