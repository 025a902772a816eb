"""Fixtures of the dashboard tests: the app under AppTest, and small run settings that keep runs short."""

from __future__ import annotations

from pathlib import Path

import pytest

APP = Path(__file__).resolve().parents[2] / "dashboard" / "app.py"
# One real trace (of the repository's test traces, tests/data/traces): a small, fast capacity search
# without a GPU cache.
KV_TRACES = Path(__file__).resolve().parents[2] / "tests" / "data" / "traces" / "kv-cache-tester"
TRACE = str((KV_TRACES / "trace_0002.json.gz").resolve())

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


class Downloads:
    """The files behind the download buttons drawn while the ``downloads`` fixture is active."""

    def __init__(self) -> None:
        self.files: dict = {}

    def of(self, button) -> tuple[str, bytes]:
        """(file name, bytes) a download button offers."""
        file_id = button.proto.url.rsplit("/", 1)[-1].split(".")[0]
        f = self.files[file_id]
        return f.filename, f.content


@pytest.fixture
def downloads(monkeypatch):
    """Keep every file AppTest's media storage is given (it drops them when a run ends). Ask for it
    before ``app``."""
    from streamlit.runtime.memory_media_file_storage import MemoryMediaFileStorage
    from streamlit.testing.v1 import app_test

    kept = Downloads()

    class Keeping(MemoryMediaFileStorage):
        def load_and_get_id(self, path_or_data, mimetype, kind, filename=None):
            file_id = super().load_and_get_id(path_or_data, mimetype, kind, filename)
            kept.files[file_id] = self._files_by_id[file_id]
            return file_id

    monkeypatch.setattr(app_test, "MemoryMediaFileStorage", Keeping)
    return kept


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


def set_plan(at, targets: str | None = None, field: str | None = None, lo=None, hi=None, *, load=None,
             duration=SMALL_DURATION_S, synthetic=SMALL_SYNTHETIC, workers=2, max_runs=4, other: str | None = None):
    """Fill the Plan page's inputs (each ``set_value`` reruns the page, as a user's edit does)."""
    if targets is not None:
        by_label(at.text_area, "Targets").set_value(targets).run()
    if field is not None:
        by_label(at.selectbox, "Variable").set_value(field).run()
    if other is not None:
        by_label(at.text_input, "Field (section.field)").set_value(other).run()
    if lo is not None:
        by_label(at.number_input, "From (LO)").set_value(lo).run()
    if hi is not None:
        by_label(at.number_input, "To (HI)").set_value(hi).run()
    if load is not None:
        by_label(at.number_input, "Sessions per run").set_value(load).run()
    by_label(at.number_input, "Seconds per run").set_value(float(duration)).run()
    by_label(at.number_input, "Synthetic sessions").set_value(synthetic).run()
    by_label(at.number_input, "Points per round").set_value(workers).run()
    by_label(at.number_input, "Max runs").set_value(max_runs).run()
