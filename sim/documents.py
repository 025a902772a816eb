"""The JSON documents of a sweep, a comparison and a capacity search: what ``kvpool sim run``,
``compare`` and ``plan`` write, and what the dashboard's downloads hold (docs/metrics.md).

Contract:
    * ``Inputs`` is what a front end was given besides the scenario: ``source`` (the scenario's name
      or file as given), the user's ``--set`` lines, every override the scenario was loaded with
      (``kvpool.run_inputs.run_overrides``) and the trace path. Equal inputs give equal
      ``provenance`` blocks (``sim.provenance``) and so the same ``id``, whichever front end ran them.
    * ``Execution`` is how the runs went: ``produced_by`` (the front end: ``kvpool sim run``,
      ``kvpool dashboard (Run page)``, ...), the executor and the worker count, and optionally
      ``command``, the equivalent command line. It goes in the ``run`` block only.
    * ``run_document(s, rows, inputs, execution)``: ``{id, provenance, results, run, warnings?}``.
    * ``compare_document(arms_s, arms, inputs, execution)``: ``{id, provenance: {arms}, arms, ratios,
      run, warnings?}``, the first arm the reference; every arm has its own ``Inputs``.
    * ``plan_summary(result)`` is the search's verdict and explored curve; ``plan_document(base,
      result, inputs, execution, search)`` wraps it with ``id``, ``provenance`` (plus ``search``) and
      ``run``.
    * ``warnings(s, traces, rows, prefix)``: one line per load whose result is no measurement
      (``report.degenerate_reason``) and, for a replay of one-request traces that measured nothing,
      why; the documents carry them under ``warnings`` when there are any.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.scenario.model import Scenario
from kvpool.sim import report
from kvpool.sim.provenance import provenance, short_id


@dataclass(frozen=True)
class Inputs:
    """A front end's inputs besides the scenario (see the module's contract)."""

    source: str
    set_overrides: tuple[str, ...] = ()
    overrides: tuple[str, ...] = ()
    traces: str | None = None


@dataclass(frozen=True)
class Execution:
    """How the runs went: the ``run`` block's fixed part."""

    produced_by: str
    executor: str = "local"
    workers: int = 1
    command: str | None = None

    def block(self, **parts: object) -> dict:
        out: dict = {"produced_by": self.produced_by}
        if self.command is not None:
            out["command"] = self.command
        return {**out, "executor": self.executor, "workers": self.workers, **parts}


def degenerate_lines(rows: Sequence[dict], prefix: str = "") -> list[str]:
    """One line per load whose result is not a measurement (``report.degenerate_reason``)."""
    out = []
    for r in rows:
        why = report.degenerate_reason(r)
        if why:
            key, value = report.load_of(r)
            out.append(f"{prefix}{key} {value:g}: {why}")
    return out


def replay_warning(s: Scenario, traces: str | None, rows: Sequence[dict]) -> list[str]:
    """Why a replay of one-request sessions (Mooncake rows) measured no request, when it did not."""
    from kvpool.sim.run import workload_for

    if s.workload.mode != "replay" or not (traces or s.workload.traces) or any(r.get("requests") for r in rows):
        return []
    if all(len(x.requests) == 1 for x in workload_for(s, traces)):
        return ["every trace is a single request (Mooncake rows): production replay excludes each session's cold "
                "first turn from the metrics, so nothing is measured; replay multi-turn sessions (Weka traces) "
                "or run them as AgentX lanes (--sessions)"]
    return []


def note_lines(rows: Sequence[dict], notes: str, prefix: str = "") -> list[str]:
    """Per load, the lines of its ``notes`` field, each after its load: ``cost_notes`` (the
    calibrated cost model's costs outside its measured range, ``sim.calibration``) or ``kv_notes``
    (requests that failed for want of prefill KV, ``sim.run.prefill_kv_notes``)."""
    out = []
    for r in rows:
        for line in r.get(notes, ()):
            key, value = report.load_of(r)
            out.append(f"{prefix}{key} {value:g}: {line}")
    return out


def warnings(s: Scenario, traces: str | None, rows: Sequence[dict], prefix: str = "") -> list[str]:
    return (replay_warning(s, traces, rows) + degenerate_lines(rows, prefix) + note_lines(rows, "kv_notes", prefix)
            + note_lines(rows, "cost_notes", prefix))


def _provenance(s: Scenario, inputs: Inputs, loads: Sequence[float] = (), with_loads: bool = True) -> dict:
    from kvpool.sim.run import load_key

    return provenance(s, source=inputs.source, overrides=inputs.overrides, set_overrides=inputs.set_overrides,
                      traces=inputs.traces, load_key=load_key(s) if with_loads else None, loads=loads)


def run_document(s: Scenario, rows: Sequence[dict], inputs: Inputs, execution: Execution) -> dict:
    """The document of a sweep of ``s`` (the scenario after every override) over ``rows``' loads."""
    loads = [report.load_of(r)[1] for r in rows]
    doc = report.run_document(rows, _provenance(s, inputs, loads),
                              execution.block(loads=[report.timing(r) for r in rows]))
    lines = warnings(s, inputs.traces, rows)
    if lines:
        doc["warnings"] = lines
    return doc


def compare_document(arms_s: Sequence[Scenario], arms: dict[str, Sequence[dict]], inputs: Sequence[Inputs],
                     execution: Execution) -> dict:
    """The document of a comparison: ``arms_s[i]`` ran ``arms[arms_s[i].name]`` with ``inputs[i]``."""
    from kvpool.sim import compare as cmp

    names = [s.name for s in arms_s]
    prov = {"arms": {s.name: _provenance(s, inp, [report.load_of(r)[1] for r in arms[s.name]])
                     for s, inp in zip(arms_s, inputs)}}
    doc = {"id": short_id(prov), "provenance": prov,
           "arms": {n: [report.public(r) for r in arms[n]] for n in names},
           "ratios": {"reference": names[0], "over": cmp.ratios({n: arms[n] for n in names})},
           "run": execution.block(arms={n: [report.timing(r) for r in arms[n]] for n in names})}
    lines = [w for s, inp in zip(arms_s, inputs) for w in replay_warning(s, inp.traces, arms[s.name])]
    lines += [w for n in names for w in degenerate_lines(arms[n], prefix=f"{n} ")
              + note_lines(arms[n], "kv_notes", prefix=f"{n} ")]
    if lines:
        doc["warnings"] = lines
    return doc


def plan_summary(result) -> dict:
    """The verdict and explored curve of a ``sim.plan.PlanResult`` (``failed``: why no value meets
    the targets, when none does)."""
    from kvpool.sim.plan import why_none

    curve = [{"value": v, "meets_targets": ok, **report.public(row)} for v, row, ok in result.curve()]
    out = {"variable": result.variable.field, "direction": "maximize" if result.variable.maximize else "minimize",
           "targets": [str(t) for t in result.targets], "best": result.best, "runs": len(curve), "curve": curve}
    if result.best is None:
        out["failed"] = why_none(result)
    return out


@dataclass(frozen=True)
class Search:
    """The search's own inputs (with its targets, the ``provenance.search`` block): the ``--vary``
    text, the load of every run (None: the scenario's), points per round and the most runs."""

    vary: str
    load: float | None
    points_per_round: int
    max_runs: int


def plan_document(base: Scenario, result, inputs: Inputs, execution: Execution, search: Search) -> dict:
    """The document of a capacity search from ``base`` (after every override)."""
    prov = {**_provenance(base, inputs, with_loads=False),
            "search": {"vary": search.vary, "targets": [str(t) for t in result.targets], "load": search.load,
                       "points_per_round": search.points_per_round, "max_runs": search.max_runs}}
    points = [{"value": v, **report.timing(row)} for v, row, _ in result.curve()]
    return {"id": short_id(prov), "provenance": prov, **plan_summary(result),
            "run": execution.block(points=points)}
