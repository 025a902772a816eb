"""sim.keys: group ids are the policy core's digests numbered first seen, whatever is reused."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.policy.chunks import chain_seed, digests_from_blocks
from kvpool.sim.keys import KeyChain, KeySpace


@pytest.mark.parametrize("block_tokens", [64, 512, 96])
@settings(max_examples=60, deadline=None)
@given(requests=st.lists(st.tuples(st.sampled_from(["", "a#p0", "b#p1"]), st.integers(0, 2), st.integers(0, 3),
                          st.integers(0, 12), st.integers(0, 63)), min_size=1, max_size=40))
def test_chunk_gids_number_the_digests_first_seen(block_tokens, requests):
    """Threads that grow, diverge and restart, in several scopes (shared prefixes across threads
    and scopes included): the ids equal a plain dictionary numbering of every prompt's digests.
    Blocks of whole chunks (64), chunks inside a block (512) and neither (96)."""
    keys = KeySpace("ns", 256)
    ref: dict[bytes, int] = {}
    prompts: dict[tuple[str, int], list[int]] = {}
    handed: list[tuple[np.ndarray, list[int]]] = []  # every list returned: it never changes later
    chains: dict[tuple[str, int], KeyChain] = {}
    fresh = 100
    for scope, thread, cut, grow, short in requests:
        p = prompts.get((scope, thread), [1, 2, 3, 4])  # every thread starts with the same prefix
        p = p[: max(0, len(p) - 4 * cut)] + list(range(fresh, fresh + 4 * grow))
        fresh += 4 * grow
        prompts[(scope, thread)] = p
        blocks = np.asarray(p, dtype=np.uint32)
        n_tokens = max(0, blocks.size * block_tokens - short)
        got = keys.chunk_gids(scope, chains.setdefault((scope, thread), KeyChain()), blocks, block_tokens, n_tokens)
        want = [ref.setdefault(d, len(ref))
                for d in digests_from_blocks(p, block_tokens, n_tokens, 256, chain_seed("ns", scope))]
        assert got.tolist() == want
        handed.append((got, want))
        for ids, was in handed:
            assert ids.tolist() == was
    assert keys.groups == len(ref)


def test_chunk_gids_two_block_sizes_in_one_scope():
    """The same block ids under two block sizes are different chunks (the head differs)."""
    keys = KeySpace("ns", 256)
    blocks = np.arange(1, 17, dtype=np.int64)
    a = keys.chunk_gids("s", KeyChain(), blocks, 64, 16 * 64)
    b = keys.chunk_gids("s", KeyChain(), blocks, 128, 16 * 128)
    assert set(a.tolist()).isdisjoint(b.tolist())
    again = keys.chunk_gids("s", KeyChain(), blocks, 64, 16 * 64)
    assert again.tolist() == a.tolist()


@pytest.mark.parametrize("dtype", [np.int64, np.uint32])
@pytest.mark.parametrize("block_tokens", [64, 16, 512, 96])
@settings(max_examples=60, deadline=None)
@given(requests=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 50), st.integers(0, 40), st.integers(0, 5)),
                         min_size=1, max_size=30))
def test_chunk_gids_prefixes_copied_across_threads(dtype, block_tokens, requests):
    """Threads whose prompts copy a prefix of another thread's prompt (long shared runs, found
    again through either of the key space's stores) then add fresh blocks or repeat old ones."""
    keys = KeySpace("ns", 256)
    ref: dict[bytes, int] = {}
    prompts: list[list[int]] = [[]]
    chains = [KeyChain() for _ in range(5)]  # one per thread
    fresh = 1000
    for thread, src_cut, grow, src in requests:
        base = prompts[src % len(prompts)]
        p = base[: min(len(base), src_cut)] + list(range(fresh, fresh + grow))
        if grow % 3 == 0:
            p = p + base[:grow]  # blocks seen before, after a new prefix
        fresh += grow
        prompts.append(p)
        n_tokens = len(p) * block_tokens
        got = keys.chunk_gids("s", chains[thread], np.asarray(p, dtype=dtype), block_tokens, n_tokens)
        want = [ref.setdefault(d, len(ref))
                for d in digests_from_blocks(p, block_tokens, n_tokens, 256, chain_seed("ns", "s"))]
        assert got.tolist() == want
    assert keys.groups == len(ref)
