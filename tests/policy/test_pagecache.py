"""The page discipline of the prefill's GPU prefix cache (``policy.pagecache``): held pages are never
evicted, a request that cannot get its pages changes nothing, released pages go tail first."""

from __future__ import annotations

import pytest

from kvpool.policy.pagecache import PageCache


def keys(name: str, n: int) -> list[tuple[str, int]]:
    """``n`` chained page keys of prefix ``name`` (equal names: equal prefixes)."""
    return [(name, k) for k in range(n)]


def test_a_committed_prefix_hits_up_to_the_limit_and_whatever_holds_it():
    c = PageCache(8)
    a = c.allocate(keys("a", 3), 3, limit=0)
    assert a.hit_pages == 0 and a.block_ids == [0, 1, 2]
    early = c.allocate(keys("a", 3), 3, limit=2)  # a has not committed: no hit, pages of its own
    assert early.hit_pages == 0 and early.block_ids == [3, 4, 5]
    c.commit(a, 3)
    b = c.allocate(keys("a", 3), 3, limit=2)  # a still holds them: a cached page hits anyway
    assert b.hit_pages == 2 and b.block_ids == [0, 1, 6]
    assert c.held_pages == 7 and c.cached_pages == 3


def test_held_pages_are_never_evicted_and_a_request_that_cannot_get_pages_changes_nothing():
    c = PageCache(6)
    a = c.allocate(keys("a", 4), 4, limit=0)
    c.commit(a, 4)
    c.release(a)  # 4 cached, unreferenced
    b = c.allocate(keys("a", 4) + keys("b", 2), 6, limit=5)  # reuses a's 4 pages and takes the 2 free
    assert b.hit_pages == 4 and c.free_pages == 0 and not any(c.is_evictable(p) for p in b.block_ids)
    state = (c.held_pages, c.cached_pages, c.free_pages, c.evictions)
    assert c.allocate(keys("x", 1), 1, limit=0) is None  # every page is held: it waits
    assert (c.held_pages, c.cached_pages, c.free_pages, c.evictions) == state
    c.release(b)
    x = c.allocate(keys("x", 1), 1, limit=0)  # b's uncommitted pages were freed: one of them, no eviction
    assert x.block_ids[0] in b.block_ids[4:] and c.evictions == 0 and c.cached_prefix(keys("a", 4), 4) == 4


def test_release_puts_a_prefix_tail_first_and_the_oldest_release_goes_first():
    c = PageCache(6)
    a = c.allocate(keys("a", 3), 3, limit=0)
    c.commit(a, 3)
    b = c.allocate(keys("b", 3), 3, limit=0)
    c.commit(b, 3)
    c.release(a)  # released first: older
    c.release(b)
    x = c.allocate(keys("x", 2), 2, limit=0)  # evicts a's last two pages
    assert set(x.block_ids) == set(a.block_ids[1:]) and c.evictions == 2
    assert c.cached_prefix(keys("a", 3), 3) == 1 and c.cached_prefix(keys("b", 3), 3) == 3


def test_a_page_committed_twice_stays_private_and_is_freed_on_release():
    c = PageCache(4)
    a = c.allocate(keys("a", 2), 2, limit=0)
    b = c.allocate(keys("a", 2), 2, limit=0)  # the same prefix, neither committed
    assert c.commit(a, 2) == 2 and c.commit(b, 2) == 0
    c.release(b)
    assert c.free_pages == 2 and c.cached_pages == 2 and c.held_pages == 2
    c.release(a)
    c.release(a)  # once only
    assert c.held_pages == 0 and c.cached_pages == 2 and c.free_pages == 2


def test_a_prompt_of_more_pages_than_exist_is_refused_and_a_hit_page_is_not_evicted_for_its_own_request():
    c = PageCache(4)
    with pytest.raises(ValueError, match="5 pages needed, 4 exist"):
        c.allocate(keys("a", 5), 5, limit=4)
    a = c.allocate(keys("a", 4), 4, limit=0)
    c.commit(a, 4)
    c.release(a)
    b = c.allocate(keys("a", 4), 4, limit=3)  # 3 hits, 1 page to find: a's last page, not a hit one
    assert b.hit_pages == 3 and b.block_ids == a.block_ids[:3] + [a.block_ids[3]] and c.evictions == 1
    assert c.clear_cache() == 0 and c.held_pages == 4
    c.release(b)
    assert c.clear_cache() == 3 and c.cached_pages == 0 and c.free_pages == 4
