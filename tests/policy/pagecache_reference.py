"""A page-by-page reference of ``policy.pagecache.PageCache``'s contract (dictionaries and an
ordered LRU, one page at a time), for the differential test: the array implementation must
decide exactly as this one does."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field


@dataclass
class ReferenceAllocation:
    """One request's pages: ``block_ids[k]`` holds its page ``k``; ``keys`` names its full pages."""

    block_ids: list[int]
    keys: Sequence[Hashable]
    hit_pages: int  # leading pages reused from the cache
    committed: bool = False
    released: bool = False
    cached: list[bool] = field(default_factory=list)  # per page: this allocation's page is in the cache


class ReferencePageCache:
    """Pages, reference counts, the prefix cache and its LRU (see the module docstring)."""

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be > 0, got {num_pages}")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() gives 0, 1, 2, ...
        self._refs = [0] * num_pages
        self._by_key: dict[Hashable, int] = {}
        self._key_of: dict[int, Hashable] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced pages, oldest first
        self._held = 0
        self.evictions = 0

    # -- queries ---------------------------------------------------------------------------
    @property
    def held_pages(self) -> int:
        """Pages referenced by a request now."""
        return self._held

    @property
    def cached_pages(self) -> int:
        """Pages in the cache (referenced or not)."""
        return len(self._by_key)

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def cached_prefix(self, keys: Sequence[Hashable], limit: int) -> int:
        """Leading keys the cache holds, at most ``limit``."""
        k, n = 0, min(max(0, limit), len(keys))
        by_key = self._by_key
        while k < n and keys[k] in by_key:
            k += 1
        return k

    def is_evictable(self, page: int) -> bool:
        """Whether ``page`` is cached and unreferenced (the next allocations may evict it)."""
        return page in self._lru

    # -- allocation ------------------------------------------------------------------------
    def allocate(self, keys: Sequence[Hashable], pages: int, limit: int) -> ReferenceAllocation | None:
        if pages > self.num_pages:
            raise ValueError(f"{pages} pages needed, {self.num_pages} exist")
        hit = min(self.cached_prefix(keys, limit), max(0, pages))
        hit_pages = [self._by_key[k] for k in keys[:hit]]
        need = pages - hit
        lru = self._lru
        evictable = len(lru) - sum(1 for b in hit_pages if b in lru)
        if need > len(self._free) + evictable:
            return None
        for b in hit_pages:  # referenced first, so the rest cannot evict them
            self._ref(b)
        fresh = [self._take() for _ in range(need)]
        return ReferenceAllocation(hit_pages + fresh, keys, hit, cached=[True] * hit + [False] * need)

    def _ref(self, b: int) -> None:
        if self._refs[b] == 0:
            self._lru.pop(b, None)
            self._held += 1
        self._refs[b] += 1

    def _take(self) -> int:
        if self._free:
            b = self._free.pop()
        else:
            b, _ = self._lru.popitem(last=False)
            del self._by_key[self._key_of.pop(b)]
            self.evictions += 1
        self._refs[b] = 1
        self._held += 1
        return b

    def commit(self, alloc: ReferenceAllocation, full_pages: int) -> int:
        if alloc.released:
            raise ValueError("the allocation was released")
        entered = 0
        for k in range(alloc.hit_pages, min(len(alloc.keys), len(alloc.block_ids), full_pages)):
            key, b = alloc.keys[k], alloc.block_ids[k]
            if alloc.cached[k] or key in self._by_key:
                continue
            self._by_key[key] = b
            self._key_of[b] = key
            alloc.cached[k] = True
            entered += 1
        alloc.committed = True
        return entered

    def release(self, alloc: ReferenceAllocation) -> None:
        if alloc.released:
            return
        alloc.released = True
        for b in reversed(alloc.block_ids):  # the tail is evicted first
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._held -= 1
                if b in self._key_of:
                    self._lru[b] = None
                else:
                    self._free.append(b)

    def clear_cache(self) -> int:
        """Forget every unreferenced cached page (they return to the free list); returns how many."""
        n = 0
        while self._lru:
            b, _ = self._lru.popitem(last=False)
            del self._by_key[self._key_of.pop(b)]
            self._free.append(b)
            n += 1
        return n


