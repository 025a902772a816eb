"""The prefill engine's block manager: page ids shared by every stage, and the GPU prefix cache.

Contract:
    * ``num_blocks`` pages of ``page_tokens`` tokens; every stage holds its layers of page ``b`` at
      index ``b`` of its caches (one block table serves all stages, as one KV cache manager drives
      every pipeline stage).
    * A full page is named by a chained digest (``policy.chunks.digests_from_tokens`` with
      ``chunk_tokens = page_tokens`` under the engine's seed), so equal digests mean equal prefixes.
    * The page discipline is ``policy.pagecache.PageCache``'s (the simulator's prefill instances decide
      through the same class): ``allocate(token_ids)`` reuses the longest run of leading full
      pages the cache holds (at most ``(n - 1) // page_tokens`` pages, so the last token is always
      computed), takes the other pages from the free list, then by evicting the least recently
      released cached page that no request references; ``None`` when the pages cannot be found
      now (the caller waits for releases); ``ValueError`` when the prompt can never fit.
    * ``commit(alloc, computed_tokens)``: the request's computed full pages enter the cache (a page
      whose digest is already cached by another request stays private and is freed on release).
    * ``release(alloc)``: drop the request's references; unreferenced cached pages join the LRU
      (most recent last, a request's pages from its last to its first, so a prefix loses its tail
      before its head: what is left of it still hits), unreferenced private pages the free list.
    * No torch: page ids are ints.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.policy.chunks import digests_from_tokens
from kvpool.policy.pagecache import PageAllocation, PageCache

#: One request's pages: ``block_ids[k]`` holds tokens ``k*P .. k*P + P - 1``; ``keys`` are its full pages' digests.
Allocation = PageAllocation


class BlockManager:
    """Pages, reference counts, the prefix cache and its LRU (see the module docstring)."""

    def __init__(self, num_blocks: int, page_tokens: int, seed: bytes) -> None:
        if num_blocks <= 0 or page_tokens <= 0:
            raise ValueError("num_blocks and page_tokens must be > 0")
        self.num_blocks = num_blocks
        self.page_tokens = page_tokens
        self.seed = seed
        self.pages = PageCache(num_blocks)

    # -- queries ---------------------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.page_tokens

    @property
    def evictions(self) -> int:
        return self.pages.evictions

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_tokens)

    @property
    def used_blocks(self) -> int:
        """Pages referenced by a request now."""
        return self.pages.held_pages

    @property
    def cached_blocks(self) -> int:
        return self.pages.cached_pages

    def page_digests(self, token_ids: Sequence[int]) -> list[bytes]:
        return list(digests_from_tokens(token_ids, self.page_tokens, self.seed))

    def hit_limit(self, n_tokens: int) -> int:
        """The most leading pages a prompt of ``n_tokens`` may reuse: its last token is computed."""
        return max(0, (n_tokens - 1) // self.page_tokens)

    def cached_prefix_pages(self, digests: Sequence[bytes], n_tokens: int) -> int:
        return self.pages.cached_prefix(digests, self.hit_limit(n_tokens))

    # -- allocation ------------------------------------------------------------------------
    def allocate(self, token_ids: Sequence[int]) -> Allocation | None:
        n = len(token_ids)
        pages = self.pages_for(n)
        if pages > self.num_blocks:
            raise ValueError(f"a prompt of {n} tokens needs {pages} pages; the prefill KV holds "
                             f"{self.num_blocks} ({self.capacity_tokens} tokens, serve.prefill_kv_tokens)")
        return self.pages.allocate(self.page_digests(token_ids), pages, self.hit_limit(n))

    def commit(self, alloc: Allocation, computed_tokens: int) -> int:
        """Put the allocation's full pages below ``computed_tokens`` into the cache; returns how many entered."""
        return self.pages.commit(alloc, computed_tokens // self.page_tokens)

    def release(self, alloc: Allocation) -> None:
        self.pages.release(alloc)

    def clear_cache(self) -> int:
        """Forget every unreferenced cached page (they return to the free list); returns how many."""
        return self.pages.clear_cache()
