"""The Triton kernel of kvpool.kernels (see ``triton_ops`` for the design and host functions).

Imports Triton at module level: ``triton_ops._kernel`` loads this file lazily, once compiled and
(on the CPU) once under Triton's interpreter, as two separate module objects, because Triton decides
at decoration time whether a kernel is interpreted.
"""

import triton
import triton.language as tl


@triton.jit
def _tile_addrs(
    pid, grp, seg_ptr, sg_ptr, bt_ptr, bt_cols, bt_s0, bt_s1, n_seg, flat_off, group_stride,
    tokens, token_start, ranks, rank0, row_lo, row_hi,
    MODE: tl.constexpr, TO_PAGED: tl.constexpr, PAGE: tl.constexpr, CHUNK: tl.constexpr,
    BT_2D: tl.constexpr, REC: tl.constexpr, ROWS: tl.constexpr, ALIGN: tl.constexpr,
):
    """Source and destination word offsets and the row mask of rows ``pid*ROWS ..`` of group ``grp``
    (a chunk, a rank, or a landed segment). See ``_copy_rows_kernel`` for the arguments."""
    # Index math in int32 (host checks rows and positions < 2**31), addresses in int64.
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
        if MODE == 3:
            r = rank0
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
        elif MODE == 2:
            g = g + row_lo
            mask = g < row_hi
            flat_row = flat_off + g.to(tl.int64) * REC
        else:
            # MODE_SCATTER_SEGS: segment ``grp`` of the table (first row, end row, flat offset of row 0)
            seg_lo = tl.load(sg_ptr + 3 * grp)
            seg_hi = tl.load(sg_ptr + 3 * grp + 1)
            seg_off = tl.load(sg_ptr + 3 * grp + 2)
            g = g + seg_lo.to(tl.int32)
            mask = g < seg_hi
            flat_row = seg_off + g.to(tl.int64) * REC
        s = g // tl.maximum(n_r, 1)
        j = g - s * n_r
        pos = first + j * ranks
        if MODE >= 2:
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
    if TO_PAGED:
        src = flat_row
        dst = paged_row
    else:
        src = paged_row
        dst = flat_row
    return src, dst, mask


@triton.jit
def _load_rows(anchor_ptr, src, mask, REC: tl.constexpr, COLS: tl.constexpr, TAIL: tl.constexpr):
    """Load rows: a record is COLS words (a power of two) plus a TAIL tile masked to REC (a 576 B
    latent is 128 + 16 int32 words, a 144 B indexer key 32 + 4), so no lane holds padding."""
    cols = tl.arange(0, COLS)
    v = tl.load(anchor_ptr + src[:, None] + cols[None, :], mask=mask[:, None] & (cols < COLS)[None, :])
    if TAIL > 0:
        tcols = COLS + tl.arange(0, TAIL)
        vt = tl.load(anchor_ptr + src[:, None] + tcols[None, :], mask=mask[:, None] & (tcols < REC)[None, :])
    else:
        vt = v
    return v, vt


@triton.jit
def _store_rows(anchor_ptr, dst, mask, v, vt, REC: tl.constexpr, COLS: tl.constexpr, TAIL: tl.constexpr):
    cols = tl.arange(0, COLS)
    tl.store(anchor_ptr + dst[:, None] + cols[None, :], v, mask=mask[:, None] & (cols < COLS)[None, :])
    if TAIL > 0:
        tcols = COLS + tl.arange(0, TAIL)
        tl.store(anchor_ptr + dst[:, None] + tcols[None, :], vt, mask=mask[:, None] & (tcols < REC)[None, :])


@triton.jit
def _copy_tile(
    pid, grp, anchor_ptr, seg_ptr, sg_ptr, bt_ptr, bt_cols, bt_s0, bt_s1, n_seg, flat_off, group_stride,
    tokens, token_start, ranks, rank0, row_lo, row_hi,
    MODE: tl.constexpr, TO_PAGED: tl.constexpr, PAGE: tl.constexpr, CHUNK: tl.constexpr,
    BT_2D: tl.constexpr, REC: tl.constexpr, COLS: tl.constexpr, TAIL: tl.constexpr, ROWS: tl.constexpr,
    ALIGN: tl.constexpr,
):
    """Copy rows ``pid*ROWS ..`` of group ``grp`` (a chunk or a rank). See ``_copy_rows_kernel``."""
    src, dst, mask = _tile_addrs(
        pid, grp, seg_ptr, sg_ptr, bt_ptr, bt_cols, bt_s0, bt_s1, n_seg, flat_off, group_stride,
        tokens, token_start, ranks, rank0, row_lo, row_hi,
        MODE, TO_PAGED, PAGE, CHUNK, BT_2D, REC, ROWS, ALIGN,
    )
    v, vt = _load_rows(anchor_ptr, src, mask, REC, COLS, TAIL)
    _store_rows(anchor_ptr, dst, mask, v, vt, REC, COLS, TAIL)


@triton.jit
def _copy_rows_kernel(
    anchor_ptr,  # *word: every address below is a word offset from here
    seg_ptr,  # *i64 [4, n_seg]: paged base, block stride, token stride, flat offset (words)
    seg2_ptr,  # the same for the second record size (REC2 > 0)
    sg_ptr,  # MODE_SCATTER_SEGS: *i64 [n_groups, 3]: first row, end row, flat offset of row 0 (words)
    bt_ptr,  # *i32|i64 block table, read row-major through (bt_cols, bt_s0, bt_s1)
    bt_cols,
    bt_s0,
    bt_s1,
    n_seg,  # segments of the first record size
    n_seg2,  # segments of the second record size
    n_tiles,  # programs (along axis 0) of the first record size; the rest do the second
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
    COLS: tl.constexpr,  # largest power of two <= REC
    TAIL: tl.constexpr,  # next power of two >= REC - COLS (0 if REC is a power of two)
    ROWS: tl.constexpr,
    REC2: tl.constexpr,  # second record size in words (0: none), MODE_CHUNK only
    COLS2: tl.constexpr,
    TAIL2: tl.constexpr,
    ROWS2: tl.constexpr,
    ALIGN: tl.constexpr,  # words: every row offset is a multiple of this
):
    pid = tl.program_id(0)
    grp = tl.program_id(1) + grp0
    if REC2 == 0:
        _copy_tile(
            pid, grp, anchor_ptr, seg_ptr, sg_ptr, bt_ptr, bt_cols, bt_s0, bt_s1, n_seg, flat_off, group_stride,
            tokens, token_start, ranks, rank0, row_lo, row_hi,
            MODE, TO_PAGED, PAGE, CHUNK, BT_2D, REC, COLS, TAIL, ROWS, ALIGN,
        )
    else:
        if pid < n_tiles:
            _copy_tile(
                pid, grp, anchor_ptr, seg_ptr, sg_ptr, bt_ptr, bt_cols, bt_s0, bt_s1, n_seg, flat_off,
                group_stride, tokens, token_start, ranks, rank0, row_lo, row_hi,
                MODE, TO_PAGED, PAGE, CHUNK, BT_2D, REC, COLS, TAIL, ROWS, ALIGN,
            )
        else:
            _copy_tile(
                pid - n_tiles, grp, anchor_ptr, seg2_ptr, sg_ptr, bt_ptr, bt_cols, bt_s0, bt_s1, n_seg2, flat_off,
                group_stride, tokens, token_start, ranks, rank0, row_lo, row_hi,
                MODE, TO_PAGED, PAGE, CHUNK, BT_2D, REC2, COLS2, TAIL2, ROWS2, ALIGN,
            )



@triton.jit
def _copy_rows_persistent_kernel(
    anchor_ptr, seg_ptr, bt_ptr, bt_cols, bt_s0, bt_s1, n_seg,
    n_tiles,  # row tiles per group
    n_groups,  # chunks (MODE_CHUNK) or ranks (MODE_GATHER); 1 for MODE_SCATTER
    flat_off, group_stride, tokens, token_start, ranks, rank0, row_lo, row_hi,
    MODE: tl.constexpr, TO_PAGED: tl.constexpr, PAGE: tl.constexpr, CHUNK: tl.constexpr,
    BT_2D: tl.constexpr, REC: tl.constexpr, COLS: tl.constexpr, TAIL: tl.constexpr, ROWS: tl.constexpr,
    ALIGN: tl.constexpr,
):
    """One record size, a fixed number of programs, each looping over tiles ``pid, pid + nprog, ..``
    (tile ``f`` = row tile ``f % n_tiles`` of group ``f // n_tiles``). Software-pipelined by hand:
    the next tile's block ids and table entries are read while this tile's data is in flight, so
    the small dependent loads do not add their latency to every tile."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    total = n_tiles * n_groups
    src, dst, mask = _tile_addrs(
        pid % n_tiles, pid // n_tiles, seg_ptr, seg_ptr, bt_ptr, bt_cols, bt_s0, bt_s1, n_seg, flat_off, group_stride,
        tokens, token_start, ranks, rank0, row_lo, row_hi,
        MODE, TO_PAGED, PAGE, CHUNK, BT_2D, REC, ROWS, ALIGN,
    )
    zero = tl.zeros([ROWS], dtype=tl.int32)  # (scalar & block masks trip the interpreter)
    mask = mask & (zero + pid < total)
    for f in range(pid, total, nprog):
        v, vt = _load_rows(anchor_ptr, src, mask, REC, COLS, TAIL)
        fn = f + nprog
        fv = zero + fn < total
        fn = tl.where(fn < total, fn, 0)
        nsrc, ndst, nmask = _tile_addrs(
            fn % n_tiles, fn // n_tiles, seg_ptr, seg_ptr, bt_ptr, bt_cols, bt_s0, bt_s1, n_seg, flat_off, group_stride,
            tokens, token_start, ranks, rank0, row_lo, row_hi,
            MODE, TO_PAGED, PAGE, CHUNK, BT_2D, REC, ROWS, ALIGN,
        )
        _store_rows(anchor_ptr, dst, mask, v, vt, REC, COLS, TAIL)
        src = nsrc
        dst = ndst
        mask = nmask & fv
