"""The audit of a Kafka sink, read back as its consumers read it (``audit_kafka_sink``)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import TYPE_CHECKING

from offsetlake.config import PipelineConfig
from offsetlake.config.sink_kinds import KafkaSinkKind
from offsetlake.history import SinkCommit
from offsetlake.kafka import current_offsets
from offsetlake.kafka_commit import commit_log_ends, group_offsets, kafka_sink_commits
from offsetlake.kafka_transactions import read_committed_headers
from offsetlake.ledger import Ledger
from offsetlake.plan import OFFSET_MOVING_KINDS, BatchStatus

if TYPE_CHECKING:
    pass
from offsetlake.audit.report import AUDIT, AuditReport, SinkAudit


def audit_kafka_sink(config: PipelineConfig, against_kafka: bool = True) -> AuditReport:
    """A Kafka sink read back as its consumers read it (read_committed), against its commit log,
    its group's offsets and the ledger: the commit log's ranges follow each other from the start
    to the committed ends (nothing skipped or read twice); every visible record belongs to a
    committed batch (an aborted one shows nothing), each batch shows exactly the rows and dead
    letters its entry counts, and no source record is in two forward batches; the ledger holds
    every commit. The rows are counted over every output topic (``sink.routes``). It always reads
    Kafka: ``against_kafka`` is the Delta audit's choice."""
    report = AuditReport(config.name, sink_topic=", ".join(config.kafka_sink.output_topics))
    commits = kafka_sink_commits(config)
    keys = sorted(current_offsets(config))
    ends = commit_log_ends(commits, keys)
    report.committed = {k: v for k, v in ends.items() if v is not None}
    report.problems += _commit_log_coverage(commits)
    expected = {c.batch_id: c for c in commits}
    seen_rows: dict[str, int] = {}
    seen_dead: dict[str, int] = {}
    owner: dict[tuple[str, int, int], str] = {}
    client = config.kafka_client_config()
    read = [(topic, seen_rows) for topic in config.kafka_sink.output_topics] + [(config.kafka_sink.dead_letters_to, seen_dead)]
    for topic, counts in read:
        for headers in read_committed_headers(client, topic, config.name):
            batch = headers.get("offsetlake.batch", b"").decode()
            counts[batch] = counts.get(batch, 0) + 1
            if batch not in expected:
                report.problems.append(f"{topic}: a record of batch {batch or '(none)'}, which the commit log does not hold")
                continue
            if expected[batch].kind in OFFSET_MOVING_KINDS and "offsetlake.topic" in headers:
                at = (headers["offsetlake.topic"].decode(), int(headers["offsetlake.partition"]), int(headers["offsetlake.offset"]))
                if owner.setdefault(at, batch) != batch:
                    report.problems.append(f"{at[0]}[{at[1]}] offset {at[2]}: produced by batch {owner[at]} and again by batch {batch}")
    for batch_id, c in expected.items():
        rows = sum(r.count("rows_written") or 0 for r in c.entry.ranges)
        dead = sum(r.count("dead_letters") or 0 for r in c.entry.ranges)
        if (seen_rows.get(batch_id, 0), seen_dead.get(batch_id, 0)) != (rows, dead):
            report.problems.append(
                f"batch {batch_id}: its entry counts {rows} rows and {dead} dead letters, the topics show "
                f"{seen_rows.get(batch_id, 0)} and {seen_dead.get(batch_id, 0)}"
            )
    report.rows, report.dead_letters = sum(seen_rows.values()), sum(seen_dead.values())
    _group_against_the_commit_log(config, report, keys, ends)
    recorded = {r["batch_id"] for r in Ledger.of(config).batches() if BatchStatus(r["status"]).committed}
    for batch_id in sorted(set(expected) - recorded):
        report.problems.append(f"batch {batch_id} is in the commit log but not committed in the ledger (the next run reconciles it)")
    return report


def _group_against_the_commit_log(
    config: PipelineConfig, report: AuditReport, keys: list[tuple[str, int]], ends: Mapping[tuple[str, int], int | None]
) -> None:
    """The group's offsets are Kafka's copy of the commit log's ends: past them is a problem (the
    next run refuses), behind or missing (expired, deleted) a note (the next run restores them)."""
    group = group_offsets(config.kafka_client_config(), config.name, keys)
    for (topic, partition), offset in sorted(group.items()):
        logged = ends.get((topic, partition))
        if offset is not None and offset > (logged or 0):
            report.problems.append(
                f"{topic}[{partition}]: the group's committed offset {offset} is past the commit log's end {logged} (the next run refuses)"
            )
        elif logged is not None and (offset is None or offset < logged):
            report.notes.append(
                f"{topic}[{partition}]: the group's committed offset is {offset if offset is not None else 'missing'} "
                f"(expired or deleted), the commit log's end {logged}: the next run restores it; planning reads the commit log"
            )


def _commit_log_coverage(commits: list[SinkCommit]) -> list[str]:
    """Per partition, the forward commits' ranges must follow each other from the first."""
    by_partition: dict[tuple[str, int], list[tuple[int, int, str]]] = {}
    for c in commits:
        if c.kind in OFFSET_MOVING_KINDS:
            for r in c.entry.offset_ranges:
                if r.size:
                    by_partition.setdefault((r.topic, r.partition), []).append((r.start, r.end, c.batch_id))
    problems = []
    for key, spans in sorted(by_partition.items()):
        spans.sort()
        for (_, end, first), (start, _, then) in itertools.pairwise(spans):
            if start != end:
                what = "overlaps" if start < end else "leaves a hole after"
                problems.append(f"{key[0]}[{key[1]}]: batch {then} starts at {start}, which {what} batch {first}'s end {end}")
    return problems


class KafkaSinkAudit(SinkAudit):
    @classmethod
    def run(cls, config: PipelineConfig, against_kafka: bool) -> AuditReport:
        return audit_kafka_sink(config, against_kafka)


KafkaSinkKind.provides(AUDIT, KafkaSinkAudit)
