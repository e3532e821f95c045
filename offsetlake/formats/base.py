"""The vocabulary every record format shares, and the registry of formats.

A decoder turns the values of one consumed chunk into Arrow columns inside the Spark read task
(``decode_chunk``, never record by record in the driver), and finishes in Spark whatever the read
task left undecided (``decode_in_spark``), producing the struct column ``PARSED`` and the column
``REASON``: null for a good record, the dead-letter reason otherwise (invariant 8: nothing is
dropped; ``formats.reasons`` makes each reason with its code).

Each format module registers itself (``register_format``): its ``format.type`` name, how a new
plan resolves its reader schema (invariant 12), and how it builds the decoder of a plan's reader
schema. ``format_named`` finds it; ``offsetlake.formats`` dispatches through it, so a new format is
a new module and one name in ``FORMAT_MODULES``, not another branch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import pyarrow as pa

from offsetlake.formats import reasons

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from offsetlake.config import PipelineConfig
    from offsetlake.plan import ReaderSchema

REASON = "_dead_letter_reason"  # null for a good record, else why it is a dead letter (``formats.reasons``)
PARSED = "_parsed"  # the decoded value: a struct of the format's fields
PARSED_IN_READ = "_parsed_in_read"  # what the read task decoded (null: left to Spark)
TOMBSTONE = reasons.TOMBSTONE  # the dead-letter reason of a null value
# What a good record does to a keyed sink (``offsetlake.keyed``): null (or "upsert") writes its
# row, "delete" removes its key's row, "skip" does nothing (a Debezium tombstone after a delete).
# Set by an envelope decoder or by ``keyed.mark_tombstones``; never a sink column.
CHANGE = "_offsetlake_change"
UPSERT, DELETE, SKIP = "upsert", "delete", "skip"


@dataclass(frozen=True)
class DecodedChunk:
    """What a read task decided about one chunk's values.

    ``parsed``: the decoded values (``read_type()``), null where the task left a record to
    ``decode_in_spark``; None when the decoder decodes nothing in the tasks. ``problems``: per
    record, the dead-letter reason the task already knows (null: none), or None for no problem.
    """

    parsed: pa.StructArray | None
    problems: list[str | None] | None
    settled: list[bool] | None = None  # per record: certainly a row (decoded, required fields present)


class Decoder(Protocol):
    """One pipeline's record format."""

    @property
    def rows_in_read(self) -> bool:
        """True when a record ``decode_chunk`` settled is a row made of exactly what the read task
        decoded (``decode_in_spark`` adds nothing to it): the read tasks may then write it
        themselves (``offsetlake.direct``)."""
        ...

    def fields(self) -> list[str]:
        """The sink columns a decoded value gives, in order."""
        ...

    def read_type(self) -> pa.StructType | None:
        """The Arrow type of the values ``decode_chunk`` decodes, or None when it decodes none
        (it may still find problems)."""
        ...

    def decode_chunk(self, values: list[bytes | None]) -> DecodedChunk:
        """Runs in the read task, for one chunk: decoded values and per-record problems."""
        ...

    def decode_in_spark(self, raw: DataFrame) -> DataFrame:
        """``raw`` (the read columns, with PARSED_IN_READ if ``read_type``) plus PARSED and REASON."""
        ...

    def check_types(self, where: str) -> None:
        """Before a batch reads: the format's types through Spark's own parser (ConfigError if not)."""
        ...


@dataclass(frozen=True)
class Format:
    """One value format (``format.type``), as its module registers it.

    ``reader_schema``: the reader schema a new plan records (raises ConfigError or
    SchemaRegistryUnavailableError before anything is read). ``decoder``: the decoder of the rows
    of ``reader_schema``. ``envelope``: the decoder of Debezium envelopes carrying such rows
    (``format.envelope: debezium``), given where the pipeline is defined and whether a delete needs
    its ``before`` row; None wraps ``decoder``'s rows (``debezium.EnvelopeDecoder.row_fields_of``).
    """

    name: str
    reader_schema: Callable[[PipelineConfig], ReaderSchema]
    decoder: Callable[[PipelineConfig, ReaderSchema], Decoder]
    envelope: Callable[[PipelineConfig, ReaderSchema, str, Callable[[list[str]], bool]], Decoder] | None = None


# the modules that register formats, imported when a format is first asked for (not before: they
# bring fastavro, protobuf and jsonschema with them)
FORMAT_MODULES = ("json_records", "avro_records", "json_schema_records", "protobuf_records")
FORMATS: dict[str, Format] = {}


def register_format(fmt: Format) -> None:
    """Called by a format module when it is imported: ``fmt`` is the format named ``fmt.name``."""
    FORMATS[fmt.name] = fmt


def format_named(name: str) -> Format:
    """The registered format of ``format.type`` ``name`` (the config's models admit only known
    names; an unknown one here is a format module missing from ``FORMAT_MODULES``: KeyError)."""
    if name not in FORMATS:
        for module in FORMAT_MODULES:
            importlib.import_module(f"offsetlake.formats.{module}")
    return FORMATS[name]
