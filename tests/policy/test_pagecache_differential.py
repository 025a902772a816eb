"""``policy.pagecache.PageCache`` against a page-by-page reference of its contract
(``pagecache_reference``): the same calls give the same pages, hits, commits, evictions and
counts, with either key index, over random request streams that fill, share and evict."""

from __future__ import annotations

import random

import numpy as np
import pytest
from pagecache_reference import ReferencePageCache

from kvpool.policy.pagecache import DenseKeys, HashKeys, PageCache


def prompts(rng: random.Random, n: int) -> list[list[int]]:
    """``n`` prompts as page keys: turns of a few threads (each extends or cuts back its last
    prompt, keys chained by a counter), so prompts share prefixes as agent turns do."""
    counter = iter(range(10**9))
    threads: list[list[int]] = [[] for _ in range(4)]
    out = []
    for _ in range(n):
        t = rng.randrange(len(threads))
        keep = len(threads[t]) if rng.random() < 0.8 else rng.randrange(len(threads[t]) + 1)
        threads[t] = threads[t][:keep] + [next(counter) for _ in range(rng.randrange(1, 12))]
        out.append(list(threads[t]))
    return out


@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_the_array_cache_decides_as_the_page_by_page_reference(seed: int, dense: bool):
    rng = random.Random(seed)
    num_pages = rng.choice([24, 40, 64])
    ref, got = ReferencePageCache(num_pages), PageCache(num_pages, DenseKeys() if dense else HashKeys())
    live: list[tuple[object, object]] = []
    evicted_somewhere = False
    for keys in prompts(rng, 300):
        pages = len(keys) + rng.randrange(2)  # a partial last page sometimes
        limit = rng.randrange(len(keys) + 1)
        if pages > num_pages:
            with pytest.raises(ValueError):
                got.allocate(np.asarray(keys, dtype=np.int64) if dense else keys, pages, limit)
            continue
        a = ref.allocate(keys, pages, limit)
        # dense keys spread far apart (entries in spans of the keys met, not by the largest key)
        b = got.allocate(np.asarray(keys, dtype=np.int64) * 97 + 5_000_000 if dense else keys, pages, limit)
        assert (a is None) == (b is None)
        if a is not None:
            assert (b.block_ids, b.hit_pages) == (a.block_ids, a.hit_pages)
            live.append((a, b))
        while live and (a is None or rng.random() < 0.5):  # commit and release some in flight
            a2, b2 = live.pop(rng.randrange(len(live)))
            full = rng.randrange(len(a2.keys) + 1)
            assert got.commit(b2, full) == ref.commit(a2, full)
            ref.release(a2)
            got.release(b2)
            if a is None:
                break
        state = (got.held_pages, got.cached_pages, got.free_pages, got.evictions)
        assert state == (ref.held_pages, ref.cached_pages, ref.free_pages, ref.evictions)
        assert [got.is_evictable(p) for p in range(num_pages)] == [ref.is_evictable(p) for p in range(num_pages)]
        evicted_somewhere |= ref.evictions > 0
    assert evicted_somewhere  # the stream did fill the cache
    assert got.clear_cache() == ref.clear_cache()
    assert (got.free_pages, got.cached_pages) == (ref.free_pages, ref.cached_pages)
