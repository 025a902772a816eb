"""Compare page: two or more scenarios (or arms, e.g. split vs shared pool) at the same loads, with ratios."""

from __future__ import annotations

import streamlit as st

from kvpool.dashboard import charts, data, knobs, results, state, ui
from kvpool.scenario import to_toml
from kvpool.sim.run import load_key

EDITED = "edited: "
DEFAULT_PAIR = ["mi350x-6p2d-split", "mi350x-6p2d-shared"]
LAST = "compare_last"


def _choices(cur) -> list[str]:
    from kvpool.scenario import builtin_names

    names = builtin_names()
    if cur.scenario is not None:
        names = [EDITED + cur.scenario.name] + names
    return names


def _toml_of(choice: str, cur) -> tuple[str, str]:
    """(scenario TOML, label) of a choice: the edited scenario or a built-in."""
    if choice.startswith(EDITED):
        return cur.toml, cur.label
    raw, label = data.builtin(choice)
    return to_toml(knobs.edited(raw, [], label)), label


def _cli(picked: list[str], names: dict[str, str], settings: ui.RunSettings, key: str) -> str:
    """The equivalent ``kvpool sim compare`` line: built-ins by name, the edited scenario as its TOML file."""
    args = [f"{names[c]}.toml" if c.startswith(EDITED) else c for c in picked]
    loads = ",".join(f"{x:g}" for x in settings.loads)
    return (f"kvpool sim compare {' '.join(args)} --{key} {loads} --duration {settings.duration_s:g} "
            f"--set workload.synthetic_sessions={int(settings.synthetic_sessions)} --json")


def render() -> None:
    st.title("Compare")
    st.caption("Run two or more scenarios (or arms, e.g. the seed's Figure 8 split vs shared pool) at the same loads "
               "and read each against the first (the baseline): what `kvpool sim compare` does. Each scenario runs "
               "through the same sweep as the Run page, so the numbers are the CLI's.")
    cur = state.current()
    options = _choices(cur)
    default = [c for c in DEFAULT_PAIR if c in options]
    for k in ("compare_pick", "keep:compare_pick"):  # drop picks that are no longer offered
        if k in st.session_state:
            st.session_state[k] = [c for c in st.session_state[k] if c in options]
    with st.form("compare_form"):
        picked = ui.kept(st.multiselect, "compare_pick", default, label="Scenarios (the first is the baseline)",
                         options=options, help="Built-in scenarios, and the one being edited on the Scenario page.")
        kinds = {c: load_key(data.scenario(*_toml_of(c, cur))) for c in picked}
        key = next(iter(kinds.values()), "sessions")
        settings, errors = ui.run_settings("compare", key, default_loads="56,112" if key == "sessions" else None)
        go = st.form_submit_button("Run comparison", type="primary", icon=":material/play_arrow:")
    if go:
        if len(picked) < 2:
            errors.append("Scenarios: pick at least two to compare")
        if len(set(kinds.values())) > 1:
            errors.append("Scenarios: they must share a load kind (all AgentX sessions or all replay RPS); picked: "
                          + ", ".join(f"{c} ({k})" for c, k in kinds.items()))
        runs, names = {}, {}
        if not errors and settings is not None:
            for c in picked:
                s, errs = ui.scenario_for_run(*_toml_of(c, cur), settings)
                errors += errs
                if s is not None:
                    runs[s.name if not c.startswith(EDITED) else c] = to_toml(s)
                    names[c] = s.name
        ui.show_errors(errors)
        if not errors and settings is not None:
            st.session_state[LAST] = (runs, tuple(settings.loads), settings.workers)
            st.session_state["compare_cli"] = _cli(picked, names, settings, key)
    last = st.session_state.get(LAST)
    if last is None:
        st.info("Pick the scenarios and loads, then press **Run comparison**. Each scenario's sweep is cached "
                "like the Run page's.")
        return
    tomls, loads, workers = last
    runs: dict[str, list[dict]] = {}
    for name, toml_text in tomls.items():
        rows, err = ui.simulate(toml_text, loads, None, workers)
        if err:
            ui.show_errors([f"{name}: {err}"])
            return
        runs[name] = rows
    names = list(runs)
    key = results.load_name(runs[names[0]])
    frame = results.compare_frame(runs)
    ratio = results.ratio_frame(runs, names[0])
    st.subheader(f"Ratios to {names[0]}")
    st.dataframe(ratio, hide_index=True, width="stretch",
                 column_config={c: st.column_config.NumberColumn(format="%.3f") for c in ratio.columns[2:]})
    c1, c2 = st.columns(2)
    c1.altair_chart(charts.compare_metric(frame, key, "throughput_per_gpu_tok_s", "Throughput per GPU (tok/s)", ",.0f"),
                    width="stretch")
    c2.altair_chart(charts.compare_metric(frame, key, "reuse", "Reuse (GPU + pool share)", ".1%"), width="stretch")
    c1, c2 = st.columns(2)
    c1.altair_chart(charts.compare_metric(frame, key, "ttft_p90_s", "TTFT p90 (s)", ".2f"), width="stretch")
    if len(ratio):
        c2.altair_chart(charts.ratios(ratio, key), width="stretch")
    st.subheader("All metrics")
    st.dataframe(frame, hide_index=True, width="stretch")
    by_name = {data.scenario(t).name: runs[n] for n, t in tomls.items()}  # the CLI's keys: scenario names
    c1, c2, _ = st.columns([1.3, 1.3, 3])
    c1.download_button("Download comparison CSV", frame.to_csv(index=False), file_name="compare.csv", mime="text/csv",
                       icon=":material/download:")
    if len(by_name) == len(runs):
        c2.download_button("Download comparison JSON", results.compare_json(by_name), mime="application/json",
                           file_name="compare-" + "-vs-".join(by_name) + ".json", icon=":material/download:")
    st.caption("The same numbers from the command line (`--json` prints `{scenario name: [per-load objects]}`; "
               "the edited scenario is the TOML downloaded from the Scenario page):")
    st.code(st.session_state.get("compare_cli", ""), language="bash")
    if len(by_name) < len(runs):
        st.caption("Two of these scenarios share a name; `kvpool sim compare` needs distinct names (rename the edited "
                   "one with a `name=...` line in the Scenario page's Advanced tab).")


render()
