"""The embedded pool's arena: one block of host memory allocated once, cut into extents.

Contract:
    * ``Arena(size_bytes, pinned)`` maps ``size_bytes`` of anonymous memory once (``mmap``; pages
      are committed on first touch). With ``pinned=True`` it page-locks the whole block for the
      GPU (``cudaHostRegister`` through torch, portable flag, so any device's copy engine can
      read it); when registration fails the arena stays plain memory and ``pinned`` says so.
      ``pinned=None`` pins when torch is already imported and reports a GPU (so a process that
      never touches a GPU never imports torch here). ``close()`` unregisters and unmaps.
    * ``ExtentAllocator`` hands out byte ranges of the arena. ``alloc_batch(sizes)`` places a batch
      (one put, one save window) as one contiguous run in batch order when a free extent holds
      it, else each object in one extent (best fit), else an object in several extents; it
      returns ``None`` only when the free bytes are fewer than the batch needs. ``free`` merges
      neighbours, so a batch freed whole becomes one extent again.
    * ``Copier(threads)`` runs a list of ``memmove``s, splitting large ones across threads
      (``ctypes.memmove`` releases the GIL), and returns when every byte is copied.

Nothing here imports torch unless ``pinned`` asks for it.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

CUDA_HOST_REGISTER_PORTABLE = 1
COPY_PIECE_BYTES = 8 << 20  # a memmove larger than this is split across the copier's threads

Piece = tuple[int, int]  # (arena offset, bytes)


def gpu_present() -> bool:
    """Whether torch is already imported and sees a GPU (CUDA or ROCm); never imports torch."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # a broken driver is "no GPU" for the arena's purpose
        return False


class Arena:
    """``size_bytes`` of host memory, pinned for the GPU when asked and possible."""

    def __init__(self, size_bytes: int, pinned: bool | None = None) -> None:
        if size_bytes <= 0:
            raise ValueError(f"arena size must be > 0 bytes, got {size_bytes}")
        flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20) | getattr(mmap, "MAP_NORESERVE", 0)
        self.size_bytes = size_bytes
        self.buffer = mmap.mmap(-1, size_bytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.buffer))
        self.pinned = False
        self.pin_error = ""
        if pinned is None:
            pinned = gpu_present()
        if pinned:
            self._pin()

    def _pin(self) -> None:
        try:
            import torch

            rc = torch.cuda.cudart().cudaHostRegister(self.address, self.size_bytes, CUDA_HOST_REGISTER_PORTABLE)
            if int(rc) != 0:
                self.pin_error = f"cudaHostRegister returned {int(rc)}"
                return
            self.pinned = True
        except Exception as e:  # no GPU runtime: plain memory
            self.pin_error = f"{type(e).__name__}: {e}"

    def close(self) -> None:
        """Unregister (if pinned) and unmap. Views still held elsewhere keep the mapping alive."""
        if self.pinned:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.address)
            self.pinned = False
        try:
            self.buffer.close()
        except BufferError:  # a tensor or memoryview still views the arena: the GC unmaps it later
            pass


class ExtentAllocator:
    """Free byte ranges of ``[0, size_bytes)``; not thread-safe (the pool's lock guards it)."""

    def __init__(self, size_bytes: int) -> None:
        self.size_bytes = size_bytes
        self._starts: list[int] = [0]  # sorted starts of free extents
        self._len: dict[int, int] = {0: size_bytes}
        self.free_bytes = size_bytes

    @property
    def free_extents(self) -> int:
        return len(self._starts)

    def _take(self, start: int, nbytes: int) -> None:
        """Take ``nbytes`` from the front of the free extent at ``start``."""
        length = self._len.pop(start)
        i = bisect.bisect_left(self._starts, start)
        if length == nbytes:
            del self._starts[i]
        else:
            self._starts[i] = start + nbytes
            self._len[start + nbytes] = length - nbytes
        self.free_bytes -= nbytes

    def _first_fit(self, nbytes: int) -> int | None:
        for s in self._starts:
            if self._len[s] >= nbytes:
                return s
        return None

    def _best_fit(self, nbytes: int) -> int | None:
        best, best_len = None, 0
        for s in self._starts:
            n = self._len[s]
            if n >= nbytes and (best is None or n < best_len):
                best, best_len = s, n
                if n == nbytes:
                    break
        return best

    def alloc_batch(self, sizes_bytes: Sequence[int]) -> list[tuple[Piece, ...]] | None:
        """Pieces of each object of a batch (see the module docstring), or ``None`` if it cannot fit."""
        total = sum(sizes_bytes)
        if total > self.free_bytes:
            return None
        run = self._first_fit(total)
        if run is not None:
            self._take(run, total)
            out, off = [], run
            for n in sizes_bytes:
                out.append(((off, n),))
                off += n
            return out
        out = []
        for n in sizes_bytes:
            s = self._best_fit(n)
            if s is not None:
                self._take(s, n)
                out.append(((s, n),))
                continue
            pieces, left = [], n  # split over the lowest free extents (total free >= left holds)
            while left:
                s = self._starts[0]
                take = min(left, self._len[s])
                self._take(s, take)
                pieces.append((s, take))
                left -= take
            out.append(tuple(pieces))
        return out

    def free(self, pieces: Sequence[Piece]) -> None:
        """Return pieces to the free list, merging with free neighbours."""
        for start, nbytes in pieces:
            i = bisect.bisect_left(self._starts, start)
            if i < len(self._starts) and self._starts[i] < start + nbytes:
                raise ValueError(f"double free of arena range [{start}, +{nbytes})")
            if i > 0 and self._starts[i - 1] + self._len[self._starts[i - 1]] > start:
                raise ValueError(f"double free of arena range [{start}, +{nbytes})")
            self.free_bytes += nbytes
            if i < len(self._starts) and self._starts[i] == start + nbytes:  # merge the right neighbour
                nbytes += self._len.pop(self._starts[i])
                del self._starts[i]
            if i > 0 and self._starts[i - 1] + self._len[self._starts[i - 1]] == start:  # and the left one
                self._len[self._starts[i - 1]] += nbytes
            else:
                self._starts.insert(i, start)
                self._len[start] = nbytes


class Copier:
    """``memmove`` batches, large copies split across ``threads`` (the GIL is released in memmove)."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = max(1, threads if threads is not None else min(8, os.cpu_count() or 1))
        self._exec = ThreadPoolExecutor(self.threads, thread_name_prefix="kvpool-arena-copy") if self.threads > 1 else None

    def run(self, copies: Sequence[tuple[int, int, int]]) -> None:
        """Copy each ``(dst_address, src_address, nbytes)``."""
        total = sum(n for _, _, n in copies)
        if self._exec is None or total < 2 * COPY_PIECE_BYTES:
            for dst, src, n in copies:
                ctypes.memmove(dst, src, n)
            return
        pieces = []
        for dst, src, n in copies:
            for o in range(0, n, COPY_PIECE_BYTES):
                pieces.append((dst + o, src + o, min(COPY_PIECE_BYTES, n - o)))
        per = -(-len(pieces) // self.threads)
        futs = [self._exec.submit(_memmove_all, pieces[i : i + per]) for i in range(0, len(pieces), per)]
        for f in futs:
            f.result()

    def close(self) -> None:
        if self._exec is not None:
            self._exec.shutdown(wait=True)
            self._exec = None


def _memmove_all(pieces: Sequence[tuple[int, int, int]]) -> None:
    for dst, src, n in pieces:
        ctypes.memmove(dst, src, n)
