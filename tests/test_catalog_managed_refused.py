"""A pipeline whose sink is a catalog-managed Delta table (Unity Catalog's managed tables: the
``catalogManaged`` table feature) is refused when the table is first opened, with a message that
says why and what to do, and nothing is planned or written (issue 53)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from offsetlake import storage
from offsetlake.embedded.sample_data import ensure_topic, produce_orders


def _make_catalog_managed(table: Path, feature: str) -> None:
    """What a catalog's upgrade commits: a protocol naming the feature (reader and writer)."""
    log = table / "_delta_log"
    version = max(int(p.stem) for p in log.glob("*.json")) + 1
    protocol = {"minReaderVersion": 3, "minWriterVersion": 7, "readerFeatures": [feature], "writerFeatures": [feature]}
    (log / f"{version:020d}.json").write_text(
        json.dumps({"commitInfo": {"timestamp": 1_795_000_000_000, "operation": "UPGRADE PROTOCOL"}})
        + "\n"
        + json.dumps({"protocol": protocol})
        + "\n"
    )


@pytest.mark.local_lake
@pytest.mark.parametrize("feature", ["catalogManaged", "catalogOwned-preview"])
def test_a_catalog_managed_sink_is_refused_before_anything_is_planned(pipeline, feature: str) -> None:
    config = pipeline.write()
    ensure_topic(pipeline.bootstrap, pipeline.topic, 1)
    produce_orders(pipeline.bootstrap, pipeline.topic, 20)
    assert pipeline.cli("run").returncode == 0
    sink, ledger = Path(str(config.layout.sink)), config.layout.ledger
    _make_catalog_managed(sink, feature)
    ledger_version = storage.table(ledger).version()
    sink_log = sorted(p.name for p in (sink / "_delta_log").iterdir())
    produce_orders(pipeline.bootstrap, pipeline.topic, 20)

    refused = pipeline.cli("run")
    assert refused.returncode == 2, refused.stderr[-3000:]
    last = refused.stderr.strip().splitlines()[-1]
    assert f"the Delta table at {sink} is catalog-managed" in last, refused.stderr[-3000:]
    assert "Point the pipeline's lake at a folder of its own" in last
    assert "Traceback" not in refused.stderr
    assert storage.table(ledger).version() == ledger_version, "a refused run still wrote to the ledger"
    assert sorted(p.name for p in (sink / "_delta_log").iterdir()) == sink_log, "a refused run still committed to the sink"
