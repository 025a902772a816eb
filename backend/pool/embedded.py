"""EmbeddedPool: an in-process pool (the default when no Mooncake address is given).

Contract: the ``Pool`` contract of ``kvpool.backend.pool.api``, plus:
    * What is kept, evicted and rejected is ``kvpool.policy.eviction.GroupedPool``'s, the policy
      core's grouped eviction (its module docstring is the contract): grouped LRU (or LFU / FIFO),
      a pass when a put does not fit and one when usage ends above the high watermark (0.90),
      each freeing a fraction (0.05) of capacity, a group evicted whole, first writer wins. The
      simulator's pool (``policy.grouptable``) decides the same for the same calls (a
      differential test checks it).
    * One ``put`` call is one put of the policy: all its groups are protected from its own
      passes, and when its new objects do not fit even after eviction, the leading groups that
      fit are stored and the others' keys answer ``Status.FULL`` at once (no background thread
      runs, so retrying could not help).
    * ``get`` and ``exists`` are read calls of the policy: each group they find counts one read.
      A present key put again answers ``OK`` and counts as a use of its group.
    * The clock is injected (``clock``); each call reads it once.
    * **Memory.** The bytes live in one arena (``backend.pool.arena``) of ``capacity_bytes +
      arena_headroom_bytes``, mapped once at construction and page-locked for the GPU when one is
      present (``pinned``). A put places its new objects as one contiguous run in key order when
      a free range holds it, so the chunks of one save (and of a restore of that save) sit back
      to back; a get copies them with a few large ``memmove``s (split across ``copy_threads``).
      Nothing else is allocated per object.
    * **In place** (``ArenaPool``): ``lease_read`` lends objects' arena ranges for host -> device
      copies without a host copy; ``reserve_write`` returns the ranges a save fills (device ->
      host straight into the arena) before ``commit``. An object evicted or removed while lent
      keeps its bytes until the lease ends (``arena_headroom_bytes`` holds such bytes); reserved
      objects read as ``MISSING`` until committed. Neither pins groups: eviction decides exactly
      as for ``get`` and ``put``.
    * When the arena has no room for objects the policy stored (only possible while lent,
      removed objects exceed the headroom), those keys are removed again and answer ``FULL``.
      Never answers ``NO_ANSWER`` or ``FAILED``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.backend.pool.api import ArenaPiece, ArenaRead, ArenaWrite, BufferRef, PoolStats, Status
from kvpool.backend.pool.arena import Arena, Copier, ExtentAllocator, Piece
from kvpool.backend.pool.buffers import BufferRegistry, check_batch
from kvpool.policy.eviction import GroupedPool, Put

MIB = 1 << 20


@dataclass(eq=False)
class _Object:
    """One object's place in the arena; ``leases``/``pending``/``dead`` defer freeing its pieces."""

    size_bytes: int
    pieces: tuple[Piece, ...]
    leases: int = 0
    pending: bool = False
    dead: bool = False


def _dense_pieces(objs: Sequence[tuple[int, _Object]], dense_offsets: Sequence[int]) -> list[ArenaPiece]:
    """Pieces of ``objs`` (index, object) at their dense offsets, merged where contiguous on both sides."""
    out: list[ArenaPiece] = []
    for (i, obj) in objs:
        d = dense_offsets[i]
        for a, n in obj.pieces:
            if out and out[-1].arena_offset_bytes + out[-1].nbytes == a and out[-1].dense_offset_bytes + out[-1].nbytes == d:
                last = out[-1]
                out[-1] = ArenaPiece(last.arena_offset_bytes, last.dense_offset_bytes, last.nbytes + n)
            else:
                out.append(ArenaPiece(a, d, n))
            d += n
    return out


class EmbeddedPool:
    """In-process pool of ``capacity_bytes`` evicting with ``policy.eviction.GroupedPool``.

    Args:
        capacity_bytes: bytes the pool holds (> 0).
        eviction: eviction order, a name of ``policy.eviction.EVICTION_ORDERS`` (``"lru"``,
            ``"lfu"``, ``"fifo"``).
        high_watermark: usage fraction above which an eviction pass runs.
        evict_ratio: fraction of capacity a pass frees at least.
        clock: seconds, monotonic; injected so tests and the simulator control time.
        pinned: page-lock the arena for GPU copies; ``None`` (default): when torch is imported and
            sees a GPU.
        arena_headroom_bytes: arena bytes beyond ``capacity_bytes`` for objects evicted while lent;
            default 1/16 of the capacity (at least 1 MiB).
        copy_threads: threads of large host copies; default ``min(8, cpu_count)``.
    """

    def __init__(
        self,
        capacity_bytes: int,
        eviction: str = "lru",
        *,
        high_watermark: float = 0.90,
        evict_ratio: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
        pinned: bool | None = None,
        arena_headroom_bytes: int | None = None,
        copy_threads: int | None = None,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        headroom = max(capacity_bytes // 16, MIB) if arena_headroom_bytes is None else arena_headroom_bytes
        if headroom < 0:
            raise ValueError(f"arena_headroom_bytes must be >= 0, got {headroom}")
        self._book = GroupedPool(capacity_bytes, eviction, high_watermark=high_watermark, evict_ratio=evict_ratio)
        self._clock = clock
        self._lock = threading.Lock()
        self._objects: dict[str, _Object] = {}
        self._arena = Arena(capacity_bytes + headroom, pinned)
        self._alloc = ExtentAllocator(self._arena.size_bytes)
        self._copier = Copier(copy_threads)
        self._buffers = BufferRegistry()
        self._closed = False

    # -- arena -----------------------------------------------------------------------------
    @property
    def arena_buffer(self) -> Any:
        """The arena (a writable ``mmap``); ``torch.frombuffer(pool.arena_buffer, dtype=torch.uint8)``."""
        return self._arena.buffer

    @property
    def arena_pinned(self) -> bool:
        return self._arena.pinned

    def arena_info(self) -> dict[str, Any]:
        """Arena size, pinning, free bytes and free extents (inspection, benchmarks)."""
        with self._lock:
            return {
                "arena_bytes": self._arena.size_bytes,
                "pinned": self._arena.pinned,
                "pin_error": self._arena.pin_error,
                "free_bytes": self._alloc.free_bytes,
                "free_extents": self._alloc.free_extents,
                "copy_threads": self._copier.threads,
            }

    # -- buffers ---------------------------------------------------------------------------
    def register_buffer(self, buffer: Any) -> BufferRef:
        self._check_open()
        return self._buffers.add(buffer)

    def unregister_buffer(self, ref: BufferRef) -> None:
        self._buffers.remove(ref)

    # -- data ------------------------------------------------------------------------------
    def put(
        self,
        keys: Sequence[str],
        groups: Sequence[str],
        buffer: BufferRef,
        offsets_bytes: Sequence[int],
        sizes_bytes: Sequence[int],
    ) -> list[Status]:
        self._check_open()
        self._buffers.check(buffer)
        check_batch(keys, offsets_bytes, sizes_bytes, buffer, groups)
        with self._lock:
            statuses, new = self._policy_put(keys, groups, sizes_bytes, pending=False)
            base = self._arena.address
            copies = []
            for i, obj in new:
                src = buffer.address + offsets_bytes[i]
                for a, n in obj.pieces:
                    copies.append((base + a, src, n))
                    src += n
            self._copier.run(copies)
        return statuses

    def get(
        self,
        keys: Sequence[str],
        buffer: BufferRef,
        offsets_bytes: Sequence[int],
        sizes_bytes: Sequence[int],
    ) -> list[Status]:
        self._check_open()
        self._buffers.check(buffer)
        check_batch(keys, offsets_bytes, sizes_bytes, buffer)
        with self._lock:
            self._book.lookup(keys, self._clock())  # one read call
            out, found = self._read_statuses(keys, sizes_bytes)
            base = self._arena.address
            copies = []
            for i, obj in found:
                dst = buffer.address + offsets_bytes[i]
                for a, n in obj.pieces:
                    if copies and copies[-1][0] + copies[-1][2] == dst and copies[-1][1] + copies[-1][2] == base + a:
                        d, s, m = copies[-1]
                        copies[-1] = (d, s, m + n)
                    else:
                        copies.append((dst, base + a, n))
                    dst += n
            self._copier.run(copies)
        return out

    def lease_read(self, keys: Sequence[str], sizes_bytes: Sequence[int]) -> ArenaRead:
        """Lend the arena ranges of ``keys`` (``ArenaPool``; one read call of the policy)."""
        self._check_open()
        if len(keys) != len(sizes_bytes):
            raise ValueError(f"{len(keys)} keys but {len(sizes_bytes)} sizes")
        dense = self._dense_offsets(sizes_bytes)
        with self._lock:
            self._book.lookup(keys, self._clock())
            out, found = self._read_statuses(keys, sizes_bytes)
            for _, obj in found:
                obj.leases += 1
            pieces = _dense_pieces(found, dense)
        lent = [obj for _, obj in found]

        def release() -> None:
            with self._lock:
                for obj in lent:
                    obj.leases -= 1
                    if obj.dead and obj.leases == 0 and not obj.pending:
                        self._alloc.free(obj.pieces)

        return ArenaRead(out, pieces, release)

    def reserve_write(self, keys: Sequence[str], groups: Sequence[str], sizes_bytes: Sequence[int]) -> ArenaWrite:
        """One put of the policy whose new objects the caller fills in place (``ArenaPool``)."""
        self._check_open()
        if not (len(keys) == len(groups) == len(sizes_bytes)):
            raise ValueError(f"keys, groups and sizes differ in length: {len(keys)}, {len(groups)}, {len(sizes_bytes)}")
        for key, size in zip(keys, sizes_bytes):
            if not isinstance(key, str) or not key:
                raise ValueError(f"keys must be non-empty strings, got {key!r}")
            if size <= 0:
                raise ValueError(f"object size must be > 0 bytes, got {size}")
        dense = self._dense_offsets(sizes_bytes)
        with self._lock:
            statuses, new = self._policy_put(keys, groups, sizes_bytes, pending=True)
            pieces = _dense_pieces(new, dense)
        reserved = [(keys[i], obj) for i, obj in new]

        def finish(ok: bool) -> None:
            with self._lock:
                for key, obj in reserved:
                    obj.pending = False
                    if not ok and not obj.dead:
                        self._book.remove(key)
                        self._drop(key)
                    elif obj.dead and obj.leases == 0:
                        self._alloc.free(obj.pieces)

        return ArenaWrite(statuses, pieces, finish)

    def exists(self, keys: Sequence[str]) -> list[bool] | None:
        self._check_open()
        with self._lock:
            return self._book.lookup(list(keys), self._clock())

    def remove(self, keys: Sequence[str]) -> list[Status]:
        self._check_open()
        out: list[Status] = []
        with self._lock:
            for key in keys:
                if self._book.remove(key):
                    self._drop(key)
                    out.append(Status.OK)
                else:
                    out.append(Status.MISSING)
        return out

    def keys(self) -> list[str]:
        """The keys held now, for inspection (not a read: the eviction order does not change)."""
        with self._lock:
            return self._book.keys()

    def stats(self) -> PoolStats | None:
        with self._lock:
            return PoolStats(
                capacity_bytes=self._book.capacity_bytes,
                used_bytes=self._book.used_bytes,
                key_count=len(self._book),
                evicted_key_count=self._book.evicted_objects,
                evicted_bytes=self._book.evicted_bytes,
                eviction_passes=self._book.evict_passes,
            )

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._objects.clear()
        self._copier.close()
        self._arena.close()

    # -- internals -------------------------------------------------------------------------
    @staticmethod
    def _dense_offsets(sizes_bytes: Sequence[int]) -> list[int]:
        out, acc = [], 0
        for n in sizes_bytes:
            out.append(acc)
            acc += n
        return out

    def _policy_put(
        self, keys: Sequence[str], groups: Sequence[str], sizes_bytes: Sequence[int], pending: bool
    ) -> tuple[list[Status], list[tuple[int, _Object]]]:
        """The policy's put plus arena placement (lock held): statuses and the new objects by index."""
        res = self._book.put(keys, groups, sizes_bytes, self._clock())
        for key in res.evicted_keys:
            self._drop(key)
        statuses = [Status.FULL if o is Put.REJECTED else Status.OK for o in res.outcomes]
        first: dict[str, int] = {}
        for i, (key, outcome) in enumerate(zip(keys, res.outcomes)):
            if outcome is Put.STORED and key not in self._objects:
                first.setdefault(key, i)  # a key named twice: its first range
        idx = list(first.values())
        placed = self._alloc.alloc_batch([sizes_bytes[i] for i in idx]) if idx else []
        if placed is None:  # lent objects hold the headroom: store what fits, one by one
            placed = []
            for i in idx:
                one = self._alloc.alloc_batch([sizes_bytes[i]])
                placed.append(one[0] if one else None)
        new: list[tuple[int, _Object]] = []
        for i, pieces in zip(idx, placed):
            if pieces is None:
                self._book.remove(keys[i])
                for j, key in enumerate(keys):
                    if key == keys[i]:
                        statuses[j] = Status.FULL
                continue
            obj = _Object(sizes_bytes[i], pieces, pending=pending)
            self._objects[keys[i]] = obj
            new.append((i, obj))
        return statuses, new

    def _read_statuses(
        self, keys: Sequence[str], sizes_bytes: Sequence[int]
    ) -> tuple[list[Status], list[tuple[int, _Object]]]:
        out: list[Status] = []
        found: list[tuple[int, _Object]] = []
        for i, (key, size) in enumerate(zip(keys, sizes_bytes)):
            obj = self._objects.get(key)
            if obj is None or obj.pending:
                out.append(Status.MISSING)
            elif obj.size_bytes != size:
                out.append(Status.WRONG_SIZE)
            else:
                out.append(Status.OK)
                found.append((i, obj))
        return out, found

    def _drop(self, key: str) -> None:
        """Forget ``key``'s object (lock held); its pieces are freed now or when its lease ends."""
        obj = self._objects.pop(key, None)
        if obj is None:
            return
        if obj.leases or obj.pending:
            obj.dead = True
        else:
            self._alloc.free(obj.pieces)

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("the pool is closed")

    def __enter__(self) -> EmbeddedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
