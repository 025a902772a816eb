"""Registered buffers: host memory a pool may read from and write to, and batch validation.

Contract:
    * ``buffer_address`` turns a bytearray, a writable C-contiguous numpy array or a contiguous
      CPU torch tensor into ``(address, size_bytes)`` without importing torch or numpy.
    * ``BufferRegistry`` keeps each registered object alive until it is unregistered, rejects
      overlapping registrations (as Mooncake does, -600) and answers whether a ``BufferRef``
      belongs to it.
    * ``check_batch`` validates a whole batch before anything moves.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections.abc import Sequence
from typing import Any

from kvpool.backend.pool.api import BufferRef


def buffer_address(buffer: Any) -> tuple[int, int]:
    """``(address, size_bytes)`` of host memory; ``ValueError`` for anything not registrable.

    Accepted: ``bytearray``, a writable C-contiguous numpy array, a contiguous torch tensor on the
    CPU (duck-typed through ``data_ptr``). Rejected: ``bytes`` (read-only), non-contiguous views,
    GPU tensors, empty buffers.
    """
    if isinstance(buffer, bytearray):
        if not buffer:
            raise ValueError("cannot register an empty bytearray")
        return ctypes.addressof((ctypes.c_char * len(buffer)).from_buffer(buffer)), len(buffer)
    if hasattr(buffer, "data_ptr") and hasattr(buffer, "element_size"):  # torch.Tensor
        device = getattr(buffer, "device", None)
        if device is not None and getattr(device, "type", "cpu") != "cpu":
            raise ValueError(f"only CPU tensors can be registered with this pool, got one on {device}")
        if not buffer.is_contiguous():
            raise ValueError("a tensor must be contiguous to be registered")
        size = buffer.numel() * buffer.element_size()
        if size == 0:
            raise ValueError("cannot register an empty tensor")
        return int(buffer.data_ptr()), int(size)
    if hasattr(buffer, "__array_interface__"):  # numpy.ndarray
        flags = buffer.flags
        if not flags["C_CONTIGUOUS"] or not flags["WRITEABLE"]:
            raise ValueError("a numpy array must be C-contiguous and writable to be registered")
        if buffer.nbytes == 0:
            raise ValueError("cannot register an empty array")
        return int(buffer.__array_interface__["data"][0]), int(buffer.nbytes)
    raise ValueError(
        f"cannot register a {type(buffer).__name__}: use a bytearray, a writable numpy array "
        "or a contiguous CPU torch tensor"
    )


class BufferRegistry:
    """The buffers registered with one pool (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._by_id: dict[int, tuple[BufferRef, Any]] = {}

    def add(self, buffer: Any) -> BufferRef:
        """Register ``buffer``; ``ValueError`` if it overlaps a registered one."""
        address, size = buffer_address(buffer)
        with self._lock:
            for ref, _ in self._by_id.values():
                if address < ref.address + ref.size_bytes and ref.address < address + size:
                    raise ValueError(
                        f"buffer [{address:#x}, +{size}) overlaps a registered buffer "
                        f"[{ref.address:#x}, +{ref.size_bytes}); register one arena and use ranges in it"
                    )
            ref = BufferRef(address=address, size_bytes=size, buffer_id=next(self._ids))
            self._by_id[ref.buffer_id] = (ref, buffer)
            return ref

    def remove(self, ref: BufferRef) -> None:
        """Forget ``ref``; ``ValueError`` if it is not registered here."""
        with self._lock:
            self._check(ref)
            del self._by_id[ref.buffer_id]

    def check(self, ref: BufferRef) -> None:
        """``ValueError`` unless ``ref`` is registered here."""
        with self._lock:
            self._check(ref)

    def _check(self, ref: BufferRef) -> None:
        entry = self._by_id.get(ref.buffer_id)
        if entry is None or entry[0] != ref:
            raise ValueError(f"buffer {ref} is not registered with this pool")

    def all(self) -> list[BufferRef]:
        with self._lock:
            return [ref for ref, _ in self._by_id.values()]


def check_batch(
    keys: Sequence[str],
    offsets_bytes: Sequence[int],
    sizes_bytes: Sequence[int],
    buffer: BufferRef,
    groups: Sequence[str] | None = None,
) -> None:
    """Validate a batch before anything moves: equal lengths (of ``groups`` too, for a put),
    non-empty keys, ranges inside the buffer."""
    if groups is not None and len(groups) != len(keys):
        raise ValueError(f"{len(keys)} keys but {len(groups)} group ids")
    if not (len(keys) == len(offsets_bytes) == len(sizes_bytes)):
        raise ValueError(
            f"keys, offsets and sizes differ in length: {len(keys)}, {len(offsets_bytes)}, {len(sizes_bytes)}"
        )
    for key, offset, size in zip(keys, offsets_bytes, sizes_bytes):
        if not isinstance(key, str) or not key:
            raise ValueError(f"keys must be non-empty strings, got {key!r}")
        buffer.check_range(offset, size)
