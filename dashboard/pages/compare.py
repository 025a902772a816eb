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


def render() -> None:
    st.title("Compare")
    st.caption("Run two or more scenarios at the same loads and read each against the first (the baseline). "
               "The four-server comparison of the seed's Figure 8 (`kvpool sim compare`) has not landed yet; "
               "this page runs each scenario through the same sweep as the Run page.")
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
        runs = {}
        if not errors and settings is not None:
            for c in picked:
                s, errs = ui.scenario_for_run(*_toml_of(c, cur), settings)
                errors += errs
                if s is not None:
                    runs[s.name if not c.startswith(EDITED) else c] = to_toml(s)
        ui.show_errors(errors)
        if not errors and settings is not None:
            st.session_state[LAST] = (runs, tuple(settings.loads), settings.workers)
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
    st.download_button("Download comparison CSV", frame.to_csv(index=False), file_name="compare.csv", mime="text/csv",
                       icon=":material/download:")


render()
