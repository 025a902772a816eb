"""Grouped eviction: a pool's bookkeeping of objects, groups, capacity and what to evict.

Contract:
    * Objects (one per chunk x stage) belong to groups (one per chunk). A group is evicted whole:
      after any operation either all of a group's objects are present or none of them is counted
      as evicted by the pool (a stage object that never arrived is simply absent).
    * Eviction starts when usage exceeds ``high_watermark`` x capacity (seed and Mooncake: 0.90),
      or when a put does not fit. A pass frees
      ``capacity x max(evict_ratio, used_ratio - high_watermark + evict_ratio)`` bytes (ratio 0.05),
      Mooncake's rule expressed in bytes, and at least what the pending put needs.
    * Victims come from a pluggable ``EvictionPolicy`` (LRU, LFU, FIFO registered); reads
      (``touch``/``exists``) refresh recency; pinned groups (loads in flight) are never evicted.
    * An eviction either frees what it reports or changes nothing: victims are chosen first and
      committed only if they cover what the caller must have.
    * A put of a key already present changes nothing (first writer wins, as Mooncake; keys are
      content-addressed). A put that cannot fit even after eviction is rejected, changing nothing.
    * Time is passed in (``now``, seconds); nothing here reads a clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol


class EvictionPolicy(Protocol):
    """Orders groups for eviction. Called by ``GroupedPool``; never frees anything itself."""

    name: str

    def on_insert(self, group: str, now: float) -> None:
        """A new group appeared."""

    def on_access(self, group: str, now: float) -> None:
        """A group was read or written again."""

    def on_remove(self, group: str) -> None:
        """A group left the pool."""

    def order(self) -> Iterator[str]:
        """Groups, first to evict first."""


class LRUPolicy:
    """Least recently used group first."""

    name = "lru"

    def __init__(self) -> None:
        self._od: OrderedDict[str, None] = OrderedDict()

    def on_insert(self, group: str, now: float) -> None:
        self._od[group] = None
        self._od.move_to_end(group)

    def on_access(self, group: str, now: float) -> None:
        if group in self._od:
            self._od.move_to_end(group)

    def on_remove(self, group: str) -> None:
        self._od.pop(group, None)

    def order(self) -> Iterator[str]:
        return iter(list(self._od))


class FIFOPolicy(LRUPolicy):
    """Oldest inserted group first; reads do not refresh."""

    name = "fifo"

    def on_access(self, group: str, now: float) -> None:
        return None


class LFUPolicy:
    """Least frequently used group first; ties broken by least recent access."""

    name = "lfu"

    def __init__(self) -> None:
        self._count: dict[str, int] = {}
        self._seq: dict[str, int] = {}
        self._tick = 0

    def _bump(self, group: str) -> None:
        self._tick += 1
        self._seq[group] = self._tick

    def on_insert(self, group: str, now: float) -> None:
        self._count[group] = 1
        self._bump(group)

    def on_access(self, group: str, now: float) -> None:
        if group in self._count:
            self._count[group] += 1
            self._bump(group)

    def on_remove(self, group: str) -> None:
        self._count.pop(group, None)
        self._seq.pop(group, None)

    def order(self) -> Iterator[str]:
        return iter(sorted(self._count, key=lambda g: (self._count[g], self._seq[g])))


EVICTION_POLICIES: dict[str, type] = {"lru": LRUPolicy, "lfu": LFUPolicy, "fifo": FIFOPolicy}


def make_policy(name: str) -> EvictionPolicy:
    """A fresh policy by registry name; unknown names list the allowed ones."""
    try:
        return EVICTION_POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; allowed: {sorted(EVICTION_POLICIES)}") from None


@dataclass
class _Group:
    keys: set[str] = field(default_factory=set)
    nbytes: int = 0
    pins: int = 0


@dataclass(frozen=True)
class PutResult:
    """Outcome of a put: whether the object is now stored, and the groups evicted to make room."""

    stored: bool
    evicted: tuple[str, ...] = ()
    already_present: bool = False


class GroupedPool:
    """Capacity and membership bookkeeping of one pool part (one Mooncake master's objects).

    Args:
        capacity_bytes: usable bytes of the pool part.
        policy: eviction order (an ``EvictionPolicy`` or a registry name).
        high_watermark: usage fraction above which a pass runs (0 < hw <= 1).
        evict_ratio: fraction of capacity a pass frees at least (0 < ratio <= 1).
    """

    def __init__(
        self,
        capacity_bytes: int,
        policy: EvictionPolicy | str = "lru",
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
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.high_watermark = high_watermark
        self.evict_ratio = evict_ratio
        self.used_bytes = 0
        self.evicted_groups = 0
        self.evicted_bytes = 0
        self._objects: dict[str, tuple[str, int]] = {}
        self._groups: dict[str, _Group] = {}

    # -- queries ---------------------------------------------------------------------------
    def __contains__(self, key: str) -> bool:
        return key in self._objects

    def __len__(self) -> int:
        return len(self._objects)

    @property
    def groups(self) -> int:
        return len(self._groups)

    def group_of(self, key: str) -> str | None:
        obj = self._objects.get(key)
        return obj[0] if obj else None

    def exists(self, keys: Iterable[str], now: float) -> list[bool]:
        """Presence of each key; present keys' groups count as read (as Mooncake's leases)."""
        out = []
        for k in keys:
            obj = self._objects.get(k)
            out.append(obj is not None)
            if obj is not None:
                self.policy.on_access(obj[0], now)
        return out

    def touch(self, keys: Iterable[str], now: float) -> None:
        """Mark the groups of ``keys`` as read now."""
        self.exists(keys, now)

    # -- pins ------------------------------------------------------------------------------
    def pin(self, group: str) -> None:
        """Protect ``group`` from eviction until a matching ``unpin`` (nests)."""
        if group in self._groups:
            self._groups[group].pins += 1

    def unpin(self, group: str) -> None:
        g = self._groups.get(group)
        if g is not None and g.pins > 0:
            g.pins -= 1

    # -- mutations -------------------------------------------------------------------------
    def put(self, key: str, group: str, nbytes: int, now: float) -> PutResult:
        """Store one object in ``group``; evicts first if it would not fit."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if key in self._objects:
            self.policy.on_access(self._objects[key][0], now)
            return PutResult(stored=True, already_present=True)
        if nbytes > self.capacity_bytes:
            return PutResult(stored=False)
        evicted: tuple[str, ...] = ()
        need = self.used_bytes + nbytes - self.capacity_bytes
        if need > 0:
            evicted = self._evict(need, protect=group)
            if not evicted:
                return PutResult(stored=False)
        self._insert(key, group, nbytes, now)
        if self.used_bytes > self.high_watermark * self.capacity_bytes:
            evicted += self._evict(0, protect=group)
        return PutResult(stored=True, evicted=evicted)

    def remove(self, key: str) -> bool:
        """Remove one object (its group stays while it has other objects)."""
        obj = self._objects.pop(key, None)
        if obj is None:
            return False
        group, nbytes = obj
        g = self._groups[group]
        g.keys.discard(key)
        g.nbytes -= nbytes
        self.used_bytes -= nbytes
        if not g.keys:
            del self._groups[group]
            self.policy.on_remove(group)
        return True

    def remove_group(self, group: str) -> int:
        """Remove a whole group; returns the bytes freed."""
        g = self._groups.pop(group, None)
        if g is None:
            return 0
        for k in g.keys:
            del self._objects[k]
        self.used_bytes -= g.nbytes
        self.policy.on_remove(group)
        return g.nbytes

    def evict_pass(self, now: float) -> tuple[str, ...]:
        """Run a watermark pass if usage is above the high watermark; returns evicted groups."""
        if self.used_bytes > self.high_watermark * self.capacity_bytes:
            return self._evict(0)
        return ()

    def _insert(self, key: str, group: str, nbytes: int, now: float) -> None:
        g = self._groups.get(group)
        if g is None:
            g = self._groups[group] = _Group()
            self.policy.on_insert(group, now)
        else:
            self.policy.on_access(group, now)
        g.keys.add(key)
        g.nbytes += nbytes
        self._objects[key] = (group, nbytes)
        self.used_bytes += nbytes

    def _evict(self, need_bytes: int, protect: str | None = None) -> tuple[str, ...]:
        """Free at least ``need_bytes`` (all or nothing) and up to a pass's target (best effort)."""
        cap = self.capacity_bytes
        used_ratio = self.used_bytes / cap if cap else 1.0
        ratio = max(self.evict_ratio, used_ratio - self.high_watermark + self.evict_ratio)
        target = max(need_bytes, int(-(-cap * ratio // 1)))
        victims: list[str] = []
        freed = 0
        for grp in self.policy.order():
            if freed >= target:
                break
            g = self._groups[grp]
            if g.pins or grp == protect:
                continue
            victims.append(grp)
            freed += g.nbytes
        if freed < need_bytes:
            return ()
        for grp in victims:
            self.evicted_bytes += self.remove_group(grp)
        self.evicted_groups += len(victims)
        return tuple(victims)
