"""How a sink's schema takes a batch's (invariant 12): new columns and nested fields are added
(nullable), a changed type or a required field the batch lacks is refused naming the field, both
types and the reader schemas involved, and ``on_schema_change: fail`` refuses any change. Read
only: ``sink.add_columns_first`` and the batch's commit write what ``evolved_schema`` returns."""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa
from deltalake import DeltaTable

from offsetlake.config import KEY_COLUMN, PipelineConfig
from offsetlake.errors import SchemaChangeError
from offsetlake.history import sink_commits
from offsetlake.plan import BatchPlan


def sink_columns(table: DeltaTable | None) -> set[str] | None:
    """The sink's column names, None when it does not exist yet (what an unset key_format looks at)."""
    return None if table is None else set(table_schema(table).names)


def table_schema(table: DeltaTable) -> pa.Schema:
    return pa.schema(table.schema().to_arrow())


def evolved_schema(table: DeltaTable, config: PipelineConfig, rows: pa.Schema, plan: BatchPlan) -> pa.Schema | None:
    """The sink's schema with the batch's new fields (nullable) added, or None if it has none
    (invariant 12): a new column, or a new field inside a struct at any depth (in arrays of
    structs and map values too), which Delta adds in place. A column or nested field the batch no
    longer has stays; its new rows read null.

    Raises SchemaChangeError, naming the column or nested field (``addr.city``,
    ``lines.element.qty``, ``extras.value.b``), both types and the reader schemas involved, for a
    type that differs from the sink's (Delta cannot take that in place and nothing is ever cast
    silently), for a nested field the sink holds as required (not null) that the batch lacks, and
    under ``on_schema_change: fail`` for any added or missing column or nested field.
    """
    diff = schema_diff(table_schema(table), rows)
    if diff.changed:
        path, old_type, new_type = diff.changed[0]
        more = f" ({len(diff.changed) - 1} more changed)" if len(diff.changed) > 1 else ""
        schemas = _schemas_involved(table, config, plan)  # the history is read only to explain a refusal
        what = "nested field" if len(path) > 1 else "column"
        raise SchemaChangeError(
            f"batch {plan.batch_id} writes {what} '{dotted(path)}' as {new_type}, but the sink "
            f"{config.sink_path} holds it as {old_type}{more}{schemas}; Delta cannot change a {what}'s type in place and "
            "offsetlake never casts silently. Nothing was committed. Ways forward: a new sink table (sink.table), or a "
            f"transform that casts the {what} back to the sink's type",
            pipeline=config.name,
            batch_id=plan.batch_id,
            field=dotted(path),
        )
    if diff.required_missing:
        raise SchemaChangeError(
            f"batch {plan.batch_id} has no {_listed('nested field', diff.required_missing)}, "
            f"which the sink {config.sink_path} holds as required (not null){_schemas_involved(table, config, plan)}; "
            "its rows could not be read back. Nothing was committed. Ways forward: keep the field in the schema, or a "
            "new sink table (sink.table)",
            pipeline=config.name,
            batch_id=plan.batch_id,
            field=dotted(diff.required_missing[0]),
        )
    if config.on_schema_change == "fail" and (diff.added or diff.missing):
        raise _refused_change(table, config, plan, diff)
    return diff.merged if diff.added else None


def _refused_change(table: DeltaTable, config: PipelineConfig, plan: BatchPlan, diff: SchemaDiff) -> SchemaChangeError:
    """The error of a batch that adds or drops a column or nested field under ``on_schema_change: fail``."""
    schemas = _schemas_involved(table, config, plan)
    what = "; ".join(
        part
        for part in (
            _listed("new column", [p for p in diff.added if len(p) == 1]),
            _listed("new nested field", [p for p in diff.added if len(p) > 1]),
            _listed("no column", [p for p in diff.missing if len(p) == 1], " any more"),
            _listed("no nested field", [p for p in diff.missing if len(p) > 1], " any more"),
        )
        if part
    )
    return SchemaChangeError(
        f"batch {plan.batch_id} changes the sink {config.sink_path}'s schema ({what}){schemas}, "
        "and on_schema_change is fail. Nothing was committed. Ways forward: on_schema_change: evolve (a new column "
        "or nested field is added in the batch's own commit), pin format.version to the schema the sink has, or a "
        "new sink table"
        + (
            f"; {KEY_COLUMN} is the record key (key_format, string unless set): key_format: none keeps the sink without it"
            if (KEY_COLUMN,) in diff.added
            else ""
        ),
        pipeline=config.name,
        batch_id=plan.batch_id,
        field=dotted([*diff.added, *diff.missing][0]),
    )


def dotted(path: tuple[str, ...]) -> str:
    return ".".join(path)


def _listed(label: str, paths: list[tuple[str, ...]], tail: str = "") -> str:
    """ "new columns 'a', 'b'", or "" for no paths."""
    if not paths:
        return ""
    return f"{label}{'s' if len(paths) > 1 else ''} {', '.join(repr(dotted(p)) for p in paths)}{tail}"


@dataclass
class SchemaDiff:
    """How a batch's rows differ from the sink's schema, field by field. A field is named by its
    path: ``("addr", "zip")``; ``("lines", "element", "qty")`` inside an array of structs;
    ``("extras", "value", "b")`` inside a map's values (Delta's names for them, dotted)."""

    merged: pa.Schema  # the sink's schema with the rows' new fields appended (nullable) where they belong
    added: list[tuple[str, ...]] = field(default_factory=list)
    missing: list[tuple[str, ...]] = field(default_factory=list)  # the sink's, absent from the rows: kept, rows read null
    required_missing: list[tuple[str, ...]] = field(default_factory=list)  # missing nested fields the sink holds not null
    changed: list[tuple[tuple[str, ...], pa.DataType, pa.DataType]] = field(default_factory=list)  # path, sink's, rows'


def schema_diff(sink: pa.Schema, rows: pa.Schema) -> SchemaDiff:
    """Compare ``rows`` with ``sink`` by name at every depth (Delta, Spark and pyarrow resolve
    struct fields by name, so a different order is no change). The merged schema keeps the sink's
    fields, types and order and appends each new field at the end of its struct, as Delta's own
    schema merge does."""
    diff = SchemaDiff(merged=sink)
    merged = _merged_struct((), pa.struct(list(sink)), pa.struct(list(rows)), diff)
    diff.merged = pa.schema(list(merged), metadata=sink.metadata)
    return diff


def _merged_type(path: tuple[str, ...], old: pa.DataType, new: pa.DataType, diff: SchemaDiff) -> pa.DataType:
    if pa.types.is_struct(old) and pa.types.is_struct(new):
        return _merged_struct(path, old, new, diff)
    if _is_list(old) and _is_list(new):
        element = old.value_field.with_type(_merged_type((*path, "element"), old.value_type, new.value_type, diff))
        return pa.large_list(element) if pa.types.is_large_list(old) else pa.list_(element)
    if pa.types.is_map(old) and pa.types.is_map(new):
        if not _same_type(old.key_type, new.key_type):
            diff.changed.append(((*path, "key"), old.key_type, new.key_type))
            return old
        value = old.item_field.with_type(_merged_type((*path, "value"), old.item_type, new.item_type, diff))
        return pa.map_(old.key_field, value, keys_sorted=old.keys_sorted)
    if not _same_type(old, new):
        diff.changed.append((path, old, new))
    return old


def _merged_struct(path: tuple[str, ...], old: pa.StructType, new: pa.StructType, diff: SchemaDiff) -> pa.StructType:
    theirs = {f.name: f for f in new}
    fields = []
    for mine in old:
        other = theirs.get(mine.name)
        if other is None:
            diff.missing.append((*path, mine.name))
            if path and not mine.nullable:
                diff.required_missing.append((*path, mine.name))
            fields.append(mine)
        else:
            fields.append(mine.with_type(_merged_type((*path, mine.name), mine.type, other.type, diff)))
    ours = {f.name for f in old}
    for other in new:
        if other.name not in ours:
            diff.added.append((*path, other.name))
            fields.append(pa.field(other.name, other.type, nullable=True))
    return pa.struct(fields)


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def _schemas_involved(table: DeltaTable, config: PipelineConfig, plan: BatchPlan) -> str:
    """ ", reading with <this plan's reader schema>; the sink's last batch read with <its>", or ""."""
    if plan.reader_schema is None:
        return ""
    last = next((c.entry.reader_schema for c in reversed(sink_commits(table, config.name)) if c.entry.reader_schema is not None), None)
    said = f"; this batch reads with {plan.reader_schema.describe()}"
    return said + (f", the sink's last batch read with {last.describe()}" if last is not None else "")


def _same_type(a: pa.DataType, b: pa.DataType) -> bool:
    """Equal as Delta types: string/large_string, list child names and nullability are not
    differences (Delta and Spark name and flag them differently)."""
    return _canonical(a) == _canonical(b)


def _canonical(t: pa.DataType) -> str:
    if pa.types.is_large_string(t) or pa.types.is_string(t):
        return "string"
    if pa.types.is_large_binary(t) or pa.types.is_binary(t):
        return "binary"
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return f"list<{_canonical(t.value_type)}>"
    if pa.types.is_map(t):
        return f"map<{_canonical(t.key_type)},{_canonical(t.item_type)}>"
    if pa.types.is_struct(t):
        return "struct<" + ",".join(f"{t.field(i).name}:{_canonical(t.field(i).type)}" for i in range(t.num_fields)) + ">"
    return str(t)
