"""The merge engines' batch states (``offsetlake.state_segments``) against the contributions they
stand for: a backfill folds a batch state instead of its contribution files, so a batch state that
is not their exact fold makes a wrong group with nothing else to show it. Every batch state a
backfill could take (each file it names live in the pinned state, none with a deletion vector) is
compared, group by group, with the fold of the contribution files it names, in Arrow
(``engine_arrow.ArrowEngine.fold``) from the files as they are, not from the read tasks' fold
that wrote it. Delta only: nothing is read from Kafka."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from offsetlake import engine_arrow, state_segments, state_table, storage
from offsetlake.config import PipelineConfig
from offsetlake.engines import STATE, group_columns
from offsetlake.schema_evolution import table_schema
from offsetlake.sink import live_files
from offsetlake.staging import read_table

if TYPE_CHECKING:
    from deltalake import DeltaTable

from offsetlake.audit.report import _SHOW, AuditReport


def check_batch_states(config: PipelineConfig, sink: DeltaTable | None, report: AuditReport) -> None:
    """Each usable batch state equals the fold of its contribution files (module docstring);
    ``report.batch_states`` says how many were compared."""
    if not config.sink.folds_in_read:
        return
    state = state_table.pinned(config, sink)
    if state is None:
        return
    root = state_table.location(config)
    files = {storage.file_path_from_log(f["path"]): f for f in live_files(state)}
    offered = set(state_segments.file_paths(list(files.values())))
    schema = table_schema(state)
    group = group_columns(config)
    wrong: list[str] = []
    for segment in state_segments.listed(root):
        if not segment.files <= offered:
            continue  # a stale batch state (a file of it replaced or removed): never used
        held = state_segments.rows_of(root, segment)
        if held is None:
            continue  # unreadable: a backfill reads its files instead
        engine = engine_arrow.ArrowEngine.of(config, schema, held.schema)
        try:
            contributions = read_table(root, [files[f] for f in sorted(segment.files)], schema, [])
            folded = engine.fold(contributions.select([*group, STATE]).cast(held.schema))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, KeyError):
            continue  # of an earlier schema than its files (a column added since): a backfill does not read it
        report.batch_states += 1
        wrong += _differences(segment, group, engine.fold(held), folded)
    report.problems.extend(wrong[:_SHOW])
    if len(wrong) > _SHOW:
        report.problems.append(f"... {len(wrong) - _SHOW} more groups where a batch state differs from its contribution files")


def _differences(segment: state_segments.Segment, group: list[str], held: pa.Table, folded: pa.Table) -> list[str]:
    """What differs between a batch state's groups and the fold of its files, group by group."""

    def by_group(table: pa.Table) -> dict[tuple, Any]:
        return {tuple(r[c] for c in group): r[STATE] for r in table.to_pylist()}

    have, want = by_group(held), by_group(folded)
    where = f"batch state {segment.path} (of {len(segment.files)} contribution files)"
    out = []
    for key in sorted(have.keys() | want.keys(), key=repr):
        if key not in want:
            out.append(f"{where}: group {key!r} is in it but in none of its files")
        elif key not in have:
            out.append(f"{where}: group {key!r} of its files is missing from it")
        elif not _same(have[key], want[key]):
            out.append(f"{where}: group {key!r} holds {have[key]!r}, the fold of its files gives {want[key]!r}")
    return out


def _same(a: object, b: object) -> bool:
    """Equal states, floats within the rounding another summation order gives, NaN equal to NaN."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9) or (a != a and b != b)
    return a == b
