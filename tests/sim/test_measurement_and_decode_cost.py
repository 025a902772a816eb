"""The measured window's grace cutoff (kvpool.workload.records) and the MTP-aware decode step (sim.cost)."""

import pytest

from kvpool.scenario import load_scenario
from kvpool.sim.cost import AnalyticalCost
from kvpool.workload.records import RequestRecord, summarize


def _rec(key: int, arrival: float, end: float, tokens: int = 1000) -> RequestRecord:
    r = RequestRecord(key, "s", 0, True, arrival, tokens, 10)
    r.first_token_s = arrival + 1.0
    r.end_s = end
    r.computed_tokens = tokens
    return r


def test_responses_after_the_cutoff_are_left_out():
    recs = [_rec(0, 0.0, 50.0), _rec(1, 10.0, 100.0), _rec(2, 20.0, 500.0)]
    full = summarize(recs, gpus=1)
    cut = summarize(recs, gpus=1, cutoff_s=130.0)
    assert full["requests"] == 3 and full["window_s"] == 500.0
    assert cut["requests"] == 2 and cut["window_s"] == 100.0
    assert cut["throughput_tok_s"] == pytest.approx(2 * 1010 / 100.0)
    assert cut["rejected"] == 0  # left out, not rejected


def test_run_point_cuts_at_duration_plus_grace():
    from kvpool.sim.run import run_point

    s = load_scenario("mi350x-6p2d-shared", ["workload.duration_s=120", "workload.synthetic_sessions=16"])
    out = run_point(s, 8)
    assert out["window_s"] <= 120 + s.workload.grace_s + 1e-6


def test_decode_per_sequence_cost_counts_the_tokens_a_step_verifies():
    base = load_scenario("mi355x-1p1d")
    costs = {}
    for accept in (1.0, 1.5, 2.0):
        s = base.model_copy(update={"decode": base.decode.model_copy(update={"mtp_accept_tokens": accept})})
        costs[accept] = AnalyticalCost.from_scenario(s)
    per = base.cost.decode_step_per_seq_s
    assert costs[1.0].decode_per_seq_s == pytest.approx(per)
    assert costs[1.5].decode_per_seq_s == pytest.approx(2 * per)  # one draft token verified
    assert costs[2.0].decode_per_seq_s == pytest.approx(2 * per)
    # the single server (MTP, acceptance 2): every running sequence costs two verified tokens a step
    assert costs[2.0].decode_step_s(10, 0) == pytest.approx(base.cost.decode_step_fixed_s + 10 * 2 * per)
