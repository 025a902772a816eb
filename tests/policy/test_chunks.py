"""policy.chunks: chained chunk keys from token ids and from trace block ids."""

import hashlib
import json
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.policy.chunks import (
    CHAIN_PERSON,
    ChunkNaming,
    chain_seed,
    digests_from_blocks,
    digests_from_tokens,
    namespace_for,
)
from kvpool.policy.kvspec import KVSpec

GOLDEN = Path(__file__).parent / "data" / "chunk_keys_golden.json"
SEED = chain_seed("kvpool1-test")


@pytest.mark.parametrize("row", json.loads(GOLDEN.read_text()), ids=lambda r: r["input"]["kind"])
def test_golden_keys(row):
    """The checked-in golden vectors pin the key format: changing it must be deliberate."""
    from make_golden import expected

    assert expected(row["input"]) == row["expected"]


def test_first_digest_follows_the_documented_rule():
    tokens = list(range(256))
    want = hashlib.blake2b(SEED, digest_size=16, person=CHAIN_PERSON)
    want.update(b"T" + struct.pack("<256i", *tokens))
    assert digests_from_tokens(tokens, 256, SEED)[0] == want.digest()


def test_partial_last_chunk_is_never_keyed():
    assert len(digests_from_tokens(list(range(511)), 256, SEED)) == 1
    assert len(digests_from_tokens(list(range(512)), 256, SEED)) == 2
    assert digests_from_tokens(list(range(255)), 256, SEED) == []


@given(st.lists(st.integers(0, 50_000), min_size=256, max_size=1200), st.integers(0, 1199))
def test_equal_digest_iff_equal_prefix(tokens, change_at):
    other = list(tokens)
    if change_at < len(other):
        other[change_at] += 1
    a, b = digests_from_tokens(tokens, 64, SEED), digests_from_tokens(other, 64, SEED)
    for i, (x, y) in enumerate(zip(a, b)):
        assert (x == y) == ((i + 1) * 64 <= change_at)


def test_namespace_separates_deployments():
    pp4 = KVSpec("GLM-5.2", 78, 576, (20, 20, 20, 18))
    pp1 = KVSpec("GLM-5.2", 78, 576, (78,))
    other_model = KVSpec("GLM-5.3", 78, 576, (20, 20, 20, 18))
    names = {namespace_for(s, 256) for s in (pp4, pp1, other_model)} | {namespace_for(pp4, 512)}
    assert len(names) == 4
    assert namespace_for(pp4, 256) == namespace_for(KVSpec("GLM-5.2", 78, 576, (20, 20, 20, 18)), 256)
    tokens = list(range(256))
    assert digests_from_tokens(tokens, 256, chain_seed(namespace_for(pp4, 256))) != digests_from_tokens(
        tokens, 256, chain_seed(namespace_for(pp1, 256)))


def test_scope_separates_local_block_ids():
    blocks = [1, 2, 3, 4]
    a = digests_from_blocks(blocks, 64, 256, 256, chain_seed("ns", "trace-a"))
    b = digests_from_blocks(blocks, 64, 256, 256, chain_seed("ns", "trace-b"))
    assert a != b


@given(st.lists(st.integers(0, 2**40), min_size=1, max_size=40), st.integers(0, 63))
def test_blocks_prefix_property_and_partial_block(block_ids, short):
    n_tokens = len(block_ids) * 64 - short
    ds = digests_from_blocks(block_ids, 64, n_tokens, 256, SEED)
    full_blocks = n_tokens // 64
    assert len(ds) == min(n_tokens // 256, full_blocks // 4)
    longer = digests_from_blocks(block_ids + [7, 8, 9, 10], 64, len(block_ids) * 64 + 256, 256, SEED)
    assert longer[: len(ds)] == ds


def test_mooncake_blocks_cut_into_smaller_chunks():
    # 512-token blocks, 256-token chunks: each block gives two chunks; a partial block gives none
    ds = digests_from_blocks([11, 12, 13], 512, 1400, 256, SEED)
    assert len(ds) == 4
    same_first = digests_from_blocks([11, 99], 512, 1024, 256, SEED)
    assert same_first[:2] == ds[:2] and same_first[2] != ds[2]


def test_tokens_and_blocks_never_collide():
    assert digests_from_tokens([0] * 256, 256, SEED) != digests_from_blocks([0] * 4, 64, 256, 256, SEED)


def test_block_input_errors():
    with pytest.raises(ValueError, match="need 2 blocks"):
        digests_from_blocks([1], 64, 100, 64, SEED)
    with pytest.raises(ValueError, match="u64"):
        digests_from_blocks([-1], 64, 64, 64, SEED)


def test_object_keys_and_groups():
    naming = ChunkNaming("kvpool1-abc", 4)
    d = bytes(range(16))
    keys = naming.stage_keys([d])
    assert [k[0] for k in keys] == [f"kvpool1-abc/s{s}of4/{d.hex()}" for s in range(4)]
    assert naming.group_id(d) == f"kvpool1-abc/group/{d.hex()}"
    assert "s0of4" not in naming.group_id(d)
    with pytest.raises(ValueError):
        naming.object_key(d, 4)


@given(st.lists(st.integers(0, 1000), min_size=4, max_size=40), st.integers(0, 10))
def test_continuing_a_chain_equals_computing_it_whole(block_ids, start):
    n = len(block_ids) * 64
    whole = digests_from_blocks(block_ids, 64, n, 256, SEED)
    start = min(start, len(whole))
    parent = whole[start - 1] if start else SEED
    assert digests_from_blocks(block_ids, 64, n, 256, parent, start_chunk=start) == whole[start:]


def _blocks_reference(block_ids, block_tokens, n_tokens, chunk_tokens, seed):
    """The documented block payload, chunk by chunk, token range by token range (no arrays)."""
    out, parent = [], seed
    full_blocks = min(n_tokens, len(block_ids) * block_tokens) // block_tokens
    for c in range(min(n_tokens // chunk_tokens, full_blocks * block_tokens // chunk_tokens)):
        payload = b"B" + struct.pack("<I", block_tokens)
        t, end = c * chunk_tokens, (c + 1) * chunk_tokens
        while t < end:
            b, off = divmod(t, block_tokens)
            take = min(block_tokens - off, end - t)
            payload += struct.pack("<QII", block_ids[b], off, take)
            t += take
        h = hashlib.blake2b(digest_size=16, person=CHAIN_PERSON)
        h.update(parent)
        h.update(payload)
        parent = h.digest()
        out.append(parent)
    return out


@given(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=24), st.sampled_from([(64, 256), (512, 256), (96, 256), (256, 256), (16, 64)]),
       st.integers(0, 600), st.integers(0, 6))
def test_block_digests_equal_the_documented_payload(block_ids, sizes, short, start):
    """Every layout (chunks of whole blocks, blocks of whole chunks, neither) against the payload
    rule written out directly; a continued chain gives the tail of the whole one."""
    block_tokens, chunk_tokens = sizes
    n_tokens = max(0, len(block_ids) * block_tokens - short)
    want = _blocks_reference(block_ids, block_tokens, n_tokens, chunk_tokens, SEED)
    assert digests_from_blocks(block_ids, block_tokens, n_tokens, chunk_tokens, SEED) == want
    start = min(start, len(want))
    parent = want[start - 1] if start else SEED
    assert digests_from_blocks(block_ids, block_tokens, n_tokens, chunk_tokens, parent, start_chunk=start) == want[start:]
    assert digests_from_blocks(np.asarray(block_ids, dtype=np.uint64), block_tokens, n_tokens, chunk_tokens, SEED) == want
