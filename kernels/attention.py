"""MLA decode attention of a batch of sequences over DCP-sharded paged KV held in one cache tensor.

Contract:
    * ``DecodePlan.build(pages, positions, dcp, blocks_per_rank, page_tokens, device)``: one step's
      tables, built on the host once per step and uploaded in one copy. Sequence ``i`` has
      ``positions[i] + 1`` tokens (its new token included); token ``t`` lives on rank ``t mod dcp``
      at rank-local index ``t // dcp``; ``pages[i][r]`` lists its blocks on rank ``r`` (rank ``r``'s
      block ``b`` is block ``r * blocks_per_rank + b`` of the shared cache). Its tokens are cut into
      *parts*: per rank in rank order, runs of ``SPLIT_TOKENS`` rank-local tokens (the last one
      shorter). A plan also holds where each sequence's new record goes (``write_block``,
      ``write_slot``).
    * ``mla_decode(cache, qlat, qr, plan, scale, out, backend="auto")``: for every sequence ``i``,
      ``out[i] = softmax(scale * (qlat[i] ck^T + qr[i] kr^T)) ck`` over its tokens (``ck`` the
      512-wide latent, ``kr`` the 64-wide RoPE key of each cached record; ``qlat [rows, H, 512]``,
      ``qr [rows, H, 64]``, ``out [rows, H, 512]``, float32, row ``i`` for sequence ``i``): each part's
      partial (running max ``m``, sum of exponentials ``l``, weighted latent sum ``o``), then the
      exact log-sum-exp merge of the parts. Rows of ``out`` past the plan's sequences are untouched.
    * ``backend``: ``"triton"`` (compiled on a GPU; on the CPU under Triton's interpreter), ``"torch"``
      (``mla_decode_ref``), ``"auto"`` (Triton on a GPU, the reference on the CPU).
    * Batch invariance: a sequence's result depends on its own query, tokens and pages only, never
      on the other sequences of the plan or on its row. Triton: one program per (part, sequence)
      reads only that sequence's tables, then one program per sequence merges its parts in part
      order; the kernels take the batch-dependent sizes unspecialized. Reference: one sequence at a
      time, every shape its own.
    * The two backends agree to float32 rounding (they sum in different orders: the kernel runs an
      online softmax over tiles of ``BLOCK_TOKENS``, the reference one softmax per part); where
      every sum is exact (scores that give ``e^0`` or underflow, small dyadic keys) they agree bit
      for bit.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvpool.kernels.triton_ops import _interpret_env, _use_interpreter
from kvpool.policy.layout import rank_token_count

#: Rank-local tokens of one part (one program of the partials kernel).
SPLIT_TOKENS = 256
#: Tokens of one tile of the partials kernel.
BLOCK_TOKENS = 32
NUM_WARPS = 8
LATENT = 512
ROPE = 64
_KERNELS: dict[bool, Any] = {}


@dataclass
class DecodePlan:
    """One decode step's attention tables (see the module docstring). Device tensors are int64."""

    page_rows: torch.Tensor  # [seqs, ranks, rank_pages]: shared-cache block of each rank-local page
    parts: torch.Tensor  # [seqs, max_parts, 3]: rank, first rank-local token, tokens
    n_parts: torch.Tensor  # [seqs]
    write_block: torch.Tensor  # [seqs]: shared-cache block of the new token's record
    write_slot: torch.Tensor  # [seqs]: its slot in that block
    host_parts: list[int]  # per sequence, its number of parts
    host_longest: list[int]  # per sequence, its longest part in tokens

    @property
    def seqs(self) -> int:
        return len(self.host_parts)

    @classmethod
    def build(cls, pages: Sequence[Sequence[Sequence[int]]], positions: Sequence[int], dcp: int, blocks_per_rank: int,
              page_tokens: int, device: torch.device | str) -> DecodePlan:
        n, P = len(positions), page_tokens
        counts = [[rank_token_count(pos + 1, r, dcp) for r in range(dcp)] for pos in positions]
        width = max(1, max(-(-c // P) for cs in counts for c in cs))
        parts = [[(r, t0, min(SPLIT_TOKENS, c - t0)) for r, c in enumerate(cs) for t0 in range(0, c, SPLIT_TOKENS)]
                 for cs in counts]
        max_parts = max(len(p) for p in parts)
        flat: list[int] = []
        for i, cs in enumerate(counts):
            for r, c in enumerate(cs):
                mine = [r * blocks_per_rank + b for b in pages[i][r][: -(-c // P)]]
                flat += mine + [0] * (width - len(mine))
        for p in parts:
            for part in p:
                flat += part
            flat += [0, 0, 0] * (max_parts - len(p))
        flat += [len(p) for p in parts]
        for pos, pg in zip(positions, pages):
            owner, local = pos % dcp, pos // dcp
            flat.append(owner * blocks_per_rank + pg[owner][local // P])
        flat += [(pos // dcp) % P for pos in positions]
        t = torch.tensor(flat, dtype=torch.int64).to(device)
        a = n * dcp * width
        b = a + n * max_parts * 3
        return cls(t[:a].view(n, dcp, width), t[a:b].view(n, max_parts, 3), t[b:b + n], t[b + n:b + 2 * n],
                   t[b + 2 * n:], [len(p) for p in parts], [max(x[2] for x in p) for p in parts])


def mla_decode(cache: torch.Tensor, qlat: torch.Tensor, qr: torch.Tensor, plan: DecodePlan, scale: float,
               out: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """See the module docstring."""
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend: expected auto, triton or torch, got {backend!r}")
    if backend == "torch" or (backend == "auto" and cache.device.type == "cpu"):
        return mla_decode_ref(cache, qlat, qr, plan, scale, out)
    return mla_decode_triton(cache, qlat, qr, plan, scale, out)


def _read_records(cache: torch.Tensor, blocks: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Records at ``(blocks, slots)`` as float32, gathered as bytes (indexing is defined for uint8 on
    every device, not for every float8 type)."""
    raw = cache.view(torch.uint8)[blocks, slots]
    return raw.view(cache.dtype).float()


def mla_decode_ref(cache: torch.Tensor, qlat: torch.Tensor, qr: torch.Tensor, plan: DecodePlan, scale: float,
                   out: torch.Tensor) -> torch.Tensor:
    """The torch reference: per sequence, every part's partial from one batched product over
    ``[parts, longest part]`` keys (a shorter part's missing tokens masked), merged exactly."""
    P = cache.shape[1]
    for i in range(plan.seqs):
        parts = plan.parts[i, : plan.host_parts[i]]                                   # [J, 3]
        k = torch.arange(plan.host_longest[i], device=cache.device)
        valid = k[None, :] < parts[:, 2:3]                                             # [J, L]
        local = torch.where(valid, parts[:, 1:2] + k[None, :], parts[:, 1:2])
        blocks = plan.page_rows[i][parts[:, 0:1], local // P]
        keys = _read_records(cache, blocks, local % P)                                # [J, L, 576]
        ck, kr = keys[..., :LATENT], keys[..., LATENT:]
        scores = (qlat[i][None] @ ck.transpose(1, 2) + qr[i][None] @ kr.transpose(1, 2)) * scale
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))                # [J, H, L]
        mx = scores.max(dim=-1, keepdim=True).values                                   # every part holds a token
        e = torch.exp(scores - mx)
        w = torch.exp(mx - mx.max(dim=0).values[None])                                 # [J, H, 1]
        num = (w * (e @ ck)).sum(dim=0)
        den = (w * e.sum(dim=-1, keepdim=True)).sum(dim=0)
        out[i] = num / den
    return out


def _kernels(interpret: bool) -> Any:
    """The kernel module (once per mode; ``interpret`` selects Triton's CPU interpreter)."""
    if interpret not in _KERNELS:
        with _interpret_env(interpret):
            spec = importlib.util.spec_from_file_location(
                f"kvpool.kernels._attention_kernels_{'interpreted' if interpret else 'compiled'}",
                Path(__file__).with_name("_attention_kernels.py"))
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
            _KERNELS[interpret] = module
    return _KERNELS[interpret]


def _launch(kernel: Any, grid: tuple[int, ...], interpret: bool, *args: Any, **meta: Any) -> None:
    """One kernel launch (the single place every launch of this module goes through)."""
    with _interpret_env(True) if interpret else contextlib.nullcontext():
        kernel[grid](*args, **meta)


def head_pad(heads: int) -> int:
    """Query rows of one program: the heads padded to a power of two, at least 16 (``tl.dot``)."""
    return max(16, 1 << max(0, heads - 1).bit_length())


def mla_decode_triton(cache: torch.Tensor, qlat: torch.Tensor, qr: torch.Tensor, plan: DecodePlan, scale: float,
                      out: torch.Tensor, interpret: bool | None = None) -> torch.Tensor:
    """The Triton backend: a partials launch over (part, sequence), then a merge launch per sequence."""
    if plan.seqs == 0:
        return out
    _check(cache, qlat, qr, out)
    interp = _use_interpreter(cache.device, interpret)
    mod = _kernels(interp)
    n, J, H = plan.seqs, plan.parts.shape[1], qlat.shape[1]
    HP = head_pad(H)
    m = torch.empty(n, J, HP, dtype=torch.float32, device=cache.device)
    l_ = torch.empty_like(m)
    o = torch.empty(n, J, HP, LATENT, dtype=torch.float32, device=cache.device)
    _launch(mod._mla_partials_kernel, (J, n), interp,
            cache, cache.stride(0), cache.stride(1), qlat, qlat.stride(0), qlat.stride(1), qr, qr.stride(0), qr.stride(1),
            plan.page_rows, plan.parts, plan.n_parts, m, l_, o,
            float(scale), H, plan.page_rows.shape[2], J, plan.page_rows.shape[1],
            PAGE=cache.shape[1], LAT=LATENT, ROPE=ROPE, HP=HP, BLOCK=BLOCK_TOKENS, num_warps=NUM_WARPS)
    _launch(mod._mla_merge_kernel, (n,), interp, m, l_, o, plan.n_parts, out, out.stride(0), out.stride(1), H, J,
            LAT=LATENT, HP=HP, num_warps=NUM_WARPS)
    return out


def _check(cache: torch.Tensor, qlat: torch.Tensor, qr: torch.Tensor, out: torch.Tensor) -> None:
    if cache.dim() != 3 or cache.shape[2] != LATENT + ROPE or cache.stride(2) != 1:
        raise ValueError(f"cache: expected [blocks, page, {LATENT + ROPE}] with contiguous records, got "
                         f"{tuple(cache.shape)} strides {cache.stride()}")
    for name, t, width in (("qlat", qlat, LATENT), ("qr", qr, ROPE), ("out", out, LATENT)):
        if t.dtype != torch.float32 or t.dim() != 3 or t.shape[2] != width or t.stride(2) != 1:
            raise ValueError(f"{name}: expected float32 [rows, heads, {width}] with a contiguous last dim, got "
                             f"{t.dtype} {tuple(t.shape)} strides {t.stride()}")
        if t.device != cache.device:
            raise ValueError(f"{name} is on {t.device}, the cache on {cache.device}")

