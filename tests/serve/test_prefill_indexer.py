"""The DSA indexer's records through the real prefill processes (cpu-tiny plan with the indexer on
layers 0-2 and ``index_topk`` 32, so prompts of 200 tokens really select): computed, taken from
the GPU prefix cache, restored from the pool, and handed to decode ranks in this process, the
latents and the indexer keys that land equal a single-process ``RefModel.prefill`` bit for bit,
and every byte count is layers x latent + indexer layers x 144 B per token."""

from __future__ import annotations

import pytest
from indexer_sets import INDEXER_SETS, TOKEN_BYTES
from prefill_testing import assert_matches_reference, prefill, prompt, running, sources

from kvpool.backend.serve import handoff_plan as hp

#: 40 pages of prefill KV, 128-token steps; the indexer on layers 0, 1 (stage 0) and 2 (stage 1)
OVERRIDES = ["serve.prefill_kv_tokens=640", "prefill.max_batched_tokens=128", *INDEXER_SETS]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with running(tmp_path_factory.mktemp("prefill-indexer"), OVERRIDES) as deployed:
        yield deployed


def test_the_hand_off_geometry_has_a_part_for_the_indexer_records(served):
    dep, _, _ = served
    sc = dep.plan.scenario_model()
    assert hp.senders(sc) == 4 and hp.indexer_layers(sc) == (0, 1, 2)
    parts = [hp.stage_parts(sc, s, 100) for s in (0, 1)]
    assert {k: (p.layers, p.record_bytes, start) for k, (p, start) in parts[0].items()} == \
        {0: (2, 1152, 0), 2: (2, 144, 4)}
    assert {k: (p.layers, p.record_bytes, start) for k, (p, start) in parts[1].items()} == \
        {1: (2, 1152, 2), 3: (1, 144, 6)}
    assert [hp.stage_bytes_per_token(sc, s) for s in (0, 1)] == list(sc.kvspec().stage_bytes_per_token)
    assert sum(sc.kvspec().stage_bytes_per_token) == TOKEN_BYTES


def test_computed_kv_and_indexer_keys_land_as_the_reference_computes_them(served):
    dep, decode, ref = served
    tokens = prompt(200, 1)
    body = prefill(dep, decode, "idx-1", tokens)
    assert_matches_reference(decode, ref, "idx-1", tokens, body)
    rec = body["record"]
    assert sources(body) == (0, 0, 200)
    assert rec["handoff_bytes"] == 200 * TOKEN_BYTES             # every token's latents and indexer keys
    assert rec["save_bytes"] == 3 * 64 * TOKEN_BYTES             # its 3 full 64-token chunks, both stages


def test_a_gpu_prefix_hit_with_the_indexer_gives_the_reference_bits(served):
    dep, decode, ref = served
    base = prompt(200, 2)
    prefill(dep, decode, "idx-share-a", base)
    tokens = prompt(230, 3, prefix=base[:160])
    body = prefill(dep, decode, "idx-share-b", tokens)
    assert sources(body) == (160, 0, 70)
    assert_matches_reference(decode, ref, "idx-share-b", tokens, body)


def test_indexer_keys_restored_from_the_pool_are_the_reference_bits(served):
    dep, decode, ref = served
    tokens = prompt(200, 4)
    assert sources(prefill(dep, decode, "idx-evict-a", tokens))[0] == 0
    for i in range(4):                                            # 4 x 13 pages > the 40 pages: evicts it
        prefill(dep, decode, f"idx-evict-fill-{i}", prompt(200, 100 + i))
    body = prefill(dep, decode, "idx-evict-b", tokens)
    assert sources(body) == (0, 192, 8)                           # 3 chunks of 64 from the pool
    assert body["record"]["restore_bytes"] == 3 * 64 * TOKEN_BYTES
    assert_matches_reference(decode, ref, "idx-evict-b", tokens, body)
