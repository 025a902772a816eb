"""Connector faults with real processes; every case ends with the correct KV (a full recompute's bits).

Mooncake cases start their own pools (the fixtures' launcher) and kill or restart processes by PID.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvpool.backend.connector_scheduler import SchedulerConfig
from kvpool.backend.connector_worker import WorkerConfig, slot_bytes_for
from kvpool.backend.pool import EmbeddedPool, Pool, Status
from kvpool.backend.pool.launcher import PoolSpec

from connector_testing import CHUNK, Engine, assert_matches_reference, prime, prompt
from pool_testing import TEST_RPC_TIMEOUT_MS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

MIB = 1 << 20
TOKENS = prompt(4 * CHUNK + 9, seed=11)  # 4 full chunks
#: A dead master costs ~4.3 s per call; a dead service's reads fail within ~1.1 s.
DEAD_MASTER_CALL_S = 8.0


def fault_spec(**kw) -> PoolSpec:
    base = dict(services=2, bytes_per_service=32 * MIB, lease_ttl_ms=300, client_ttl_s=2, rpc_timeout_ms=TEST_RPC_TIMEOUT_MS)
    return PoolSpec(**{**base, **kw})


def wait_for(pred, timeout_s: float, what: str) -> None:
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout_s:
            pytest.fail(f"{what} did not happen within {timeout_s} s")
        time.sleep(0.2)


def test_store_service_killed_mid_load_fails_the_load_and_the_request_recomputes(
    local_pool_factory, mooncake_client_factory, keyspace: str
) -> None:
    local = local_pool_factory(fault_spec())
    pool = mooncake_client_factory(local.address)
    slot = slot_bytes_for(589_824)
    cfg = WorkerConfig(load_buffer_bytes=slot, save_buffer_bytes=4 * slot, load_timeout_s=5, save_timeout_s=5)
    e = Engine(pool, keyspace, worker_config=cfg)  # one slot: a round per chunk
    try:
        assert prime(e, "p", TOKENS).stored
        killed = threading.Event()

        def kill_after_first_round(stage: int, done: int, total: int) -> None:
            if stage == 0 and done == 1 and not killed.is_set():
                killed.set()
                local.kill_service(0)  # the remaining chunks' objects are spread over both services

        t0 = time.monotonic()
        served = e.serve("r", TOKENS, on_round=kill_after_first_round)
        elapsed = time.monotonic() - t0
        assert killed.is_set()
        assert served.metrics.restore_failed and served.metrics.pool_tokens == 0
        assert served.metrics.computed_tokens == len(TOKENS)
        assert "failed" in {r.reason for r in e.conn.last_reports}
        assert elapsed < 5 + 10 + 3  # load timeout + the prefill's compute + slack: nothing hangs
        assert_matches_reference(e, served, TOKENS)
    finally:
        e.close()


def test_master_killed_gives_no_hits_then_recovers_after_restart(
    local_pool_factory, mooncake_client_factory, keyspace: str
) -> None:
    local = local_pool_factory(fault_spec(services=1))
    pool = mooncake_client_factory(local.address)
    sc = SchedulerConfig(recheck_after_s=60, no_answer_pause_s=0.5, no_answer_pause_factor=0.0)
    e = Engine(pool, keyspace, sched_config=sc)
    try:
        assert prime(e, "p", TOKENS).stored
        local.kill_master()
        t0 = time.monotonic()
        down = e.serve("down", TOKENS)  # lookup: no answer -> compute; save: no answer -> dropped
        assert time.monotonic() - t0 < 2 * DEAD_MASTER_CALL_S + 10
        assert not down.metrics.lookup_answered and down.metrics.computed_tokens == len(TOKENS)
        assert down.save is not None and not down.save.stored
        assert_matches_reference(e, down, TOKENS)

        local.start_master()  # forgets every key; the service re-mounts within a few seconds
        wait_for(lambda: (st := pool.stats()) is not None and st.capacity_bytes > 0, 15, "the service re-mounting")
        # the client marked the lost master down; a probe finds it again and the calls reach it
        wait_for(lambda: pool.exists(["probe"]) is not None, 15, "the client reaching the master again")
        time.sleep(sc.no_answer_pause_s)
        after = e.serve("after", TOKENS)  # answered, nothing held: compute and save again
        assert after.metrics.lookup_answered and after.metrics.pool_tokens == 0
        assert after.save is not None and after.save.stored
        assert_matches_reference(e, after, TOKENS)
        again = e.serve("again", TOKENS, save=False)
        assert again.metrics.pool_tokens == 4 * CHUNK
        assert_matches_reference(e, again, TOKENS)
    finally:
        e.close()


def test_a_chunk_held_by_only_some_stages_stops_the_hit(pool: Pool, keyspace: str) -> None:
    e = Engine(pool, keyspace)
    try:
        assert prime(e, "p", TOKENS).stored
        digests = e.sched.digests_for(TOKENS)
        assert pool.remove([e.naming.object_key(digests[2], 1)]) == [Status.OK]  # stage 1 lacks chunk 2
        served = e.serve("r", TOKENS)
        assert served.metrics.pool_tokens == 2 * CHUNK and served.metrics.computed_tokens == len(TOKENS) - 2 * CHUNK
        assert e.conn.last_lookup.hit.stranded_objects == 2 + 0 + 2  # stages 0 and 2 hold chunks 2, 3
        assert_matches_reference(e, served, TOKENS)
        assert served.save is not None and served.save.stored  # chunks 2..3 saved again: the gap is filled
        full = e.serve("full", TOKENS, save=False)
        assert full.metrics.pool_tokens == 4 * CHUNK
        assert_matches_reference(e, full, TOKENS)
    finally:
        e.close()


def test_a_wrong_size_object_is_rejected_and_the_request_recomputes(pool: Pool, keyspace: str) -> None:
    e = Engine(pool, keyspace)
    try:
        digests = e.sched.digests_for(TOKENS)
        bad_key = e.naming.object_key(digests[1], 2)
        junk = np.zeros(8192, np.uint8)
        ref = pool.register_buffer(junk)
        assert pool.put([bad_key], [e.naming.group_id(digests[1])], ref, [0], [8192]) == [Status.OK]
        pool.unregister_buffer(ref)
        assert prime(e, "p", TOKENS).stored  # first writer wins: the junk object stays
        served = e.serve("r", TOKENS)
        assert served.metrics.restore_failed and served.metrics.pool_tokens == 0
        assert [r.reason for r in e.conn.last_reports][2] == "wrong_size"
        assert e.workers[2].counters["wrong_size_removed"] == 1
        assert_matches_reference(e, served, TOKENS)
        # the bad object was removed, so the recomputed chunks were saved again: the next turn hits
        nxt = e.serve("next", TOKENS, save=False)
        assert nxt.metrics.pool_tokens == 4 * CHUNK and not nxt.metrics.restore_failed
        assert_matches_reference(e, nxt, TOKENS)
    finally:
        e.close()


def test_a_full_pool_evicts_groups_whole_and_partial_groups_never_hit(pool_kind: str, request, keyspace: str) -> None:
    """Seven deployments (namespaces) save the same 4-chunk history into a 16 MiB pool (~14 chunks)."""
    if pool_kind == "embedded":
        pool: Pool = EmbeddedPool(16 * MIB)
    else:
        local = request.getfixturevalue("local_pool_factory")(fault_spec(services=1, bytes_per_service=16 * MIB))
        pool = request.getfixturevalue("mooncake_client_factory")(local.address)
    engines = [Engine(pool, f"{keyspace}-{i}") for i in range(7)]
    try:
        t0 = time.monotonic()
        outcomes = [prime(e, f"p{i}", TOKENS) for i, e in enumerate(engines)]
        assert time.monotonic() - t0 < 7 * 3 * 2  # each put gives up within its retry budget
        assert all(o is not None for o in outcomes) and outcomes[-1].stored  # eviction made room
        stats = pool.stats()
        assert stats is not None and stats.evicted_key_count > 0
        for i, e in enumerate(engines):
            digests = e.sched.digests_for(TOKENS)
            present = pool.exists([k for row in e.naming.stage_keys(digests) for k in row])
            rows = [present[s * 4 : (s + 1) * 4] for s in range(3)]
            common = next((c for c in range(4) if not all(r[c] for r in rows)), 4)
            look = e.sched.lookup(f"l{i}", digests, len(TOKENS))
            assert look.hit.pool_prefix_chunks == common  # a partly present chunk never counts
        for i in (0, 6):  # the oldest (evicted: recomputed) and the newest (restored)
            served = engines[i].serve(f"r{i}", TOKENS, save=False)
            assert_matches_reference(engines[i], served, TOKENS)
        assert engines[6].conn.last_load is not None and engines[6].conn.last_load.ok
    finally:
        for e in engines:
            e.close()


def test_master_hung_mid_load_fails_within_the_rpc_timeout_and_the_request_recomputes(
    local_pool_factory, mooncake_client_factory, keyspace: str
) -> None:
    local = local_pool_factory(fault_spec(services=1))
    pool = mooncake_client_factory(local.address)
    slot = slot_bytes_for(589_824)
    cfg = WorkerConfig(load_buffer_bytes=slot, save_buffer_bytes=4 * slot, load_timeout_s=5, save_timeout_s=5)
    e = Engine(pool, keyspace, worker_config=cfg)
    try:
        assert prime(e, "p", TOKENS).stored
        paused = threading.Event()

        def pause_after_first_round(stage: int, done: int, total: int) -> None:
            if stage == 0 and done == 1 and not paused.is_set():
                paused.set()
                local.pause_master()

        t0 = time.monotonic()
        served = e.serve("r", TOKENS, on_round=pause_after_first_round)  # load fails; the save gets no answer
        elapsed = time.monotonic() - t0
        assert paused.is_set() and served.metrics.restore_failed
        assert "no_answer" in {r.reason for r in e.conn.last_reports}
        assert served.save is not None and not served.save.stored
        assert elapsed < 5 + 5 + 10  # load and save timeouts + compute: nothing hangs
        assert_matches_reference(e, served, TOKENS)
        local.resume_master()
        # A master hung longer than the client TTL (2 s here) drops the service on waking (no
        # heartbeats seen), forgetting its keys; the service re-mounts by itself.
        wait_for(lambda: (st := pool.stats()) is not None and st.capacity_bytes > 0, 15, "the service re-mounting")
        wait_for(lambda: pool.exists(["probe"]) is not None, 15, "the client reaching the master again")
        again = e.serve("again", TOKENS)
        assert_matches_reference(e, again, TOKENS)
        assert again.metrics.pool_tokens == 4 * CHUNK or (again.save is not None and again.save.stored)
        third = e.serve("third", TOKENS, save=False)
        assert third.metrics.pool_tokens == 4 * CHUNK
        assert_matches_reference(e, third, TOKENS)
    finally:
        local.resume_master()
        e.close()


def test_a_save_into_a_pool_too_small_for_a_chunk_is_dropped_cleanly(keyspace: str) -> None:
    """A 512 KiB pool cannot hold stage 0's 576 KiB objects: the save reports FULL, the partial
    groups it leaves never count as hits, the scheduler plans the save again, and the KV is right."""
    pool = EmbeddedPool(512 << 10)
    e = Engine(pool, keyspace)
    try:
        served = e.serve("r", TOKENS)
        assert served.save is not None and not served.save.stored and 0 in served.save.failed_stages
        assert served.metrics.save_bytes < 4 * sum(e.spec.chunk_object_bytes(s, CHUNK) for s in range(3))
        assert_matches_reference(e, served, TOKENS)
        digests = e.sched.digests_for(TOKENS)
        look = e.sched.lookup("l", digests, len(TOKENS))
        assert look.answered and look.hit.pool_tokens == 0
        e.conn.restore("again", TOKENS, e.new_table(len(TOKENS)))
        assert e.sched.plan_save("again", digests, len(TOKENS)) is not None  # retried later, not remembered as done
    finally:
        e.close()
