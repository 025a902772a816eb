"""``backend.serve.calibrate.measure`` against a real ``kvpool serve cpu-tiny``, on a small grid and
with a short replay phase: the curves it writes are the simulator's format, each fit is over the
samples it names, the hand-off and save fits see only the requests sent one at a time, the replay
phase's figures are the engines' accounts, its fit makes the simulated replay's stage time the
real one, and the document reads back as a ``sim.calibration.Calibration``."""

from __future__ import annotations

import asyncio
import statistics
from pathlib import Path

import pytest

from kvpool.backend.serve.calibrate import (SHARE_PROMPTS, SHARE_SETTLE_STEPS, SHARE_WINDOW_STEPS, WARM_UP_REQUESTS,
                                            _measured_step_s, _share_prompt_tokens)
from kvpool.backend.serve.calibrate_replay import PROBE_PROMPTS

GRID = {"new_tokens": [1, 128, 512, 1024], "cached_tokens": [0, 3072], "restore_tokens": [64, 256],
        "decode": [(1, 64), (1, 256), (2, 64), (2, 256)], "reps": 1,
        "share": {"prompt_tokens": 128, "batch": 2, "context_tokens": 256}}
REPLAY_TRACES = str(Path(__file__).resolve().parents[1] / "data" / "traces" / "kv-cache-tester-split" / "calibration")
REPLAY_SETS = ["workload.token_scale=0.015625", "workload.max_output_tokens=8", "workload.warmup_requests=0",
               "workload.idle_cap_s=1", 'cost.kv_capacity="serve"', 'workload.mode="agentx"', "workload.sessions=2",
               "workload.duration_s=6.0", "workload.grace_s=0"]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    from kvpool.backend.serve.calibrate import measure
    from kvpool.backend.serve.calibrate_replay import ReplayPhase
    from kvpool.backend.serve.engine_accounts import engine_urls
    from kvpool.backend.serve.launch import start_serve
    from kvpool.cli.calibrate import replay_schedule
    from kvpool.scenario.load import load_scenario

    s = load_scenario("cpu-tiny")
    served = start_serve("cpu-tiny", [], tmp_path_factory.mktemp("calibrate") / "serve")
    steps: list[str] = []
    try:
        replay_s = load_scenario("cpu-tiny", REPLAY_SETS)
        replay = ReplayPhase(replay_s, REPLAY_TRACES, engine_urls(served.run_dir), replay_schedule(replay_s, REPLAY_TRACES))
        doc = asyncio.run(measure(served.url, s, grid=GRID, replay=replay, on_step=steps.append))
    finally:
        served.stop()
    return s, doc, steps


@pytest.mark.timeout(300)
def test_every_request_is_counted_and_the_grid_is_the_one_asked_for(measured):
    from kvpool.backend.serve.calibrate import plan_size

    s, doc, steps = measured
    # "restore: flushed" and the replay's one step are no request of the calibration's client
    assert len(steps) == plan_size(GRID, s, replay=True) and doc["requests"] == len(steps) - 2
    assert doc["prefill"]["new_tokens"] == GRID["new_tokens"] and doc["prefill"]["cached_tokens"] == GRID["cached_tokens"]
    assert all(v > 0 for row in doc["prefill"]["step_s"] for v in row)


@pytest.mark.timeout(300)
def test_the_sharing_slowdowns_are_the_ratios_of_the_steps_and_windows_it_measured(measured):
    s, doc, _ = measured
    share = doc["sharing"]
    assert (share["batch"], share["context_tokens"]) == (GRID["share"]["batch"], GRID["share"]["context_tokens"])
    # a prompt of the prefill grid, at least the one asked for, long enough by the grid
    steps = [row[0] for row in doc["prefill"]["step_s"]]
    long_enough = SHARE_WINDOW_STEPS * _measured_step_s(doc["decode"], 2, 256) / s.prefill.pp
    assert share["prompt_tokens"] == _share_prompt_tokens(128, GRID["new_tokens"], steps, long_enough)
    assert share["prompt_tokens"] in GRID["new_tokens"] and share["prompt_tokens"] >= GRID["share"]["prompt_tokens"]
    assert len(share["prefill_window_alone_s"]) == SHARE_PROMPTS
    assert 1 <= len(share["prefill_window_beside_s"]) <= SHARE_PROMPTS  # those inside the decode's stream
    assert share["decode_tokens"] > 2 * SHARE_SETTLE_STEPS
    before, beside = share["decode_step_before_s"], share["decode_step_beside_s"]
    assert 0 < before < 1 and 0 < beside < 1
    assert share["decode_slowdown_per_worker"] == pytest.approx(max(0.0, beside / before - 1), rel=1e-12)
    windows = statistics.median(share["prefill_window_beside_s"]) / statistics.median(share["prefill_window_alone_s"])
    assert share["prefill_slowdown_per_worker"] == pytest.approx(max(0.0, windows - 1), rel=1e-12)
    # the same prompt alone at the end against its prefill-grid cell (no cached context) over the stages
    cell_s = doc["prefill"]["step_s"][GRID["new_tokens"].index(share["prompt_tokens"])][0]
    assert share["prefill_alone_over_grid"] == pytest.approx(
        statistics.median(share["prefill_window_alone_s"]) / (s.prefill.pp * cell_s), rel=1e-12)


@pytest.mark.timeout(300)
def test_the_prefill_grid_is_measured_after_the_restore_and_decode_phases(measured):
    _, doc, steps = measured
    order = [label.split(" ")[0].rstrip(":") for label in steps]
    first = {phase: order.index(phase) for phase in ("restore", "decode", "prefill", "sharing", "replay")}
    assert first["restore"] < first["decode"] < first["prefill"] < first["sharing"] < first["replay"]
    assert list(doc["phase_s"]) == ["warm_up", "restore", "decode", "prefill", "sharing", "replay"]


def test_the_sharing_prompt_is_the_shortest_measured_one_whose_window_spans_enough_decode_steps():
    new, stage_s = [1, 128, 512, 1024], [0.002, 0.01, 0.07, 0.17]
    assert _share_prompt_tokens(128, new, stage_s, 0.05) == 512
    assert _share_prompt_tokens(128, new, stage_s, 0.001) == 128  # never shorter than asked
    assert _share_prompt_tokens(128, new, stage_s, 1.0) == 1024  # none long enough: the longest


@pytest.mark.timeout(300)
def test_the_hand_off_and_save_fits_are_over_the_requests_sent_one_at_a_time(measured):
    s, doc, _ = measured
    decode_requests = sum(1 + b for b, _ in GRID["decode"])  # a shared prefix, then the batch together
    sharing_requests = 2 * SHARE_PROMPTS + 1 + GRID["share"]["batch"]  # prompts alone and beside, the decode's
    probes = 2 * PROBE_PROMPTS  # the replay phase's prompts alone before and after it
    hand, save = doc["handoff"], doc["save"]
    assert len(hand["samples"]) == doc["requests"] - WARM_UP_REQUESTS - decode_requests - sharing_requests - probes
    per_token = s.model.record_bytes * s.model.layers
    assert {x["bytes"] for x in hand["samples"]} >= {n * per_token for n in (1, 128, 1024)}
    assert all(x["s"] > 0 for x in hand["samples"] + save["samples"])
    # a save is of whole chunks, per stage (the stages hold equal layers here)
    chunk = s.pool.chunk_tokens * per_token // s.prefill.pp
    assert save["samples"] and all(x["bytes"] % chunk == 0 for x in save["samples"])
    for curve in (hand, save):
        assert curve["bytes_range"] == [0, max(x["bytes"] for x in curve["samples"])]
        assert curve["fit"]["fixed_s"] >= 0 and curve["fit"]["bytes_per_s"] > 0


@pytest.mark.timeout(300)
def test_the_document_reads_back_as_the_simulators_calibration(measured, tmp_path):
    from kvpool.cli.calibrate import calibration_document
    from kvpool.sim.calibration import parse_calibration

    s, doc, _ = measured
    cal = parse_calibration(calibration_document(s, doc, url="http://127.0.0.1:1", device="cpu"), "measured")
    assert cal.save_bytes == tuple(doc["save"]["bytes_range"]) and cal.handoff_bytes == tuple(doc["handoff"]["bytes_range"])
    assert cal.save_bytes_per_s == doc["save"]["fit"]["bytes_per_s"] and cal.prefill_pp == s.prefill.pp


@pytest.mark.timeout(300)
def test_the_replay_phase_holds_the_engines_accounts_of_the_traces_it_replayed(measured):
    from kvpool.backend.serve.calibrate_replay import trace_digests

    s, doc, _ = measured
    r = doc["replay"]
    assert r["files"] == trace_digests(REPLAY_TRACES) and len(r["files"]) == 5
    assert (r["sessions"], r["duration_s"], r["token_scale"]) == (2, 6.0, 0.015625)
    assert r["requests"] >= 2 and r["errors"] == 0 and r["idle"]
    p = r["prefill"]
    assert p["step_tokens"] > 0 and p["steps"] > 0 and 0 < p["forward_s"] <= p["stage_s"]
    assert p["stage_us_per_token"] == pytest.approx(1e6 * p["stage_s"] / p["step_tokens"], rel=1e-12)
    assert r["decode"]["steps"] > 0 and r["decode"]["mean_batch"] >= 1
    cell_s = doc["prefill"]["step_s"][GRID["new_tokens"].index(doc["sharing"]["prompt_tokens"])][0]
    for probe in (r["alone_before"], r["alone_after"]):
        assert probe["prompt_tokens"] == doc["sharing"]["prompt_tokens"] and len(probe["windows_s"]) == PROBE_PROMPTS
        assert probe["over_grid"] == pytest.approx(statistics.median(probe["windows_s"]) / (s.prefill.pp * cell_s),
                                                   rel=1e-12)
        assert all(f > 0 for f in probe["forward_us_per_token"])
    assert doc["prefill"]["replay_scale"] == 1.0  # until sim.replay_fit sets it


@pytest.mark.timeout(300)
def test_the_replay_fit_scales_the_cells_until_the_simulated_replay_spends_what_the_real_one_did(measured):
    from kvpool.cli.calibrate import calibration_document
    from kvpool.scenario.load import load_scenario
    from kvpool.sim.calibration import parse_calibration
    from kvpool.sim.replay_fit import TOLERANCE, with_replay_scale

    s, doc, _ = measured
    scaled = with_replay_scale(calibration_document(s, doc, url="http://127.0.0.1:1", device="cpu"),
                               load_scenario("cpu-tiny", REPLAY_SETS), REPLAY_TRACES)
    fit = scaled["replay"]["fit"]
    assert fit["real_us_per_token"] == doc["replay"]["prefill"]["stage_us_per_token"]
    off = [abs(us / fit["real_us_per_token"] - 1) for _, us in fit["runs"]]
    assert fit["runs"][0][0] == 1.0 and fit["runs"][off.index(min(off))] == [fit["scale"], fit["sim_us_per_token"]]
    # a scaled step changes which steps overlap, so the nearest run may miss by a little
    assert min(off) <= 0.05, fit
    assert fit["converged"] == (min(off) <= TOLERANCE) and fit["prefill_steps_outside_grid"] == 0
    assert scaled["prefill"]["replay_scale"] == fit["scale"] > 0
    cal = parse_calibration(scaled, "scaled")  # the measured cells as they were, the scale beside them
    assert cal.prefill_scale == fit["scale"] and cal.prefill_step_s == tuple(map(tuple, doc["prefill"]["step_s"]))
