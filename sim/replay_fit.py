"""A calibration's prefill grid scaled to the server as a replay finds it (``kvpool calibrate --replay-traces``).

The calibration's replay phase (``backend.serve.calibrate_replay``) measured what the real prefill
stages spent per computed token while a held-out trace set was replayed. This module finds the
factor by which the simulator's prefill cells must be multiplied so that the simulator, replaying
the same traces the same way, spends as much.

Contract:
    * ``fit_replay_scale(doc, s, traces) -> dict``: ``doc`` is a calibration document (the format of
      ``sim.calibration``, version 3) with its ``replay`` section; ``s`` the replay's scenario with
      the server's capacities (``cost.kv_capacity = "serve"``; its ``workload.*`` as the replay ran: AgentX
      lanes ``workload.sessions``, duration, token scale, output cap, warm-up, seed); ``traces``
      the trace set replayed. The simulated figure is the prefill instances' stage-0 busy seconds
      over the tokens they computed (every step's cell times ``prefill.replay_scale``, times the
      sharing of its device); the real one ``replay.prefill.stage_us_per_token``. From
      ``scale = 1``, ``scale <- scale x real / simulated`` until the two agree within
      ``TOLERANCE`` or ``MAX_RUNS`` simulations have run (a scaled step changes which steps
      overlap, so one ratio is not the answer); the scale kept is that of the run nearest the
      real figure. Returns ``{"scale", "real_us_per_token", "sim_us_per_token" (at that scale),
      "sim_us_per_token_unscaled", "runs": [[scale, sim_us_per_token], ...], "converged",
      "prefill_steps", "prefill_steps_outside_grid"}`` (the unscaled run's steps, and those the
      analytic model priced: outside the grid, not scaled).
    * ``stage_us_per_token(sim)``: that simulated figure of a finished simulation (``None`` when
      it computed nothing); ``bench/fidelity.py`` prints it beside the real one.
    * ``with_replay_scale(doc, s, traces) -> dict``: ``doc`` with ``prefill.replay_scale`` set to the
      fitted scale and ``replay.fit`` to ``fit_replay_scale``'s answer.
    A ``ValueError`` says what is missing: no replay section, no computed tokens in it, a scenario
    without the server's capacities, or a grid that does not describe the replay (more than
    ``MAX_OUTSIDE_SHARE`` of the simulated prefill steps outside it).
"""

from __future__ import annotations

from kvpool.sim.calibration import CalibratedCost, parse_calibration

TOLERANCE = 0.005  # relative: the simulated stage time per token within 0.5 % of the real one
MAX_RUNS = 8
MAX_OUTSIDE_SHARE = 0.1  # of the simulated prefill steps, priced outside the grid by the analytic model


def fit_replay_scale(doc: dict, s, traces: str) -> dict:
    """The factor on the prefill cells that makes the simulated replay's stage time per token the real one."""
    from kvpool.sim.run import workload_for

    real = ((doc.get("replay") or {}).get("prefill") or {}).get("stage_us_per_token")
    if not real:
        raise ValueError("the calibration has no replay phase with computed tokens (replay.prefill.stage_us_per_token)")
    if s.cost.kv_capacity != "serve":
        raise ValueError('the replay is simulated with the server\'s capacities: cost.kv_capacity = "serve"')
    workload = workload_for(s, traces)
    runs: list[tuple[float, float]] = []
    scale = 1.0
    steps, outside = 0, 0
    for _ in range(MAX_RUNS):
        sim_us, cost = _stage_us_per_token(doc, s, workload, scale)
        if not runs:
            steps, outside = cost.calls["prefill"], cost.fallbacks["prefill"]
            if outside > MAX_OUTSIDE_SHARE * steps:
                raise ValueError(f"{outside} of {steps} prefill steps of the simulated replay lie outside the prefill "
                                 "grid (the analytic model prices them, unscaled): the grid does not describe this replay")
        runs.append((scale, sim_us))
        if abs(sim_us / real - 1) <= TOLERANCE:
            break
        scale *= real / sim_us
    best_scale, best_us = min(runs, key=lambda r: abs(r[1] / real - 1))
    return {"scale": best_scale, "real_us_per_token": real, "sim_us_per_token": best_us,
            "sim_us_per_token_unscaled": runs[0][1], "runs": [list(r) for r in runs],
            "converged": abs(best_us / real - 1) <= TOLERANCE, "prefill_steps": steps,
            "prefill_steps_outside_grid": outside}


def with_replay_scale(doc: dict, s, traces: str) -> dict:
    """``doc`` with ``prefill.replay_scale`` and ``replay.fit`` from ``fit_replay_scale``."""
    fit = fit_replay_scale(doc, s, traces)
    return {**doc, "prefill": {**doc["prefill"], "replay_scale": fit["scale"]},
            "replay": {**doc["replay"], "fit": fit}}


def stage_us_per_token(sim) -> float | None:
    """A finished simulation's prefill stage time per computed token, microseconds: the prefill
    instances' busy seconds at their first stage over the tokens they computed (a stage's step is
    a calibrated cell, a lone request's prefill window over the stages, so the hops between stages
    are inside it); ``None`` when nothing was computed."""
    tokens = sum(p.computed_tokens for p in sim.prefills)
    return 1e6 * sum(p.busy_s for p in sim.prefills) / tokens if tokens else None


def _stage_us_per_token(doc: dict, s, workload, scale: float) -> tuple[float, CalibratedCost]:
    """The simulated replay's prefill stage time per computed token, microseconds, with the cells
    times ``scale``; and the cost model that priced it (its calls and fallbacks counted)."""
    from kvpool.sim.cost import AnalyticalCost
    from kvpool.sim.engine import Simulation
    from kvpool.sim.run import make_replay

    cal = parse_calibration({**doc, "prefill": {**doc["prefill"], "replay_scale": scale}}, "the replay fit")
    cost = CalibratedCost(cal, AnalyticalCost.from_scenario(s), s.gpu.nic_gb_s * 1e9)
    sim = Simulation(s, make_replay(s, workload, s.workload.sessions), cost=cost)
    sim.run()
    us = stage_us_per_token(sim)
    if us is None:
        raise ValueError("the simulated replay computed no prompt tokens")
    return us, cost
