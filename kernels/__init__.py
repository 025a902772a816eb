"""GPU kernels (Triton, portable to ROCm and CUDA) with pure-torch reference ops for the CPU.

Public ops (``kvpool.kernels.ops``): ``pack``, ``unpack`` (paged KV <-> 256-token chunk objects,
the pool byte format of ``docs/pool-format.md``) and ``gather_dcp``, ``scatter_dcp`` (a prefill
stage's layout <-> per-decode-rank staging buffers, following ``policy.layout.HandoffPlan``).
Each has a Triton host function (``triton_ops.*_triton``) and a torch reference (``reference.*_ref``).
``kvpool.kernels.attention``: the decode step's MLA attention of a batch of sequences over
DCP-sharded paged KV (``mla_decode``: a Triton kernel and its torch reference ``mla_decode_ref``).

Triton is imported only when a kernel launches, so this package imports on any machine.
"""

from kvpool.kernels.format import (
    SUPPORTED_FORMAT_VERSIONS,
    ChunkFormat,
    Segment,
    rank_buffer_offset_bytes,
    staging_views,
)
from kvpool.kernels.ops import GatherDcp, ScatterDcp, gather_dcp, pack, scatter_dcp, unpack
from kvpool.policy.chunks import POOL_FORMAT_VERSION

__all__ = [
    "POOL_FORMAT_VERSION",
    "SUPPORTED_FORMAT_VERSIONS",
    "ChunkFormat",
    "GatherDcp",
    "ScatterDcp",
    "Segment",
    "gather_dcp",
    "pack",
    "rank_buffer_offset_bytes",
    "scatter_dcp",
    "staging_views",
    "unpack",
]
