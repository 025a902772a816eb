"""Cost models: how long prefill steps, decode steps, restores and handoffs take.

Contract: a ``CostModel`` turns work (tokens, context, bytes) into seconds; it holds no
state and sees no SimPy. ``AnalyticalCost`` is the default, parameterized by the scenario's
``[cost]``, ``[gpu]`` and ``[model]`` sections (sources and calibration in docs/cost-model.md):

    prefill step   overhead + sum(tokens x (2 x active params + attention + ctx x attention_ctx))
                   / (GPUs of the instance x dense peak x MFU)        [pipeline stages overlap]
    decode step    fixed + per-token x batch x tokens verified per sequence
                   + context bytes read / (HBM bandwidth x efficiency x ranks)
    pack/gather    bytes / GPU copy rate (the Triton kernels)
    pool load      bytes / load-worker rate (Mooncake get into the registered buffer + unpack)

Transfers (bytes / bandwidth share + writes / message rate) are priced by the links (``sim/links.py``).

``cost_model(s)`` is the scenario's cost model: ``AnalyticalCost``, or with ``cost.calibration``
the measured curves of that file (``sim.calibration.CalibratedCost``) with ``AnalyticalCost`` for
what lies outside them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from kvpool.scenario.model import Scenario


class CostModel(Protocol):
    def prefill_step_s(self, tokens_and_context: list[tuple[int, int]]) -> float:
        """Time of one prefill step over the whole pipeline: (computed tokens, context before) per request."""

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        """Time of one decode step of ``batch`` sequences holding ``context_tokens`` in all."""

    def unpack_s(self, nbytes: int) -> float:
        """GPU time to gather or scatter ``nbytes`` (the hand-off's), or unpack them after a load."""

    def pack_s(self, nbytes: int) -> float:
        """A rank's time to save ``nbytes`` of new chunks to the pool, beyond moving them over its NIC."""

    def pool_load_s(self, nbytes: int) -> float:
        """A load worker's time to read ``nbytes`` of pool objects and unpack them into paged KV."""


@dataclass(frozen=True)
class AnalyticalCost:
    """The default cost model (see the module docstring)."""

    flops_per_token: float
    flops_per_token_ctx: float
    prefill_flops_s: float
    prefill_step_overhead_s: float
    decode_fixed_s: float
    decode_per_seq_s: float  # per sequence per step: per verified token x tokens verified per sequence
    decode_bytes_per_ctx_token: float
    decode_bytes_s: float
    unpack_bytes_s: float
    pool_load_bytes_s: float

    @classmethod
    def from_scenario(cls, s: Scenario) -> AnalyticalCost:
        c, g = s.cost, s.gpu
        return cls(
            flops_per_token=2.0 * s.model.active_params_b * 1e9 + c.attention_flops_per_token,
            flops_per_token_ctx=c.attention_flops_per_token_ctx,
            prefill_flops_s=s.prefill.gpus * g.dense_tflops * 1e12 * c.prefill_mfu,
            prefill_step_overhead_s=c.prefill_step_overhead_s,
            decode_fixed_s=c.decode_step_fixed_s,
            # with MTP a step verifies the draft as well: ceil(acceptance) tokens per sequence
            # (the smallest draft that reaches the pinned acceptance), each touching experts and
            # attention like a token of its own; without MTP one token per sequence
            decode_per_seq_s=c.decode_step_per_seq_s * math.ceil(s.decode.mtp_accept_tokens - 1e-9),
            decode_bytes_per_ctx_token=c.decode_kv_read_bytes_per_token,
            decode_bytes_s=g.hbm_tb_s * 1e12 * c.hbm_efficiency * s.decode.dcp,
            unpack_bytes_s=c.unpack_gb_s * 1e9,
            pool_load_bytes_s=c.pool_load_gb_s * 1e9,
        )

    def prefill_step_s(self, tokens_and_context: list[tuple[int, int]]) -> float:
        flops = 0.0
        for tokens, ctx in tokens_and_context:
            # attention over the context before the chunk plus, on average, half the chunk itself
            flops += tokens * (self.flops_per_token + self.flops_per_token_ctx * (ctx + tokens / 2))
        return self.prefill_step_overhead_s + flops / self.prefill_flops_s

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        if batch <= 0:
            return 0.0
        return (self.decode_fixed_s + self.decode_per_seq_s * batch
                + context_tokens * self.decode_bytes_per_ctx_token / self.decode_bytes_s)

    def unpack_s(self, nbytes: int) -> float:
        return nbytes / self.unpack_bytes_s

    def pack_s(self, nbytes: int) -> float:
        return nbytes / self.unpack_bytes_s  # packing costs what unpacking does

    def pool_load_s(self, nbytes: int) -> float:
        return nbytes / self.pool_load_bytes_s


def cost_model(s: Scenario) -> CostModel:
    """The scenario's cost model (see the module docstring); ``CalibrationError`` for a bad file."""
    analytic = AnalyticalCost.from_scenario(s)
    if s.cost.calibration is None:
        return analytic
    from kvpool.sim.calibration import CalibratedCost, load_calibration

    return CalibratedCost(load_calibration(s.cost.calibration), analytic, s.gpu.nic_gb_s * 1e9)
