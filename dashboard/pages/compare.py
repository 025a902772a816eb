"""Compare page: two or more scenarios (or arms, e.g. split vs shared pool) at the same loads, with ratios."""

from __future__ import annotations

import streamlit as st

from kvpool.dashboard import charts, data, knobs, results, state, ui
from kvpool.scenario import to_toml
from kvpool.sim.run import load_key

EDITED = "edited: "
DEFAULT_PAIR = ["mi350x-6p2d-shared", "mi350x-6p2d-split"]  # the seed's Figure 8, read as shared over split
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


def _source(choice: str, name: str) -> str:
    """The scenario as the equivalent command names it: a built-in by name, the edited one as its TOML file."""
    return f"{name}.toml" if choice.startswith(EDITED) else choice


def _cli(sources: list[str], settings: ui.RunSettings) -> str:
    """The equivalent ``kvpool sim compare`` line."""
    return f"kvpool sim compare {' '.join(sources)} {settings.flags()} --json"


def render() -> None:
    st.title("Compare")
    st.caption("Run two or more scenarios (or arms, e.g. the seed's Figure 8 shared vs split pool) at the same "
               "loads and read the first (the reference) over each other: what `kvpool sim compare` does. A "
               "throughput ratio above 1 means the reference is faster; a TTFT ratio below 1 that it answers "
               "sooner. Each scenario runs through the same sweep as the Run page, so the numbers are the CLI's.")
    cur = state.current()
    options = _choices(cur)
    default = [c for c in DEFAULT_PAIR if c in options]
    for k in ("compare_pick", "keep:compare_pick"):  # drop picks that are no longer offered
        if k in st.session_state:
            st.session_state[k] = [c for c in st.session_state[k] if c in options]
    with st.form("compare_form"):
        picked = ui.kept(st.multiselect, "compare_pick", default, label="Scenarios (the first is the reference)",
                         options=options, help="Built-in scenarios, and the one being edited on the Scenario page.")
        picked_s = {c: data.scenario(*_toml_of(c, cur)) for c in picked}
        kinds = {c: load_key(x) for c, x in picked_s.items()}
        key = next(iter(kinds.values()), "sessions")
        settings, errors = ui.run_settings("compare", key, list(picked_s.values()),
                                           default_loads="56,112" if key == "sessions" else None,
                                           follow_scenario=False)
        go = st.form_submit_button("Run comparison", type="primary", icon=":material/play_arrow:")
    if go:
        if len(picked) < 2:
            errors.append("Scenarios: pick at least two to compare")
        if len(set(kinds.values())) > 1:
            errors.append("Scenarios: they must share a load kind (all AgentX sessions or all replay RPS); picked: "
                          + ", ".join(f"{c} ({k})" for c, k in kinds.items()))
        runs, sources = {}, {}
        if not errors and settings is not None:
            for c in picked:
                s, errs = ui.scenario_for_run(*_toml_of(c, cur), settings)
                errors += errs
                if s is not None:
                    label = s.name if not c.startswith(EDITED) else c
                    runs[label] = to_toml(s)
                    sources[label] = _source(c, s.name)
        ui.show_errors(errors)
        if not errors and settings is not None:
            st.session_state[LAST] = (runs, sources, tuple(settings.loads), settings,
                                      [to_toml(x) for x in picked_s.values()])
    last = st.session_state.get(LAST)
    if last is None:
        st.info("Pick the scenarios and loads, then press **Run comparison**: each scenario's own window by "
                "default. Each scenario's sweep is cached like the Run page's.")
        return
    tomls, sources, loads, settings, picked_tomls = last
    runs: dict[str, list[dict]] = {}
    for name, toml_text in tomls.items():
        rows, err = ui.simulate(toml_text, loads, None, settings.workers)
        if err:
            ui.show_errors([f"{name}: {err}"])
            return
        runs[name] = rows
    names = list(runs)
    key = results.load_name(runs[names[0]])
    frame = results.compare_frame(runs)
    ratio = results.ratio_frame(runs)
    cli = _cli(list(sources.values()), settings)
    ui.short_window([data.scenario(t) for t in picked_tomls], settings)
    st.subheader(f"Ratios: {names[0]} over {', '.join(names[1:])}")
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
    arms_s = [data.scenario(t) for t in tomls.values()]
    if len({s.name for s in arms_s}) == len(arms_s):
        from kvpool.outputs import safe_name
        from kvpool.sim.documents import Execution, compare_document

        by_name = {s.name: runs[n] for s, n in zip(arms_s, tomls)}  # the CLI's keys: scenario names
        doc = compare_document(arms_s, by_name, [settings.inputs(sources[n]) for n in tomls],
                               Execution("kvpool dashboard (Compare page)", "local", settings.workers, command=cli))
        ui.show_warnings(doc.get("warnings", []))
        stem = "compare-" + safe_name("-vs-".join(by_name)) + f"-{doc['id']}"
        c1, c2, _ = st.columns([1.3, 1.3, 3])
        c1.download_button("Download comparison JSON", results.document_json(doc), mime="application/json",
                           file_name=f"{stem}.json", icon=":material/download:",
                           help="The document `kvpool sim compare` writes: each arm's provenance (scenario and "
                                "its hash, overrides, seed, workload, window, loads, kvpool version), the "
                                "results, the ratios, the run.")
        c2.download_button("Download comparison CSV", results.compare_csv(by_name), file_name=f"{stem}.csv",
                           mime="text/csv", icon=":material/download:",
                           help="The CSV `kvpool sim compare` writes; its name ends in the JSON's id.")
    else:
        st.caption("Two of these scenarios share a name; `kvpool sim compare` needs distinct names (rename the edited "
                   "one with a `name=...` line in the Scenario page's Advanced tab), so there is no download.")
    st.caption("The same numbers from the command line (`--json` prints the document the JSON download holds; "
               "the edited scenario is the TOML downloaded from the Scenario page):")
    st.code(cli, language="bash")


render()
