"""Pure-torch reference ops: the definition of each op's result, on any device.

Primitives (each the ground truth its Triton twin is tested against with ``torch.equal``):
    ``pack_ref(caches, block_ids, num_chunks, chunk_tokens, out)``      paged KV -> chunk objects
    ``unpack_ref(objects, caches, block_ids, num_chunks, chunk_tokens)`` chunk objects -> paged KV
    ``gather_dcp_ref(caches, block_ids, plan, out)``                     stage layout -> staging
    ``scatter_dcp_ref(landing, caches, block_ids, plan, rank, row0)``    landing -> decode paged KV

They take inputs already validated by the public functions (``kvpool.kernels.ops``) and are written
for clarity with torch indexing, one segment (per-layer cache) at a time.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvpool.kernels._checks import as_record_bytes
from kvpool.policy.layout import HandoffPlan


def _flat_ids(block_ids: torch.Tensor) -> torch.Tensor:
    return block_ids.reshape(-1).long()


def pack_ref(
    caches: Sequence[torch.Tensor], block_ids: torch.Tensor, num_chunks: int, chunk_tokens: int, out: torch.Tensor
) -> torch.Tensor:
    """Copy chunks ``0..num_chunks-1`` (tokens ``c*C .. c*C+C-1`` of the table) into ``out[c]``."""
    page = caches[0].shape[1]
    pages = _flat_ids(block_ids)[: num_chunks * chunk_tokens // page]
    off = 0
    for cache in caches:
        b = as_record_bytes(cache)
        rec = b.shape[2]
        seg = b[pages].reshape(num_chunks, chunk_tokens * rec)  # [chunk, token-major records]
        out[:num_chunks, off : off + chunk_tokens * rec] = seg
        off += chunk_tokens * rec
    return out


def unpack_ref(
    objects: torch.Tensor, caches: Sequence[torch.Tensor], block_ids: torch.Tensor, num_chunks: int, chunk_tokens: int
) -> None:
    """Inverse of ``pack_ref``: write ``objects[c]`` into the pages the table names for chunk ``c``."""
    page = caches[0].shape[1]
    pages = _flat_ids(block_ids)[: num_chunks * chunk_tokens // page]
    off = 0
    for cache in caches:
        b = as_record_bytes(cache)
        rec = b.shape[2]
        seg = objects[:num_chunks, off : off + chunk_tokens * rec].reshape(-1, page, rec)
        b[pages] = seg
        off += chunk_tokens * rec


def _slots(block_ids: torch.Tensor, positions: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = _flat_ids(block_ids)
    return ids[positions // page], positions % page


def gather_dcp_ref(
    caches: Sequence[torch.Tensor], block_ids: torch.Tensor, plan: HandoffPlan, out: torch.Tensor
) -> torch.Tensor:
    """Rank buffers back to back; rank ``r``'s: per layer, its tokens ``t = r (mod R)`` in order."""
    page = caches[0].shape[1]
    off = 0
    for r in range(plan.ranks):
        pos = torch.tensor(list(plan.rank_positions(r)), dtype=torch.long, device=block_ids.device)
        blk, slot = _slots(block_ids, pos, page)
        for cache in caches:
            rows = as_record_bytes(cache)[blk, slot]  # [n_r, rec]
            out[off : off + rows.numel()] = rows.reshape(-1)
            off += rows.numel()
    return out


def scatter_dcp_ref(
    landing: torch.Tensor,
    caches: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    plan: HandoffPlan,
    rank: int,
    row0: int = 0,
) -> None:
    """Write landing rows ``row0 ..`` of ``rank``'s staging buffer into the decode rank's pages.

    Row ``g`` of the buffer is layer ``g // n_r``, rank token ``j = g % n_r``, absolute position
    ``p = first + j*R``, decode-local index ``p // R`` in the decode block table.
    """
    page = caches[0].shape[1]
    rec = plan.record_bytes
    n_r = plan.rank_tokens(rank)
    rows = landing.numel() // rec
    if rows == 0:
        return
    positions = list(plan.rank_positions(rank))
    g = torch.arange(row0, row0 + rows, device=landing.device)
    layer = g // n_r
    local = torch.tensor(positions, dtype=torch.long, device=landing.device)[g % n_r] // plan.ranks
    blk, slot = _slots(block_ids, local, page)
    data = landing.view(rows, rec)
    for li in torch.unique(layer).tolist():
        sel = layer == li
        as_record_bytes(caches[li])[blk[sel], slot[sel]] = data[sel]
