"""Between batches a full GC runs after a large batch, or once the last one is half a minute old:
a drain of large batches keeps its peak flat (``bench/offsetlake_bench.py --only memory``), and a
stream's micro-batches of a few thousand records do not pay 240-310 ms each for it
(``bench/stream_latency.py``, BENCHMARKS.md)."""

from __future__ import annotations

import gc
import time

from offsetlake import spark


def test_a_full_gc_follows_a_large_batch_or_a_quiet_half_minute_not_every_micro_batch(monkeypatch) -> None:
    collected: list[float] = []
    clock = [1000.0]
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append(clock[0]) or 0)
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(spark, "_SESSION", None)
    monkeypatch.setattr(spark, "_released_at", None)

    assert spark.release_memory(10) is True, "the first batch of a process releases"
    for _ in range(20):  # a stream's micro-batches, one a second
        clock[0] += 1.0
        assert spark.release_memory(1_000) is False
    clock[0] += spark.RELEASE_EVERY_SECONDS - 20  # half a minute after the last release
    assert spark.release_memory(1_000) is True
    clock[0] += 1.0
    assert spark.release_memory(spark.RELEASE_AFTER_RECORDS) is True, "a large batch releases at once"
    clock[0] += 1.0
    assert spark.release_memory(200_000) is True
    assert collected == [1000.0, 1030.0, 1031.0, 1032.0]
