"""kernels.attention: the Triton MLA decode kernels against their torch reference, a dense oracle,
and themselves (batch invariance).

The Triton side runs compiled on a GPU (``-m gpu``) and under Triton's interpreter on the CPU (when
the ``triton`` package is installed).
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from kvpool.kernels.attention import SPLIT_TOKENS, DecodePlan, mla_decode, mla_decode_ref, mla_decode_triton

HAVE_TRITON = importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.timeout(300)

DEVICES = [
    pytest.param("cpu", id="cpu-interp",
                 marks=pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed: no interpreter")),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]
PAGE = 16
SCALE = 1.0 / math.sqrt(128)


class Case:
    """Sequences at ``positions`` in one shared cache of ``dcp`` ranks, each on its own shuffled
    pages; queries for ``rows`` rows (sequence ``i`` on row ``i``)."""

    def __init__(self, positions: list[int], dcp: int, heads: int, dtype: torch.dtype, device: str,
                 exact: bool, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        need = [[-(-((p + 1 - r + dcp - 1) // dcp) // PAGE) for r in range(dcp)] for p in positions]
        self.blocks = max(sum(n[r] for n in need) for r in range(dcp)) + 2
        perm = [torch.randperm(self.blocks, generator=g).tolist() for _ in range(dcp)]
        taken = [0] * dcp
        self.pages = []
        for n in need:
            mine = []
            for r in range(dcp):
                mine.append(perm[r][taken[r]:taken[r] + n[r]])
                taken[r] += n[r]
            self.pages.append(mine)
        self.positions, self.dcp, self.device = positions, dcp, device
        rows, shape = len(positions), (dcp * self.blocks, PAGE, 576)
        if exact:
            # every sum exact: keys small integers, scores 0 or far below (e^0 = 1 or e^-707 = 0);
            # head h selects on latent dim 200 + h (even heads) or RoPE dim h (odd heads)
            keys = torch.randint(-2, 3, shape, generator=g).float()
            sel = torch.randint(0, 2, (shape[0], PAGE, heads), generator=g).float() * -8
            qlat, qr = torch.zeros(rows, heads, 512), torch.zeros(rows, heads, 64)
            for h in range(heads):
                if h % 2 == 0:
                    keys[:, :, 200 + h] = sel[:, :, h]
                    qlat[:, h, 200 + h] = 1000.0
                else:
                    keys[:, :, 512 + h] = sel[:, :, h]
                    qr[:, h, h] = 1000.0
        else:
            keys = torch.randn(shape, generator=g)
            qlat, qr = torch.randn(rows, heads, 512, generator=g), torch.randn(rows, heads, 64, generator=g)
        self.cache = keys.to(dtype).to(device)
        self.qlat, self.qr = qlat.to(device), qr.to(device)

    def plan(self, order: list[int] | None = None) -> DecodePlan:
        order = list(range(len(self.positions))) if order is None else order
        return DecodePlan.build([self.pages[i] for i in order], [self.positions[i] for i in order], self.dcp,
                                self.blocks, PAGE, self.device)

    def out(self, rows: int | None = None) -> torch.Tensor:
        return torch.full((rows or len(self.positions), *self.qlat.shape[1:]), 7.0, device=self.device)

    def oracle(self, i: int) -> torch.Tensor:
        """Token by token: sequence ``i``'s records in position order, one float64 softmax."""
        p = self.positions[i]
        recs = []
        for t in range(p + 1):
            r, local = t % self.dcp, t // self.dcp
            blk = r * self.blocks + self.pages[i][r][local // PAGE]
            recs.append(self.cache[blk, local % PAGE].double().cpu())
        k = torch.stack(recs)
        s = (self.qlat[i].double().cpu() @ k[:, :512].T + self.qr[i].double().cpu() @ k[:, 512:].T) * SCALE
        return torch.softmax(s, dim=-1) @ k[:, :512]


POSITIONS = [0, 5, 47, 2 * SPLIT_TOKENS + 40, 3]   # one token; a part per rank; several parts per rank


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dcp,heads,dtype", [(1, 2, torch.bfloat16), (2, 8, torch.float8_e4m3fn),
                                             (3, 3, torch.float8_e4m3fn)], ids=["dcp1-bf16", "dcp2-fp8", "dcp3-h3"])
def test_the_kernel_equals_the_reference_bit_for_bit_where_sums_are_exact(device, dcp, heads, dtype):
    case = Case(POSITIONS, dcp, heads, dtype, device, exact=True)
    plan = case.plan()
    ref = mla_decode_ref(case.cache, case.qlat, case.qr, plan, SCALE, case.out())
    tri = mla_decode_triton(case.cache, case.qlat, case.qr, plan, SCALE, case.out())
    assert torch.equal(tri, ref)
    for i in range(len(POSITIONS)):
        assert torch.allclose(ref[i].double().cpu(), case.oracle(i), rtol=0, atol=1e-6), i
    # heads select different tokens of the long sequence: no head's result is another's
    assert len({tuple(ref[3, h].tolist()) for h in range(heads)}) == heads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dcp", [1, 2, 4])
def test_both_backends_match_a_dense_softmax(device, dcp):
    case = Case(POSITIONS, dcp, 8, torch.float8_e4m3fn, device, exact=False, seed=dcp)
    plan = case.plan()
    ref = mla_decode_ref(case.cache, case.qlat, case.qr, plan, SCALE, case.out())
    tri = mla_decode_triton(case.cache, case.qlat, case.qr, plan, SCALE, case.out())
    for i in range(len(POSITIONS)):
        want = case.oracle(i)
        assert torch.allclose(ref[i].double().cpu(), want, rtol=0, atol=1e-5), i
        assert torch.allclose(tri[i].double().cpu(), want, rtol=0, atol=1e-5), i


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_sequences_bits_do_not_depend_on_the_batch(device, backend):
    case = Case(POSITIONS, 2, 8, torch.float8_e4m3fn, device, exact=False, seed=3)
    target = 3
    run = mla_decode_triton if backend == "triton" else mla_decode_ref
    # alone, on row 0 (its query moved there)
    alone_case_q = (case.qlat[target:target + 1], case.qr[target:target + 1])
    alone = run(case.cache, *alone_case_q, case.plan([target]), SCALE, case.out(1))
    order = [4, 0, target, 1, 2]                        # row 2 of a batch with longer and shorter ones
    batch = run(case.cache, case.qlat[order], case.qr[order], case.plan(order), SCALE, case.out())
    assert torch.equal(batch[2], alone[0])
    assert not torch.equal(batch[1], batch[2])


@pytest.mark.parametrize("device", DEVICES)
def test_rows_past_the_plans_sequences_are_left_alone(device):
    case = Case([9, 30], 2, 2, torch.bfloat16, device, exact=False)
    out = mla_decode(case.cache, case.qlat, case.qr, case.plan(), SCALE, case.out(4),
                     backend="triton" if device == "cpu" else "auto")
    assert torch.equal(out[2:], torch.full_like(out[2:], 7.0))


def test_the_plan_cuts_each_ranks_tokens_into_parts_in_rank_order():
    long_pages = [list(range(17)), list(range(19, 2, -1))]
    pages = [[[3], [0]], long_pages]
    long_pos = 2 * SPLIT_TOKENS + 9                     # 522 tokens: 261 on each of 2 ranks
    plan = DecodePlan.build(pages, [20, long_pos], dcp=2, blocks_per_rank=20, page_tokens=PAGE, device="cpu")
    assert plan.host_parts == [2, 4] and plan.host_longest == [11, SPLIT_TOKENS]
    assert plan.parts[0, :2].tolist() == [[0, 0, 11], [1, 0, 10]]      # 21 tokens: 11 on rank 0, 10 on rank 1
    assert plan.parts[1].tolist() == [[0, 0, SPLIT_TOKENS], [0, SPLIT_TOKENS, 5], [1, 0, SPLIT_TOKENS],
                                      [1, SPLIT_TOKENS, 5]]
    assert plan.n_parts.tolist() == [2, 4]
    assert plan.page_rows[1, 1].tolist() == [20 + b for b in long_pages[1]]   # rank 1's blocks follow rank 0's
    assert plan.page_rows[0, 0, 0].item() == 3 and plan.page_rows[0, 1, 0].item() == 20
    # the new tokens: position 20 on rank 0 (local 10), position 521 on rank 1 (local 260: page 16, slot 4)
    assert plan.write_block.tolist() == [3, 20 + long_pages[1][16]]
    assert plan.write_slot.tolist() == [10, 4]
