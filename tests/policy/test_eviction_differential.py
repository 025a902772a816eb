"""The backend's pools and the simulator's pool decide grouped eviction alike.

Random call sequences go through ``EmbeddedPool`` (real bytes through a registered buffer, an
injected clock; it decides through ``policy.eviction.GroupedPool``) and through
``policy.grouptable.GroupTable`` (the simulator's pool), with object ``(g, s)`` named
``f"{g}/{s}"`` in group ``f"g{g}"`` and of ``slot_bytes[s]`` bytes. After every call both hold the
same keys and bytes, every put stored and rejected the same objects, every read answered the
same, and every eviction pass took the same groups (compared in order where the API shows them).
Pins exist in ``GroupedPool`` and ``GroupTable`` only (a pool's pins are its loads in flight), so
a second driver runs the same sequences with pins against ``GroupedPool`` directly.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.backend.pool import EmbeddedPool, Status
from kvpool.policy.eviction import ORDERS, GroupedPool, Put
from kvpool.policy.grouptable import GroupIds, GroupTable
from kvpool.policy.hits import leading_run

GROUPS = 24  # group ids 0..23: enough reuse for hits, re-puts and pinned victims
MAX_SLOTS = 4
MAX_OBJECT_BYTES = 40


def key(g: int, s: int) -> str:
    return f"{g}/{s}"


def pattern(g: int, s: int, nbytes: int) -> np.ndarray:
    """The bytes of object ``(g, s)``: distinct per object, so a get shows whose bytes came back."""
    return ((np.arange(nbytes) + 7 * g + 3 * s) % 251).astype(np.uint8)


# -- the call sequences --------------------------------------------------------------------

gids = st.lists(st.integers(0, GROUPS - 1), min_size=1, max_size=10)
slot_lists = st.lists(st.integers(0, MAX_SLOTS - 1), min_size=1, max_size=MAX_SLOTS, unique=True)
dt = st.sampled_from([0.0, 0.0, 0.0, 1.0, 2.5])  # most calls share a moment with the one before


def calls(pins: bool) -> st.SearchStrategy:
    kinds = ["put", "put", "put", "read", "read", "remove"] + (["pin", "unpin"] if pins else [])
    return st.lists(st.tuples(st.sampled_from(kinds), gids, slot_lists, dt, st.integers(0, 2)), min_size=1, max_size=60)


settings_st = st.tuples(
    st.sampled_from(ORDERS),
    st.lists(st.integers(1, MAX_OBJECT_BYTES), min_size=1, max_size=MAX_SLOTS),  # slot_bytes
    st.integers(1, 600),  # capacity_bytes
    st.sampled_from([(0.9, 0.05), (1.0, 0.05), (0.9, 0.01), (0.75, 0.2), (0.5, 0.3), (1.0, 1.0), (0.95, 0.5)]),
)


# -- the two worlds --------------------------------------------------------------------------

class TableWorld:
    """``GroupTable``, called the way the simulator calls it."""

    def __init__(self, order: str, slot_bytes: list[int], capacity: int, hw: float, ratio: float) -> None:
        self.t = GroupTable(capacity, slot_bytes, order, high_watermark=hw, evict_ratio=ratio, initial_groups=4)

    def keys(self) -> set[str]:
        return {key(g, s) for g, s in zip(*np.nonzero(self.t.present))}

    def put(self, gs: list[int], slots: list[int], now: float):
        if len(set(gs)) == len(gs):  # one prompt's groups: distinct and bounded (sim.prompt)
            return self.t.put(GroupIds(np.asarray(gs, dtype=np.int64), max(gs)), slots, now)
        return self.t.put(gs, slots, now)

    def read(self, gs: list[int], slots: list[int], now: float, variant: int) -> list[list[bool]]:
        """Presence ``[slot][group]``, through one of the table's three read calls."""
        if variant == 0 and len(slots) == 1:
            return [self.t.lookup(gs, slots[0], now).tolist()]
        if variant == 1:
            return self.t.lookup_slots(gs, slots, now).tolist()
        runs = self.t.lookup_runs(gs, slots, now)  # only leading runs: the rest is read back untouched
        rows = [[self.t.contains(g, s) for g in gs] for s in slots]
        assert runs == [leading_run(np.asarray(r, dtype=bool)) for r in rows]
        return rows


def items(gs: list[int], slots: list[int], slot_bytes: list[int]) -> list[tuple[str, str, int, int, int]]:
    """(key, group, size, g, s) of the objects ``gs x slots``, group by group."""
    return [(key(g, s), f"g{g}", slot_bytes[s], g, s) for g in gs for s in slots]


class PoolWorld:
    """``EmbeddedPool``: real bytes from a registered buffer, the clock injected."""

    def __init__(self, order: str, slot_bytes: list[int], capacity: int, hw: float, ratio: float) -> None:
        self.now = 0.0
        self.slot_bytes = slot_bytes
        self.pool = EmbeddedPool(capacity, order, high_watermark=hw, evict_ratio=ratio, clock=lambda: self.now)
        n = 10 * MAX_SLOTS * MAX_OBJECT_BYTES
        self.src, self.dst = np.zeros(n, np.uint8), np.zeros(n, np.uint8)
        self.rs, self.rd = self.pool.register_buffer(self.src), self.pool.register_buffer(self.dst)

    def keys(self) -> set[str]:
        return set(self.pool.keys())

    def used_bytes(self) -> int:
        return self.pool.stats().used_bytes

    def put(self, gs: list[int], slots: list[int]) -> list[bool]:
        """The put; per object, whether it is held now (stored or present)."""
        objs = items(gs, slots, self.slot_bytes)
        offsets = [i * MAX_OBJECT_BYTES for i in range(len(objs))]
        for (_, _, n, g, s), off in zip(objs, offsets):
            self.src[off : off + n] = pattern(g, s, n)
        got = self.pool.put([o[0] for o in objs], [o[1] for o in objs], self.rs, offsets, [o[2] for o in objs])
        assert set(got) <= {Status.OK, Status.FULL}
        return [s is Status.OK for s in got]

    def read(self, gs: list[int], slots: list[int], variant: int) -> list[list[bool]]:
        """Presence ``[slot][group]`` through ``exists`` (variant 0) or ``get`` (checking the bytes)."""
        objs = [(key(g, s), self.slot_bytes[s], g, s) for s in slots for g in gs]
        if variant == 0:
            flat = self.pool.exists([o[0] for o in objs])
        else:
            offsets = [i * MAX_OBJECT_BYTES for i in range(len(objs))]
            got = self.pool.get([o[0] for o in objs], self.rd, offsets, [o[1] for o in objs])
            assert set(got) <= {Status.OK, Status.MISSING}
            flat = [s is Status.OK for s in got]
            for (_, n, g, s), off, ok in zip(objs, offsets, flat):
                if ok:
                    assert np.array_equal(self.dst[off : off + n], pattern(g, s, n))
        return [flat[i * len(gs) : (i + 1) * len(gs)] for i in range(len(slots))]

    def remove(self, gs: list[int], slot: int) -> list[bool]:
        return [s is Status.OK for s in self.pool.remove([key(g, slot) for g in gs])]


def held(table: TableWorld, gs: list[int], slots: list[int]) -> set[tuple[int, int]]:
    return {(g, s) for g in gs for s in slots if table.t.contains(g, s)}


def check_put(table: TableWorld, gs, slots, slot_bytes, held_before, held_after: list[bool], out) -> None:
    """The pool's per-object outcome against the table's: same objects held after, same counts."""
    objs = items(gs, slots, slot_bytes)
    assert held_after == [table.t.contains(g, s) for _, _, _, g, s in objs]
    new = {(g, s) for _, _, _, g, s in objs} - held_before
    stored = sum(table.t.contains(g, s) for g, s in new)
    assert (out.stored, out.rejected) == (stored, len(new) - stored)


# -- the tests -------------------------------------------------------------------------------

@settings(max_examples=2500, deadline=None, derandomize=True)
@given(setup=settings_st, ops=calls(pins=False))
def test_embedded_pool_and_group_table_decide_alike(setup, ops):
    order, slot_bytes, capacity, (hw, ratio) = setup
    table, pool = TableWorld(order, slot_bytes, capacity, hw, ratio), PoolWorld(order, slot_bytes, capacity, hw, ratio)
    slots_of = lambda ss: [s % len(slot_bytes) for s in ss]  # noqa: E731
    for op, gs, ss, step, variant in ops:
        pool.now += step
        ss = sorted(set(slots_of(ss)))
        if op == "put":
            was = held(table, gs, ss)
            out = table.put(gs, ss, pool.now)
            check_put(table, gs, ss, slot_bytes, was, pool.put(gs, ss), out)
        elif op == "read":
            assert pool.read(gs, ss, variant % 2) == table.read(gs, ss, pool.now, variant)
        else:
            assert pool.remove(gs, ss[0]) == table.t.remove(gs, ss[0]).tolist()
        assert pool.keys() == table.keys()
        stats = pool.pool.stats()
        assert (stats.used_bytes, stats.evicted_bytes, stats.eviction_passes) == (
            table.t.used_bytes, table.t.evicted_bytes, table.t.evict_passes)


@settings(max_examples=1500, deadline=None, derandomize=True)
@given(setup=settings_st, ops=calls(pins=True))
def test_grouped_pool_and_group_table_decide_alike_with_pins(setup, ops):
    """The same, with pins, against ``GroupedPool`` itself: evicted groups compared in order."""
    order, slot_bytes, capacity, (hw, ratio) = setup
    table = TableWorld(order, slot_bytes, capacity, hw, ratio)
    book = GroupedPool(capacity, order, high_watermark=hw, evict_ratio=ratio)
    now = 0.0
    for op, gs, ss, step, variant in ops:
        now += step
        ss = sorted({s % len(slot_bytes) for s in ss})
        if op == "put":
            was = held(table, gs, ss)
            out = table.put(gs, ss, now)
            objs = items(gs, ss, slot_bytes)
            res = book.put([o[0] for o in objs], [o[1] for o in objs], [o[2] for o in objs], now)
            check_put(table, gs, ss, slot_bytes, was, [o is not Put.REJECTED for o in res.outcomes], out)
            assert res.evicted_groups == tuple(f"g{g}" for g in out.evicted_ids.tolist())
            assert res.evicted_bytes == out.evicted_bytes
        elif op == "read":
            found = book.lookup([key(g, s) for s in ss for g in gs], now)
            assert [found[i * len(gs) : (i + 1) * len(gs)] for i in range(len(ss))] == table.read(gs, ss, now, variant)
        elif op == "remove":
            assert [book.remove(key(g, ss[0])) for g in gs] == table.t.remove(gs, ss[0]).tolist()
        else:  # pin / unpin: the first groups named, repeats included
            pinned = gs[: variant + 1]
            for g in pinned:
                getattr(book, op)(f"g{g}")
            getattr(table.t, op)(pinned)
        assert set(book.keys()) == table.keys()
        assert (book.used_bytes, book.evicted_groups, book.evict_passes) == (
            table.t.used_bytes, table.t.evicted_groups, table.t.evict_passes)


# -- the named case: a prefix in one put, then one more chunk --------------------------------------

@pytest.mark.parametrize("world", ["embedded", "table"])
def test_lru_keeps_the_head_of_a_prefix_written_at_one_moment(world):
    """10 objects of room, LRU, watermark 0.9: a 10-chunk prefix written at one moment, then one
    more chunk. The prefix loses its tail (chunks 9 and 8: the pass frees 15 % of capacity), so
    its first 8 chunks are still a hit."""
    if world == "table":
        t = GroupTable(100, [10], "lru", high_watermark=0.9, evict_ratio=0.05)
        t.put(list(range(10)), 0, 0.0)
        t.put([10], 0, 1.0)
        held = set(np.flatnonzero(t.present[:, 0]).tolist())
    else:
        clock = [0.0]
        pool = EmbeddedPool(100, "lru", high_watermark=0.9, evict_ratio=0.05, clock=lambda: clock[0])
        ref = pool.register_buffer(np.zeros(100, np.uint8))
        assert pool.put([f"c{c}" for c in range(10)], [f"g{c}" for c in range(10)], ref,
                        [10 * c for c in range(10)], [10] * 10) == [Status.OK] * 10
        clock[0] = 1.0
        assert pool.put(["c10"], ["g10"], ref, [0], [10]) == [Status.OK]
        held = {int(k[1:]) for k in pool.keys()}
    assert held == {0, 1, 2, 3, 4, 5, 6, 7, 10}
