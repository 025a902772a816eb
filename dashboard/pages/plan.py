"""Plan page: the capacity search of ``kvpool sim plan`` (``kvpool.sim.plan.search``) on the edited scenario.

Inputs: targets (one ``METRIC>=VALUE`` per line), the variable (a common field or any ``section.field``)
with its range, the load of every run, the run length, points per round and the most runs. Bad inputs
are named under the input they belong to (the ``PlanError`` / ``ScenarioError`` text the CLI prints);
the search runs with a progress bar per run; the result is the document ``kvpool sim plan --json`` prints.
"""

from __future__ import annotations

from kvpool.errors import UserError
from kvpool.scenario.fields import check

import shlex
from dataclasses import dataclass

import streamlit as st

from kvpool.dashboard import data, state, ui

LAST = "plan_last"
FAILED = "plan_failed"
OTHER = "other field (type it)"
COMMON = ("pool.gib_per_service", "pool.services_per_server", "cluster.servers")
RANGES: dict[str, tuple[float, float]] = {
    "pool.gib_per_service": (64.0, 768.0),
    "pool.services_per_server": (1, 8),
    "cluster.servers": (1, 4),
    "workload.sessions": (8, 160),
    "workload.rps": (0.2, 2.0),
}
DEFAULT_TARGETS = "reuse>=0.95\nttft_p90_s<=5"  # the README's example: met inside 64..768 GiB by the default scenario
DEFAULT_WORKERS = 2  # the CLI's --workers default: points evaluated per round
DEFAULT_MAX_RUNS = 8


def _num(x: float) -> str:
    """A number as the CLI would be given it: ``64``, ``0.2``, ``1e+20``, full precision (whole numbers
    past 2^53 in exponent form, so a huge input stays a short message)."""
    x = float(x)
    return str(int(x)) if x.is_integer() and abs(x) < 2**53 else repr(x)


@dataclass(frozen=True)
class Inputs:
    """One search: the plain values ``data.plan`` is keyed on, plus the run-length overrides."""

    targets: tuple[str, ...]
    field: str
    lo: float
    hi: float
    load: float | None  # None when the variable is the load itself
    duration_s: float | None  # None: the scenario's own (no --duration)
    synthetic_sessions: int | None  # None: the scenario's own (no --set)
    workers: int
    max_runs: int

    @property
    def vary(self) -> str:
        return f"{self.field}={_num(self.lo)}..{_num(self.hi)}"

    def cli(self, scenario_file: str) -> str:
        """The equivalent ``kvpool sim plan`` line (its ``--json`` prints what this page shows)."""
        parts = ["kvpool", "sim", "plan", scenario_file]
        for t in self.targets:
            parts += ["--target", t]
        parts += ["--vary", self.vary]
        if self.load is not None:
            parts += ["--load", _num(self.load)]
        if self.duration_s is not None:
            parts += ["--duration", _num(self.duration_s)]
        for line in self.set_lines():
            parts += ["--set", line]
        parts += ["--workers", str(self.workers), "--max-runs", str(self.max_runs), "--json"]
        return " ".join(shlex.quote(p) for p in parts)

    def set_lines(self) -> list[str]:
        return [] if self.synthetic_sessions is None else [f"workload.synthetic_sessions={self.synthetic_sessions}"]

    def provenance_inputs(self, scenario_file: str) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
        """(source, ``--set`` lines, every override) of the equivalent command, as ``kvpool sim plan`` records them."""
        from kvpool.run_inputs import run_overrides

        sets = self.set_lines()
        return scenario_file, tuple(sets), tuple(run_overrides(sets, duration=self.duration_s))


def _target_lines(text: str) -> tuple[list[str], list[str]]:
    """(targets, errors): one target per non-empty line, each parsed as ``--target`` is."""
    from kvpool.sim.plan import PlanError, parse_target

    targets, errors = [], []
    for i, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        try:
            parse_target(line)
            targets.append(line.replace(" ", ""))
        except PlanError as e:
            errors.append(f"Targets, line {i}: {e}")
    if not targets and not errors:
        errors.append("Targets: give at least one, one per line, e.g. reuse>=0.95 or ttft_p90_s<=2.5")
    return targets, errors


def _inputs(s, label: str, toml_text: str):
    """Draw the inputs; return (Inputs or None, the scenario of the runs or None), showing errors inline."""
    from kvpool.sim.plan import LOAD_FIELDS, INTEGER_FIELDS, PlanError, parse_vary
    from kvpool.sim.run import load_key

    key = load_key(s)
    load_field = f"workload.{key}"
    ok = True
    c1, c2 = st.columns(2)
    with c1:
        text = ui.kept(st.text_area, "plan_targets", DEFAULT_TARGETS, label="Targets, one per line",
                       height=110, help="METRIC>=VALUE (or <=, >, <) with a metric of `kvpool sim run --json` "
                       "(docs/metrics.md), e.g. reuse>=0.95, ttft_p90_s<=2.5, throughput_per_gpu_tok_s>=2000. "
                       "A run meets the targets when every line holds.")
        targets, errs = _target_lines(text)
        ui.show_errors(errs)
        ok &= not errs
    with c2:
        options = [*COMMON, load_field, OTHER]
        pick = ui.kept(st.selectbox, f"plan_field_{key}", options[0], label="Variable", options=options,
                       help="The field the search changes. Loads (workload.sessions, workload.rps) are maximized "
                       "(the most load that still meets the targets); every other field is minimized (the "
                       "smallest pool or cluster that meets them).")
        field = pick
        if pick == OTHER:
            field = ui.kept(st.text_input, "plan_field_other", "", label="Field (section.field)",
                            placeholder="e.g. prefill.instances", help="Any scenario field, in `--set` syntax.").strip()
        lo0, hi0 = RANGES.get(field, (0.0, 1.0))
        integer = field in INTEGER_FIELDS
        cast = int if integer else float
        r1, r2 = st.columns(2)
        step = 1 if integer else None
        lo = ui.kept(r1.number_input, f"plan_lo:{field}", cast(lo0), label="From (LO)", step=step)
        hi = ui.kept(r2.number_input, f"plan_hi:{field}", cast(hi0), label="To (HI)", step=step)
    run_cols = st.columns(5)
    is_load = field in LOAD_FIELDS
    load_default = int(s.workload.sessions) if key == "sessions" else float(s.workload.rps)
    load_label = "Sessions per run" if key == "sessions" else "Requests per second per run"
    load = ui.kept(run_cols[0].number_input, f"plan_load_{key}", load_default, label=load_label,
                   step=1 if key == "sessions" else 0.1, disabled=is_load,
                   help="The load of every run (`--load`; the scenario's by default). Not used when the variable "
                   "is the load itself.")
    own_duration, own_synth = float(s.workload.duration_s), int(s.workload.synthetic_sessions)
    duration = ui.kept(run_cols[1].number_input, f"plan_duration:{own_duration:g}", own_duration,
                       label="Seconds per run", step=60.0,
                       help=f"workload.duration_s of every run (`--duration`; the scenario's is {own_duration:g} s). "
                            + ui.SHORT_WINDOW_NOTE)
    synth = ui.kept(run_cols[2].number_input, f"plan_synth:{own_synth}", own_synth, label="Synthetic sessions",
                    step=10, help=f"workload.synthetic_sessions (the scenario's: {own_synth}; ignored when the "
                                  "scenario replays a trace set).")
    workers = ui.kept(run_cols[3].number_input, "plan_workers", DEFAULT_WORKERS, label="Points per round", step=1,
                      help="`--workers`: points evaluated in parallel per round. The points explored depend on it.")
    max_runs = ui.kept(run_cols[4].number_input, "plan_max_runs", DEFAULT_MAX_RUNS, label="Max runs", step=1,
                       help="`--max-runs`: the most simulator runs; the search stops narrowing there.")

    errors: list[str] = []
    if not field:
        errors.append("Variable: type a field, in section.field form (e.g. prefill.instances)")
    elif is_load and field != load_field:
        mode = "AgentX (sessions)" if key == "sessions" else "production replay (requests per second)"
        errors.append(f"Variable: {field} is not this scenario's load; it runs in {mode} mode, so vary {load_field}")
    if not is_load and load <= 0:
        errors.append(f"{load_label}: value {load:g}: must be > 0")
    elif not is_load:
        try:
            check(load_field, int(load) if key == "sessions" and float(load).is_integer() else load, load_label)
        except UserError as e:
            errors.append(str(e))
    errors += ui.field_errors([("workload.duration_s", float(duration), "Seconds per run"),
                               ("workload.synthetic_sessions", int(synth), "Synthetic sessions")])
    if workers < 1:
        errors.append(f"Points per round: value {workers}: must be at least 1")
    elif workers > ui.MAX_WORKERS:
        errors.append(f"Points per round: value {workers}: at most {ui.MAX_WORKERS}")
    if max_runs < 2:
        errors.append(f"Max runs: value {max_runs}: must be at least 2 (the search first runs both ends of the range)")
    elif max_runs > 1000:
        errors.append(f"Max runs: value {max_runs}: at most 1000")
    duration_s = None if float(duration) == own_duration else float(duration)
    synthetic = None if int(synth) == own_synth else int(synth)
    settings = ui.RunSettings([float(load)], duration_s, synthetic, int(workers), key)
    run_s, scenario_errors = ui.scenario_for_run(toml_text, label, settings)
    errors += scenario_errors
    if run_s is not None and field and not errors:
        try:
            parse_vary(f"{field}={_num(lo)}..{_num(hi)}", run_s)
        except PlanError as e:
            errors.append(f"Variable: {e}")
    ui.show_errors(errors)
    ok &= not errors
    if not ok or run_s is None:
        return None, None
    if duration_s is not None and duration_s < own_duration:
        st.warning(f"{duration_s:g} s per run, the scenario's is {own_duration:g} s. {ui.SHORT_WINDOW_NOTE}",
                   icon=":material/timer:")
    return Inputs(tuple(targets), field, float(lo), float(hi), None if is_load else float(load), duration_s,
                  synthetic, int(workers), int(max_runs)), run_s


def _search(run_toml: str, inp: Inputs, name: str) -> tuple[dict | None, str]:
    """``data.plan`` with failures turned into a message (never a traceback); ``name`` is the edited
    scenario's, whose TOML file the equivalent command names."""
    from kvpool.scenario import ScenarioError
    from kvpool.sim.plan import PlanError
    from kvpool.workload.errors import TraceError

    source, sets, overrides = inp.provenance_inputs(f"{name}.toml")
    try:
        return data.plan(run_toml, inp.targets, inp.vary, inp.load, inp.workers, inp.max_runs, source, sets,
                         overrides, inp.cli(f"{name}.toml")), ""
    except PlanError as e:
        return None, str(e)
    except ScenarioError as e:  # a point inside the range that does not validate (e.g. decode.tp=4.5)
        return None, f"a point of the search does not validate: {e}"
    except TraceError as e:
        return None, f"workload: {e}"
    except Exception as e:  # noqa: BLE001 - the simulator is under development; show, don't crash
        return None, f"the simulator failed: {type(e).__name__}: {e}"


def _verdict(summary: dict, inp: Inputs) -> None:
    from kvpool.dashboard import results

    field, best = summary["variable"], summary["best"]
    maximize = summary["direction"] == "maximize"
    targets = ", ".join(summary["targets"])
    if best is None:
        end = inp.lo if maximize else inp.hi
        st.error(f"**Nothing in range meets the targets**: no value of `{field}` in {_num(inp.lo)}..{_num(inp.hi)} "
                 f"meets {targets} (even {field}={_num(end)} fails). "
                 + ("Lower LO or relax the targets." if maximize else "Raise HI or relax the targets."),
                 icon=":material/block:")
        return
    c1, c2 = st.columns([1.3, 3])
    c1.metric(f"{'Largest' if maximize else 'Smallest'} {field}", f"{best:,.6g}",
              help=f"The {'largest' if maximize else 'smallest'} value found that meets every target ({targets}); "
                   f"{summary['runs']} simulator runs.")
    fails, meets = results.plan_bracket(summary)
    with c2:
        if fails is None:
            side = "HI" if maximize else "LO"
            st.info(f"Even {field}={best:g}, the {'top' if maximize else 'bottom'} of the range, meets every target: "
                    f"the threshold lies beyond it; widen the range ({side}) to search further.",
                    icon=":material/info:")
        else:
            st.success(f"`{field}` = **{best:,.6g}** meets {targets}; {fails:,.6g} fails. The threshold lies between "
                       "them (narrower with more max runs).", icon=":material/check_circle:")


def _results(summary: dict, inp: Inputs, run_name: str) -> None:
    from kvpool.dashboard import charts, results
    from kvpool.sim.plan import parse_target

    field = summary["variable"]
    parsed = [parse_target(t) for t in summary["targets"]]
    frame = results.plan_frame(summary, [t.metric for t in parsed])
    _verdict(summary, inp)
    if len(frame):
        cols = st.columns(2)
        for i, t in enumerate(parsed):
            cols[i % 2].altair_chart(charts.plan_metric(frame, field, t.metric, t.op, t.value, summary["best"]),
                                     width="stretch")
    st.subheader(f"Explored curve ({summary['runs']} runs, {summary['direction']} {field})")
    st.dataframe(frame, hide_index=True, width="stretch", column_config={
        "value": st.column_config.NumberColumn(field, format="%.6g"),
        "meets_targets": st.column_config.CheckboxColumn("meets all targets"),
    })
    text = results.plan_json(summary)
    from kvpool.outputs import safe_name

    stem = f"plan-{safe_name(run_name)}-{field}-{summary['id']}"
    c1, c2, _ = st.columns([1, 1, 3])
    c1.download_button("Download JSON", text, file_name=f"{stem}.json", mime="application/json", key="plan_json",
                       icon=":material/download:",
                       help="The document `kvpool sim plan` writes: what produced it (scenario and its hash, "
                            "overrides, seed, workload, window, the search's inputs, kvpool version), the verdict, "
                            "the explored curve, the run.")
    c2.download_button("Download CSV", frame.to_csv(index=False), file_name=f"{stem}.csv", mime="text/csv",
                       key="plan_csv", icon=":material/download:",
                       help="The explored curve, one row per run; its name ends in the JSON's id.")
    with st.expander("JSON (the document `kvpool sim plan --json` prints)"):
        st.code(text, language="json")


def render() -> None:
    st.title("Plan")
    st.caption("Capacity search (`kvpool sim plan`): the smallest pool or cluster, or the most sessions, that meets "
               "every target. Each round simulates a few points of the range in parallel and keeps the part where "
               "the verdict flips; it assumes the targets hold on one side of a threshold (more memory never hurts, "
               "more load never helps). Every run is kept: the explored curve.")
    cur = state.current()
    if cur.scenario is None:
        st.warning("The scenario being edited does not validate; fix it on the Scenario page.")
        ui.show_errors(cur.errors)
        st.page_link("pages/scenario.py", label="Go to the Scenario page", icon=":material/tune:")
        return
    s = cur.scenario
    d = data.derived(cur.toml)
    st.markdown(f"Scenario **{s.name}** ({cur.label}{', edited' if cur.overrides else ''}), change it on the "
                "Scenario page. What it provides now (analytical, `kvpool scenario show`):")
    c = st.columns(4)
    c[0].metric("Pool capacity", f"{d['pool_capacity_tib']:.2f} TiB")
    c[1].metric("Pool capacity (tokens)", f"{d['pool_capacity_tokens']:,}")
    c[2].metric("Sessions of 10 GiB history", f"{d['pool_sessions_10gib']:.0f}")
    c[3].metric("GPUs", d["gpus"])

    st.subheader("Search")
    inp, run_s = _inputs(s, cur.label, cur.toml)
    if st.button("Run search", type="primary", icon=":material/query_stats:", disabled=inp is None):
        from kvpool.scenario import to_toml

        run_toml = to_toml(run_s)
        summary, err = _search(run_toml, inp, s.name)
        if err:
            st.session_state.pop(LAST, None)
            st.session_state[FAILED] = err
        else:
            st.session_state.pop(FAILED, None)
            st.session_state[LAST] = (run_toml, inp, s.name, cur.toml)
    if st.session_state.get(FAILED):
        ui.show_errors([f"The search stopped: {st.session_state[FAILED]}"])
        return
    last = st.session_state.get(LAST)
    if last is None:
        st.info("Set the targets and the variable, then press **Run search**. Results are cached: the same "
                "scenario and inputs show again at once.")
        return
    run_toml, last_inp, name, source_toml = last
    cli = last_inp.cli(f"{name}.toml")
    summary, err = _search(run_toml, last_inp, name)
    if err:
        ui.show_errors([f"The search stopped: {err}"])
        return
    st.divider()
    if source_toml != cur.toml or last_inp != inp:
        st.caption("These results are of other inputs or another version of the scenario; press Run search "
                   "to update.")
    _results(summary, last_inp, data.scenario(run_toml).name)
    st.caption("The same result from the command line (with the scenario TOML downloaded from the Scenario page):")
    st.code(cli, language="bash")


render()
