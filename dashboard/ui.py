"""Small Streamlit helpers the pages share: kept widgets, run settings, error lists, downloads.

Nothing here runs at import; every function draws into the page that calls it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import streamlit as st

from kvpool.dashboard import knobs
from kvpool.scenario import Scenario, ScenarioError

# Defaults of the Run and Compare pages: short runs, so a four-load sweep takes seconds, not minutes.
DEFAULT_DURATION_S = 300.0
DEFAULT_SYNTHETIC_SESSIONS = 40
DEFAULT_LOADS = {"sessions": "56,72,96,112", "rps": "0.6,0.8,1.0,1.2"}
LOAD_LABELS = {"sessions": "Sessions (AgentX lanes), comma-separated", "rps": "Requests per second, comma-separated"}


WARM_MODULES = ("pandas", "altair", "kvpool.sim.run", "kvpool.sim.engine", "kvpool.sim.plan",
                "kvpool.dashboard.results", "kvpool.dashboard.charts")
_warm_thread: threading.Thread | None = None  # the thread warm_imports started, if any


def warm_imports() -> None:
    """Import what the Run and Compare pages need in a background thread, once per server process.

    The first page a browser opens then does not wait for pandas, Altair and the simulator
    (about 2 s on the 2-core development machine), and neither does the first visit to Run.
    """
    import importlib
    import sys

    global _warm_thread
    if all(m in sys.modules for m in WARM_MODULES):
        return

    def warm() -> None:
        try:
            for name in WARM_MODULES:
                importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the page that needs the module reports the failure itself
            return

    _warm_thread = threading.Thread(target=warm, name="kvpool-dashboard-warm-imports", daemon=True)
    _warm_thread.start()


def finish_warm_imports() -> None:
    """Wait until the imports of ``warm_imports`` are done. Call it before starting worker processes:
    a process forked while another thread is inside an import inherits that import's lock held,
    and hangs on its first import of the same module."""
    if _warm_thread is not None:
        _warm_thread.join()


def kept(widget: Callable[..., Any], key: str, default: Any, **kwargs: Any) -> Any:
    """Draw ``widget`` under ``key`` and keep its value when the user visits another page.

    Streamlit forgets the state of widgets a run does not draw; the value is copied to
    ``keep:<key>`` and restored from there.
    """
    store = f"keep:{key}"
    if key not in st.session_state:
        st.session_state[key] = st.session_state.get(store, default)
    value = widget(key=key, **kwargs)
    st.session_state[store] = value
    return value


def show_errors(lines: Sequence[str], title: str = "") -> None:
    """One ``st.error`` per problem line (each names its field)."""
    if title and lines:
        st.markdown(f"**{title}**")
    for line in lines:
        st.error(line, icon=":material/error:")


@dataclass(frozen=True)
class RunSettings:
    loads: list[float]
    duration_s: float
    synthetic_sessions: int
    workers: int

    def overrides(self) -> list[str]:
        """The ``--set`` lines the run adds to the scenario (what ``--duration`` does in the CLI)."""
        return [knobs.override_text("workload.duration_s", float(self.duration_s)),
                knobs.override_text("workload.synthetic_sessions", int(self.synthetic_sessions))]

    def cli(self, scenario_file: str, key: str) -> str:
        """The equivalent ``kvpool sim run`` command line."""
        loads = ",".join(f"{x:g}" for x in self.loads)
        return (f"kvpool sim run {scenario_file} --{key} {loads} --duration {self.duration_s:g} "
                f"--set workload.synthetic_sessions={int(self.synthetic_sessions)} --json")


MAX_WORKERS = 64  # processes one dashboard run may start


def run_settings(prefix: str, key: str, default_loads: str | None = None) -> tuple[RunSettings | None, list[str]]:
    """The loads and run length inputs (inside the caller's form); returns settings or error lines."""
    from kvpool.errors import UserError
    from kvpool.loads import parse_loads

    c1, c2, c3, c4 = st.columns([3, 1.2, 1.2, 1])
    text = kept(c1.text_input, f"{prefix}_loads_{key}", default_loads or DEFAULT_LOADS[key], label=LOAD_LABELS[key],
                help="The loads of the sweep: AgentX lanes (sessions) or production-replay requests per second.")
    duration = kept(c2.number_input, f"{prefix}_duration", DEFAULT_DURATION_S, label="Seconds per load",
                    step=60.0, help="workload.duration_s for this run (the measured window). The built-in "
                    "scenarios use 3600 s, which takes tens of seconds per load; short runs are for exploring.")
    synth = kept(c3.number_input, f"{prefix}_synth", DEFAULT_SYNTHETIC_SESSIONS, label="Synthetic sessions",
                 step=10, help="workload.synthetic_sessions: sessions the synthetic preset generates "
                 "(ignored when the scenario replays a trace set).")
    workers = kept(c4.number_input, f"{prefix}_workers", min(4, os.cpu_count() or 1), label="Workers", step=1,
                   help="Processes running loads in parallel (results do not depend on it).")
    errors = []
    loads: list[float] = []
    try:
        loads = parse_loads(text, LOAD_LABELS[key].split(",")[0], key == "sessions", f"workload.{key}")
        if not loads:
            errors.append(f"{LOAD_LABELS[key].split(',')[0]}: give at least one load, e.g. {DEFAULT_LOADS[key]}")
    except UserError as e:
        errors.append(str(e))
    if workers < 1:
        errors.append(f"Workers: value {workers}: must be at least 1")
    elif workers > MAX_WORKERS:
        errors.append(f"Workers: value {workers}: at most {MAX_WORKERS}")
    if errors:
        return None, errors
    return RunSettings(loads, float(duration), int(synth), int(workers)), []


def scenario_for_run(toml_text: str, label: str, settings: RunSettings) -> tuple[Scenario | None, list[str]]:
    """The scenario with the run's duration and synthetic-session overrides, validated."""
    import tomllib

    try:
        s = knobs.edited(tomllib.loads(toml_text), settings.overrides(), label)
    except ScenarioError as e:
        return None, knobs.error_lines(e)
    if s.workload.traces:
        from kvpool.workload.errors import TraceError
        from kvpool.workload.load import trace_files

        try:
            trace_files(s.workload.traces)
        except TraceError as e:
            return None, [f"{label}: workload.traces: value {s.workload.traces!r}: {e.message} "
                          "(give a trace file or directory, or leave it empty for the synthetic preset)"]
    return s, []


def downloads(rows: Sequence[dict], scenario_name: str, prefix: str) -> None:
    """CSV and JSON of the results: the keys and values of ``kvpool sim run``'s files."""
    from kvpool.dashboard import results  # pandas: only the pages with results pay for it

    name = results.stem(scenario_name, rows)
    c1, c2, _ = st.columns([1, 1, 3])
    c1.download_button("Download CSV", results.to_csv(rows), file_name=f"{name}.csv", mime="text/csv",
                       key=f"{prefix}_csv", icon=":material/download:")
    c2.download_button("Download JSON", results.to_json(rows), file_name=f"{name}.json", mime="application/json",
                       key=f"{prefix}_json", icon=":material/download:")


def simulate(toml_text: str, loads: Sequence[float], traces: str | None, workers: int) -> tuple[list[dict] | None, str]:
    """``data.sweep`` with the simulator's failures turned into a message instead of a traceback."""
    from kvpool.dashboard import data
    from kvpool.workload.errors import TraceError

    try:
        return data.sweep(toml_text, tuple(float(x) for x in loads), traces, _workers=workers), ""
    except TraceError as e:
        return None, f"workload: {e}"
    except Exception as e:  # noqa: BLE001 - the simulator is under development; show, don't crash
        return None, f"the simulator failed: {type(e).__name__}: {e}"
