"""Fixtures of the dashboard tests: the app under AppTest, and small run settings that keep runs short."""

from __future__ import annotations

from pathlib import Path

import pytest

APP = Path(__file__).resolve().parents[2] / "dashboard" / "app.py"

# A sweep small enough to take seconds on a 2-core machine.
SMALL_LOADS = "8,16"
SMALL_DURATION_S = 120
SMALL_SYNTHETIC = 10


@pytest.fixture
def app():
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(APP), default_timeout=120)
    at.run()
    assert not at.exception
    return at


def by_label(widgets, label: str):
    """The widget whose label starts with ``label``."""
    found = [w for w in widgets if w.label.startswith(label)]
    assert found, f"no widget labelled {label!r} among {[w.label for w in widgets]}"
    return found[0]


def errors(at) -> list[str]:
    return [e.value for e in at.error]


def set_run(at, prefix_loads: str = SMALL_LOADS, duration=SMALL_DURATION_S, synthetic=SMALL_SYNTHETIC, workers=1):
    """Fill the run settings of the Run or Compare page (not submitted)."""
    by_label(at.text_input, "Sessions").set_value(prefix_loads)
    by_label(at.number_input, "Seconds per load").set_value(float(duration))
    by_label(at.number_input, "Synthetic sessions").set_value(synthetic)
    by_label(at.number_input, "Workers").set_value(workers)


def press(at, label: str):
    by_label(at.button, label).click()
    return at.run()
