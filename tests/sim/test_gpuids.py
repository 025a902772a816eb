"""sim.gpuids: one GPU cache's dense names for the blocks it meets, page by page."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.sim.gpuids import PAGE_IDS, CacheIds


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", ""]), st.lists(st.integers(0, 999), max_size=40)), max_size=25))
def test_same_block_same_id_and_only_touched_pages_named(calls):
    names = CacheIds()
    seen: dict[tuple[str, int], int] = {}
    for scope, blocks in calls:
        out = np.full(len(blocks), -7, dtype=np.int64)
        names.ids(scope, 999, np.array(blocks, dtype=np.uint32), out)
        for b, g in zip(blocks, out.tolist()):
            assert 0 <= g < names.size and seen.setdefault((scope, b), g) == g
    assert len(set(seen.values())) == len(seen)  # distinct blocks, distinct ids
    pages = {(scope, b // PAGE_IDS) for scope, b in seen}
    assert names.size == len(pages) * PAGE_IDS


def test_a_scope_keeps_its_first_bound():
    names = CacheIds()
    out = np.empty(2, dtype=np.int64)
    names.ids("a", 100, np.array([0, 100]), out)
    with pytest.raises(ValueError, match="beyond"):
        names.ids("a", 100 + PAGE_IDS, np.array([0, 1]), out)
    names.ids("", 1 << 20, np.array([1 << 20, 5]), out)  # the global scope: its whole reserve
    assert out[0] != out[1]


def test_any_integer_block_ids_name_alike():
    """Weka stores (uint32), Mooncake rows (uint64) and plain int64 ids get the same names."""
    got = []
    for dtype in (np.uint32, np.uint64, np.int64):
        names, out = CacheIds(), np.empty(5, dtype=np.int64)
        names.ids("", (1 << 23) + 9, np.array([5, 300, 70000, 5, (1 << 23) + 9], dtype=dtype), out)
        got.append(out.tolist())
    assert got[0] == got[1] == got[2] and got[0][0] == got[0][3] and len(set(got[0])) == 4
