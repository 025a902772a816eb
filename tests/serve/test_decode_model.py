"""The decode step over DCP-sharded paged KV: batch-invariant bits, the exact DCP merge, and the
reference generation it must reproduce (CPU)."""

from __future__ import annotations

import pytest
import torch
from decode_testing import Batch

from kvpool.backend.serve.decode_model import ROW_BLOCK
from kvpool.backend.serve.model_config import ref_config
from kvpool.backend.serve.reference import recompute_generate, reference_generate
from kvpool.scenario.load import load_scenario

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]

CFG = ref_config(load_scenario("cpu-tiny"))
FP8 = ref_config(load_scenario("cpu-tiny", ["serve.cache_dtype=float8_e4m3fn", "model.record_bytes=576"]))


def prompts(k: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(torch.randint(1, 50, (1,), generator=g)),), generator=g).tolist()
            for _ in range(k)]


@pytest.mark.parametrize("dcp", [1, 2])
def test_a_sequences_bits_do_not_depend_on_the_batch(dcp):
    ps = prompts(ROW_BLOCK + 3, seed=1)
    target = 3
    batch = Batch(CFG, ps, dcp, 4)
    alone = batch.run([target], 4)
    small = batch.run([0, 1, 2, target, 4], 4)        # row 3 of 5
    big = batch.run(list(range(len(ps)))[::-1], 4)    # row 15 of 19: a second block
    for other in (small, big):
        assert other[0][target] == alone[0][target]
        for a, b in zip(alone[1][target], other[1][target]):
            assert torch.equal(a, b)
    # a sequence's neighbours get their own tokens, not a copy of the target's
    assert len({tuple(v) for v in big[0].values()}) > 1


@pytest.mark.parametrize("dcp", [1, 2])
def test_batched_dcp_decode_equals_reference_generate(dcp):
    ps = prompts(5, seed=2)
    toks, _ = Batch(CFG, ps, dcp, 9).run(list(range(5)), 9)
    for i, p in enumerate(ps):
        assert toks[i] == reference_generate(CFG, p, 10, dcp)


@pytest.mark.parametrize("dcp", [2, 3])
def test_rank_by_rank_partials_give_the_tokens_of_the_batched_ranks(dcp):
    """Ranks on several devices compute their partials one by one; on one device in one product."""
    ps = prompts(4, seed=6) + [[7]]
    one = Batch(CFG, ps, dcp, 8, share=True)
    assert one.kv.shared is not None
    apart = Batch(CFG, ps, dcp, 8, share=False)
    assert apart.kv.shared is None
    a, b = one.run(list(range(5)), 8), apart.run(list(range(5)), 8)
    assert a[0] == b[0]
    # float32 sums in another order: a generated token's record may round to another bfloat16
    # (logits are of unit scale; a wrong merge moves them by tenths)
    diff = max(float((x - y).abs().max()) for i in range(5) for x, y in zip(a[1][i], b[1][i]))
    assert diff < 1e-2, diff


def test_the_tokens_do_not_depend_on_tp():
    ps = prompts(3, seed=4)
    one = Batch(CFG, ps, 2, 5, tp=1).run([0, 1, 2], 5)
    two = Batch(CFG, ps, 2, 5, tp=2).run([0, 1, 2], 5)
    assert one[0] == two[0]
    assert all(torch.equal(a, b) for i in range(3) for a, b in zip(one[1][i], two[1][i]))


def test_heads_on_several_devices_give_the_tokens_of_one_device():
    """Head by head (``cpu`` and ``cpu:0`` are distinct devices to the model) against every head in
    one product with absorbed weights: the same tokens, logits equal to float32 rounding."""
    ps = prompts(3, seed=7)
    fused = Batch(CFG, ps, 2, 6, tp=2)
    apart = Batch(CFG, ps, 2, 6, tp=2, devices=["cpu", "cpu:0"])
    assert fused.step.fused is not None and apart.step.fused is None
    a, b = fused.run([0, 1, 2], 6), apart.run([0, 1, 2], 6)
    assert a[0] == b[0]
    diff = max(float((x - y).abs().max()) for i in range(3) for x, y in zip(a[1][i], b[1][i]))
    assert diff < 1e-2, diff


@pytest.mark.parametrize("dcp,cfg", [(1, CFG), (2, CFG), (3, CFG), (2, FP8)], ids=["1", "2", "3", "2-fp8"])
def test_reference_generate_equals_a_full_recompute(dcp, cfg):
    """The DCP merge is exact: every token equals the argmax of a full prefill of the sequence so
    far, and the logits agree to rounding (the generated tokens' records are rounded to bfloat16
    from hidden states that differ in the last float32 bits, so a record may differ by one bfloat16
    step; a wrong merge moves logits by tenths)."""
    for p in prompts(2, seed=5) + [[65]]:
        ref = reference_generate(cfg, p, 8, dcp)
        rec, rec_logits = recompute_generate(cfg, p, 8)
        assert ref == rec
        _, lg = Batch(cfg, [p], dcp, 8).run([0], 7)
        for a, b in zip(lg[0], rec_logits[1:]):
            assert torch.allclose(a, b, rtol=0, atol=2e-3), (a - b).abs().max()
