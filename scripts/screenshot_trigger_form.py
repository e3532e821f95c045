"""Screenshot of the `orders_backfill` trigger form (Params) in headless Chromium, for docs/guides/airflow.md.

Run after `make demo`: starts Airflow on the demo's home, logs in, opens the trigger form.
Needs Debian's chromium (/usr/bin/chromium) and the playwright package (no browser download).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from headless_chromium import launch  # noqa: E402
from local_airflow import LocalAirflow  # noqa: E402
from playwright.sync_api import sync_playwright  # noqa: E402

from offsetlake.embedded.local_broker import free_port  # noqa: E402


def main(out: str = "docs/backfill-trigger-form.png") -> int:
    os.environ.setdefault("OFFSETLAKE_LAKE", str(ROOT / "lake"))
    os.environ.setdefault("OFFSETLAKE_PIPELINES_DIR", str(ROOT / "pipelines"))
    os.environ.setdefault("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092")
    airflow = LocalAirflow(ROOT / ".airflow", free_port(), password="screenshot-only")
    airflow.start()
    try:
        airflow.wait_for_dag("orders_backfill")
        with sync_playwright() as p:
            browser = launch(p)
            page = browser.new_page(viewport={"width": 1400, "height": 1500})
            page.goto(f"{airflow.url}/dags/orders_backfill", wait_until="domcontentloaded")
            trigger = page.get_by_role("button", name="Trigger").first
            username = page.locator("input[name=username]")
            trigger.or_(username).first.wait_for(timeout=60_000)
            if username.count():
                username.fill("admin")
                page.fill("input[name=password]", "screenshot-only")
                page.keyboard.press("Enter")
                page.wait_for_url("**/dags/orders_backfill*", timeout=60_000)
                trigger.wait_for(timeout=60_000)
            page.get_by_role("button", name="Trigger").first.click()
            page.get_by_text("Run Parameters", exact=True).first.wait_for(timeout=30_000)
            for _ in range(3):  # the accordion renders closed; open it until the Params show
                if page.get_by_text("From offset").count() and page.get_by_text("From offset").first.is_visible():
                    break
                page.get_by_role("button", name="Run Parameters").first.click()
                page.wait_for_timeout(1500)
            page.screenshot(path=str(ROOT / out), full_page=False)
            browser.close()
    finally:
        airflow.stop()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
