"""Pieces of sim.engine written out for speed, checked against the policy core they stand for."""

import pytest


@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
def test_handoff_plans_equal_policy_rank_plan(ranks):
    """The simulator's per-request hand-off plan equals policy.layout.rank_plan, write for write."""
    from kvpool.policy.layout import rank_plan
    from kvpool.sim.engine import handoff_plans

    record, max_write = 576, 8 << 20
    consts = [(layers, layers * record, max_write // record * record) for layers in (18, 20, 79)]
    for tokens in [0, 1, 2, 3, 5, 17, 4095, 4096, 65_537, 131_072, 1_000_003]:
        rank_tokens, plans = handoff_plans(tokens, ranks, consts)
        for layers, _, _ in consts:
            want = rank_plan(tokens, layers, record, ranks, max_write)
            assert [t for t, _ in want] == rank_tokens
            assert [w for _, w in want] == plans[layers]


def test_block_ids_from_reports_the_known_prefix_it_copied():
    """BlockStore.block_ids_from: the same ids as a walk without known lists, and its first n ids
    are known[r]'s first n (what the engine reuses for the GPU cache ids)."""
    import numpy as np

    from kvpool.scenario import load_scenario
    from kvpool.sim.run import workload_for

    w = workload_for(load_scenario("mi355x-1p1d"))
    for s in w.sessions[:5]:
        store = s.blocks
        latest: dict[int, int] = {}
        known: dict[int, np.ndarray] = {}
        copied = 0
        for req in s.requests[:80]:
            ids, r, n = store.block_ids_from(req.index, known)
            assert np.array_equal(ids, store.block_ids(req.index))
            if n:
                copied += 1
                assert r in known and r != req.index and np.array_equal(ids[:n], known[r][:n])
            else:
                assert r == -1
            old = latest.get(req.thread)
            if old is not None:
                known.pop(old, None)
            known[req.index] = ids
            latest[req.thread] = req.index
        assert copied  # the walks do stop at kept lists
