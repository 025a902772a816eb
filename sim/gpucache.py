"""The prefill GPU prefix cache of one prefill instance, at trace-block granularity.

Contract:
    * Entries are the workload's blocks (64 tokens for Weka traces, a multiple of the 16-token
      page), named by global integer block ids (``sim.keys`` interns per-session ids).
    * ``hit_blocks(ids, now)``: the longest run of leading blocks held; those blocks count as used now.
    * ``insert(ids, now)``: after a prefill, the prompt's full blocks are held. When the cache
      exceeds its capacity, least recently used blocks go first, and among blocks used at the same
      moment the deepest ones (a prefix loses its tail first), until ``evict_fraction`` of the
      capacity is free; the blocks being inserted are never victims.
    * Capacity is in tokens (``None``: unbounded, the trace-ceiling check); it holds
      ``capacity_tokens // block_tokens`` blocks of the first workload it sees.
"""

from __future__ import annotations

import numpy as np

from kvpool.policy.grouptable import IdList


class GPUPrefixCache:
    def __init__(self, capacity_tokens: int | None, *, evict_fraction: float = 0.05, initial: int = 1 << 16) -> None:
        if capacity_tokens is not None and capacity_tokens < 0:
            raise ValueError(f"capacity_tokens must be >= 0, got {capacity_tokens}")
        self.capacity_tokens = capacity_tokens
        self.capacity_blocks: int | None = None
        self.evict_fraction = evict_fraction
        self.held = np.zeros(initial, dtype=bool)
        self._last = np.zeros(initial, dtype=np.float64)
        self._depth = np.zeros(initial, dtype=np.int32)
        self.blocks = 0
        self.evicted_blocks = 0
        self._resident = IdList()  # ids held (plus stale ones until the next evict)
        self._listed = np.zeros(initial, dtype=bool)  # whether an id is in _resident

    def _grow(self, max_id: int) -> None:
        n = len(self.held)
        if max_id < n:
            return
        new = max(max_id + 1, 2 * n)
        self.held = np.concatenate([self.held, np.zeros(new - n, dtype=bool)])
        self._last = np.concatenate([self._last, np.zeros(new - n)])
        self._depth = np.concatenate([self._depth, np.zeros(new - n, dtype=np.int32)])
        self._listed = np.concatenate([self._listed, np.zeros(new - n, dtype=bool)])

    def hit_blocks(self, ids: np.ndarray, now: float) -> int:
        """Leading blocks of ``ids`` held; they count as used now."""
        if not ids.size:
            return 0
        self._grow(int(ids.max()))
        held = self.held[ids]
        miss = np.flatnonzero(~held)
        run = int(miss[0]) if miss.size else int(ids.size)
        if run:
            self._last[ids[:run]] = now
        return run

    def insert(self, ids: np.ndarray, now: float, block_tokens: int) -> None:
        """Hold ``ids`` (a prompt's full blocks, in order) as used now; evict if over capacity."""
        if not ids.size:
            return
        if self.capacity_tokens is not None and self.capacity_blocks is None:
            self.capacity_blocks = self.capacity_tokens // block_tokens
        self._grow(int(ids.max()))
        if self.capacity_blocks is not None and ids.size > self.capacity_blocks:
            ids = ids[: self.capacity_blocks]
        new = ~self.held[ids]
        self.blocks += int(new.sum())
        if self.capacity_blocks is not None:
            joining = ids[new & ~self._listed[ids]]
            self._listed[joining] = True
            self._resident.extend(joining)
        self.held[ids] = True
        self._last[ids] = now
        self._depth[ids] = np.arange(ids.size, dtype=np.int32)
        if self.capacity_blocks is not None and self.blocks > self.capacity_blocks:
            self._evict(protect=ids)

    def _evict(self, protect: np.ndarray) -> None:
        cap = self.capacity_blocks or 0
        target = self.blocks - cap + int(cap * self.evict_fraction)
        alive = self.held[self._resident.view()]
        self._listed[self._resident.keep(alive)] = False  # drop stale entries
        cand = self._resident.view()
        # The blocks being inserted were used just now, so LRU reaches them last; exclude them
        # only when the pass would otherwise take them.
        now = self._last[protect[0]]
        is_older = self._last[cand] < now
        if target < int(is_older.sum()):
            cand = cand[is_older]
        else:
            keep = np.zeros(len(self.held), dtype=bool)
            keep[protect] = True
            cand = cand[~keep[cand]]
        k = max(0, min(target, cand.size))
        if k == 0:
            return
        # LRU, deepest first among blocks used at the same moment (depth < 1e6 blocks, so the
        # tie-break stays below the float resolution of distinct times that matter).
        key = self._last[cand] - self._depth[cand] * 1e-9
        victims = cand[np.argpartition(key, k - 1)[:k]] if k < cand.size else cand
        self.held[victims] = False
        self.blocks -= int(victims.size)
        self.evicted_blocks += int(victims.size)
