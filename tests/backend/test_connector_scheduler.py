"""The connector's scheduler side against real pools (embedded and Mooncake): one batched existence
check per lookup, the all-stage hit rule, the recheck bound, "no answer", load/save bookkeeping."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from kvpool.backend.connector_scheduler import ConnectorScheduler, SchedulerConfig, StageReport
from kvpool.backend.pool import Pool, Status
from kvpool.policy.chunks import ChunkNaming
from kvpool.policy.kvspec import KVSpec

from pool_testing import TEST_RPC_TIMEOUT_MS

# a small MLA-like model: 6 layers x 64 B records, 3 stages; chunk objects of 256 x 128 B = 32 KiB
SPEC = KVSpec(model="tiny-mla", layers=6, record_bytes=64, stage_layers=(2, 2, 2))
CHUNK = 256


class CountingPool:
    """Delegates to a real pool, counting existence calls and keys (a spy, not a fake)."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.exist_calls: list[int] = []

    def exists(self, keys):
        self.exist_calls.append(len(keys))
        return self.pool.exists(keys)


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def save_chunks(pool: Pool, naming: ChunkNaming, digests, stages=None, skip=()) -> None:
    """Store chunk objects of the right size for ``stages`` (all by default), except ``(chunk, stage)`` in skip."""
    size = SPEC.chunk_object_bytes(0, CHUNK)
    buf = np.zeros(size, np.uint8)
    ref = pool.register_buffer(buf)
    for c, d in enumerate(digests):
        todo = [s for s in (stages if stages is not None else range(SPEC.stages)) if (c, s) not in skip]
        keys = [naming.object_key(d, s) for s in todo]
        assert pool.put(keys, [naming.group_id(d)] * len(keys), ref, [0] * len(keys), [size] * len(keys)) == [Status.OK] * len(keys)
    pool.unregister_buffer(ref)


def make(pool: Pool, keyspace: str, **cfg) -> tuple[ConnectorScheduler, CountingPool, Clock]:
    spy, clock = CountingPool(pool), Clock()
    naming = ChunkNaming(namespace=keyspace, stages=SPEC.stages)
    return ConnectorScheduler(spy, naming, SPEC, SchedulerConfig(**cfg), clock=clock), spy, clock


def test_scheduler_imports_no_torch_or_mooncake() -> None:
    code = "import sys, kvpool.backend.connector_scheduler; print('torch' in sys.modules, 'mooncake' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_lookup_asks_once_for_every_stage_and_chunk_and_applies_the_all_stage_rule(pool: Pool, keyspace: str) -> None:
    sched, spy, _ = make(pool, keyspace)
    tokens = list(range(10 * CHUNK + 40))
    digests = sched.digests_for(tokens)
    assert len(digests) == 10
    save_chunks(pool, sched.naming, digests[:8], skip={(5, 1)})  # stage 1 lacks chunk 5; chunks 8, 9 absent
    look = sched.lookup("r1", digests, len(tokens), gpu_hit_tokens=0)
    assert spy.exist_calls == [3 * 10]  # one batched check: 3 stages x 10 chunks
    assert look.answered and look.keys_checked == 30 and look.exist_calls == 1
    assert look.hit.pool_prefix_chunks == 5 and look.hit.pool_tokens == 5 * CHUNK
    assert look.hit.stranded_objects == 3 + 3  # runs of stages 0 and 2 reach chunk 8; stage 1 stops at 5
    assert look.hit.computed_tokens == len(tokens) - 5 * CHUNK


def test_gpu_hit_and_last_token_rules_come_from_policy_hits(pool: Pool, keyspace: str) -> None:
    sched, _, _ = make(pool, keyspace)
    tokens = list(range(4 * CHUNK))  # exactly 4 chunks: the last token is always computed
    digests = sched.digests_for(tokens)
    save_chunks(pool, sched.naming, digests)
    look = sched.lookup("r", digests, len(tokens), gpu_hit_tokens=300)  # GPU holds 300 -> load from chunk 2
    h = look.hit
    assert (h.gpu_tokens, h.load_first_chunk, h.load_end_chunk) == (288, 2, 4)
    assert h.pool_tokens == 2 * CHUNK - 16 and h.gpu_tokens + h.pool_tokens + h.computed_tokens == 4 * CHUNK
    plan = sched.plan_load(look)
    assert plan is not None and (plan.first_chunk, plan.end_chunk) == (2, 4)


def test_large_lookups_are_split_at_the_batch_bound(pool: Pool, keyspace: str) -> None:
    sched, spy, _ = make(pool, keyspace, lookup_batch_keys=7)
    digests = sched.digests_for(list(range(5 * CHUNK)))
    save_chunks(pool, sched.naming, digests)
    look = sched.lookup("r", digests, 5 * CHUNK + 1)
    assert spy.exist_calls == [7, 7, 1] and look.hit.pool_prefix_chunks == 5


def test_load_plan_names_every_stage_key_with_its_exact_size_and_loads(pool: Pool, keyspace: str) -> None:
    sched, _, _ = make(pool, keyspace)
    digests = sched.digests_for(list(range(3 * CHUNK)))
    save_chunks(pool, sched.naming, digests)
    plan = sched.plan_load(sched.lookup("r", digests, 3 * CHUNK + 5))
    assert plan is not None and not plan.rechecked
    assert [s.stage for s in plan.stages] == [0, 1, 2]
    assert all(len(s.keys) == 3 and s.object_bytes == 32 * 1024 for s in plan.stages)
    assert plan.total_bytes == 3 * 3 * 32 * 1024
    # what a stage worker does with it: every object reads with exactly that size
    buf = np.zeros(3 * 32 * 1024, np.uint8)
    ref = pool.register_buffer(buf)
    for st in plan.stages:
        offs = [i * st.object_bytes for i in range(len(st.keys))]
        assert pool.get(list(st.keys), ref, offs, [st.object_bytes] * len(st.keys)) == [Status.OK] * 3


def test_stale_lookup_is_rechecked_before_the_load(pool: Pool, keyspace: str) -> None:
    sched, spy, clock = make(pool, keyspace, recheck_after_s=1.0)
    digests = sched.digests_for(list(range(6 * CHUNK)))
    save_chunks(pool, sched.naming, digests)
    look = sched.lookup("r", digests, 6 * CHUNK + 1)
    assert look.hit.pool_prefix_chunks == 6
    clock.now_s += 0.5
    fresh = sched.plan_load(look)  # young enough: no second check
    assert fresh is not None and not fresh.rechecked and len(spy.exist_calls) == 1
    sched.finish("r")  # forget that load: the same lookup plans again below
    pool.remove([sched.naming.object_key(digests[3], 2)])  # evicted meanwhile
    clock.now_s += 1.0
    stale = sched.plan_load(look)
    assert stale is not None and stale.rechecked and len(spy.exist_calls) == 2
    assert stale.end_chunk == 3  # the recheck shrank the load to what every stage still holds


def test_no_answer_means_compute_and_pauses_lookups(local_pool_factory, mooncake_client_factory, keyspace: str) -> None:
    from kvpool.backend.pool.launcher import PoolSpec

    local = local_pool_factory(PoolSpec(services=1, bytes_per_service=16 << 20, lease_ttl_ms=300, client_ttl_s=20, rpc_timeout_ms=TEST_RPC_TIMEOUT_MS))
    pool = mooncake_client_factory(local.address)
    sched, spy, clock = make(pool, keyspace, no_answer_pause_s=30.0)
    digests = sched.digests_for(list(range(4 * CHUNK)))
    save_chunks(pool, sched.naming, digests)
    look = sched.lookup("r", digests, 4 * CHUNK + 1)
    assert look.hit.pool_prefix_chunks == 4
    local.pause_master()  # hung master: the check times out after MC_RPC_TIMEOUT_MS
    try:
        look = sched.lookup("r", digests, 4 * CHUNK + 1)
        assert not look.answered and look.hit.pool_tokens == 0 and look.hit.computed_tokens == 4 * CHUNK + 1
        assert sched.plan_load(look) is None
        calls = len(spy.exist_calls)
        clock.now_s += 10.0  # still paused: answered at once without asking the pool
        again = sched.lookup("r2", digests, 4 * CHUNK + 1)
        assert not again.answered and len(spy.exist_calls) == calls and sched.no_answer_count == 1
    finally:
        local.resume_master()
    # the client marked the master down; its next probe (a period later) finds it again
    end = time.monotonic() + 15.0
    while pool.exists(["probe"]) is None:
        assert time.monotonic() < end, "the client did not reach the master again within 15 s"
        time.sleep(0.2)
    clock.now_s += 30.0  # the pause is over: the pool is asked again and answers
    back = sched.lookup("r3", digests, 4 * CHUNK + 1)
    assert back.answered and back.hit.pool_prefix_chunks == 4


def test_load_is_ready_only_when_every_stage_reported_and_fails_if_any_stage_failed(pool: Pool, keyspace: str) -> None:
    sched, _, _ = make(pool, keyspace)
    digests = sched.digests_for(list(range(4 * CHUNK)))
    save_chunks(pool, sched.naming, digests)
    plan = sched.plan_load(sched.lookup("ok", digests, 4 * CHUNK + 1))
    assert plan is not None
    assert sched.report_stage(StageReport("ok", 2, True, 10.2, 10.5, 100)) is None
    assert sched.report_stage(StageReport("ok", 0, True, 10.0, 10.3, 100)) is None
    out = sched.report_stage(StageReport("ok", 1, True, 10.1, 10.9, 100))
    assert out is not None and out.ok and out.pool_tokens == 4 * CHUNK
    assert out.stage_load_s == pytest.approx((0.3, 0.8, 0.3)) and out.first_to_last_s == pytest.approx(0.9)
    assert out.bytes_loaded == 300 and out.failed_stages == ()
    with pytest.raises(ValueError, match="no load in progress"):
        sched.report_stage(StageReport("ok", 0, True, 0, 0))

    plan = sched.plan_load(sched.lookup("bad", digests, 4 * CHUNK + 1))
    assert plan is not None
    assert sched.report_stage(StageReport("bad", 0, True, 0.0, 0.1)) is None
    assert sched.report_stage(StageReport("bad", 1, False, 0.0, 0.2)) is None  # waits for stage 2 still
    with pytest.raises(ValueError, match="already reported"):
        sched.report_stage(StageReport("bad", 1, True, 0.0, 0.2))
    out = sched.report_stage(StageReport("bad", 2, True, 0.0, 0.1))
    assert out is not None and not out.ok and out.pool_tokens == 0 and out.failed_stages == (1,)
    # the failed load lowered the save floor: the recomputed chunks are saved again
    save = sched.plan_save("bad", digests, 4 * CHUNK + 1)
    assert save is not None and (save.first_chunk, save.end_chunk) == (0, 4)


def load_every_stage(sched: ConnectorScheduler, look) -> None:
    """Plan ``look``'s load and report it done on every stage."""
    plan = sched.plan_load(look)
    assert plan is not None
    for s in range(SPEC.stages):
        sched.report_stage(StageReport(look.request_id, s, True, 0.0, 0.1, 100))


def test_saves_cover_only_new_full_chunks_one_in_flight_per_request(pool: Pool, keyspace: str) -> None:
    sched, _, _ = make(pool, keyspace, max_inflight_saves=2)
    digests = sched.digests_for(list(range(8 * CHUNK)))
    save_chunks(pool, sched.naming, digests[:3])
    look = sched.lookup("a", digests, 8 * CHUNK + 1)
    assert look.hit.pool_prefix_chunks == 3
    with pytest.raises(ValueError, match="load ended"):
        sched.plan_save("a", digests, 8 * CHUNK)  # its load is not done: nothing computed yet
    load_every_stage(sched, look)
    save = sched.plan_save("a", digests, 5 * CHUNK + 100)  # chunks 3, 4 are new and full
    assert save is not None and (save.first_chunk, save.end_chunk) == (3, 5)
    assert save.group_ids == tuple(sched.naming.group_id(d) for d in digests[3:5])
    assert all(s.keys == tuple(sched.naming.object_key(d, s.stage) for d in digests[3:5]) for s in save.stages)
    assert sched.plan_save("a", digests, 8 * CHUNK) is None  # one save per request in flight
    sched.complete_save("a", stored=True)
    nxt = sched.plan_save("a", digests, 8 * CHUNK)
    assert nxt is not None and (nxt.first_chunk, nxt.end_chunk) == (5, 8)
    sched.complete_save("a", stored=False)  # dropped (e.g. the pool stayed full): tried again later
    retry = sched.plan_save("a", digests, 8 * CHUNK)
    assert retry is not None and (retry.first_chunk, retry.end_chunk) == (5, 8)
    # the global bound on saves in flight
    other = sched.digests_for(list(range(1, 2 * CHUNK + 1)))  # a prompt the pool does not hold
    sched.lookup("b", other, 2 * CHUNK)
    sched.lookup("c", other, 2 * CHUNK)
    assert sched.plan_save("b", other, 2 * CHUNK) is not None and sched.inflight_saves == 2
    assert sched.plan_save("c", other, 2 * CHUNK) is None
    with pytest.raises(ValueError, match="no save in flight"):
        sched.complete_save("c", stored=True)
    with pytest.raises(ValueError, match="not looked up"):
        sched.plan_save("d", other, 2 * CHUNK)


def test_config_and_spec_are_checked() -> None:
    with pytest.raises(ValueError, match="multiple of page_tokens"):
        SchedulerConfig(chunk_tokens=100)
    with pytest.raises(ValueError, match="stages"):
        ConnectorScheduler(CountingPool(None), ChunkNaming("ns", 2), SPEC)  # type: ignore[arg-type]
