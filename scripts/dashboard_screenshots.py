"""Screenshots of the dashboard at its defaults, for the README and docs/dashboard.md.

Starts ``kvpool dashboard`` on a free 127.0.0.1 port, opens it in headless Chromium (Playwright,
Debian's /usr/bin/chromium), presses each page's run button with the inputs as a first visit
finds them, and writes full-page PNGs:

    docs/img/dashboard-run.png      Run: mi355x-1p1d at 56/72/96/112 sessions, the scenario's hour
    docs/img/dashboard-compare.png  Compare: mi350x-6p2d-shared over mi350x-6p2d-split, 56 and 112 sessions
    docs/img/dashboard-plan.png     Plan: the smallest pool.gib_per_service meeting the default targets

Usage: .venv/bin/python scripts/dashboard_screenshots.py [--out docs/img] [--pages run,compare,plan]
(needs the dashboard and dev extras: scripts/setup.sh dashboard dev).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kvpool.dashboard.browser import CHROMIUM, CHROMIUM_ARGS, DashboardError, missing_chromium, served_dashboard

ROOT = Path(__file__).resolve().parents[1]
WIDTH_PX = 1400
RUN_TIMEOUT_MS = 300_000

# page -> (link, button, text that shows when its results are drawn, file name)
PAGES = {
    "run": ("Run", "Run sweep", "mi355x-1p1d: 4 load(s)", "dashboard-run.png"),
    "compare": ("Compare", "Run comparison", "All metrics", "dashboard-compare.png"),
    "plan": ("Plan", "Run search", "Explored curve", "dashboard-plan.png"),
}


def _shoot(page, url: str, name: str, out: Path) -> Path:
    link, button, done, file_name = PAGES[name]
    page.goto(url)
    page.get_by_text("Editing mi355x-1p1d").wait_for()
    page.get_by_role("link", name=link).click()
    page.get_by_role("heading", name=link).wait_for()
    page.get_by_role("button", name=button).click()
    page.get_by_text(done, exact=False).first.wait_for(timeout=RUN_TIMEOUT_MS)
    page.locator("[data-testid='stVegaLiteChart'] canvas, [data-testid='stVegaLiteChart'] svg").first.wait_for()
    if page.locator("[data-testid='stException']").count():
        sys.exit(f"error: the {link} page shows an exception")
    # The page scrolls inside Streamlit's main block, not the document: grow the window to its height.
    height = page.evaluate("() => document.querySelector(\"[data-testid='stMain']\").scrollHeight")
    page.set_viewport_size({"width": WIDTH_PX, "height": max(1000, int(height))})
    page.wait_for_timeout(2000)  # the charts redrawn at the new size
    path = out / file_name
    page.screenshot(path=str(path), full_page=True)
    page.set_viewport_size({"width": WIDTH_PX, "height": 1000})
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img", help="folder of the PNGs (default docs/img)")
    ap.add_argument("--pages", default=",".join(PAGES), help="comma-separated: " + ", ".join(PAGES))
    a = ap.parse_args()
    names = [n.strip() for n in a.pages.split(",") if n.strip()]
    unknown = [n for n in names if n not in PAGES]
    if unknown:
        sys.exit(f"error: --pages {a.pages}: unknown page {unknown[0]!r}; allowed: {', '.join(PAGES)}")
    missing = missing_chromium()
    if missing:
        sys.exit(f"error: {missing}")
    from playwright.sync_api import sync_playwright

    a.out.mkdir(parents=True, exist_ok=True)
    try:
        with served_dashboard() as url, sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": WIDTH_PX, "height": 1000})
                page.set_default_timeout(90_000)
                for name in names:
                    t0 = time.monotonic()
                    path = _shoot(page, url, name, a.out)
                    print(f"wrote {path} ({time.monotonic() - t0:.0f} s)")
            finally:
                browser.close()
    except DashboardError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
