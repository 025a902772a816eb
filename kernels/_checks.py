"""Input checks shared by the torch references and the Triton host functions.

Every check raises ``ValueError``/``TypeError``/``IndexError`` with a message naming the argument;
nothing here copies, reshapes into a copy, or calls ``.contiguous()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpool.kernels.format import ChunkFormat
from kvpool.policy.layout import HandoffPlan

BLOCK_ID_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class CacheGeometry:
    """Byte geometry of a list of paged caches (one per segment)."""

    page_tokens: int
    num_blocks: int  # smallest block count over the caches: every block id must be below it
    record_bytes: tuple[int, ...]
    device: torch.device


def as_record_bytes(cache: torch.Tensor) -> torch.Tensor:
    """A ``[num_blocks, page_tokens, record_bytes]`` uint8 view of a paged cache (never a copy)."""
    if cache.dtype == torch.uint8:
        return cache
    return cache.view(torch.uint8)


def check_caches(caches: Sequence[torch.Tensor], name: str = "caches") -> CacheGeometry:
    """Validate paged caches: each ``[num_blocks, page_tokens, record]`` with a contiguous record.

    Records may have any dtype (FP8, BF16, uint8, ...); they move as bytes. Block and token strides
    are free (a cache may be a slice of a bigger tensor), but the record itself must be contiguous.
    """
    if isinstance(caches, torch.Tensor) or not isinstance(caches, Sequence) or len(caches) == 0:
        raise TypeError(f"{name} must be a non-empty list of tensors, one per segment")
    page_tokens = None
    num_blocks = None
    recs: list[int] = []
    device = None
    for i, c in enumerate(caches):
        if not isinstance(c, torch.Tensor):
            raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(c).__name__}")
        if c.dim() != 3:
            raise ValueError(
                f"{name}[{i}] must be 3-D [num_blocks, page_tokens, record], got shape {tuple(c.shape)}"
            )
        if c.dtype in (torch.bool,) or c.is_complex():
            raise TypeError(f"{name}[{i}] has dtype {c.dtype}; records must be plain numeric bytes")
        if c.shape[2] > 1 and c.stride(2) != 1:
            raise ValueError(
                f"{name}[{i}]: the record dimension must be contiguous (stride 1), got strides {c.stride()}"
            )
        if any(s < 0 for s in c.stride()):
            raise ValueError(f"{name}[{i}]: negative strides are not supported, got {c.stride()}")
        if device is None:
            device = c.device
        elif c.device != device:
            raise ValueError(f"{name}[{i}] is on {c.device}, but {name}[0] is on {device}")
        if page_tokens is None:
            page_tokens = c.shape[1]
        elif c.shape[1] != page_tokens:
            raise ValueError(f"{name}[{i}] has {c.shape[1]} tokens per page, {name}[0] has {page_tokens}")
        num_blocks = c.shape[0] if num_blocks is None else min(num_blocks, c.shape[0])
        rb = c.shape[2] * c.element_size()
        if rb <= 0:
            raise ValueError(f"{name}[{i}] has empty records")
        recs.append(rb)
    assert page_tokens is not None and num_blocks is not None and device is not None
    if page_tokens <= 0:
        raise ValueError(f"{name}: page_tokens must be > 0")
    return CacheGeometry(page_tokens, num_blocks, tuple(recs), device)


def check_block_ids(block_ids: torch.Tensor, pages_needed: int, device: torch.device, name: str = "block_ids") -> None:
    """Validate a block table: int32/int64, 1-D or 2-D (read row-major), on ``device``, long enough."""
    if not isinstance(block_ids, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(block_ids).__name__}")
    if block_ids.dtype not in BLOCK_ID_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {block_ids.dtype}")
    if block_ids.dim() not in (1, 2):
        raise ValueError(f"{name} must be 1-D or 2-D (read row-major), got shape {tuple(block_ids.shape)}")
    if block_ids.device != device:
        raise ValueError(f"{name} is on {block_ids.device}, the caches on {device}")
    if block_ids.numel() < pages_needed:
        raise ValueError(f"{name} names {block_ids.numel()} pages, {pages_needed} are needed")


def check_block_bounds(
    block_ids: torch.Tensor, pages: int, num_blocks: int, unique: bool, name: str = "block_ids", first: int = 0
) -> None:
    """Check ids ``first .. pages-1`` (row-major) are in ``0..num_blocks-1`` (and distinct if ``unique``).

    Reads the ids back to the host (one synchronization): the hot path may skip it with
    ``validate=False`` once the caller guarantees the table.
    """
    if pages <= first:
        return
    used = block_ids.reshape(-1)[first:pages]  # reading only; a reshape copy here is never written back
    lo, hi = (int(v) for v in torch.aminmax(used))
    if lo < 0 or hi >= num_blocks:
        bad = lo if lo < 0 else hi
        raise IndexError(f"{name} holds block id {bad}, out of range 0..{num_blocks - 1}")
    if unique and torch.unique(used).numel() != used.numel():
        raise ValueError(f"{name} names a block twice: the writes into it would race")


def check_objects(objects: torch.Tensor, num_chunks: int, fmt_bytes: int, device: torch.device, name: str) -> None:
    """Validate chunk objects: uint8 ``[num_chunks, object_bytes]``, each row contiguous."""
    if not isinstance(objects, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(objects).__name__}")
    if objects.dtype != torch.uint8:
        raise TypeError(f"{name} must be uint8 (raw bytes), got {objects.dtype}")
    if objects.dim() != 2:
        raise ValueError(f"{name} must be 2-D [num_chunks, object_bytes], got shape {tuple(objects.shape)}")
    if objects.device != device:
        raise ValueError(f"{name} is on {objects.device}, the caches on {device}")
    if objects.shape[1] != fmt_bytes:
        raise ValueError(
            f"{name} rows are {objects.shape[1]} B, but one chunk object is {fmt_bytes} B "
            "(a different size means a different layout)"
        )
    if objects.shape[0] < num_chunks:
        raise ValueError(f"{name} holds {objects.shape[0]} objects, {num_chunks} are needed")
    if fmt_bytes > 1 and objects.stride(1) != 1:
        raise ValueError(f"{name}: each object must be contiguous (stride 1 along bytes), got strides {objects.stride()}")
    if num_chunks > 1 and objects.stride(0) < fmt_bytes:
        raise ValueError(f"{name}: object stride {objects.stride(0)} B is smaller than an object ({fmt_bytes} B)")


def check_format(fmt: ChunkFormat | None, geom: CacheGeometry, chunk_tokens: int) -> None:
    """Check caches against an explicit format (segment count, record sizes, chunk size)."""
    if chunk_tokens <= 0 or chunk_tokens % geom.page_tokens:
        raise ValueError(f"chunk_tokens {chunk_tokens} must be a positive multiple of the page size {geom.page_tokens}")
    if fmt is None:
        return
    if fmt.chunk_tokens != chunk_tokens:
        raise ValueError(f"format has {fmt.chunk_tokens}-token chunks, the call {chunk_tokens}")
    if fmt.record_bytes != geom.record_bytes:
        raise ValueError(
            f"caches have record sizes {list(geom.record_bytes)} B, the format expects {list(fmt.record_bytes)} B"
        )


def check_flat(buf: torch.Tensor, min_bytes: int, device: torch.device, name: str) -> None:
    """Validate a 1-D contiguous uint8 buffer of at least ``min_bytes``."""
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(buf).__name__}")
    if buf.dtype != torch.uint8:
        raise TypeError(f"{name} must be uint8 (raw bytes), got {buf.dtype}")
    if buf.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(buf.shape)}")
    if buf.numel() > 1 and buf.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous, got stride {buf.stride(0)}")
    if buf.device != device:
        raise ValueError(f"{name} is on {buf.device}, the caches on {device}")
    if buf.numel() < min_bytes:
        raise ValueError(f"{name} is {buf.numel()} B, too small: {min_bytes} B are needed")


def check_plan_caches(plan: HandoffPlan, geom: CacheGeometry, name: str = "caches") -> None:
    """The caches must be the plan's layers, each with the plan's record size."""
    if not isinstance(plan, HandoffPlan):
        raise TypeError(f"plan must be a policy.layout.HandoffPlan, got {type(plan).__name__}")
    if len(geom.record_bytes) != plan.layers:
        raise ValueError(f"{name} holds {len(geom.record_bytes)} layers, the plan {plan.layers}")
    bad = [i for i, b in enumerate(geom.record_bytes) if b != plan.record_bytes]
    if bad:
        raise ValueError(
            f"{name}[{bad[0]}] has {geom.record_bytes[bad[0]]} B records, the plan {plan.record_bytes} B"
        )


def pages_for(tokens_end: int, page_tokens: int) -> int:
    """Pages covering token positions ``0 .. tokens_end - 1``."""
    return -(-tokens_end // page_tokens)


def scatter_rows(plan: HandoffPlan, rank: int, offset_bytes: int, landing_bytes: int) -> tuple[int, int]:
    """Rows ``[row0, row0 + rows)`` of ``rank``'s staging buffer held by a landing buffer."""
    if not 0 <= rank < plan.ranks:
        raise ValueError(f"rank {rank} out of range 0..{plan.ranks - 1}")
    rec = plan.record_bytes
    size = plan.buffer_bytes(rank)
    if offset_bytes < 0 or offset_bytes % rec:
        raise ValueError(f"offset_bytes {offset_bytes} must be >= 0 and a multiple of the record ({rec} B)")
    if landing_bytes % rec:
        raise ValueError(f"landing holds {landing_bytes} B, not a whole number of {rec} B records")
    if offset_bytes + landing_bytes > size:
        raise ValueError(
            f"landing bytes {offset_bytes}..{offset_bytes + landing_bytes} run past rank {rank}'s buffer ({size} B)"
        )
    return offset_bytes // rec, landing_bytes // rec


# ---------------------------------------------------------------- whole-op checks (all backends)


def prepare_chunks(
    caches: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    num_chunks: int | None,
    chunk_tokens: int,
    objects: torch.Tensor | None,
    fmt: ChunkFormat | None,
    validate: bool,
    to_paged: bool,
) -> tuple[CacheGeometry, int, torch.Tensor]:
    """Shared checks of pack/unpack; allocates ``out`` for pack when it is None."""
    geom = check_caches(caches)
    check_format(fmt, geom, chunk_tokens)
    check_block_ids(block_ids, 0, geom.device)
    ppc = chunk_tokens // geom.page_tokens
    if num_chunks is None:
        num_chunks = objects.shape[0] if (to_paged and objects is not None and objects.dim() == 2) else block_ids.numel() // ppc
    if num_chunks < 0:
        raise ValueError(f"num_chunks must be >= 0, got {num_chunks}")
    check_block_ids(block_ids, num_chunks * ppc, geom.device)
    obj_bytes = chunk_tokens * sum(geom.record_bytes)
    if objects is None:
        objects = torch.empty((num_chunks, obj_bytes), dtype=torch.uint8, device=geom.device)
    check_objects(objects, num_chunks, obj_bytes, geom.device, "objects" if to_paged else "out")
    if validate:
        check_block_bounds(block_ids, num_chunks * ppc, geom.num_blocks, unique=to_paged)
    return geom, num_chunks, objects


def prepare_gather(
    caches: Sequence[torch.Tensor], block_ids: torch.Tensor, plan: HandoffPlan, out: torch.Tensor | None, validate: bool
) -> tuple[CacheGeometry, torch.Tensor]:
    """Shared checks of gather_dcp; allocates ``out`` (the staging tensor) when it is None."""
    geom = check_caches(caches)
    return geom, prepare_gather_geom(geom, block_ids, plan, out, validate)


def prepare_gather_geom(
    geom: CacheGeometry, block_ids: torch.Tensor, plan: HandoffPlan, out: torch.Tensor | None, validate: bool
) -> torch.Tensor:
    """``prepare_gather`` for caches already checked (``geom``); returns ``out``."""
    check_plan_caches(plan, geom)
    pages = pages_for(plan.token_start + plan.tokens, geom.page_tokens) if plan.tokens else 0
    check_block_ids(block_ids, pages, geom.device)
    if out is None:
        out = torch.empty(plan.total_bytes, dtype=torch.uint8, device=geom.device)
    check_flat(out, plan.total_bytes, geom.device, "out")
    if validate:
        check_block_bounds(block_ids, pages, geom.num_blocks, unique=False)
    return out


def prepare_scatter(
    landing: torch.Tensor,
    caches: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    plan: HandoffPlan,
    rank: int,
    offset_bytes: int,
    validate: bool,
) -> tuple[CacheGeometry, int, int]:
    """Shared checks of scatter_dcp; returns the geometry and the landing's buffer rows (first, count)."""
    geom = check_caches(caches)
    check_plan_caches(plan, geom)
    check_flat(landing, 0, geom.device, "landing")
    row0, rows = scatter_rows(plan, rank, offset_bytes, landing.numel())
    check_rank_pages(geom, block_ids, plan, rank, bool(rows), validate)
    return geom, row0, rows


def prepare_scatter_segments(
    geom: CacheGeometry,
    landing: torch.Tensor,
    block_ids: torch.Tensor,
    plan: HandoffPlan,
    rank: int,
    segments: Sequence[tuple[int, int, int]],
    validate: bool,
) -> list[tuple[int, int, int]]:
    """Checks of a multi-segment scatter over caches already checked (``geom``).

    ``segments``: ``(landing_offset_bytes, buffer_offset_bytes, nbytes)``: bytes
    ``landing[landing_offset : +nbytes]`` are bytes ``buffer_offset ..`` of ``rank``'s staging buffer.
    Returns ``(landing_offset_bytes, row0, rows)`` per non-empty segment.
    """
    check_plan_caches(plan, geom)
    check_flat(landing, 0, geom.device, "landing")
    out = []
    for i, (lo, off, n) in enumerate(segments):
        if lo < 0 or n < 0 or lo + n > landing.numel():
            raise ValueError(f"segment {i}: landing bytes {lo}..{lo + n} outside the landing's {landing.numel()} B")
        row0, rows = scatter_rows(plan, rank, off, n)
        if rows:
            out.append((lo, row0, rows))
    check_rank_pages(geom, block_ids, plan, rank, bool(out), validate)
    return out


def check_rank_pages(geom: CacheGeometry, block_ids: torch.Tensor, plan: HandoffPlan, rank: int,
                     any_rows: bool, validate: bool) -> None:
    """The block table of a scatter into ``rank``'s pages: long enough for the pages its tokens
    touch (none when no row lands) and, with ``validate``, distinct in-range blocks."""
    if not any_rows:
        check_block_ids(block_ids, 0, geom.device)
        return
    positions = plan.rank_positions(rank)
    first_page = positions[0] // plan.ranks // geom.page_tokens
    pages = positions[-1] // plan.ranks // geom.page_tokens + 1
    check_block_ids(block_ids, pages, geom.device)
    if validate:
        check_block_bounds(block_ids, pages, geom.num_blocks, unique=True, first=first_page)
