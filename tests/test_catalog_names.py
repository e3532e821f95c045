"""Which of a pipeline's tables ``offsetlake sql`` and ``catalog register`` name, and where Spark
reaches them: committed local tables by folder, S3 tables at ``s3a://`` with S3A's per-bucket
settings made from the pipeline's ``storage:``; a store Spark here has no filesystem for is refused
by name."""

from __future__ import annotations

import pytest

from offsetlake.catalog import NamedTable, committed, hadoop_settings, s3_buckets
from offsetlake.errors import OffsetlakeError
from offsetlake.storage import Location


def _table(location: str, options: dict[str, str] | None = None, pipeline: str = "orders") -> NamedTable:
    return NamedTable(pipeline, pipeline, "sink", Location.of(location, options))


def test_a_local_table_is_named_once_it_has_a_delta_log(tmp_path) -> None:
    table = _table(str(tmp_path / "orders"))
    assert not committed(table)
    (tmp_path / "orders" / "_delta_log").mkdir(parents=True)
    assert committed(table)
    assert committed(_table((tmp_path / "orders").as_uri()))
    assert table.spark_location == str((tmp_path / "orders").resolve())


def test_a_table_on_a_store_spark_cannot_reach_is_refused_with_what_to_do_instead() -> None:
    with pytest.raises(OffsetlakeError) as refused:
        committed(NamedTable("orders_ledger", "orders", "ledger", Location.of("gs://bucket/lake/_offset_ledger")))
    said = str(refused.value)
    assert refused.value.pipeline == "orders"
    assert "orders_ledger" in said and "gs://bucket/lake/_offset_ledger" in said and "delta-rs" in said


def test_a_file_uri_with_escapes_names_the_folder_it_escapes(tmp_path) -> None:
    folder = tmp_path / "a lake" / "orders"
    (folder / "_delta_log").mkdir(parents=True)
    assert committed(_table(folder.as_uri()))  # file:///.../a%20lake/orders


def test_an_s3_table_is_read_through_s3a_with_its_own_buckets_settings() -> None:
    local = {
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
        "AWS_REGION": "eu-west-1",
        "AWS_ACCESS_KEY_ID": "k1",
        "AWS_SECRET_ACCESS_KEY": "s1",
    }
    temporary = {"aws_access_key_id": "k2", "aws_secret_access_key": "s2", "aws_session_token": "t2", "aws_region": "us-east-1"}
    tables = [
        _table("s3://lake-a/lake/orders", local),
        NamedTable("orders_ledger", "orders", "ledger", Location.of("s3://lake-a/lake/_offset_ledger", local)),
        _table("s3a://lake.b/x/payments", temporary, pipeline="payments"),
    ]
    assert tables[0].spark_location == "s3a://lake-a/lake/orders"
    assert s3_buckets(tables) == ["lake-a", "lake.b"]
    assert hadoop_settings(tables) == {
        "fs.s3a.bucket.lake-a.endpoint": "http://127.0.0.1:9000",
        "fs.s3a.bucket.lake-a.endpoint.region": "eu-west-1",
        "fs.s3a.bucket.lake-a.access.key": "k1",
        "fs.s3a.bucket.lake-a.secret.key": "s1",
        "fs.s3a.bucket.lake-a.path.style.access": "true",  # a custom endpoint: path-style, as object_store asks it
        "fs.s3a.bucket.lake-a.connection.ssl.enabled": "false",
        "fs.s3a.bucket.lake.b.access.key": "k2",
        "fs.s3a.bucket.lake.b.secret.key": "s2",
        "fs.s3a.bucket.lake.b.session.token": "t2",
        "fs.s3a.bucket.lake.b.endpoint.region": "us-east-1",
        "fs.s3a.bucket.lake.b.aws.credentials.provider": "org.apache.hadoop.fs.s3a.TemporaryAWSCredentialsProvider",
    }
    hosted = hadoop_settings([_table("s3://c/l/t", {"aws_endpoint_url": "https://s3.example", "aws_virtual_hosted_style_request": "true"})])
    assert hosted["fs.s3a.bucket.c.path.style.access"] == "false" and hosted["fs.s3a.bucket.c.connection.ssl.enabled"] == "true"
    assert hadoop_settings([_table("s3://c/l/t")]) == {}  # nothing given: S3A's own chain, as delta-rs reads the environment


def test_two_pipelines_reaching_one_bucket_with_different_settings_are_refused() -> None:
    same = [_table("s3://shared/a/t", {"aws_region": "eu-west-1"}), _table("s3://shared/b/t", {"aws_region": "eu-west-1"}, "p2")]
    assert hadoop_settings(same) == {"fs.s3a.bucket.shared.endpoint.region": "eu-west-1"}
    with pytest.raises(OffsetlakeError) as refused:
        hadoop_settings([same[0], _table("s3://shared/b/t", {"aws_region": "us-east-2"}, "p2")])
    said = str(refused.value)
    assert "orders and p2" in said and "bucket shared" in said and "endpoint.region" in said and "--pipeline" in said


def test_a_pipeline_names_its_tables_in_its_catalog_database(tmp_path) -> None:
    """``catalog.database``: the three names go to that database (``default`` unless given), and
    offsetlake prints them qualified outside ``default``; a name Spark and the Hive Metastore
    would not keep as given is refused at load, naming the file and the field."""
    import yaml

    from offsetlake.catalog import named_tables
    from offsetlake.config import load_pipeline
    from offsetlake.errors import ConfigError

    base = {
        "name": "orders",
        "topic": "orders",
        "kafka": {"bootstrap_servers": "127.0.0.1:9092"},
        "format": {"type": "json", "schema": {"order_id": "long"}},
        "lake": str(tmp_path / "lake"),
    }
    plain, sales = tmp_path / "orders.yaml", tmp_path / "sales" / "orders.yaml"
    sales.parent.mkdir()
    plain.write_text(yaml.safe_dump(base))
    sales.write_text(yaml.safe_dump({**base, "catalog": {"database": "sales"}}))
    defaults = named_tables([load_pipeline(str(plain))])
    assert [(t.database, t.label, t.qualified) for t in defaults] == [
        ("default", "orders", "`default`.`orders`"),
        ("default", "orders_dead_letters", "`default`.`orders_dead_letters`"),
        ("default", "orders_ledger", "`default`.`orders_ledger`"),
    ]
    assert [t.label for t in named_tables([load_pipeline(str(sales))])] == [
        "sales.orders",
        "sales.orders_dead_letters",
        "sales.orders_ledger",
    ]
    # a Kafka sink's rows and dead letters are topics: its ledger is its one table
    kafka = tmp_path / "kafka" / "orders.yaml"
    kafka.parent.mkdir()
    kafka.write_text(yaml.safe_dump({**base, "sink": {"type": "kafka", "topic": "orders-out"}}))
    assert [t.label for t in named_tables([load_pipeline(str(kafka))])] == ["orders_ledger"]
    for bad in ("Sales", "sales-eu", "a.b", ""):
        sales.write_text(yaml.safe_dump({**base, "catalog": {"database": bad}}))
        with pytest.raises(ConfigError) as refused:
            load_pipeline(str(sales))
        assert str(sales) in str(refused.value) and "catalog.database" in str(refused.value), str(refused.value)
