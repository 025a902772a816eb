"""``sim.calibration``: the calibration file read through one interface, the analytic model outside it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool.scenario.load import load_scenario
from kvpool.sim.calibration import CalibratedCost, CalibrationError, load_calibration
from kvpool.sim.cost import AnalyticalCost, cost_model

FILE = Path(__file__).resolve().parents[1] / "data" / "calibration" / "cpu-tiny.json"


def _cost():
    s = load_scenario("cpu-tiny", [f'cost.calibration="{FILE}"'])
    return s, cost_model(s)


def test_the_grid_is_interpolated_inside_and_the_analytic_model_answers_outside():
    s, c = _cost()
    assert isinstance(c, CalibratedCost)
    cal = c.cal
    # on a grid point: the measured step
    assert c.prefill_step_s([(cal.new_tokens[1], cal.cached_tokens[2])]) == pytest.approx(cal.prefill_step_s[1][2])
    # between two points: between their values
    mid = (cal.new_tokens[1] + cal.new_tokens[2]) // 2
    lo, hi = sorted((cal.prefill_step_s[1][0], cal.prefill_step_s[2][0]))
    assert lo <= c.prefill_step_s([(mid, 0)]) <= hi
    assert not c.fallbacks
    # beyond the grid: the analytic model, counted and reported
    beyond = [(cal.new_tokens[-1] + 1, 0)]
    assert c.prefill_step_s(beyond) == AnalyticalCost.from_scenario(s).prefill_step_s(beyond)
    assert c.fallbacks["prefill"] == 1
    assert "1 of 3 prefill costs lay outside the measured range" in c.fallback_lines()[0]


def test_decode_passes_through_every_measured_step_and_is_linear_between_batch_sizes():
    _, c = _cost()
    samples = c.cal.raw["decode"]["samples"]
    for x in samples:  # two contexts per batch size: each batch's line goes through both
        assert c.decode_step_s(x["batch"], x["context_tokens"]) == pytest.approx(x["step_s"])
    two, four = c.decode_step_s(2, 2 * 2000), c.decode_step_s(4, 4 * 2000)
    assert two < c.decode_step_s(3, 3 * 2000) < four
    assert c.decode_step_s(3, 3 * 2000) == pytest.approx((two + four) / 2)
    assert c.decode_step_s(0, 0) == 0.0 and not c.fallbacks


def test_the_control_plane_comes_from_the_file():
    _, c = _cost()
    assert c.control_plane_s == c.cal.control_plane_s


def test_a_bad_file_names_the_field(tmp_path):
    doc = json.loads(FILE.read_text())
    doc["prefill"]["step_s"][0][0] = -1
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(CalibrationError, match=r"prefill.step_s\[0\]\[0\] must be a number > 0"):
        load_calibration(bad)
    with pytest.raises(CalibrationError, match="no such calibration file"):
        load_calibration(tmp_path / "missing.json")
    doc["version"] = 99
    bad.write_text(json.dumps(doc))
    with pytest.raises(CalibrationError, match="field version must be one of 2, 3 .*re-run kvpool calibrate"):
        load_calibration(bad)
    doc = json.loads(FILE.read_text())
    del doc["save"]
    bad.write_text(json.dumps(doc))
    with pytest.raises(CalibrationError, match="missing field save.fit.fixed_s"):
        load_calibration(bad)
    doc = json.loads(FILE.read_text())
    doc["decode"]["samples"][0]["step_s"] = "fast"
    bad.write_text(json.dumps(doc))
    with pytest.raises(CalibrationError, match=r"decode.samples\[0\] must have a whole batch > 0"):
        load_calibration(bad)


def test_a_save_costs_its_fit_less_the_nic_and_the_analytic_model_outside_its_sizes():
    s, c = _cost()
    f = c.cal
    nbytes = f.save_bytes[1] // 2
    assert c.pack_s(nbytes) == pytest.approx(max(0.0, f.save_fixed_s + nbytes / f.save_bytes_per_s
                                                 - nbytes / (s.gpu.nic_gb_s * 1e9)))
    assert c.pack_s(f.save_bytes[1] + 1) == AnalyticalCost.from_scenario(s).pack_s(f.save_bytes[1] + 1)
    assert c.fallbacks["save"] == 1 and c.calls["save"] == 2


def test_sharing_is_read_when_present_checked_and_none_when_absent(tmp_path):
    doc = json.loads(FILE.read_text())
    doc["sharing"] = {"decode_slowdown_per_worker": 0.57, "prefill_slowdown_per_worker": 0.06}
    path = tmp_path / "sharing.json"
    path.write_text(json.dumps(doc))
    got = load_calibration(path).sharing
    assert (got.decode_slowdown_per_worker, got.prefill_slowdown_per_worker) == (0.57, 0.06)
    doc["sharing"]["prefill_slowdown_per_worker"] = -0.1
    path.write_text(json.dumps(doc))
    with pytest.raises(CalibrationError, match="sharing.prefill_slowdown_per_worker must be a finite number >= 0"):
        load_calibration(path)
    del doc["sharing"]
    path.write_text(json.dumps(doc))
    assert load_calibration(path).sharing is None


def test_the_robust_line_ignores_a_few_slow_first_transfers_that_tilt_least_squares():
    from kvpool.backend.serve.calibrate import _bytes_fit, _robust_line

    xs = [1e6 * k for k in range(1, 11)]
    ys = [0.005 + x / 5e9 for x in xs]  # 5 ms + 5 GB/s
    ys[0] += 1.3  # the first ever: compiles
    ys[1] += 0.25
    fixed, slope = _robust_line(xs, ys)
    assert fixed == pytest.approx(0.005) and slope == pytest.approx(1 / 5e9)
    # least squares would have the line fall (a negative slope)
    assert float(__import__("numpy").polyfit(xs, ys, 1)[0]) < 0
    fit = _bytes_fit(list(zip(xs, ys)))
    assert fit["fit"]["fixed_s"] == pytest.approx(0.005) and fit["gb_s"] == pytest.approx(5.0)
    # flat samples: no per-byte cost, the median as the fixed one
    assert _robust_line([1, 2, 3], [0.3, 0.1, 0.2]) == (pytest.approx(0.2), 0.0)


def test_refit_recomputes_the_fits_from_the_samples_and_keeps_what_was_measured():
    from kvpool.backend.serve.calibrate import _bytes_fit, refit

    doc = json.loads(FILE.read_text())
    doc["handoff"]["fit"]["fixed_s"] = 9.0  # a fit its samples do not give
    new = refit(doc)
    samples = [(x["bytes"], x["s"]) for x in doc["handoff"]["samples"]]
    assert new["handoff"] == _bytes_fit(samples) and new["handoff"]["fit"]["fixed_s"] < 1
    assert new["prefill"] == doc["prefill"] and new["restore"]["samples"] == doc["restore"]["samples"]
    assert new["overheads"]["control_plane_s"] == max(0.0, doc["overheads"]["ttft_residual_s_median"])


def test_a_version_3_file_scales_every_prefill_cell_by_its_replay_scale_and_a_version_2_file_by_1(tmp_path):
    s = load_scenario("cpu-tiny")
    doc = json.loads(FILE.read_text())
    assert doc["version"] == 2 and "replay_scale" not in doc["prefill"]
    step = [(300, 2000), (200, 500)]
    old = CalibratedCost(load_calibration(FILE), AnalyticalCost.from_scenario(s), 1e12)
    assert old.cal.prefill_scale == 1.0
    doc["version"] = 3
    doc["prefill"]["replay_scale"] = 1.25
    path = tmp_path / "v3.json"
    path.write_text(json.dumps(doc))
    new = CalibratedCost(load_calibration(path), AnalyticalCost.from_scenario(s), 1e12)
    assert new.prefill_step_s(step) == pytest.approx(1.25 * old.prefill_step_s(step))
    beyond = [(new.cal.new_tokens[-1] + 1, 0)]  # outside the grid: the analytic model, unscaled
    assert new.prefill_step_s(beyond) == AnalyticalCost.from_scenario(s).prefill_step_s(beyond)
    for bad, why in ((0, "> 0"), ("fast", "> 0"), (None, "> 0")):
        doc["prefill"]["replay_scale"] = bad
        path.write_text(json.dumps(doc))
        with pytest.raises(CalibrationError, match=f"field prefill.replay_scale must be a finite number {why}"):
            load_calibration(path)
    del doc["prefill"]["replay_scale"]
    path.write_text(json.dumps(doc))
    with pytest.raises(CalibrationError, match="missing field prefill.replay_scale"):
        load_calibration(path)
