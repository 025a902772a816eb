"""The pool object byte format (version 1) and the DCP staging buffer layout, as plain integers.

Primitives:
    Building a format (backend connector, once per deployment):
        ``ChunkFormat.from_spec(spec, stage, chunk_tokens)``: the segments of one stage's chunk object.
        ``ChunkFormat(segments, chunk_tokens)``: the same from explicit record sizes (tests, tools).
    Addressing inside an object (docs, debugging, the ops' host checks):
        ``ChunkFormat.object_bytes``, ``ChunkFormat.segment_offset_bytes(i)``.
    Addressing the handoff staging buffer (gather_dcp / scatter_dcp, the write plan):
        ``rank_buffer_offset_bytes(plan, rank)``, ``staging_views(staging, plan)``.

Byte format of a chunk object (``POOL_FORMAT_VERSION`` 1, see docs/pool-format.md):
    An object holds ``chunk_tokens`` consecutive tokens of one pipeline stage. It is the
    concatenation of its *segments* in order; a segment is one per-layer cache (the MLA latent of a
    layer, the indexer key of a layer, ...) and holds ``chunk_tokens`` records of that cache, token
    by token, each record ``record_bytes`` raw bytes copied unchanged (FP8, BF16, mixed). Segment
    order is layer-major: for each layer of the stage in layer-id order, its main record, then its
    extra records in ``KVSpec.extra_records`` order. There is no header and no padding: an object
    is exactly ``chunk_tokens * sum(record_bytes)`` bytes, which equals
    ``KVSpec.chunk_object_bytes(stage, chunk_tokens)``. The version is part of the key namespace
    (``policy.chunks.namespace_for``), so objects of another version are never read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from kvpool.policy.chunks import POOL_FORMAT_VERSION
from kvpool.policy.kvspec import KVSpec
from kvpool.policy.layout import HandoffPlan

if TYPE_CHECKING:  # torch is only needed by staging_views
    import torch

#: Format versions these kernels read and write.
SUPPORTED_FORMAT_VERSIONS: tuple[int, ...] = (POOL_FORMAT_VERSION,)


@dataclass(frozen=True)
class Segment:
    """One per-layer cache inside a chunk object.

    Attributes:
        layer_id: model layer id (ids ``>= KVSpec.layers`` are MTP layers).
        record: record name: ``"kv"`` for the main record, else the extra record's name.
        record_bytes: bytes per token of this cache.
    """

    layer_id: int
    record: str
    record_bytes: int

    def __post_init__(self) -> None:
        if self.record_bytes <= 0:
            raise ValueError(f"segment layer {self.layer_id} {self.record!r}: record_bytes must be > 0")


@dataclass(frozen=True)
class ChunkFormat:
    """Byte layout of one stage's chunk object. See the module docstring.

    Attributes:
        segments: the object's segments in order (one per cache tensor handed to ``pack``).
        chunk_tokens: tokens per object (256 in the seed).
        version: pool format version (must be in ``SUPPORTED_FORMAT_VERSIONS``).
    """

    segments: tuple[Segment, ...]
    chunk_tokens: int
    version: int = POOL_FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.version not in SUPPORTED_FORMAT_VERSIONS:
            raise ValueError(
                f"pool format version {self.version} is not supported (supported: {SUPPORTED_FORMAT_VERSIONS})"
            )
        if not self.segments:
            raise ValueError("a chunk format needs at least one segment")
        if self.chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be > 0, got {self.chunk_tokens}")

    @classmethod
    def from_spec(cls, spec: KVSpec, stage: int, chunk_tokens: int = 256) -> ChunkFormat:
        """Segments of ``stage``'s object: per layer in id order, the main record then extras."""
        if chunk_tokens % spec.page_tokens:
            raise ValueError(f"chunk_tokens {chunk_tokens} must be a multiple of the page size {spec.page_tokens}")
        segs: list[Segment] = []
        for layer in spec.stage_layer_ids(stage):
            segs.append(Segment(layer, "kv", spec.record_bytes))
            for rec in spec.extra_records:
                if layer in rec.layer_ids:
                    segs.append(Segment(layer, rec.name, rec.bytes_per_token))
        fmt = cls(tuple(segs), chunk_tokens)
        assert fmt.object_bytes == spec.chunk_object_bytes(stage, chunk_tokens)
        return fmt

    @classmethod
    def from_record_bytes(cls, record_bytes: Sequence[int], chunk_tokens: int = 256) -> ChunkFormat:
        """A format whose segment ``i`` has ``record_bytes[i]`` bytes per token (layer ids 0..n-1)."""
        return cls(tuple(Segment(i, "kv", int(b)) for i, b in enumerate(record_bytes)), chunk_tokens)

    @property
    def record_bytes(self) -> tuple[int, ...]:
        """Bytes per token of each segment, in order."""
        return tuple(s.record_bytes for s in self.segments)

    @property
    def bytes_per_token(self) -> int:
        """Bytes per token over all segments."""
        return sum(self.record_bytes)

    @property
    def object_bytes(self) -> int:
        """Size of one chunk object."""
        return self.chunk_tokens * self.bytes_per_token

    @cached_property
    def _offsets(self) -> tuple[int, ...]:
        offs, acc = [], 0
        for b in self.record_bytes:
            offs.append(acc)
            acc += self.chunk_tokens * b
        return tuple(offs)

    def segment_offset_bytes(self, index: int) -> int:
        """Byte offset of segment ``index`` inside an object."""
        return self._offsets[index]


def rank_buffer_offset_bytes(plan: HandoffPlan, rank: int) -> int:
    """Offset of ``rank``'s buffer inside the one staging tensor of ``gather_dcp``.

    The staging tensor holds the R rank buffers back to back in rank order; rank ``r``'s buffer is
    ``plan.buffer_bytes(r)`` bytes, layer-major (for each layer, the rank's tokens in position order).
    """
    if not 0 <= rank < plan.ranks:
        raise ValueError(f"rank {rank} out of range 0..{plan.ranks - 1}")
    return sum(plan.buffer_bytes(q) for q in range(rank))


def staging_views(staging: torch.Tensor, plan: HandoffPlan) -> list[torch.Tensor]:
    """Per-rank 1-D views of a staging tensor (no copy); ``plan.writes(r)`` offsets index view ``r``."""
    if staging.dim() != 1 or staging.numel() < plan.total_bytes:
        raise ValueError(
            f"staging must be a 1-D tensor of at least {plan.total_bytes} B, got shape {tuple(staging.shape)}"
        )
    return [
        staging.narrow(0, rank_buffer_offset_bytes(plan, r), plan.buffer_bytes(r)) for r in range(plan.ranks)
    ]
