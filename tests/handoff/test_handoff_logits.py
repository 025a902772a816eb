"""Model-level check: the reference MLA model's next-token logits computed from KV that went
through the handoff (2 prefill stage processes -> 2 decode rank processes, Mooncake TCP) equal,
bit for bit, those of a single-process run."""

from __future__ import annotations

import pytest
import torch

from handoff_workers import PAGE, Geom, call, expected_rank_kv, model_tokens, ref_model

from kvpool.backend.handoff import HandoffResult

pytestmark = pytest.mark.timeout(150)

G = Geom(tokens=192, stages=2, layers=2, ranks=2, record_bytes=1152, slots=8, model=True)


def test_next_token_logits_after_handoff_equal_single_process(cluster, run_request):
    started = cluster.decodes(G, "mooncake")
    decodes = [c for _, c, _ in started]
    prefills = [c for _, c, _ in cluster.prefills(G, "mooncake", [ep for _, _, ep in started])]
    reports, results = run_request(decodes, prefills, "model", 0)
    assert all(isinstance(r, HandoffResult) for r in results), results
    rank_kv = [call(conn, ("kv", 0, {})) for conn in decodes]         # [layers, n_r, 1152] uint8 each
    for r in range(G.ranks):
        assert rank_kv[r].equal(expected_rank_kv(G, r, 0)), f"rank {r} pages differ"

    model = ref_model(G)
    tokens = model_tokens(G, 0)
    table = torch.arange(-(-(G.tokens + 1) // PAGE))
    # decode's view: every position's latent from the rank holding it, into fresh pages
    caches = model.new_caches(table.numel())
    for layer in range(G.total_layers):
        stage, i = divmod(layer, G.layers)
        for p in range(G.tokens):
            rec = rank_kv[p % G.ranks][layer, p // G.ranks].view(model.config.cache_dtype)
            caches[stage][i][table[p // PAGE], p % PAGE] = rec
    after = model.prefill(tokens, caches, table, start_token=G.tokens)
    single = model.prefill(tokens, model.new_caches(table.numel()), table, start_token=0)
    assert torch.equal(after, single)

