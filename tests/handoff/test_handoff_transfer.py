"""The handoff between real processes on loopback: bit-exact KV, exact write counts, metrics."""

from __future__ import annotations

from dataclasses import replace

import pytest

from handoff_workers import Geom, call, expected_rank_kv

from kvpool.backend.handoff import HandoffResult, StageReport, handoff_breakdown, record_handoff
from kvpool.workload.records import RequestRecord

pytestmark = pytest.mark.timeout(150)


def _check_request(g: Geom, decodes, reports, results, seed: int) -> None:
    plan = g.plan()
    assert all(isinstance(r, StageReport) for r in reports), reports
    assert all(isinstance(r, HandoffResult) for r in results), results
    for rep in reports:
        assert rep.handoff_writes == plan.batched_writes
        assert rep.handoff_bytes == plan.total_bytes
    for r, (conn, res) in enumerate(zip(decodes, results)):
        assert res.handoff_writes == g.stages * len(plan.writes(r))
        assert res.handoff_bytes == g.stages * plan.buffer_bytes(r)
        assert sorted(res.stage_s) == list(range(g.stages))
        got = call(conn, ("kv", seed, {"tokens": g.tokens, "token_start": g.token_start}))
        assert got.equal(expected_rank_kv(g, r, seed)), f"rank {r} KV differs (seed {seed})"


def test_kv_bit_exact_and_exact_write_count(handoff_cluster, run_request):
    """Every decode rank holds exactly its tokens of every stage's layers; each stage sent exactly
    the plan's writes; back-to-back requests reuse credited slots; the request's record gets the hand-off's bytes, writes and time."""
    g, decodes, prefills = handoff_cluster
    for i, seed in enumerate((0, 1)):
        reports, results = run_request(decodes, prefills, f"req-{i}", seed)
        _check_request(g, decodes, reports, results, seed)
        rec = record_handoff(RequestRecord(f"req-{i}"), reports, results)
        assert rec.handoff_bytes == g.stages * g.plan().total_bytes
        assert rec.handoff_writes == g.stages * g.plan().batched_writes
        assert rec.handoff_s > 0 and set(handoff_breakdown(reports, results).stage_s) == {0, 1}
    for conn in prefills:  # every slot came back: each stage holds all of its credits again
        assert call(conn, ("credits", "a")) == [g.slots // g.stages] * g.ranks


def test_odd_start_tokens_and_write_size(handoff_cluster, run_request):
    """A request starting at token 37 with 517 tokens, writes of 10 records (cut mid-layer)."""
    g, decodes, prefills = handoff_cluster
    over = {"tokens": 517, "token_start": 37, "max_write_bytes": 10 * 576}
    reports, results = run_request(decodes, prefills, "odd", 3, **over)
    _check_request(replace(g, **over), decodes, reports, results, 3)


def test_inflight_writes_to_one_peer_are_bounded(handoff_cluster, run_request):
    """With plenty of credits, never more than max_inflight writes are outstanding per rank."""
    g, decodes, prefills = handoff_cluster
    reports, results = run_request(decodes, prefills, "bounded", 2, max_inflight=2)
    _check_request(g, decodes, reports, results, 2)
    assert all(rep.peak_inflight == 2 for rep in reports), reports


def test_ipc_transport_four_ranks(cluster, run_request):
    """Same-host IPC transport (shared memory on the CPU), one stage to 4 ranks, 3 slots per rank."""
    g = Geom(tokens=701, stages=1, ranks=4, slots=3)
    decodes = cluster.decodes(g, "ipc")
    prefills = cluster.prefills(g, "ipc", [ep for _, _, ep in decodes])
    dconns = [c for _, c, _ in decodes]
    reports, results = run_request(dconns, [c for _, c, _ in prefills], "ipc", 5)
    _check_request(g, dconns, reports, results, 5)


def test_pipelined_requests_over_ipc(cluster):
    """Four requests started back to back (two staging buffers, 2 slots per rank, so later writes
    wait for credits that earlier requests return): every one lands with the plan's writes, and the
    KV is that of the last request, bit-exact (each rank scatters in request order)."""
    g = Geom(tokens=701, stages=1, ranks=2, slots=2, max_write_bytes=16 * 1024)
    decodes = cluster.decodes(g, "ipc")
    dconns = [c for _, c, _ in decodes]
    (_, p, _), = cluster.prefills(g, "ipc", [ep for _, _, ep in decodes], staging_buffers=2)
    items = [(f"pipe-{i}", 10 + i) for i in range(4)]
    for rid, seed in items:
        for conn in dconns:
            call(conn, ("expect", rid, seed, {}))
    reports = call(p, ("send_many", items, "a", 30.0), 60)
    assert [r.request_id for r in reports] == [rid for rid, _ in items]
    assert all(r.handoff_writes == g.plan().batched_writes for r in reports), reports
    for rid, _ in items:
        for r, conn in enumerate(dconns):
            res = call(conn, ("wait", rid, 20), 30)
            assert res.handoff_writes == len(g.plan().writes(r))
    for r, conn in enumerate(dconns):
        assert call(conn, ("kv", items[-1][1], {})).equal(expected_rank_kv(g, r, items[-1][1]))
    assert call(p, ("credits", "a")) == [g.slots] * g.ranks


@pytest.mark.gpu
@pytest.mark.parametrize("fences", [True, False])
def test_pipelined_requests_over_gpu_ipc(cluster, fences):
    """GPU IPC between processes on one GPU, four requests pipelined with 2 slots per rank. With
    device fences every READIES goes out at submit time carrying the copy's interprocess event and
    the ranks scatter after it completes; without, after the stage saw the copy complete. Both land
    every request with the plan's writes, the last request's KV bit-exact, all credits back."""
    g = Geom(tokens=701, stages=1, ranks=2, slots=2, max_write_bytes=16 * 1024)
    decodes = cluster.decodes(g, "ipc", device="cuda:0")
    dconns = [c for _, c, _ in decodes]
    (_, p, _), = cluster.prefills(g, "ipc", [ep for _, _, ep in decodes], staging_buffers=2, device="cuda:0",
                                  device_fences=fences)
    items = [(f"gpu-{i}", 20 + i) for i in range(4)]
    for rid, seed in items:
        for conn in dconns:
            call(conn, ("expect", rid, seed, {}))
    reports = call(p, ("send_many", items, "a", 30.0), 60)
    assert all(r.handoff_writes == g.plan().batched_writes for r in reports), reports
    for rid, _ in items:
        for r, conn in enumerate(dconns):
            assert call(conn, ("wait", rid, 20), 30).handoff_writes == len(g.plan().writes(r))
    for r, conn in enumerate(dconns):
        assert call(conn, ("kv", items[-1][1], {})).equal(expected_rank_kv(g, r, items[-1][1]))
        state = call(conn, ("state",))
        writes = len(g.plan().writes(r)) * len(items)
        assert state["landed"] == writes and state["quarantined"] == []
        assert (state["fenced"] > 0) == fences   # one per READIES message when fenced
    assert call(p, ("credits", "a")) == [g.slots] * g.ranks


def test_inflight_bound_validated():
    from kvpool.backend.handoff import LocalTransport, PrefillStage

    with pytest.raises(ValueError, match="max_inflight_per_peer"):
        PrefillStage(0, LocalTransport(), staging_bytes=16, max_inflight_per_peer=1025)
