"""The one task-side file writer (``staging.TaskFiles``) that every data path's tasks write with:
a file per partition value, at most ``max_open`` open, row groups gathered, names unique per file,
rows counted per topic-partition inside the batch's ranges (no Spark, a local folder)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from offsetlake import storage
from offsetlake.coordinates import OFFSET, PARTITION, TOPIC
from offsetlake.staging import ROW_GROUP_ROWS, ROWS, TaskFiles, result_batch, result_counts, staged_file

SCHEMA = pa.schema([("order_id", pa.int64()), ("region", pa.string()), (TOPIC, pa.string()), (PARTITION, pa.int32()), (OFFSET, pa.int64())])


def _rows(partition: int, offsets: range, region: str | None) -> pa.Table:
    n = len(offsets)
    return pa.table(
        {
            "order_id": list(offsets),
            "region": [region] * n,
            TOPIC: ["t"] * n,
            PARTITION: pa.array([partition] * n, pa.int32()),
            OFFSET: list(offsets),
        },
        schema=SCHEMA,
    )


def test_partition_values_beyond_the_open_files_go_to_new_files_and_every_row_is_counted_once(tmp_path: Path):
    files = TaskFiles(storage.Location.of(str(tmp_path)), "data/b-1", SCHEMA, ["region"], max_open=1, attempt="00003-abc")
    # interleaved values: with one file open, each change of value closes the previous file
    writes = [(0, range(0, 5), "eu"), (1, range(0, 3), "us"), (0, range(5, 9), "eu"), (1, range(3, 4), None), (0, range(9, 11), "")]
    for partition, offsets, region in writes:
        files.write(_rows(partition, offsets, region))
    done = files.close()

    assert [f.rows for f in done] == [5, 3, 4, 1, 2]
    names = [f.relative for f in done]
    assert len(set(names)) == len(names) and all("part-00003-abc-" in n for n in names)
    null = f"region={storage.HIVE_NULL}"  # null and "" share a folder: the file names keep them apart
    assert [n.split("/")[2] for n in names] == ["region=eu", "region=us", "region=eu", null, null]
    assert sum((Counter(f.counts) for f in done), Counter()) == Counter({("t", 0): 11, ("t", 1): 4})
    assert [f.empty_as_null for f in done] == [0, 0, 0, 0, 2]  # "" is stored as null, and counted
    read = pa.concat_tables([pq.read_table(tmp_path / n) for n in names])
    assert sorted(zip(read[PARTITION].to_pylist(), read[OFFSET].to_pylist(), strict=True)) == sorted(
        (p, o) for p, offsets, _ in writes for o in offsets
    )
    assert "region" not in read.column_names and all(
        pq.ParquetFile(tmp_path / n).metadata.num_rows == f.rows for n, f in zip(names, done, strict=True)
    )

    # a read task knows each chunk's topic-partition: the same counts without grouping
    known = TaskFiles(storage.Location.of(str(tmp_path)), "data/b-3", SCHEMA, ["region"], attempt="00004-abc")
    for partition, offsets, region in writes:
        known.write(_rows(partition, offsets, region), source=("t", partition))
    assert sum((Counter(f.counts) for f in known.close()), Counter()) == Counter({("t", 0): 11, ("t", 1): 4})

    # what the task returns is what the driver commits
    staged = [staged_file(r) for r in result_batch((ROWS, f) for f in done).to_pylist()]
    assert [(s.path, s.rows, s.size) for s in staged] == [(f.relative, f.rows, (tmp_path / f.relative).stat().st_size) for f in done]
    assert result_counts(result_batch([], Counter({("t", 0): 11})).to_pylist()[0]) == {("t", 0): 11}


def test_rows_are_gathered_into_row_groups_and_only_rows_inside_the_ranges_are_counted(tmp_path: Path):
    inside = pc.field(OFFSET) < 1_000
    files = TaskFiles(storage.Location.of(str(tmp_path)), "data/b-2", SCHEMA, [], attempt="00000-x", inside=inside)
    chunk = 10_000
    for start in range(0, ROW_GROUP_ROWS + chunk, chunk):  # just over one row group's rows, in chunks
        files.write(_rows(0, range(start, start + chunk), "eu"))
    [done] = files.close()

    metadata = pq.ParquetFile(tmp_path / done.relative).metadata
    assert metadata.num_rows == done.rows == 80_000
    assert metadata.num_row_groups == 2  # not one per chunk
    assert done.counts == Counter({("t", 0): 1_000})
