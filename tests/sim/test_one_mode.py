"""One simulator: ``cost.kv_capacity`` chooses where the capacities come from, never which
mechanisms run. A built-in planning scenario and the same scenario told the same capacities as
``serve.*`` give the same records; the serve-sized one differs only through its smaller prefill KV."""

from __future__ import annotations

from kvpool.scenario import load_scenario
from kvpool.scenario.derive import decode_kv_capacity_tokens, prefill_kv_capacity_tokens
from kvpool.sim.engine import Simulation
from kvpool.sim.run import make_replay, workload_for
from kvpool.sim.steps.pages import PrefillPages

BASE = ["workload.duration_s=300", "workload.warmup_requests=1"]


def run(overrides: list[str]) -> tuple[Simulation, list]:
    s = load_scenario("mi355x-1p1d", BASE + overrides)
    sim = Simulation(s, make_replay(s, workload_for(s), 6))
    return sim, sim.run()


def test_the_capacity_flag_selects_data_not_mechanisms():
    planned = load_scenario("mi355x-1p1d", BASE)
    prefill_tokens, decode_tokens = prefill_kv_capacity_tokens(planned), decode_kv_capacity_tokens(planned)
    serve_sized = ['cost.kv_capacity="serve"', f"serve.prefill_kv_tokens={prefill_tokens}",
                   f"serve.decode_kv_tokens={decode_tokens}"]
    told = load_scenario("mi355x-1p1d", BASE + serve_sized)
    assert prefill_kv_capacity_tokens(told) == prefill_tokens
    # the decode engine allocates whole pages per DCP rank: at most one page per rank more
    assert 0 <= decode_kv_capacity_tokens(told) - decode_tokens < told.decode.dcp * told.model.page_tokens

    (sim_a, a), (sim_b, b) = run([]), run(serve_sized)
    for sim in (sim_a, sim_b):  # the same mechanisms: the engine's pages and pipeline on every prefill
        assert all(isinstance(p.pages, PrefillPages) for p in sim.world.prefills)
        assert all(p.step_page_tokens == planned.model.page_tokens for p in sim.world.prefills)
    assert len(a) > 20 and sum(r.gpu_tokens for r in a) > 0
    assert [vars(r) for r in a] == [vars(r) for r in b]  # six sessions never fill the decode KV

    sim_c, c = run(['cost.kv_capacity="serve"'])  # the scenario's own serve sizes: 65,536 prefill tokens
    assert sim_c.world.prefills[0].pages.cache.num_pages == load_scenario("mi355x-1p1d").serve.prefill_kv_tokens // 16
    assert [vars(r) for r in c] != [vars(r) for r in a]
