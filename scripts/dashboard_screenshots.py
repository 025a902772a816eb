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
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
WIDTH_PX = 1400
RUN_TIMEOUT_MS = 300_000

# page -> (link, button, text that shows when its results are drawn, file name)
PAGES = {
    "run": ("Run", "Run sweep", "mi355x-1p1d: 4 load(s)", "dashboard-run.png"),
    "compare": ("Compare", "Run comparison", "All metrics", "dashboard-compare.png"),
    "plan": ("Plan", "Run search", "Explored curve", "dashboard-plan.png"),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"error: kvpool dashboard exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    sys.exit(f"error: {url} did not answer in {timeout_s:.0f} s")


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
    if not os.path.exists(CHROMIUM):
        sys.exit(f"error: {CHROMIUM} is missing: scripts/setup.sh dev installs Debian's chromium")
    from playwright.sync_api import sync_playwright

    a.out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    kvpool = str(Path(sys.executable).with_name("kvpool"))
    proc = subprocess.Popen([kvpool, "dashboard", "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, "STREAMLIT_BROWSER_GATHER_USAGE_STATS": "false"})
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc)
        with sync_playwright() as p:
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
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


if __name__ == "__main__":
    main()
