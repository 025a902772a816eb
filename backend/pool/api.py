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

Optional capability, ``Reachable`` (the Mooncake pool): ``reachable() -> bool`` says, at once (or
after one bounded probe), whether calls would reach the pool's master now; ``False`` means a call
would answer ``NO_ANSWER`` / ``None`` without trying, so a caller can skip the work that precedes
it (packing a save).

Optional capability, ``ArenaPool`` (the embedded pool): a pool that holds its objects in one host
arena may lend them in place instead of copying them into a registered buffer:
    * ``lease_read(keys, sizes)`` is one read call (as ``get``): per key ``OK`` / ``MISSING`` /
      ``WRONG_SIZE``, and for the ``OK`` keys the arena ranges holding their bytes. The bytes stay
      valid until ``ArenaRead.release()`` (an object evicted or removed meanwhile keeps its bytes
      until then); the caller copies them out (host memcpy, host -> device DMA) and releases.
    * ``reserve_write(keys, groups, sizes)`` is one put (as ``put``: the same outcomes, the same
      evictions) that returns the arena ranges to fill for the keys it stores. Those objects read
      as ``MISSING`` until ``ArenaWrite.commit()``; ``abort()`` removes them again.
    * Ranges are ``ArenaPiece(arena_offset_bytes, dense_offset_bytes, nbytes)``: bytes
      ``[dense, dense + nbytes)`` of the batch laid out densely (object ``i`` at the sum of the
      sizes before it) live at ``arena[arena_offset : + nbytes]``. Pieces come sorted by dense
      offset, and neighbours contiguous on both sides are merged, so a batch placed in one run
      is a single piece.
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


@dataclass(frozen=True)
class ArenaPiece:
    """Bytes ``[dense_offset, + nbytes)`` of a dense batch at ``arena[arena_offset : + nbytes]``."""

    arena_offset_bytes: int
    dense_offset_bytes: int
    nbytes: int


class ArenaRead:
    """The outcome of ``ArenaPool.lease_read``: statuses, pieces, and the lease to release."""

    def __init__(self, statuses: list[Status], pieces: list[ArenaPiece], release: Any) -> None:
        self.statuses = statuses
        self.pieces = pieces
        self._release = release

    def release(self) -> None:
        """End the lease (idempotent); the pieces' bytes may be reused afterwards."""
        if self._release is not None:
            release, self._release = self._release, None
            release()


class ArenaWrite:
    """The outcome of ``ArenaPool.reserve_write``: statuses, pieces to fill, then commit or abort."""

    def __init__(self, statuses: list[Status], pieces: list[ArenaPiece], finish: Any) -> None:
        self.statuses = statuses
        self.pieces = pieces
        self._finish = finish

    def commit(self) -> None:
        """The pieces hold the objects' bytes: make them readable (idempotent)."""
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish(True)

    def abort(self) -> None:
        """The bytes were not written: remove the reserved objects (idempotent)."""
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish(False)


@runtime_checkable
class ArenaPool(Protocol):
    """A pool whose objects live in one host arena and can be lent in place (module docstring)."""

    @property
    def arena_buffer(self) -> Any:
        """The arena as a writable buffer (``torch.frombuffer`` views it without a copy)."""
        ...

    @property
    def arena_pinned(self) -> bool:
        """Whether the arena is page-locked for GPU copies."""
        ...

    def lease_read(self, keys: Sequence[str], sizes_bytes: Sequence[int]) -> ArenaRead: ...

    def reserve_write(self, keys: Sequence[str], groups: Sequence[str], sizes_bytes: Sequence[int]) -> ArenaWrite: ...


@runtime_checkable
class Reachable(Protocol):
    """A pool that knows when its master is lost (module docstring)."""

    def reachable(self) -> bool: ...


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
