"""The connector end to end with the reference model, on real pools (embedded and Mooncake):
KV restored from the pool equals a full recompute bit for bit, and so do the next-token logits."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch

from kvpool.backend.connector import KVPoolConnector
from kvpool.backend.connector_data import LoadPlan, StageObjects
from kvpool.backend.connector_metrics import ConnectorMetrics
from kvpool.backend.connector_worker import ConnectorWorker, WorkerConfig, slot_bytes_for
from kvpool.backend.pool import EmbeddedPool, Pool

from connector_testing import CHUNK, Engine, assert_matches_reference, prime, prompt

pytestmark = pytest.mark.timeout(120)

TOKENS = prompt(6 * CHUNK + 71, seed=7)  # 6 full chunks + a partial one


def test_restored_kv_and_logits_equal_a_full_recompute(pool: Pool, keyspace: str) -> None:
    metrics = ConnectorMetrics()
    e = Engine(pool, keyspace, metrics=metrics)
    try:
        first = e.serve("first", TOKENS)  # nothing in the pool: computes everything, saves 6 chunks
        assert (first.metrics.gpu_tokens, first.metrics.pool_tokens, first.metrics.computed_tokens) == (0, 0, len(TOKENS))
        assert first.save is not None and first.save.stored
        chunk_bytes = sum(e.spec.chunk_object_bytes(s, CHUNK) for s in range(e.spec.stages))
        assert first.metrics.save_bytes == 6 * chunk_bytes
        assert_matches_reference(e, first, TOKENS)

        second = e.serve("second", TOKENS)  # restores 6 chunks on every stage, computes 71 tokens
        m = second.metrics
        assert (m.gpu_tokens, m.pool_tokens, m.computed_tokens) == (0, 6 * CHUNK, 71)
        assert not m.restore_failed and m.restore_bytes == 6 * chunk_bytes and m.save_bytes == 0
        assert len(m.restore_stage_s) == 3 and m.restore_spread_s >= max(m.restore_stage_s) > 0
        assert_matches_reference(e, second, TOKENS)
    finally:
        e.close()
    text = metrics.text()
    assert sample(text, "kvpool_connector_requests_total", outcome="loaded") == 1
    assert sample(text, "kvpool_connector_requests_total", outcome="no_load") == 1
    assert sample(text, "kvpool_connector_pool_tokens_total") == 6 * CHUNK
    assert sample(text, "kvpool_connector_computed_tokens_total") == len(TOKENS) + 71
    assert sample(text, "kvpool_connector_restore_bytes_total") == 6 * chunk_bytes
    assert sample(text, "kvpool_connector_save_bytes_total") == 6 * chunk_bytes
    assert sample(text, "kvpool_connector_restore_stage_seconds_count", stage="2") == 1
    assert sample(text, "kvpool_connector_restore_spread_seconds_sum") == pytest.approx(m.restore_spread_s)


def sample(text: str, name: str, **labels: str) -> float:
    """One sample's value from Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and s.labels == labels:
                return s.value
    raise AssertionError(f"no sample {name}{labels}")


def test_a_longer_turn_restores_the_history_and_computes_only_the_new_tokens(keyspace: str) -> None:
    pool = EmbeddedPool(64 << 20)
    e = Engine(pool, keyspace)
    try:
        prime(e, "turn1", TOKENS[: 4 * CHUNK + 3])  # the previous turn: 4 chunks saved
        served = e.serve("turn2", TOKENS)
        assert (served.metrics.pool_tokens, served.metrics.computed_tokens) == (4 * CHUNK, len(TOKENS) - 4 * CHUNK)
        assert served.save is not None and served.save.stored  # chunks 4 and 5 saved, not 0..3 again
        assert served.metrics.save_bytes == 2 * sum(e.spec.chunk_object_bytes(s, CHUNK) for s in range(3))
        assert_matches_reference(e, served, TOKENS)
    finally:
        e.close()


def test_a_gpu_hit_below_the_pool_hit_loads_from_the_next_chunk_boundary(keyspace: str) -> None:
    """GPU holds 300 tokens (288 in whole pages): tokens 288..511 are computed, chunks 2..5 loaded
    into the right pages (the block table read from chunk 2 on), 1536.. computed."""
    pool = EmbeddedPool(64 << 20)
    e = Engine(pool, keyspace)
    try:
        assert prime(e, "p", TOKENS).stored
        served = e.serve("r", TOKENS, save=False, gpu_hit_tokens=300)
        m = served.metrics
        assert (m.gpu_tokens, m.pool_tokens, m.computed_tokens) == (288, 4 * CHUNK, 224 + 71)
        assert e.conn.last_load is not None and e.conn.last_load.ok
        assert m.restore_bytes == 4 * sum(e.spec.chunk_object_bytes(s, CHUNK) for s in range(3))
        assert_matches_reference(e, served, TOKENS)
    finally:
        e.close()


def test_a_full_prompt_hit_on_a_chunk_boundary_computes_the_last_page_again(keyspace: str) -> None:
    """Every chunk of a 4-chunk prompt is in the pool: all four load, and prefill computes the last
    token from the start of its page, over the loaded KV of the page's other tokens."""
    pool = EmbeddedPool(64 << 20)
    e = Engine(pool, keyspace)
    tokens = TOKENS[: 4 * CHUNK]
    try:
        assert prime(e, "p", tokens).stored
        served = e.serve("r", tokens, save=False)
        m = served.metrics
        assert (m.gpu_tokens, m.pool_tokens, m.computed_tokens) == (0, 4 * CHUNK - 16, 16)
        assert e.conn.last_load is not None and e.conn.last_load.ok
        assert m.restore_bytes == 4 * sum(e.spec.chunk_object_bytes(s, CHUNK) for s in range(3))
        assert_matches_reference(e, served, tokens)
    finally:
        e.close()


def test_a_request_larger_than_the_load_buffer_loads_in_rounds(keyspace: str) -> None:
    pool = EmbeddedPool(64 << 20)
    probe = Engine(pool, keyspace)
    stage0_slot = slot_bytes_for(probe.spec.chunk_object_bytes(0, CHUNK))
    probe.close()
    cfg = WorkerConfig(load_buffer_bytes=2 * stage0_slot, save_buffer_bytes=stage0_slot, load_timeout_s=10, save_timeout_s=10)
    e = Engine(pool, keyspace, worker_config=cfg)
    try:
        arena_bytes = [w._arena.numel() for w in e.workers]
        assert prime(e, "p", TOKENS).stored  # saves in 6 windows of one slot on stage 0
        rounds: list[tuple[int, int, int]] = []
        served = e.serve("r", TOKENS, save=False, on_round=lambda s, d, t: rounds.append((s, d, t)))
        # 2 slots on stage 0, 4 on the others, used as two halves (read one while unpacking the other)
        assert [r.rounds for r in e.conn.last_reports] == [6, 3, 3]
        assert sorted(d for s, d, _ in rounds if s == 0) == [1, 2, 3, 4, 5, 6]
        assert sorted(d for s, d, _ in rounds if s == 1) == [2, 4, 6]
        assert [w._arena.numel() for w in e.workers] == arena_bytes  # never grown
        assert served.metrics.pool_tokens == 6 * CHUNK
        assert_matches_reference(e, served, TOKENS)
    finally:
        e.close()


def test_a_plan_with_another_object_size_is_rejected_without_reading(keyspace: str) -> None:
    pool = EmbeddedPool(16 << 20)
    e = Engine(pool, keyspace)
    try:
        w = e.workers[1]
        bad = LoadPlan("x", 0, 1, tuple(StageObjects(s, (f"{keyspace}/k{s}",), w.object_bytes + 256) for s in range(3)), CHUNK, False)
        rep = w.load(bad, e.new_table(CHUNK))
        assert not rep.ok and rep.reason == "size_mismatch" and rep.rounds == 0
    finally:
        e.close()


class GatedPool:
    """A real EmbeddedPool whose puts (and in-place reservations) wait on a gate (a spy to hold a
    save in flight)."""

    def __init__(self, pool: Pool) -> None:
        self.pool, self.gate, self.puts = pool, threading.Event(), 0

    def put(self, *a, **kw):
        self.puts += 1
        assert self.gate.wait(10)
        return self.pool.put(*a, **kw)

    def reserve_write(self, *a, **kw):
        self.puts += 1
        assert self.gate.wait(10)
        return self.pool.reserve_write(*a, **kw)

    def __getattr__(self, name):
        return getattr(self.pool, name)


def test_saves_are_asynchronous_and_bounded_in_flight(keyspace: str) -> None:
    gated = GatedPool(EmbeddedPool(64 << 20))
    cfg = WorkerConfig(load_buffer_bytes=4 << 20, save_buffer_bytes=4 << 20, max_inflight_saves=1, save_timeout_s=10)
    e = Engine(gated, keyspace, worker_config=cfg)
    try:
        a, b = TOKENS, prompt(2 * CHUNK, seed=99)
        ta, tb = e.new_table(len(a)), e.new_table(len(b))
        e.conn.restore("a", a, ta)
        e.conn.restore("b", b, tb)
        plan_a, fut_a = e.conn.submit_save("a", ta, len(a))  # returns at once: puts are gated
        assert not any(f.done() for f in fut_a)
        plan_b, fut_b = e.conn.submit_save("b", tb, len(b))
        assert all(f.done() and f.result().reason == "dropped" for f in fut_b)  # beyond the bound
        out_b = e.conn.complete_save(plan_b, fut_b)
        assert not out_b.stored and e.sched.plan_save("b", e.conn._digests["b"], len(b)) is not None  # planned again
        gated.gate.set()
        assert e.conn.complete_save(plan_a, fut_a).stored
        assert all(w.inflight_saves == 0 for w in e.workers)
    finally:
        gated.gate.set()
        e.close()


def test_facade_delegates_by_role_and_imports_no_torch_for_the_scheduler(keyspace: str) -> None:
    pool = EmbeddedPool(16 << 20)
    e = Engine(pool, keyspace)
    try:
        sched = KVPoolConnector.scheduler(pool, e.spec, e.naming.namespace)
        look = sched.lookup("r", sched.digests_for(TOKENS), len(TOKENS))
        assert look.answered and look.hit.pool_tokens == 0
        with pytest.raises(RuntimeError, match="scheduler side"):
            sched.submit_load(None, None)
        worker = KVPoolConnector.worker(pool, e.spec, 2, e.caches[2], WorkerConfig(load_buffer_bytes=1 << 20, save_buffer_bytes=1 << 20))
        assert isinstance(worker.impl, ConnectorWorker)
        with pytest.raises(RuntimeError, match="worker side"):
            worker.lookup("r", [], 0)
        worker.close()
    finally:
        e.close()
    code = "import sys, kvpool.backend.connector, kvpool.backend.connector_data; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False"], out.stderr


def test_prometheus_endpoint_serves_on_loopback() -> None:
    import urllib.request

    m = ConnectorMetrics()
    server, thread = m.serve(0)
    try:
        port = server.server_address[1]
        assert server.server_address[0] == "127.0.0.1"
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "kvpool_connector_restore_spread_seconds" in body
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    assert torch.get_num_threads() >= 1


@pytest.mark.gpu
def test_gpu_restore_gives_bit_identical_kv_and_logits(pool: Pool, keyspace: str) -> None:
    """The same check on the GPU: pinned host slots, device windows, Triton unpack/pack."""
    e = Engine(pool, keyspace, device="cuda")
    try:
        assert prime(e, "p", TOKENS).stored
        served = e.serve("r", TOKENS)
        assert served.metrics.pool_tokens == 6 * CHUNK and not served.metrics.restore_failed
        assert_matches_reference(e, served, TOKENS)
        recomputed = e.serve("first-gpu", prompt(3 * CHUNK + 5, seed=3))  # the compute path on the GPU too
        assert recomputed.metrics.pool_tokens == 0
        assert_matches_reference(e, recomputed, prompt(3 * CHUNK + 5, seed=3))
    finally:
        e.close()
