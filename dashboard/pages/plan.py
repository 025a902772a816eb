"""Plan page: the capacity search. It has not landed in the simulator yet; the page says so plainly."""

from __future__ import annotations

import streamlit as st

from kvpool.dashboard import data, state, ui


def render() -> None:
    st.title("Plan")
    st.warning(
        "**The capacity search has not landed yet.** `kvpool sim plan` (the smallest pool, the fewest servers "
        "and the most sessions that meet reuse and TTFT targets, with the explored curve) is still being built "
        "in the simulator, so this page shows no search results. Nothing here is estimated or made up.",
        icon=":material/construction:",
    )
    st.markdown(
        "Until it lands you can explore by hand:\n"
        "- **Scenario**: change the pool size (`pool.gib_per_service`, `pool.services_per_server`) or the servers;\n"
        "- **Run**: sweep sessions and read reuse, the pool share and TTFT p90 against your targets;\n"
        "- **Compare**: put several sizes (download each edited scenario, or use the built-ins) side by side."
    )
    cur = state.current()
    if cur.scenario is None:
        ui.show_errors(cur.errors, "The scenario being edited does not validate:")
        return
    d = data.derived(cur.toml)
    st.subheader(f"What {cur.scenario.name} provides (analytical, from the scenario alone)")
    st.caption("These figures come from `kvpool scenario show` (no simulation): the capacities a search would trade off.")
    c = st.columns(4)
    c[0].metric("Pool capacity", f"{d['pool_capacity_tib']:.2f} TiB")
    c[1].metric("Pool capacity (tokens)", f"{d['pool_capacity_tokens']:,}")
    c[2].metric("Sessions of 10 GiB history", f"{d['pool_sessions_10gib']:.0f}")
    c[3].metric("GPUs", d["gpus"])


render()
