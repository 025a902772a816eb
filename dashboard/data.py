"""The dashboard's only ``st.cache_data`` wrappers around kvpool functions the CLI also uses.

Every cached function is keyed on the scenario as TOML text (``kvpool.scenario.to_toml``) plus
its plain arguments, so the same inputs never rerun a simulation, across pages and sessions:

    * ``builtin(name)``: a built-in scenario's raw table and label (``kvpool.scenario.load.read_raw``);
    * ``derived(toml)``: the derived figures ``kvpool scenario show`` prints (``summarize``);
    * ``sweep(toml, loads, traces)``: ``kvpool.sim.run.sweep``, exactly what ``kvpool sim run`` calls,
      with a progress bar while it runs (the bar is created and removed inside, so a cached replay
      shows nothing);
    * ``decode_series(toml, load, traces)``: the decode KV occupancy time series of one load, which
      ``run_point`` does not export yet: one more simulation of that load, reading
      ``Simulation.timeline.decode_t/decode_occ``.

Importing this module calls no Streamlit element (the decorators only wrap).
"""

from __future__ import annotations

import os
import tomllib

import streamlit as st

from kvpool.scenario import Scenario, summarize
from kvpool.scenario.load import read_raw, validate

MAX_ENTRIES = 64


def scenario(toml_text: str, source: str = "dashboard") -> Scenario:
    """A validated scenario from TOML text (cheap; not cached)."""
    return validate(tomllib.loads(toml_text), source)


@st.cache_data(show_spinner=False, max_entries=MAX_ENTRIES)
def builtin(name: str) -> tuple[dict, str]:
    return read_raw(name)


@st.cache_data(show_spinner=False, max_entries=MAX_ENTRIES)
def derived(toml_text: str) -> dict:
    return summarize(scenario(toml_text))


@st.cache_data(show_spinner=False, max_entries=MAX_ENTRIES)
def sweep(toml_text: str, loads: tuple[float, ...], traces: str | None = None, _workers: int = 0) -> list[dict]:
    """``kvpool.sim.run.sweep`` over ``loads`` (results in load order), with a progress bar."""
    from kvpool.sim.run import load_key
    from kvpool.sim.run import sweep as run_sweep

    s = scenario(toml_text)
    workers = _workers or min(len(loads), os.cpu_count() or 1)
    bar = st.progress(0.0, text=f"simulating {s.name}: 0/{len(loads)} loads")
    done: list[float] = []

    def on_done(load: float, _result: dict) -> None:
        done.append(load)
        bar.progress(len(done) / len(loads), text=f"simulating {s.name}: {len(done)}/{len(loads)} loads "
                                                     f"(last: {load:g} {load_key(s)})")

    try:
        return run_sweep(s, list(loads), traces=traces, workers=workers, on_done=on_done)
    finally:
        bar.empty()


@st.cache_data(show_spinner="simulating the decode KV occupancy of one load...", max_entries=MAX_ENTRIES)
def decode_series(toml_text: str, load: float, traces: str | None = None) -> tuple[list[float], list[float]]:
    """(t_s, occupancy) of the decode KV over one simulation of ``load``, as ``run_point`` runs it."""
    from kvpool.sim.engine import Simulation
    from kvpool.sim.run import make_replay, workload_for

    s = scenario(toml_text)
    sim = Simulation(s, make_replay(s, workload_for(s, traces), load))
    sim.run()
    t, occ = sim.timeline.decode_t, sim.timeline.decode_occ
    step = max(1, len(t) // 400)
    return list(t[::step]), list(occ[::step])
