"""A request's prompt, named once: its block ids, GPU cache ids and chunk group ids.

Contract:
    * ``Prompts.build(d, prefill)`` returns the ``Prompt`` of dispatch ``d`` (``workload.replay``'s
      ``Dispatch``) routed to prefill instance ``prefill`` (its index), built once, before the
      request's lookup; every step reads it, none changes it.
    * ``Prompt.blocks``: the request's block ids (``BlockStore.block_ids``). ``gpu_ids``: the ids
      of its full blocks in its prefill's GPU cache: each prefill names the blocks it meets
      densely (one ``sim.gpuids.CacheIds`` per prefill); a main thread's prompt opens with the
      shared prefix's own ids there when the workload has one. So a cache's arrays cover only
      the blocks it has served, not every session's ids. ``gids``: the group ids of its keyable
      chunks (``sim.keys``; with a shared prefix they chain ids unique across scopes,
      ``KeySpace.block_offset``), distinct (every chunk's key chains its whole prefix). ``max_gpu_id`` and ``max_gid`` bound them
      (the ids that cache has named so far; the key space's groups so far).
    * ``Prompt.source``/``copied``: its first ``copied`` block ids are those of the play's
      request ``source`` (``-1, 0``: none known), the latest of a thread of the same play when it
      was built, and so are its GPU cache ids when ``source`` was served by the same prefill;
      ``source`` is the thread's own previous request in the usual case (a turn extends its
      thread's last prompt).
    * Per play, the latest prompt of each thread is kept (the store decompresses a later
      prompt's ids against them) until ``forget(d)`` after the play's last request, together with
      each thread's latest GPU cache insert (``PlayPrompts.inserts``, set by the compute step).

Implementation: a thread's block ids and GPU cache ids live in buffers with room to grow
(``_Ids``, its GPU cache ids in one cache's names): a prompt that extends the list at a buffer's
tip (its thread's last prompt, typically, on the same prefill) writes only its new ids past it,
and its lists are views of the same buffers; a new buffer copies the ids it keeps, and their
cache ids when they are of the same cache (else it names them again). Ids are only ever written
past a tip, so every earlier prompt's lists keep their ids.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kvpool.sim.gpucache import LogEntry
from kvpool.sim.gpuids import CacheIds
from kvpool.sim.keys import SHARED_PREFIX_SCOPE, KeySpace


class Prompt(NamedTuple):
    """One request's prompt (see the module docstring)."""

    thread: int
    request: int  # its index in the session
    blocks: np.ndarray
    gpu_ids: np.ndarray
    gids: np.ndarray
    max_gpu_id: int
    max_gid: int
    source: int
    copied: int


class _Ids:
    """A thread's block ids and their GPU cache ids (named by ``names``), in buffers of which
    ``tip`` ids are in use."""

    __slots__ = ("blocks", "gblocks", "names", "tip")

    def __init__(self, capacity: int, dtype, names: CacheIds) -> None:
        self.blocks = np.empty(capacity, dtype=dtype)
        self.gblocks = np.empty(capacity, dtype=np.int64)
        self.names = names
        self.tip = 0


class PlayPrompts:
    """What a play's later prompts reuse: per thread its latest request's ids (by request index,
    with the buffers they are views of) and its latest GPU cache insert."""

    __slots__ = ("blocks", "gblocks", "bufs", "last_request", "inserts")

    def __init__(self) -> None:
        self.blocks: dict[int, np.ndarray] = {}  # request index -> block ids
        self.gblocks: dict[int, np.ndarray] = {}  # request index -> GPU cache ids
        self.bufs: dict[int, _Ids] = {}  # request index -> the buffers of its lists
        self.last_request: dict[int, int] = {}  # thread -> request index
        #: thread -> (prefill index, the log entry of its latest GPU cache insert, its request index)
        self.inserts: dict[int, tuple[int, LogEntry | None, int]] = {}

    def ids(self, store, index: int, thread: int, names: CacheIds, scope: str, max_block: int,
            lists) -> tuple[np.ndarray, np.ndarray, int, int]:
        """Request ``index``'s block ids and GPU cache ids (by ``names``, for ``scope``, whose
        largest block id is ``max_block``), kept as ``thread``'s latest, and ``(r, n)``: its
        first ``n`` ids are those of kept request ``r`` (-1, 0: none). ``lists``: the store's
        ``lists()``."""
        pieces, r, n = store.pieces_from(index, self.blocks, lists)
        total = lists[3][index]
        src = self.blocks.get(r) if n else None
        buf = self.bufs.get(r) if n else None
        fresh = n  # the first id whose cache id is not in the buffer yet
        if buf is None or n != src.size or buf.tip != n or buf.blocks.size < total or buf.names is not names:
            old = buf
            buf = _Ids(max(2 * total, 64), store.tail.dtype, names)  # room for the thread's next prompts
            if n:
                buf.blocks[:n] = src[:n]
                if old.names is names:  # its cache ids hold here too
                    buf.gblocks[:n] = old.gblocks[:n]
                else:
                    fresh = 0
        blocks, gblocks, tail = buf.blocks, buf.gblocks, store.tail
        for at, start, count in pieces:  # past the tip: no list handed out covers them
            blocks[at:at + count] = tail[start:start + count]
        if fresh < total:  # the new ids' cache ids, in one call
            names.ids(scope, max_block, blocks[fresh:total], gblocks[fresh:total])
        buf.tip = total
        blocks, gblocks = blocks[:total], gblocks[:total]
        old_index = self.last_request.get(thread)
        if old_index is not None:
            self.blocks.pop(old_index, None)
            self.gblocks.pop(old_index, None)
            self.bufs.pop(old_index, None)
        self.blocks[index] = blocks
        self.gblocks[index] = gblocks
        self.bufs[index] = buf
        self.last_request[thread] = index
        return blocks, gblocks, r, n


class Prompts:
    """Builds every request's ``Prompt`` (see the module docstring)."""

    def __init__(self, keys: KeySpace, shared_prefix_tokens: int) -> None:
        self.keys = keys
        self.plays: dict[int, PlayPrompts] = {}
        self._max_block: dict[str, int] = {}  # session id -> its largest block id
        self._lists: dict[str, tuple] = {}  # session id -> its BlockStore.lists()
        #: per prefill index: its GPU cache's names and the shared prefix's ids there
        self._gpu: dict[int, tuple[CacheIds, np.ndarray]] = {}
        # the prefix every session shares is a scope of its own, in each GPU cache and among the
        # ids chunk keys chain (with a shared prefix, chunk keys come from ids unique across
        # scopes, under one chain; its range taken first, so each scope's lies above it)
        self._shared_tokens = n = shared_prefix_tokens
        base = keys.block_offset(SHARED_PREFIX_SCOPE, n) if n else 0
        self._shared_key_ids = np.arange(base, base + n, dtype=np.int64)

    def play(self, d) -> PlayPrompts:
        got = self.plays.get(d.play)
        if got is None:
            got = self.plays[d.play] = PlayPrompts()
        return got

    def build(self, d, prefill: int) -> Prompt:
        """``d``'s prompt on prefill ``prefill``; its ids are kept as its thread's latest in ``play(d)``."""
        req, session = d.request, d.session
        bt = session.block_tokens
        max_block = self._max_block_id(session)
        names, shared_gpu_ids = self._gpu_names(prefill)
        lists = self._lists.get(session.id)
        if lists is None:
            lists = self._lists[session.id] = session.blocks.lists()
        blocks, gblocks, source, copied = self.play(d).ids(session.blocks, req.index, req.thread, names, d.scope,
                                                           max_block, lists)
        if self._shared_tokens:
            key_ids = blocks.astype(np.int64)
            key_ids += self.keys.block_offset(d.scope, max_block)
            if req.thread == 0:  # the main thread's prompts open with the shared prefix
                gblocks = gblocks.copy()  # (the kept ids stay the plain ones other threads copy)
                k = min(self._shared_tokens // bt, gblocks.size)
                gblocks[:k] = shared_gpu_ids[:k]
                key_ids[:k] = self._shared_key_ids[:k]
            gids = self.keys.chunk_gids(d.scope, req.thread, key_ids, bt, req.in_tokens, chain_scope="")
        else:
            gids = self.keys.chunk_gids(d.scope, req.thread, blocks, bt, req.in_tokens)
        full_blocks = min(gblocks.size, req.in_tokens // bt)
        return Prompt(req.thread, req.index, blocks, gblocks[:full_blocks], gids, names.size - 1,
                      self.keys.groups - 1, source, copied)

    def _gpu_names(self, prefill: int) -> tuple[CacheIds, np.ndarray]:
        """Prefill ``prefill``'s GPU cache names and the shared prefix's ids there."""
        got = self._gpu.get(prefill)
        if got is None:
            names, n = CacheIds(), self._shared_tokens
            shared = np.empty(n, dtype=np.int64)
            if n:
                names.ids(SHARED_PREFIX_SCOPE, n - 1, np.arange(n), shared)
            got = self._gpu[prefill] = (names, shared)
        return got

    def forget(self, d) -> None:
        """After a play's last request: its key scope and kept prompts go."""
        if d.request.index == len(d.session.requests) - 1:
            if d.scope:
                self.keys.forget_scope(d.scope)
            self.plays.pop(d.play, None)

    def _max_block_id(self, session) -> int:
        """The largest block id a session uses (bounds its id range in the GPU cache), memoized."""
        got = self._max_block.get(session.id)
        if got is None:
            tail = session.blocks.tail
            got = self._max_block[session.id] = int(tail.max()) if tail.size else 0
        return got
