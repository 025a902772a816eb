"""The prefill's paged KV in serve mode: a request holds pages for its whole prompt while in flight.

With ``cost.kv_capacity = "serve"`` (and a bounded world) every prefill instance's GPU prefix
cache follows ``kvpool serve``'s page discipline, decided by the same ``policy.pagecache.PageCache``
as the prefill engine's block manager (``backend.serve.blocks``):

Contract:
    * ``PrefillPages(num_pages, page_tokens)`` per prefill instance: ``serve.prefill_kv_tokens //
      page_tokens`` pages of ``model.page_tokens`` tokens.
    * ``admit(r, then)``: ``r`` joins the instance's admission queue (first come, first served);
      when it reaches the head and its pages can be found (``PageCache.allocate`` of its page
      keys, ``pages_for(in_tokens)`` pages, at most ``(in_tokens - 1) // page_tokens`` leading
      pages reused), ``r.pages`` is set and ``then()`` runs (its lookup). Until then it waits,
      and so does every request behind it. A prompt of more pages than the instance holds fails
      (``rec.error = "prefill_kv"``, ``failed(r)``), as the engine answers 413.
    * ``gpu_tokens(r)``: the tokens its reused pages hold (``hit_pages x page_tokens``).
    * ``commit(r)``: after its compute, its full pages enter the cache.
    * ``release(r)``: after its hand-off and its save have ended (or when it fails), its pages are
      given back (unreferenced cached pages become evictable) and the queue's head is tried again.
    * ``cancel(r)``: a failed request leaves the queue; ``False`` when it was not waiting.
    * Page keys: a page is named by the chained digest (``policy.chunks.digests_from_blocks``
      with ``chunk_tokens = page_tokens``) of the prompt's full blocks in its prefill's cache
      names (``r.prompt.cache``): equal keys exactly when the prompts' tokens up to the page's end
      are equal, as the engine's digests of token ids. A full page past the prompt's full blocks
      (tokens the trace does not name, private to the request) gets a key of its own, which no
      other request has.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable

from kvpool.policy.chunks import digests_from_blocks
from kvpool.policy.pagecache import PageCache
from kvpool.sim.request import Request

_SEED = bytes(16)  # the chain's seed: one cache's names are its own, so one seed serves every cache


class PrefillPages:
    """One prefill instance's pages and admission queue (see the module docstring)."""

    def __init__(self, num_pages: int, page_tokens: int) -> None:
        self.cache = PageCache(num_pages)
        self.page_tokens = page_tokens
        #: (request, its page keys, then, failed), first come first
        self._waiting: deque[tuple[Request, list[Hashable] | None, Callable[[], None], Callable[[Request], None]]] = deque()
        self._private = 0  # keys of pages no other request shares
        self._admitting = False

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def keys(self, r: Request) -> list[Hashable]:
        """The keys of ``r``'s full pages (see the module docstring)."""
        P = self.page_tokens
        blocks = r.prompt.cache
        bt = r.d.session.block_tokens
        full = r.rec.in_tokens // P
        ids = blocks.ids
        keys: list[Hashable] = list(digests_from_blocks(ids, bt, int(ids.size) * bt, P, _SEED)[:full]) if ids.size else []
        while len(keys) < full:
            self._private += 1
            keys.append(self._private)
        return keys

    def admit(self, r: Request, then: Callable[[], None], failed: Callable[[Request], None]) -> None:
        fits = -(-r.rec.in_tokens // self.page_tokens) <= self.cache.num_pages
        self._waiting.append((r, self.keys(r) if fits else None, then, failed))
        self._admit()

    def _admit(self) -> None:
        if self._admitting:  # a request admitted here released pages: the outer loop goes on
            return
        self._admitting = True
        try:
            while self._waiting:
                r, keys, then, failed = self._waiting[0]
                if keys is None:  # more pages than the instance holds
                    self._waiting.popleft()
                    failed(r)
                    continue
                n = r.rec.in_tokens
                alloc = self.cache.allocate(keys, -(-n // self.page_tokens), max(0, (n - 1) // self.page_tokens))
                if alloc is None:
                    return
                self._waiting.popleft()
                r.pages = alloc
                then()
        finally:
            self._admitting = False

    def gpu_tokens(self, r: Request) -> int:
        return r.pages.hit_pages * self.page_tokens

    def commit(self, r: Request) -> None:
        self.cache.commit(r.pages, r.rec.in_tokens // self.page_tokens)

    def release(self, r: Request) -> None:
        if r.pages is None or r.pages.released:
            return
        self.cache.release(r.pages)
        self._admit()

    def cancel(self, r: Request) -> bool:
        for i, w in enumerate(self._waiting):
            if w[0] is r:
                del self._waiting[i]
                if i == 0:  # it may have kept the next ones out
                    self._admit()
                return True
        return False
