"""The prefill engine's block manager: page ids shared by every stage, and the GPU prefix cache.

Contract:
    * ``num_blocks`` pages of ``page_tokens`` tokens; every stage holds its layers of page ``b`` at
      index ``b`` of its caches (one block table serves all stages, as one KV cache manager drives
      every pipeline stage).
    * A full page is named by a chained digest (``policy.chunks.digests_from_tokens`` with
      ``chunk_tokens = page_tokens`` under the engine's seed), so equal digests mean equal prefixes.
    * ``allocate(token_ids)``: the longest run of leading full pages the cache holds is reused
      (referenced; at most ``(n - 1) // page_tokens`` pages, so the last token is always computed),
      the other pages come from the free list, then from evicting the least recently used cached
      page that no request references. ``None`` when the pages cannot be found now (the caller
      waits for releases); ``ValueError`` when the prompt can never fit.
    * ``commit(alloc)``: the request's computed full pages enter the cache (a page whose digest is
      already cached by another request stays private and is freed on release).
    * ``release(alloc)``: drop the request's references; unreferenced cached pages join the LRU
      (most recent last, a request's pages from its last to its first, so a prefix loses its tail
      before its head: what is left of it still hits), unreferenced private pages the free list.
    * No torch: page ids are ints.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpool.policy.chunks import digests_from_tokens


@dataclass
class Allocation:
    """One request's pages: ``block_ids[k]`` holds tokens ``k*P .. k*P + P - 1``."""

    block_ids: list[int]
    digests: list[bytes]            # digests of the prompt's full pages
    hit_pages: int                  # leading pages reused from the cache
    committed: bool = False
    released: bool = False
    cached: list[bool] = field(default_factory=list)  # per page: this allocation's page is in the cache


class BlockManager:
    """Pages, reference counts, the prefix cache and its LRU (see the module docstring)."""

    def __init__(self, num_blocks: int, page_tokens: int, seed: bytes) -> None:
        if num_blocks <= 0 or page_tokens <= 0:
            raise ValueError("num_blocks and page_tokens must be > 0")
        self.num_blocks = num_blocks
        self.page_tokens = page_tokens
        self.seed = seed
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives 0, 1, 2, ...
        self._refs = [0] * num_blocks
        self._by_digest: dict[bytes, int] = {}
        self._digest_of: dict[int, bytes] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced pages
        self.evictions = 0

    # -- queries ---------------------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.page_tokens

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_tokens)

    @property
    def used_blocks(self) -> int:
        """Pages referenced by a request now."""
        return sum(1 for r in self._refs if r)

    @property
    def cached_blocks(self) -> int:
        return len(self._by_digest)

    def page_digests(self, token_ids: Sequence[int]) -> list[bytes]:
        return list(digests_from_tokens(token_ids, self.page_tokens, self.seed))

    def cached_prefix_pages(self, digests: Sequence[bytes], n_tokens: int) -> int:
        limit = max(0, (n_tokens - 1) // self.page_tokens)
        k = 0
        while k < min(limit, len(digests)) and digests[k] in self._by_digest:
            k += 1
        return k

    # -- allocation ------------------------------------------------------------------------
    def allocate(self, token_ids: Sequence[int]) -> Allocation | None:
        n = len(token_ids)
        pages = self.pages_for(n)
        if pages > self.num_blocks:
            raise ValueError(f"a prompt of {n} tokens needs {pages} pages; the prefill KV holds "
                             f"{self.num_blocks} ({self.capacity_tokens} tokens, serve.prefill_kv_tokens)")
        digests = self.page_digests(token_ids)
        hit = self.cached_prefix_pages(digests, n)
        hit_blocks = [self._by_digest[d] for d in digests[:hit]]
        # reuse first (so the hit pages are not evicted to make room for the rest)
        need = pages - hit
        evictable = len(self._lru) - sum(1 for b in hit_blocks if b in self._lru)
        if need > len(self._free) + evictable:
            return None
        for b in hit_blocks:
            self._ref(b)
        fresh = [self._take() for _ in range(need)]
        return Allocation(hit_blocks + fresh, digests, hit, cached=[True] * hit + [False] * need)

    def _ref(self, b: int) -> None:
        if self._refs[b] == 0:
            self._lru.pop(b, None)
        self._refs[b] += 1

    def _take(self) -> int:
        if self._free:
            b = self._free.pop()
        else:
            b, _ = self._lru.popitem(last=False)
            del self._by_digest[self._digest_of.pop(b)]
            self.evictions += 1
        self._refs[b] = 1
        return b

    def commit(self, alloc: Allocation, computed_tokens: int) -> int:
        """Put the allocation's full pages below ``computed_tokens`` into the cache; returns how many entered."""
        if alloc.released:
            raise ValueError("the allocation was released")
        entered = 0
        full = min(len(alloc.digests), computed_tokens // self.page_tokens)
        for k in range(alloc.hit_pages, full):
            d, b = alloc.digests[k], alloc.block_ids[k]
            if alloc.cached[k] or d in self._by_digest:
                continue
            self._by_digest[d] = b
            self._digest_of[b] = d
            alloc.cached[k] = True
            entered += 1
        alloc.committed = True
        return entered

    def release(self, alloc: Allocation) -> None:
        if alloc.released:
            return
        alloc.released = True
        for b in reversed(alloc.block_ids):  # the tail is evicted first
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._digest_of:
                    self._lru[b] = None
                else:
                    self._free.append(b)

    def clear_cache(self) -> int:
        """Forget every unreferenced cached page (they return to the free list); returns how many."""
        n = 0
        while self._lru:
            b, _ = self._lru.popitem(last=False)
            del self._by_digest[self._digest_of.pop(b)]
            self._free.append(b)
            n += 1
        return n
