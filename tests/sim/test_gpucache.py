"""sim.gpucache: prefix hits, LRU with tail-first ties, capacity."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.sim.gpucache import Blocks, GPUPrefixCache, first_occurrences, same


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


class _ReferenceLRU:
    """A direct statement of the contract: every block's last use and its depth in that use;
    eviction sorts all held blocks by (last use, deepest first) and drops the first ones."""

    def __init__(self, capacity_blocks: int, evict_fraction: float) -> None:
        self.cap = capacity_blocks
        self.frac = evict_fraction
        self.used: dict[int, tuple[float, int]] = {}

    def hit(self, ids, now):
        run = 0
        for b in ids:
            if b not in self.used:
                break
            run += 1
        for d, b in enumerate(ids[:run]):
            self.used[b] = (now, d)
        return run

    def insert(self, ids, now):
        ids = list(ids)[: self.cap]
        for d, b in enumerate(ids):
            self.used[b] = (now, d)
        if len(self.used) > self.cap:
            target = len(self.used) - self.cap + int(self.cap * self.frac)
            order = sorted((b for b in self.used if b not in set(ids)), key=lambda b: (self.used[b][0], -self.used[b][1]))
            for b in order[:target]:
                del self.used[b]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 80), min_size=1, max_size=20, unique=True)),
                max_size=60),
       st.sampled_from([0.0, 0.05, 0.25]))
def test_matches_a_direct_lru_model(ops, frac):
    """Hits and inserts at distinct moments give exactly the reference's hits and contents."""
    c = GPUPrefixCache(24 * 64, evict_fraction=frac)
    ref = _ReferenceLRU(24, frac)
    for i, (is_hit, p) in enumerate(ops):
        ids = np.array(p)
        if is_hit:
            assert c.hit_blocks(ids, float(i)) == ref.hit(p, float(i))
        else:
            c.insert(ids, float(i), 64)
            ref.insert(p, float(i))
        assert set(np.flatnonzero(c.held).tolist()) == set(ref.used)
        assert c.blocks == len(ref.used)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 6), st.booleans(), st.integers(0, 30)),
                min_size=1, max_size=50),
       st.sampled_from([0.0, 0.05, 0.25]))
def test_replaced_entries_change_nothing(turns, frac):
    """Threads whose prompts grow (sometimes diverging): a cache told which earlier entry each
    insert may replace (compared), and one told the prompt's lead and its use (prefixes by
    construction) as the simulator tells it, hold, hit and evict exactly what a cache that is
    not told does."""
    plain, told = GPUPrefixCache(40 * 64, evict_fraction=frac), GPUPrefixCache(40 * 64, evict_fraction=frac)
    pre = GPUPrefixCache(40 * 64, evict_fraction=frac)  # told the lead and the use
    prompts: dict[int, list[int]] = {}
    last: dict[int, object] = {}
    last_pre: dict[int, object] = {}
    fresh = 1000
    for i, (thread, grow, diverge, between) in enumerate(turns):
        p = list(prompts.get(thread, [thread * 100]))
        if diverge and len(p) > 1:
            p = p[: len(p) // 2]
        p += list(range(fresh, fresh + grow))
        fresh += grow
        prompts[thread] = p
        ids = np.array(p)
        now = 2.0 * i
        got = told.use(ids, now)
        run, hit = got.run, got.entry
        assert plain.hit_blocks(ids, now) == run
        lead = last_pre.get(thread)  # the thread's last insert, when it leads the prompt
        if lead is not None and not (lead.ids.size <= ids.size and same(lead.ids, ids[: lead.ids.size])):
            lead = None
        use_pre = pre.use(Blocks(ids, int(ids.max()), lead), now)
        assert use_pre.run == run
        hit_pre = use_pre.entry
        assert hit_pre is (pre._log[-1] if run else None)
        if between:  # another prompt between the use and the insert (its evictions included)
            other = np.arange(5000 + 100 * i, 5000 + 100 * i + between)
            for c in (plain, told, pre):
                c.insert(other, now + 0.5, 64)
        plain.insert(ids, now + 1, 64)
        earlier = last.get(thread) if i % 2 else hit  # the thread's last insert or the hit, compared
        last[thread] = told.insert(ids, now + 1, 64, earlier)
        earlier_pre = last_pre.get(thread)
        last_pre[thread] = pre.insert(use_pre, now + 1, 64, None if earlier_pre is lead else earlier_pre)
        if hit is not None and earlier is hit:  # compared or known, the hit is found stale
            assert hit.dead and hit_pre.dead
        for c in (told, pre):
            assert np.array_equal(plain.held, c.held)
            assert np.array_equal(plain._last, c._last)
            assert (plain.blocks, plain.evicted_blocks) == (c.blocks, c.evicted_blocks)


def test_a_replaced_entry_must_be_a_prefix():
    c = GPUPrefixCache(100 * 64)
    a = c.insert(np.array([1, 2, 3]), 0.0, 64)
    b = c.insert(np.array([1, 2, 3, 4]), 1.0, 64, a)
    assert a.dead and not b.dead
    d = c.insert(np.array([1, 9, 3, 4, 5]), 2.0, 64, b)
    assert not b.dead and not d.dead  # [1, 2, 3, 4] is not a prefix: block 2 is still live there
    e = c.insert(np.array([1, 9, 3, 4, 5]), 2.0, 64, d)
    assert not d.dead and not e.dead  # same moment: nothing is stale yet




@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 50), max_size=60))
def test_first_occurrences_are_those_of_a_sort(ids):
    """The scratch-array marking of each id's first position equals np.unique's first indices."""
    ids = np.array(ids, dtype=np.int64)
    want = np.zeros(ids.size, dtype=bool)
    want[np.unique(ids, return_index=True)[1]] = True
    scratch = np.full(64, 7, dtype=np.int32)
    assert np.array_equal(first_occurrences(ids, scratch), want)


def test_moment_zero_is_a_moment_before_every_later_one():
    """Blocks used at time 0 are held (the last-use array's 0 means 'not held', so time 0
    counts at the smallest positive float) and are the first evicted, deepest first, even
    against a moment a subnormal later."""
    c = GPUPrefixCache(4 * 64, evict_fraction=0.0)
    c.insert(np.array([1, 2]), 0.0, 64)
    assert c.hit_blocks(np.array([1, 2, 9]), 0.0) == 2
    c.insert(np.array([3, 4]), 1e-320, 64)
    c.insert(np.array([5]), 1.0, 64)
    assert set(np.flatnonzero(c.held).tolist()) == {1, 3, 4, 5}
    assert c.blocks == 4 and c.evicted_blocks == 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.booleans(), st.lists(st.integers(0, 60), min_size=1, max_size=16)),
                max_size=60))
def test_caches_sharing_one_scratch_decide_as_alone(ops):
    """Two caches whose scratch is one (left dirty by the other, grown by the larger ids) hold,
    hit and evict exactly what each does with its own; moments of several entries, repeated ids."""
    from kvpool.sim.gpucache import Scratch

    shared = Scratch()
    together = [GPUPrefixCache(12 * 64, scratch=shared), GPUPrefixCache(12 * 64, scratch=shared)]
    alone = [GPUPrefixCache(12 * 64), GPUPrefixCache(12 * 64)]
    for i, (which, is_hit, p) in enumerate(ops):
        now = float(i // 4)  # several calls per moment
        ids = np.array(p) + (1000 if which else 0)  # the second cache's ids run larger
        for c in (together[which], alone[which]):
            if is_hit:
                c.hit_blocks(ids, now)
            else:
                c.insert(ids, now, 64)
        assert np.array_equal(together[which].held, alone[which].held)
        assert together[which].evicted_blocks == alone[which].evicted_blocks
