"""Render bench-results.json (from `make bench`) as the Markdown tables of BENCHMARKS.md.

    .venv/bin/python bench/report.py [bench-results.json]

Every target line says met or not met with its numbers; nothing here is typed in by hand.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def fmt(n: float) -> str:
    return f"{n:,.0f}" if n >= 100 else f"{n:,.2f}"


def verdict(ok: bool) -> str:
    return "**met**" if ok else "**not met**"


def render(f: dict) -> str:
    out = []
    data = f["data"]
    out.append(
        f"Data: {data['records']:,} JSON orders, mean value {data['mean_value_bytes']} bytes, "
        f"{data['partitions']} partitions; medians of {f['args']['repeats']} runs each.\n"
    )
    out.append("| measure | median | runs | throughput |")
    out.append("| --- | --- | --- | --- |")
    rows = [
        ("raw consume (confluent-kafka loop, discard)", "raw_consume"),
        ("read limit: 2 consume loops in 2 processes (the baseline)", "consume_limit_2_processes"),
        ("one-process plain peer (read, pyarrow parse, one delta-rs commit)", "plain_peer_one_process"),
        ("raw write (deltalake from Arrow, one commit)", "raw_write"),
        ("offsetlake, warm Spark session", "steady_warm"),
        ("offsetlake, fresh `offsetlake run` incl. session start", "steady_with_session_start"),
        ("offsetlake, fresh `offsetlake run --remote` attached to `offsetlake spark-server`", "steady_cli_attached"),
        ("`offsetlake run --no-server`, nothing new", "cli_run_nothing_new"),
        ("`offsetlake run --no-server`, 1,000 new records", "cli_run_1k_new"),
        ("`airflow dags test <p>_ingest` with the server off, nothing new", "airflow_dags_test_nothing_new"),
        ("`airflow dags test <p>_ingest` with the server off (spark-submit), 1,000 new records", "airflow_dags_test_1k_new"),
        ("`offsetlake run --remote` (warm server), 1,000 new records", "cli_run_1k_new_attached"),
        ("`airflow dags test <p>_ingest` with spark_connect_default, 1,000 new records", "airflow_dags_test_1k_new_attached"),
        ("`offsetlake run` by default, the first (starts the project's server), 1,000 new records", "cli_run_1k_new_default_first"),
        ("`offsetlake run` by default (the project's server up), 1,000 new records", "cli_run_1k_new_default"),
        ("`airflow dags test <p>_ingest` by default (the project's server), 1,000 new records", "airflow_dags_test_1k_new_default"),
        ("plan step after 10 committed batches", "plan_after_10_batches"),
        ("plan step after 100 committed batches", "plan_after_100_batches"),
        ("plan step after 1,000 committed batches", "plan_after_1000_batches"),
    ]
    for label, key in rows:
        if key not in f:
            continue
        m = f[key]
        rate = f"{fmt(m['records_per_s'])} records/s" if "records_per_s" in m else ""
        if "mb_per_s" in m:
            rate += f", {m['mb_per_s']} MB/s"
        out.append(f"| {label} | {m['median_s']} s | {', '.join(map(str, m['samples_s']))} | {rate} |")
    if f.get("steady_warm", {}).get("cpu_s"):
        splits = "; ".join(", ".join(f"{k} {v}" for k, v in sorted(s.items())) for s in f["steady_warm"]["cpu_s"])
        out.append(f"| CPU seconds of each warm run | | {splits} | |")
    if "steady_warm_local_vs_s3" in f:
        m = f["steady_warm_local_vs_s3"]
        out.append(
            f"| offsetlake, warm, lake on a local folder (next to S3) | {m['local_median_s']} s | "
            f"{', '.join(map(str, m['local_samples_s']))} | {fmt(round(m['records'] / m['local_median_s']))} records/s |"
        )
        out.append(
            f"| offsetlake, warm, lake on the embedded S3 | {m['s3_median_s']} s | "
            f"{', '.join(map(str, m['s3_samples_s']))} | {fmt(round(m['records'] / m['s3_median_s']))} records/s "
            f"({m['s3_over_local']} × the local time) |"
        )
    if "steady_warm_json_vs_avro" in f:
        m = f["steady_warm_json_vs_avro"]
        out.append(
            f"| offsetlake, warm, JSON orders (next to Avro; {m['json_mean_value_bytes']} B/value) | {m['json_median_s']} s | "
            f"{', '.join(map(str, m['json_samples_s']))} | {fmt(m['json_records_per_s'])} records/s |"
        )
        out.append(
            f"| offsetlake, warm, the same orders as Avro via the registry ({m['avro_mean_value_bytes']} B/value) | "
            f"{m['avro_median_s']} s | {', '.join(map(str, m['avro_samples_s']))} | "
            f"{fmt(m['avro_records_per_s'])} records/s ({m['avro_over_json']} × the JSON time) |"
        )
    if "decode_json_vs_avro" in f:
        m = f["decode_json_vs_avro"]
        out.append(
            f"| decode step alone, {m['records']:,} records in 10,000-record chunks | | JSON {m['json_us_per_record']} µs, "
            f"Avro {m['avro_us_per_record']} µs per record | Avro / JSON {m['avro_over_json']} |"
        )
    if "upsert_block" in f:
        m = f["upsert_block"]
        for size in m["sizes"]:
            out.append(
                f"| upsert: {m['updates']:,} updates of one key block into a {size:,}-row keyed sink | "
                f"{m['median_s'][str(size)]} s | {', '.join(map(str, m['samples_s'][str(size)]))} | "
                f"{m['files_rewritten'][str(size)]} file(s) rewritten, {m['rows_rewritten'][str(size)]:,} rows kept |"
            )
    if "upsert_spread" in f:
        m = f["upsert_spread"]
        for size, run in m["runs"].items():
            out.append(
                f"| upsert: {m['updates']:,} updates spread over all keys of a {int(size):,}-row keyed sink (once) | "
                f"{run['s']} s | | {run['files_rewritten']} file(s) rewritten, {run['rows_rewritten']:,} rows kept |"
            )
    for label in ("1x", "10x"):
        key = f"memory_{label}"
        if key in f:
            m = f[key]
            split = "; ".join(", ".join(f"{k} {v}" for k, v in sorted(s.items())) for s in m["peak_split_mib"])
            out.append(
                f"| peak RSS draining {m['backlog_records']:,} records ({label} the cap of "
                f"{m['max_records_per_batch']:,}) | {m['peak_rss_mib_median']:,} MiB | "
                f"{', '.join(map(str, m['samples_mib']))} MiB | split at each peak (MiB): {split} |"
            )

    out.append("\n| target | figure | verdict |")
    out.append("| --- | --- | --- |")
    if "ratio_steady_to_raw_consume" in f:
        r = f["ratio_steady_to_raw_consume"]["warm"]
        out.append(
            f"| steady state ≥ 0.5 × raw consume | {r} × (with session start: "
            f"{f['ratio_steady_to_raw_consume']['with_session_start']} ×) | {verdict(r >= 0.5)} |"
        )
    if "ratio_warm_to_peers" in f:
        r = f["ratio_warm_to_peers"]
        out.append(
            f"| warm steady state ≥ 0.6 × the 2-process read limit | {r['warm_over_limit']} × | {verdict(r['warm_over_limit'] >= 0.6)} |"
        )
        out.append(
            f"| warm steady state ≥ 1.5 × the one-process plain peer | {r['warm_over_plain_peer']} × | "
            f"{verdict(r['warm_over_plain_peer'] >= 1.5)} |"
        )
    if "ratio_plan_1000_to_10" in f:
        r = f["ratio_plan_1000_to_10"]["ratio"]
        out.append(
            f"| plan time at 1,000 batches ≤ 2 × at 10 | {r} × ({f['plan_after_1000_batches']['median_s']} s vs "
            f"{f['plan_after_10_batches']['median_s']} s) | {verdict(r <= 2)} |"
        )
    if "ratio_memory_10x_to_1x" in f:
        r = f["ratio_memory_10x_to_1x"]["ratio"]
        out.append(f"| peak RSS at 10× backlog ≤ 1.2 × at 1× | {r} × | {verdict(r <= 1.2)} |")
    if "upsert_block" in f:
        r = f["upsert_block"]["ratio_10m_over_1m"]
        out.append(f"| upsert batch into 10M rows ≤ 2 × into 1M rows | {r} × | {verdict(r <= 2)} |")
    if "steady_with_session_start" in f and "steady_warm" in f:
        cold, warm = f["steady_with_session_start"]["median_s"], f["steady_warm"]["median_s"]
        attached = f.get("steady_cli_attached", {}).get("median_s")
        best = min(cold, attached) if attached else cold
        out.append(
            f"| cold `offsetlake run` ≤ 1.3 × the warm time | {round(cold / warm, 2)} × starting its own JVM"
            + (f", {round(attached / warm, 2)} × attached to the server" if attached else "")
            + f" ({warm} s warm) | {verdict(best / warm <= 1.3)} |"
        )
    for key, label, limit in (
        ("cli_run_1k_new", "`offsetlake run` with 1,000 new records ≤ 8 s", 8),
        ("airflow_dags_test_1k_new", "an Airflow ingest of 1,000 new records ≤ 15 s", 15),
    ):
        if key in f:
            own, attached = f[key]["median_s"], f.get(f"{key}_attached", {}).get("median_s")
            best = min(own, attached) if attached else own
            out.append(
                f"| {label} | {own} s with its own JVM"
                + (f", {attached} s attached to the server" if attached else "")
                + f" | {verdict(best <= limit)} |"
            )
    if "cli_run_nothing_new" in f:
        s = f["cli_run_nothing_new"]["median_s"]
        out.append(f"| CLI run with nothing new ≤ 5 s | {s} s | {verdict(s <= 5)} |")
    if "airflow_dags_test_nothing_new" in f:
        spark = f["airflow_dags_test_nothing_new"]["spark_started"]
        out.append(
            f"| Airflow run with nothing new starts no Spark | Spark started: {spark} (checked on every run) | {verdict(not spark)} |"
        )
    return "\n".join(out)


if __name__ == "__main__":
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "bench-results.json"
    print(render(json.loads(path.read_text())))
