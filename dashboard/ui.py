"""Small Streamlit helpers the pages share: kept widgets, run settings, error lists, warnings, downloads.

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

# The Run and Compare pages start from the scenario's own measured window and synthetic sessions
# (the built-ins measure an hour per load, or the seed's 900 s for Figure 8, over 200 synthetic
# sessions: a sweep takes seconds). A shorter window measures mostly each lane's cold start.
DEFAULT_LOADS = {"sessions": "56,72,96,112", "rps": "0.6,0.8,1.0,1.2"}
LOAD_LABELS = {"sessions": "Sessions (AgentX lanes), comma-separated", "rps": "Requests per second, comma-separated"}
SHORT_WINDOW_NOTE = ("A window shorter than the scenario's measures mostly the start of every lane: cold GPU "
                     "caches and an empty pool, so TTFT reads high and throughput low, and more load can look "
                     "slower. Use it to explore; trust the scenario's window.")


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
    """A run's inputs besides the scenario. ``duration_s`` and ``synthetic_sessions`` are None where
    the scenario's own value stands (no ``--duration``, no ``--set``), as in the CLI."""

    loads: list[float]
    duration_s: float | None
    synthetic_sessions: int | None
    workers: int
    key: str = "sessions"

    def set_lines(self) -> list[str]:
        """The ``--set`` lines of the equivalent command."""
        if self.synthetic_sessions is None:
            return []
        return [knobs.override_text("workload.synthetic_sessions", int(self.synthetic_sessions))]

    def loads_text(self) -> str:
        return ",".join(f"{x:g}" for x in self.loads)

    def overrides(self) -> list[str]:
        """Every override the run applies: the ``--set`` lines, then those ``--duration`` and
        ``--sessions``/``--rps`` stand for (``kvpool.run_inputs.run_overrides``, as the CLI)."""
        from kvpool.run_inputs import run_overrides

        loads = self.loads_text()
        return run_overrides(self.set_lines(), duration=self.duration_s,
                             sessions=loads if self.key == "sessions" else None,
                             rps=loads if self.key == "rps" else None)

    def flags(self) -> str:
        """The command line's run flags: ``--sessions 56,72 [--duration D] [--set ...]``."""
        text = f"--{self.key} {self.loads_text()}"
        if self.duration_s is not None:
            text += f" --duration {self.duration_s:g}"
        return text + "".join(f" --set {line}" for line in self.set_lines())

    def cli(self, scenario_file: str) -> str:
        """The equivalent ``kvpool sim run`` command line."""
        return f"kvpool sim run {scenario_file} {self.flags()} --json"

    def inputs(self, source: str):
        """The ``kvpool.sim.documents.Inputs`` of the equivalent command on ``source``."""
        from kvpool.sim.documents import Inputs

        return Inputs(source, tuple(self.set_lines()), tuple(self.overrides()))


MAX_WORKERS = 64  # processes one dashboard run may start


def run_settings(prefix: str, key: str, scenarios: Sequence[Scenario], default_loads: str | None = None,
                 follow_scenario: bool = True) -> tuple[RunSettings | None, list[str]]:
    """The loads and run length inputs (inside the caller's form); returns settings or error lines.

    The window and the synthetic sessions start at the first scenario's values; with
    ``follow_scenario`` a new value there resets them (the scenario changes on another page; the
    Compare page picks its scenarios in the same form, so it keeps what was typed). A value every
    scenario already has is no override.
    """
    from kvpool.errors import UserError
    from kvpool.loads import parse_loads

    own_duration = float(scenarios[0].workload.duration_s) if scenarios else 3600.0
    own_synth = int(scenarios[0].workload.synthetic_sessions) if scenarios else 200
    c1, c2, c3, c4 = st.columns([3, 1.2, 1.2, 1])
    text = kept(c1.text_input, f"{prefix}_loads_{key}", default_loads or DEFAULT_LOADS[key], label=LOAD_LABELS[key],
                help="The loads of the sweep: AgentX lanes (sessions) or production-replay requests per second.")
    suffix = (f":{own_duration:g}", f":{own_synth}") if follow_scenario else ("", "")
    duration = kept(c2.number_input, f"{prefix}_duration{suffix[0]}", own_duration, label="Seconds per load",
                    step=60.0, help=f"workload.duration_s for this run (the measured window); the scenario's is "
                    f"{own_duration:g} s. " + SHORT_WINDOW_NOTE)
    synth = kept(c3.number_input, f"{prefix}_synth{suffix[1]}", own_synth, label="Synthetic sessions",
                 step=10, help=f"workload.synthetic_sessions: sessions the synthetic preset generates (the "
                 f"scenario's: {own_synth}; ignored when the scenario replays a trace set).")
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
    errors += field_errors([("workload.duration_s", float(duration), "Seconds per load"),
                            ("workload.synthetic_sessions", int(synth), "Synthetic sessions")])
    if workers < 1:
        errors.append(f"Workers: value {workers}: must be at least 1")
    elif workers > MAX_WORKERS:
        errors.append(f"Workers: value {workers}: at most {MAX_WORKERS}")
    if errors:
        return None, errors
    same_duration = all(float(s.workload.duration_s) == float(duration) for s in scenarios)
    same_synth = all(int(s.workload.synthetic_sessions) == int(synth) for s in scenarios)
    return RunSettings(loads, None if same_duration else float(duration), None if same_synth else int(synth),
                       int(workers), key), []


def field_errors(values: Sequence[tuple[str, Any, str]]) -> list[str]:
    """The problems of (scenario field, value, input label) triples, each as the CLI names a flag's
    (``kvpool.scenario.fields.check``), with the input's label."""
    from kvpool.errors import UserError
    from kvpool.scenario.fields import check

    out = []
    for path, value, label in values:
        try:
            check(path, value, label)
        except UserError as e:
            out.append(str(e))
    return out


def short_window(scenarios: Sequence[Scenario], settings: RunSettings) -> None:
    """Say why the results mislead when the window is shorter than a scenario's own."""
    if settings.duration_s is not None and any(settings.duration_s < s.workload.duration_s for s in scenarios):
        own = ", ".join(dict.fromkeys(f"{s.workload.duration_s:g} s" for s in scenarios))
        st.warning(f"{settings.duration_s:g} s per load, the scenario's is {own}. {SHORT_WINDOW_NOTE}",
                   icon=":material/timer:")


def show_warnings(lines: Sequence[str]) -> None:
    """A document's ``warnings`` (loads whose result is no measurement), as the CLI prints them."""
    for line in lines:
        st.warning(f"Not a measurement: {line}", icon=":material/warning:")


def scenario_for_run(toml_text: str, label: str, settings: RunSettings) -> tuple[Scenario | None, list[str]]:
    """The scenario with the run's duration and synthetic-session overrides, validated."""
    import tomllib

    from kvpool.errors import UserError

    try:
        s = knobs.edited(tomllib.loads(toml_text), settings.overrides(), label)
    except ScenarioError as e:
        return None, knobs.error_lines(e)
    except UserError as e:  # a run setting out of its field's bounds
        return None, [str(e)]
    if s.workload.traces:
        from kvpool.workload.errors import TraceError
        from kvpool.workload.load import trace_files

        try:
            trace_files(s.workload.traces)
        except TraceError as e:
            return None, [f"{label}: workload.traces: value {s.workload.traces!r}: {e.message} "
                          "(give a trace file or directory, or leave it empty for the synthetic preset)"]
    return s, []


def downloads(doc: dict, csv_text: str, stem: str, prefix: str) -> None:
    """The JSON document (``kvpool.sim.documents``: id, provenance, results, run) and the CSV, as the
    CLI writes them, under the CLI's file names (``stem`` ends in the document's id)."""
    from kvpool.dashboard import results  # pandas: only the pages with results pay for it

    c1, c2, _ = st.columns([1, 1, 3])
    c1.download_button("Download JSON", results.document_json(doc), file_name=f"{stem}.json",
                       mime="application/json", key=f"{prefix}_json", icon=":material/download:",
                       help="The document `kvpool sim run` writes: what produced it (scenario and its hash, "
                            "overrides, seed, workload, window, loads, kvpool version), the results, the run.")
    c2.download_button("Download CSV", csv_text, file_name=f"{stem}.csv", mime="text/csv", key=f"{prefix}_csv",
                       icon=":material/download:", help="The CSV of the same run; its name ends in the JSON's id.")


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
