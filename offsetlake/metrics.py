"""Prometheus text for the pipelines' state: what ``/offsetlake/metrics`` of the Airflow plugin serves.

The figures come from ``offsetlake.ledger_view.pipeline_metrics`` (the functions behind
``offsetlake status`` and the Offset ledger view); this module only names and labels them, with
the Prometheus client's collector types and text encoder. Every metric is a gauge read when
scraped: counts of batches are counts of ledger batches now (a rewind or a rebuilt ledger can
lower them), not counters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import UTC, datetime

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from offsetlake.config import PipelineConfig
from offsetlake.plan import LEDGER_OUTCOMES

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "offsetlake_"
# Statuses and outcomes always exported (0 when absent), so an alert rule has a series to watch.
STATUSES = tuple(str(s) for s in LEDGER_OUTCOMES)
OUTCOMES = ("passed", "quarantined", "failed")


def _gauge(name: str, documentation: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, documentation, labels=labels)


class _Pipelines:
    """A collector over the pipelines' ``pipeline_metrics``, read once per scrape."""

    def __init__(self, names: list[str], load: Callable[[str], PipelineConfig]) -> None:
        self.names, self.load = names, load

    def collect(self) -> Iterator[Metric]:
        from offsetlake.ledger_view import pipeline_metrics

        families = _Families()
        now = datetime.now(UTC)
        for name in self.names:
            try:
                m = pipeline_metrics(self.load(name))
            except Exception:
                families.up.add_metric([name], 0)
                continue
            families.add(name, m, now)
        yield from families.all()


class _Families:
    """The metric families offsetlake exports, filled pipeline by pipeline."""

    def __init__(self) -> None:
        self.up = _gauge("pipeline_up", "1 if the pipeline's sink, ledger and lease could be read", ["pipeline"])
        self.kafka_up = _gauge("kafka_up", "1 if the broker answered for the pipeline's partitions", ["pipeline"])
        self.lag = _gauge(
            "lag_records",
            "Last stable offset minus committed end: records in Kafka not yet in the sink",
            ["pipeline", "topic", "partition"],
        )
        self.committed = _gauge(
            "committed_end_offset", "Exclusive end offset committed to the sink (its Delta txn version)", ["pipeline", "topic", "partition"]
        )
        self.lso = _gauge(
            "last_stable_offset", "The partition's last stable offset (what read_committed can read)", ["pipeline", "topic", "partition"]
        )
        self.lost = _gauge(
            "offsets_lost",
            "1 if offsets above the committed end are gone from Kafka (retention, deletes)",
            ["pipeline", "topic", "partition"],
        )
        self.last_commit = _gauge("last_commit_timestamp_seconds", "When the last batch committed (Unix time)", ["pipeline"])
        self.since = _gauge("seconds_since_last_commit", "Seconds since the last batch committed", ["pipeline"])
        self.records = _gauge("last_batch_records", "Records read by the latest batch", ["pipeline", "kind", "status"])
        self.rows = _gauge("last_batch_rows", "Rows written by the latest batch", ["pipeline", "kind", "status"])
        self.dead = _gauge("last_batch_dead_letters", "Dead letters of the latest batch", ["pipeline", "kind", "status"])
        self.duration = _gauge("last_batch_duration_seconds", "Duration of the latest batch", ["pipeline", "kind", "status"])
        self.batches = _gauge("batches", "Ledger batches by their final status", ["pipeline", "status"])
        self.validated = _gauge(
            "validated_batches",
            "Ledger batches by validation outcome (quarantined: failing records went to dead letters)",
            ["pipeline", "outcome"],
        )
        self.lease = _gauge("stream_lease_live", "1 while a live stream owns the pipeline, with its owner", ["pipeline", "owner"])

    def all(self) -> tuple[GaugeMetricFamily, ...]:
        return (
            self.up,
            self.kafka_up,
            self.lag,
            self.committed,
            self.lso,
            self.lost,
            self.last_commit,
            self.since,
            self.records,
            self.rows,
            self.dead,
            self.duration,
            self.batches,
            self.validated,
            self.lease,
        )

    def add(self, name: str, m: dict, now: datetime) -> None:
        """One pipeline's figures (``ledger_view.pipeline_metrics``) as samples."""
        self.up.add_metric([name], 1)
        self.kafka_up.add_metric([name], 0 if m["kafka_error"] else 1)
        for p in m["partitions"]:
            labels = [name, p["topic"], str(p["partition"])]
            self.lag.add_metric(labels, p["lag"])
            self.lso.add_metric(labels, p["last_stable"])
            self.lost.add_metric(labels, 1 if p["lost"] else 0)
            if p["committed_end"] is not None:
                self.committed.add_metric(labels, p["committed_end"])
        if m["last_commit_at"]:
            at = datetime.fromisoformat(m["last_commit_at"])
            self.last_commit.add_metric([name], at.timestamp())
            self.since.add_metric([name], max((now - at).total_seconds(), 0.0))
        if m["last_batch"]:
            b = m["last_batch"]
            labels = [name, b["kind"], b["status"]]
            self.records.add_metric(labels, b["records"])
            self.rows.add_metric(labels, b["rows"])
            self.dead.add_metric(labels, b["dead_letters"])
            if b["duration_ms"] is not None:
                self.duration.add_metric(labels, b["duration_ms"] / 1000)
        for status in sorted({*STATUSES, *m["batches_by_status"]}):
            self.batches.add_metric([name, status], m["batches_by_status"].get(status, 0))
        for outcome in sorted({*OUTCOMES, *m["batches_by_validation"]}):
            self.validated.add_metric([name, outcome], m["batches_by_validation"].get(outcome, 0))
        held = m["stream_lease"]
        self.lease.add_metric([name, held["owner"] if held else ""], 1 if held and held["live"] else 0)


def prometheus_text(names: list[str], load: Callable[[str], PipelineConfig]) -> bytes:
    """The exposition text of the named pipelines' metrics."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Pipelines(names, load))
    return generate_latest(registry)
