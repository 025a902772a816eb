"""policy.layout: DCP mapping, gather and write plans."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.policy.layout import MIB, HandoffPlan, dcp_rank_of, rank_token_count


def test_seed_handoff_example():
    plan = HandoffPlan(tokens=8192, layers=20, record_bytes=576, ranks=4, max_write_bytes=8 * MIB)
    assert plan.naive_writes == 163_840
    assert plan.batched_writes == 12
    assert plan.total_bytes == 94_371_840  # "about 94 MB"
    assert len(plan.all_writes()) == 12


def test_dcp_rank_of():
    assert [dcp_rank_of(t, 4) for t in range(6)] == [0, 1, 2, 3, 0, 1]


@given(st.integers(0, 5000), st.integers(0, 300), st.integers(1, 8), st.integers(1, 40),
       st.integers(1, 2048), st.integers(1, 64))
def test_writes_cover_every_buffer_exactly(tokens, start, ranks, layers, record, cap_records):
    plan = HandoffPlan(tokens=tokens, layers=layers, record_bytes=record, ranks=ranks,
                       max_write_bytes=cap_records * record + record // 2, token_start=start)
    assert sum(plan.rank_tokens(r) for r in range(ranks)) == tokens
    for r in range(ranks):
        pos = list(plan.rank_positions(r))
        assert len(pos) == plan.rank_tokens(r)
        assert all(p % ranks == r and start <= p < start + tokens for p in pos)
        writes = plan.writes(r)
        assert sum(w.nbytes for w in writes) == plan.buffer_bytes(r)
        off = 0
        for w in writes:
            assert w.offset_bytes == off and 0 < w.nbytes <= plan.max_write_bytes and w.nbytes % record == 0
            off += w.nbytes
    assert plan.batched_writes == len(plan.all_writes())
    assert all(plan.rank_writes(r) == len(plan.writes(r)) for r in range(ranks))
    assert sum(plan.buffer_bytes(r) for r in range(ranks)) == plan.total_bytes


def test_rank_token_count_bounds():
    with pytest.raises(ValueError):
        rank_token_count(10, 4, 4)
    assert [rank_token_count(10, r, 4) for r in range(4)] == [3, 3, 2, 2]


def test_write_cap_smaller_than_record_is_rejected():
    with pytest.raises(ValueError, match="smaller than one record"):
        HandoffPlan(tokens=16, layers=1, record_bytes=576, ranks=1, max_write_bytes=100)


@given(st.integers(0, 5000), st.integers(0, 300), st.integers(1, 8), st.integers(1, 40), st.integers(1, 2048))
def test_rank_plan_matches_per_rank_queries(tokens, start, ranks, layers, record):
    plan = HandoffPlan(tokens=tokens, layers=layers, record_bytes=record, ranks=ranks, token_start=start)
    assert plan.rank_plan() == [(plan.rank_tokens(r), plan.rank_writes(r)) for r in range(ranks)]
