"""Which of a pipeline's tables ``offsetlake sql`` names: committed local tables only; a lake on
object storage is refused by name, since the pinned jars carry no S3 filesystem for Spark."""

from __future__ import annotations

import pytest

from offsetlake.catalog import NamedTable, committed
from offsetlake.errors import OffsetlakeError


def test_a_local_table_is_named_once_it_has_a_delta_log(tmp_path) -> None:
    table = NamedTable("orders", "orders", "sink", str(tmp_path / "orders"))
    assert not committed(table)
    (tmp_path / "orders" / "_delta_log").mkdir(parents=True)
    assert committed(table)
    assert committed(NamedTable("orders", "orders", "sink", (tmp_path / "orders").as_uri()))


def test_a_table_on_object_storage_is_refused_with_what_to_do_instead() -> None:
    with pytest.raises(OffsetlakeError) as refused:
        committed(NamedTable("orders_ledger", "orders", "ledger", "s3://bucket/lake/_offset_ledger"))
    said = str(refused.value)
    assert refused.value.pipeline == "orders"
    assert "orders_ledger" in said and "s3://bucket/lake/_offset_ledger" in said and "delta-rs" in said


def test_a_file_uri_with_escapes_names_the_folder_it_escapes(tmp_path) -> None:
    folder = tmp_path / "a lake" / "orders"
    (folder / "_delta_log").mkdir(parents=True)
    assert committed(NamedTable("orders", "orders", "sink", folder.as_uri()))  # file:///.../a%20lake/orders
