"""A prefill instance's paged KV and its GPU prefix cache: which pages a request holds, which stay cached, which go.

One implementation of the page discipline of ``kvpool serve``'s prefill engine: its block manager
(``backend.serve.blocks``) and the simulator's prefill instances (``sim.steps.pages``) both
decide through ``PageCache``.

Contract:
    * ``num_pages`` pages, named ``0 .. num_pages - 1`` (vLLM's block ids). A page is free, held
      (referenced by at least one request in flight) or cached and unreferenced (in the LRU).
    * A request names its prompt's full pages by keys, distinct within one prompt, equal keys
      meaning equal prefixes (chained digests, ``policy.chunks``). A page's key is known once the
      page is committed; the cache maps keys to pages through its key index: ``HashKeys`` (any
      hashable keys, the engine's digests; the default) or ``DenseKeys`` (non-negative integer
      keys in a NumPy array, the simulator's page group ids). Both give the same decisions for
      the same equalities between keys.
    * ``allocate(keys, pages, limit)``: the request's hit is the longest run of leading keys the
      cache holds, at most ``limit`` (the caller's rule: the last prompt token is always
      computed); those pages are referenced (a cached page is a hit whether or not another
      request holds it now). The other ``pages - hit`` pages come from the free list (a page
      freed last is taken first; pages never used, lowest id first, after every freed one), then
      by evicting the least recently released cached page that no request references; a hit page
      is never evicted for its own request. ``None`` when the pages cannot be found now (nothing
      changes: the caller waits for releases); ``ValueError`` when ``pages > num_pages`` (the
      prompt can never fit).
    * ``commit(alloc, full_pages)``: the allocation's pages ``hit .. full_pages - 1`` enter the
      cache under their keys; a page whose key the cache holds already (committed by another
      request meanwhile) stays private and is freed on release. Returns how many entered.
    * ``release(alloc)`` (once; later calls do nothing): the allocation's references drop;
      pages nobody references any more go to the LRU when cached (most recent last, a request's
      pages from its last to its first, so a prefix loses its tail before its head and what is
      left of it still hits) and to the free list otherwise.
    * ``clear_cache()`` forgets every unreferenced cached page (they become free).
    * Nothing here reads a clock: the order of calls is the only time.

Implementation: a request's pages are handled as arrays, so its cost grows with its pages only
through NumPy operations (a 100K-token prompt has 6,250 pages of 16 tokens). Per-page state lives
in arrays that grow with the pages ever used (``num_pages`` may be far larger than what a run
touches: the simulator's unbounded cache). The free list is a stack over the pages freed so far
above the pages never used. The LRU is a log of pages in release order: a page's live entry is
the one its ``_lru_at`` points to, so a hit drops the page from the LRU by clearing that mark,
and eviction reads the log from its oldest end, skipping entries no longer live.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

_NONE = -1  # no page / no LRU entry / no key


class HashKeys:
    """Key index for any hashable keys (a dictionary each way)."""

    def __init__(self) -> None:
        self._page_of: dict[Hashable, int] = {}
        self._key_of: dict[int, Hashable] = {}

    def __len__(self) -> int:
        return len(self._page_of)

    def leading_pages(self, keys: Sequence[Hashable], n: int) -> np.ndarray:
        """The pages of the run of held keys from the first, at most ``n``."""
        out: list[int] = []
        page_of = self._page_of
        for k in range(n):
            page = page_of.get(keys[k])
            if page is None:
                break
            out.append(page)
        return np.asarray(out, dtype=np.int64)

    def pages_of(self, keys: Sequence[Hashable]) -> np.ndarray:
        """Each key's page (``-1``: not held)."""
        get = self._page_of.get
        return np.fromiter((get(k, _NONE) for k in keys), dtype=np.int64, count=len(keys))

    def put(self, keys: Sequence[Hashable], pages: np.ndarray) -> None:
        for key, page in zip(keys, pages.tolist()):
            self._page_of[key] = page
            self._key_of[page] = key

    def drop_pages(self, pages: np.ndarray) -> None:
        for page in pages.tolist():
            del self._page_of[self._key_of.pop(page)]

    def holds_pages(self, pages: np.ndarray) -> np.ndarray:
        """Whether each page is cached under a key."""
        key_of = self._key_of
        return np.fromiter((p in key_of for p in pages.tolist()), dtype=bool, count=pages.size)


class DenseKeys:
    """Key index for non-negative integer keys (NumPy arrays in, arrays out).

    A key's entry lives in a span of ``SPAN_KEYS`` consecutive keys, allocated the first time a
    key of the span is stored, so the memory follows the keys this cache has held (keys come in
    runs: a prompt's new pages are numbered one after another), not the largest key of a key
    space that many caches share. Every span never met points at span 0, which is never written
    (all ``-1``), so a lookup is two gathers whatever it asks about.
    """

    SPAN_BITS = 8
    SPAN_KEYS = 1 << SPAN_BITS
    _EMPTY_SPAN = 0  # the entries of every span never met: no key held

    def __init__(self) -> None:
        self._span_at = np.full(64, self._EMPTY_SPAN, dtype=np.int64)  # by key >> SPAN_BITS: its span's first entry
        self._page_of = np.full(self.SPAN_KEYS, _NONE, dtype=np.int64)  # by entry: the page of its key (-1: none)
        self._spans = 1  # spans allocated in _page_of, the empty one included
        self._key_of = np.full(1024, _NONE, dtype=np.int64)  # by page
        self._held = 0

    def __len__(self) -> int:
        return self._held

    def leading_pages(self, keys: np.ndarray, n: int) -> np.ndarray:
        pages = self.pages_of(keys[:n])
        if not pages.size or pages.min() >= 0:
            return pages
        return pages[: int((pages < 0).argmax())]

    def _entries(self, keys: np.ndarray, meet: bool = False) -> np.ndarray:
        """Each key's entry in ``_page_of`` (in the empty span where its span was never met, or with
        ``meet`` its span allocated now)."""
        span = keys >> self.SPAN_BITS
        try:
            at = self._span_at[span]
        except IndexError:  # a span past every one met so far
            self._span_at = _grown(self._span_at, int(span.max()) + 1, self._EMPTY_SPAN)
            at = self._span_at[span]
        if meet and at.size and at.min() == self._EMPTY_SPAN:  # spans never met
            new = np.unique(span[at == self._EMPTY_SPAN])
            self._span_at[new] = (self._spans + np.arange(new.size)) * self.SPAN_KEYS
            self._spans += new.size
            self._page_of = _grown(self._page_of, self._spans * self.SPAN_KEYS)
            at = self._span_at[span]
        at += keys & (self.SPAN_KEYS - 1)
        return at

    def pages_of(self, keys: np.ndarray) -> np.ndarray:
        return self._page_of[self._entries(np.asarray(keys, dtype=np.int64))]

    def put(self, keys: np.ndarray, pages: np.ndarray) -> None:
        keys = np.asarray(keys, dtype=np.int64)
        if not keys.size:
            return
        entries = self._entries(keys, meet=True)  # (may grow _page_of)
        self._page_of[entries] = pages
        self._key_of = _grown(self._key_of, int(pages.max()) + 1)
        self._key_of[pages] = keys
        self._held += keys.size

    def drop_pages(self, pages: np.ndarray) -> None:
        self._page_of[self._entries(self._key_of[pages])] = _NONE
        self._key_of[pages] = _NONE
        self._held -= pages.size

    def holds_pages(self, pages: np.ndarray) -> np.ndarray:
        if pages.size:  # the array by page covers every page asked about (-1: no key)
            self._key_of = _grown(self._key_of, int(pages.max()) + 1)
        return self._key_of[pages] >= 0


def _grown(a: np.ndarray, size: int, fill: int = _NONE) -> np.ndarray:
    """``a``, or a copy at least ``size`` long (at least twice as long) filled with ``fill`` past it."""
    if size <= a.size:
        return a
    out = np.full(max(size, 2 * a.size), fill, dtype=a.dtype)
    out[: a.size] = a
    return out


@dataclass
class PageAllocation:
    """One request's pages: ``pages[k]`` holds its page ``k``; ``keys`` names its full pages."""

    pages: np.ndarray
    keys: Sequence[Hashable]
    hit_pages: int  # leading pages reused from the cache
    cached: np.ndarray  # per page: this allocation's page is in the cache
    committed: bool = False
    released: bool = False

    @property
    def block_ids(self) -> list[int]:
        """The page ids as a list (block tables, messages)."""
        return self.pages.tolist()


class PageCache:
    """Pages, reference counts, the prefix cache and its LRU (see the module docstring)."""

    def __init__(self, num_pages: int, keys: HashKeys | DenseKeys | None = None) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be > 0, got {num_pages}")
        self.num_pages = num_pages
        self._keys = HashKeys() if keys is None else keys
        self._used = 0  # pages 0 .. _used - 1 have been taken at least once
        self._refs = np.zeros(0, dtype=np.int32)  # by page, for the pages used
        self._lru_at = np.zeros(0, dtype=np.int64)  # by page: its live entry in the log, or -1
        self._freed = np.zeros(64, dtype=np.int64)  # stack of freed pages, the top last
        self._nfreed = 0
        self._log = np.zeros(64, dtype=np.int64)  # LRU log: pages in release order
        self._log_head = 0  # entries before it are no longer live
        self._log_tail = 0
        self._lru = 0  # cached, unreferenced pages
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
        return len(self._keys)

    @property
    def free_pages(self) -> int:
        return self._nfreed + self.num_pages - self._used

    def cached_prefix(self, keys: Sequence[Hashable], limit: int) -> int:
        """Leading keys the cache holds, at most ``limit``."""
        return int(self._keys.leading_pages(keys, min(max(0, limit), len(keys))).size)

    def is_evictable(self, page: int) -> bool:
        """Whether ``page`` is cached and unreferenced (the next allocations may evict it)."""
        return page < self._used and self._lru_at[page] >= 0

    # -- allocation ------------------------------------------------------------------------
    def allocate(self, keys: Sequence[Hashable], pages: int, limit: int) -> PageAllocation | None:
        if pages > self.num_pages:
            raise ValueError(f"{pages} pages needed, {self.num_pages} exist")
        hit_pages = self._keys.leading_pages(keys, min(max(0, limit), len(keys), max(0, pages)))
        hit = int(hit_pages.size)
        need = pages - hit
        refs = self._refs[hit_pages]
        unreferenced = refs == 0  # hit pages in the LRU
        in_lru = int(np.count_nonzero(unreferenced))
        if need > self.free_pages + self._lru - in_lru:
            return None
        # referenced first, so the rest cannot evict them (a hit page is unreferenced unless shared)
        self._lru_at[hit_pages if in_lru == hit else hit_pages[unreferenced]] = _NONE
        self._lru -= in_lru
        self._held += in_lru
        self._refs[hit_pages] = refs + 1
        fresh = self._take(need)
        cached = np.zeros(pages, dtype=bool)
        cached[:hit] = True
        return PageAllocation(np.concatenate([hit_pages, fresh]), keys, hit, cached)

    def _take(self, n: int) -> np.ndarray:
        """``n`` pages, referenced once: freed ones (the last freed first), then never used ones,
        then evicted ones (the least recently released first)."""
        k = min(n, self._nfreed)
        freed = self._freed[self._nfreed - k : self._nfreed][::-1].copy()
        self._nfreed -= k
        m = min(n - k, self.num_pages - self._used)
        unused = np.arange(self._used, self._used + m, dtype=np.int64)
        self._use(self._used + m)
        evicted = self._evict(n - k - m)
        taken = np.concatenate([freed, unused, evicted])
        self._refs[taken] = 1
        self._held += n
        return taken

    def _use(self, used: int) -> None:
        """Pages below ``used`` have been taken at least once (their state arrays exist)."""
        self._used = used
        self._refs = _grown(self._refs, used, 0)
        self._lru_at = _grown(self._lru_at, used)

    def _evict(self, n: int) -> np.ndarray:
        """The ``n`` least recently released cached, unreferenced pages, taken out of the cache."""
        out: list[np.ndarray] = []
        while n:
            head, tail = self._log_head, self._log_tail
            end = min(tail, head + max(2 * n, 4096))
            at = np.arange(head, end)
            window = self._log[head:end]
            live = at[self._lru_at[window] == at][:n]
            self._log_head = int(live[-1]) + 1 if live.size == n else end
            out.append(self._log[live])
            n -= live.size
        if not out:
            return np.zeros(0, dtype=np.int64)
        evicted = np.concatenate(out)
        self._lru_at[evicted] = _NONE
        self._lru -= evicted.size
        self._keys.drop_pages(evicted)
        self.evictions += evicted.size
        return evicted

    def commit(self, alloc: PageAllocation, full_pages: int) -> int:
        if alloc.released:
            raise ValueError("the allocation was released")
        end = min(len(alloc.keys), alloc.pages.size, full_pages)
        entered = 0
        if end > alloc.hit_pages:
            first = alloc.hit_pages
            keys = alloc.keys[first:end]
            new = ~alloc.cached[first:end] & (self._keys.pages_of(keys) < 0)
            if new.all():  # the usual case: no other request committed these keys meanwhile
                self._keys.put(keys, alloc.pages[first:end])
                alloc.cached[first:end] = True
                entered = end - first
            elif new.any():
                chosen = np.flatnonzero(new) + first
                self._keys.put(keys[new] if isinstance(keys, np.ndarray) else [keys[i - first] for i in chosen],
                               alloc.pages[chosen])
                alloc.cached[chosen] = True
                entered = int(chosen.size)
        alloc.committed = True
        return entered

    def release(self, alloc: PageAllocation) -> None:
        if alloc.released:
            return
        alloc.released = True
        pages = alloc.pages[::-1]  # the tail is evicted first
        refs = self._refs
        refs[pages] -= 1
        unreferenced = refs[pages] == 0
        gone = pages if unreferenced.all() else pages[unreferenced]  # (all, unless a page is shared)
        self._held -= gone.size
        cached = self._keys.holds_pages(gone)
        self._to_lru(gone[cached])
        self._to_free(gone[~cached])

    def _to_lru(self, pages: np.ndarray) -> None:
        if self._log_tail + pages.size > self._log.size:
            self._compact_log(pages.size)
        at = np.arange(self._log_tail, self._log_tail + pages.size)
        self._log[self._log_tail : self._log_tail + pages.size] = pages
        self._lru_at[pages] = at
        self._log_tail += pages.size
        self._lru += pages.size

    def _compact_log(self, room: int) -> None:
        """Keep only the log's live entries, with room for ``room`` more."""
        at = np.arange(self._log_head, self._log_tail)
        window = self._log[self._log_head : self._log_tail]
        live = window[self._lru_at[window] == at]
        size = max(self._log.size, 2 * (live.size + room))
        self._log = np.zeros(size, dtype=np.int64)
        self._log[: live.size] = live
        self._lru_at[live] = np.arange(live.size)
        self._log_head, self._log_tail = 0, live.size

    def _to_free(self, pages: np.ndarray) -> None:
        self._freed = _grown(self._freed, self._nfreed + pages.size, 0)
        self._freed[self._nfreed : self._nfreed + pages.size] = pages
        self._nfreed += pages.size

    def clear_cache(self) -> int:
        """Forget every unreferenced cached page (they return to the free list); returns how many."""
        evicted = self._evict(self._lru)
        self.evictions -= evicted.size  # forgotten, not evicted for a request
        self._to_free(evicted)
        return int(evicted.size)


__all__ = ["DenseKeys", "HashKeys", "PageAllocation", "PageCache"]
