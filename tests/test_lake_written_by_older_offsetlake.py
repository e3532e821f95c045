"""A lake written by an older offsetlake (main 3e10e68: ledger entries with only the
``offsetlake: 1`` marker, no ``format_version``) is read and continued by this one: nothing
re-read, nothing duplicated (issue 36, item 1).

The lake under ``tests/data/lake-v1`` was written by ``scripts/make_upgrade_lake.py`` with that
version's code: ingest batches with dead letters, a backfill a rewind undid, another backfill, a gap, and a batch
whose run was killed right after its sink commit (its dead letters staged, not applied). Its records
are re-produced here into a fresh topic of the same name at the same offsets and timestamps
(partition by partition, each delivered offset checked), and the records the old broker had
deleted are deleted again, so the lake's committed ends mean what they meant.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
from pathlib import Path

import yaml
from confluent_kafka import Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from offsetlake import dead_letters, storage
from offsetlake.config import load_pipeline
from offsetlake.embedded.sample_data import produce_orders
from offsetlake.entry import FORMAT_VERSION, IngestEntry
from offsetlake.history import commit_infos, sink_commits
from offsetlake.ledger import Ledger
from offsetlake.plan import BatchKind, RunContext
from offsetlake.runs import run_pipeline

DATA = Path(__file__).resolve().parent / "data" / "lake-v1"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from make_upgrade_lake import pipeline_body, topic_records  # noqa: E402


def _reproduce(bootstrap: str, manifest: dict) -> None:
    """The old topic again: same partitions, records, offsets, timestamps and log starts."""
    topic = manifest["topic"]
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=manifest["partitions"], replication_factor=1)])[topic].result(30)
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 5})
    delivered: list[tuple[int, int, int]] = []
    for r in manifest["records"]:
        producer.produce(
            topic,
            value=base64.b64decode(r["value"]) if r["value"] is not None else None,
            key=base64.b64decode(r["key"]) if r["key"] is not None else None,
            partition=r["partition"],
            timestamp=r["timestamp_ms"],
            on_delivery=lambda err, m, want=r["offset"]: delivered.append(
                (m.partition(), m.offset(), want) if err is None else (-1, -1, want)
            ),
        )
    assert producer.flush(60) == 0
    assert all(got == want for _, got, want in delivered) and len(delivered) == len(manifest["records"]), (
        "the re-produced records did not land at their old offsets"
    )
    starts = [TopicPartition(topic, int(p), o) for p, o in manifest["log_start"].items()]
    for future in admin.delete_records(starts).values():
        future.result(30)


def _decoded(manifest: dict) -> tuple[dict[tuple[int, int], int], set[tuple[int, int]]]:
    """(partition, offset) -> order id of every parseable record the old topic held, and the
    coordinates of the others (dead letters)."""
    good, bad = {}, set()
    for r in manifest["records"]:
        try:
            good[(r["partition"], r["offset"])] = int(json.loads(base64.b64decode(r["value"]))["order_id"])
        except ValueError:
            bad.add((r["partition"], r["offset"]))
    return good, bad


def _raw_keys(config, first: int) -> list[set[str]]:
    """The JSON keys of each sink commit's entry from version ``first`` on, as stored."""
    table = storage.table(config.sink_path)
    return [
        set(json.loads(i["userMetadata"]))
        for i in commit_infos(table, first, table.version())
        if '"offsetlake":1' in (i.get("userMetadata") or "")
    ]


def _sink_rows(config) -> list[tuple[int, int, int]]:
    rows = storage.table(config.sink_path).to_pyarrow_table(columns=["_kafka_partition", "_kafka_offset", "order_id"])
    return list(zip(*(rows[c].to_pylist() for c in rows.column_names), strict=True))


def _open(tmp_path: Path, bootstrap: str):
    lake = tmp_path / "lake"
    shutil.copytree(DATA / "lake", lake)  # Delta paths are relative: the copy is the same lake
    file = tmp_path / "upgrade.yaml"
    file.write_text(yaml.safe_dump(pipeline_body(bootstrap, str(lake)), sort_keys=False))
    return load_pipeline(str(file)), file


def test_a_lake_written_before_format_versions_is_read_and_continued_exactly_once(broker, spark, tmp_path):
    manifest = json.loads((DATA / "records.json").read_text())
    expected = json.loads((DATA / "expected.json").read_text())
    _reproduce(broker.bootstrap, manifest)
    config, file = _open(tmp_path, broker.bootstrap)

    # read: every old entry, of every kind, as the old code recorded it
    commits = sink_commits(storage.table(config.sink_path), config.name)
    assert {c.entry.format_version for c in commits} == {1}
    assert {BatchKind.INGEST, BatchKind.BACKFILL, BatchKind.REWIND, BatchKind.GAP} <= {c.kind for c in commits}
    crashed = commits[-1]  # its run died after the sink commit: dead letters staged, not applied
    assert [c.version for c in dead_letters.pending(config)] == [crashed.version]
    assert isinstance(crashed.entry, IngestEntry) and crashed.entry.staged
    batches = {(r["batch_id"], r["kind"], r["status"]) for r in Ledger.of(config).batches()}
    by_kind: dict[str, int] = {}
    for _, kind, status in batches:
        by_kind[f"{kind}/{status}"] = by_kind.get(f"{kind}/{status}", 0) + 1
    assert by_kind == expected["batches_by_kind_and_status"]
    assert (crashed.batch_id, "ingest", "planned") in batches

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "offsetlake", *args, str(file)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=Path(__file__).resolve().parent.parent,
        )

    status = cli("status", "--json")
    assert status.returncode == 0, status.stderr
    ends = {str(p["partition"]): p["committed_end"] for p in json.loads(status.stdout)["partitions"]}
    assert ends == expected["committed_ends"]
    audit = cli("audit")
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert len(_sink_rows(config)) == expected["sink_rows"]

    # continue: new records only, each once
    old_keys = set().union(*_raw_keys(config, 0))
    for p in range(manifest["partitions"]):
        produce_orders(broker.bootstrap, manifest["topic"], 40, first_id=50_000 + p * 1_000, partition=p, malformed_every=13)
    results = run_pipeline(config, RunContext("after-upgrade"), lambda: spark)
    assert results and all(r.status == "committed" for r in results)
    first_starts: dict[str, int] = {}
    for result in results:
        for r in result.plan.ranges:
            first_starts.setdefault(str(r.partition), r.start)
    assert first_starts == expected["committed_ends"], "the continued run must start at the old committed ends"
    new_commits = sink_commits(storage.table(config.sink_path), config.name)[len(commits) :]
    assert {c.entry.format_version for c in new_commits} == {FORMAT_VERSION}
    # what the old code reads: a new entry holds the old keys, format_version and optional keys added
    # since (data_path: an old reader keeps it as an unknown key), nothing renamed; topic_ids the old
    # code wrote too, where the broker named ids (the frozen lake was written on one that named none)
    assert all(keys <= old_keys | {"format_version", "data_path", "topic_ids"} for keys in _raw_keys(config, crashed.version + 1))

    good, bad = _decoded(manifest)
    for (p, o), r in topic_records(broker.bootstrap).items():  # the new records, read with a plain consumer
        if o >= int(expected["committed_ends"][str(p)]):
            try:
                good[(p, o)] = int(json.loads(base64.b64decode(r["value"]))["order_id"])
            except ValueError:
                bad.add((p, o))
    gaps = [(r["partition"], r["start_offset"], r["end_offset"]) for r in Ledger.of(config).batches() if r["kind"] == BatchKind.GAP]
    assert gaps and all(end == manifest["log_start"][str(p)] for p, _, end in gaps)

    def lost(c: tuple[int, int]) -> bool:
        return any(c[0] == p and s <= c[1] < e for p, s, e in gaps)

    rows = _sink_rows(config)
    assert len({(p, o) for p, o, _ in rows}) == len(rows), "a record is in the sink twice"
    assert {(p, o): oid for p, o, oid in rows} == {c: oid for c, oid in good.items() if not lost(c)}
    new_rows = sum(r.total("rows_written") for r in results)
    assert new_rows == 2 * (40 - 40 // 13) and len(rows) == expected["sink_rows"] + new_rows
    dead = storage.table(config.dead_letter_path).to_pyarrow_table(columns=["_kafka_partition", "_kafka_offset"])
    dead_coordinates = list(zip(dead["_kafka_partition"].to_pylist(), dead["_kafka_offset"].to_pylist(), strict=True))
    assert len(dead_coordinates) == len(set(dead_coordinates)), "a dead letter is in the table twice"
    assert set(dead_coordinates) == {c for c in bad if not lost(c)}, "the crashed batch's dead letters applied once"
    # dead letters gained reason_code (issue 36 item 5): null in what the old code wrote, a code in the new
    coded = storage.table(config.dead_letter_path).to_pyarrow_table(columns=["_kafka_partition", "_kafka_offset", "reason_code"])
    codes = {(p, o): c for p, o, c in zip(*(coded[n].to_pylist() for n in coded.column_names), strict=True)}
    old_end = {int(p): int(e) for p, e in expected["committed_ends"].items()}
    assert {c for (p, o), c in codes.items() if o < old_end[p]} == {None}
    assert {c for (p, o), c in codes.items() if o >= old_end[p]} == {"undecodable"}
    assert dead_letters.pending(config) == []
    audit = cli("audit")
    assert audit.returncode == 0, audit.stdout + audit.stderr
    statuses = {r["batch_id"]: r["status"] for r in Ledger.of(config).batches()}
    assert statuses[crashed.batch_id] == "committed", "reconciled from its old entry"
    rebuilt = cli("ledger", "rebuild")  # the projection again from the old and the new entries alone
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert {(r["batch_id"], r["status"]) for r in Ledger.of(config).batches()} >= {
        (b, s) for b, _, s in batches if s in ("committed", "gap", "rewound")
    } | {(crashed.batch_id, "committed")}
