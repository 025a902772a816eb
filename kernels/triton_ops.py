"""Triton kernel and host functions for the four ops (portable Triton: CUDA and ROCm alike).

Primitives:
    Host functions (validate, then launch; tensors on a GPU, or on the CPU under Triton's
    interpreter when ``TRITON_INTERPRET=1`` or ``interpret=True``):
        ``pack_triton``, ``unpack_triton``, ``gather_dcp_triton``, ``scatter_dcp_triton``.
    The one kernel behind them: ``_copy_rows_kernel`` (built lazily by ``_kernel(interpret)``).

Design. Every op moves *rows*: one token's record of one per-layer cache (576 B latent, 144 B
indexer, ...). A row has a paged side (cache base + block id x block stride + slot x token stride)
and a flat side (chunk object or staging buffer). A program copies a ``ROWS x COLS`` tile: ``ROWS``
rows of one launch, ``COLS`` the record's words rounded up to a power of two (masked). The block id
is read once per row. Records move as 4-, 2- or 1-byte words, the widest that divides every
address, stride and record size, with ``tl.multiple_of`` hints up to 16 B so loads vectorize.
All addresses are word offsets from one anchor pointer (the first cache), so one launch reaches any
number of caches; per-cache bases and strides sit in a small int64 table cached across calls.

Triton is imported only inside ``_kernel``; importing this module needs torch alone.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from kvpool.kernels import _checks as ck
from kvpool.kernels.format import ChunkFormat
from kvpool.policy.layout import HandoffPlan

MODE_CHUNK = 0  # pack / unpack: groups are chunks
MODE_GATHER = 1  # gather_dcp: groups are decode ranks, rank buffers back to back
MODE_SCATTER = 2  # scatter_dcp: one rank, a landing slice of its buffer

#: Tuning knobs (bench/kernels.py sweeps them): words per program tile, warps per program.
TILE_WORDS = 4096
NUM_WARPS = 4
_MAX_GRID_Y = 65535
_KERNELS: dict[bool, Any] = {}
_TABLES: OrderedDict[tuple, torch.Tensor] = OrderedDict()
_TABLES_MAX = 64


def _kernel(interpret: bool) -> Any:
    """Build (once per mode) the row-copy kernel; ``interpret`` selects Triton's CPU interpreter."""
    if interpret in _KERNELS:
        return _KERNELS[interpret]
    with _interpret_env(interpret):
        import triton
        import triton.language as tl

        @triton.jit
        def _copy_rows_kernel(
            anchor_ptr,  # *word: every address below is a word offset from here
            seg_ptr,  # *i64 [4, n_seg]: paged base, block stride, token stride, flat offset (words)
            bt_ptr,  # *i32|i64 block table, read row-major through (bt_cols, bt_s0, bt_s1)
            bt_cols,
            bt_s0,
            bt_s1,
            n_seg,  # segments in this launch
            flat_off,  # words: flat buffer base (minus row0*REC for scatter)
            group_stride,  # MODE_CHUNK: words between objects
            tokens,  # MODE_GATHER/SCATTER: handoff tokens
            token_start,  # MODE_GATHER/SCATTER: absolute position of the first one
            ranks,  # MODE_GATHER/SCATTER: DCP size
            rank0,  # MODE_SCATTER: the rank; MODE_GATHER: 0 (rank = rank0 + program_id(1))
            row_lo,  # MODE_SCATTER: first buffer row held by the landing slice
            row_hi,  # MODE_SCATTER: one past the last
            grp0,  # first group of this launch (grids are split at 65535 groups)
            MODE: tl.constexpr,
            TO_PAGED: tl.constexpr,
            PAGE: tl.constexpr,  # tokens per page
            CHUNK: tl.constexpr,  # MODE_CHUNK: tokens per chunk (rows per segment)
            BT_2D: tl.constexpr,  # block table is 2-D (else bt_cols is unused)
            REC: tl.constexpr,  # words per record
            COLS: tl.constexpr,  # next power of two >= REC
            ROWS: tl.constexpr,
            ALIGN: tl.constexpr,  # words: every row offset is a multiple of this
        ):
            # Index math in int32 (host checks rows and positions < 2**31), addresses in int64.
            pid = tl.program_id(0)
            grp = tl.program_id(1) + grp0
            g = pid * ROWS + tl.arange(0, ROWS)
            if MODE == 0:
                mask = g < n_seg * CHUNK
                s = g // CHUNK
                i = g - s * CHUNK
                pos = grp * CHUNK + i
                s = tl.where(mask, s, 0)
                flat_seg = tl.load(seg_ptr + 3 * n_seg + s, mask=mask, other=0)
                flat_row = flat_off + grp.to(tl.int64) * group_stride + flat_seg + i.to(tl.int64) * REC
            else:
                r = rank0 + grp
                end = token_start + tokens
                n_r = (end - r + ranks - 1) // ranks - (token_start - r + ranks - 1) // ranks
                first = token_start + (r + ranks - token_start % ranks) % ranks
                if MODE == 1:
                    mask = g < n_seg * n_r
                    # handoff tokens of lower ranks: #p in [start, end) with p mod R < r
                    before = (end // ranks) * r + tl.minimum(end % ranks, r)
                    before -= (token_start // ranks) * r + tl.minimum(token_start % ranks, r)
                    flat_row = flat_off + (before * n_seg + g).to(tl.int64) * REC
                else:
                    g = g + row_lo
                    mask = g < row_hi
                    flat_row = flat_off + g.to(tl.int64) * REC
                s = g // tl.maximum(n_r, 1)
                j = g - s * n_r
                pos = first + j * ranks
                if MODE == 2:
                    pos = pos // ranks  # decode-local index
                s = tl.where(mask, s, 0)
            page = pos // PAGE
            slot = pos - page * PAGE
            if BT_2D:
                prow = page // bt_cols
                bt_off = prow.to(tl.int64) * bt_s0 + (page - prow * bt_cols).to(tl.int64) * bt_s1
            else:
                bt_off = page.to(tl.int64) * bt_s1
            bid = tl.load(bt_ptr + bt_off, mask=mask, other=0).to(tl.int64)
            seg_base = tl.load(seg_ptr + s, mask=mask, other=0)
            seg_bs = tl.load(seg_ptr + n_seg + s, mask=mask, other=0)
            seg_ts = tl.load(seg_ptr + 2 * n_seg + s, mask=mask, other=0)
            paged_row = seg_base + bid * seg_bs + slot.to(tl.int64) * seg_ts
            paged_row = tl.multiple_of(paged_row, ALIGN)
            flat_row = tl.multiple_of(flat_row, ALIGN)
            cols = tl.arange(0, COLS)
            m2 = mask[:, None] & (cols < REC)[None, :]
            if TO_PAGED:
                src = flat_row
                dst = paged_row
            else:
                src = paged_row
                dst = flat_row
            v = tl.load(anchor_ptr + src[:, None] + cols[None, :], mask=m2)
            tl.store(anchor_ptr + dst[:, None] + cols[None, :], v, mask=m2)

        _KERNELS[interpret] = (_copy_rows_kernel, triton)
    return _KERNELS[interpret]


@contextlib.contextmanager
def _interpret_env(interpret: bool) -> Iterator[None]:
    """Triton reads TRITON_INTERPRET when a kernel is decorated and again inside interpreted
    launches; set it for exactly that span so no other Triton user in the process is affected."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


# ----------------------------------------------------------------------------------------------
# host side


def _use_interpreter(device: torch.device, interpret: bool | None) -> bool:
    """On the CPU the kernels run under Triton's interpreter; on a GPU compiled unless asked."""
    if device.type == "cpu":
        if interpret is False:
            raise RuntimeError("compiled Triton kernels need a GPU; on the CPU use the interpreter or the reference")
        return True
    return bool(interpret)


_WORDS = {4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _word_bytes(quantities: Sequence[int]) -> tuple[int, int]:
    """(word bytes, alignment in words) for byte quantities: addresses, strides, record sizes."""
    g = 0
    for q in quantities:
        g = math.gcd(g, int(q))
    g = math.gcd(g, 16) if g else 16
    word = 4 if g % 4 == 0 else 2 if g % 2 == 0 else 1
    return word, g // word


def _cache_quantities(caches: Sequence[torch.Tensor]) -> list[int]:
    out = []
    for c in caches:
        es = c.element_size()
        out += [c.data_ptr(), c.stride(0) * es, c.stride(1) * es, c.shape[2] * es]
    return out


def _seg_table(
    caches: Sequence[torch.Tensor], index: Sequence[int], word: int, flat_bytes: Sequence[int]
) -> torch.Tensor:
    """int64 [4, n] table (paged base, block stride, token stride, flat offset) in words, cached."""
    anchor = caches[0].data_ptr()
    sel = [caches[i] for i in index]
    key = (
        caches[0].device,
        anchor,
        word,
        tuple((c.data_ptr(), tuple(c.shape), c.stride(), c.element_size()) for c in sel),
        tuple(flat_bytes),
    )
    hit = _TABLES.get(key)
    if hit is not None:
        _TABLES.move_to_end(key)
        return hit
    rows: list[list[int]] = [[], [], [], []]
    for c, fb in zip(sel, flat_bytes):
        es = c.element_size()
        rows[0].append((c.data_ptr() - anchor) // word)
        rows[1].append(c.stride(0) * es // word)
        rows[2].append(c.stride(1) * es // word)
        rows[3].append(fb // word)
    table = torch.tensor(rows, dtype=torch.int64).to(caches[0].device)
    _TABLES[key] = table
    if len(_TABLES) > _TABLES_MAX:
        _TABLES.popitem(last=False)
    return table


def _launch(
    caches: Sequence[torch.Tensor],
    index: Sequence[int],
    flat_bytes: Sequence[int],
    block_ids: torch.Tensor,
    word: int,
    align: int,
    rec_bytes: int,
    grid_rows: int,
    groups: int,
    interpret: bool,
    **scalars: int,
) -> None:
    kernel, triton = _kernel(interpret)
    table = _seg_table(caches, index, word, flat_bytes)
    rec = rec_bytes // word
    cols = triton.next_power_of_2(rec)
    rows = max(1, min(max(1, TILE_WORDS // cols), triton.next_power_of_2(max(grid_rows, 1))))
    anchor = triton.reinterpret(caches[0], _tl_word(word))
    a = dict(
        n_seg=len(index), flat_off=0, group_stride=0, chunk_tokens=1,
        tokens=0, token_start=0, ranks=1, rank0=0, row_lo=0, row_hi=0,
    )
    a.update(scalars)
    n_tiles = triton.cdiv(grid_rows, rows)
    if n_tiles == 0 or groups == 0:
        return
    if grid_rows >= 2**31 or groups * a["chunk_tokens"] >= 2**31 or a["token_start"] + a["tokens"] >= 2**31:
        raise ValueError("one launch is limited to 2**31 rows and token positions")
    bt_2d = block_ids.dim() == 2
    bt_cols = block_ids.shape[1] if bt_2d else 1
    bt_s0 = block_ids.stride(0) if bt_2d else 0
    bt_s1 = block_ids.stride(1) if bt_2d else block_ids.stride(0)
    with _interpret_env(True) if interpret else contextlib.nullcontext():
        for g0 in range(0, groups, _MAX_GRID_Y):
            kernel[(n_tiles, min(_MAX_GRID_Y, groups - g0))](
                anchor, table, block_ids, max(bt_cols, 1), bt_s0, bt_s1,
                a["n_seg"], a["flat_off"], a["group_stride"],
                a["tokens"], a["token_start"], a["ranks"], a["rank0"], a["row_lo"], a["row_hi"], g0,
                MODE=a["mode"], TO_PAGED=a["to_paged"], PAGE=caches[0].shape[1], CHUNK=a["chunk_tokens"],
                BT_2D=bt_2d, REC=rec, COLS=cols, ROWS=rows, ALIGN=align, num_warps=NUM_WARPS,
            )


def _tl_word(word: int) -> Any:
    import triton.language as tl

    return {4: tl.int32, 2: tl.int16, 1: tl.uint8}[word]


def _chunk_op(
    caches: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    objects: torch.Tensor,
    num_chunks: int,
    chunk_tokens: int,
    to_paged: bool,
    interpret: bool,
) -> None:
    recs = [c.shape[2] * c.element_size() for c in caches]
    offsets, acc = [], 0
    for rb in recs:
        offsets.append(acc)
        acc += chunk_tokens * rb
    quantities = _cache_quantities(caches) + [objects.data_ptr(), objects.stride(0)]
    word, align = _word_bytes(quantities)
    flat_off = (objects.data_ptr() - caches[0].data_ptr()) // word
    by_rec: dict[int, list[int]] = {}
    for i, rb in enumerate(recs):
        by_rec.setdefault(rb, []).append(i)
    for rb, index in by_rec.items():  # one launch per record size (REC is a compile-time constant)
        _launch(
            caches, index, [offsets[i] for i in index], block_ids, word, align, rb,
            grid_rows=len(index) * chunk_tokens, groups=num_chunks, interpret=interpret,
            mode=MODE_CHUNK, to_paged=to_paged, flat_off=flat_off,
            group_stride=objects.stride(0) // word if num_chunks > 1 else 0, chunk_tokens=chunk_tokens,
        )


def pack_triton(
    caches: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    num_chunks: int | None = None,
    chunk_tokens: int = 256,
    out: torch.Tensor | None = None,
    fmt: ChunkFormat | None = None,
    validate: bool = True,
    interpret: bool | None = None,
) -> torch.Tensor:
    """Triton ``pack``: see ``kvpool.kernels.ops.pack`` for the contract."""
    geom, num_chunks, out = _prepare_chunks(caches, block_ids, num_chunks, chunk_tokens, out, fmt, validate, False)
    _chunk_op(caches, block_ids, out, num_chunks, chunk_tokens, False, _use_interpreter(geom.device, interpret))
    return out


def unpack_triton(
    objects: torch.Tensor,
    caches: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    num_chunks: int | None = None,
    chunk_tokens: int = 256,
    fmt: ChunkFormat | None = None,
    validate: bool = True,
    interpret: bool | None = None,
) -> None:
    """Triton ``unpack``: see ``kvpool.kernels.ops.unpack`` for the contract."""
    geom, num_chunks, _ = _prepare_chunks(caches, block_ids, num_chunks, chunk_tokens, objects, fmt, validate, True)
    _chunk_op(caches, block_ids, objects, num_chunks, chunk_tokens, True, _use_interpreter(geom.device, interpret))


def _prepare_chunks(
    caches: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    num_chunks: int | None,
    chunk_tokens: int,
    objects: torch.Tensor | None,
    fmt: ChunkFormat | None,
    validate: bool,
    to_paged: bool,
) -> tuple[ck.CacheGeometry, int, torch.Tensor]:
    """Shared checks of pack/unpack; allocates ``out`` for pack when it is None."""
    geom = ck.check_caches(caches)
    ck.check_format(fmt, geom, chunk_tokens)
    ck.check_block_ids(block_ids, 0, geom.device)
    ppc = chunk_tokens // geom.page_tokens
    if num_chunks is None:
        num_chunks = objects.shape[0] if (to_paged and objects is not None and objects.dim() == 2) else block_ids.numel() // ppc
    if num_chunks < 0:
        raise ValueError(f"num_chunks must be >= 0, got {num_chunks}")
    ck.check_block_ids(block_ids, num_chunks * ppc, geom.device)
    obj_bytes = chunk_tokens * sum(geom.record_bytes)
    if objects is None:
        objects = torch.empty((num_chunks, obj_bytes), dtype=torch.uint8, device=geom.device)
    ck.check_objects(objects, num_chunks, obj_bytes, geom.device, "objects" if to_paged else "out")
    if validate:
        ck.check_block_bounds(block_ids, num_chunks * ppc, geom.num_blocks, unique=to_paged)
    return geom, num_chunks, objects


def gather_dcp_triton(
    caches: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    plan: HandoffPlan,
    out: torch.Tensor | None = None,
    validate: bool = True,
    interpret: bool | None = None,
) -> torch.Tensor:
    """Triton ``gather_dcp``: see ``kvpool.kernels.ops.gather_dcp`` for the contract."""
    geom, out = _prepare_gather(caches, block_ids, plan, out, validate)
    use_interp = _use_interpreter(geom.device, interpret)
    word, align = _word_bytes(_cache_quantities(caches) + [out.data_ptr()])
    max_rows = max(plan.rank_tokens(r) for r in range(plan.ranks)) * plan.layers
    _launch(
        caches, range(len(caches)), [0] * len(caches), block_ids, word, align, plan.record_bytes,
        grid_rows=max_rows, groups=plan.ranks if plan.tokens else 0, interpret=use_interp,
        mode=MODE_GATHER, to_paged=False, flat_off=(out.data_ptr() - caches[0].data_ptr()) // word,
        tokens=plan.tokens, token_start=plan.token_start, ranks=plan.ranks,
    )
    return out


def _prepare_gather(
    caches: Sequence[torch.Tensor], block_ids: torch.Tensor, plan: HandoffPlan, out: torch.Tensor | None, validate: bool
) -> tuple[ck.CacheGeometry, torch.Tensor]:
    geom = ck.check_caches(caches)
    ck.check_plan_caches(plan, geom)
    pages = ck.pages_for(plan.token_start + plan.tokens, geom.page_tokens) if plan.tokens else 0
    ck.check_block_ids(block_ids, pages, geom.device)
    if out is None:
        out = torch.empty(plan.total_bytes, dtype=torch.uint8, device=geom.device)
    ck.check_flat(out, plan.total_bytes, geom.device, "out")
    if validate:
        ck.check_block_bounds(block_ids, pages, geom.num_blocks, unique=False)
    return geom, out


def scatter_dcp_triton(
    landing: torch.Tensor,
    caches: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    plan: HandoffPlan,
    rank: int,
    offset_bytes: int = 0,
    validate: bool = True,
    interpret: bool | None = None,
) -> None:
    """Triton ``scatter_dcp``: see ``kvpool.kernels.ops.scatter_dcp`` for the contract."""
    geom, row0, rows = _prepare_scatter(landing, caches, block_ids, plan, rank, offset_bytes, validate)
    use_interp = _use_interpreter(geom.device, interpret)
    word, align = _word_bytes(_cache_quantities(caches) + [landing.data_ptr()])
    rec_words = plan.record_bytes // word
    _launch(
        caches, range(len(caches)), [0] * len(caches), block_ids, word, align, plan.record_bytes,
        grid_rows=rows, groups=1 if rows else 0, interpret=use_interp,
        mode=MODE_SCATTER, to_paged=True,
        flat_off=(landing.data_ptr() - caches[0].data_ptr()) // word - row0 * rec_words,
        tokens=plan.tokens, token_start=plan.token_start, ranks=plan.ranks, rank0=rank,
        row_lo=row0, row_hi=row0 + rows,
    )


def _prepare_scatter(
    landing: torch.Tensor,
    caches: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    plan: HandoffPlan,
    rank: int,
    offset_bytes: int,
    validate: bool,
) -> tuple[ck.CacheGeometry, int, int]:
    geom = ck.check_caches(caches)
    ck.check_plan_caches(plan, geom)
    ck.check_flat(landing, 0, geom.device, "landing")
    row0, rows = ck.scatter_rows(plan, rank, offset_bytes, landing.numel())
    if rows:
        positions = plan.rank_positions(rank)
        first_page = positions[0] // plan.ranks // geom.page_tokens
        pages = positions[-1] // plan.ranks // geom.page_tokens + 1
        ck.check_block_ids(block_ids, pages, geom.device)
        if validate:
            ck.check_block_bounds(block_ids, pages, geom.num_blocks, unique=True, first=first_page)
    else:
        ck.check_block_ids(block_ids, 0, geom.device)
    return geom, row0, rows
