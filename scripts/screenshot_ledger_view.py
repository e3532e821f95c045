"""Screenshot of the Airflow UI's "Offset ledger" view of `orders` in headless Chromium, for docs/guides/airflow.md.

Run after `make demo`: starts the demo's broker (.kafka/, unless KAFKA_BOOTSTRAP_SERVERS is set)
and Airflow on the demo's home (.airflow/) and lake (lake/), produces 2,000 more orders so the
lag chart has lag to show (the next `orders_ingest` run picks them up), logs in and opens the view.
Needs Debian's chromium (/usr/bin/chromium) and the playwright package (no browser download).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from headless_chromium import launch, open_logged_in  # noqa: E402
from local_airflow import LocalAirflow  # noqa: E402
from playwright.sync_api import sync_playwright  # noqa: E402

from offsetlake.embedded.local_broker import LocalBroker, free_port  # noqa: E402
from offsetlake.embedded.sample_data import produce_orders  # noqa: E402

NEW_ORDERS = 2_000


def main(out: str = "docs/ledger-view.png") -> int:
    os.environ.setdefault("OFFSETLAKE_LAKE", str(ROOT / "lake"))
    os.environ.setdefault("OFFSETLAKE_PIPELINES_DIR", str(ROOT / "pipelines"))
    if not (Path(os.environ["OFFSETLAKE_LAKE"]) / "_offset_ledger").exists():
        raise SystemExit(f"no offset ledger in {os.environ['OFFSETLAKE_LAKE']}: run `make demo` first")
    broker = None
    if not os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        broker = LocalBroker(ROOT / ".kafka" / "data", log_path=ROOT / ".kafka" / "broker.log").start()
        os.environ["KAFKA_BOOTSTRAP_SERVERS"] = broker.bootstrap
    airflow = LocalAirflow(ROOT / ".airflow", free_port(), password="screenshot-only")
    try:
        produce_orders(os.environ["KAFKA_BOOTSTRAP_SERVERS"], os.environ.get("ORDERS_TOPIC", "orders"), NEW_ORDERS, first_id=10_000_000)
        airflow.start()
        with sync_playwright() as p:
            browser = launch(p)
            page = open_logged_in(browser, airflow.url, "/plugin/offsetlake-ledger", "screenshot-only", {"width": 1500, "height": 1250})
            view = page.frame_locator("iframe[title='Offset ledger']")
            view.locator("tr[data-pipeline=orders]").get_by_role("link", name="orders").click(timeout=60_000)
            view.locator("svg.lag-chart").wait_for(timeout=60_000)
            page.wait_for_timeout(500)
            page.screenshot(path=str(ROOT / out), full_page=False)
            browser.close()
    finally:
        airflow.stop()
        if broker is not None:
            broker.stop()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
