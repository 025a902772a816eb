"""Capacity search: the smallest pool (fewest servers, most sessions) that meets every target.

Contract:
    * Targets are ``metric OP value`` with a metric of ``kvpool sim run --json`` (docs/metrics.md)
      and OP one of ``>= <= > <``, e.g. ``reuse>=0.95``, ``ttft_p90_s<=2.5``.
    * The variable is a scenario field (``--set`` syntax) with a range, ``pool.gib_per_service=64..768``,
      or the load itself (``workload.sessions=40..160`` / ``workload.rps=0.2..2``).
    * Direction: loads are maximized (the most sessions that still meet the targets); every other
      variable is minimized (the smallest pool or cluster that meets them). The search assumes the
      targets hold on one side of a threshold (more memory never hurts; more load never helps).
    * Search: each round evaluates ``workers`` interior points of the bracket in parallel (locally or
      on Ray: ``sim.executor``; the verdicts never depend on where they ran) and keeps
      the sub-interval where the verdict flips, until it is narrower than ``tolerance`` (integer
      fields: 1). Every point evaluated is returned (the explored curve).
"""

from __future__ import annotations

import math
import operator
import re
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvpool.scenario.model import Scenario
from kvpool.sim.executor import Runner
from kvpool.sim.metrics import SUMMARY_KEYS

_OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}
_TARGET = re.compile(r"^\s*([a-z0-9_]+)\s*(>=|<=|>|<)\s*([-+0-9.eE]+)\s*$")
_VARY = re.compile(r"^\s*([a-z0-9_.]+)\s*=\s*([-+0-9.eE]+)\s*\.\.\s*([-+0-9.eE]+)\s*$")
LOAD_FIELDS = ("workload.sessions", "workload.rps")
INTEGER_FIELDS = ("workload.sessions", "cluster.servers", "pool.services_per_server", "prefill.instances",
                  "decode.instances")


class PlanError(ValueError):
    """A target or variable the search cannot use; the message names it and what is allowed."""


@dataclass(frozen=True)
class Target:
    metric: str
    op: str
    value: float

    def met(self, row: dict) -> bool:
        return bool(_OPS[self.op](row[self.metric], self.value))

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.value:g}"


@dataclass(frozen=True)
class Variable:
    field: str
    lo: float
    hi: float

    @property
    def integer(self) -> bool:
        """Integer fields (by the scenario model's type) are searched at whole values only."""
        return self.field in INTEGER_FIELDS or _integer_field(self.field)

    @property
    def maximize(self) -> bool:
        return self.field in LOAD_FIELDS


def _integer_field(path: str) -> bool:
    from kvpool.scenario.fields import field_info

    try:
        ann = field_info(path).annotation
    except (KeyError, AttributeError):
        return False
    return ann is int or (typing.get_origin(ann) in (typing.Union, types.UnionType) and int in typing.get_args(ann))


def _number(text: str, what: str) -> float:
    """``text`` as a finite float, or a ``PlanError`` naming ``what``."""
    try:
        v = float(text)
    except ValueError:
        raise PlanError(f"{what}: {text!r} is not a number") from None
    if not math.isfinite(v):
        raise PlanError(f"{what}: {text!r} is not a finite number")
    return v


def parse_target(text: str) -> Target:
    m = _TARGET.match(text)
    if not m:
        raise PlanError(f"--target {text!r}: expected METRIC>=VALUE (or <=, >, <), e.g. reuse>=0.95")
    metric, op, value = m.group(1), m.group(2), _number(m.group(3), f"--target {text!r}")
    if metric not in SUMMARY_KEYS or metric in ("sessions", "rps", "duration_s", "gpus", "wall_s"):
        allowed = ", ".join(k for k in SUMMARY_KEYS if k not in ("sessions", "rps", "duration_s", "gpus", "wall_s"))
        raise PlanError(f"--target {text!r}: unknown metric {metric!r}; allowed: {allowed}")
    return Target(metric, op, value)


def parse_vary(text: str, base: Scenario) -> Variable:
    m = _VARY.match(text)
    if not m:
        raise PlanError(f"--vary {text!r}: expected section.field=LO..HI, e.g. pool.gib_per_service=64..768")
    name, lo, hi = m.group(1), _number(m.group(2), f"--vary {text!r}: LO"), _number(m.group(3), f"--vary {text!r}: HI")
    if not lo < hi:
        raise PlanError(f"--vary {text!r}: LO must be below HI")
    try:  # the field must exist and accept both ends
        _with(base, name, lo, Variable(name, lo, hi).integer)
        _with(base, name, hi, Variable(name, lo, hi).integer)
    except ValueError as e:
        raise PlanError(f"--vary {text!r}: {e}") from None
    return Variable(name, lo, hi)


def _with(base: Scenario, name: str, value: float, integer: bool) -> Scenario:
    from kvpool.scenario.load import apply_overrides, validate

    raw = base.model_dump(mode="json", exclude_none=True)
    v = int(round(value)) if integer else value
    return validate(apply_overrides(raw, [f"{name}={v}"], base.name), f"{base.name} ({name}={v})")


@dataclass
class PlanResult:
    variable: Variable
    targets: list[Target]
    explored: list[tuple[float, dict, bool]] = field(default_factory=list)  # (value, metrics, all met)
    best: float | None = None

    def curve(self) -> list[tuple[float, dict, bool]]:
        return sorted(self.explored, key=lambda x: x[0])


def why_none(result: PlanResult) -> list[str]:
    """When no value met every target: per target, where it failed (every value tried, or which
    ones) and its closest value, e.g. ``ttft_p90_s<=2.5 fails at every value tried (64..768):
    closest 3.84 at 768``."""
    curve = result.curve()
    if not curve:
        return ["no run finished"]
    out = []
    lo, hi = curve[0][0], curve[-1][0]
    for tg in result.targets:
        failing = [(v, row) for v, row, _ in curve if not tg.met(row)]
        if not failing:
            out.append(f"{tg} holds at every value tried")
            continue
        if len(failing) == len(curve):
            v, row = min(failing, key=lambda x: abs(x[1][tg.metric] - tg.value))
            out.append(f"{tg} fails at every value tried ({lo:g}..{hi:g}): closest {tg.metric}={row[tg.metric]:.4g} at {v:g}")
        else:
            out.append(f"{tg} fails at " + ", ".join(f"{v:g} ({tg.metric}={row[tg.metric]:.4g})" for v, row in failing))
    return out


def search(
    base: Scenario,
    variable: Variable,
    targets: Sequence[Target],
    *,
    load: float | None = None,
    traces: str | None = None,
    tolerance: float | None = None,
    workers: int = 2,
    max_runs: int = 24,
    executor: str = "local",
    address: str | None = None,
    runner: Runner | None = None,
    evaluate: Callable[[list[tuple[Scenario, float]]], list[dict]] | None = None,
    on_run: Callable[[float, dict, bool], None] | None = None,
) -> PlanResult:
    """Search ``variable`` for the best value meeting every target (see the module docstring).

    ``load``: the load of every run when the variable is not the load itself (default: the
    scenario's). The points of a round run through ``sim.executor`` (``executor``, ``workers``,
    ``address``: the same choice as ``sim.run.sweep``, one runner for the whole search, or an open
    ``runner``), and ``on_run`` fires as each point finishes; ``evaluate`` replaces that with a
    function running a batch of (scenario, load) points (then ``on_run`` fires after the batch).
    """
    if evaluate is not None:
        return _search(base, variable, targets, load, tolerance, workers, max_runs, evaluate, None, on_run)
    from kvpool.sim.executor import runner as open_runner

    def batches(r: Runner) -> Callable[[list[tuple[Scenario, float]], Callable[[int, dict], None]], list[dict]]:
        return lambda points, each: r.map(_run_task, [(s, x, traces) for s, x in points], each)

    if runner is not None:
        return _search(base, variable, targets, load, tolerance, workers, max_runs, None, batches(runner), on_run)
    with open_runner(executor, workers=workers, address=address) as r:
        return _search(base, variable, targets, load, tolerance, workers, max_runs, None, batches(r), on_run)


def _search(base: Scenario, variable: Variable, targets: Sequence[Target], load: float | None,
            tolerance: float | None, workers: int, max_runs: int,
            evaluate: Callable[[list[tuple[Scenario, float]]], list[dict]] | None,
            run_batch: Callable[[list[tuple[Scenario, float]], Callable[[int, dict], None]], list[dict]] | None,
            on_run: Callable[[float, dict, bool], None] | None) -> PlanResult:
    default_load = base.workload.sessions if base.workload.mode == "agentx" else base.workload.rps
    integer = variable.integer
    tol = tolerance if tolerance is not None else (1.0 if integer else (variable.hi - variable.lo) / 64)
    result = PlanResult(variable, list(targets))
    seen: dict[float, bool] = {}

    def point(v: float) -> tuple[Scenario, float]:
        if variable.field in LOAD_FIELDS:
            return base, (int(round(v)) if integer else v)
        return _with(base, variable.field, v, integer), (load if load is not None else default_load)

    def run(values: list[float]) -> None:
        values = [v for v in dict.fromkeys(int(round(x)) if integer else x for x in values) if v not in seen]
        if not values:
            return
        if run_batch is not None:  # on_run as each point finishes; ``explored`` stays in value order (below)
            def each(i: int, row: dict) -> None:
                if on_run:
                    on_run(values[i], row, all(t.met(row) for t in targets))

            rows = run_batch([point(v) for v in values], each)
        else:
            rows = evaluate([point(v) for v in values])
        for v, row in zip(values, rows):
            ok = all(t.met(row) for t in targets)
            seen[v] = ok
            result.explored.append((v, row, ok))
            if on_run and run_batch is None:
                on_run(v, row, ok)

    # "good" is the side where targets hold: high values when minimizing, low when maximizing
    run([variable.lo, variable.hi])
    lo, hi = variable.lo, variable.hi
    good_end = variable.lo if variable.maximize else variable.hi
    bad_end = variable.hi if variable.maximize else variable.lo
    if not seen[int(round(good_end)) if integer else good_end]:
        return result  # even the best end fails: nothing meets the targets in range
    if seen[int(round(bad_end)) if integer else bad_end]:
        result.best = bad_end  # even the cheapest end passes
        return result
    k = max(1, workers)
    while hi - lo > tol and len(result.explored) < max_runs:
        inner = [lo + (hi - lo) * (i + 1) / (k + 1) for i in range(k)]
        if integer:
            inner = sorted({min(max(int(round(x)), int(lo) + 1), int(hi) - 1) for x in inner})
            if not inner or int(hi) - int(lo) <= 1:
                break
        run(inner)
        grid = sorted(v for v in seen if lo <= v <= hi)
        for a, b in zip(grid, grid[1:]):
            if seen[a] != seen[b]:
                lo, hi = a, b
                break
    result.best = lo if variable.maximize else hi
    return result


def _run_task(args: tuple[Scenario, float, str | None]) -> dict:
    from kvpool.sim.run import run_point

    s, x, traces = args
    return run_point(s, x, traces)
