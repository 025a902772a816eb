"""backend.serve.engine_accounts: what the engines' time accounts say the serving stack costs
(``stack_cost``) and a prefill stage's step costs (``stage_time``).

A decode engine's cost is its busy time outside decode steps; a prefill engine's is the part of its
steps' time in flight spent neither in a stage's layers nor queued behind a stage's earlier step
(the pipeline's fill is the plan's, not the stack's)."""

from __future__ import annotations

import pytest

from kvpool.backend.serve import engine_accounts as accounts


def _prefill(pending_s, in_flight_s, forward_s, queued_s, handled_s, round_trip_s, steps=0, step_tokens=0):
    return {"pending_s": pending_s, "computable_s": pending_s, "loading_only_s": 0.0,
            "steps_in_flight_s": in_flight_s, "steps": steps, "step_tokens": step_tokens, "stage_forward_s": forward_s, "stage_queued_s": queued_s,
            "stage_handled_s": handled_s, "stage_round_trip_s": round_trip_s}


ZERO_PREFILL = _prefill(0.0, 0.0, [0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0])


def test_a_busy_prefill_engine_is_charged_only_what_the_pipeline_does_not_need():
    # 10 s holding work, 16 s of steps in flight (1.6 of 2 stages), 6 + 5 s in the layers,
    # 2 s queued, 14 s of round trips of which 13.5 s handled at the stages.
    before = {"prefill0": ZERO_PREFILL, "decode0": {"busy_s": 0.0, "step_s": 0.0}}
    after = {"prefill0": _prefill(10.0, 16.0, [6.0, 5.0], [1.0, 1.0], [7.5, 6.0], [8.0, 6.0]),
             "decode0": {"busy_s": 5.0, "step_s": 4.9}}
    got = accounts.stack_cost(before, after, 20.0)
    p = got["engines"]["prefill0"]
    assert got["bottleneck"] == "prefill0"
    assert p["forward_share"] == pytest.approx(0.6)
    assert p["mean_steps_in_flight"] == pytest.approx(1.6)
    assert p["stack_share"] == pytest.approx((16.0 - 11.0 - 2.0) / 16.0)
    assert got["stack_cost"] == pytest.approx(p["stack_share"])
    calls = p["stage_calls"]
    assert calls["hop_share"] == pytest.approx(0.5 / 14.0)
    assert calls["stage_other_share"] == pytest.approx((13.5 - 2.0 - 11.0) / 14.0)


def test_a_busy_decode_engine_is_charged_its_time_outside_steps():
    before = {"prefill0": ZERO_PREFILL, "decode0": {"busy_s": 1.0, "step_s": 1.0}}
    after = {"prefill0": _prefill(2.0, 2.0, [1.0, 1.0], [0.0, 0.0], [1.0, 1.0], [1.0, 1.0]),
             "decode0": {"busy_s": 9.0, "step_s": 8.6}}
    got = accounts.stack_cost(before, after, 10.0)
    assert got["bottleneck"] == "decode0"
    assert got["stack_cost"] == pytest.approx(1.0 - 7.6 / 8.0)


def test_a_stage_step_is_its_round_trip_less_its_wait_behind_earlier_steps_averaged_over_the_stages():
    # two stages: round trips 8 and 6 s, of which 1 and 3 s queued behind an earlier step; 10 steps of 4,000 tokens
    before = {"prefill0": ZERO_PREFILL, "decode0": {"busy_s": 0.0, "step_s": 0.0, "steps": 0, "sequences": 0}}
    after = {"prefill0": _prefill(10.0, 16.0, [6.0, 4.0], [1.0, 3.0], [7.5, 5.5], [8.0, 6.0], steps=10, step_tokens=4000),
             "decode0": {"busy_s": 5.0, "step_s": 4.8, "steps": 100, "sequences": 250}}
    got = accounts.stage_time(before, after)
    assert got["prefill"] == {"stage_s": pytest.approx((7.0 + 3.0) / 2), "forward_s": pytest.approx(5.0),
                              "step_tokens": 4000, "steps": 10}
    assert got["decode"] == {"step_s": pytest.approx(4.8), "steps": 100, "sequences": 250}
