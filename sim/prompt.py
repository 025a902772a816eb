"""A request's prompt, named once: its block ids, page keys and chunk group ids.

Contract:
    * ``Prompts.build(d)`` returns the ``Prompt`` of dispatch ``d`` (``workload.replay``'s
      ``Dispatch``), built once, before the request's lookup; every step reads it, none changes
      it. It carries what the simulator knows of its ids, so no step passes such knowledge on its
      own.
    * ``Prompt.blocks``: the request's block ids (``BlockStore.block_ids``). ``pages``: the keys of
      its full pages that lie within its full blocks (``model.page_tokens`` tokens each; a
      ``sim.keys`` numbering of ``policy.chunks``' chained page digests in a key space of their
      own, ``Prompts.page_keys``), so two prompts' pages have equal keys exactly when the prompts
      agree up to the page's end, as the engine's page digests of token ids; a main thread's
      prompt opens with the shared prefix's pages when the workload has one. ``groups``: the
      group ids of its keyable chunks (``sim.keys``; with a shared prefix they chain ids unique
      across scopes, ``KeySpace.block_offset``) as one ``GroupIds``: distinct (every chunk's key
      chains its whole prefix) and bounded by the key space's groups so far.
    * ``Prompt.source``/``copied``: its first ``copied`` block ids are those of the play's
      request ``source`` (``-1, 0``: none known), the latest of a thread of the same play when it
      was built; ``source`` is the thread's own previous request in the usual case (a turn
      extends its thread's last prompt).
    * ``Prompt.memory``: its thread's ``ThreadMemory``, the one place that remembers a thread:
      its latest prompt's ids (the store decompresses a later prompt's ids against every
      thread's latest) and its key chains (``keys.KeyChain``: chunks and pages). A play's
      memories go with ``forget(d)`` after its last request. A global-scope play's threads
      (Mooncake traces: every row a one-request session, ids shared by the whole workload) share
      their key chains with the same thread of every other such play: two rows' prompts share
      their leading chunks as a thread's turns do, so a row names only the chunks past its common
      prefix with the previous row, which costs what a turn does instead of naming the whole
      prompt.

Implementation: a thread's block ids live in a buffer with room to grow (``_Ids``): a prompt that
extends the list at the buffer's tip (its thread's last prompt, typically) writes only its new
ids past it, and its list is a view of the same buffer; a new buffer copies the ids it keeps. Ids
are only ever written past a tip, so every earlier prompt's list keeps its ids.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kvpool.policy.grouptable import GroupIds
from kvpool.sim.keys import SHARED_PREFIX_SCOPE, KeyChain, KeySpace


class _Ids:
    """A thread's block ids, in a buffer of which ``tip`` ids are in use."""

    __slots__ = ("blocks", "tip")

    def __init__(self, capacity: int, dtype) -> None:
        self.blocks = np.empty(capacity, dtype=dtype)
        self.tip = 0


class ThreadMemory:
    """What a thread's later prompts reuse (see the module docstring): its latest request's index
    (``-1``: none yet), block ids (a view of ``buf``) and its key chains of chunks and of pages."""

    __slots__ = ("request", "blocks", "buf", "chain", "page_chain")

    def __init__(self, chains: tuple[KeyChain, KeyChain]) -> None:
        self.request = -1
        self.blocks = np.zeros(0, dtype=np.int64)
        self.buf: _Ids | None = None
        self.chain, self.page_chain = chains


class Prompt(NamedTuple):
    """One request's prompt (see the module docstring)."""

    thread: int
    request: int  # its index in the session
    blocks: np.ndarray
    pages: np.ndarray
    groups: GroupIds
    source: int
    copied: int
    memory: ThreadMemory


class PlayPrompts:
    """A play's thread memories, and ``blocks``: per request index, the block ids of each
    thread's latest request (what the store decompresses a later prompt's ids against).
    ``chains``: the key chains (chunks, pages) its threads share with other plays, by thread
    (``None``: each thread has its own)."""

    __slots__ = ("threads", "blocks", "_latest", "_chains")

    def __init__(self, chains: dict[int, tuple[KeyChain, KeyChain]] | None = None) -> None:
        self.threads: dict[int, ThreadMemory] = {}
        self.blocks: dict[int, np.ndarray] = {}
        self._latest: dict[int, ThreadMemory] = {}  # request index -> the memory it is the latest of
        self._chains = chains

    def thread(self, thread: int) -> ThreadMemory:
        got = self.threads.get(thread)
        if got is None:
            chains = self._chains
            if chains is None:
                pair = (KeyChain(), KeyChain())
            else:
                pair = chains.get(thread)
                if pair is None:
                    pair = chains[thread] = (KeyChain(), KeyChain())
            got = self.threads[thread] = ThreadMemory(pair)
        return got

    def ids(self, store, index: int, thread: int, lists) -> tuple[np.ndarray, int, int]:
        """Request ``index``'s block ids, kept as ``thread``'s latest, and ``(r, n)``: its first
        ``n`` ids are those of kept request ``r`` (-1, 0: none). ``lists``: the store's ``lists()``."""
        pieces, r, n = store.pieces_from(index, self.blocks, lists)
        total = lists[3][index]
        src = self._latest[r] if n else None
        buf = src.buf if n else None
        if buf is None or n != src.blocks.size or buf.tip != n or buf.blocks.size < total:
            buf = _Ids(max(2 * total, 64), store.tail.dtype)  # room for the thread's next prompts
            if n:
                buf.blocks[:n] = src.blocks[:n]
        blocks, tail = buf.blocks, store.tail
        for at, start, count in pieces:  # past the tip: no list handed out covers them
            blocks[at:at + count] = tail[start:start + count]
        buf.tip = total
        mem = self.thread(thread)
        if mem.request >= 0:
            del self.blocks[mem.request], self._latest[mem.request]
        mem.request, mem.blocks, mem.buf = index, blocks[:total], buf
        self.blocks[index] = mem.blocks
        self._latest[index] = mem
        return mem.blocks, r, n


class Prompts:
    """Builds every request's ``Prompt`` (see the module docstring): chunk group ids in ``keys``,
    page keys in ``page_keys`` (a key space whose chunks are pages)."""

    def __init__(self, keys: KeySpace, page_keys: KeySpace, shared_prefix_tokens: int) -> None:
        self.keys = keys
        self.page_keys = page_keys
        self.plays: dict[int, PlayPrompts] = {}
        self._global_chains: dict[int, tuple[KeyChain, KeyChain]] = {}  # thread -> global-scope plays' chains
        self._max_block: dict[str, int] = {}  # session id -> its largest block id
        self._lists: dict[str, tuple] = {}  # session id -> its BlockStore.lists()
        # the prefix every session shares is a scope of its own among the ids keys chain (with a
        # shared prefix, chunk and page keys come from ids unique across scopes, under one chain;
        # its range taken first, so each scope's lies above it)
        self._shared_tokens = n = shared_prefix_tokens
        base = keys.block_offset(SHARED_PREFIX_SCOPE, n) if n else 0
        self._shared_key_ids = np.arange(base, base + n, dtype=np.int64)

    def play(self, d) -> PlayPrompts:
        got = self.plays.get(d.play)
        if got is None:
            got = self.plays[d.play] = PlayPrompts(None if d.scope else self._global_chains)
        return got

    def build(self, d) -> Prompt:
        """``d``'s prompt; its ids are kept as its thread's latest in ``play(d)``."""
        req, session = d.request, d.session
        bt = session.block_tokens
        max_block = self._max_block_id(session)
        lists = self._lists.get(session.id)
        if lists is None:
            lists = self._lists[session.id] = session.blocks.lists()
        play = self.play(d)
        mem = play.thread(req.thread)
        blocks, source, copied = play.ids(session.blocks, req.index, req.thread, lists)
        key_ids, chain_scope = blocks, None  # the chains of the play's own scope
        if self._shared_tokens:  # ids unique across scopes, under one chain
            key_ids = blocks.astype(np.int64)
            key_ids += self.keys.block_offset(d.scope, max_block)
            if req.thread == 0:  # the main thread's prompts open with the shared prefix
                k = min(self._shared_tokens // bt, key_ids.size)
                key_ids[:k] = self._shared_key_ids[:k]
            chain_scope = ""
        gids = self.keys.chunk_gids(d.scope, mem.chain, key_ids, bt, req.in_tokens, chain_scope=chain_scope)
        pages = self.page_keys.chunk_gids(d.scope, mem.page_chain, key_ids, bt, req.in_tokens, chain_scope=chain_scope)
        return Prompt(req.thread, req.index, blocks, pages, GroupIds(gids, self.keys.groups - 1), source, copied,
                      mem)

    def forget(self, d) -> None:
        """After a play's last request: its thread memories go (the shared key chains stay)."""
        if d.request.index == len(d.session.requests) - 1:
            self.plays.pop(d.play, None)

    def _max_block_id(self, session) -> int:
        """The largest block id a session uses (bounds its id range in the key space), memoized."""
        got = self._max_block.get(session.id)
        if got is None:
            tail = session.blocks.tail
            got = self._max_block[session.id] = int(tail.max()) if tail.size else 0
        return got
