"""``format.envelope: debezium``: Debezium change events become rows and deletes.

A Debezium value is an envelope: ``op`` (``c`` create, ``r`` snapshot read, ``u`` update, ``d``
delete), the row ``before`` and ``after`` the change, and ``source`` (``ts_ms``, and ``lsn`` for
Postgres). ``EnvelopeDecoder`` wraps the format's own decoder (JSON with the row declared in the
YAML, or Avro / Protobuf / JSON Schema through the registry, whose schema is the envelope) and
turns each event into the row the table keeps:

* ``c``/``r``/``u``: the ``after`` row, an upsert;
* ``d``: the ``before`` row (its key columns say which row goes), a delete (``formats.CHANGE``);
* a tombstone (null value, which Debezium sends after each delete so Kafka compaction can drop
  the key): nothing at all, a skip;
* plus ``_cdc_op``, ``_cdc_ts_ms`` (``source.ts_ms``, when the database made the change) and
  ``_cdc_lsn`` (``source.lsn``, null where the connector has none) as columns.

A value that does not decode keeps its format's reason; an envelope that is not one (no ``op``,
an ``op`` other than c/r/u/d, a create or update without ``after``, a delete without
``before``) is a dead letter naming what is wrong. In an append sink the events are a change
log (a delete is a row with ``_cdc_op = d``); in an upsert sink they converge to the table.
JSON events may come with Kafka Connect's schema wrapper (``{"schema": ..., "payload": {...}}``,
the JsonConverter's default) or without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pyarrow as pa

from offsetlake.formats import CHANGE, DELETE, PARSED, REASON, SKIP, TOMBSTONE, UPSERT, DecodedChunk, Decoder, reasons

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

    from offsetlake.config import JsonFormat

OP, SOURCE_TS, LSN = "_cdc_op", "_cdc_ts_ms", "_cdc_lsn"
CDC_COLUMNS = (OP, SOURCE_TS, LSN)
_ENVELOPE = ("before", "after", "op", "source")


def envelope_json_format(row: JsonFormat) -> JsonFormat:
    """The JSON format of a Debezium event whose row is ``row`` (the YAML's schema): before and
    after as that row, op, ts_ms, source.ts_ms and source.lsn, with or without the ``payload``
    wrapper. ``required`` stays the row's (checked on the row the event keeps)."""
    from offsetlake.config import JsonFormat

    struct = "struct<" + ", ".join(f"`{name}`: {kind}" for name, kind in row.schema_.items()) + ">"
    event = {"before": struct, "after": struct, "op": "string", "ts_ms": "long", "source": "struct<ts_ms: long, lsn: long>"}
    inner = "struct<" + ", ".join(f"{name}: {kind}" for name, kind in event.items()) + ">"
    return JsonFormat.model_construct(type="json", schema_={**event, "payload": inner}, required=[], envelope=None)


class EnvelopeDecoder:
    """A value decoder whose values are Debezium envelopes, giving the rows they carry."""

    rows_in_read = False

    def __init__(self, inner: Decoder, row_fields: list[str], required: list[str], where: str, delete_needs_before: bool = True) -> None:
        self.inner = inner
        self.row_fields = row_fields
        self.required = required
        self.where = where
        # False for a keyed sink whose key comes from the record key: a delete then needs no before
        self.delete_needs_before = delete_needs_before

    @staticmethod
    def row_fields_of(inner: Decoder, where: str) -> list[str]:
        """The row's fields from an envelope schema (the fields of ``after``); ConfigError if the
        schema is not a Debezium envelope."""
        from offsetlake.errors import ConfigError

        read_type = inner.read_type()
        names = inner.fields()
        missing = [n for n in _ENVELOPE if n not in names]
        if missing or read_type is None:
            raise ConfigError(
                f"{where}: format.envelope is debezium but the value schema has no "
                f"{', '.join(missing) or 'decodable'} field{'s' if len(missing) > 1 else ''}; a Debezium "
                f"envelope has before, after, op and source (its fields: {', '.join(names)})"
            )
        after = read_type.field("after").type
        if not pa.types.is_struct(after):
            raise ConfigError(f"{where}: format.envelope is debezium but 'after' is {after}, not a record")
        return [after.field(i).name for i in range(after.num_fields)]

    def fields(self) -> list[str]:
        return [*self.row_fields, *CDC_COLUMNS]

    def read_type(self) -> pa.StructType | None:
        return self.inner.read_type()

    def decode_chunk(self, values: list[bytes | None]) -> DecodedChunk:
        return self.inner.decode_chunk(values)

    def check_types(self, where: str) -> None:
        self.inner.check_types(where)

    def decode_in_spark(self, raw: DataFrame) -> DataFrame:
        from pyspark.sql import functions as F

        decoded = self.inner.decode_in_spark(raw)
        names = set(self.inner.fields())

        def part(name: str) -> Column:
            own = F.col(f"{PARSED}.`{name}`")
            if "payload" in names:  # Kafka Connect's JsonConverter with schemas: {schema, payload}
                return F.coalesce(F.col(f"{PARSED}.payload.`{name}`"), own)
            return own

        def source(name: str) -> Column:
            source_type = _source_fields(decoded)
            if name not in source_type:
                return F.lit(None).cast("long")
            value = part("source").getField(name)
            return value.cast("long")

        op = part("op")
        before, after = part("before"), part("after")
        tombstone = F.col("value").isNull()
        if "read_problem" in decoded.columns:  # a read task may have called the tombstone a dead letter
            decoded = decoded.withColumn(
                "read_problem", F.when(tombstone & (F.col("read_problem") == TOMBSTONE), F.lit(None)).otherwise(F.col("read_problem"))
            )
            decoded = decoded.withColumn(REASON, F.when(tombstone, F.lit(TOMBSTONE)).otherwise(F.col(REASON)))
        row = F.when(op == "d", before).otherwise(after)
        problem = self._envelope_problem(op, before, after, row)
        out = decoded.withColumn("_row", row).withColumn(OP, op)
        return out.select(
            *[c for c in decoded.columns if c not in (PARSED, REASON, CHANGE)],
            F.struct(
                *[F.col(f"_row.`{n}`").alias(n) for n in self.row_fields],
                F.col(OP).alias(OP),
                source("ts_ms").alias(SOURCE_TS),
                source("lsn").alias(LSN),
            ).alias(PARSED),
            F.when(tombstone & (F.col(REASON) == TOMBSTONE), F.lit(None)).otherwise(problem).alias(REASON),
            F.when(tombstone & (F.col(REASON) == TOMBSTONE), F.lit(SKIP))
            .when(op == "d", F.lit(DELETE))
            .otherwise(F.lit(UPSERT))
            .alias(CHANGE),
        )

    def _envelope_problem(self, op: Column, before: Column, after: Column, row: Column) -> Column:
        """Why a change event is a dead letter: the read's reason, else what is wrong with its
        envelope (op, before, after) or a required field the row lacks; null when nothing is."""
        from pyspark.sql import functions as F

        problem = (
            F.when(F.col(REASON).isNotNull(), F.col(REASON))
            .when(op.isNull(), F.lit(reasons.envelope("no op (not a change event)")))
            .when(
                ~op.isin("c", "r", "u", "d"),
                reasons.coded("envelope", F.concat(F.lit("debezium envelope: op '"), op, F.lit("' is not c, r, u or d"))),
            )
            .when(
                op.isin("c", "r", "u") & after.isNull(),
                reasons.coded("envelope", F.concat(F.lit("debezium envelope: op '"), op, F.lit("' without after"))),
            )
            .when(
                (op == "d") & before.isNull() & F.lit(self.delete_needs_before),
                F.lit(reasons.envelope("op 'd' without before (the table's REPLICA IDENTITY gives no key)")),
            )
        )
        for name in self.required:
            problem = problem.when(op.isin("c", "r", "u") & row.getField(name).isNull(), F.lit(reasons.required_missing(name, " in after")))
        return problem


def _source_fields(decoded: DataFrame) -> set[str]:
    from pyspark.sql.types import StructType

    parsed = decoded.schema[PARSED].dataType
    assert isinstance(parsed, StructType)
    names: set[str] = set()
    for holder in ("payload", None):
        struct = parsed
        if holder is not None:
            if holder not in parsed.fieldNames():
                continue
            inner = parsed[holder].dataType
            if not isinstance(inner, StructType):
                continue
            struct = inner
        if "source" in struct.fieldNames() and isinstance(struct["source"].dataType, StructType):
            names |= set(struct["source"].dataType.fieldNames())
    return names
