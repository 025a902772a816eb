"""sim.gpucache: prefix hits, LRU with tail-first ties, capacity."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.sim.gpucache import GPUPrefixCache


def test_hit_is_the_leading_run():
    c = GPUPrefixCache(None)
    c.insert(np.array([1, 2, 3]), 0.0, 64)
    assert c.hit_blocks(np.array([1, 2, 3, 4]), 1.0) == 3
    assert c.hit_blocks(np.array([1, 9, 3]), 1.0) == 1


def test_capacity_evicts_least_recent_tail_first():
    c = GPUPrefixCache(10 * 64, evict_fraction=0.0)
    c.insert(np.arange(8), 0.0, 64)
    c.insert(np.arange(100, 104), 1.0, 64)  # 12 blocks > 10: the two deepest of the old prefix go
    assert c.blocks == 10
    assert c.hit_blocks(np.arange(8), 2.0) == 6
    assert c.hit_blocks(np.arange(100, 104), 2.0) == 4


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.integers(0, 60), min_size=1, max_size=12, unique=True), max_size=40))
def test_never_over_capacity(prompts):
    c = GPUPrefixCache(16 * 64)
    for i, p in enumerate(prompts):
        c.insert(np.array(p), float(i), 64)
        assert c.blocks == int(c.held.sum()) <= 16
