"""``kvpool serve cpu-tiny`` with the DSA indexer (real processes on loopback, the embedded pool): the
indexer on layers 0-2 (GLM-5.2's schedule on 4 layers) and ``index_topk`` 32, so every prompt and
every decode step of a 600-token session selects. A multi-turn session's turns (computed; turn 1
from the GPU prefix cache; turn 2 from the pool after prompts that evict it) each decode exactly
the no-cache recompute's tokens (``reference_generate``), and every record's byte counts are
layers x latent + indexer layers x 144 B per token. After the deployment stops, no process it
started is left."""

from __future__ import annotations

import pytest
from indexer_sets import INDEXER_SETS, TOKEN_BYTES
from serve_process import multi_turn_session, start_serve

from kvpool.backend.serve.model_config import ref_config
from kvpool.scenario.load import load_scenario

SERVE_SETS = ["serve.prefill_kv_tokens=4096", *INDEXER_SETS]
CHUNK_TOKENS = 64


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    served = start_serve(tmp_path_factory.mktemp("e2e-indexer") / "run", SERVE_SETS)
    try:
        yield served
    finally:
        status = served.stop()  # asserts every process of router.ready.json is gone
    assert status == 0, served.output()[-4000:]


def test_a_multi_turn_session_with_the_indexer_decodes_as_the_no_cache_recompute(served):
    config = ref_config(load_scenario("cpu-tiny", SERVE_SETS))
    assert config.indexer_layers == (0, 1, 2) and config.bytes_per_token == TOKEN_BYTES
    records, prompts = multi_turn_session(served.url, SERVE_SETS, seed=23, user="session-indexer")
    sources = [(r["gpu_tokens"], r["pool_tokens"], r["computed_tokens"]) for r in records]
    assert sources[0] == (0, 0, 600), sources
    assert sources[1][0] >= 592 and sources[1][1] == 0, sources
    assert sources[2][1] >= 640 and sources[2][0] == 0, sources
    for r, p in zip(records, prompts):
        assert r["handoff_bytes"] == len(p) * TOKEN_BYTES, r
        assert r["save_bytes"] % (CHUNK_TOKENS * TOKEN_BYTES) == 0 and not r["restore_failed"], r
    assert records[0]["save_bytes"] == 600 // CHUNK_TOKENS * CHUNK_TOKENS * TOKEN_BYTES
    assert records[2]["restore_bytes"] == sources[2][1] * TOKEN_BYTES
