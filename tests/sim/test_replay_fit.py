"""``sim.replay_fit``: the factor on a calibration's prefill cells that makes the simulator's replay of
a trace set spend, per computed token in a prefill stage, what the real replay's engines did."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool.scenario.load import load_scenario
from kvpool.sim.replay_fit import TOLERANCE, _stage_us_per_token, fit_replay_scale, with_replay_scale
from kvpool.sim.run import workload_for

ROOT = Path(__file__).resolve().parents[1]
FILE = ROOT / "data" / "calibration" / "cpu-tiny.json"
TRACES = str(ROOT / "data" / "traces" / "kv-cache-tester-split" / "calibration")
SETS = ["workload.token_scale=0.03125", "workload.max_output_tokens=16", 'cost.kv_capacity="serve"',
        'workload.mode="agentx"', "workload.sessions=2", "workload.duration_s=20.0", "workload.grace_s=0"]


def _doc(real_us_per_token: float | None) -> dict:
    """The CPU calibration as version 3, with a replay section that measured ``real_us_per_token``."""
    doc = json.loads(FILE.read_text())
    doc["version"] = 3
    doc["prefill"]["replay_scale"] = 1.0
    doc["replay"] = {"prefill": {"stage_us_per_token": real_us_per_token}}
    return doc


def test_the_scale_makes_the_simulated_stage_time_per_token_the_real_one():
    s = load_scenario("cpu-tiny", SETS)
    unscaled, _ = _stage_us_per_token(_doc(None), s, workload_for(s, TRACES), 1.0)
    fit = fit_replay_scale(_doc(1.3 * unscaled), s, TRACES)
    assert fit["sim_us_per_token_unscaled"] == unscaled and fit["runs"][0] == [1.0, unscaled]
    assert fit["converged"] and abs(fit["sim_us_per_token"] / fit["real_us_per_token"] - 1) <= TOLERANCE
    assert fit["scale"] == pytest.approx(1.3, rel=0.1) and fit["prefill_steps"] > 0
    assert fit["prefill_steps_outside_grid"] == 0
    scaled = with_replay_scale(_doc(1.3 * unscaled), s, TRACES)
    assert scaled["prefill"]["replay_scale"] == fit["scale"] and scaled["replay"]["fit"] == fit


def test_what_the_fit_cannot_use_is_named():
    s = load_scenario("cpu-tiny", SETS)
    doc = _doc(200.0)
    del doc["replay"]
    with pytest.raises(ValueError, match="no replay phase"):
        fit_replay_scale(doc, s, TRACES)
    with pytest.raises(ValueError, match="server's capacities"):
        fit_replay_scale(_doc(200.0), load_scenario("cpu-tiny", [x for x in SETS if "kv_capacity" not in x]), TRACES)
    narrow = _doc(200.0)  # a grid of short prompts without context: the replay's steps lie outside it
    narrow["prefill"]["new_tokens"], narrow["prefill"]["cached_tokens"] = [1, 2], [0, 1]
    narrow["prefill"]["step_s"] = [[0.01, 0.01], [0.01, 0.01]]
    with pytest.raises(ValueError, match="prefill steps of the simulated replay lie outside the prefill grid"):
        fit_replay_scale(narrow, s, TRACES)
