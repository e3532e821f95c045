"""Which metastore `offsetlake catalog` names the tables in: one setting (``--metastore`` or
``$OFFSETLAKE_METASTORE``) picks a Hive Metastore server by its thrift address; unset or
``embedded`` keeps the project's own Derby; anything else is refused saying what to give."""

from __future__ import annotations

import pytest

from offsetlake import metastore
from offsetlake.errors import OffsetlakeError


def test_the_setting_picks_a_hive_metastore_server_or_the_embedded_one(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv(metastore.ENV, raising=False)
    assert metastore.server() is None and metastore.server("embedded") is None
    monkeypatch.setenv(metastore.ENV, "thrift://hms-1:9083, thrift://hms-2:9083")
    assert metastore.server() == "thrift://hms-1:9083,thrift://hms-2:9083"
    assert metastore.server("embedded") is None  # the flag wins over the environment

    remote = metastore.settings(tmp_path, "thrift://hms-1:9083")
    assert remote["spark.hadoop.hive.metastore.uris"] == "thrift://hms-1:9083"
    assert remote["spark.sql.catalogImplementation"] == "hive"
    assert not any("derby" in value.lower() for value in remote.values()), "a server's names, not a Derby folder's"
    embedded = metastore.settings(tmp_path)
    assert "spark.hadoop.hive.metastore.uris" not in embedded
    assert str(tmp_path / ".offsetlake" / "metastore" / "metastore_db") in embedded["spark.hadoop.javax.jdo.option.ConnectionURL"]


@pytest.mark.parametrize("given", ["http://hms:9083", "thrift://hms", "hms:9083", "thrift://hms:9083/db"])
def test_an_address_that_is_not_a_thrift_metastore_is_refused(given: str) -> None:
    with pytest.raises(OffsetlakeError) as refused:
        metastore.server(given)
    said = str(refused.value)
    assert repr(given) in said and "thrift://HOST:PORT" in said and "embedded" in said
