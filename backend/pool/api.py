"""The pool interface: one small protocol that every KV pool implements.

Contract (every implementation; ``tests/backend/test_pool_contract.py`` checks each one):
    * Objects are opaque byte strings under string keys. Keys are content-addressed (a chunk's
      prefix digest plus its stage), so a **put of an existing key changes nothing** (first
      writer wins) and still reports ``Status.OK``.
    * Data moves only between the pool and **registered buffers**: ``register_buffer`` returns a
      ``BufferRef``; ``put`` and ``get`` take ranges ``(offset, size)`` inside one of them. Ranges
      are checked before anything moves (``ValueError`` for a range outside the buffer, or for a
      buffer that is not registered with this pool).
    * ``put(keys, groups, ...)`` stores each key in its group (a chunk's stage objects share one
      group, so the pool evicts them together). A put into a full pool is retried with a bounded
      backoff and then gives up with ``Status.FULL``; it never blocks longer than the pool's
      retry budget plus one RPC timeout.
    * ``get`` copies an object into its range only if the object has exactly the range's size;
      any other size is ``Status.WRONG_SIZE``. Every non-``OK`` get status is a miss: the caller
      recomputes. The bytes of a range whose get failed are unspecified.
    * ``exists(keys)`` answers for every key at once, or returns ``None`` ("no answer") when the
      pool cannot answer (master dead, hung or unreachable) -- never a guess, never a hang past
      the pool's RPC timeout. ``True`` may still be followed by a failed get (an object on a store
      service that died moments ago); the get is the authority.
    * ``remove`` deletes objects (even leased ones); ``stats`` reports capacity, use, keys and
      evictions, or ``None`` when the pool cannot answer.
    * Every call is bounded in time and thread-safe.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


class Status(enum.IntEnum):
    """Outcome of one key of a batch call. Everything except ``OK`` means "miss" to a reader."""

    OK = 0
    MISSING = 1  #: no such object (never written, evicted, or forgotten by a restarted master)
    WRONG_SIZE = 2  #: the object's size differs from the range's size; nothing usable was read
    FULL = 3  #: put gave up: the pool stayed full through the bounded retries
    NO_ANSWER = 4  #: the master did not answer (dead, hung or unreachable) within the RPC timeout
    FAILED = 5  #: the transfer failed (e.g. the store service holding the object died)


@dataclass(frozen=True)
class BufferRef:
    """A buffer registered with one pool: the only memory ``put``/``get`` read from or write to.

    Attributes:
        address: address of the first byte (host memory).
        size_bytes: length of the buffer.
        buffer_id: the pool's handle (unique per pool while registered).
    """

    address: int
    size_bytes: int
    buffer_id: int

    def check_range(self, offset_bytes: int, size_bytes: int) -> None:
        """Raise ``ValueError`` unless ``[offset, offset + size)`` lies inside the buffer."""
        if size_bytes <= 0:
            raise ValueError(f"object size must be > 0 bytes, got {size_bytes}")
        if offset_bytes < 0 or offset_bytes + size_bytes > self.size_bytes:
            raise ValueError(
                f"range [{offset_bytes}, {offset_bytes + size_bytes}) is outside the registered "
                f"buffer of {self.size_bytes} bytes"
            )


@dataclass(frozen=True)
class PoolStats:
    """Capacity, use and evictions of a pool (the whole pool, as its master or owner sees it).

    Attributes:
        capacity_bytes: bytes the pool can hold.
        used_bytes: bytes allocated to objects now.
        key_count: objects stored now.
        evicted_key_count: objects evicted since the pool started.
        evicted_bytes: bytes evicted since the pool started.
        eviction_passes: eviction passes that freed something.
    """

    capacity_bytes: int
    used_bytes: int
    key_count: int
    evicted_key_count: int
    evicted_bytes: int
    eviction_passes: int

    @property
    def used_fraction(self) -> float:
        return self.used_bytes / self.capacity_bytes if self.capacity_bytes else 0.0


@runtime_checkable
class Pool(Protocol):
    """The KV pool interface. See the module docstring for the contract."""

    def register_buffer(self, buffer: Any) -> BufferRef:
        """Register host memory (bytearray, writable numpy array, or contiguous CPU torch tensor)."""
        ...

    def unregister_buffer(self, ref: BufferRef) -> None:
        """Forget a registration; later calls with ``ref`` raise ``ValueError``."""
        ...

    def put(
        self,
        keys: Sequence[str],
        groups: Sequence[str],
        buffer: BufferRef,
        offsets_bytes: Sequence[int],
        sizes_bytes: Sequence[int],
    ) -> list[Status]:
        """Store ``keys[i]`` in group ``groups[i]`` from ``buffer[offsets[i] : offsets[i] + sizes[i]]``."""
        ...

    def get(
        self,
        keys: Sequence[str],
        buffer: BufferRef,
        offsets_bytes: Sequence[int],
        sizes_bytes: Sequence[int],
    ) -> list[Status]:
        """Copy each object into its range if it exists with exactly that size."""
        ...

    def exists(self, keys: Sequence[str]) -> list[bool] | None:
        """Presence of every key, or ``None`` when the pool cannot answer."""
        ...

    def remove(self, keys: Sequence[str]) -> list[Status]:
        """Delete objects: ``OK``, ``MISSING`` or ``NO_ANSWER`` per key."""
        ...

    def stats(self) -> PoolStats | None:
        """Capacity, use, keys and evictions, or ``None`` when the pool cannot answer."""
        ...

    def close(self) -> None:
        """Release the client; the pool object is unusable afterwards."""
        ...
