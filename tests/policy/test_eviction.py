"""policy.eviction: contract tests run against every registered policy, plus LRU/LFU/FIFO order."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.policy.eviction import EVICTION_POLICIES, GroupedPool, make_policy

POLICIES = sorted(EVICTION_POLICIES)


def fill(pool: GroupedPool, groups: int, stages: int = 4, nbytes: int = 10, t0: float = 0.0):
    for g in range(groups):
        for s in range(stages):
            pool.put(f"c{g}/s{s}", f"g{g}", nbytes, t0 + g)


@pytest.mark.parametrize("name", POLICIES)
def test_group_is_evicted_whole(name):
    pool = GroupedPool(400, name, high_watermark=0.9, evict_ratio=0.05)
    fill(pool, 12)  # 480 B into 400 B: evictions happen
    assert pool.evicted_groups > 0
    for g in range(12):
        held = [f"c{g}/s{s}" in pool for s in range(4)]
        assert all(held) or not any(held)
    assert pool.used_bytes <= pool.capacity_bytes


@pytest.mark.parametrize("name", POLICIES)
def test_watermark_pass_frees_at_least_ratio(name):
    pool = GroupedPool(1000, name, high_watermark=0.9, evict_ratio=0.05)
    for g in range(91):
        pool.put(f"k{g}", f"g{g}", 10, g)
    # 910 B > 900 B: one pass freed >= 5 % of 1000 B
    assert pool.used_bytes <= 910 - 50
    assert pool.evicted_bytes >= 50


@pytest.mark.parametrize("name", POLICIES)
def test_pinned_groups_are_never_evicted(name):
    pool = GroupedPool(100, name, high_watermark=1.0, evict_ratio=0.05)
    fill(pool, 2, stages=1, nbytes=50)
    pool.pin("g0")
    pool.pin("g1")
    r = pool.put("x", "gx", 10, 5.0)
    assert not r.stored and r.evicted == () and "c0/s0" in pool and "c1/s0" in pool
    pool.unpin("g1")
    r = pool.put("x", "gx", 10, 6.0)
    assert r.stored and r.evicted == ("g1",) and "c0/s0" in pool


@pytest.mark.parametrize("name", POLICIES)
def test_eviction_is_all_or_nothing(name):
    pool = GroupedPool(100, name, high_watermark=1.0)
    pool.put("a", "ga", 60, 0)
    pool.pin("ga")
    before = (pool.used_bytes, len(pool), pool.evicted_groups)
    assert not pool.put("b", "gb", 50, 1).stored
    assert (pool.used_bytes, len(pool), pool.evicted_groups) == before


@pytest.mark.parametrize("name", POLICIES)
def test_first_writer_wins(name):
    pool = GroupedPool(100, name)
    pool.put("k", "g1", 10, 0)
    r = pool.put("k", "g2", 30, 1)
    assert r.already_present and pool.group_of("k") == "g1" and pool.used_bytes == 10


@pytest.mark.parametrize("name", POLICIES)
def test_object_larger_than_pool_is_rejected(name):
    pool = GroupedPool(100, name)
    assert not pool.put("k", "g", 101, 0).stored and len(pool) == 0


@pytest.mark.parametrize("name", POLICIES)
@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["put", "read", "pin", "unpin", "remove"]),
                              st.integers(0, 15), st.integers(1, 60)), max_size=120))
def test_accounting_invariants(name, ops):
    pool = GroupedPool(300, name, high_watermark=0.9, evict_ratio=0.05)
    for t, (op, g, nbytes) in enumerate(ops):
        if op == "put":
            r = pool.put(f"g{g}/s{t % 2}", f"g{g}", nbytes, t)
            freed = set(r.evicted)
            assert all(pool.group_of(k) not in freed for k in list(pool._objects))
        elif op == "read":
            pool.touch([f"g{g}/s0", f"g{g}/s1"], t)
        elif op == "pin":
            pool.pin(f"g{g}")
        elif op == "unpin":
            pool.unpin(f"g{g}")
        else:
            pool.remove(f"g{g}/s0")
        assert 0 <= pool.used_bytes <= pool.capacity_bytes
        assert pool.used_bytes == sum(n for _, n in pool._objects.values())


def test_lru_reads_refresh_recency():
    pool = GroupedPool(300, "lru", high_watermark=1.0, evict_ratio=0.01)
    for g in range(3):
        pool.put(f"k{g}", f"g{g}", 100, g)
    pool.touch(["k0"], 10)
    r = pool.put("k3", "g3", 100, 11)
    assert r.evicted == ("g1",)


def test_fifo_ignores_reads():
    pool = GroupedPool(300, "fifo", high_watermark=1.0, evict_ratio=0.01)
    for g in range(3):
        pool.put(f"k{g}", f"g{g}", 100, g)
    pool.touch(["k0"], 10)
    assert pool.put("k3", "g3", 100, 11).evicted == ("g0",)


def test_lfu_keeps_frequently_read():
    pool = GroupedPool(300, "lfu", high_watermark=1.0, evict_ratio=0.01)
    for g in range(3):
        pool.put(f"k{g}", f"g{g}", 100, g)
    for t in range(3):
        pool.touch(["k0", "k2"], 10 + t)
    assert pool.put("k3", "g3", 100, 20).evicted == ("g1",)


def test_unknown_policy_lists_allowed():
    with pytest.raises(ValueError, match="allowed: \\['fifo', 'lfu', 'lru'\\]"):
        make_policy("arc")
