"""Names for what the simulator caches: block ids unique across scopes and chunk group ids (pool).

Contract:
    * ``IdRanges`` shifts block ids of a play whose hash scope is local (Weka traces: small
      per-session ints) into a dense range of their own per scope, in the order scopes are first
      met, so different sessions and different plays of one session never share an id;
      global-scope ids (scope ``""``, Mooncake traces) share one range of ``GLOBAL_SCOPE_IDS``.
      The key space's (``KeySpace.block_offset``) names blocks for chunk chains across scopes
      (a shared prefix, below); each GPU cache names its blocks itself (``sim.gpuids``).
    * Chunk group ids are a numbering of the policy core's chunk keys, made without hashing:
      two chunks get the same group id exactly when ``policy.chunks.digests_from_blocks`` under
      ``chain_seed(namespace, chain scope)`` gives them the same digest (BLAKE2b-128 collisions
      aside; why, and where it is tested: below). Ids are small integers, numbered first seen,
      for ``policy.grouptable``. ``KeySpace`` holds the numbering only; what a thread named
      last is its caller's ``KeyChain`` (``sim.prompt.ThreadMemory`` holds one per thread), so a
      request names only the chunks past its common prefix with the chain's previous prompt.
    * A prefix common to every session (``workload.shared_prefix_tokens``: one product's tool
      definitions) gets one range of block ids of its own (scope ``SHARED_PREFIX_SCOPE``); the
      simulator then keys every chunk from global ids under one chain (``chain_scope=""``), so
      chunks made only of shared blocks are the same object in every session and no others are.

Why the numbering equals the digests: a chunk's digest is ``BLAKE2b(parent digest || head ||
payload)`` (``policy.chunks.block_pieces``), where the parent digest has a fixed length and the
head (``block_head``) is five bytes fixed by the block size. So, collisions aside, two chunks have
equal digests exactly when their parents' digests, their block sizes and their payloads are equal.
A chain's first chunk has the seed for parent, ``chain_seed(namespace, chain scope)``, hashed
under another personalization (never a chunk's digest); one key space has one namespace, so two
seeds are equal exactly when their chain scopes are, and the key space gives each (chain scope,
block size) one root id (negative, never a group id). Every chunk of a chain has its root's block
size. By induction along the chain, then, (the parent's group id, the payload) is fixed by the
digest and fixes it: that pair is a chunk's name, and one name gets one group id.
``tests/sim/test_chunk_identity.py`` checks the equivalence over replays of real traces driven
through the engine (AgentX sessions with subagents and replayed plays, a shared prefix, Mooncake
rows): every served request's group ids against the digests of its blocks, a bijection over the
whole replay. ``tests/sim/test_keys.py`` checks the ids against a numbering of the digests for
generated prompts (blocks of whole chunks, chunks inside a block, and neither).

Implementation: once a chunk is new, every later chunk of the prompt is new as well (its parent
is), so a request looks up its chunks only until the first miss and numbers the rest in one step.
Where the names live: a chunk numbered right after its parent (``gid == parent + 1``, every chunk
of a new run but its first, unless it continues the newest run) is found through two arrays, its
parent and its payload by group id (payloads of one size: blocks of whole chunks or chunks inside
a block); the others (a run's first chunk, payloads of varying size) in a dictionary keyed by
parent id and payload bytes.
"""

from __future__ import annotations

import numpy as np

from kvpool.policy.chunks import block_pieces

_PIECE_BYTES = 16  # one block piece in a chain payload (policy.chunks)

_NONE = -(1 << 62)  # no parent in the arrays (roots are small negative ids)
GLOBAL_SCOPE_IDS = 1 << 24  # block ids reserved for global-scope (Mooncake) ids
#: The scope of the block ids of the prefix every session shares (no trace scope starts with NUL).
SHARED_PREFIX_SCOPE = "\0shared-prefix"


def _name(parent: int, payload: bytes) -> bytes:
    """A chunk's key in the dictionary of group ids: its parent's group id (i8) and payload."""
    return parent.to_bytes(8, "little", signed=True) + payload


class KeyChain:
    """One thread's last prompt under one chain: its key block ids and chunk group ids, which
    ``KeySpace.chunk_gids`` reads and replaces. The group ids are a view of ``buf``, whose first
    ``tip`` entries have been handed out (views of them may still be in use): a request that
    keeps all of them writes its new ids past the tip, in place, and anything else gets a new
    buffer, so no id handed out ever changes. A chain is only ever passed with one chain scope
    and block size (its group ids are names under that root)."""

    __slots__ = ("blocks", "gids", "buf", "tip")

    def __init__(self) -> None:
        self.blocks = self.gids = self.buf = np.zeros(0, dtype=np.int64)
        self.tip = 0


class IdRanges:
    """Dense ranges of block ids, one per scope, allocated in first-met order from 0: a local
    scope's range holds its ids ``0 .. max_id`` (``max_id`` as first given), the global scope's
    ``GLOBAL_SCOPE_IDS`` ids. ``size``: the ids allocated so far."""

    __slots__ = ("_ranges", "size")

    def __init__(self) -> None:
        self._ranges: dict[str, tuple[int, int]] = {}  # scope -> (offset, size)
        self.size = 0

    def offset(self, scope: str, max_id: int) -> int:
        """Where ``scope``'s block ids start; ``max_id`` bounds every id the scope will use (an
        error when it exceeds what the scope has reserved)."""
        got = self._ranges.get(scope)
        if got is None:
            size = GLOBAL_SCOPE_IDS if not scope else max_id + 1
            got = self._ranges[scope] = (self.size, size)
            self.size += size
        off, size = got
        if max_id >= size:
            raise ValueError(f"block id {max_id} beyond the {size} ids reserved for scope {scope!r}")
        return off


class KeySpace:
    def __init__(self, namespace: str, chunk_tokens: int) -> None:
        self.namespace = namespace  # every seed's: equal scopes give equal seeds (a root each)
        self.chunk_tokens = chunk_tokens
        self._blocks = IdRanges()  # block ids unique across scopes (chains under chain scope "")
        self._roots: dict[tuple[str, int], int] = {}  # (scope, block tokens) -> a negative parent id
        self._gid: dict[bytes, int] = {}  # _name(parent id, payload) -> group id, of chunks not below
        self._groups = 0
        # chunks numbered right after their parent: parent (_NONE: not here) and payload by group id
        self._parent = np.full(1 << 14, _NONE, dtype=np.int64)
        self._payload: np.ndarray | None = None  # [gid, u64 word], one payload size (the first seen)
        self.hashed_chunks = 0  # chunks named past their chain's common prefix

    @property
    def groups(self) -> int:
        return self._groups

    def fresh(self, n: int) -> np.ndarray:
        """``n`` group ids no chunk has, nor will have (names of something no other prompt shares)."""
        ids = np.arange(self._groups, self._groups + n, dtype=np.int64)
        self._groups += n
        self._grow(self._groups)
        return ids

    def block_offset(self, scope: str, max_id: int) -> int:
        """Where ``scope``'s block ids start among ids unique across every scope (``IdRanges``)."""
        return self._blocks.offset(scope, max_id)

    def chunk_gids(self, scope: str, st: KeyChain, block_ids: np.ndarray, block_tokens: int, n_tokens: int,
                   *, chain_scope: str | None = None) -> np.ndarray:
        """Group ids of the request's keyable chunks (policy.chunks rules), in order; ``st``, the
        thread's chain, becomes this prompt's (the chunks it shares with the chain's previous
        prompt keep their ids unnamed again).

        ``chain_scope``: the scope whose chain seed starts the digests (default ``scope``); a
        caller that passes ids unique across scopes (each plus its scope's ``block_offset``)
        passes ``""`` so that equal leading ids give equal chunks in every scope. A chain must
        keep one choice. Tokens beyond the recorded blocks (traces whose ``in`` over-counts)
        are never keyed."""
        n_tokens = min(n_tokens, block_ids.size * block_tokens)
        n = min(st.blocks.size, block_ids.size)
        prev = st.blocks[:n]
        if prev.dtype == block_ids.dtype and prev.tobytes() == block_ids[:n].tobytes():
            common_blocks = n  # the usual case (a thread's prompt extends its last one): one memcmp
        else:
            differ = prev != block_ids[:n]
            common_blocks = int(differ.argmax()) if n else 0  # the first difference, if any
            if n and not differ[common_blocks]:  # none (argmax of all False is 0)
                common_blocks = n
        keyable = min(n_tokens // self.chunk_tokens, n_tokens // block_tokens * block_tokens // self.chunk_tokens)
        keep = min(st.gids.size, common_blocks * block_tokens // self.chunk_tokens, keyable)
        if keep < keyable:
            if keep:
                parent = int(st.gids[keep - 1])
            else:  # the chain's seed: one root per chain scope and block size
                chain = scope if chain_scope is None else chain_scope
                parent = self._roots.get((chain, block_tokens))
                if parent is None:
                    parent = self._roots[(chain, block_tokens)] = -1 - len(self._roots)
            new = self._number(parent, block_ids, block_tokens, n_tokens, keep, keyable)
            self.hashed_chunks += new.size
            buf = st.buf
            if keep != st.tip or buf.size < keyable:  # not an extension at the tip: a new buffer
                buf = np.empty(max(2 * keyable, 64), dtype=np.int64)
                buf[:keep] = st.gids[:keep]
                st.buf = buf
            buf[keep:keyable] = new
            st.tip = keyable
            gids = buf[:keyable]
        else:
            gids = st.gids[:keep]
        st.blocks, st.gids = block_ids, gids
        return gids

    def _number(self, parent: int, block_ids: np.ndarray, block_tokens: int, n_tokens: int, first: int,
                keyable: int) -> np.ndarray:
        """Group ids of chunks ``first .. keyable - 1`` (at least one) of a prompt whose chunk
        ``first - 1`` has group id ``parent`` (a root when ``first`` is 0): known chunks keep
        their ids, up to the first new one; it and every later chunk get the next ids."""
        ct = self.chunk_tokens
        if ct % block_tokens == 0 and block_ids.dtype.kind == "u":
            # whole blocks per chunk, ids that are u64 already: block_pieces' records written
            # directly (block id; offset 0 | block size << 32), the same bytes
            per = ct // block_tokens
            m = keyable - first
            rec = np.empty((m, 2 * per), dtype="<u8")
            rec[:, 0::2] = block_ids[first * per: keyable * per].reshape(m, per)
            rec[:, 1::2] = block_tokens << 32
            raw, bounds = rec.tobytes(), ()
        else:
            raw, bounds = block_pieces(block_ids, block_tokens, n_tokens, ct, first)
        gid = self._gid
        if ct % block_tokens == 0 or block_tokens % ct == 0:  # payloads of one size
            step = (ct // block_tokens if ct % block_tokens == 0 else 1) * _PIECE_BYTES
            payload = self._payload
            if payload is None:
                payload = self._payload = np.zeros((self._parent.size, step // 8), dtype=np.uint64)
            if payload.shape[1] * 8 == step:
                return self._number_uniform(parent, raw, step)
        out = []
        for a, b in bounds:  # payloads of varying size (or not the first size): the dictionary
            k = _name(parent, raw[a:b])
            g = gid.get(k)
            if g is None:
                g = gid[k] = self._groups
                self._groups += 1
                self._grow(self._groups)
            out.append(g)
            parent = g
        return np.asarray(out, dtype=np.int64)

    def _number_uniform(self, parent: int, raw: bytes, step: int) -> np.ndarray:
        gid = self._gid
        groups = self._groups
        parents, payload = self._parent, self._payload
        m = len(raw) // step
        known: list[int] = []
        a = 0
        while a < len(raw):  # known chunks: a continuation in the arrays, else the dictionary
            chunk = raw[a:a + step]
            c = parent + 1
            if parent >= 0 and c < groups and parents[c] == parent and payload[c].tobytes() == chunk:
                g = c
            else:
                g = gid.get(_name(parent, chunk))
                if g is None:
                    break
            known.append(g)
            parent = g
            a += step
        rest = m - len(known)
        if not rest:
            return np.asarray(known, dtype=np.int64)
        self._groups = end = groups + rest
        if end > parents.size:
            self._grow(end)
            parents, payload = self._parent, self._payload
        ids = np.arange(groups, end, dtype=np.int64)
        parents[groups] = parent  # the run's first chunk; every later one continues it
        parents[groups + 1:end] = ids[:-1]
        payload[groups:end] = np.frombuffer(raw, dtype=np.uint64, offset=a).reshape(rest, step // 8)
        if parent < 0 or parent != groups - 1:  # not a continuation: found through the dictionary
            gid[_name(parent, raw[a:a + step])] = groups
        return np.concatenate([np.asarray(known, dtype=np.int64), ids]) if known else ids

    def _grow(self, groups: int) -> None:
        n = self._parent.size
        if groups <= n:
            return
        new = max(groups, 2 * n)
        parents = np.full(new, _NONE, dtype=np.int64)
        parents[:n] = self._parent
        self._parent = parents
        if self._payload is not None:
            payload = np.zeros((new, self._payload.shape[1]), dtype=np.uint64)
            payload[:n] = self._payload
            self._payload = payload
