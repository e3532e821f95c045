"""An independent check that the sink is exactly once and agrees with its ledger — and with Kafka.

``audit_pipeline`` reads only Delta (sink, dead letters, ledger) through delta-rs and pyarrow,
so it is a quick check on a laptop. Exactly once is checked per source record and per row: a
record is a sink row (or, with a transform, rows — each ``(record, _kafka_row)`` once) or a
dead letter, never both, never twice; committed ranges are contiguous; every row and dead letter
lies in a committed range; each batch's range holds the rows and dead letters its entry says it
wrote (append sinks); the sink's txn versions equal the ledger's ends. Dead-letter changes a
crash left pending after their sink commit are counted as the next run will apply them.

``against_kafka=True`` also reads the committed ranges back from Kafka with its own
read_committed consumer and checks that every committed record Kafka still holds is in exactly
one of the sink, the dead letters or a recorded gap, and that nothing else is: a row or dead
letter at an offset Kafka does not serve (an aborted record, a transaction marker) is a problem,
and so is a record in neither table. Offsets past retention are reported, not checked. With a
transform, a record without rows may have been filtered on purpose: those records (only those)
are decoded and transformed again on Spark, and the ones that do give rows are lost.

The package holds one audit per kind of sink and the checks they share: ``delta`` (a Delta
sink), ``kafka_sink`` (a Kafka sink read back from Kafka), ``keyed`` (keys once, rows replayed
from Kafka by the ordering rule or the merge engine), ``against_kafka`` (the committed ranges read
back) and ``report`` (``AuditReport``).
"""

from __future__ import annotations

from offsetlake.audit.delta import audit_delta_sink
from offsetlake.audit.kafka_sink import audit_kafka_sink
from offsetlake.audit.report import AUDIT, AuditReport
from offsetlake.config import PipelineConfig
from offsetlake.config.sink_kinds import sink_kind

__all__ = ["AuditReport", "audit_delta_sink", "audit_kafka_sink", "audit_pipeline"]


def audit_pipeline(config: PipelineConfig, against_kafka: bool = False) -> AuditReport:
    """The independent check (``offsetlake audit``): reads the sink, its history, the dead letters
    and the ledger (and Kafka with ``against_kafka``) and reports every problem it finds; it
    changes nothing. Each kind of sink provides its audit: a Delta table's (``audit_delta_sink``),
    a Kafka topic read back from its topics, always against Kafka (``audit_kafka_sink``)."""
    return sink_kind(config).implementation(AUDIT).run(config, against_kafka)
