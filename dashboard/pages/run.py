"""Run page: a sweep of the current scenario over sessions (or RPS), with the seed's plots."""

from __future__ import annotations

import streamlit as st

from kvpool.dashboard import charts, data, results, state, ui
from kvpool.sim.run import load_key

LAST = "run_last"  # (run scenario TOML, loads, traces, RunSettings, edited scenario TOML, its name): what the page shows


_PERCENT = ("share_gpu", "share_pool", "share_computed", "reuse", "decode_kv_occupancy_p50")
_COLUMNS = {
    **{k: st.column_config.NumberColumn(format="percent") for k in _PERCENT},
    **{k: st.column_config.NumberColumn(format="%.3f") for k in ("ttft_p50_s", "ttft_p90_s", "restore_stage_s_p50",
                                                                    "restore_spread_s_mean")},
    **{k: st.column_config.NumberColumn(format="localized") for k in ("throughput_tok_s", "throughput_per_gpu_tok_s",
                                                                      "bytes_moved", "prompt_tokens", "output_tokens")},
}


def _charts(rows: list[dict]) -> None:
    key = results.load_name(rows)
    summary = results.summary_frame(rows)
    c1, c2 = st.columns(2)
    c1.altair_chart(charts.throughput(summary, key), width="stretch")
    c2.altair_chart(charts.token_sources(summary, key), width="stretch")
    from kvpool.sim.report import THROUGHPUT_NOTE

    st.caption(THROUGHPUT_NOTE)
    c1, c2 = st.columns(2)
    c1.altair_chart(charts.ttft(summary, key), width="stretch")
    restore = results.restore_frame(rows)
    if len(restore):
        c2.altair_chart(charts.restore_latency(restore), width="stretch")
    else:
        c2.info("No request restored from the pool in these runs, so there is no restore-latency distribution.")
    timeline = results.timeline_frame(rows)
    c1, c2 = st.columns(2)
    if len(timeline):
        c1.altair_chart(charts.pool_occupancy(timeline), width="stretch")
        c2.altair_chart(charts.evictions(timeline), width="stretch")
    else:
        c1.info("This scenario has no pool (no Store services), so there is no pool occupancy to plot.")
    c1, c2 = st.columns(2)
    c1.altair_chart(charts.decode_occupancy_p50(summary, key), width="stretch")
    decode = results.decode_frame(rows)
    if len(decode):
        c2.altair_chart(charts.decode_occupancy(decode), width="stretch")
    else:
        c2.info("These results carry no decode KV occupancy series; press Run sweep to simulate them again.")


def render() -> None:
    st.title("Run")
    cur = state.current()
    if cur.scenario is None:
        st.warning("The scenario being edited does not validate; fix it on the Scenario page.")
        ui.show_errors(cur.errors)
        st.page_link("pages/scenario.py", label="Go to the Scenario page", icon=":material/tune:")
        return
    s = cur.scenario
    key = load_key(s)
    st.caption(f"Scenario **{s.name}** ({cur.label}{', edited' if cur.overrides else ''}): {s.workload.mode} mode, "
               f"workload {'traces ' + s.workload.traces if s.workload.traces else 'synthetic preset ' + s.workload.preset}. "
               "Change it on the Scenario page.")
    with st.form("run_form"):
        settings, errors = ui.run_settings("run", key, [s])
        go = st.form_submit_button("Run sweep", type="primary", icon=":material/play_arrow:")
    if go:
        ui.show_errors(errors)
        if settings is not None:
            run_s, errors = ui.scenario_for_run(cur.toml, cur.label, settings)
            ui.show_errors(errors)
            if run_s is not None:
                from kvpool.scenario import to_toml

                st.session_state[LAST] = (to_toml(run_s), tuple(settings.loads), None, settings, cur.toml, s.name)
    last = st.session_state.get(LAST)
    if last is None:
        st.info("Set the loads and press **Run sweep**: the scenario's own window by default (an hour per "
                "load for the built-ins, a few seconds of simulation each). Results are cached: the same "
                "scenario and loads show again at once.")
        return
    toml_text, loads, traces, settings, source_toml, name = last
    rows, err = ui.simulate(toml_text, loads, traces, settings.workers)
    if err:
        ui.show_errors([err])
        return
    from kvpool.sim.documents import Execution, run_document
    from kvpool.sim.provenance import workload_label

    run_s = data.scenario(toml_text)
    cli = settings.cli(f"{name}.toml")
    doc = run_document(run_s, rows, settings.inputs(f"{name}.toml"),
                       Execution("kvpool dashboard (Run page)", "local", settings.workers, command=cli))
    prov = doc["provenance"]
    st.subheader(f"{run_s.name}: {len(rows)} load(s), {prov['duration_s']:g} s each")
    st.caption(f"{workload_label(prov['workload'])}, seed {prov['seed']}, result id `{doc['id']}` "
               "(the JSON download records what produced it).")
    if source_toml != cur.toml:
        st.caption("These results are of another version of the scenario; press Run sweep to update.")
    ui.short_window([data.scenario(source_toml)], settings)
    ui.show_warnings(doc.get("warnings", []))
    st.dataframe(results.summary_frame(rows), hide_index=True, width="stretch", column_config=_COLUMNS)
    ui.downloads(doc, results.to_csv(rows), results.stem(run_s.name, rows, doc["id"]), "run")
    st.caption("The same numbers from the command line (with the scenario TOML downloaded from the Scenario page):")
    st.code(cli, language="bash")
    _charts(rows)


render()
