"""The Triton kernels of ``kvpool.kernels.attention`` (see that module for the contract).

Imports Triton at module level: ``attention._kernels`` loads this file lazily, once compiled and
(on the CPU) once under Triton's interpreter, as two separate module objects, because Triton decides
at decoration time whether a kernel is interpreted.

Every integer whose value depends on the batch (table widths, part counts) is left unspecialized,
so one compiled kernel serves every batch: a program's arithmetic depends on its sequence alone.
"""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n_heads", "rank_pages", "max_parts"])
def _mla_partials_kernel(
    cache_ptr,  # the layer's shared cache [blocks, PAGE, LAT + ROPE] (every rank's blocks)
    s_blk, s_slot,  # its block and token strides, elements
    qlat_ptr, s_ql_row, s_ql_head,  # latent queries [rows, heads, LAT] (last dim contiguous)
    qr_ptr, s_qr_row, s_qr_head,  # RoPE queries [rows, heads, ROPE]
    page_rows_ptr,  # int64 [seqs, ranks, rank_pages]: cache block of each rank-local page
    parts_ptr,  # int64 [seqs, max_parts, 3]: rank, first rank-local token, tokens
    n_parts_ptr,  # int64 [seqs]
    m_ptr, l_ptr, o_ptr,  # float32 [seqs, max_parts, HP] (m, l) and [seqs, max_parts, HP, LAT] (o)
    scale, n_heads, rank_pages, max_parts, ranks,
    PAGE: tl.constexpr, LAT: tl.constexpr, ROPE: tl.constexpr, HP: tl.constexpr, BLOCK: tl.constexpr,
):
    """Program (part ``j``, sequence ``s``): the partial attention of sequence ``s``'s query over
    part ``j`` of its tokens (one rank's contiguous run of rank-local tokens), online over tiles
    of ``BLOCK`` tokens: running max ``m``, sum of exponentials ``l``, weighted latent sum ``o``."""
    j = tl.program_id(0)
    s = tl.program_id(1)
    if j < tl.load(n_parts_ptr + s):
        part = parts_ptr + (s.to(tl.int64) * max_parts + j) * 3
        rank = tl.load(part)
        t0 = tl.load(part + 1)
        nt = tl.load(part + 2)
        heads = tl.arange(0, HP)
        hmask = heads < n_heads
        lat = tl.arange(0, LAT)
        rope = tl.arange(0, ROPE)
        q = tl.load(qlat_ptr + s * s_ql_row + heads[:, None] * s_ql_head + lat[None, :], mask=hmask[:, None], other=0.0)
        qr = tl.load(qr_ptr + s * s_qr_row + heads[:, None] * s_qr_head + rope[None, :], mask=hmask[:, None], other=0.0)
        table = page_rows_ptr + (s.to(tl.int64) * ranks + rank) * rank_pages
        m_i = tl.full([HP], float("-inf"), tl.float32)
        l_i = tl.zeros([HP], tl.float32)
        acc = tl.zeros([HP, LAT], tl.float32)
        for t in range(0, nt, BLOCK):
            k = t + tl.arange(0, BLOCK)
            kmask = k < nt
            local = t0 + k
            page = local // PAGE
            blk = tl.load(table + page, mask=kmask, other=0)
            row = blk * s_blk + (local - page * PAGE) * s_slot
            ck = tl.load(cache_ptr + row[:, None] + lat[None, :], mask=kmask[:, None], other=0.0).to(tl.float32)
            kr = tl.load(cache_ptr + row[:, None] + LAT + rope[None, :], mask=kmask[:, None], other=0.0).to(tl.float32)
            sc = tl.dot(q, tl.trans(ck), input_precision="ieee") + tl.dot(qr, tl.trans(kr), input_precision="ieee")
            sc = tl.where(kmask[None, :], sc * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(sc - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p, ck, input_precision="ieee")
            m_i = m_new
        out = (s.to(tl.int64) * max_parts + j) * HP + heads
        tl.store(m_ptr + out, m_i)
        tl.store(l_ptr + out, l_i)
        tl.store(o_ptr + out[:, None] * LAT + lat[None, :], acc)


@triton.jit(do_not_specialize=["n_heads", "max_parts"])
def _mla_merge_kernel(
    m_ptr, l_ptr, o_ptr,  # the partials (see _mla_partials_kernel)
    n_parts_ptr,
    out_ptr, s_out_row, s_out_head,  # float32 [rows, heads, LAT]
    n_heads, max_parts,
    LAT: tl.constexpr, HP: tl.constexpr,
):
    """Program ``s``: the exact log-sum-exp merge of sequence ``s``'s partials, in part order:
    ``top = max_j m_j``, ``out = sum_j e^(m_j - top) o_j / sum_j e^(m_j - top) l_j``."""
    s = tl.program_id(0)
    n = tl.load(n_parts_ptr + s)
    heads = tl.arange(0, HP)
    lat = tl.arange(0, LAT)
    base = s.to(tl.int64) * max_parts * HP
    top = tl.full([HP], float("-inf"), tl.float32)
    for j in range(0, n):
        top = tl.maximum(top, tl.load(m_ptr + base + j * HP + heads))
    num = tl.zeros([HP, LAT], tl.float32)
    den = tl.zeros([HP], tl.float32)
    for j in range(0, n):
        at = base + j * HP + heads
        w = tl.exp(tl.load(m_ptr + at) - top)
        num = num + w[:, None] * tl.load(o_ptr + at[:, None] * LAT + lat[None, :])
        den = den + w * tl.load(l_ptr + at)
    res = tl.math.div_rn(num, den[:, None])  # correctly rounded, as torch divides
    hmask = heads < n_heads
    tl.store(out_ptr + s * s_out_row + heads[:, None] * s_out_head + lat[None, :], res, mask=hmask[:, None])
