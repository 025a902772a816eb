"""One GPU prefix cache's names for the blocks it meets: dense ids, allocated page by page.

Contract:
    * ``CacheIds().ids(scope, max_id, blocks, out)`` writes into ``out`` the cache ids of block
      ids ``blocks`` of ``scope`` (each ``<= max_id``): two blocks get the same cache id exactly
      when they are the same block of the same scope. A local scope's ids are ``0 .. max_id`` as
      first given, the global scope's (``""``, Mooncake traces) ``keys.GLOBAL_SCOPE_IDS``, as in
      ``keys.IdRanges``; a ``max_id`` past the scope's last page is an error.
    * Ids are allocated from 0 in pages of ``PAGE_IDS`` consecutive block ids of one scope, the
      first time a block of that page is met; ``size`` bounds every id handed out. A cache's
      arrays by id (``sim.gpucache``) are then as long as the pages its prompts touched, not as
      every session's ids: with N servers a thread's requests meet many prefills, and each of
      them holds only what it served.
    * A scope's page table holds one entry per ``PAGE_IDS`` of its ids.

Which page gets which ids follows the order pages are met, so ids differ from one cache to
another; the cache's decisions depend only on which ids are equal, never on their values.
"""

from __future__ import annotations

import numpy as np

from kvpool.sim.keys import GLOBAL_SCOPE_IDS

PAGE_BITS = 8
PAGE_IDS = 1 << PAGE_BITS  # block ids per page
_NOT_MET = np.iinfo(np.int64).min  # the shift of a page not met yet (below every real one)


class CacheIds:
    """See the module docstring. Per scope, a page table holds each met page's shift: its first
    cache id minus its first block id (``_NOT_MET`` before), so a block's cache id is the block
    id plus its page's shift."""

    __slots__ = ("_pages", "size")

    def __init__(self) -> None:
        self._pages: dict[str, np.ndarray] = {}  # scope -> the shift of each page (_NOT_MET: not met)
        self.size = 0

    def ids(self, scope: str, max_id: int, blocks: np.ndarray, out: np.ndarray) -> None:
        """Write the cache ids of ``blocks`` (block ids of ``scope``) into ``out`` (int64, as long)."""
        pages = self._pages.get(scope)
        if pages is None:
            ids = GLOBAL_SCOPE_IDS if not scope else max_id + 1
            pages = self._pages[scope] = np.full(((ids - 1) >> PAGE_BITS) + 1, _NOT_MET, dtype=np.int64)
        if max_id >> PAGE_BITS >= pages.size:
            raise ValueError(f"block id {max_id} beyond the {pages.size * PAGE_IDS} ids of scope {scope!r}")
        page = np.right_shift(blocks, PAGE_BITS, dtype=np.intp, casting="unsafe")  # (intp: a plain gather)
        shift = pages[page]
        if shift.size and shift.min() == _NOT_MET:  # pages met for the first time get the next ids
            self._meet(pages, page[shift == _NOT_MET])
            shift = pages[page]
        np.add(blocks, shift, out=out, dtype=np.int64, casting="unsafe")  # (any integer ids, no float)

    def _meet(self, pages: np.ndarray, new: np.ndarray) -> None:
        """Give the pages in ``new`` (not met yet, each maybe more than once) the next ids."""
        lo = int(new.min())
        if lo == new.max():  # one page (the usual case: a prompt growing into its next page)
            pages[lo] = self.size - (lo << PAGE_BITS)
            self.size += PAGE_IDS
            return
        mark = np.arange(-2, -2 - new.size, -1, dtype=np.int64)
        pages[new] = mark  # one mark stays per page (the write that came last)
        first = new[pages[new] == mark].astype(np.int64)  # each page once
        pages[first] = self.size + ((np.arange(first.size, dtype=np.int64) - first) << PAGE_BITS)
        self.size += int(first.size) << PAGE_BITS
