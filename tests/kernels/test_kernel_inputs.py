"""Bad inputs raise clear errors before anything is written; the format and staging helpers agree
with policy.kvspec / policy.layout; the package imports and runs its references without Triton."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

from kvpool.kernels import (
    POOL_FORMAT_VERSION,
    ChunkFormat,
    gather_dcp,
    pack,
    rank_buffer_offset_bytes,
    scatter_dcp,
    staging_views,
    unpack,
)
from kvpool.policy.kvspec import ExtraRecord, KVSpec, every_kth_layer
from kvpool.policy.layout import HandoffPlan

BACKENDS = [
    "torch",
    pytest.param(
        "triton",
        marks=pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed"),
    ),
]


def _caches(recs=(576, 144), nb=8, page=16):
    return [torch.arange(nb * page * r, dtype=torch.int64).remainder(251).to(torch.uint8).view(nb, page, r) for r in recs]


# ------------------------------------------------------------------------------------------ pack/unpack


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [-1, 8, 1000])
def test_pack_rejects_out_of_range_block_ids(backend, bad):
    ids = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, bad])
    with pytest.raises(IndexError, match=f"block id {bad}, out of range 0..7"):
        pack(_caches(), ids, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unpack_rejects_bad_ids_before_writing(backend):
    caches = _caches()
    before = [c.clone() for c in caches]
    objects = torch.zeros(1, 256 * 720, dtype=torch.uint8)
    with pytest.raises(IndexError):
        unpack(objects, caches, torch.tensor([9] + list(range(1, 16))), backend=backend)
    with pytest.raises(ValueError, match="twice"):
        unpack(objects, caches, torch.tensor([0] * 16), num_chunks=1, backend=backend)
    for a, b in zip(caches, before):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_wrong_dtypes(backend):
    caches = _caches()
    with pytest.raises(TypeError, match="int32 or int64"):
        pack(caches, torch.arange(16, dtype=torch.float32), backend=backend)
    with pytest.raises(TypeError, match="uint8"):
        pack(caches, torch.arange(16), out=torch.empty(1, 256 * 720, dtype=torch.int8), backend=backend)
    with pytest.raises(TypeError, match="uint8"):
        unpack(torch.empty(1, 256 * 720 // 4, dtype=torch.int32), caches, torch.arange(16), backend=backend)
    with pytest.raises(TypeError, match="bool"):
        pack([torch.zeros(8, 16, 4, dtype=torch.bool)], torch.arange(16), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_too_small_or_mis_sized_buffers(backend):
    caches = _caches()
    ids = torch.arange(8).repeat(4)  # 32 pages: 2 chunks
    with pytest.raises(ValueError, match="holds 1 objects, 2 are needed"):
        pack(caches, ids, out=torch.empty(1, 256 * 720, dtype=torch.uint8), backend=backend)
    with pytest.raises(ValueError, match="different layout"):
        pack(caches, ids, out=torch.empty(2, 256 * 576, dtype=torch.uint8), backend=backend)
    with pytest.raises(ValueError, match="names 16 pages, 32 are needed"):
        pack(caches, ids[:16], num_chunks=2, backend=backend)
    with pytest.raises(ValueError, match="different layout"):
        unpack(torch.empty(1, 256 * 720 + 1, dtype=torch.uint8), caches, ids[:16], backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_layout_errors_never_copy(backend):
    caches = _caches()
    with pytest.raises(ValueError, match="record dimension must be contiguous"):
        pack([caches[0][:, :, ::2]], torch.arange(16) % 8, backend=backend)
    with pytest.raises(ValueError, match="multiple of the page size"):
        pack(caches, torch.arange(16) % 8, chunk_tokens=40, backend=backend)
    with pytest.raises(ValueError, match="tokens per page"):
        pack([caches[0], torch.zeros(8, 8, 144, dtype=torch.uint8)], torch.arange(16) % 8, backend=backend)
    with pytest.raises(ValueError, match="3-D"):
        pack([caches[0].reshape(8, -1)], torch.arange(16) % 8, backend=backend)
    objects = torch.zeros(1, 2 * 256 * 720, dtype=torch.uint8)[:, ::2]
    with pytest.raises(ValueError, match="contiguous"):
        unpack(objects, caches, torch.arange(16) % 8, backend=backend)
    with pytest.raises(TypeError, match="list of tensors"):
        pack(caches[0], torch.arange(16) % 8, backend=backend)


def test_format_checks():
    caches = _caches()
    ids = torch.arange(16) % 8
    good = ChunkFormat.from_record_bytes([576, 144])
    assert torch.equal(pack(caches, ids, fmt=good), pack(caches, ids))
    with pytest.raises(ValueError, match="format expects"):
        pack(caches, ids, fmt=ChunkFormat.from_record_bytes([144, 576]))
    with pytest.raises(ValueError, match="256-token chunks, the call 128"):
        pack(caches, ids, chunk_tokens=128, fmt=good)
    with pytest.raises(ValueError, match="version 2 is not supported"):
        ChunkFormat(good.segments, 256, version=2)
    with pytest.raises(ValueError, match="backend must be"):
        pack(caches, ids, backend="cuda")


# ------------------------------------------------------------------------------------------ DCP


@pytest.mark.parametrize("backend", BACKENDS)
def test_dcp_bad_inputs(backend):
    plan = HandoffPlan(tokens=100, layers=2, record_bytes=576, ranks=4)
    caches = _caches((576, 576))
    ids = torch.arange(7)
    with pytest.raises(IndexError, match="block id 8"):
        gather_dcp(caches, torch.tensor([0, 1, 2, 3, 4, 5, 8]), plan, backend=backend)
    with pytest.raises(ValueError, match="names 6 pages, 7 are needed"):
        gather_dcp(caches, ids[:6], plan, backend=backend)
    with pytest.raises(ValueError, match="too small"):
        gather_dcp(caches, ids, plan, out=torch.empty(plan.total_bytes - 1, dtype=torch.uint8), backend=backend)
    with pytest.raises(TypeError, match="uint8"):
        gather_dcp(caches, ids, plan, out=torch.empty(plan.total_bytes, dtype=torch.float16), backend=backend)
    with pytest.raises(ValueError, match="the plan 576 B"):
        gather_dcp(_caches((576, 144)), ids, plan, backend=backend)
    with pytest.raises(ValueError, match="holds 1 layers, the plan 2"):
        gather_dcp(caches[:1], ids, plan, backend=backend)

    buf = torch.zeros(plan.buffer_bytes(1), dtype=torch.uint8)
    d_ids = torch.arange(2)
    with pytest.raises(ValueError, match="run past"):
        scatter_dcp(buf, caches, d_ids, plan, 1, offset_bytes=576, backend=backend)
    with pytest.raises(ValueError, match="multiple of the record"):
        scatter_dcp(buf[:576], caches, d_ids, plan, 1, offset_bytes=100, backend=backend)
    with pytest.raises(ValueError, match="whole number"):
        scatter_dcp(buf[:600], caches, d_ids, plan, 1, backend=backend)
    with pytest.raises(ValueError, match="rank 4 out of range"):
        scatter_dcp(buf, caches, d_ids, plan, 4, backend=backend)
    with pytest.raises(IndexError, match="block id -3"):
        scatter_dcp(buf, caches, torch.tensor([0, -3]), plan, 1, backend=backend)
    with pytest.raises(ValueError, match="twice"):
        scatter_dcp(buf, caches, torch.tensor([5, 5]), plan, 1, backend=backend)
    with pytest.raises(ValueError, match="names 1 pages, 2 are needed"):
        scatter_dcp(buf, caches, d_ids[:1], plan, 1, backend=backend)
    with pytest.raises(TypeError, match="uint8"):
        scatter_dcp(buf.view(torch.int8), caches, d_ids, plan, 1, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_handoff_is_a_no_op(backend):
    plan = HandoffPlan(tokens=0, layers=1, record_bytes=576, ranks=4, token_start=32)
    caches = _caches((576,))
    out = gather_dcp(caches, torch.arange(2), plan, backend=backend)
    assert out.numel() == 0
    before = caches[0].clone()
    scatter_dcp(out, caches, torch.arange(1), plan, 2, backend=backend)
    assert torch.equal(before, caches[0])


# ------------------------------------------------------------------------------------------ format


def glm_spec() -> KVSpec:
    idx = every_kth_layer(78, 3, 4, 6) + (78,)
    return KVSpec(
        model="glm-5.3", layers=78, record_bytes=576, stage_layers=(20, 20, 20, 18), mtp_layers=1,
        extra_records=(ExtraRecord("indexer", 144, idx),),
    )


def test_chunk_format_from_spec_is_layer_major_and_sized_by_kvspec():
    spec = glm_spec()
    for stage in range(spec.stages):
        fmt = ChunkFormat.from_spec(spec, stage, 256)
        assert fmt.version == POOL_FORMAT_VERSION == 1
        assert fmt.object_bytes == spec.chunk_object_bytes(stage, 256)
        layers = [s.layer_id for s in fmt.segments]
        assert layers == sorted(layers)
        assert [s.layer_id for s in fmt.segments if s.record == "kv"] == list(spec.stage_layer_ids(stage))
    fmt0 = ChunkFormat.from_spec(spec, 0)
    assert [(s.layer_id, s.record) for s in fmt0.segments[:4]] == [(0, "kv"), (0, "indexer"), (1, "kv"), (1, "indexer")]
    assert fmt0.segment_offset_bytes(1) == 256 * 576
    assert fmt0.segment_offset_bytes(2) == 256 * (576 + 144)
    last = ChunkFormat.from_spec(spec, 3)
    assert last.segments[-2:] == (last.segments[-2], last.segments[-1])
    assert (last.segments[-2].layer_id, last.segments[-1].record) == (78, "indexer")  # MTP layer last
    with pytest.raises(ValueError, match="multiple of the page size"):
        ChunkFormat.from_spec(spec, 0, 100)


def test_staging_views_follow_the_plan():
    plan = HandoffPlan(tokens=8192, layers=20, record_bytes=576, ranks=4)
    assert plan.batched_writes == 12 and plan.naive_writes == 163_840
    staging = torch.empty(plan.total_bytes, dtype=torch.uint8)
    views = staging_views(staging, plan)
    assert [v.numel() for v in views] == [2048 * 20 * 576] * 4
    for r, v in enumerate(views):
        assert v.data_ptr() - staging.data_ptr() == rank_buffer_offset_bytes(plan, r)
        assert sum(w.nbytes for w in plan.writes(r)) == v.numel()
    odd = HandoffPlan(tokens=10, layers=3, record_bytes=144, ranks=4, token_start=3)
    assert [rank_buffer_offset_bytes(odd, r) for r in range(4)] == [0, 3 * 3 * 144, 5 * 3 * 144, 7 * 3 * 144]
    with pytest.raises(ValueError, match="at least"):
        staging_views(staging[:10], plan)


def test_imports_and_references_run_without_triton():
    """The package must import (and its CPU path run) on a machine without Triton."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from kvpool.kernels import pack\n"
        "c = [torch.zeros(4, 16, 576, dtype=torch.uint8)]\n"
        "assert pack(c, torch.arange(16) % 4).shape == (1, 256 * 576)\n"
        "assert 'triton.language' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
