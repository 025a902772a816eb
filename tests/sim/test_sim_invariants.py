"""Simulator invariants on small generated sessions and a few real traces."""

from __future__ import annotations

import numpy as np
import pytest
from trace_builders import KV_TRACES, req, trace

from kvpool.scenario import load_scenario
from kvpool.sim.engine import Simulation
from kvpool.sim.run import run_point, sweep
from kvpool.workload.load import load_workload
from kvpool.workload.model import Workload
from kvpool.workload.records import summarize
from kvpool.workload.replay import AgentXReplay
from kvpool.workload.weka import session_from_weka

SCENARIO = "mi355x-1p1d"


def growing_session(tid: str, rng: np.random.Generator, turns: int = 8) -> dict:
    """One main thread whose context grows; one turn rewrites history after block 40 (a prefix change)."""
    ids: list[int] = []
    nxt = 0
    reqs = []
    t = 0.0
    for k in range(turns):
        if k == turns // 2 and len(ids) > 40:
            ids = ids[:40]  # history changed: only the first 40 blocks still match
        grow = int(rng.integers(20, 120))
        ids = ids + list(range(nxt, nxt + grow))
        nxt += grow
        n_in = len(ids) * 64 - int(rng.integers(0, 63))
        reqs.append(req(t, n_in, list(ids), out=int(rng.integers(50, 400)), api=2.0))
        t += 2.0 + float(rng.exponential(20.0))
    return trace(tid, reqs)


def small_workload(n: int = 6, seed: int = 3) -> Workload:
    rng = np.random.default_rng(seed)
    return Workload(tuple(session_from_weka(growing_session(f"s{i}", rng)) for i in range(n)))


def every_request(w: Workload, lanes: int) -> AgentXReplay:
    return AgentXReplay(w, lanes=lanes, seed=1, warmup=False, recycle=False, idle_cap_s=300.0)


def infinite_cache_hit(ids: list, in_tokens: int, seen: set) -> int:
    """One prompt's reused tokens under an infinite cache holding the blocks in ``seen`` (then
    adds the prompt's), with the last-token and whole-page rules of policy.hits (docs/metrics.md)."""
    full = min(len(ids), in_tokens // 64)
    h = 0
    while h < full and ids[h] in seen:
        h += 1
    seen.update(ids[:full])
    return min(h * 64, in_tokens - 1) // 16 * 16


def ceiling_tokens(w: Workload) -> tuple[int, int]:
    """(reused, prompt) tokens under an infinite cache, in each session's order."""
    reused = prompt = 0
    for s in w:
        seen: set[int] = set()
        for r in s.requests:
            reused += infinite_cache_hit(s.block_ids(r.index).tolist(), r.in_tokens, seen)
            prompt += r.in_tokens
    return reused, prompt


def test_unbounded_caches_reach_the_trace_ceiling_exactly():
    w = small_workload()
    s = load_scenario(SCENARIO)
    sim = Simulation(s, every_request(w, lanes=len(w)), unbounded=True)
    recs = sim.run()
    assert len(recs) == w.n_requests and all(r.measured for r in recs)
    reused, prompt = ceiling_tokens(w)
    m = summarize(recs, gpus=sim.gpus)
    assert m["prompt_tokens"] == prompt
    assert sum(r.gpu_tokens + r.pool_tokens for r in recs) == reused
    assert m["reuse"] == reused / prompt


def test_token_sources_add_up_and_bytes_follow_the_kv_size():
    w = small_workload()
    s = load_scenario(SCENARIO, ["prefill.gpu_mem_utilization=0.47"])  # tiny GPU cache: the pool must work
    sim = Simulation(s, every_request(w, lanes=len(w)))
    recs = sim.run()
    bpt = s.kvspec().bytes_per_token
    chunk_bytes = s.pool.chunk_tokens * bpt
    assert sum(r.pool_tokens for r in recs) > 0
    for r in recs:
        assert r.gpu_tokens + r.pool_tokens + r.computed_tokens == r.in_tokens
        assert r.computed_tokens >= 1
        assert r.handoff_bytes == r.in_tokens * bpt
        assert r.restore_bytes % chunk_bytes == 0
        if r.pool_tokens:
            assert r.pool_tokens * bpt <= r.restore_bytes < (r.pool_tokens + s.pool.chunk_tokens) * bpt
            assert len(r.restore_stage_s) == 4 and r.restore_spread_s >= max(r.restore_stage_s)
        else:
            assert r.restore_bytes == 0
        assert r.save_bytes % chunk_bytes == 0
        assert r.arrival_s <= r.prefill_start_s <= r.prefill_end_s <= r.first_token_s <= r.end_s


def test_no_pool_means_no_pool_share():
    w = small_workload()
    s = load_scenario(SCENARIO, ["pool.gib_per_service=0", "prefill.gpu_mem_utilization=0.47"])
    recs = Simulation(s, every_request(w, lanes=len(w))).run()
    m = summarize(recs, gpus=8)
    assert m["share_pool"] == 0.0 and m["reuse"] == m["share_gpu"]
    assert all(r.restore_bytes == 0 and r.save_bytes == 0 for r in recs)


def test_run_leaves_the_cyclic_collector_as_it_found_it():
    """The run keeps its long-lived objects out of full collections while it runs, then hands
    the collector back: nothing frozen before stays frozen after, a caller's freeze is kept."""
    import gc

    w = small_workload(n=2)
    s = load_scenario(SCENARIO)
    assert gc.get_freeze_count() == 0
    first = Simulation(s, every_request(w, lanes=len(w))).run()
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        again = Simulation(s, every_request(w, lanes=len(w))).run()
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
    assert [r.as_dict() for r in first] == [r.as_dict() for r in again]


def test_pool_recovers_what_the_small_gpu_cache_loses():
    w = small_workload()
    small_gpu = ["prefill.gpu_mem_utilization=0.47"]
    with_pool = summarize(Simulation(load_scenario(SCENARIO, small_gpu), every_request(w, len(w))).run(), gpus=8)
    without = summarize(Simulation(load_scenario(SCENARIO, small_gpu + ["pool.gib_per_service=0"]),
                                   every_request(w, len(w))).run(), gpus=8)
    assert with_pool["reuse"] > without["reuse"]
    assert with_pool["share_computed"] < without["share_computed"]


def test_same_seed_same_results_in_any_process():
    s = load_scenario(SCENARIO, ["workload.duration_s=300", "workload.synthetic_sessions=12", "workload.warmup_requests=1"])
    traces = str(KV_TRACES / "trace_0001.json.gz")
    one = run_point(s, 4, traces)
    again = sweep(s, [4, 6], traces=traces, workers=2)
    strip = lambda r: {k: v for k, v in r.items() if k not in ("wall_s", "cpu_s", "sim_s_per_wall_s")}  # noqa: E731
    assert strip(one) == strip(again[0])
    assert again[1]["sessions"] == 6 and again[0]["sessions"] == 4


def test_real_traces_run_and_use_the_pool_under_pressure():
    files = sorted(KV_TRACES.glob("*.json.gz"))[:12]
    w = Workload(tuple(s for f in files for s in load_workload(f)))
    s = load_scenario(SCENARIO, ["prefill.gpu_mem_utilization=0.5", "workload.duration_s=600"])
    rp = AgentXReplay(w, lanes=12, seed=s.seed, duration_s=600.0, warmup_requests=2)
    sim = Simulation(s, rp)
    m = summarize(sim.run(), gpus=sim.gpus, occupancy=(sim.timeline.decode_t, sim.timeline.decode_occ))
    assert m["requests"] > 50
    assert abs(m["share_gpu"] + m["share_pool"] + m["share_computed"] - 1.0) < 1e-12
    assert m["share_pool"] > 0 and m["reuse"] > 0.8
    assert 0 < m["ttft_p50_s"] <= m["ttft_p90_s"]
    assert 0 < m["decode_kv_occupancy_p50"] < 1


def test_weighted_median_of_a_step_function():
    from kvpool.workload.records import weighted_median

    # 0.1 for 1 s, 0.9 for 3 s, 0.5 for 1 s -> the median time-weighted value is 0.9
    assert weighted_median([0.0, 1.0, 4.0], [0.1, 0.9, 0.5], 5.0) == 0.9
    assert weighted_median([0.0, 4.0], [0.2, 0.7], 5.0) == 0.2


def test_ssd_tier_catches_what_dram_evicts():
    w = small_workload(n=8)
    small = ["prefill.gpu_mem_utilization=0.47", "pool.gib_per_service=0.4"]
    ssd = small + ["pool.ssd.enabled=true", "pool.ssd.gib_per_server=64"]
    dram_only = summarize(Simulation(load_scenario(SCENARIO, small), every_request(w, len(w))).run(), gpus=8)
    recs = Simulation(load_scenario(SCENARIO, ssd), every_request(w, len(w))).run()
    with_ssd = summarize(recs, gpus=8)
    assert with_ssd["share_ssd"] > 0 and dram_only["share_ssd"] == 0
    assert with_ssd["reuse"] > dram_only["reuse"]
    for r in recs:
        assert r.gpu_tokens + r.pool_tokens + r.ssd_tokens + r.computed_tokens == r.in_tokens


def test_four_server_gate_admits_and_rejects_with_a_reason():
    w = small_workload()
    s = load_scenario("mi350x-6p2d-shared", ["gate.max_input_tokens=6000"])
    sim = Simulation(s, every_request(w, lanes=len(w)))
    recs = sim.run()
    rejected = [r for r in recs if r.rejected]
    admitted = [r for r in recs if not r.rejected]
    assert rejected and all(r.in_tokens > 6000 and r.rejected == "reject_input_too_long" for r in rejected)
    assert admitted and all(r.in_tokens <= 6000 and r.end_s >= r.first_token_s > 0 for r in admitted)
    assert {r.decode for r in admitted} <= {0, 1} and sim.gate.reserved == [0, 0]  # every reservation released
    assert summarize(recs, gpus=sim.gpus)["rejected"] == len(rejected)


def test_frontend_overhead_delays_every_first_token_by_exactly_that_much():
    w = small_workload(1)
    runs = {}
    for x in (0.0, 0.75):
        s = load_scenario(SCENARIO, [f"cost.frontend_overhead_s={x}"])
        runs[x] = Simulation(s, every_request(w, lanes=1)).run()
    for a, b in zip(runs[0.0], runs[0.75]):
        assert b.ttft_s == pytest.approx(a.ttft_s + 0.75, abs=1e-9)
        assert (b.gpu_tokens, b.pool_tokens, b.computed_tokens) == (a.gpu_tokens, a.pool_tokens, a.computed_tokens)


@pytest.mark.timeout(60)
def test_a_full_gate_rejects_at_its_deadline_whatever_the_clock_rounding():
    """A wait that starts at 500.002 s with a 30 s bound ends at 530.002 s rounded down, a few
    1e-14 s short of its deadline; a timeout that short never advances the clock, so the gate must
    reject at the deadline as rounded (re-waiting on it would hang the run at that moment)."""
    from kvpool.workload.records import RequestRecord

    s = load_scenario("mi350x-6p2d-shared", ["gate.max_wait_s=30"])
    sim = Simulation(s, every_request(small_workload(1), lanes=1))
    start, wait = 500.002, 30.0
    assert wait - ((start + wait) - start) > 0  # the rounding this test is about
    for d in range(len(sim.decodes)):  # fill the gate: nothing will ever be released
        k = 0
        while sim.gate.try_admit(("blocker", d, k), 900_000, 0, d).value == "admitted":
            k += 1
    env = sim.env
    env.run(until=start)
    rec = RequestRecord(1, "s", 0, True, env.now, 100_000, 1000)
    rejected = []
    sim.lifecycle.admit_step.arrive(rec, lambda decode: None, lambda: rejected.append(env.now))
    env.run(until=start + 2 * wait)
    assert rec.rejected == "reject_admission_timeout" and rejected == [start + wait]


def test_gate_admits_waiters_first_fit_in_arrival_order_at_the_release():
    """A release offers the freed budget to the waiters in arrival order: one that does not fit
    keeps its place while a later, smaller one is admitted; each is admitted at the release's
    moment on the decode instance with room, and one that never fits is rejected at its bound."""
    from kvpool.workload.records import RequestRecord

    s = load_scenario("mi350x-6p2d-shared", ["gate.tokens_per_decode=1000000", "gate.max_wait_s=30"])
    sim = Simulation(s, every_request(small_workload(1), lanes=1))
    env, gate = sim.env, sim.gate
    budget = gate.free_tokens(0)
    assert budget == gate.free_tokens(1) == 900_000
    for d in (0, 1):
        assert gate.try_admit(("blocker", d), budget - 1000, 1000, d).value == "admitted"
    done: dict[int, tuple[float, int | None]] = {}

    admit = sim.lifecycle.admit_step

    def ask(key: int, at_s: float, need: int):
        yield env.timeout(at_s - env.now)
        rec = RequestRecord(key, "s", 0, True, env.now, need - 1000, 1000)
        admit.arrive(rec, lambda decode: done.__setitem__(key, (env.now, decode, rec.rejected)),
                     lambda: done.__setitem__(key, (env.now, None, rec.rejected)))

    def release(at_s: float, key):
        yield env.timeout(at_s)
        admit.release(key)

    for key, at_s, need in ((1, 1.0, 600_000), (2, 2.0, 700_000), (3, 3.0, 200_000), (4, 4.0, 120_000)):
        env.process(ask(key, at_s, need))
    env.process(release(5.0, ("blocker", 0)))
    env.process(release(10.0, ("blocker", 1)))
    env.run(until=100.0)
    assert done[1] == (5.0, 0, "")  # first in line, fits the freed 900K
    assert done[3] == (5.0, 0, "")  # the 300K left fit the third, not the second
    assert done[2] == (10.0, 1, "")  # the second kept its place until decode 1 freed
    assert done[4] == (10.0, 1, "")  # 100K left on decode 0 was too little; after the second, 200K on 1
    assert gate.free_tokens(0) == 100_000 and gate.free_tokens(1) == 900_000 - 700_000 - 120_000
    assert not admit.waiters
    # nothing is released any more: a request that does not fit waits its 30 s and is rejected
    env.process(ask(5, 101.0, 400_000))
    env.run(until=200.0)
    assert done[5] == (131.0, None, "reject_admission_timeout") and not admit.waiters


def test_split_pool_serves_each_prefill_from_its_own_server():
    w = small_workload()
    recs = Simulation(load_scenario("mi350x-6p2d-split", ["prefill.gpu_mem_utilization=0.47"]),
                      every_request(w, lanes=len(w))).run()
    assert all(r.gpu_tokens + r.pool_tokens + r.computed_tokens == r.in_tokens for r in recs)
    assert len({r.prefill for r in recs}) > 1  # routing spreads the turns over prefill instances


def test_simulation_runs_with_the_collector_off_and_restores_it():
    """Simulation.run turns the cyclic collector off while it runs and back on after (left off
    when the caller had it off)."""
    import gc

    from kvpool.scenario import load_scenario
    from kvpool.sim.engine import Simulation
    from kvpool.sim.run import make_replay, workload_for

    s = load_scenario("mi355x-1p1d", ["workload.duration_s=20", "workload.preset=agentx-062126"])
    seen = []
    sim = Simulation(s, make_replay(s, workload_for(s), 2))
    sim.env.process((lambda: (seen.append(gc.isenabled()), (yield sim.env.timeout(0))))())
    assert gc.isenabled()
    sim.run()
    assert seen == [False] and gc.isenabled()
    gc.disable()
    try:
        Simulation(s, make_replay(s, workload_for(s), 2)).run()
        assert not gc.isenabled()
    finally:
        gc.enable()
