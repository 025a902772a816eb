"""Grouped eviction: which objects a pool keeps, which it evicts, and which puts it rejects.

This docstring is the contract of grouped eviction. Two implementations follow it and are
checked against each other by ``tests/policy/test_eviction_differential.py``:
``GroupedPool`` below (string keys and groups, objects of any size: the backend's embedded pool;
readable reference code) and ``policy.grouptable.GroupTable`` (integer groups x slots in numpy:
the simulator's pool).

Objects and groups
    * Every object belongs to one group (a chunk's group; its objects are the chunk's per-stage
      copies). A group exists while it holds at least one object and is evicted whole.
    * A group is *inserted* when it gets an object while holding none; every insertion takes the
      next number of one sequence (its insertion number), in the order the put names the groups.
    * A put of an object already present stores nothing: its bytes, size and group stay the first
      writer's (keys are content-addressed). It still counts as a write of that group (below).
    * ``remove`` deletes one object; its group keeps its last use, read count and insertion number
      while it holds other objects. Removing a group's last object ends the group; a later put
      inserts it anew. Removing is not evicting (no eviction counter moves).

Use
    * Time is passed in (``now``, seconds); nothing here reads a clock, and many calls may share
      one moment.
    * A group's *last use* is the latest ``now`` at which it was read or written. Read: a read
      call (lookup, exists, get) found at least one of its objects. Written: a put named it, with
      new objects or present ones, stored or rejected.
    * A group's *reads* start at 0 at insertion and grow by one per read call that finds it,
      however many of its objects the call names. Puts never count as reads.

Orders (first victim first)
    * ``lru``: oldest last use first; among equal last use, the most recently inserted first. A
      prefix written (or read) in one moment therefore loses its tail before its head, and what
      survives of it is still a hit.
    * ``lfu``: fewest reads first; ties as ``lru`` (oldest last use, then newest insertion).
    * ``fifo``: oldest insertion first; reads and re-puts change nothing.

Pins
    * ``pin``/``unpin`` count per group (nesting; never below zero), whether or not the group holds
      objects now. A pinned group is never a victim.

Eviction passes
    * A pass frees at least ``target = max(need, ceil(capacity x max(evict_ratio, used_ratio -
      high_watermark + evict_ratio)))`` bytes, ``used_ratio = used / capacity`` (1 for a pool of no
      capacity) when the pass starts, ``need`` the bytes its caller must have. It walks the order
      over the groups holding objects, skipping pinned groups and the groups of the put in
      progress, and takes victims (at least one) until it has freed ``target`` or run out of
      candidates (best effort: it evicts what it can even if that is not enough). A pass that
      finds no candidate changes nothing and is not counted.

A put (one call: one moment, any number of objects and groups)
    1. The put's groups are its objects' groups (a present object's own group, whatever group the
       call names for it). Each gets last use ``now`` (a group holding nothing has none to keep)
       and is protected from both of this call's passes.
    2. Its new objects are the keys not present (a key named twice counts once, as first named).
       If they do not fit (``used + new bytes > capacity``), one pass runs with ``need = used + new
       bytes - capacity``.
    3. The groups, in the order the put first names them, are stored whole while their new objects
       still fit in ``capacity - used``; from the first group that does not fit on, every group's
       new objects are rejected (even a later, smaller one's).
    4. If usage is now above ``high_watermark x capacity``, one pass runs with ``need = 0``.
    Each object's outcome is ``PRESENT`` (held before the call), ``STORED`` or ``REJECTED``.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

ORDERS = ("lru", "lfu", "fifo")


@dataclass(slots=True)
class GroupState:
    """What the eviction order knows of a group."""

    inserted: int  # insertion number
    last_use_s: float
    reads: int = 0
    nbytes: int = 0
    objects: dict[str, int] = field(default_factory=dict)  # key -> size in bytes, in put order


OrderKey = Callable[[GroupState], tuple]
"""Sort key of the eviction order over groups: the smallest key is the first victim."""


def _lru(g: GroupState) -> tuple:
    return (g.last_use_s, -g.inserted)


def _lfu(g: GroupState) -> tuple:
    return (g.reads, g.last_use_s, -g.inserted)


def _fifo(g: GroupState) -> tuple:
    return (g.inserted,)


EVICTION_ORDERS: dict[str, OrderKey] = {"lru": _lru, "lfu": _lfu, "fifo": _fifo}


def order_key(name: str) -> OrderKey:
    """The sort key of a registered order; unknown names list the allowed ones."""
    try:
        return EVICTION_ORDERS[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; allowed: {sorted(EVICTION_ORDERS)}") from None


class Put(enum.Enum):
    """The outcome of one object of a put."""

    PRESENT = "present"  # held before the call (first writer wins)
    STORED = "stored"
    REJECTED = "rejected"


@dataclass(frozen=True, slots=True)
class PutResult:
    """What a put did: each object's outcome (in the call's order) and what was evicted."""

    outcomes: tuple[Put, ...]
    evicted_groups: tuple[str, ...] = ()  # in eviction order
    evicted_keys: tuple[str, ...] = ()
    evicted_bytes: int = 0


class GroupedPool:
    """Capacity and membership bookkeeping of one pool (one Mooncake master's objects). See the
    module docstring for the contract.

    Args:
        capacity_bytes: usable bytes (>= 0).
        order: eviction order, a name of ``EVICTION_ORDERS``.
        high_watermark: usage fraction above which a put ends with a pass (0 < hw <= 1).
        evict_ratio: fraction of capacity a pass frees at least (0 < ratio <= 1).
    """

    def __init__(
        self,
        capacity_bytes: int,
        order: str = "lru",
        *,
        high_watermark: float = 0.90,
        evict_ratio: float = 0.05,
    ) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        if not 0.0 < high_watermark <= 1.0:
            raise ValueError(f"high_watermark must be in (0, 1], got {high_watermark}")
        if not 0.0 < evict_ratio <= 1.0:
            raise ValueError(f"evict_ratio must be in (0, 1], got {evict_ratio}")
        self.capacity_bytes = capacity_bytes
        self.order = order
        self._key = order_key(order)
        self.high_watermark = high_watermark
        self.evict_ratio = evict_ratio
        self.used_bytes = 0
        self.evicted_groups = 0
        self.evicted_objects = 0
        self.evicted_bytes = 0
        self.evict_passes = 0
        self._inserted = 0  # the last insertion number given
        self._groups: dict[str, GroupState] = {}
        self._group_of: dict[str, str] = {}  # key -> its group
        self._pins: dict[str, int] = {}

    # -- queries (no effect on the order) ---------------------------------------------------
    def __contains__(self, key: str) -> bool:
        return key in self._group_of

    def __len__(self) -> int:
        return len(self._group_of)

    def keys(self) -> list[str]:
        return list(self._group_of)

    def group_of(self, key: str) -> str | None:
        return self._group_of.get(key)

    def group(self, name: str) -> GroupState | None:
        """A group's state (for inspection; do not modify), or ``None`` if it holds nothing."""
        return self._groups.get(name)

    @property
    def groups(self) -> int:
        return len(self._groups)

    # -- reads ------------------------------------------------------------------------------
    def lookup(self, keys: Sequence[str], now: float) -> list[bool]:
        """Presence of each key; one read call: each group found counts one read and is used now."""
        found = [k in self._group_of for k in keys]
        read: dict[str, None] = {}
        for k, hit in zip(keys, found):
            if hit:
                read[self._group_of[k]] = None
        for name in read:
            g = self._groups[name]
            g.last_use_s = now
            g.reads += 1
        return found

    # -- pins -------------------------------------------------------------------------------
    def pin(self, group: str) -> None:
        """Protect ``group`` from eviction until a matching ``unpin`` (nests)."""
        self._pins[group] = self._pins.get(group, 0) + 1

    def unpin(self, group: str) -> None:
        left = self._pins.get(group, 0) - 1
        if left > 0:
            self._pins[group] = left
        else:
            self._pins.pop(group, None)

    # -- writes -----------------------------------------------------------------------------
    def put(self, keys: Sequence[str], groups: Sequence[str], sizes_bytes: Sequence[int], now: float) -> PutResult:
        """Store ``keys[i]`` (``sizes_bytes[i]`` bytes, > 0) in group ``groups[i]``: one put."""
        if not len(keys) == len(groups) == len(sizes_bytes):
            raise ValueError(f"keys, groups and sizes differ in length: {len(keys)}, {len(groups)}, {len(sizes_bytes)}")
        named: dict[str, None] = {}  # the put's groups, in the order it first names them
        new: dict[str, dict[str, int]] = {}  # group -> its new objects (key -> size)
        new_group: dict[str, str] = {}  # new key -> its group (the first naming of the key)
        for key, group, nbytes in zip(keys, groups, sizes_bytes):
            if nbytes <= 0:
                raise ValueError(f"object sizes must be > 0 bytes, got {nbytes} for {key!r}")
            held = self._group_of.get(key)
            if held is not None:  # present: it stays in the group it was first written to
                named[held] = None
                continue
            group = new_group.setdefault(key, group)  # a key named twice: its first naming
            named[group] = None
            new.setdefault(group, {}).setdefault(key, nbytes)
        protect = named.keys()
        for name in named:
            if name in self._groups:
                self._groups[name].last_use_s = now

        evicted: list[str] = []
        evicted_keys: list[str] = []
        freed = 0
        need = self.used_bytes + sum(sum(objs.values()) for objs in new.values()) - self.capacity_bytes
        if need > 0:
            freed += self._evict(need, protect, evicted, evicted_keys)
        room = self.capacity_bytes - self.used_bytes
        stored: set[str] = set()
        for name in named:
            objs = new.get(name)
            if not objs:
                continue
            nbytes = sum(objs.values())
            if nbytes > room:
                break
            room -= nbytes
            self._store(name, objs, now)
            stored.add(name)
        if self.used_bytes > self.high_watermark * self.capacity_bytes:
            freed += self._evict(0, protect, evicted, evicted_keys)

        outcomes = tuple(
            Put.STORED if new_group.get(key) in stored else Put.REJECTED if key in new_group else Put.PRESENT
            for key in keys
        )
        return PutResult(outcomes, tuple(evicted), tuple(evicted_keys), freed)

    def remove(self, key: str) -> bool:
        """Delete one object; ``False`` if it is not held."""
        name = self._group_of.pop(key, None)
        if name is None:
            return False
        g = self._groups[name]
        nbytes = g.objects.pop(key)
        g.nbytes -= nbytes
        self.used_bytes -= nbytes
        if not g.objects:
            del self._groups[name]
        return True

    # -- internals --------------------------------------------------------------------------
    def _store(self, name: str, objects: dict[str, int], now: float) -> None:
        g = self._groups.get(name)
        if g is None:
            self._inserted += 1
            g = self._groups[name] = GroupState(inserted=self._inserted, last_use_s=now)
        for key, nbytes in objects.items():
            g.objects[key] = nbytes
            g.nbytes += nbytes
            self._group_of[key] = name
            self.used_bytes += nbytes

    def _evict(self, need_bytes: int, protect: Iterable[str], evicted: list[str], evicted_keys: list[str]) -> int:
        """One pass (see the module docstring); appends its victims and their keys, returns bytes freed."""
        cap = self.capacity_bytes
        used_ratio = self.used_bytes / cap if cap else 1.0
        ratio = max(self.evict_ratio, used_ratio - self.high_watermark + self.evict_ratio)
        target = max(need_bytes, math.ceil(cap * ratio))
        skip = set(protect)
        candidates = [n for n in self._groups if n not in skip and not self._pins.get(n)]
        if not candidates:
            return 0
        candidates.sort(key=lambda n: self._key(self._groups[n]))
        freed = victims = 0
        for name in candidates:  # at least one victim, then until the target is freed
            g = self._groups.pop(name)
            for key in g.objects:
                del self._group_of[key]
            evicted.append(name)
            evicted_keys.extend(g.objects)
            freed += g.nbytes
            victims += 1
            self.evicted_objects += len(g.objects)
            if freed >= target:
                break
        self.used_bytes -= freed
        self.evicted_groups += victims
        self.evicted_bytes += freed
        self.evict_passes += 1
        return freed
