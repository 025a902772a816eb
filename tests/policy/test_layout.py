"""policy.layout: DCP mapping, gather and write plans."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.policy.layout import MIB, HandoffPlan, dcp_rank_of, handoff_counts, rank_token_count


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


@given(st.integers(0, 5000), st.sampled_from([1, 64, 4096]), st.integers(0, 300), st.integers(1, 8),
       st.lists(st.integers(1, 80), min_size=1, max_size=3), st.integers(1, 2048), st.integers(1, 64),
       st.integers(0, 2047))
def test_handoff_counts_equal_the_plans_writes(tokens, scale, start, ranks, depths, record, cap_records, extra):
    """Every depth's per-rank counts at once equal each depth's plan: its ranks' positions and
    its built writes (``len(writes(r))``), for write caps of whole records and ones that are not,
    short prompts and long ones (``scale`` grows the tokens and the cap alike)."""
    tokens *= scale
    max_write = cap_records * scale * record + extra % record
    counts = handoff_counts(tokens, depths, record, ranks, max_write, token_start=start)
    assert sorted(counts.rank_writes) == sorted(set(depths))
    for layers in depths:
        plan = HandoffPlan(tokens=tokens, layers=layers, record_bytes=record, ranks=ranks,
                           max_write_bytes=max_write, token_start=start)
        assert counts.rank_tokens == [len(plan.rank_positions(r)) for r in range(ranks)]
        assert counts.rank_writes[layers] == [len(plan.writes(r)) for r in range(ranks)]


def test_handoff_counts_of_the_seed_example():
    """8,192 tokens to 4 ranks from stages of 20 and 18 layers: 2,048 tokens a rank; a rank's
    20-layer buffer (23,592,960 B) takes 3 writes of <= 8 MiB, its 18-layer one (21,233,664 B) 3."""
    counts = handoff_counts(8192, (20, 18), 576, 4, 8 * MIB)
    assert counts.rank_tokens == [2048] * 4
    assert counts.rank_writes == {20: [3] * 4, 18: [3] * 4}
    counts = handoff_counts(5, (1,), 576, 4, 576, token_start=3)  # positions 3..7: ranks 3, 0, 1, 2, 3
    assert counts.rank_tokens == [1, 1, 1, 2] and counts.rank_writes == {1: [1, 1, 1, 2]}
