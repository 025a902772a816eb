"""pack / unpack / gather_dcp / scatter_dcp: bit-exact against the torch reference and a naive oracle.

The Triton side runs compiled on a GPU (``-m gpu``) and under Triton's interpreter on the CPU
(when the ``triton`` package is installed). Data movement has no tolerance: ``torch.equal``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kvpool.kernels import ChunkFormat, GatherDcp, ScatterDcp, gather_dcp, pack, scatter_dcp, staging_views, unpack
from kvpool.policy.layout import HandoffPlan

HAVE_TRITON = importlib.util.find_spec("triton") is not None

DEVICES = [
    pytest.param(
        "cpu",
        id="cpu-interp",
        marks=pytest.mark.skipif(not HAVE_TRITON, reason="triton not installed: no interpreter"),
    ),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]


# ------------------------------------------------------------------------------------------ helpers


def rand_bytes(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)


def make_caches(
    record_bytes: list[int], num_blocks: int, page: int, gen: torch.Generator, device: str, style: str = "plain"
) -> list[torch.Tensor]:
    """Per-segment caches of random bytes in one of several memory layouts.

    styles: ``plain`` (each its own contiguous tensor), ``sliced`` (views into one
    [blocks, segments, page, max_rec] tensor: block stride > page bytes), ``padded`` (records padded
    in memory: token stride > record), ``dtypes`` (FP8 / BF16 / uint8 views of the same bytes).
    """
    if style == "plain":
        return [rand_bytes((num_blocks, page, r), gen).to(device) for r in record_bytes]
    if style == "sliced":
        big = rand_bytes((num_blocks, len(record_bytes), page, max(record_bytes)), gen).to(device)
        return [big[:, i, :, :r] for i, r in enumerate(record_bytes)]
    if style == "padded":
        return [rand_bytes((num_blocks, page, r + 16), gen).to(device)[:, :, :r] for r in record_bytes]
    if style == "dtypes":
        out = []
        for i, r in enumerate(record_bytes):
            raw = rand_bytes((num_blocks, page, r), gen).to(device)
            if i % 3 == 1 and r % 2 == 0:
                out.append(raw.view(torch.bfloat16))
            elif i % 3 == 2:
                out.append(raw.view(torch.float8_e4m3fn))
            else:
                out.append(raw)
        return out
    raise ValueError(style)


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    return cache if cache.dtype == torch.uint8 else cache.view(torch.uint8)


def oracle_pack(caches, block_ids, num_chunks: int, chunk_tokens: int) -> torch.Tensor:
    """Token-by-token definition of the chunk object format."""
    page = caches[0].shape[1]
    ids = block_ids.reshape(-1).tolist()
    rows = []
    for c in range(num_chunks):
        parts = []
        for cache in caches:
            b = as_bytes(cache).cpu()
            for i in range(chunk_tokens):
                pos = c * chunk_tokens + i
                parts.append(b[ids[pos // page], pos % page])
        rows.append(torch.cat(parts))
    return torch.stack(rows)


def oracle_gather(caches, block_ids, plan: HandoffPlan) -> torch.Tensor:
    """Record-by-record definition of the staging layout (rank buffers back to back)."""
    page = caches[0].shape[1]
    ids = block_ids.reshape(-1).tolist()
    parts = [torch.empty(0, dtype=torch.uint8)]
    for r in range(plan.ranks):
        for cache in caches:
            b = as_bytes(cache).cpu()
            for p in plan.rank_positions(r):
                parts.append(b[ids[p // page], p % page])
    return torch.cat(parts)


def clone_caches(caches):
    return [c.clone() for c in caches]


# ------------------------------------------------------------------------------------------ pack


PACK_CASES = [
    # record sizes, page, chunk_tokens, pages in table, style
    ([576], 16, 256, 16, "plain"),  # one seed chunk, one segment
    ([576, 144, 576, 576, 144], 16, 128, 20, "plain"),  # latent + indexer; 20 pages: 2 full chunks
    ([576, 144, 576], 16, 16, 7, "sliced"),  # single-page chunks, strided caches
    ([576, 144], 16, 48, 9, "padded"),  # token stride > record
    ([100, 6, 34], 5, 20, 13, "plain"),  # odd record sizes (2-byte words), odd page size
    ([7, 13], 4, 8, 6, "plain"),  # odd sizes: byte words
    ([1152, 576, 144], 16, 32, 5, "dtypes"),  # BF16 / FP8 / uint8 records moved as bytes
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recs,page,chunk,pages,style", PACK_CASES)
def test_pack_matches_reference_and_oracle(device, recs, page, chunk, pages, style):
    gen = torch.Generator().manual_seed(len(recs) * 1000 + pages)
    nb = pages + 11
    caches = make_caches(recs, nb, page, gen, device, style)
    block_ids = torch.randperm(nb, generator=gen)[:pages].to(torch.int32).to(device)
    want = pack(caches, block_ids, chunk_tokens=chunk, backend="torch")
    got = pack(caches, block_ids, chunk_tokens=chunk, backend="triton")
    n = pages * page // chunk
    assert got.shape == (n, chunk * sum(recs))
    assert torch.equal(got, want)
    assert torch.equal(want.cpu(), oracle_pack(caches, block_ids, n, chunk))


@pytest.mark.parametrize("device", DEVICES)
def test_pack_noncontiguous_2d_table_and_strided_out(device):
    """Block table as a strided 2-D view (every other column), objects in 4 KiB-aligned slots."""
    gen = torch.Generator().manual_seed(7)
    recs, page, chunk, n = [576, 144, 576], 16, 64, 3
    caches = make_caches(recs, 64, page, gen, device, "plain")
    full = torch.randperm(64, generator=gen)[: n * 8].reshape(n, 8).to(torch.int64).to(device)
    table = full[:, ::2]  # [3, 4] with strides (8, 2): 4 pages per 64-token chunk
    assert not table.is_contiguous()
    obj = chunk * sum(recs)
    slot = -(-obj // 4096) * 4096
    pool = torch.zeros(n * slot, dtype=torch.uint8, device=device)
    out = pool.view(n, slot)[:, :obj]
    pack(caches, table, chunk_tokens=chunk, out=out, backend="triton")
    assert torch.equal(out, pack(caches, table.contiguous(), chunk_tokens=chunk, backend="torch"))
    assert torch.equal(out.cpu(), oracle_pack(caches, table, n, chunk))
    assert int(pool.view(n, slot)[:, obj:].count_nonzero()) == 0  # slot padding untouched


@pytest.mark.parametrize("device", DEVICES)
def test_pack_fewer_chunks_than_table(device):
    gen = torch.Generator().manual_seed(3)
    caches = make_caches([576, 144], 30, 16, gen, device)
    block_ids = torch.randperm(30, generator=gen)[:25].to(device)  # 25 pages: 1 full 256-token chunk
    got = pack(caches, block_ids, backend="triton")
    assert got.shape[0] == 1
    one = pack(caches, block_ids, num_chunks=1, backend="torch")
    assert torch.equal(got, one)
    none = pack(caches, block_ids, num_chunks=0, backend="triton")
    assert none.shape == (0, 256 * 720)


# ------------------------------------------------------------------------------------------ unpack


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recs,page,chunk,pages,style", PACK_CASES)
def test_unpack_matches_reference_and_round_trips(device, recs, page, chunk, pages, style):
    gen = torch.Generator().manual_seed(len(recs) * 77 + pages)
    nb = pages + 9
    n = pages * page // chunk
    src = make_caches(recs, nb, page, gen, device, style)
    src_ids = torch.randperm(nb, generator=gen)[:pages].to(device)
    objects = pack(src, src_ids, chunk_tokens=chunk, backend="torch")

    dst_ids = torch.randperm(nb, generator=gen)[: n * chunk // page].to(torch.int32).to(device)
    a = make_caches(recs, nb, page, gen, device, style)
    b = clone_caches(a)
    before = clone_caches(a)
    unpack(objects, a, dst_ids, chunk_tokens=chunk, backend="torch")
    unpack(objects, b, dst_ids, chunk_tokens=chunk, backend="triton")
    for x, y in zip(a, b):
        assert torch.equal(as_bytes(x), as_bytes(y))
    # round trip: packing the written pages gives the objects back
    assert torch.equal(pack(b, dst_ids, chunk_tokens=chunk, backend="triton"), objects)
    # pages not named by the table are untouched
    untouched = sorted(set(range(nb)) - set(dst_ids.tolist()))
    for x, y in zip(b, before):
        assert torch.equal(as_bytes(x)[untouched], as_bytes(y)[untouched])


# ------------------------------------------------------------------------------------------ DCP


DCP_CASES = [
    # tokens, token_start, layers, record, ranks, page
    (8 * 16, 0, 3, 576, 4, 16),  # even split, whole pages
    (301, 5, 3, 576, 4, 16),  # uneven ranks, partial first and last page, nonzero start
    (7, 3, 2, 576, 4, 16),  # a single page; one rank gets 1 token
    (3, 0, 2, 144, 4, 16),  # fewer tokens than ranks: rank 3 gets nothing
    (50, 13, 4, 100, 3, 5),  # odd everything (2-byte words)
    (64, 0, 2, 576, 1, 16),  # DCP1: gather is a plain layer-major copy
]


def _plan(tokens, start, layers, rec, ranks, max_write=None):
    kw = {"max_write_bytes": max_write} if max_write else {}
    return HandoffPlan(tokens=tokens, layers=layers, record_bytes=rec, ranks=ranks, token_start=start, **kw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens,start,layers,rec,ranks,page", DCP_CASES)
def test_gather_dcp_matches_reference_and_oracle(device, tokens, start, layers, rec, ranks, page):
    gen = torch.Generator().manual_seed(tokens + start)
    pages = -(-(start + tokens) // page)
    nb = pages + 6
    caches = make_caches([rec] * layers, nb, page, gen, device, "sliced")
    block_ids = torch.randperm(nb, generator=gen)[:pages].to(device)
    plan = _plan(tokens, start, layers, rec, ranks)
    want = gather_dcp(caches, block_ids, plan, backend="torch")
    got = gather_dcp(caches, block_ids, plan, backend="triton")
    assert got.numel() == plan.total_bytes
    assert torch.equal(got, want)
    assert torch.equal(want.cpu(), oracle_gather(caches, block_ids, plan))
    views = staging_views(got, plan)
    assert [v.numel() for v in views] == [plan.buffer_bytes(r) for r in range(ranks)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens,start,layers,rec,ranks,page", DCP_CASES)
def test_gather_scatter_round_trip_in_landed_writes(device, tokens, start, layers, rec, ranks, page):
    """Each rank's buffer is scattered write by write (plan.writes, a small cap), out of order."""
    gen = torch.Generator().manual_seed(tokens * 3 + ranks)
    pages = -(-(start + tokens) // page)
    prefill = make_caches([rec] * layers, pages + 4, page, gen, device, "plain")
    p_ids = torch.randperm(pages + 4, generator=gen)[:pages].to(device)
    plan = _plan(tokens, start, layers, rec, ranks, max_write=rec * 40)
    staging = gather_dcp(prefill, p_ids, plan, backend="triton")

    local_pages = (start + tokens - 1) // ranks // page + 1  # pages of the decode-local index
    for r, buf in enumerate(staging_views(staging, plan)):
        nb = local_pages + 5
        d_ids = torch.randperm(nb, generator=gen)[:local_pages].to(torch.int32).to(device)
        dec_t = make_caches([rec] * layers, nb, page, gen, device, "padded")
        dec_r = clone_caches(dec_t)
        writes = plan.writes(r)
        for w in reversed(writes):
            piece = buf.narrow(0, w.offset_bytes, w.nbytes)
            scatter_dcp(piece, dec_t, d_ids, plan, r, offset_bytes=w.offset_bytes, backend="triton")
        scatter_dcp(buf, dec_r, d_ids, plan, r, backend="torch")
        for x, y in zip(dec_t, dec_r):
            assert torch.equal(x, y)
        # every handed-off token of this rank sits at its decode-local slot, in every layer
        ids = d_ids.tolist()
        src_ids = p_ids.tolist()
        for layer in range(layers):
            for p in plan.rank_positions(r):
                local = p // ranks
                got = dec_t[layer][ids[local // page], local % page]
                want = prefill[layer][src_ids[p // page], p % page]
                assert torch.equal(got, want), (r, layer, p)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens,start,layers,rec,ranks,page", DCP_CASES)
def test_bound_gather_and_segment_scatter(device, tokens, start, layers, rec, ranks, page):
    """GatherDcp equals gather_dcp; ScatterDcp lands a rank's writes from shuffled landing slots,
    in two uneven batches of segments, exactly as scatter_dcp of the whole buffer does."""
    gen = torch.Generator().manual_seed(tokens * 7 + ranks)
    pages = -(-(start + tokens) // page)
    prefill = make_caches([rec] * layers, pages + 4, page, gen, device, "sliced")
    p_ids = torch.randperm(pages + 4, generator=gen)[:pages].to(device)
    plan = _plan(tokens, start, layers, rec, ranks, max_write=rec * 40)
    want = gather_dcp(prefill, p_ids, plan, backend="torch")
    for backend in ("torch", "triton"):
        gather = GatherDcp(prefill, backend=backend)
        assert torch.equal(gather(p_ids, plan), want)
        out = torch.zeros(plan.total_bytes + 64, dtype=torch.uint8, device=device)
        for _ in range(2):   # the second launch reuses the compiled kernel (triton_ops.FAST_LAUNCH)
            assert torch.equal(gather(p_ids, plan, out=out.narrow(0, 0, plan.total_bytes)), want)
            out.zero_()
    local_pages = (start + tokens - 1) // ranks // page + 1
    for r, buf in enumerate(staging_views(want, plan)):
        nb = local_pages + 5
        d_ids = torch.randperm(nb, generator=gen)[:local_pages].to(torch.int32).to(device)
        dec_r = make_caches([rec] * layers, nb, page, gen, device, "padded")
        pristine = clone_caches(dec_r)
        dec_t = {"torch": clone_caches(dec_r), "triton": clone_caches(dec_r)}
        scatter_dcp(buf, dec_r, d_ids, plan, r, backend="torch")
        writes = plan.writes(r)
        slot = plan.max_write_bytes + 64
        order = torch.randperm(len(writes) + 3, generator=gen).tolist()
        landing = torch.zeros((len(writes) + 3) * slot, dtype=torch.uint8, device=device)
        segs = []
        for w, k in zip(writes, order):
            landing.narrow(0, k * slot, w.nbytes).copy_(buf.narrow(0, w.offset_bytes, w.nbytes))
            segs.append((k * slot, w.offset_bytes, w.nbytes))
        cut = max(1, len(segs) // 3)
        for backend, dec in dec_t.items():
            op = ScatterDcp(dec, backend=backend)
            for _ in range(2):   # again over restored caches: relaunches of the compiled kernel
                op(landing, d_ids, plan, r, segs[cut:][::-1])
                op(landing, d_ids, plan, r, segs[:cut])
                for x, y in zip(dec, dec_r):
                    assert torch.equal(x, y), (backend, r)
                for x, y in zip(dec, pristine):
                    x.copy_(y)


def test_segment_scatter_rejects_bad_segments():
    plan = _plan(64, 0, 2, 576, 2)
    caches = [torch.zeros(4, 16, 576, dtype=torch.uint8) for _ in range(2)]
    op = ScatterDcp(caches, backend="torch")
    landing = torch.zeros(4 * 576, dtype=torch.uint8)
    ids = torch.arange(4)
    with pytest.raises(ValueError, match="outside the landing"):
        op(landing, ids, plan, 0, [(576 * 3, 0, 576 * 2)])
    with pytest.raises(ValueError, match="multiple of the record"):
        op(landing, ids, plan, 0, [(0, 100, 576)])
    with pytest.raises(ValueError, match="run past"):
        op(landing, ids, plan, 0, [(0, plan.buffer_bytes(0) - 576, 1152)])


@pytest.mark.gpu
def test_gpu_seed_sizes_match_reference():
    """Seed sizes on the GPU: a 20-layer stage, 4 chunks of 256 tokens; an 8,192-token handoff to 4 ranks."""
    gen = torch.Generator().manual_seed(0)
    recs = [576] * 20 + [144] * 6
    caches = make_caches(recs, 700, 16, gen, "cuda", "sliced")
    ids = torch.randperm(700, generator=gen)[:512].to("cuda")
    assert torch.equal(pack(caches, ids, backend="triton"), pack(caches, ids, backend="torch"))
    plan = HandoffPlan(tokens=8192, layers=20, record_bytes=576, ranks=4)
    assert plan.batched_writes == 12 and plan.total_bytes == 94_371_840
    lat = caches[:20]
    st = gather_dcp(lat, ids, plan, backend="triton")
    assert torch.equal(st, gather_dcp(lat, ids, plan, backend="torch"))


@pytest.mark.gpu
def test_gpu_ops_capture_in_cuda_graph():
    """With validate=False no op synchronizes, so a CUDA graph can hold it; replays are exact."""
    gen = torch.Generator().manual_seed(1)
    caches = make_caches([576, 144], 64, 16, gen, "cuda")
    ids = torch.randperm(64, generator=gen)[:32].to("cuda")
    out = torch.empty(2, 256 * 720, dtype=torch.uint8, device="cuda")
    pack(caches, ids, out=out, validate=False)  # warm-up: compile, cache the segment table
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pack(caches, ids, out=out, validate=False)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, pack(caches, ids, backend="torch"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("persist,pair", [(0, True), (0, False), (3, False)])
def test_kernel_variants_agree(device, persist, pair, monkeypatch):
    """Every launch variant (one tile per program / persistent loop; record sizes paired or not)."""
    from kvpool.kernels import triton_ops

    monkeypatch.setattr(triton_ops, "PERSIST_CTAS_PER_SM", persist)
    monkeypatch.setattr(triton_ops, "PAIR_RECORD_SIZES", pair)
    gen = torch.Generator().manual_seed(persist + 10 * pair)
    caches = make_caches([576, 144, 576], 24, 16, gen, device, "sliced")
    ids = torch.randperm(24, generator=gen)[:8].to(device)
    objects = pack(caches, ids, chunk_tokens=64, backend="triton")
    assert torch.equal(objects, pack(caches, ids, chunk_tokens=64, backend="torch"))
    back = [torch.zeros_like(c) for c in caches]
    unpack(objects, back, ids, chunk_tokens=64, backend="triton")
    assert torch.equal(pack(back, ids, chunk_tokens=64, backend="torch"), objects)
    plan = _plan(70, 7, 3, 576, 4)
    lat = [caches[0], caches[2], caches[0]]
    staging = gather_dcp(lat, ids, plan, backend="triton")
    assert torch.equal(staging, gather_dcp(lat, ids, plan, backend="torch"))
    buf = staging_views(staging, plan)[3]
    d_ids = torch.randperm(24, generator=gen)[:2].to(device)
    a = [torch.zeros(24, 16, 576, dtype=torch.uint8, device=device) for _ in range(3)]
    b = [torch.zeros_like(x) for x in a]
    scatter_dcp(buf, a, d_ids, plan, 3, backend="triton")
    scatter_dcp(buf, b, d_ids, plan, 3, backend="torch")
    assert all(torch.equal(x, y) for x, y in zip(a, b))
