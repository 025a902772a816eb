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
from kvpool.policy.eviction import GroupedPool, Put


class EmbeddedPool:
    """In-process pool of ``capacity_bytes`` evicting with ``policy.eviction.GroupedPool``.

    Args:
        capacity_bytes: bytes the pool holds (> 0).
        eviction: eviction order, a name of ``policy.eviction.EVICTION_ORDERS`` (``"lru"``,
            ``"lfu"``, ``"fifo"``).
        high_watermark: usage fraction above which an eviction pass runs.
        evict_ratio: fraction of capacity a pass frees at least.
        clock: seconds, monotonic; injected so tests and the simulator control time.
    """

    def __init__(
        self,
        capacity_bytes: int,
        eviction: str = "lru",
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
        self._buffers = BufferRegistry()
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
        with self._lock:
            res = self._book.put(keys, groups, sizes_bytes, self._clock())
            for key in res.evicted_keys:
                del self._data[key]
            for key, off, size, outcome in zip(keys, offsets_bytes, sizes_bytes, res.outcomes):
                if outcome is Put.STORED and key not in self._data:  # (a key named twice: its first range)
                    self._data[key] = ctypes.string_at(buffer.address + off, size)
        return [Status.FULL if o is Put.REJECTED else Status.OK for o in res.outcomes]

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
            self._book.lookup(keys, self._clock())  # one read call
            for key, off, size in zip(keys, offsets_bytes, sizes_bytes):
                blob = self._data.get(key)
                if blob is None:
                    out.append(Status.MISSING)
                elif len(blob) != size:
                    out.append(Status.WRONG_SIZE)
                else:
                    ctypes.memmove(buffer.address + off, blob, size)
                    out.append(Status.OK)
        return out

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
                    del self._data[key]
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
            self._closed = True
            self._data.clear()

    # -- internals -------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("the pool is closed")

    def __enter__(self) -> EmbeddedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
