"""The dashboard's only ``st.cache_data`` wrappers around kvpool functions the CLI also uses.

Every cached function is keyed on the scenario as TOML text (``kvpool.scenario.to_toml``) plus
its plain arguments, so the same inputs never rerun a simulation, across pages and sessions:

    * ``builtin(name)``: a built-in scenario's raw table and label (``kvpool.scenario.load.read_raw``);
    * ``derived(toml)``: the derived figures ``kvpool scenario show`` prints (``summarize``);
    * ``sweep(toml, loads, traces)``: ``kvpool.sim.run.sweep``, exactly what ``kvpool sim run`` calls,
      with a progress bar while it runs (the bar is created and removed inside, so a cached replay
      shows nothing);
    * ``plan(toml, targets, vary, load, workers, max_runs, ...)``: ``kvpool.sim.plan.search``, what
      ``kvpool sim plan`` calls, returning the document its ``--json`` prints
      (``kvpool.sim.documents.plan_document``), with a progress bar that advances per run.

Importing this module calls no Streamlit element (the decorators only wrap).
"""

from __future__ import annotations

import os
import tomllib

import streamlit as st

from kvpool.dashboard.ui import finish_warm_imports
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
    finish_warm_imports()  # before the sweep forks its workers
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


@st.cache_data(show_spinner=False, max_entries=MAX_ENTRIES)
def plan(toml_text: str, targets: tuple[str, ...], vary: str, load: float | None, workers: int, max_runs: int,
         source: str = "dashboard", set_lines: tuple[str, ...] = (), overrides: tuple[str, ...] = (),
         command: str | None = None) -> dict:
    """The capacity search of ``kvpool sim plan`` on the scenario; returns the document it writes
    (``kvpool.sim.documents.plan_document``: id, provenance, the verdict and curve, run).

    ``targets`` are ``--target`` texts, ``vary`` the ``--vary`` text, ``load`` ``--load`` (None: the
    scenario's load; ignored when the variable is the load). The explored points depend on
    ``workers`` (points per round), so it is part of the key. ``source``, ``set_lines`` and
    ``overrides`` are the equivalent command's scenario argument, ``--set`` lines and every override
    (its provenance); ``command`` that command line. Raises ``PlanError`` on bad inputs.
    """
    from kvpool.sim import documents
    from kvpool.sim import plan as pl

    s = scenario(toml_text)
    parsed = [pl.parse_target(t) for t in targets]
    variable = pl.parse_vary(vary, s)
    bar = st.progress(0.0, text=f"searching {variable.field} in {variable.lo:g}..{variable.hi:g}: "
                                f"running both ends (at most {max_runs} runs)")
    runs: list[float] = []

    def on_run(value: float, _row: dict, meets: bool) -> None:
        runs.append(value)
        bar.progress(min(1.0, len(runs) / max_runs),
                     text=f"searching {variable.field}: run {len(runs)} (at most {max_runs}): "
                          f"{variable.field}={value:g} {'meets' if meets else 'fails'} the targets")

    finish_warm_imports()  # before the search forks its workers
    try:
        result = pl.search(s, variable, parsed, load=load, workers=workers, max_runs=max_runs, on_run=on_run)
    finally:
        bar.empty()
    return documents.plan_document(s, result, documents.Inputs(source, set_lines, overrides),
                                   documents.Execution("kvpool dashboard (Plan page)", "local", workers, command=command),
                                   documents.Search(vary, load, workers, max_runs))
