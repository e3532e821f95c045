"""Planning arithmetic: fair shares of max_records_per_batch, splits that use both cores."""

from __future__ import annotations

from offsetlake.plan import OffsetRange, PartitionOffsets
from offsetlake.planner import plan_ranges, share_fairly
from offsetlake.reader import split_ranges, task_count


def test_share_fairly_gives_unused_shares_to_lagging_partitions():
    assert share_fairly({0: 10, 1: 1_000, 2: 1_000}, 900) == {0: 10, 1: 445, 2: 445}
    assert share_fairly({0: 0, 1: 5}, 100) == {0: 0, 1: 5}
    grant = share_fairly({0: 7, 1: 7, 2: 7}, 10)
    assert sum(grant.values()) == 10 and max(grant.values()) - min(grant.values()) <= 1


def test_plan_starts_at_committed_end_and_stops_at_lso():
    offsets = {("t", 0): PartitionOffsets("t", 0, 0, 500), ("t", 1): PartitionOffsets("t", 1, 100, 300)}
    ranges = plan_ranges({("t", 0): 200, ("t", 1): None}, offsets, "earliest", 10_000)
    assert ranges == [OffsetRange("t", 0, 200, 500), OffsetRange("t", 1, 100, 300)]
    latest = plan_ranges({("t", 0): 200, ("t", 1): None}, offsets, "latest", 10_000)
    assert latest[1] == OffsetRange("t", 1, 300, 300)


def test_the_budget_is_shared_across_the_partitions_of_every_topic():
    offsets = {
        ("a", 0): PartitionOffsets("a", 0, 0, 1_000),
        ("b", 0): PartitionOffsets("b", 0, 0, 1_000),
        ("b", 1): PartitionOffsets("b", 1, 0, 10),
    }
    ranges = plan_ranges({("a", 0): None, ("b", 0): 0, ("b", 1): None}, offsets, "earliest", 610)
    assert ranges == [OffsetRange("a", 0, 0, 301), OffsetRange("b", 0, 0, 299), OffsetRange("b", 1, 0, 10)]


def test_split_ranges_covers_every_offset_once():
    ranges = [OffsetRange("t", 0, 0, 1_000_000), OffsetRange("t", 1, 5, 30)]
    splits = split_ranges(ranges, parallelism=2)
    assert len(splits) >= 4
    for r in ranges:
        mine = sorted((s.start, s.end) for s in splits if s.partition == r.partition)
        assert mine[0][0] == r.start and mine[-1][1] == r.end
        assert all(a[1] == b[0] for a, b in zip(mine, mine[1:], strict=False))


def test_small_batches_share_their_read_tasks():
    """A task costs its scheduling, consumer and files whatever it reads: a few records over many
    partitions take as many tasks as cores, a large batch a task per split."""
    small = [(s.topic, s.partition, s.start, s.end) for s in split_ranges([OffsetRange("t", p, 0, 166) for p in range(6)], 2)]
    assert len(small) == 6 and task_count(small, parallelism=2) == 2
    large = [(s.topic, s.partition, s.start, s.end) for s in split_ranges([OffsetRange("t", p, 0, 50_000) for p in range(6)], 2)]
    assert task_count(large, parallelism=2) == len(large) == 6
    middle = [("t", p, 0, 30_000) for p in range(3)]  # 90,000 records: enough for every split's own task
    assert task_count(middle, parallelism=2) == 3
    assert task_count([("t", p, 0, 15_000) for p in range(4)], parallelism=2) == 3  # 60,000 records, 20,000 each
    assert task_count([], parallelism=2) == 1
