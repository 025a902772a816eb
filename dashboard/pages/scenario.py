"""Scenario page: pick a built-in or upload a TOML, edit the knobs, see derived figures, download."""

from __future__ import annotations

import streamlit as st

from kvpool.dashboard import data, knobs, state, ui
from kvpool.scenario import ScenarioError, builtin_names


def _pick_builtin() -> None:
    name = st.session_state["pick_builtin"]
    state.set_base(*data.builtin(name), choice=name)


def _load_upload(name: str, payload: bytes) -> None:
    try:
        raw, label = knobs.parse_upload(payload, name)
    except ScenarioError as e:
        st.session_state["upload_errors"] = knobs.error_lines(e)
        return
    st.session_state["upload_errors"] = []
    state.set_base(raw, label)


def _source() -> None:
    names = builtin_names()
    choice = st.session_state.get(state.BASE_CHOICE, "")
    c1, c2 = st.columns([1, 1])
    c1.selectbox("Built-in scenario", names, index=names.index(choice) if choice in names else None,
                 key="pick_builtin", on_change=_pick_builtin, placeholder=f"({st.session_state[state.BASE_LABEL]})",
                 help="The scenarios shipped in scenarios/*.toml (kvpool scenario list).")
    up = c2.file_uploader("…or upload a scenario TOML", type=["toml"], key="upload",
                          help="A file like `kvpool scenario show NAME --toml` prints; it must validate.")
    if up is not None and st.session_state.get("upload_seen") != up.file_id:
        st.session_state["upload_seen"] = up.file_id
        _load_upload(up.name, up.getvalue())
    with st.expander("…or paste a scenario TOML"):
        with st.form("paste_form", border=False):
            text = st.text_area("Scenario TOML", height=200, key="paste_text")
            if st.form_submit_button("Load pasted TOML"):
                _load_upload("pasted.toml", text.encode())
    ui.show_errors(st.session_state.get("upload_errors", []), "The uploaded scenario was not loaded:")


def _sync_edits(bid: str) -> None:
    """Copy the knob widgets' values (updated before this rerun) into the edits."""
    edits = st.session_state.setdefault(state.EDITS, {})
    for knob in knobs.KNOBS:
        key = f"knob:{bid}:{knob.path}"
        if key in st.session_state:
            edits[knob.path] = knobs.model_value(knob, st.session_state[key])
    if f"adv:{bid}" in st.session_state:
        st.session_state[state.ADVANCED] = st.session_state[f"adv:{bid}"]


def _knob(knob: knobs.Knob, base, bid: str, errors: list[str], where) -> None:
    key = f"knob:{bid}:{knob.path}"
    if key not in st.session_state:
        edits = st.session_state[state.EDITS]
        value = edits[knob.path] if knob.path in edits else knobs.value_at(base, knob.path)
        st.session_state[key] = knobs.widget_value(knob, value)
    label, help_ = knob.label, knob.help
    with where:
        if knob.kind == "bool":
            st.toggle(label, key=key, help=help_)
        elif knob.kind == "choice":
            st.selectbox(label, knob.choices(), key=key, help=help_)
        elif knob.kind == "int":
            st.number_input(label, step=1, key=key, help=help_)
        elif knob.kind == "float":
            st.number_input(label, step=knob.step, format="%g", key=key, help=help_)
        else:
            st.text_input(label, key=key, help=help_)
        for line in knobs.field_errors(errors, knob.path):
            st.error(line, icon=":material/error:")


def _derived(toml_text: str) -> None:
    d = data.derived(toml_text)
    c = st.columns(4)
    c[0].metric("GPUs (prefill + decode)", d["gpus"])
    c[1].metric("KV bytes per token", f"{d['kv_bytes_per_token']:,}")
    c[2].metric("Pool capacity", f"{d['pool_capacity_tib']:.2f} TiB", help=f"{d['pool_capacity_tokens']:,} tokens")
    c[3].metric("Pool / prefill GPU KV", f"{d['pool_to_prefill_gpu_kv_ratio'] or 0:.1f}x")
    c = st.columns(4)
    c[0].metric("Prefill GPU KV (tokens per instance)", f"{d['prefill_gpu_kv_capacity_tokens']:,}")
    c[1].metric("Decode KV (tokens per instance)", f"{d['decode_gpu_kv_capacity_tokens']:,}")
    c[2].metric("Sessions of 10 GiB the pool holds", f"{d['pool_sessions_10gib']:.0f}")
    c[3].metric("Handoff writes (naive → batched)", f"{d['handoff_writes_naive']:,} → {d['handoff_writes_batched']:,}")


def render() -> None:
    st.title("Scenario")
    st.caption("Pick a deployment, change the knobs that matter, and take the TOML to `kvpool sim run`. "
               "Every field is documented in docs/scenario.md.")
    state.ensure_base()
    _source()
    bid = state.base_id()
    _sync_edits(bid)
    base = state.base_scenario()
    cur = state.current()
    st.subheader(f"Editing {cur.scenario.name if cur.scenario else base.name}")
    st.caption(f"Base: {cur.label}" + (f" · {len(cur.overrides)} change(s)" if cur.overrides else ""))
    if cur.errors:
        ui.show_errors(cur.errors, "This scenario does not validate; fix the fields named below:")
    else:
        _derived(cur.toml)

    tabs = st.tabs(list(knobs.GROUPS) + ["Advanced"])
    for tab, group in zip(tabs, knobs.GROUPS):
        cols = tab.columns(3)
        for i, knob in enumerate(k for k in knobs.KNOBS if k.group == group):
            _knob(knob, base, bid, cur.errors, cols[i % 3])
    with tabs[-1]:
        adv = f"adv:{bid}"
        if adv not in st.session_state:
            st.session_state[adv] = st.session_state.get(state.ADVANCED, "")
        st.text_area("More overrides, one `section.field=value` per line (the CLI's --set)", key=adv,
                     placeholder="cost.prefill_mfu=0.15\npool.eviction_policy=\"lfu\"", height=140)
        matched = [e for e in cur.errors if not any(knobs.field_errors([e], k.path) for k in knobs.KNOBS)]
        ui.show_errors(matched)

    c1, c2, _ = st.columns([1, 1, 2])
    c1.download_button("Download scenario TOML", cur.toml or "", file_name=f"{(cur.scenario or base).name}.toml",
                       mime="application/toml", disabled=cur.scenario is None, icon=":material/download:")
    if c2.button("Reset edits", disabled=not cur.overrides):
        state.set_base(st.session_state[state.BASE_RAW], cur.label, st.session_state.get(state.BASE_CHOICE, ""))
        for k in [k for k in st.session_state if str(k).startswith(("knob:", "adv:"))]:
            del st.session_state[k]
        st.rerun()
    if cur.overrides:
        base_name = st.session_state.get(state.BASE_CHOICE) or "SCENARIO.toml"
        st.code(f"kvpool scenario show {base_name} " + " ".join(f"--set '{o}'" for o in cur.overrides), language="bash")


render()
