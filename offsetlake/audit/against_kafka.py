"""The committed ranges read back from Kafka with the audit's own read_committed consumer: every
record Kafka still holds is in exactly one of the sink, the dead letters or a recorded gap."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from offsetlake.config import PipelineConfig
from offsetlake.coordinates import OFFSET, PARTITION, TOPIC
from offsetlake.kafka import current_offsets, read_range
from offsetlake.schema_evolution import sink_columns
from offsetlake.sink import open_table

if TYPE_CHECKING:
    pass
from offsetlake.audit.report import AuditReport


# ---- against Kafka ----------------------------------------------------------------------------
def _check_against_kafka(
    config: PipelineConfig,
    report: AuditReport,
    records: pa.Table,
    dead: pa.Table,
    covered: dict[tuple[str, int], list[tuple[int, int]]],
    gaps: dict[tuple[str, int], list[tuple[int, int]]],
    deleted: dict[tuple[str, int], set[int]],
) -> None:
    """Every committed record Kafka still holds is in exactly one of sink, dead letters or a gap,
    or its rows were deleted by a commit offsetlake did not make (``deleted``: counted, not lost)."""
    found = {"records": 0, "in_sink": 0, "dead_letters": 0, "in_gaps": 0, "filtered": 0, "past_retention": 0, "deleted_by_others": 0}
    report.against_kafka = found
    offsets = current_offsets(config)
    in_sink = _group_offsets(records)
    in_dead = _group_offsets(dead)
    unaccounted: list[tuple[str, int, list]] = []  # (topic, partition, raw messages) of records in neither table
    client = config.kafka_client_config()
    for (topic, partition), spans in sorted(covered.items()):
        if (topic, partition) not in offsets:
            report.problems.append(f"{topic}[{partition}] has committed ranges but is not a partition of {config.topic_label} any more")
            continue
        log_start = offsets[(topic, partition)].log_start
        sink_set = set(in_sink.get((topic, partition), np.array([], np.int64)).tolist())
        dead_set = set(in_dead.get((topic, partition), np.array([], np.int64)).tolist())
        spans_read = _retained(spans, log_start, found)
        served, missing = _read_back(config, client, (topic, partition), spans_read, sink_set, dead_set, deleted, found)
        found["records"] += len(served)
        retained = [(max(s, log_start), e) for s, e in _merged(spans) if e > log_start]
        phantoms = sorted(o for o in sink_set | dead_set if _inside(o, retained) and o not in served)
        if phantoms:
            report.problems.append(
                f"{len(phantoms)} rows or dead letters of {topic}[{partition}] are at offsets Kafka does not serve to "
                f"read_committed (aborted records or transaction markers), e.g. {phantoms[:5]}"
            )
        for start, end in gaps.get((topic, partition), []):
            found["in_gaps"] += max(0, end - max(start, log_start)) if end > log_start else 0
        if missing:
            unaccounted.append((topic, partition, missing))
    lost = _lost_records(config, unaccounted, found)
    for topic, partition, offsets_lost in lost:
        report.problems.append(
            f"{len(offsets_lost)} committed records of {topic}[{partition}] that Kafka holds are in neither the sink "
            f"nor the dead letters nor a recorded gap, e.g. offsets {offsets_lost[:5]}"
        )


def _read_back(
    config: PipelineConfig,
    client: dict[str, str],
    key: tuple[str, int],
    spans: list[tuple[int, int]],
    sink_set: set[int],
    dead_set: set[int],
    deleted: dict[tuple[str, int], set[int]],
    found: dict[str, int],
) -> tuple[set[int], list]:
    """The offsets Kafka serves in ``spans`` of one partition, and its records that are neither a
    row nor a dead letter nor deleted by another writer; ``found`` counts where each one is."""
    served: set[int] = set()
    missing: list = []
    # one read per run of adjacent ranges: a read that ends on a transaction marker waits for the
    # consumer's poll timeout, so reading range by range got slower with every batch
    for start, end in spans:
        for chunk in read_range(client, config.name, key[0], key[1], start, end, config.read_timeout_seconds):
            for message in chunk:
                offset = int(message.offset() or 0)  # always set on a consumed record
                served.add(offset)
                as_row, as_dead = offset in sink_set, offset in dead_set
                found["in_sink"] += as_row
                found["dead_letters"] += as_dead
                if not as_row and not as_dead:
                    if offset in deleted.get(key, ()):
                        found["deleted_by_others"] += 1
                    else:
                        missing.append(message)
    return served, missing


def _lost_records(config: PipelineConfig, unaccounted: list[tuple[str, int, list]], found: dict) -> list[tuple[str, int, list[int]]]:
    """The records of ``unaccounted`` that should have become rows or dead letters of this table:
    all of them without a transform or routes; with one, those its decode, transform and route
    (``offsetlake.routing``) still turn into rows or dead letters here."""
    if not unaccounted:
        return []
    if not config.transform and not config.routed_by_column:
        return [(t, p, sorted(m.offset() for m in messages)) for t, p, messages in unaccounted]
    from pyspark.sql import functions as F

    from offsetlake import routing
    from offsetlake.formats import CHANGE, REASON, decoder_for, good_rows
    from offsetlake.reader import raw_dataframe
    from offsetlake.spark import spark_session
    from offsetlake.transform import apply_transform

    spark = spark_session()
    decoder = decoder_for(config, sink_columns=sink_columns(open_table(config.layout.sink)))
    decoded = decoder.decode_in_spark(raw_dataframe(spark, unaccounted, decoder, max_record_bytes=config.max_record_bytes))
    decoded = decoded.withColumn(REASON, F.coalesce(F.col("read_problem"), F.col(REASON))).persist()
    should_be_dead = (
        {
            (r["topic"], r["partition"], r["offset"])
            for r in decoded.where(F.col(REASON).isNotNull()).select("topic", "partition", "offset").collect()
        }
        if routing.owns_the_rest(config)
        else set()
    )
    rows = good_rows(decoded, decoder)
    if not config.sink.keyed and CHANGE in rows.columns:
        rows = rows.drop(CHANGE)
    rows = routing.rows_of_route(config, apply_transform(rows, config))
    with_rows = {(r[TOPIC], r[PARTITION], r[OFFSET]) for r in rows.select(TOPIC, PARTITION, OFFSET).distinct().collect()}
    decoded.unpersist()
    lost = []
    for topic, partition, messages in unaccounted:
        offsets = sorted(m.offset() for m in messages if (topic, partition, m.offset()) in should_be_dead | with_rows)
        found["filtered"] += len(messages) - len(offsets)
        if offsets:
            lost.append((topic, partition, offsets))
    return lost


def _retained(spans: list[tuple[int, int]], log_start: int, found: dict) -> list[tuple[int, int]]:
    """``spans`` merged (one read per run of adjacent ranges) and cut at the log start; the offsets
    cut off are counted in ``found["past_retention"]`` (reported, not checked)."""
    out = []
    for start, end in _merged(spans):
        if end <= log_start:
            found["past_retention"] += end - start
            continue
        if start < log_start:
            found["past_retention"] += log_start - start
            start = log_start
        out.append((start, end))
    return out


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Ranges with adjacent or overlapping ones joined."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _inside(offset: int, spans: list[tuple[int, int]]) -> bool:
    return any(s <= offset < e for s, e in spans)


def _outside(offsets: np.ndarray, spans: list[tuple[int, int]]) -> list[int]:
    if not spans:
        return offsets.tolist()
    spans = sorted(spans)
    starts = np.array([s for s, _ in spans])
    ends = np.array([e for _, e in spans])
    index = np.searchsorted(starts, offsets, side="right") - 1
    inside = (index >= 0) & (offsets < ends[np.clip(index, 0, None)])
    return offsets[~inside].tolist()


def _group_offsets(table: pa.Table, more: list[str] | None = None) -> dict[tuple, np.ndarray]:
    """Offsets of ``table`` per (topic, partition, *more)."""
    if table.num_rows == 0:
        return {}
    columns = [TOPIC, PARTITION, *(more or [])]
    out: dict[tuple, np.ndarray] = {}
    for key in table.group_by(columns).aggregate([]).to_pylist():
        mask = pc.and_(pc.equal(table[TOPIC], key[TOPIC]), pc.equal(table[PARTITION], key[PARTITION]))
        for column in more or []:
            mask = pc.and_(mask, pc.equal(table[column], key[column]))
        out[tuple(key[c] for c in columns)] = table.filter(mask)[OFFSET].to_numpy()
    return out
