"""policy.eviction: GroupedPool, the reference implementation of the grouped-eviction contract."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.policy.eviction import EVICTION_ORDERS, ORDERS, GroupedPool, Put, order_key

STORED, REJECTED, PRESENT = Put.STORED, Put.REJECTED, Put.PRESENT


def put_chunks(pool: GroupedPool, chunks, now: float, stages: int = 1, nbytes: int = 10):
    """One put of every stage object of ``chunks`` (chunk ``c``: group ``gc``, keys ``c/s``)."""
    keys = [f"{c}/{s}" for c in chunks for s in range(stages)]
    return pool.put(keys, [f"g{k.split('/')[0]}" for k in keys], [nbytes] * len(keys), now)


def test_registry_names_and_unknown_names():
    assert sorted(EVICTION_ORDERS) == sorted(ORDERS) == ["fifo", "lfu", "lru"]
    with pytest.raises(ValueError, match="unknown eviction policy 'arc'; allowed: \\['fifo', 'lfu', 'lru'\\]"):
        order_key("arc")
    with pytest.raises(ValueError, match="allowed"):
        GroupedPool(10, "arc")


@pytest.mark.parametrize("order", ORDERS)
def test_group_is_evicted_whole_and_capacity_holds(order):
    pool = GroupedPool(400, order, high_watermark=0.9, evict_ratio=0.05)
    for c in range(12):  # 480 B into 400 B, one chunk (4 stage objects) per put
        put_chunks(pool, [c], float(c), stages=4)
    assert pool.evicted_groups > 0 and pool.used_bytes <= 400
    for c in range(12):
        held = [f"{c}/{s}" in pool for s in range(4)]
        assert all(held) or not any(held)


def test_lru_prefix_written_at_one_moment_loses_its_tail():
    """10 objects of room, a 10-chunk prefix in one put, then one more chunk."""
    pool = GroupedPool(100, "lru", high_watermark=0.9, evict_ratio=0.05)
    assert put_chunks(pool, range(10), 0.0).outcomes == (STORED,) * 10
    res = put_chunks(pool, [10], 1.0)
    assert res.evicted_groups == ("g9", "g8") and res.evicted_keys == ("9/0", "8/0")
    assert sorted(pool.keys()) == sorted(f"{c}/0" for c in [*range(8), 10])  # the head is still a hit


def test_a_pass_frees_the_ratio_and_skips_the_puts_own_groups():
    pool = GroupedPool(1000, "lru", high_watermark=0.9, evict_ratio=0.05)
    put_chunks(pool, range(95), 0.0)  # 950 B > 900 B, but every group is the put's own
    assert pool.used_bytes == 950 and pool.evict_passes == 0
    res = put_chunks(pool, [95], 1.0)  # 960 B: frees ceil(1000 x (0.96 - 0.9 + 0.05)) = 110 B
    assert res.evicted_bytes == 110 and len(res.evicted_groups) == 11 and "95/0" in pool
    assert pool.evict_passes == 1 and pool.evicted_objects == 11


def test_leading_groups_that_fit_are_stored_the_rest_rejected():
    pool = GroupedPool(100, "lru", high_watermark=1.0, evict_ratio=0.01)
    put_chunks(pool, [0], 0.0, nbytes=50)
    pool.pin("g0")
    # 30 + 20 B fit in the 50 B free; the next 30 B do not, and the 5 B after them are rejected too
    res = pool.put(["a", "b", "c", "d"], ["ga", "gb", "gc", "gd"], [30, 20, 30, 5], 1.0)
    assert res.outcomes == (STORED, STORED, REJECTED, REJECTED) and res.evicted_groups == ()
    assert pool.used_bytes == 100


def test_groups_are_stored_whole_in_the_order_the_put_first_names_them():
    pool = GroupedPool(100, "lru", high_watermark=1.0, evict_ratio=0.01)
    res = pool.put(["x/0", "y/0", "x/1"], ["x", "y", "x"], [40, 40, 40], 0.0)
    assert res.outcomes == (STORED, REJECTED, STORED)  # x (80 B) is named first and fits; y does not
    assert pool.keys() == ["x/0", "x/1"]


def test_pins_protect_and_nest():
    pool = GroupedPool(100, "lru", high_watermark=1.0, evict_ratio=0.05)
    put_chunks(pool, [0, 1], 0.0, nbytes=50)
    pool.pin("g0")
    pool.pin("g1")
    pool.pin("g1")
    res = put_chunks(pool, [2], 1.0)
    assert res.outcomes == (REJECTED,) and res.evicted_groups == () and pool.evict_passes == 0
    pool.unpin("g1")
    assert put_chunks(pool, [2], 2.0).outcomes == (REJECTED,)  # still pinned once
    pool.unpin("g1")
    res = put_chunks(pool, [2], 3.0)
    assert res.outcomes == (STORED,) and res.evicted_groups == ("g1",)


def test_pins_count_per_group_name_even_before_it_holds_objects():
    pool = GroupedPool(20, "fifo", high_watermark=1.0)
    pool.pin("g0")
    put_chunks(pool, [0, 1], 0.0)
    assert put_chunks(pool, [2], 1.0).evicted_groups == ("g1",)


def test_first_writer_wins_and_a_re_put_is_a_use():
    pool = GroupedPool(30, "lru", high_watermark=1.0, evict_ratio=0.01)
    for c in range(3):
        put_chunks(pool, [c], float(c))
    res = pool.put(["0/0"], ["another-group"], [25], 5.0)  # present: size and group stay
    assert res.outcomes == (PRESENT,) and pool.group_of("0/0") == "g0" and pool.used_bytes == 30
    assert put_chunks(pool, [3], 6.0).evicted_groups == ("g1",)  # g0 was used at 5.0


def test_a_key_named_twice_in_one_put_counts_once():
    pool = GroupedPool(100, "lru")
    res = pool.put(["k", "k"], ["g", "h"], [10, 70], 0.0)
    assert res.outcomes == (STORED, STORED) and pool.used_bytes == 10 and pool.group_of("k") == "g"


def test_an_object_larger_than_the_pool_is_rejected():
    pool = GroupedPool(100, "lru")
    assert pool.put(["k"], ["g"], [101], 0.0).outcomes == (REJECTED,) and len(pool) == 0


def test_lru_reads_refresh_recency():
    pool = GroupedPool(30, "lru", high_watermark=1.0, evict_ratio=0.01)
    for c in range(3):
        put_chunks(pool, [c], float(c))
    assert pool.lookup(["0/0", "nope"], 10.0) == [True, False]
    assert put_chunks(pool, [3], 11.0).evicted_groups == ("g1",)


def test_fifo_ignores_reads_and_re_puts():
    pool = GroupedPool(30, "fifo", high_watermark=1.0, evict_ratio=0.01)
    for c in range(3):
        put_chunks(pool, [c], float(c))
    pool.lookup(["0/0"], 10.0)
    put_chunks(pool, [0], 11.0)
    assert put_chunks(pool, [3], 12.0).evicted_groups == ("g0",)


def test_lfu_counts_read_calls_not_objects_nor_puts():
    pool = GroupedPool(60, "lfu", high_watermark=1.0, evict_ratio=0.01)
    put_chunks(pool, [0, 1, 2], 0.0, stages=2)
    pool.lookup(["0/0", "0/1", "0/0"], 1.0)  # one read of g0, however many of its objects
    pool.lookup(["1/0"], 2.0)
    pool.lookup(["1/1"], 3.0)  # g1: two reads
    put_chunks(pool, [2], 4.0, stages=2)  # a re-put is a use, not a read
    assert pool.group("g0").reads == 1 and pool.group("g1").reads == 2 and pool.group("g2").reads == 0
    assert put_chunks(pool, [3], 5.0, stages=2).evicted_groups == ("g2",)
    assert put_chunks(pool, [4], 6.0, stages=2).evicted_groups == ("g3",)  # a new group has no reads
    assert put_chunks(pool, [5], 7.0, stages=2).evicted_groups == ("g4",)
    pool.lookup(["5/0"], 8.0)
    assert put_chunks(pool, [6], 9.0, stages=2).evicted_groups == ("g0",)  # 1 read, older use than g5


def test_remove_keeps_the_group_while_it_holds_objects():
    pool = GroupedPool(100, "lfu")
    put_chunks(pool, [0], 0.0, stages=2)
    pool.lookup(["0/0"], 1.0)
    assert pool.remove("0/0") and not pool.remove("0/0")
    g = pool.group("g0")
    assert (g.reads, g.last_use_s, g.inserted, g.nbytes) == (1, 1.0, 1, 10)
    assert pool.remove("0/1") and pool.group("g0") is None and pool.used_bytes == 0
    put_chunks(pool, [0], 2.0)
    assert pool.group("g0").inserted == 2 and pool.group("g0").reads == 0 and pool.evicted_groups == 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="capacity_bytes"):
        GroupedPool(-1)
    with pytest.raises(ValueError, match="high_watermark"):
        GroupedPool(10, high_watermark=0.0)
    with pytest.raises(ValueError, match="evict_ratio"):
        GroupedPool(10, evict_ratio=1.5)
    with pytest.raises(ValueError, match="> 0 bytes"):
        GroupedPool(10).put(["k"], ["g"], [0], 0.0)
    with pytest.raises(ValueError, match="differ in length"):
        GroupedPool(10).put(["k"], [], [1], 0.0)


@pytest.mark.parametrize("order", ORDERS)
@settings(max_examples=60, deadline=None, derandomize=True)
@given(ops=st.lists(st.tuples(st.sampled_from(["put", "read", "pin", "unpin", "remove"]),
                              st.lists(st.integers(0, 15), min_size=1, max_size=4), st.integers(1, 60)), max_size=80))
def test_accounting_invariants(order, ops):
    pool = GroupedPool(300, order, high_watermark=0.9, evict_ratio=0.05)
    for t, (op, chunks, nbytes) in enumerate(ops):
        if op == "put":
            keys = [f"{c}/{t % 2}" for c in chunks]
            res = pool.put(keys, [f"g{c}" for c in chunks], [nbytes] * len(keys), float(t))
            assert not set(res.evicted_keys) & set(pool.keys())
            assert all((o is REJECTED) != (k in pool) for k, o in zip(keys, res.outcomes))
        elif op == "read":
            pool.lookup([f"{c}/{s}" for c in chunks for s in (0, 1)], float(t))
        elif op in ("pin", "unpin"):
            getattr(pool, op)(f"g{chunks[0]}")
        else:
            pool.remove(f"{chunks[0]}/0")
        assert 0 <= pool.used_bytes <= pool.capacity_bytes
        assert pool.used_bytes == sum(pool.group(g).nbytes for g in {pool.group_of(k) for k in pool.keys()})
