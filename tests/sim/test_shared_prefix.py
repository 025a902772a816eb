"""A prefix shared by every session (``workload.shared_prefix_tokens``): one product's tool
definitions, cached once for all sessions on the GPU and in the pool."""

from __future__ import annotations

import numpy as np
from trace_builders import req, trace

from kvpool.scenario import load_scenario
from kvpool.sim.engine import Simulation
from kvpool.sim.keys import KeyChain, KeySpace
from kvpool.workload.model import Workload
from kvpool.workload.replay import AgentXReplay
from kvpool.workload.weka import session_from_weka
from test_sim_invariants import growing_session, infinite_cache_hit

SCENARIO = "mi355x-1p1d"  # one prefill instance: every request meets the same GPU cache


def run(w: Workload, shared_tokens: int, *, unbounded: bool = False):
    """The records of the first pass over ``w``: one lane plays the sessions one after the other
    (and wraps around until the window closes; later plays are fresh scopes and come after)."""
    s = load_scenario(SCENARIO, [f"workload.shared_prefix_tokens={shared_tokens}"])
    replay = AgentXReplay(w, lanes=1, seed=1, warmup=False, recycle=True, idle_cap_s=300.0, duration_s=2000.0)
    recs = sorted(Simulation(s, replay, unbounded=unbounded).run(), key=lambda r: r.arrival_s)
    return recs[: w.n_requests]


def ceiling(w: Workload, shared_blocks: int) -> int:
    """Reused tokens under an infinite cache, sessions in order, where the first
    ``shared_blocks`` blocks of every main-thread prompt are the same blocks in every session."""
    seen: set = set()
    reused = 0
    for s in w:
        for r in s.requests:
            ids = [(s.id, b) for b in s.block_ids(r.index).tolist()]
            if r.thread == 0:
                ids[:shared_blocks] = [("shared", i) for i in range(min(shared_blocks, len(ids)))]
            reused += infinite_cache_hit(ids, r.in_tokens, seen)
    return reused


def small_workload(n: int = 4) -> Workload:
    rng = np.random.default_rng(11)
    return Workload(tuple(session_from_weka(growing_session(f"s{i}", rng, turns=5)) for i in range(n)))


def test_the_replay_runs_sessions_one_after_the_other():
    w = small_workload()
    recs = run(w, 0)
    order = [r.session for r in sorted(recs, key=lambda r: r.arrival_s)]
    assert order == [s.id for s in w for _ in s.requests]


def test_unbounded_caches_reach_the_ceiling_with_the_prefix_counted_once():
    w = small_workload()
    for blocks in (0, 10, 25):
        recs = run(w, blocks * 64 + 17, unbounded=True)  # a partial block is not shared
        assert sum(r.gpu_tokens + r.pool_tokens for r in recs) == ceiling(w, blocks)
        for r in recs:
            assert r.gpu_tokens + r.pool_tokens + r.computed_tokens == r.in_tokens
    assert ceiling(w, 25) > ceiling(w, 10) > ceiling(w, 0)


def test_a_new_session_reuses_only_the_shared_prefix():
    # two sessions with the same local ids: without a shared prefix they share nothing
    a = trace("a", [req(0.0, 64 * 30, list(range(30))), req(10.0, 64 * 40, list(range(40)))])
    b = trace("b", [req(0.0, 64 * 50, list(range(50)))])
    w = Workload((session_from_weka(a), session_from_weka(b)))
    first_b = lambda recs: next(r for r in recs if r.session == "b")  # noqa: E731
    assert first_b(run(w, 0)).gpu_tokens + first_b(run(w, 0)).pool_tokens == 0
    got = first_b(run(w, 12 * 64))
    assert got.gpu_tokens == 12 * 64 and got.pool_tokens == 0
    assert got.computed_tokens == 50 * 64 - 12 * 64


def test_subagent_threads_do_not_share_the_main_prefix():
    a = trace("a", [req(0.0, 64 * 30, list(range(30)))])
    b = trace("b", [req(0.0, 64 * 20, list(range(100, 120))),
                    {"t": 1.0, "type": "subagent", "agent_id": "x_001", "subagent_type": "Explore",
                     "status": "completed", "requests": [req(0.0, 64 * 20, list(range(200, 220)))]}])
    w = Workload((session_from_weka(a), session_from_weka(b)))
    recs = run(w, 10 * 64)
    main_b = next(r for r in recs if r.session == "b" and r.thread == 0)
    sub_b = next(r for r in recs if r.session == "b" and r.thread != 0)
    assert main_b.gpu_tokens == 10 * 64
    assert sub_b.gpu_tokens + sub_b.pool_tokens == 0


def test_global_ids_under_one_chain_key_chunks_like_local_ids_under_their_scopes():
    """Equal chunks exactly when the scope-local keys say so, for ids made unique per scope."""
    rng = np.random.default_rng(5)
    local, glob = KeySpace("ns", 256), KeySpace("ns", 256)
    for scope in ("p1", "p2", "p3"):
        local_chain, glob_chain = KeyChain(), KeyChain()
        ids = np.arange(0, 200)
        for turn in range(4):
            ids = np.concatenate([ids[: int(rng.integers(50, ids.size))], np.arange(1000 * (turn + 1), 1000 * (turn + 1) + 60)])
            a = local.chunk_gids(scope, local_chain, ids, 64, ids.size * 64)
            off = glob.block_offset(scope, 5000)
            b = glob.chunk_gids(scope, glob_chain, ids + off, 64, ids.size * 64, chain_scope="")
            assert np.array_equal(a, b)
    assert local.groups == glob.groups
