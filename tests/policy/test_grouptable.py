"""policy.grouptable: the integer-id grouped pool (the simulator's); its fast paths decide as its
general ones. That it decides as ``policy.eviction`` says: ``test_eviction_differential.py``."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.policy.grouptable import ORDERS, GroupIds, GroupTable


@pytest.mark.parametrize("order", ORDERS)
def test_group_evicted_whole_and_capacity_respected(order):
    t = GroupTable(400, [10, 10, 10, 10], order)
    for g in range(12):
        for s in range(4):
            t.put([g], s, float(g))
    assert t.evicted_groups > 0 and t.used_bytes <= 400
    rows = t.present[:12]
    assert all(r.all() or not r.any() for r in rows)


@pytest.mark.parametrize("order", ORDERS)
def test_pinned_groups_are_never_victims(order):
    t = GroupTable(100, [50], order, high_watermark=1.0)
    t.put([0, 1], 0, 0.0)
    t.pin([0, 1])
    out = t.put([2], 0, 1.0)
    assert (out.stored, out.rejected, out.evicted_groups) == (0, 1, 0) and t.present[:2, 0].all()
    t.unpin([1])
    out = t.put([2], 0, 2.0)
    assert out.stored == 1 and out.evicted_groups == 1 and t.contains(0, 0) and not t.contains(1, 0)


def test_first_writer_wins_and_duplicates_in_a_batch():
    t = GroupTable(1000, [10, 20])
    assert t.put([5, 5, 6], 1, 0.0).stored == 2
    assert t.put([5], 1, 1.0).stored == 0 and t.used_bytes == 40


def test_lru_loses_the_tail_of_a_prefix_first():
    t = GroupTable(100, [10], "lru", high_watermark=1.0, evict_ratio=0.01)
    t.put(list(range(10)), 0, 0.0)  # one prefix written at once
    t.put([10], 0, 1.0)
    assert not t.contains(9, 0) and t.contains(0, 0)


def test_lookup_refreshes_recency():
    t = GroupTable(30, [10], "lru", high_watermark=1.0, evict_ratio=0.01)
    for g in range(3):
        t.put([g], 0, float(g))
    assert t.lookup([0, 7], 0, 5.0).tolist() == [True, False]
    t.put([3], 0, 6.0)
    assert t.contains(0, 0) and not t.contains(1, 0)


def test_watermark_pass_frees_ratio():
    t = GroupTable(1000, [10], "lru", high_watermark=0.9, evict_ratio=0.05)
    t.put(list(range(90)), 0, 0.0)
    assert t.evict_passes == 0
    t.put([90], 0, 1.0)  # 910 B > 900 B: one pass frees >= 5 % of 1000 B, never the group just written
    assert t.used_bytes <= 910 - 50 and t.evict_passes == 1 and t.contains(90, 0)


def test_groups_being_written_are_not_victims_of_their_own_pass():
    t = GroupTable(1000, [10], "lru", high_watermark=0.9, evict_ratio=0.05)
    t.put(list(range(95)), 0, 0.0)
    assert t.used_bytes == 950 and t.evicted_groups == 0


def test_remove_deletes_single_objects_and_keeps_the_group_state():
    t = GroupTable(1000, [10, 20], "lfu")
    t.put([1, 2], [0, 1], 0.0)
    t.lookup([1], 0, 1.0)
    assert t.remove([1, 1, 3], 0).tolist() == [True, False, False]  # a repeat removes once
    assert t.used_bytes == 50 and not t.contains(1, 0) and t.contains(1, 1)
    assert (t._count[1], t._last[1], t._inserted[1]) == (1, 1.0, 1)
    assert t.remove([1], 1).tolist() == [True] and t.used_bytes == 30 and t.objects == 2
    t.put([1], 0, 2.0)  # holding nothing, the group is inserted anew
    assert (t._count[1], t._inserted[1]) == (0, 3) and t.evicted_groups == 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="allowed"):
        GroupTable(10, [1], "arc")
    with pytest.raises(ValueError):
        GroupTable(10, [])
    with pytest.raises(ValueError):
        GroupTable(10, [1]).lookup([-1], 0, 0.0)


def test_put_reports_the_evicted_groups():
    t = GroupTable(30, [10], "lru", high_watermark=1.0, evict_ratio=0.01)
    t.put([0, 1, 2], 0, 0.0)
    out = t.put([3], 0, 1.0)
    assert out.evicted_ids.tolist() == [2] and out.evicted_bytes == 10 and out.evicted_groups == 1


def test_multi_slot_put_and_lookup_equal_single_slot_calls():
    a = GroupTable(10_000, [10, 20, 30, 40])
    b = GroupTable(10_000, [10, 20, 30, 40])
    a.put([1, 2, 3], [0, 1, 2, 3], 0.0)
    for s in range(4):
        b.put([1, 2, 3], s, 0.0)
    assert (a.present == b.present).all() and a.used_bytes == b.used_bytes == 3 * 100
    a.put([3, 4], [1, 2], 1.0)
    assert a.used_bytes == 300 + 50 and a.contains(4, 1) and not a.contains(4, 0)
    hit = a.lookup_slots([1, 4, 9], [0, 1], 2.0)
    assert hit.tolist() == [[True, False, False], [True, True, False]]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 2)), max_size=200))
def test_reinserted_groups_are_never_double_counted(ops):
    t = GroupTable(200, [10, 10, 10], "lru", high_watermark=0.9, evict_ratio=0.05)
    for i, (g, s) in enumerate(ops):
        t.put([g], s, float(i))
        assert t.used_bytes == int((t.present @ t.slot_bytes).sum()) <= 200


class _GeneralPut(GroupTable):
    """The table without its shortcut for puts of groups that hold nothing yet."""

    def _all_new(self, ids):
        return False


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "read", "pin", "unpin"]),
                          st.lists(st.integers(0, 40), min_size=1, max_size=12, unique=True),
                          st.sampled_from([[0], [1], [0, 1, 2], [0, 1, 2, 3]])), max_size=60),
       st.sampled_from(ORDERS), st.sampled_from([(0.9, 0.05), (1.0, 0.01), (0.5, 0.3)]))
def test_new_group_puts_equal_the_general_path(ops, order, marks):
    """Batched puts of new groups (the simulator's saves) decide exactly as the general path:
    same outcomes, contents, recency, insertion order and evictions. The fast table is told what
    is known of the ids (distinct, a bound) as keywords or as ``GroupIds``, turn about; the
    reference checks them."""
    hw, ratio = marks
    fast, ref = (cls(900, [10, 20, 30, 40], order, high_watermark=hw, evict_ratio=ratio) for cls in (GroupTable, _GeneralPut))
    for i, (op, gids, slots) in enumerate(ops):
        now = float(i)
        known = {"unique": True, "max_gid": 40} if i % 2 else {}  # a known bound: same decisions
        told = gids if i % 2 else GroupIds(np.asarray(gids, dtype=np.int64), 40)
        if op == "put":
            assert fast.put(told, slots, now, **known) == ref.put(gids, slots, now)
        elif op == "read":
            assert (fast.lookup_slots(told, slots, now) == ref.lookup_slots(gids, slots, now)).all()
        elif op == "pin":
            fast.pin(told, **known)
            ref.pin(gids)
        else:
            fast.unpin(told, **known)
            ref.unpin(gids)
        for name in ("_mask", "_last", "_count", "_inserted", "_pins", "_listed"):
            assert np.array_equal(getattr(fast, name), getattr(ref, name)), name
        assert (fast.used_bytes, fast.evicted_groups, fast._seq) == (ref.used_bytes, ref.evicted_groups, ref._seq)
        assert np.array_equal(fast._resident.view(), ref._resident.view())


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 30), min_size=1, max_size=8, unique=True),
                          st.sampled_from([[0], [1], [2, 3], [0, 1, 2, 3]])), max_size=30),
       st.lists(st.integers(0, 30), min_size=1, max_size=20), st.sampled_from([[0], [3, 1], [0, 1, 2, 3]]))
def test_lookup_runs_are_the_leading_runs_of_lookup_slots(puts, query, slots):
    """Per slot, the leading run of the rows ``lookup_slots`` returns; recency and read counts
    change the same way."""
    from kvpool.policy.hits import leading_run

    a, b = GroupTable(10_000, [10, 20, 30, 40]), GroupTable(10_000, [10, 20, 30, 40])
    for i, (gids, s) in enumerate(puts):
        a.put(gids, s, float(i))
        b.put(gids, s, float(i))
    rows = a.lookup_slots(query, slots, 99.0)
    assert b.lookup_runs(query, slots, 99.0, max_gid=30) == [leading_run(r) for r in rows]
    assert np.array_equal(a._last, b._last) and np.array_equal(a._count, b._count)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "put", "read", "pin", "unpin"]),
                          st.lists(st.integers(0, 300), min_size=1, max_size=40, unique=True),
                          st.sampled_from([[0], [1], [0, 1, 2], [0, 1, 2, 3]]),
                          st.integers(0, 3)), max_size=60),
       st.sampled_from(ORDERS), st.sampled_from([(0.9, 0.05), (0.8, 0.01), (0.5, 0.3)]))
def test_partial_sort_evicts_what_a_full_sort_does(ops, order, marks):
    """An eviction pass sorts only the groups that can lead the order: the same victims, in the
    same passes, as sorting every candidate (ties in recency and reads included: times repeat)."""
    hw, ratio = marks
    fast = GroupTable(4000, [10, 20, 30, 40], order, high_watermark=hw, evict_ratio=ratio)
    full = GroupTable(4000, [10, 20, 30, 40], order, high_watermark=hw, evict_ratio=ratio)
    full._partial_sort = False
    for i, (op, gids, slots, tick) in enumerate(ops):
        now = float(i // (tick + 1))  # several operations at one moment: ties in recency
        if op == "put":
            a, b = fast.put(gids, slots, now, unique=True), full.put(gids, slots, now, unique=True)
            assert a == b and np.array_equal(a.evicted_ids, b.evicted_ids)
        elif op == "read":
            assert (fast.lookup_slots(gids, slots, now) == full.lookup_slots(gids, slots, now)).all()
        elif op == "pin":
            fast.pin(gids, unique=True)
            full.pin(gids, unique=True)
        else:
            fast.unpin(gids, unique=True)
            full.unpin(gids, unique=True)
        for name in ("_mask", "_last", "_count", "_inserted", "_pins"):
            assert np.array_equal(getattr(fast, name), getattr(full, name)), name
        assert (fast.used_bytes, fast.evicted_groups, fast.evict_passes) == (full.used_bytes, full.evicted_groups, full.evict_passes)
