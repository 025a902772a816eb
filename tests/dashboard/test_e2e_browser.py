"""End to end: ``kvpool dashboard`` on a free 127.0.0.1 port, driven by headless Chromium (Playwright).

Loads a scenario (a TOML upload), runs a small sweep on the Run page and waits for the plots; runs a
two-run capacity search on the Plan page and waits for its verdict and chart. The screenshots stay in
the test's tmp_path. Uses Debian's /usr/bin/chromium (never ``playwright install``).
"""

from __future__ import annotations

import pytest

from conftest import SMALL_DURATION_S, SMALL_LOADS, SMALL_SYNTHETIC

from kvpool.dashboard.browser import CHROMIUM, CHROMIUM_ARGS, missing_chromium, served_dashboard
from kvpool.scenario import load_scenario, to_toml


@pytest.fixture
def dashboard(tmp_path):
    with (tmp_path / "dashboard.log").open("w") as log, served_dashboard(log, timeout_s=60.0) as url:
        yield url


def test_load_a_scenario_run_a_sweep_and_see_the_plots(dashboard, tmp_path):
    from playwright.sync_api import sync_playwright

    assert missing_chromium() is None, missing_chromium()
    scenario = tmp_path / "e2e.toml"
    scenario.write_text(to_toml(load_scenario("mi355x-1p1d", ['name="e2e-1p1d"'])))

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(60_000)
            page.goto(dashboard)
            page.get_by_text("Editing mi355x-1p1d").wait_for()

            page.locator("input[type='file']").set_input_files(str(scenario))
            page.get_by_text("Editing e2e-1p1d").wait_for()

            page.get_by_role("link", name="Run").click()
            page.get_by_role("heading", name="Run").wait_for()
            for label, value in [("Sessions (AgentX lanes), comma-separated", SMALL_LOADS),
                                 ("Seconds per load", str(SMALL_DURATION_S)),
                                 ("Synthetic sessions", str(SMALL_SYNTHETIC))]:
                box = page.get_by_label(label, exact=True)
                box.fill(value)
                box.press("Tab")
            page.get_by_role("button", name="Run sweep").click()

            page.get_by_text("e2e-1p1d: 2 load(s)").wait_for(timeout=120_000)
            chart = page.locator("[data-testid='stVegaLiteChart']").first
            chart.wait_for()
            page.locator("[data-testid='stVegaLiteChart'] canvas, [data-testid='stVegaLiteChart'] svg").first.wait_for()
            assert page.locator("[data-testid='stException']").count() == 0
            shot = tmp_path / "run-page.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
        finally:
            browser.close()


def test_run_a_capacity_search_and_see_its_chart(dashboard, tmp_path):
    """The Plan page in the browser: a two-run search (both ends of the range), its verdict and chart."""
    from playwright.sync_api import sync_playwright

    assert missing_chromium() is None, missing_chromium()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 2400})
            page.set_default_timeout(60_000)
            page.goto(dashboard)
            page.get_by_text("Editing mi355x-1p1d").wait_for()
            page.get_by_role("link", name="Plan").click()
            page.get_by_role("heading", name="Plan").wait_for()
            for label, value in [("Targets, one per line", "reuse>=0.5"), ("From (LO)", "0"),
                                 ("Sessions per run", "8"), ("Seconds per run", str(SMALL_DURATION_S)),
                                 ("Synthetic sessions", str(SMALL_SYNTHETIC)), ("Max runs", "2")]:
                box = page.get_by_label(label, exact=True)
                box.fill(value)
                box.press("Tab")
            page.get_by_role("button", name="Run search").click()
            page.get_by_text("Explored curve (2 runs", exact=False).wait_for(timeout=120_000)
            page.get_by_text("Smallest pool.gib_per_service", exact=False).wait_for()
            page.locator("[data-testid='stVegaLiteChart'] canvas, [data-testid='stVegaLiteChart'] svg").first.wait_for()
            assert page.locator("[data-testid='stException']").count() == 0
            shot = tmp_path / "plan-page.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
        finally:
            browser.close()
