"""Request faults (``[faults]``, ``sim.faults``) and the lane-time accounting (``workload.records.lane_time``).

Faults are off by default and then change nothing; with them on a run stays deterministic; a
hang moves lane time into ``hung`` and never into TTFT; a failure gives back what it held; the
lane-time shares sum to 1 at every load.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool.scenario import load_scenario
from kvpool.sim.engine import Simulation
from kvpool.sim.faults import Faults
from kvpool.sim.fingerprint import CONFIGS, fingerprint
from kvpool.sim.run import make_replay, run_point, workload_for
from kvpool.workload.records import LANE_PHASES, RequestRecord, lane_time, request_phases, summarize

GOLDEN = Path(__file__).resolve().parent / "golden" / "fingerprint.json"
SPLIT = "mi350x-6p2d-split"
SHORT = ["workload.duration_s=240"]


def _sim(name: str, load: float, sets: list[str]) -> tuple[Simulation, list[RequestRecord]]:
    s = load_scenario(name, sets)
    sim = Simulation(s, make_replay(s, workload_for(s), load))
    return sim, sim.run()


def _config(name: str, extra: list[str]) -> str:
    scenario, load, overrides = CONFIGS[name]
    sim, records = _sim(scenario, load, overrides + extra)
    return fingerprint(sim, records)


# -- faults off ------------------------------------------------------------------------------

def test_faults_off_by_default():
    s = load_scenario(SPLIT)
    assert not s.faults.enabled and not Faults(s).enabled


@pytest.mark.parametrize("name", ["tp4-replay-split-0.8", "6p2d-split-112"])
def test_fault_fields_that_enable_nothing_change_no_result(name):
    """hang_s alone, or zero probabilities, is no fault: the digest is the golden one."""
    golden = json.loads(GOLDEN.read_text())["configs"][name]["sha256"]
    assert _config(name, ["faults.hang_s=60", "faults.hang_prob_other=0.0", "faults.restore_fail_prob=0.0"]) == golden


# -- faults on -------------------------------------------------------------------------------

FAULTY = ["faults.hang_prob_on_pool_miss=0.3", "faults.hang_prob_other=0.05", "faults.hang_s=40",
          "faults.request_timeout_s=60", "faults.restore_fail_prob=0.2", "faults.save_fail_prob=0.2"]


def test_faults_on_are_deterministic_and_change_the_run():
    a = _config("6p2d-split-112", FAULTY)
    assert a == _config("6p2d-split-112", FAULTY)
    assert a != json.loads(GOLDEN.read_text())["configs"]["6p2d-split-112"]["sha256"]
    assert a != _config("6p2d-split-112", FAULTY[:-1])  # each kind of fault matters


def test_a_draw_is_a_pure_function_of_seed_key_and_kind():
    f, g = Faults(load_scenario(SPLIT, FAULTY)), Faults(load_scenario(SPLIT, FAULTY + ["seed=8"]))
    draws = [f.draw(k, 1) for k in range(2000)]
    assert draws == [f.draw(k, 1) for k in range(2000)] and all(0 <= x < 1 for x in draws)
    assert draws != [f.draw(k, 2) for k in range(2000)] and draws != [g.draw(k, 1) for k in range(2000)]
    assert abs(sum(x < 0.3 for x in draws) / 2000 - 0.3) < 0.04  # uniform enough to give the probability


def test_a_hang_goes_to_hung_lane_time_and_never_to_ttft():
    sets = SHORT + ["faults.hang_prob_other=0.2", "faults.hang_s=100"]
    sim, records = _sim(SPLIT, 56, sets)
    hung = [r for r in records if r.hung_from_s >= 0]
    assert hung and all(r.error == "hang" and r.first_token_s == 0 for r in hung)
    assert all(r.end_s == pytest.approx(r.hung_from_s + 100) for r in hung)
    ok = [r for r in records if r.hung_from_s < 0]
    assert all(not r.error for r in ok)
    out = summarize(records, gpus=sim.gpus, lane_window=(0.0, sim.env.now))
    ref = summarize(ok, gpus=sim.gpus, lane_window=(0.0, sim.env.now))
    assert (out["ttft_p50_s"], out["ttft_p90_s"], out["requests"]) == (ref["ttft_p50_s"], ref["ttft_p90_s"], ref["requests"])
    assert out["errors"] == sum(r.measured for r in hung) > 0
    assert out["lane_share_hung"] > 0 and ref["lane_share_hung"] == 0
    # every hung second is in "hung": the hung spans, shared with the lane's other requests in flight
    for r in hung:
        assert request_phases(r)[-1] == ("hung", r.hung_from_s, r.end_s)


def test_a_failure_gives_back_its_reservations():
    sim, records = _sim(SPLIT, 56, SHORT + FAULTY)
    assert {r.error for r in records} >= {"hang", "timeout"}
    assert sim.gate.reserved == [0, 0] and all(d.reserved_tokens == 0 for d in sim.decodes)
    assert all(p.outstanding_tokens == 0 and p.queued_tokens() == 0 for p in sim.prefills)


def test_the_timeout_fails_a_request_at_admission_plus_timeout():
    sim, records = _sim(SPLIT, 112, SHORT + ["faults.request_timeout_s=8"])
    timed_out = [r for r in records if r.error == "timeout"]
    assert timed_out and all(r.end_s == pytest.approx(r.admitted_s + 8) for r in timed_out)
    assert all(r.first_token_s == 0 for r in timed_out)


def test_failed_restores_compute_and_lost_saves_leave_the_pool_empty():
    sim, records = _sim(SPLIT, 56, SHORT + ["faults.restore_fail_prob=1.0"])
    assert any(r.restore_failed for r in records) and all(r.pool_tokens == 0 for r in records)
    assert all(r.gpu_tokens + r.computed_tokens == r.in_tokens for r in records)
    sim, records = _sim(SPLIT, 56, SHORT + ["faults.save_fail_prob=1.0"])
    assert sim.pool.used_bytes == 0 and all(r.pool_tokens == 0 for r in records)
    assert any(r.save_bytes for r in records)  # the bytes travelled


# -- lane time -------------------------------------------------------------------------------

@pytest.mark.parametrize("sets", [[], FAULTY], ids=["no-faults", "faults"])
def test_lane_shares_sum_to_one_at_every_load(sets):
    for load in (24, 56):
        row = run_point(load_scenario(SPLIT, SHORT + sets), load)
        shares = [row[f"lane_share_{p}"] for p in LANE_PHASES]
        assert all(x >= 0 for x in shares) and sum(shares) == pytest.approx(1, abs=1e-9)
        assert row["lane_s"] == pytest.approx(load * 240)
        assert row["lane_share_decode"] > 0 and row["lane_share_recorded_wait"] > 0


def _rec(lane: int, arrival: float, end: float, **kw) -> RequestRecord:
    r = RequestRecord(key=arrival, lane=lane, arrival_s=arrival, end_s=end, gate_arrival_s=arrival, admitted_s=arrival,
                      prefill_start_s=arrival, compute_queued_s=arrival, compute_start_s=arrival,
                      prefill_end_s=kw.pop("prefill_end_s", arrival), decode_start_s=kw.pop("decode_start_s", arrival))
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def test_lane_time_splits_parallel_requests_equally_and_idle_is_recorded_wait():
    # lane 0: decode 0-10 alone, then a second request hangs 5-15 beside it -> 5 s shared
    a = _rec(0, 0.0, 10.0)
    b = _rec(0, 5.0, 15.0, hung_from_s=5.0, error="hang")
    # lane 1: nothing in the window but one prefill-queue span 0-4 (queued at 0, compute from 4)
    c = _rec(1, 0.0, 4.0, compute_start_s=4.0, prefill_end_s=4.0, decode_start_s=-1.0)
    total, share = lane_time([a, b, c], (0.0, 20.0))
    assert total == 40.0
    assert share["decode"] * 40 == pytest.approx(5 + 2.5)
    assert share["hung"] * 40 == pytest.approx(2.5 + 5)
    assert share["prefill_queue"] * 40 == pytest.approx(4)
    assert share["recorded_wait"] * 40 == pytest.approx(5 + 16)
    assert sum(share.values()) == pytest.approx(1)


def test_a_record_without_phase_stamps_is_unstamped():
    r = RequestRecord(key=1, session="s", arrival_s=1.0, end_s=3.0)
    assert request_phases(r) == [("unstamped", 1.0, 3.0)]
    total, share = lane_time([r], (0.0, 4.0))
    assert total == 4.0 and share["unstamped"] == 0.5 and share["recorded_wait"] == 0.5
