"""sim.keys: group ids are the policy core's digests numbered first seen, whatever is reused."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.policy.chunks import chain_seed, digests_from_blocks
from kvpool.sim.keys import KeySpace


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["", "a#p0", "b#p1"]), st.integers(0, 2), st.integers(0, 3),
                          st.integers(0, 12), st.integers(0, 63)), min_size=1, max_size=40))
def test_chunk_gids_number_the_digests_first_seen(requests):
    """Threads that grow, diverge and restart, in several scopes (shared prefixes across threads
    and scopes included): the ids equal a plain dictionary numbering of every prompt's digests."""
    keys = KeySpace("ns", 256)
    ref: dict[bytes, int] = {}
    prompts: dict[tuple[str, int], list[int]] = {}
    fresh = 100
    for scope, thread, cut, grow, short in requests:
        p = prompts.get((scope, thread), [1, 2, 3, 4])  # every thread starts with the same prefix
        p = p[: max(0, len(p) - 4 * cut)] + list(range(fresh, fresh + 4 * grow))
        fresh += 4 * grow
        prompts[(scope, thread)] = p
        blocks = np.asarray(p, dtype=np.uint32)
        n_tokens = max(0, blocks.size * 64 - short)
        got = keys.chunk_gids(scope, thread, blocks, 64, n_tokens)
        want = [ref.setdefault(d, len(ref)) for d in digests_from_blocks(p, 64, n_tokens, 256, chain_seed("ns", scope))]
        assert got.tolist() == want
    assert keys.groups == len(ref)
