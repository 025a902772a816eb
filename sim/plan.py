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
from kvpool.workload.records import SUMMARY_KEYS

_OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}
_TARGET = re.compile(r"^\s*([a-z0-9_]+)\s*(>=|<=|>|<)\s*([-+0-9.eE]+)\s*$")
_VARY = re.compile(r"^\s*([a-z0-9_.]+)\s*=\s*([-+0-9.eE]+)\s*\.\.\s*([-+0-9.eE]+)\s*$")
LOAD_FIELDS = ("workload.sessions", "workload.rps")
#: the field that is the load of each workload mode
_LOAD_OF_MODE = {"agentx": "workload.sessions", "replay": "workload.rps"}
INTEGER_FIELDS = ("workload.sessions", "cluster.servers", "pool.services_per_server", "prefill.instances",
                  "decode.instances")
#: runs a batch of (scenario, load) points, returning their metrics in order
Batch = Callable[[list[tuple[Scenario, float]]], list[dict]]
#: the same, calling ``each(i, metrics)`` as point ``i`` finishes
StreamedBatch = Callable[[list[tuple[Scenario, float]], Callable[[int, dict], None]], list[dict]]


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
    if name in LOAD_FIELDS and name != _LOAD_OF_MODE[base.workload.mode]:
        mode = base.workload.mode
        other = next(m for m, f in _LOAD_OF_MODE.items() if f == name)
        raise PlanError(f"--vary {text!r}: {base.name} runs workload.mode={mode!r}, whose load is "
                        f"{_LOAD_OF_MODE[mode]}; vary that, or add --set workload.mode={other}")
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
    evaluate: Batch | None = None,
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

    def batches(r: Runner) -> StreamedBatch:
        return lambda points, each: r.map(_run_task, [(s, x, traces) for s, x in points], each)

    if runner is not None:
        return _search(base, variable, targets, load, tolerance, workers, max_runs, None, batches(runner), on_run)
    with open_runner(executor, workers=workers, address=address) as r:
        return _search(base, variable, targets, load, tolerance, workers, max_runs, None, batches(r), on_run)


class _Trials:
    """The points a search evaluates: each value's run and verdict, kept once per value.

    ``seen[v]``: whether every target held at value ``v`` (integers rounded for integer fields);
    ``result.explored``: every point in the order the batches returned them."""

    def __init__(self, base: Scenario, variable: Variable, targets: Sequence[Target], load: float | None,
                 evaluate: Batch | None, run_batch: StreamedBatch | None,
                 on_run: Callable[[float, dict, bool], None] | None) -> None:
        self.base, self.variable, self.targets = base, variable, list(targets)
        self.load = load if load is not None else (
            base.workload.sessions if base.workload.mode == "agentx" else base.workload.rps)
        self.evaluate, self.run_batch, self.on_run = evaluate, run_batch, on_run
        self.seen: dict[float, bool] = {}
        self.result = PlanResult(variable, list(targets))

    def value(self, x: float) -> float:
        return int(round(x)) if self.variable.integer else x

    def met(self, row: dict) -> bool:
        return all(t.met(row) for t in self.targets)

    def point(self, v: float) -> tuple[Scenario, float]:
        """The (scenario, load) a value stands for: the load itself, or the base scenario changed."""
        if self.variable.field in LOAD_FIELDS:
            return self.base, v
        return _with(self.base, self.variable.field, v, self.variable.integer), self.load

    def run(self, values: list[float]) -> None:
        """Evaluate the values not tried yet, as one batch, and record their verdicts."""
        values = [v for v in dict.fromkeys(self.value(x) for x in values) if v not in self.seen]
        if not values:
            return
        rows = self._rows(values)
        for v, row in zip(values, rows):
            ok = self.met(row)
            self.seen[v] = ok
            self.result.explored.append((v, row, ok))
            if self.on_run and self.run_batch is None:
                self.on_run(v, row, ok)

    def _rows(self, values: list[float]) -> list[dict]:
        points = [self.point(v) for v in values]
        if self.run_batch is None:
            return self.evaluate(points)

        def each(i: int, row: dict) -> None:  # on_run as each point finishes; ``explored`` stays in value order
            if self.on_run:
                self.on_run(values[i], row, self.met(row))

        return self.run_batch(points, each)


def _inner_points(lo: float, hi: float, k: int, integer: bool) -> list[float]:
    """``k`` evenly spaced points strictly inside ``(lo, hi)``; for integer fields the distinct
    integers among them (empty when no integer lies strictly inside)."""
    inner = [lo + (hi - lo) * (i + 1) / (k + 1) for i in range(k)]
    if not integer:
        return inner
    if int(hi) - int(lo) <= 1:
        return []
    return sorted({min(max(int(round(x)), int(lo) + 1), int(hi) - 1) for x in inner})


def _flip(seen: dict[float, bool], lo: float, hi: float) -> tuple[float, float]:
    """The first neighbouring pair of tried values in ``[lo, hi]`` whose verdicts differ (else ``lo, hi``)."""
    grid = sorted(v for v in seen if lo <= v <= hi)
    for a, b in zip(grid, grid[1:]):
        if seen[a] != seen[b]:
            return a, b
    return lo, hi


def _narrow(trials: _Trials, tol: float, workers: int, max_runs: int) -> tuple[float, float]:
    """Rounds of ``workers`` interior points until the bracket is narrower than ``tol`` (or the
    runs are spent); the bracket's ends have different verdicts."""
    variable = trials.variable
    lo, hi = variable.lo, variable.hi
    k = max(1, workers)
    while hi - lo > tol and len(trials.result.explored) < max_runs:
        inner = _inner_points(lo, hi, k, variable.integer)
        if not inner:
            break
        trials.run(inner)
        lo, hi = _flip(trials.seen, lo, hi)
    return lo, hi


def _search(base: Scenario, variable: Variable, targets: Sequence[Target], load: float | None,
            tolerance: float | None, workers: int, max_runs: int,
            evaluate: Batch | None, run_batch: StreamedBatch | None,
            on_run: Callable[[float, dict, bool], None] | None) -> PlanResult:
    trials = _Trials(base, variable, targets, load, evaluate, run_batch, on_run)
    result = trials.result
    tol = tolerance if tolerance is not None else (1.0 if variable.integer else (variable.hi - variable.lo) / 64)
    # "good" is the side where targets hold: high values when minimizing, low when maximizing
    trials.run([variable.lo, variable.hi])
    good_end = variable.lo if variable.maximize else variable.hi
    bad_end = variable.hi if variable.maximize else variable.lo
    if not trials.seen[trials.value(good_end)]:
        return result  # even the best end fails: nothing meets the targets in range
    if trials.seen[trials.value(bad_end)]:
        result.best = bad_end  # even the cheapest end passes
        return result
    lo, hi = _narrow(trials, tol, workers, max_runs)
    result.best = lo if variable.maximize else hi
    return result


def _run_task(args: tuple[Scenario, float, str | None]) -> dict:
    from kvpool.sim.run import run_point

    s, x, traces = args
    return run_point(s, x, traces)
