"""Public ops: validate, then run Triton on a GPU and the torch reference on the CPU.

Primitives, grouped by caller:
    Stage-aligned restore and save (the store connector's worker side, one stage per GPU):
        ``pack(caches, block_ids, ...) -> objects``       paged KV -> 256-token chunk objects
        ``unpack(objects, caches, block_ids, ...)``        chunk objects -> paged KV
    Prefill -> decode handoff (``policy.layout.HandoffPlan`` decides who gets which token):
        ``gather_dcp(caches, block_ids, plan) -> staging`` prefill stage -> R rank buffers
        ``scatter_dcp(landing, caches, block_ids, plan, rank, offset_bytes)`` landing -> decode KV
        ``GatherDcp(caches)(block_ids, plan, out)``  the same gather, caches checked once (hot path)
        ``ScatterDcp(caches)(landing, block_ids, plan, rank, segments)``  several landed slices of a
            rank buffer in one launch, caches checked once (hot path)

Common arguments:
    caches: one tensor per segment, each ``[num_blocks, page_tokens, record]`` of any dtype whose
        record (last dim) is contiguous; block and token strides are free. Records move as bytes.
    block_ids: int32/int64, 1-D or 2-D (read row-major; any strides): entry ``k`` is the block
        holding tokens ``k*page_tokens .. (k+1)*page_tokens - 1`` of the sequence.
    backend: ``"auto"`` (Triton if the tensors are on a GPU, else the torch reference),
        ``"triton"`` (on the CPU only under Triton's interpreter, ``TRITON_INTERPRET=1``) or
        ``"torch"``.
    validate: check block ids against the caches (one host synchronization). Shape, stride,
        dtype and size checks always run; ``validate=False`` only skips reading the ids back.

Errors: ``TypeError`` (wrong type or dtype), ``ValueError`` (shape, stride, size, layout),
``IndexError`` (a block id out of range). No op ever copies an input to make it contiguous.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from kvpool.kernels import _checks as ck
from kvpool.kernels import reference as ref
from kvpool.kernels import triton_ops as tri
from kvpool.kernels.format import ChunkFormat
from kvpool.policy.layout import HandoffPlan

Backend = Literal["auto", "triton", "torch"]


def _use_triton(device: torch.device, backend: Backend) -> bool:
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if backend == "auto":
        return device.type != "cpu"
    return backend == "triton"


def pack(
    caches: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    num_chunks: int | None = None,
    chunk_tokens: int = 256,
    out: torch.Tensor | None = None,
    fmt: ChunkFormat | None = None,
    validate: bool = True,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Copy whole chunks of paged KV into contiguous chunk objects (pool format v1).

    Args:
        caches: the stage's per-layer caches in format order (``ChunkFormat.from_spec``).
        block_ids: the pages of the chunks in token order; chunk ``c`` covers table entries
            ``c*P .. c*P + P - 1`` with ``P = chunk_tokens // page_tokens``.
        num_chunks: chunks to pack; default: every full chunk the table covers.
        chunk_tokens: tokens per object, a multiple of ``page_tokens``.
        out: uint8 ``[>= num_chunks, object_bytes]`` with contiguous rows (rows may be strided,
            e.g. 4 KiB-aligned slots of a registered buffer); allocated when None.
        fmt: if given, the caches' record sizes and the chunk size must match it.

    Returns:
        ``out``: row ``c`` holds chunk ``c``: for each segment in order, ``chunk_tokens`` records.
    """
    geom = ck.check_caches(caches)
    if _use_triton(geom.device, backend):
        return tri.pack_triton(caches, block_ids, num_chunks, chunk_tokens, out, fmt, validate)
    geom, num_chunks, out = ck.prepare_chunks(caches, block_ids, num_chunks, chunk_tokens, out, fmt, validate, False)
    return ref.pack_ref(caches, block_ids, num_chunks, chunk_tokens, out)


def unpack(
    objects: torch.Tensor,
    caches: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    num_chunks: int | None = None,
    chunk_tokens: int = 256,
    fmt: ChunkFormat | None = None,
    validate: bool = True,
    backend: Backend = "auto",
) -> None:
    """Write chunk objects into the pages a block table names (inverse of ``pack``).

    Args:
        objects: uint8 ``[num_chunks, object_bytes]``, contiguous rows (row stride free). A row
            of another size is rejected: it means another layout.
        caches, block_ids, chunk_tokens, fmt: as for ``pack``; ``num_chunks`` defaults to
            ``objects.shape[0]``. With ``validate`` the pages written must be distinct.
    """
    geom = ck.check_caches(caches)
    if _use_triton(geom.device, backend):
        tri.unpack_triton(objects, caches, block_ids, num_chunks, chunk_tokens, fmt, validate)
        return
    geom, num_chunks, _ = ck.prepare_chunks(caches, block_ids, num_chunks, chunk_tokens, objects, fmt, validate, True)
    ref.unpack_ref(objects, caches, block_ids, num_chunks, chunk_tokens)


def gather_dcp(
    caches: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    plan: HandoffPlan,
    out: torch.Tensor | None = None,
    validate: bool = True,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Gather a prefill stage's handoff tokens into one staging buffer per decode rank.

    Args:
        caches: the stage's ``plan.layers`` caches, each with ``plan.record_bytes`` records.
        block_ids: the prefill block table over absolute positions (entry ``k`` holds tokens
            ``k*page_tokens ..``); it must cover ``plan.token_start + plan.tokens`` tokens.
        plan: the handoff (tokens, start, ranks, write cap).
        out: 1-D contiguous uint8 of at least ``plan.total_bytes``; allocated when None.

    Returns:
        ``out``: the R rank buffers back to back in rank order (``format.staging_views`` splits
        them; ``format.rank_buffer_offset_bytes`` gives offsets). Rank ``r``'s buffer is
        ``plan.buffer_bytes(r)`` bytes, layer-major: for each layer, one record per position of
        ``plan.rank_positions(r)`` in order. ``plan.writes(r)`` cuts it into writes <= 8 MiB.
    """
    geom = ck.check_caches(caches)
    if _use_triton(geom.device, backend):
        return tri.gather_dcp_triton(caches, block_ids, plan, out, validate)
    out = ck.prepare_gather_geom(geom, block_ids, plan, out, validate)
    return ref.gather_dcp_ref(caches, block_ids, plan, out)


def scatter_dcp(
    landing: torch.Tensor,
    caches: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    plan: HandoffPlan,
    rank: int,
    offset_bytes: int = 0,
    validate: bool = True,
    backend: Backend = "auto",
) -> None:
    """Scatter landed bytes of ``rank``'s staging buffer into the decode rank's paged KV.

    Args:
        landing: 1-D contiguous uint8 holding bytes ``offset_bytes .. offset_bytes + numel`` of
            rank ``rank``'s staging buffer (a whole buffer, or one landed write): whole records.
        caches: the decode rank's caches of the plan's layers (``plan.layers`` of them).
        block_ids: the decode rank's block table over its local token index: absolute position
            ``p`` (``p mod R == rank``) is local index ``p // R``.
        plan, rank: the handoff and the decode rank receiving it.
        offset_bytes: where ``landing`` starts in the rank buffer (a multiple of the record).
    """
    geom = ck.check_caches(caches)
    if _use_triton(geom.device, backend):
        tri.scatter_dcp_triton(landing, caches, block_ids, plan, rank, offset_bytes, validate)
        return
    geom, row0, rows = ck.prepare_scatter(landing, caches, block_ids, plan, rank, offset_bytes, validate)
    ref.scatter_dcp_ref(landing, caches, block_ids, plan, rank, row0)


class _BoundCaches:
    """Caches checked once and, on a GPU, their Triton launcher built once."""

    def __init__(self, caches: Sequence[torch.Tensor], backend: Backend = "auto") -> None:
        self.geom = ck.check_caches(caches)
        self.caches = list(caches)
        self.triton = _use_triton(self.geom.device, backend)
        self._launcher = tri.DcpLauncher(self.caches, tri._use_interpreter(self.geom.device, None)) if self.triton else None


class GatherDcp(_BoundCaches):
    """``gather_dcp`` bound to one list of caches (a prefill stage's layers).

    The caches are checked and their address table built once, here; each call checks only its
    own arguments (plan, block table, ``out``) and launches. Same contract and bytes as
    ``gather_dcp``. The caches must keep their storage, shapes and strides while bound.
    """

    def __call__(
        self, block_ids: torch.Tensor, plan: HandoffPlan, out: torch.Tensor | None = None, validate: bool = True
    ) -> torch.Tensor:
        out = ck.prepare_gather_geom(self.geom, block_ids, plan, out, validate)
        if self._launcher is not None:
            self._launcher.gather(block_ids, plan, out)
            return out
        return ref.gather_dcp_ref(self.caches, block_ids, plan, out)


class ScatterDcp(_BoundCaches):
    """``scatter_dcp`` bound to one list of caches (a decode rank's layers of one prefill stage),
    taking several landed slices of a rank buffer at once.

    ``segments`` are ``(landing_offset_bytes, buffer_offset_bytes, nbytes)``: bytes
    ``landing[landing_offset : +nbytes]`` are bytes ``buffer_offset ..`` of ``rank``'s staging
    buffer (whole records). On a GPU all segments go in one launch. The caches are checked once,
    here, and must keep their storage, shapes and strides while bound.
    """

    def __call__(
        self,
        landing: torch.Tensor,
        block_ids: torch.Tensor,
        plan: HandoffPlan,
        rank: int,
        segments: Sequence[tuple[int, int, int]],
        validate: bool = True,
    ) -> None:
        segs = ck.prepare_scatter_segments(self.geom, landing, block_ids, plan, rank, segments, validate)
        if self._launcher is not None:
            self._launcher.scatter(landing, block_ids, plan, rank, segs)
            return
        rec = plan.record_bytes
        for lo, row0, rows in segs:
            ref.scatter_dcp_ref(landing.narrow(0, lo, rows * rec), self.caches, block_ids, plan, rank, row0)
