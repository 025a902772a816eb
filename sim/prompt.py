"""A request's prompt, named once: its block ids, GPU cache blocks and chunk group ids.

Contract:
    * ``Prompts.build(d, prefill)`` returns the ``Prompt`` of dispatch ``d`` (``workload.replay``'s
      ``Dispatch``) routed to prefill instance ``prefill`` (its index), built once, before the
      request's lookup; every step reads it, none changes it. It carries what the simulator
      knows of its ids, so no step passes such knowledge on its own.
    * ``Prompt.blocks``: the request's block ids (``BlockStore.block_ids``). ``cache``: its full
      blocks in its prefill's GPU cache (``gpucache.Blocks``): each prefill names the blocks it
      meets densely (one ``sim.gpuids.CacheIds`` per prefill); a main thread's prompt opens with
      the shared prefix's own ids there when the workload has one. So a cache's arrays cover
      only the blocks it has served, not every session's ids. ``cache.max_id`` bounds them (the
      ids that cache has named so far); ``cache.lead`` is the thread's latest insert in that
      cache when it is a prefix of them (known without comparing when the prompt's ids were
      copied from that insert's request far enough, else compared). ``groups``: the group ids of
      its keyable chunks (``sim.keys``; with a shared prefix they chain ids unique across scopes,
      ``KeySpace.block_offset``) as one ``GroupIds``: distinct (every chunk's key chains its
      whole prefix) and bounded by the key space's groups so far.
    * ``Prompt.source``/``copied``: its first ``copied`` block ids are those of the play's
      request ``source`` (``-1, 0``: none known), the latest of a thread of the same play when it
      was built, and so are its GPU cache ids when ``source`` was served by the same prefill;
      ``source`` is the thread's own previous request in the usual case (a turn extends its
      thread's last prompt).
    * ``Prompt.memory``: its thread's ``ThreadMemory``, the one place that remembers a thread:
      its latest prompt's ids (the store decompresses a later prompt's ids against every
      thread's latest), its latest GPU cache insert (set by the compute step,
      ``sim.steps.gpu``) and its key chain (``keys.KeyChain``). A play's memories go with
      ``forget(d)`` after its last request. A global-scope play's threads (Mooncake traces:
      every row a one-request session, ids shared by the whole workload) share their key chain
      with the same thread of every other such play: two rows' prompts share their leading
      chunks as a thread's turns do, so a row names only the chunks past its common prefix with
      the previous row, which costs what a turn does instead of naming the whole prompt.

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

from kvpool.policy.grouptable import GroupIds
from kvpool.sim.gpucache import Blocks, LogEntry, same
from kvpool.sim.gpuids import CacheIds
from kvpool.sim.keys import SHARED_PREFIX_SCOPE, KeyChain, KeySpace


class Insert(NamedTuple):
    """A thread's latest GPU cache insert: on prefill ``prefill``, its log entry (``None``:
    an unbounded cache), for request ``request`` of the play."""

    prefill: int
    entry: LogEntry | None
    request: int


class _Ids:
    """A thread's block ids and their GPU cache ids (named by ``names``), in buffers of which
    ``tip`` ids are in use."""

    __slots__ = ("blocks", "gblocks", "names", "tip")

    def __init__(self, capacity: int, dtype, names: CacheIds) -> None:
        self.blocks = np.empty(capacity, dtype=dtype)
        self.gblocks = np.empty(capacity, dtype=np.int64)
        self.names = names
        self.tip = 0


class ThreadMemory:
    """What a thread's later prompts reuse (see the module docstring): its latest request's index
    (``-1``: none yet), block ids and GPU cache ids (views of ``buf``), its latest GPU cache
    insert and its key chain."""

    __slots__ = ("request", "blocks", "gblocks", "buf", "insert", "chain")

    def __init__(self, chain: KeyChain) -> None:
        self.request = -1
        self.blocks = self.gblocks = np.zeros(0, dtype=np.int64)
        self.buf: _Ids | None = None
        self.insert: Insert | None = None
        self.chain = chain


class Prompt(NamedTuple):
    """One request's prompt (see the module docstring)."""

    thread: int
    request: int  # its index in the session
    blocks: np.ndarray
    cache: Blocks
    groups: GroupIds
    source: int
    copied: int
    memory: ThreadMemory


class PlayPrompts:
    """A play's thread memories, and ``blocks``: per request index, the block ids of each
    thread's latest request (what the store decompresses a later prompt's ids against).
    ``chains``: the key chains its threads share with other plays, by thread (``None``: each
    thread has its own)."""

    __slots__ = ("threads", "blocks", "_latest", "_chains")

    def __init__(self, chains: dict[int, KeyChain] | None = None) -> None:
        self.threads: dict[int, ThreadMemory] = {}
        self.blocks: dict[int, np.ndarray] = {}
        self._latest: dict[int, ThreadMemory] = {}  # request index -> the memory it is the latest of
        self._chains = chains

    def thread(self, thread: int) -> ThreadMemory:
        got = self.threads.get(thread)
        if got is None:
            chains = self._chains
            if chains is None:
                chain = KeyChain()
            else:
                chain = chains.get(thread)
                if chain is None:
                    chain = chains[thread] = KeyChain()
            got = self.threads[thread] = ThreadMemory(chain)
        return got

    def ids(self, store, index: int, thread: int, names: CacheIds, scope: str, max_block: int,
            lists) -> tuple[np.ndarray, np.ndarray, int, int]:
        """Request ``index``'s block ids and GPU cache ids (by ``names``, for ``scope``, whose
        largest block id is ``max_block``), kept as ``thread``'s latest, and ``(r, n)``: its
        first ``n`` ids are those of kept request ``r`` (-1, 0: none). ``lists``: the store's
        ``lists()``."""
        pieces, r, n = store.pieces_from(index, self.blocks, lists)
        total = lists[3][index]
        src = self._latest[r] if n else None
        buf = src.buf if n else None
        fresh = n  # the first id whose cache id is not in the buffer yet
        if buf is None or n != src.blocks.size or buf.tip != n or buf.blocks.size < total or buf.names is not names:
            old = buf
            buf = _Ids(max(2 * total, 64), store.tail.dtype, names)  # room for the thread's next prompts
            if n:
                buf.blocks[:n] = src.blocks[:n]
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
        mem = self.thread(thread)
        if mem.request >= 0:
            del self.blocks[mem.request], self._latest[mem.request]
        mem.request, mem.blocks, mem.gblocks, mem.buf = index, blocks[:total], gblocks[:total], buf
        self.blocks[index] = mem.blocks
        self._latest[index] = mem
        return mem.blocks, mem.gblocks, r, n


class Prompts:
    """Builds every request's ``Prompt`` (see the module docstring)."""

    def __init__(self, keys: KeySpace, shared_prefix_tokens: int) -> None:
        self.keys = keys
        self.plays: dict[int, PlayPrompts] = {}
        self._global_chains: dict[int, KeyChain] = {}  # thread -> the key chain of global-scope plays
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
            got = self.plays[d.play] = PlayPrompts(None if d.scope else self._global_chains)
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
        play = self.play(d)
        mem = play.thread(req.thread)
        last = mem.insert  # the thread's latest insert before this prompt
        blocks, gblocks, source, copied = play.ids(session.blocks, req.index, req.thread, names, d.scope,
                                                   max_block, lists)
        if self._shared_tokens:
            key_ids = blocks.astype(np.int64)
            key_ids += self.keys.block_offset(d.scope, max_block)
            if req.thread == 0:  # the main thread's prompts open with the shared prefix
                gblocks = gblocks.copy()  # (the kept ids stay the plain ones other threads copy)
                k = min(self._shared_tokens // bt, gblocks.size)
                gblocks[:k] = shared_gpu_ids[:k]
                key_ids[:k] = self._shared_key_ids[:k]
            gids = self.keys.chunk_gids(d.scope, mem.chain, key_ids, bt, req.in_tokens, chain_scope="")
        else:
            gids = self.keys.chunk_gids(d.scope, mem.chain, blocks, bt, req.in_tokens)
        ids = gblocks[:min(gblocks.size, req.in_tokens // bt)]
        lead = None
        if last is not None and last.prefill == prefill and last.entry is not None:
            e = last.entry
            k = e.ids.size
            if k <= ids.size and ((last.request == source and k <= copied) or same(e.ids, ids[:k])):
                lead = e
        return Prompt(req.thread, req.index, blocks, Blocks(ids, names.size - 1, lead),
                      GroupIds(gids, self.keys.groups - 1), source, copied, mem)

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
        """After a play's last request: its thread memories go (the shared key chains stay)."""
        if d.request.index == len(d.session.requests) - 1:
            self.plays.pop(d.play, None)

    def _max_block_id(self, session) -> int:
        """The largest block id a session uses (bounds its id range in the GPU cache), memoized."""
        got = self._max_block.get(session.id)
        if got is None:
            tail = session.blocks.tail
            got = self._max_block[session.id] = int(tail.max()) if tail.size else 0
        return got
