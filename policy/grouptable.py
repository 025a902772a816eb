"""Grouped eviction over integer group ids, in numpy, for callers that hold chunk groups as
integers (the simulator: hundreds of chunks per lookup).

Contract: ``policy.eviction``'s (its module docstring), with objects addressed as ``(group, slot)``:
    * A group is an integer id (>= 0); its objects are its ``slots`` (the pipeline stages stored in
      this pool part), object ``(g, s)`` of ``slot_bytes[s]`` bytes.
    * ``put(gids, slots, now)`` is one put of the objects ``gids x slots``, groups in the order of
      ``gids`` (repeats count once). ``lookup``, ``lookup_slots`` and ``lookup_runs`` are one read
      call each; ``contains`` reads nothing. ``remove(gids, slot)`` deletes single objects.
    * Orders: ``lru``, ``lfu``, ``fifo``; pins count per id, as in ``policy.eviction``.
    * Ids come as any integer sequence (checked: >= 0; repeats allowed) or as ``GroupIds``,
      ids whose maker knows they are distinct and bounded (taken without either check). Every
      call decides the same for the same ids, however they come.
    * ``tests/policy/test_eviction_differential.py`` drives this table and ``EmbeddedPool``
      (``eviction.GroupedPool``) through the same random calls and checks they decide alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from kvpool.policy.eviction import ORDERS

_MIN, _MAX = np.minimum.reduce, np.maximum.reduce
_NO_IDS = np.zeros(0, dtype=np.int64)
_NO_IDS.flags.writeable = False


def grown(a: np.ndarray, size: int) -> np.ndarray:
    """``a`` zero-padded to ``size`` entries (a fresh zeroed buffer: only ``a``'s part is touched)."""
    out = np.zeros(size, dtype=a.dtype)
    out[: a.size] = a
    return out


class IdList:
    """An append-mostly list of integer ids in a numpy buffer (amortized O(1) appends)."""

    def __init__(self, capacity: int = 1024) -> None:
        self._buf = np.zeros(max(1, capacity), dtype=np.int64)
        self.size = 0

    def extend(self, ids: np.ndarray) -> None:
        need = self.size + ids.size
        if need > self._buf.size:
            grown = np.zeros(max(need, 2 * self._buf.size), dtype=np.int64)
            grown[: self.size] = self._buf[: self.size]
            self._buf = grown
        self._buf[self.size : need] = ids
        self.size = need

    def view(self) -> np.ndarray:
        return self._buf[: self.size]

    def keep(self, mask: np.ndarray) -> np.ndarray:
        """Keep the entries where ``mask`` (over ``view()``) is true; returns the dropped ones."""
        v = self.view()
        dropped = v[~mask]
        kept = v[mask]
        self._buf[: kept.size] = kept
        self.size = kept.size
        return dropped


class GroupIds(NamedTuple):
    """Group ids known by construction to be distinct, each in ``0 .. max_gid`` (one prompt's
    chunk groups: every chunk's key chains its whole prefix, so no two are equal). ``part`` and
    ``where`` keep both facts: a subset of distinct ids under a bound is one."""

    ids: np.ndarray  # int64
    max_gid: int

    def part(self, start: int, stop: int | None = None) -> GroupIds:
        """Ids ``start .. stop - 1``."""
        return GroupIds(self.ids[start:stop], self.max_gid)

    def where(self, mask: np.ndarray) -> GroupIds:
        """The ids where ``mask`` (one bool per id) is true."""
        return GroupIds(self.ids[mask], self.max_gid)


Ids = Sequence[int] | np.ndarray | GroupIds


@dataclass(frozen=True, slots=True)
class PutOutcome:
    """What a put did: new objects stored and rejected, and the groups it evicted (in order)."""

    stored: int
    rejected: int
    evicted_groups: int
    evicted_bytes: int
    evicted_ids: np.ndarray = field(default_factory=lambda: _NO_IDS, compare=False)


class GroupTable:
    """One pool part's objects, indexed by integer group id and slot. See the module docstring.

    Presence is one bit per slot in a per-group mask (at most 64 slots), so a batched check or put
    is a handful of array operations whatever the number of slots."""

    _TABLE_SLOTS = 16  # up to this many slots, bytes and object counts per mask come from tables

    def __init__(
        self,
        capacity_bytes: int,
        slot_bytes: Sequence[int],
        order: str = "lru",
        *,
        high_watermark: float = 0.90,
        evict_ratio: float = 0.05,
        initial_groups: int = 4096,
    ) -> None:
        if order not in ORDERS:
            raise ValueError(f"unknown eviction order {order!r}; allowed: {list(ORDERS)}")
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        if not slot_bytes or any(b <= 0 for b in slot_bytes):
            raise ValueError(f"slot_bytes must be positive sizes, got {list(slot_bytes)}")
        if len(slot_bytes) > 64:
            raise ValueError(f"at most 64 slots per table, got {len(slot_bytes)}")
        if not 0.0 < high_watermark <= 1.0 or not 0.0 < evict_ratio <= 1.0:
            raise ValueError("high_watermark and evict_ratio must be in (0, 1]")
        self.capacity_bytes = int(capacity_bytes)
        self.slot_bytes = np.asarray(slot_bytes, dtype=np.int64)
        self.order = order
        self.high_watermark = high_watermark
        self.evict_ratio = evict_ratio
        self.used_bytes = 0
        self.evicted_groups = 0
        self.evicted_bytes = 0
        self.evict_passes = 0
        self._seq = 0
        n = max(1, initial_groups)
        self._mask = np.zeros(n, dtype=np.uint64)
        self._last = np.zeros(n, dtype=np.float64)
        self._count = np.zeros(n, dtype=np.int64)  # reads per group: kept for lfu, the order that uses them
        self._counts_reads = order == "lfu"
        self._inserted = np.zeros(n, dtype=np.int64)
        self._pins = np.zeros(n, dtype=np.int32)
        self._mark = np.zeros(n, dtype=np.int32)
        self._resident = IdList()  # groups holding objects (+ stale ones until the next pass)
        self._listed = np.zeros(n, dtype=bool)  # whether a group is in _resident
        self._bits = np.left_shift(np.uint64(1), np.arange(self.slots, dtype=np.uint64))
        self._all_bits = np.bitwise_or.reduce(self._bits)  # every slot
        self._slot_masks: dict[tuple[int, ...], tuple[np.ndarray, np.uint64]] = {}
        if self.slots <= self._TABLE_SLOTS:
            masks = np.arange(1 << self.slots, dtype=np.uint64)
            has = (masks[:, None] & self._bits[None, :]) != 0
            self._bytes_table = has.astype(np.int64) @ self.slot_bytes
            self._count_table = has.sum(axis=1)
        else:
            self._bytes_table = self._count_table = None

    @property
    def slots(self) -> int:
        return len(self.slot_bytes)

    @property
    def present(self) -> np.ndarray:
        """Presence as a ``[group, slot]`` bool array (a copy, for inspection)."""
        return (self._mask[:, None] & self._bits[None, :]) != 0

    @property
    def objects(self) -> int:
        return int(self._objects_of(self._mask).sum())

    def _bytes_of(self, masks: np.ndarray) -> np.ndarray:
        if self._bytes_table is not None:
            return self._bytes_table[masks]
        return ((masks[:, None] & self._bits[None, :]) != 0).astype(np.int64) @ self.slot_bytes

    def _objects_of(self, masks: np.ndarray) -> np.ndarray:
        if self._count_table is not None:
            return self._count_table[masks]
        return ((masks[:, None] & self._bits[None, :]) != 0).sum(axis=1)

    def _slot_mask(self, slots: int | Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.uint64]:
        """(slots as an array, their bits OR-ed), memoized per slot list."""
        if isinstance(slots, (int, np.integer)):
            key = (int(slots),)
        elif isinstance(slots, (list, tuple)):
            key = tuple(slots)
        else:
            key = tuple(np.ravel(slots).tolist())
        got = self._slot_masks.get(key)
        if got is None:
            if any(not 0 <= x < self.slots for x in key):
                raise ValueError(f"slots must be in 0..{self.slots - 1}, got {list(key)}")
            arr = np.asarray(key, dtype=np.int64)
            got = self._slot_masks[key] = (arr, np.bitwise_or.reduce(self._bits[arr]) if key else np.uint64(0))
        return got

    def _grow(self, max_gid: int) -> None:
        n = len(self._last)
        if max_gid < n:
            return
        new = max(max_gid + 1, 4 * n)
        for name in ("_mask", "_last", "_count", "_inserted", "_pins", "_mark", "_listed"):
            setattr(self, name, grown(getattr(self, name), new))

    def _ids(self, gids: Ids, max_gid: int | None = None) -> np.ndarray:
        """``gids`` as an int64 array, checked (>= 0) and with the tables grown to hold them;
        ``max_gid``: a bound the caller knows, for ids it knows are valid (no pass over them;
        a ``GroupIds`` brings its own)."""
        if type(gids) is GroupIds:
            ids, max_gid = gids
            if max_gid >= len(self._last):
                self._grow(max_gid)
            return ids
        ids = np.asarray(gids, dtype=np.int64)
        if max_gid is not None:
            if max_gid >= len(self._last):
                self._grow(max_gid)
        elif ids.size:  # the ufunc reductions directly: ndarray.min/max add a Python-level wrapper
            if _MIN(ids) < 0:
                raise ValueError("group ids must be >= 0")
            self._grow(int(_MAX(ids)))
        return ids

    # -- reads -------------------------------------------------------------------------------
    def lookup(self, gids: Ids, slot: int, now: float) -> np.ndarray:
        """Presence of ``(g, slot)`` for each ``g``; present objects' groups count as read now."""
        ids = self._ids(gids)
        hit = (self._mask[ids] & self._slot_mask(slot)[1]) != 0
        self._touch(ids[hit], now)
        return hit

    def _touch(self, touched: np.ndarray, now: float) -> None:
        """Groups read now (a lookup found objects of theirs): recency and read count."""
        if touched.size:
            self._last[touched] = now
            if self._counts_reads:
                self._count[touched] += 1

    def contains(self, gid: int, slot: int) -> bool:
        """Presence without touching recency."""
        return gid < len(self._last) and bool(self._mask[gid] & self._bits[slot])

    # -- pins --------------------------------------------------------------------------------
    def pin(self, gids: Ids, *, unique: bool = False, max_gid: int | None = None) -> None:
        """Protect groups from eviction (loads in flight); nests. ``unique``: the caller knows
        ``gids`` has no repeats (skips the check). ``max_gid`` (here and in ``unpin``, ``put``,
        ``lookup_runs``): a bound on ``gids`` the caller knows, which skips their range check.
        A ``GroupIds`` says both itself."""
        unique = unique or type(gids) is GroupIds
        ids = self._ids(gids, max_gid)
        if not unique and self._has_duplicates(ids):
            np.add.at(self._pins, ids, 1)
        else:
            self._pins[ids] += 1

    def unpin(self, gids: Ids, *, unique: bool = False, max_gid: int | None = None) -> None:
        unique = unique or type(gids) is GroupIds
        ids = self._ids(gids, max_gid)
        if not unique and self._has_duplicates(ids):
            np.subtract.at(self._pins, ids, 1)
            self._pins[ids] = np.maximum(self._pins[ids], 0)
        else:  # each id once: decrement and clamp in one gather and one scatter
            left = self._pins[ids]
            left -= 1
            np.maximum(left, 0, out=left)
            self._pins[ids] = left

    # -- writes ------------------------------------------------------------------------------
    def put(self, gids: Ids, slot: int | Sequence[int], now: float, *,
            unique: bool = False, max_gid: int | None = None) -> PutOutcome:
        """One put of the objects ``(g, s)`` for every ``g`` of ``gids`` (in order) and every ``s``
        of ``slot`` (one slot or several), as ``policy.eviction``'s contract says: present objects
        stay as they are, every named group is used now and protected, a pass when the new objects
        do not fit, the leading groups that fit stored, then a watermark pass. ``unique``: the
        caller knows ``gids`` has no repeats (a ``GroupIds`` has none)."""
        unique = unique or type(gids) is GroupIds
        ids = self._ids(gids, max_gid)
        want = self._slot_mask(slot)[1]
        if not unique and self._has_duplicates(ids):
            ids = ids[np.sort(np.unique(ids, return_index=True)[1])]
        if want and self._bytes_table is not None and self._all_new(ids):
            return self._put_new(ids, want, now)  # no object of these groups yet (a prompt's new chunks)
        missing = want & ~self._mask[ids]  # bits each group still lacks
        need_row = self._bytes_of(missing)  # bytes each group still needs
        self._last[ids] = now
        passes: list[tuple[np.ndarray, int]] = []
        total = int(need_row.sum())
        need = self.used_bytes + total - self.capacity_bytes
        if need > 0:
            passes.append(self._evict(need, protect=ids))
        room = self.capacity_bytes - self.used_bytes
        if total <= room:  # everything fits (the common case: no cumulative sum needed)
            stored_rows = np.flatnonzero(need_row)
        else:
            stored_rows = np.flatnonzero((np.cumsum(need_row) <= room) & (need_row > 0))
        stored = ids[stored_rows]
        if stored.size:
            fresh = self._mask[stored] == 0
            n_fresh = int(np.count_nonzero(fresh))
            joining = stored[fresh & ~self._listed[stored]]
            self._listed[joining] = True
            self._resident.extend(joining)
            self._inserted[stored[fresh]] = self._seq + 1 + np.arange(n_fresh)
            self._seq += n_fresh
            self._count[stored[fresh]] = 0
            self._mask[stored] |= missing[stored_rows]
            self.used_bytes += int(need_row[stored_rows].sum())
        if self.used_bytes > self.high_watermark * self.capacity_bytes:
            passes.append(self._evict(0, protect=ids))
        gone = np.concatenate([v for v, _ in passes]) if passes else np.zeros(0, dtype=np.int64)
        freed = sum(b for _, b in passes)
        n_new = int(self._objects_of(missing).sum())
        n_stored = n_new if stored_rows.size == np.count_nonzero(need_row) else int(self._objects_of(missing[stored_rows]).sum())
        return PutOutcome(n_stored, n_new - n_stored, int(gone.size), freed, gone)

    def _all_new(self, ids: np.ndarray) -> bool:
        """Whether no group of ``ids`` (non-empty) holds an object."""
        return bool(ids.size) and not np.count_nonzero(self._mask[ids])  # cheaper than .any() or a max

    def _put_new(self, ids: np.ndarray, want: np.uint64, now: float) -> PutOutcome:
        """``put`` of distinct groups none of which holds an object yet: every group needs the
        same bytes, so what fits is a leading count, not a cumulative sum (same outcome)."""
        size = int(self._bytes_table[want])
        objects = int(self._count_table[want])
        n = int(ids.size)
        self._last[ids] = now
        passes: list[tuple[np.ndarray, int]] = []
        total = n * size
        need = self.used_bytes + total - self.capacity_bytes
        if need > 0:
            passes.append(self._evict(need, protect=ids))
        room = self.capacity_bytes - self.used_bytes
        k = n if total <= room else max(0, min(n, room // size))
        stored = ids[:k] if k < n else ids
        if k:
            joining = stored[~self._listed[stored]]
            self._listed[joining] = True
            self._resident.extend(joining)
            self._inserted[stored] = np.arange(self._seq + 1, self._seq + 1 + k)
            self._seq += k
            self._count[stored] = 0
            self._mask[stored] = want
            self.used_bytes += k * size
        if self.used_bytes > self.high_watermark * self.capacity_bytes:
            passes.append(self._evict(0, protect=ids))
        if passes:
            gone = np.concatenate([v for v, _ in passes])
            freed = sum(b for _, b in passes)
        else:
            gone, freed = _NO_IDS, 0
        return PutOutcome(k * objects, (n - k) * objects, int(gone.size), freed, gone)

    def _has_duplicates(self, ids: np.ndarray) -> bool:
        """O(n) duplicate check with a scratch array (ids are already in range): with a repeated
        id, a later position overwrites an earlier one's mark."""
        if ids.size < 2:
            return False
        mark = self._mark
        pos = np.arange(1, ids.size + 1, dtype=mark.dtype)
        mark[ids] = pos
        dup = bool((mark[ids] != pos).any())
        mark[ids] = 0
        return dup

    def lookup_slots(self, gids: Ids, slots: Sequence[int], now: float) -> np.ndarray:
        """Presence ``[slot index, chunk]`` for several slots in one check (recency as ``lookup``)."""
        ids = self._ids(gids)
        slots, want = self._slot_mask(slots)
        masks = self._mask[ids]
        hit = (masks[None, :] & self._bits[slots][:, None]) != 0
        self._touch(ids[(masks & want) != 0], now)
        return hit

    def lookup_runs(self, gids: Ids, slots: Sequence[int], now: float, *,
                    max_gid: int | None = None) -> list[int]:
        """For each of ``slots``, how many leading groups of ``gids`` hold its object (the leading
        runs of ``lookup_slots``' rows, recency as ``lookup``) without building the rows."""
        ids = self._ids(gids, max_gid)
        slots, want = self._slot_mask(slots)
        got = self._mask[ids]
        if want != self._all_bits:  # (every slot wanted: the masks hold no other bit)
            got &= want
        self._touch(ids[got.astype(bool)], now)  # (nonzero, cheaper than a compare with 0)
        short = got != want  # groups missing at least one of the slots
        first = int(short.argmax())  # the first of them (bool argmax stops there), or 0
        if not short.size or not short[first]:
            return [int(ids.size)] * slots.size
        if not got[first]:  # missing every slot there: every run ends at it
            return [first] * slots.size
        runs = []
        for bit in self._bits[slots]:
            gap = np.flatnonzero((got[first:] & bit) == 0)
            runs.append(first + int(gap[0]) if gap.size else int(ids.size))
        return runs

    def remove(self, gids: Ids, slot: int) -> np.ndarray:
        """Delete the objects ``(g, slot)``; per position of ``gids``, whether it removed one (a
        repeated id removes once). A group keeps its state while it holds other objects; one left
        with none is gone (its stale entry in the resident list is dropped by the next pass)."""
        ids = self._ids(gids)
        bit = self._slot_mask(slot)[1]
        held = (self._mask[ids] & bit) != 0
        if self._has_duplicates(ids):
            first = np.zeros(ids.size, dtype=bool)
            first[np.unique(ids, return_index=True)[1]] = True
            held &= first
        gone = ids[held]
        self._mask[gone] &= ~bit
        self.used_bytes -= int(self.slot_bytes[slot]) * int(gone.size)
        return held

    _partial_sort = True  # False: every eviction pass sorts every candidate (tests compare)

    def _order_keys(self, cand: np.ndarray) -> tuple[np.ndarray, ...]:
        """``np.lexsort`` keys of the eviction order (the last key is the primary one): LRU by
        last use, then the most recently inserted first; LFU by reads, then as LRU; FIFO by
        insertion."""
        if self.order == "lru":
            return (-self._inserted[cand], self._last[cand])
        if self.order == "lfu":
            return (-self._inserted[cand], self._last[cand], self._count[cand])
        return (self._inserted[cand],)

    def _evict(self, need_bytes: int, protect: np.ndarray) -> tuple[np.ndarray, int]:
        """One pass (``policy.eviction``'s contract): whole groups in the eviction order until the
        target is freed or no candidate is left; returns their ids and the bytes freed."""
        cap = self.capacity_bytes
        used_ratio = self.used_bytes / cap if cap else 1.0
        ratio = max(self.evict_ratio, used_ratio - self.high_watermark + self.evict_ratio)
        target = max(need_bytes, int(np.ceil(cap * ratio)))
        # candidates: the resident groups (stale entries dropped here), unpinned, not being written
        alive = self._mask[self._resident.view()] != 0
        self._listed[self._resident.keep(alive)] = False
        res = self._resident.view()
        ok = self._pins[res] == 0
        if protect.size:
            self._mark[protect] = 1
            ok &= self._mark[res] == 0
            self._mark[protect] = 0
        cand = res[ok]
        if not cand.size:
            return _NO_IDS, 0
        if self.order == "lru":
            primary = self._last[cand]
        elif self.order == "lfu":
            primary = self._count[cand]
        else:
            primary = self._inserted[cand]
        # The victims lead the eviction order; no more of them than the target in the smallest
        # objects. Sort only the groups whose primary key is at most the one of that rank (ties
        # included): in cand order, sorted by the same keys they lead the full order (lexsort is
        # stable), so the leading groups are the same; too few bytes there: sort them all.
        ordered = cum = None
        bound = target // max(1, int(self.slot_bytes.min())) + 2
        if self._partial_sort and bound < cand.size:
            cut = np.partition(primary, bound - 1)[bound - 1]
            sub = primary <= cut
            ordered = cand[sub]
            ordered = ordered[np.lexsort(self._order_keys(ordered))]
            cum = np.cumsum(self._bytes_of(self._mask[ordered]))
            if cum[-1] < target:
                ordered = None
        if ordered is None:
            ordered = cand[np.lexsort(self._order_keys(cand))]
            cum = np.cumsum(self._bytes_of(self._mask[ordered]))
        k = int(np.searchsorted(cum, target, side="left")) + 1
        victims = ordered[: min(k, ordered.size)]
        freed = int(cum[victims.size - 1])
        self._mask[victims] = 0
        self.used_bytes -= freed
        self.evicted_groups += int(victims.size)
        self.evicted_bytes += freed
        self.evict_passes += 1
        return victims, freed
