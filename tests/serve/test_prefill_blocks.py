"""The prefill engine's block manager: prefix reuse, LRU eviction of unreferenced cached pages,
reference counts, and the room a prompt needs."""

from __future__ import annotations

import pytest

from kvpool.backend.serve.blocks import BlockManager

P = 16


def manager(blocks: int = 8) -> BlockManager:
    return BlockManager(blocks, P, b"\x00" * 16)


def test_a_committed_prefix_is_reused_and_the_last_token_always_computed():
    m = manager()
    a = m.allocate(list(range(48)))                 # 3 full pages
    assert a.hit_pages == 0 and len(a.block_ids) == 3
    m.commit(a, 48)
    m.release(a)
    b = m.allocate(list(range(48)))                 # the same prompt: 2 pages reused, the last recomputed
    assert b.hit_pages == 2 and b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    c = m.allocate(list(range(40)) + [999] * 10)    # shares 2 full pages, then differs
    assert c.hit_pages == 2 and c.block_ids[:2] == a.block_ids[:2]


def test_uncommitted_pages_are_never_hits():
    m = manager()
    a = m.allocate(list(range(64)))
    b = m.allocate(list(range(64)))                 # a has not finished: nothing is cached yet
    assert b.hit_pages == 0 and not set(a.block_ids) & set(b.block_ids)


def test_unreferenced_cached_pages_are_evicted_oldest_first_tail_before_head_and_referenced_ones_never():
    m = manager(6)
    a = m.allocate(list(range(48)))
    m.commit(a, 48)
    m.release(a)                                    # 3 cached, unreferenced
    keep = m.allocate(list(range(1000, 1048)))      # 3 free pages
    m.commit(keep, 48)                              # cached and still referenced
    c = m.allocate(list(range(2000, 2032)))         # needs 2: evicts a's two last pages (its tail first)
    assert c is not None and m.evictions == 2
    assert set(c.block_ids) == set(a.block_ids[1:])
    assert m.allocate(list(range(3000, 3032))) is None  # 1 evictable page left, 2 needed: wait
    assert m.cached_prefix_pages(m.page_digests(list(range(48))), 48) == 1  # a's first page still hits


def test_release_returns_pages_and_a_prompt_larger_than_the_kv_is_refused():
    m = manager(4)
    a = m.allocate(list(range(64)))
    assert m.used_blocks == 4 and m.allocate([1]) is None
    m.release(a)
    assert m.used_blocks == 0 and m.allocate(list(range(64))) is not None
    with pytest.raises(ValueError, match="serve.prefill_kv_tokens"):
        m.allocate(list(range(65)))
