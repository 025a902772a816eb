"""EmbeddedPool: an in-process pool (the default when no Mooncake address is given).

Contract: the ``Pool`` contract of ``kvpool.backend.pool.api``, plus:
    * Capacity and eviction are ``kvpool.policy.eviction.GroupedPool``'s: grouped LRU (or LFU /
      FIFO), passes from the high watermark (0.90) freeing a fraction (0.05) of capacity, a group
      evicted whole, first writer wins. The simulator's pool model uses the same bookkeeping, so
      both see the same evictions for the same sequence of calls.
    * Reads (``get``, ``exists``) count as accesses for the eviction order, like Mooncake's leases.
    * There is no background thread: eviction happens inside ``put``, so a put that cannot fit
      even after eviction (an object larger than the pool, or every other group pinned) returns
      ``Status.FULL`` at once -- retrying could not help.
    * Bytes are copied with ``memmove`` from and into registered host buffers; the pool holds one
      ``bytes`` copy per object. Never answers ``NO_ANSWER`` or ``FAILED``.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvpool.backend.pool.api import BufferRef, PoolStats, Status
from kvpool.backend.pool.buffers import BufferRegistry, check_batch
from kvpool.policy.eviction import EvictionPolicy, GroupedPool


class EmbeddedPool:
    """In-process pool of ``capacity_bytes`` evicting with ``policy.eviction.GroupedPool``.

    Args:
        capacity_bytes: bytes the pool holds (> 0).
        eviction: eviction policy name (``"lru"``, ``"lfu"``, ``"fifo"``) or an ``EvictionPolicy``.
        high_watermark: usage fraction above which an eviction pass runs.
        evict_ratio: fraction of capacity a pass frees at least.
        clock: seconds, monotonic; injected so tests and the simulator control time.
    """

    def __init__(
        self,
        capacity_bytes: int,
        eviction: str | EvictionPolicy = "lru",
        *,
        high_watermark: float = 0.90,
        evict_ratio: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self._book = GroupedPool(capacity_bytes, eviction, high_watermark=high_watermark, evict_ratio=evict_ratio)
        self._clock = clock
        self._lock = threading.Lock()
        self._data: dict[str, bytes] = {}
        self._group_keys: dict[str, set[str]] = {}
        self._buffers = BufferRegistry()
        self._evicted_keys = 0
        self._eviction_passes = 0
        self._closed = False

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
        out: list[Status] = []
        with self._lock:
            now = self._clock()
            for key, group, off, size in zip(keys, groups, offsets_bytes, sizes_bytes):
                if key in self._data:  # first writer wins; the put still counts as an access
                    self._book.touch([key], now)
                    out.append(Status.OK)
                    continue
                res = self._book.put(key, group, size, now)
                if res.evicted:
                    self._drop_groups(res.evicted)
                if not res.stored:
                    out.append(Status.FULL)
                    continue
                self._data[key] = ctypes.string_at(buffer.address + off, size)
                self._group_keys.setdefault(group, set()).add(key)
                out.append(Status.OK)
        return out

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
        out: list[Status] = []
        with self._lock:
            now = self._clock()
            for key, off, size in zip(keys, offsets_bytes, sizes_bytes):
                blob = self._data.get(key)
                if blob is None:
                    out.append(Status.MISSING)
                    continue
                self._book.touch([key], now)
                if len(blob) != size:
                    out.append(Status.WRONG_SIZE)
                    continue
                ctypes.memmove(buffer.address + off, blob, size)
                out.append(Status.OK)
        return out

    def exists(self, keys: Sequence[str]) -> list[bool] | None:
        self._check_open()
        with self._lock:
            return self._book.exists(list(keys), self._clock())

    def remove(self, keys: Sequence[str]) -> list[Status]:
        self._check_open()
        out: list[Status] = []
        with self._lock:
            for key in keys:
                group = self._book.group_of(key)
                if group is None or not self._book.remove(key):
                    out.append(Status.MISSING)
                    continue
                self._data.pop(key, None)
                members = self._group_keys.get(group)
                if members is not None:
                    members.discard(key)
                    if not members:
                        del self._group_keys[group]
                out.append(Status.OK)
        return out

    def stats(self) -> PoolStats | None:
        with self._lock:
            return PoolStats(
                capacity_bytes=self._book.capacity_bytes,
                used_bytes=self._book.used_bytes,
                key_count=len(self._book),
                evicted_key_count=self._evicted_keys,
                evicted_bytes=self._book.evicted_bytes,
                eviction_passes=self._eviction_passes,
            )

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._data.clear()
            self._group_keys.clear()

    # -- internals -------------------------------------------------------------------------
    def _drop_groups(self, groups: Sequence[str]) -> None:
        self._eviction_passes += 1
        for group in groups:
            for key in self._group_keys.pop(group, ()):
                if self._data.pop(key, None) is not None:
                    self._evicted_keys += 1

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("the pool is closed")

    def __enter__(self) -> EmbeddedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
