"""The reference model's DSA indexer (CPU): its record geometry, its choice of tokens, prefill's
page-aligned bits with the indexer, and the DCP decode step against the no-cache recompute."""

from __future__ import annotations

import pytest
import torch
from decode_testing import Batch
from indexer_sets import INDEXER, INDEXER_SETS, TOPK

from kvpool.backend.refmodel import (
    RefModel,
    dequantize_index_keys,
    gather_tokens,
    indexer_record_bytes,
    quantize_index_keys,
    select_topk,
)
from kvpool.backend.serve.decode_model import ROW_BLOCK
from kvpool.backend.serve.model_config import ServeConfigError, ref_config
from kvpool.backend.serve.reference import _model, recompute_generate, reference_generate
from kvpool.kernels.format import ChunkFormat
from kvpool.scenario.load import load_scenario

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]

SETS = INDEXER_SETS
CFG = ref_config(load_scenario("cpu-tiny", SETS))
#: the same model with a top-k no context reaches: every indexer layer dense
WIDE = ref_config(load_scenario("cpu-tiny", SETS + ["serve.index_topk=100000"]))
PLAIN = ref_config(load_scenario("cpu-tiny"))
FP8 = ref_config(load_scenario("cpu-tiny", [INDEXER, f"serve.index_topk={TOPK}", "serve.cache_dtype=float8_e4m3fn",
                                            "model.record_bytes=576"]))


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefill(cfg, toks: list[int], start: int = 0):
    """Logits and every cache's records of ``toks``, the prefix ``[0, start)`` in an earlier call."""
    m = _model(cfg)
    table = torch.arange(-(-len(toks) // cfg.page_tokens) + 1)
    caches = m.new_caches(table.numel())
    if start:
        m.prefill(toks[:start], caches, table)
    logits = m.prefill(toks, caches, table, start_token=start)
    return logits, gather_tokens(caches, table, len(toks))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


# ---- geometry ---------------------------------------------------------------------------------


def test_the_indexer_record_is_the_key_a_float32_scale_and_padding_to_16_bytes():
    assert indexer_record_bytes(128, torch.float8_e4m3fn) == 144     # ATOM's row: 128 + 4, padded
    assert indexer_record_bytes(64, torch.bfloat16) == 144
    assert indexer_record_bytes(128, torch.bfloat16) == 272
    k = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    rec = quantize_index_keys(k, CFG)
    assert rec.dtype == torch.bfloat16 and tuple(bits(rec).shape) == (5, 144)
    raw = bits(rec)
    scale = raw[:, 128:132].contiguous().view(torch.float32)[:, 0]
    assert torch.equal(scale, k.abs().amax(dim=-1) / 448.0)
    assert not raw[:, 132:].any()                                     # the padding is zeros
    back = dequantize_index_keys(rec, CFG)
    assert torch.allclose(back, k, rtol=1e-2, atol=0)                 # bfloat16's 8 bits of mantissa
    assert not torch.equal(back, k)


def test_the_kv_spec_counts_the_latent_on_every_layer_and_the_indexer_on_its_layers():
    assert CFG.indexer_layers == (0, 1, 2) and CFG.index_record_bytes == 144
    spec = CFG.kv_spec("refmodel-tiny")
    assert spec.stage_bytes_per_token == (2 * 1152 + 2 * 144, 2 * 1152 + 144)
    assert spec.bytes_per_token == CFG.bytes_per_token == 4 * 1152 + 3 * 144
    assert spec == load_scenario("cpu-tiny", SETS).kvspec()           # the simulator's geometry
    assert FP8.bytes_per_token == 4 * 576 + 3 * 144
    model = RefModel(CFG)
    for stage in (0, 1):
        caches = model.new_stage_caches(stage, 3)
        fmt = ChunkFormat.from_spec(spec, stage, 64)
        assert [(s.layer_id, s.record) for s in fmt.segments] == CFG.stage_segments(stage)
        assert [bits(c).shape[-1] for c in caches] == list(fmt.record_bytes)
    assert PLAIN.indexer_layers == () and PLAIN.kv_spec().extra_records == ()


def test_ref_config_refuses_an_indexer_it_does_not_cache():
    wrong = INDEXER.replace("bytes_per_token=144", "bytes_per_token=132")
    with pytest.raises(ServeConfigError, match="serve.index_dim 64 .* makes a 144 B indexer record"):
        ref_config(load_scenario("cpu-tiny", [wrong, "serve.index_dim=64"]))
    with pytest.raises(ServeConfigError, match="272 B"):     # bfloat16 keys of 128 elements
        ref_config(load_scenario("cpu-tiny", [INDEXER]))
    other = 'model.extra_records=[{name="scales", bytes_per_token=16, layer_ids=[1]}]'
    with pytest.raises(ServeConfigError, match="remove 'scales'"):
        ref_config(load_scenario("cpu-tiny", [other]))


# ---- the choice ---------------------------------------------------------------------------------


def test_select_topk_takes_the_best_scores_of_the_causal_context_and_the_lowest_position_on_ties():
    scores = torch.tensor([[5.0, 1.0, 3.0, 3.0, 3.0, 9.0],
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                           [2.0, 7.0, 0.0, 0.0, 0.0, 0.0]])
    pos = torch.tensor([4, 5, 1])
    chosen = select_topk(scores, pos, 3)
    assert chosen[0].tolist() == [True, False, True, True, False, False]   # 9.0 lies beyond position 4
    assert chosen[1].tolist() == [True, True, True, False, False, False]   # ties: lowest positions
    assert chosen[2].tolist() == [True, True, False, False, False, False]  # 2 tokens of context <= 3: all


def test_with_the_context_within_topk_an_indexer_layer_is_exactly_dense():
    toks = tokens(100, 1)
    plain_logits, plain = prefill(PLAIN, toks)
    wide_logits, wide = prefill(WIDE, toks)
    assert torch.equal(plain_logits, wide_logits)
    latents = [r for r, (_, rec) in zip(wide, [s for st in (0, 1) for s in WIDE.stage_segments(st)]) if rec == "kv"]
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(plain, latents))
    short = tokens(TOPK, 2)                                  # every query's context <= index_topk
    assert torch.equal(prefill(CFG, short)[0], prefill(PLAIN, short)[0])


def test_past_topk_the_indexer_changes_what_the_model_says():
    toks = tokens(100, 1)
    assert not torch.equal(prefill(CFG, toks)[0], prefill(WIDE, toks)[0])
    assert reference_generate(CFG, toks, 6, 2) != reference_generate(WIDE, toks, 6, 2)


@pytest.mark.parametrize("cfg", [CFG, FP8], ids=["bf16", "fp8"])
def test_a_cached_prefix_gives_the_bits_of_one_prefill(cfg):
    toks = tokens(150, 3)
    one_logits, one = prefill(cfg, toks)
    for start in (48, 96):                                    # page-aligned, past index_topk
        logits, two = prefill(cfg, toks, start)
        assert torch.equal(logits, one_logits)
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(one, two))


# ---- decode -------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [CFG, FP8], ids=["bf16", "fp8"])
def test_dcp_decode_with_the_indexer_equals_the_recompute(cfg):
    for n, seed in ((20, 4), (45, 5), (90, 6)):             # within topk, crossing it, past it
        p = tokens(n, seed)
        want, _ = recompute_generate(cfg, p, 10)
        assert reference_generate(cfg, p, 10, 2) == want, n
        assert reference_generate(cfg, p, 10, 1) == want, n


def test_a_sequences_bits_with_the_indexer_do_not_depend_on_the_batch_or_the_cache_sharing():
    lengths = [10, 28, 40, 70] * 5                         # dense, crossing topk during the steps, sparse
    ps = [tokens(n, 60 + i) for i, n in enumerate(lengths)]
    assert len(ps) > ROW_BLOCK
    batch = Batch(CFG, ps, 2, 6, seed=50, spare_blocks=2)
    target = 3
    alone = batch.run([target], 6)
    crowd = batch.run(list(range(len(ps)))[::-1], 6)       # the target in the second row block
    assert crowd[0][target] == alone[0][target]
    assert all(torch.equal(a, b) for a, b in zip(alone[1][target], crowd[1][target]))
    apart = Batch(CFG, ps[:4], 2, 6, share=False, seed=50, spare_blocks=2).run([0, 1, 2, 3], 6)
    assert batch.kv.shared_index is not None and len(batch.kv.shared_index) == 3
    assert {i: crowd[0][i] for i in range(4)} == apart[0]
    for i, p in enumerate(ps[:4]):
        assert crowd[0][i] == reference_generate(CFG, p, 7, 2)
