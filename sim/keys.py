"""Names for what the simulator caches: global block ids (GPU cache) and chunk group ids (pool).

Contract:
    * Block ids of a play whose hash scope is local (Weka traces: small per-session ints) are
      shifted into a dense range of their own per scope, so different sessions and different
      plays of one session never share GPU cache entries; global-scope ids (scope ``""``,
      Mooncake traces) share one range.
    * Chunk keys are the policy core's: ``policy.chunks.digests_from_blocks`` under
      ``chain_seed(namespace, scope)``. Each distinct digest gets a small integer group id (first
      seen, first numbered) for ``policy.grouptable``. A thread keeps its last request's blocks
      and digests, so a request hashes only the chunks past its common prefix with the previous
      one (the chain makes the shared digests identical by construction).
    * A prefix common to every session (``workload.shared_prefix_tokens``: one product's tool
      definitions) gets one range of block ids of its own (scope ``SHARED_PREFIX_SCOPE``); the
      simulator then keys every chunk from global ids under one chain (``chain_scope=""``), so
      chunks made only of shared blocks are the same object in every session and no others are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvpool.policy.chunks import chain_seed, digests_from_blocks

_GLOBAL_RESERVE = 1 << 24  # block ids reserved for global-scope (Mooncake) ids
#: The scope of the block ids of the prefix every session shares (no trace scope starts with NUL).
SHARED_PREFIX_SCOPE = "\0shared-prefix"


@dataclass
class _ThreadKeys:
    blocks: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    digests: list[bytes] = field(default_factory=list)
    gids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


class KeySpace:
    def __init__(self, namespace: str, chunk_tokens: int) -> None:
        self.namespace = namespace
        self.chunk_tokens = chunk_tokens
        self._scope_offsets: dict[str, tuple[int, int]] = {}
        self._next_block = 0
        self._seeds: dict[str, bytes] = {}
        self._gid: dict[bytes, int] = {}
        self._threads: dict[tuple[str, int], _ThreadKeys] = {}
        self.hashed_chunks = 0

    @property
    def groups(self) -> int:
        return len(self._gid)

    def block_offset(self, scope: str, max_id: int) -> int:
        """Where ``scope``'s block ids start in the dense global range; ``max_id`` bounds every
        id the scope will use (an error when it exceeds what the scope has reserved)."""
        got = self._scope_offsets.get(scope)
        if got is None:
            size = _GLOBAL_RESERVE if not scope else max_id + 1
            got = self._scope_offsets[scope] = (self._next_block, size)
            self._next_block += size
        off, size = got
        if max_id >= size:
            raise ValueError(f"block id {max_id} beyond the {size} ids reserved for scope {scope!r}")
        return off

    def global_blocks(self, block_ids: np.ndarray, scope: str, max_id: int) -> np.ndarray:
        """Dense global ids of ``block_ids`` (each at most ``max_id``, which bounds every id the
        scope will use)."""
        return np.add(block_ids, self.block_offset(scope, max_id), dtype=np.int64)

    def chunk_gids(self, scope: str, thread: int, block_ids: np.ndarray, block_tokens: int, n_tokens: int,
                   *, chain_scope: str | None = None) -> np.ndarray:
        """Group ids of the request's keyable chunks (policy.chunks rules), in order.

        ``chain_scope``: the scope whose chain seed starts the digests (default ``scope``); a
        caller that passes ids unique across scopes (``global_blocks``) passes ``""`` so that equal
        leading ids give equal chunks in every scope. A thread must keep one choice.
        Tokens beyond the recorded blocks (traces whose ``in`` over-counts) are never keyed."""
        n_tokens = min(n_tokens, block_ids.size * block_tokens)
        st = self._threads.get((scope, thread))
        if st is None:
            st = self._threads[(scope, thread)] = _ThreadKeys()
        n = min(st.blocks.size, block_ids.size)
        differ = st.blocks[:n] != block_ids[:n]
        common_blocks = int(differ.argmax()) if n else 0  # the first difference, if any
        if n and not differ[common_blocks]:  # none (argmax of all False is 0)
            common_blocks = n
        keyable = min(n_tokens // self.chunk_tokens, n_tokens // block_tokens * block_tokens // self.chunk_tokens)
        keep = min(len(st.digests), common_blocks * block_tokens // self.chunk_tokens, keyable)
        chain = scope if chain_scope is None else chain_scope
        seed = self._seeds.get(chain)
        if seed is None:
            seed = self._seeds[chain] = chain_seed(self.namespace, chain)
        parent = st.digests[keep - 1] if keep else seed
        new = digests_from_blocks(block_ids, block_tokens, n_tokens, self.chunk_tokens, parent, start_chunk=keep)
        self.hashed_chunks += len(new)
        del st.digests[keep:]  # the thread's own list: extended in place
        st.digests.extend(new)
        gids = np.concatenate([st.gids[:keep], self._number(new)]) if new else st.gids[:keep]
        st.blocks, st.gids = block_ids, gids
        return gids

    def _number(self, digests: list[bytes]) -> np.ndarray:
        """Group ids of ``digests``: a digest seen before keeps its id, a new one gets the next."""
        gid = self._gid
        return np.asarray([gid.setdefault(d, len(gid)) for d in digests], dtype=np.int64)

    def forget_scope(self, scope: str) -> None:
        """Drop per-thread state of a finished play (its group ids stay valid)."""
        for key in [k for k in self._threads if k[0] == scope]:
            del self._threads[key]
