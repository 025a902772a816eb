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
