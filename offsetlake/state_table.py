"""The state table of a keyed sink: where upsert and the merge engines keep what no reader should
see (docs/design.md, "State beside the sink"; invariants 13, 14 and 17).

A keyed sink's *state* (upsert's last record of each key per topic-partition, its delete
markers; an engine's folded state per group and a contribution per record) lives in its own
Delta table, ``<lake>/_state/<pipeline>``, and the sink table holds only what a reader should
see: one row per live key, one row per group (and window), no private column.

**The sink's commit is the commit point, and it pins the state it was computed from.** A batch
first commits its state (the state files it rewrote and added) to the state table, then makes
its one sink commit (rows, txns, entry, invariant 2) with one more txn action, appId
``STATE_APP_ID``, whose version is that state commit's version. So the state of a sink version
is the state table *at the version the sink pins*, read by time travel (``pinned``); a state
commit no sink commit pins (the process died between the two commits, or lost the sink's race)
is never read, and the next state commit leaves it behind: every state commit sets the table's
live files to exactly "the pinned version's files, minus what the batch replaced, plus what it
wrote" (``commit``), whatever commits came after the pinned one. A rewind moves the pin back with
the partitions' txns; a sink created anew pins nothing, and its state starts empty.

What a reader sees meanwhile: the sink's last commit, always whole; the state table's newest
version may be ahead of it (an unpinned commit), which only offsetlake reads and only by pin.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, PostCommitHookProperties, Transaction
from deltalake.exceptions import CommitFailedError

from offsetlake import staging, storage
from offsetlake.config.sink_settings import DEFAULT_FOLD_AFTER
from offsetlake.errors import BackfillParamsError, CommitConflictError, OffsetlakeError
from offsetlake.schema_evolution import schema_diff, table_schema
from offsetlake.sink import WrittenFiles, add_actions_for, create_table_once, live_files, readd_actions, remove_actions, staging_dir

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from offsetlake.config import PipelineConfig
    from offsetlake.coordinates import OffsetRange, Selection
    from offsetlake.plan import BatchPlan

log = logging.getLogger(__name__)

STATE_APP_ID = "offsetlake-state"  # the sink's txn appId: the state table version the sink version was computed from
# the state table's property: per (topic, topic epoch, partition), the offset below which no record
# keeps a contribution of its own (folded into its group's state, ``engine_merge.fold``); a
# backfill there is refused. Time travel to the pinned version reads the horizon of that state.
FOLDED_BELOW = "offsetlake.foldedBelow"
COMMIT_ATTEMPTS = 5  # a state commit that lost to another writer's is made again on the newer version


def location(config: PipelineConfig) -> storage.Location:
    return config.layout.state


def as_table(config: PipelineConfig) -> PipelineConfig:
    """``config`` with the state table in the sink's place: the merges read and write the state
    table through the very functions that once kept the state in the sink."""
    copied = config.model_copy()
    copied._layout = dataclasses.replace(config.layout, sink=config.layout.state)
    return copied


def pinned_version(sink: DeltaTable | None) -> int | None:
    """The state table version ``sink`` (at its version) was computed from; None: no state yet."""
    return sink.transaction_version(STATE_APP_ID) if sink is not None else None


def pin(version: int) -> Transaction:
    """The sink commit's txn action that pins the state table at ``version``."""
    return Transaction(STATE_APP_ID, version)


def pinned(config: PipelineConfig, sink: DeltaTable | None) -> DeltaTable | None:
    """The state table at the version ``sink`` pins (None: the sink pins none, the state is empty).
    Raises OffsetlakeError when that version cannot be read (the state table was deleted, or its
    log cleaned up below the pin): the state of the sink's rows is gone and nothing can merge."""
    version = pinned_version(sink)
    if version is None:
        return None
    try:
        return storage.table(location(config), version=version)
    except Exception as err:  # delta-rs raises several kinds for a missing table or version
        raise OffsetlakeError(
            f"the sink's rows were computed from version {version} of the state table {location(config)}, which cannot be read "
            f"({str(err).splitlines()[0]}); the keyed state is lost. Rewind to a batch whose state is still there, or move "
            "the sink table aside and ingest from the start again",
            pipeline=config.name,
        ) from None


def state_rows(config: PipelineConfig, sink: DeltaTable | None, columns: list[str] | None = None, filter: Any = None) -> pa.Table | None:
    """The pinned state's rows (None: no state)."""
    state = pinned(config, sink)
    if state is None:
        return None
    return state.to_pyarrow_dataset().to_table(columns=columns, filter=filter)


def folded_below(table: DeltaTable | None) -> dict[tuple[str, int, int], int]:
    """The horizon of the state ``table`` (at its version): (topic, epoch, partition) -> the
    offset below which every record's contribution is folded (``FOLDED_BELOW``)."""
    text = table.metadata().configuration.get(FOLDED_BELOW) if table is not None else None
    return {(t, int(e), int(p)): int(o) for t, e, p, o in json.loads(text)} if text else {}


def refuse_folded(config: PipelineConfig, state: DeltaTable | None, ranges: Iterable[OffsetRange], epochs: Mapping[str, int]) -> None:
    """BackfillParamsError for the first of ``ranges`` that reaches below the horizon of
    ``state`` (the pinned state table): those records are folded into their groups' state and
    have no contribution of their own to replace (``engine_merge.fold``)."""
    horizon = folded_below(state)
    for r in ranges:
        below = horizon.get((r.topic, int(epochs.get(r.topic, 0)), r.partition))
        if r.size and below is not None and r.start < below:
            raise BackfillParamsError(
                f"backfill: {r.topic}[{r.partition}] offsets [{r.start}, {r.end}) reach below offset {below}: the records "
                f"below it are older than sink.fold_after ({config.sink.fold_after or DEFAULT_FOLD_AFTER}) and were folded "
                "into their groups' state, so none has a contribution of its own left to replace. Backfill from offset "
                f"{below} on; or rewind the pipeline to a batch from before the fold (offsetlake rewind), whose state still "
                "holds them; or ingest the topic into a new sink table",
                pipeline=config.name,
                topic=r.topic,
                partition=r.partition,
                start=r.start,
                end=r.end,
            )


def commit(
    config: PipelineConfig,
    batch_id: str,
    pinned_table: DeltaTable | None,
    files: WrittenFiles,
    removed: list[dict[str, Any]],
    schema: pa.Schema,
    folded: dict[tuple[str, int, int], int] | None = None,
) -> int:
    """The batch's state commit: the state table's live files become the pinned version's, minus
    ``removed``, plus ``files`` (module docstring), on whatever version is newest, with the batch
    id in its commitInfo; its horizon (``FOLDED_BELOW``) the pinned version's raised by
    ``folded``, set first by a commit of its own where the newest differs (an unpinned fold, or a
    state the sink was rewound from). Returns the version, which the batch's sink commit pins (a
    version whose live files are those already: the newest, when it holds exactly them)."""
    place = location(config)
    partition_by = config.sink.partition_by
    kept = {f["path"]: f for f in (live_files(pinned_table) if pinned_table is not None else [])}
    for f in removed:
        kept.pop(f["path"], None)
    horizon = folded_below(pinned_table)
    for where, offset in (folded or {}).items():
        horizon[where] = max(offset, horizon.get(where, 0))
    for attempt in range(1, COMMIT_ATTEMPTS + 1):
        table = create_table_once(place, schema, partition_by, f"offsetlake state of pipeline {config.name}")
        if folded_below(table) != horizon:
            shown = json.dumps(sorted([t, e, p, o] for (t, e, p), o in horizon.items()))
            table.alter.set_table_properties({FOLDED_BELOW: shown}, raise_if_not_exists=False)
            table.update_incremental()
        grown = schema_diff(table_schema(table), schema)
        if grown.added:
            table.alter.add_columns([_field(f) for f in schema if f.name not in table_schema(table).names or _grows(table, f)])
        live = {f["path"]: f for f in live_files(table)}
        if not files.actions and set(live) == set(kept) and not grown.added:
            return table.version()  # nothing to change (maintenance's heal of a table already whole)
        # a file it adds that is live already (the same bytes at the same path: a state move
        # repeated after dying) stays as it is; Delta takes no add and remove of one path
        live_paths = {storage.file_path_from_log(p) for p in live}
        adding = [a for a in files.actions if a.path not in live_paths]
        again = {a.path for a in files.actions} - {a.path for a in adding}
        actions: list[Any] = [
            *remove_actions([f for p, f in live.items() if p not in kept and storage.file_path_from_log(p) not in again], partition_by),
            *readd_actions(place, [f for p, f in kept.items() if p not in live], partition_by),
            *adding,
        ]
        note = {"offsetlake_state": {"pipeline": config.name, "batch_id": batch_id, "pinned": pinned_version_of(pinned_table)}}
        base = table.version()
        try:
            table.create_write_transaction(
                actions,
                mode="append",
                schema=table.schema(),
                partition_by=partition_by or None,
                commit_properties=CommitProperties(custom_metadata={"userMetadata": json.dumps(note)}, max_commit_retries=0),
                post_commithook_properties=PostCommitHookProperties(create_checkpoint=True, cleanup_expired_logs=False),
            )
        except CommitFailedError as err:
            if attempt == COMMIT_ATTEMPTS:
                raise CommitConflictError(
                    f"batch {batch_id}: the state table {place} kept changing under the batch's state commit ({err}); "
                    "nothing of the batch is visible, run it again",
                    pipeline=config.name,
                    batch_id=batch_id,
                ) from None
            continue
        return base + 1  # no retries: the commit lands right after the version it was computed on, or fails
    raise AssertionError("unreachable")


def copied_into_state(config: PipelineConfig, sink: DeltaTable) -> WrittenFiles:
    """The sink's live files copied, byte for byte, to the same paths in the state table (a sink
    that kept its state inside, ``StatefulMode.move_state_out``): their add actions there."""
    files = live_files(sink)
    fs, _ = storage.filesystem(location(config))
    for f in files:
        _, source = storage.filesystem(storage.data_file(config.layout.sink, f["path"]))
        _, target = storage.filesystem(storage.data_file(location(config), f["path"]))
        fs.create_dir(target.rsplit("/", 1)[0], recursive=True)
        fs.copy_file(source, target)
    actions = readd_actions(location(config), files, config.sink.partition_by)
    return WrittenFiles(actions=actions, rows=sum(int(f.get("num_records") or 0) for f in files), schema=pa.schema([]))


def heal(config: PipelineConfig) -> int | None:
    """Maintenance, before it vacuums the state table: the newest version made to hold exactly
    the pinned one's files again, so that no file the sink's state needs is one vacuum may
    delete (a state commit no sink commit pins, left by a crash, removed files the pinned state
    still reads). Returns the state table's version, None when there is no state."""
    sink = storage.open_table(config.layout.sink)
    state = pinned(config, sink)
    if state is None or storage.open_table(location(config)) is None:
        return None
    return commit(config, "maintenance", state, WrittenFiles.none(), [], table_schema(state))


def pinned_version_of(table: DeltaTable | None) -> int | None:
    return table.version() if table is not None else None


def _field(f: pa.Field) -> Any:
    from deltalake.schema import Field as DeltaField

    return DeltaField.from_arrow(f)


def _grows(table: DeltaTable, f: pa.Field) -> bool:
    current = table_schema(table)
    return bool(schema_diff(pa.schema([current.field(f.name)]), pa.schema([f])).added)


@dataclass
class Projection:
    """The sink's side of a keyed batch: the files it writes, the live sink files they replace."""

    files: WrittenFiles
    removed: list[dict[str, Any]]
    shape: pa.Schema


def project(
    config: PipelineConfig,
    plan: BatchPlan,
    spark: Any,
    sink: DeltaTable | None,
    changed: DataFrame | pa.Table,
    touched: DataFrame | pa.Table,
    group: list[str],
    prune: list[str],
    output: Callable[[Any], Any],
    selection: Selection,
) -> Projection:
    """What a reader sees of the groups a batch touched: ``changed`` holds every state row of the
    groups it names (the state files the batch rewrote), ``touched`` the groups (``group``
    columns) whose rows may have changed or gone; ``output`` turns state rows into the rows a
    reader sees. The sink files that may hold a touched group (by the statistics of ``prune``)
    are rewritten: their other groups' rows as they are, the touched groups' rows anew. Rows
    the driver holds (pyarrow tables: ``engine_merge.merged_on_driver``) are projected there."""
    from pyspark.sql import functions as F
    from pyspark.sql.pandas.types import to_arrow_schema

    from offsetlake import keyed

    if isinstance(changed, pa.Table):
        return _project_held(config, plan, sink, changed, touched, group, prune, output, selection)
    rows = output(changed)
    shape = to_arrow_schema(rows.schema, timezone="UTC", prefers_large_types=False)
    touched = touched.select(*[F.col(f"`{c}`") for c in group]).distinct()
    removed: list[dict[str, Any]] = []
    if sink is not None:
        removed = keyed.files_holding(sink, touched.select(*[F.col(f"`{c}`") for c in prune]).distinct().toArrow(), config, prune)
    if removed:
        assert sink is not None
        schema = keyed.spark_safe(schema_diff(table_schema(sink), shape).merged)
        stored = staging.read_files(spark, config.layout.sink, removed, schema, config.sink.partition_by)
        rows = rows.unionByName(stored.join(touched, group, "left_anti").select(*[F.col(f"`{c}`") for c in rows.columns]))
    rows = rows.persist()
    try:
        count = rows.count()
        ordered = rows.repartitionByRange(keyed.file_count(count, config), *[F.col(f"`{c}`") for c in [*config.sink.partition_by, *group]])
        staged = staging.write_rows(
            ordered, config.layout.sink, staging_dir(config, plan.batch_id), config.sink.partition_by, selection, tuple(group)
        )
    finally:
        rows.unpersist()
    return Projection(add_actions_for(config.layout.sink, staged), removed, shape)


def _project_held(
    config: PipelineConfig,
    plan: BatchPlan,
    sink: DeltaTable | None,
    changed: pa.Table,
    touched: pa.Table,
    group: list[str],
    prune: list[str],
    output: Callable[[Any], Any],
    selection: Selection,
) -> Projection:
    """``project`` on the driver, for state rows it holds (a batch's groups: few rows)."""
    from offsetlake import keyed

    rows = output(changed)
    shape = rows.schema
    touched = touched.select(group)
    removed: list[dict[str, Any]] = []
    if sink is not None:
        removed = keyed.files_holding(sink, touched.select(prune).group_by(prune).aggregate([]), config, prune)
    if removed:
        assert sink is not None
        schema = keyed.spark_safe(schema_diff(table_schema(sink), shape).merged)
        stored = staging.read_table(config.layout.sink, removed, schema, config.sink.partition_by)
        _, kept = keyed.split_by_groups(stored, touched, group)
        rows = pa.concat_tables([rows, kept.select(rows.column_names)], promote_options="permissive")
    staged = staging.write_table(
        rows,
        config.layout.sink,
        staging_dir(config, plan.batch_id),
        config.sink.partition_by,
        selection,
        tuple(group),
        keyed.file_count(rows.num_rows, config),
    )
    return Projection(add_actions_for(config.layout.sink, staged), removed, shape)
