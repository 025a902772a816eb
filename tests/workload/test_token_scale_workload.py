"""``workload.token_scale`` applied by the workload layer: one rule for the simulator and the replay."""

from __future__ import annotations

import pytest

from kvpool.backend.serve.prompts import PromptBuilder
from kvpool.scenario.derive import decode_kv_capacity_tokens, prefill_kv_capacity_tokens
from kvpool.scenario.load import load_scenario
from kvpool.sim.run import make_replay, workload_for
from kvpool.workload.replay import run_fixed_latency
from kvpool.workload.token_scale import scale_workload, scaled_block_tokens, scaled_prompt_tokens

TRACES = "tests/data/traces/kv-cache-tester"


def _dispatches(s, workload, n=60):
    return [x.dispatch for x in run_fixed_latency(make_replay(s, workload, 3), lambda d: 1.0, max_dispatches=n)]


@pytest.mark.parametrize("scale", [1 / 32, 1 / 16, 0.3])
def test_scaled_workload_gives_the_scaled_prompts(scale):
    s = load_scenario("cpu-tiny", ["workload.duration_s=3600.0", f"workload.token_scale={scale!r}"])
    raw = workload_for(s.model_copy(update={"workload": s.workload.model_copy(update={"token_scale": 1.0})}), TRACES)
    scaled = workload_for(s, TRACES)
    assert scaled is not raw
    for a, b in zip(raw.sessions, scaled.sessions):
        assert b.block_tokens == scaled_block_tokens(a.block_tokens, scale)
        assert [r.in_tokens for r in b.requests] == [scaled_prompt_tokens(r.in_tokens, a.block_tokens, scale)
                                                     for r in a.requests]
        assert [r.out_tokens for r in b.requests] == [r.out_tokens for r in a.requests]
    # the replay's prompts: a scaled session at F = 1 is the recorded session at F, token for token
    old, new = PromptBuilder(s.serve.vocab, scale), PromptBuilder(s.serve.vocab)
    pairs = list(zip(_dispatches(s, raw), _dispatches(s, scaled), strict=True))
    assert len(pairs) == 60
    for da, db in pairs:
        assert da.key == db.key and da.request.index == db.request.index
        assert old.prompt(da) == new.prompt(db)
        assert len(new.prompt(db)) == db.in_tokens


def test_scale_one_is_the_workload_itself():
    s = load_scenario("cpu-tiny")
    w = workload_for(s, TRACES)
    assert scale_workload(w, 1.0) is w


def test_serve_capacities_are_opt_in():
    s = load_scenario("cpu-tiny")
    assert prefill_kv_capacity_tokens(s) > 10 * s.serve.prefill_kv_tokens  # derived from HBM
    t = load_scenario("cpu-tiny", ['cost.kv_capacity="serve"'])
    assert prefill_kv_capacity_tokens(t) == t.serve.prefill_kv_tokens == 8192
    assert decode_kv_capacity_tokens(t) == t.serve.decode_kv_tokens == 32768
    u = load_scenario("cpu-tiny", ['cost.kv_capacity="serve"', "serve.decode_kv_tokens=1000"])
    assert decode_kv_capacity_tokens(u) == 1024  # whole pages per DCP rank, as the decode engine allocates
