"""Debian's Chromium driven by playwright: no browser download, no background network traffic."""

from __future__ import annotations

CHROMIUM = "/usr/bin/chromium"
# Without the background-networking flags Chromium keeps trying to reach its vendor's hosts,
# which this machine's closed network refuses.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def launch(playwright):
    """A headless browser from ``sync_playwright()``'s handle."""
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
