"""Debian's Chromium driven by playwright: no browser download, no background network traffic."""

from __future__ import annotations

CHROMIUM = "/usr/bin/chromium"
# Without the background-networking flags Chromium keeps trying to reach its vendor's hosts,
# which this machine's closed network refuses.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def launch(playwright):
    """A headless browser from ``sync_playwright()``'s handle."""
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)


def open_logged_in(browser, url: str, path: str, password: str, viewport: dict, user: str = "admin"):
    """A page on ``url + path`` after Airflow's login form (which the UI shows first)."""
    page = browser.new_page(viewport=viewport)
    page.goto(f"{url}{path}", wait_until="domcontentloaded")
    username = page.locator("input[name=username]")
    username.wait_for(timeout=60_000)
    username.fill(user)
    page.fill("input[name=password]", password)
    page.keyboard.press("Enter")
    page.wait_for_url(f"**{path}*", timeout=60_000)
    return page
