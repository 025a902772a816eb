"""A prefill instance's paged KV: a request holds pages for its whole prompt while in flight.

Every prefill instance's GPU prefix cache follows ``kvpool serve``'s page discipline, decided by
the same ``policy.pagecache.PageCache`` as the prefill engine's block manager
(``backend.serve.blocks``); only its size is data (``kvpool.scenario.derive
.prefill_kv_capacity_tokens``: derived from HBM, or ``serve.prefill_kv_tokens`` with
``cost.kv_capacity = "serve"``; unbounded for the trace-ceiling check).

Contract:
    * ``PrefillPages(num_pages, page_tokens, page_keys)`` per prefill instance: ``num_pages``
      pages of ``model.page_tokens`` tokens; ``page_keys`` (the world's page key space,
      ``sim.keys.KeySpace``) names the pages no other request shares.
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
    * Page keys: ``r.prompt.pages`` (``sim.prompt``: equal keys exactly when the prompts' tokens
      up to the page's end are equal, as the engine's digests of token ids). A full page past the
      prompt's full blocks (tokens the trace does not name, private to the request) gets a key of
      its own, which no other request has.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np

from kvpool.policy.pagecache import DenseKeys, PageCache
from kvpool.sim.keys import KeySpace
from kvpool.sim.request import Request


class PrefillPages:
    """One prefill instance's pages and admission queue (see the module docstring)."""

    def __init__(self, num_pages: int, page_tokens: int, page_keys: KeySpace) -> None:
        self.cache = PageCache(num_pages, DenseKeys())
        self.page_tokens = page_tokens
        self.page_keys = page_keys
        #: (request, its page keys, then, failed), first come first
        self._waiting: deque[tuple[Request, np.ndarray | None, Callable[[], None], Callable[[Request], None]]] = deque()
        self._admitting = False

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def keys(self, r: Request) -> np.ndarray:
        """The keys of ``r``'s full pages (see the module docstring)."""
        full = r.rec.in_tokens // self.page_tokens
        named = r.prompt.pages[:full]
        if named.size == full:
            return named
        return np.concatenate([named, self.page_keys.fresh(full - named.size)])

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
