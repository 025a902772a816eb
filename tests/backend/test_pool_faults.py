"""Pool-level faults with real Mooncake processes: nothing hangs, every failure reads as a miss.

Each test starts its own pool (the fixtures' launcher is ``kvpool pool up``'s) and kills or pauses
its processes by PID.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from kvpool.backend.pool import Status
from kvpool.backend.pool.launcher import PoolSpec
from kvpool.backend.pool.metrics import read_master_metrics
from kvpool.backend.pool.mooncake import MooncakePool, PoolUnavailable, PutRetry

from pool_testing import TEST_RPC_TIMEOUT_MS

KIB = 1 << 10
MIB = 1 << 20
OBJ = 512 * KIB
#: The call that finds the master dead: -900 at once, or after ~4.3 s of reconnects; a hung one MC_RPC_TIMEOUT_MS.
DEAD_MASTER_BOUND_S = 8.0
#: Every later call while the master stays dead: refused without a Mooncake call, or after one probe of
#: the master's port (refused at once on loopback).
LOST_MASTER_CALL_BOUND_S = 0.25
HUNG_MASTER_BOUND_S = TEST_RPC_TIMEOUT_MS / 1000 + 3.0
#: Reads from a dead store service fail after the transport's reconnect attempts (~1 s measured).
DEAD_SERVICE_BOUND_S = 3.0

pytestmark = pytest.mark.slow


def fault_spec(**kw) -> PoolSpec:
    base = dict(services=2, bytes_per_service=32 * MIB, lease_ttl_ms=100, client_ttl_s=2, rpc_timeout_ms=TEST_RPC_TIMEOUT_MS)
    return PoolSpec(**{**base, **kw})


def wait_for(pred: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.2) -> float:
    """Poll ``pred`` until true; fail after ``timeout_s``. Returns the seconds it took."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout_s:
            pytest.fail(f"{what} did not happen within {timeout_s} s")
        time.sleep(poll_s)
    return time.monotonic() - t0


def timed(fn, *args):
    t0 = time.monotonic()
    out = fn(*args)
    return out, time.monotonic() - t0


def fill(pool: MooncakePool, n: int, prefix: str, seed: int):
    src = np.random.default_rng(seed).integers(0, 256, n * OBJ, dtype=np.uint8)
    dst = np.zeros(n * OBJ, np.uint8)
    rs, rd = pool.register_buffer(src), pool.register_buffer(dst)
    keys = [f"{prefix}/{i}" for i in range(n)]
    offsets = [i * OBJ for i in range(n)]
    assert pool.put(keys, [f"{prefix}/g{i // 4}" for i in range(n)], rs, offsets, [OBJ] * n) == [Status.OK] * n
    return keys, offsets, src, dst, rs, rd


def test_killed_store_services_read_as_misses_and_their_keys_vanish(local_pool_factory, mooncake_client_factory) -> None:
    """Kill one service while idle (its keys linger until the client TTL), one under a running reader."""
    local = local_pool_factory(fault_spec(services=3))
    pool = mooncake_client_factory(local.address)
    n = 48
    keys, offsets, src, dst, rs, rd = fill(pool, n, "svc", 1)
    used = {s.segment: s.used_bytes for s in read_master_metrics(local.address.metrics_url).segments}
    by_use = sorted(range(3), key=lambda i: used[local.segments[i]])
    assert all(used[seg] > 0 for seg in local.segments)  # random placement spread the objects
    first, second = by_use[2], by_use[1]  # the survivor (by_use[0]) keeps the fewest

    def check(statuses: list[Status], allowed: set[Status]) -> list[int]:
        assert set(statuses) <= allowed, statuses
        ok = [i for i, st in enumerate(statuses) if st == Status.OK]
        for i in ok:
            assert np.array_equal(dst[offsets[i] : offsets[i] + OBJ], src[offsets[i] : offsets[i] + OBJ])
        return ok

    # 1. idle kill: the dead service's keys still "exist" (until --client_ttl), but reads fail fast
    local.kill_service(first, signal.SIGKILL)
    assert pool.exists(keys) == [True] * n
    dst[:] = 0
    statuses, took_s = timed(pool.get, keys, rd, offsets, [OBJ] * n)
    assert took_s < DEAD_SERVICE_BOUND_S  # connection refused: fails after a few quick reconnects
    # lost objects fail; with a short lease the slow batch may also fail live keys (-707): misses too
    check(statuses, {Status.OK, Status.FAILED, Status.MISSING})
    assert Status.FAILED in statuses

    # 2. kill another service under a running reader: every call returns promptly, nothing raises
    stop, durations_s, errors = threading.Event(), [], []

    def reader() -> None:
        buf = np.zeros(n * OBJ, np.uint8)
        ref = pool.register_buffer(buf)
        try:
            while not stop.is_set():
                t0 = time.monotonic()
                pool.get(keys, ref, offsets, [OBJ] * n)
                durations_s.append(time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 -- reported below
            errors.append(e)
        finally:
            pool.unregister_buffer(ref)

    thread = threading.Thread(target=reader)
    thread.start()
    time.sleep(0.3)
    local.kill_service(second, signal.SIGKILL)
    time.sleep(0.5)
    stop.set()
    thread.join(timeout=10)
    assert not thread.is_alive() and not errors
    assert durations_s and max(durations_s) < DEAD_SERVICE_BOUND_S, max(durations_s)

    # 3. after the master drops the dead services' keys: the survivor's objects load, the rest miss
    def settled() -> bool:
        return set(pool.get(keys, rd, offsets, [OBJ] * n)) <= {Status.OK, Status.MISSING}

    wait_for(settled, 10.0, "the dead services' keys disappearing")
    dst[:] = 0
    statuses = pool.get(keys, rd, offsets, [OBJ] * n)
    kept = check(statuses, {Status.OK, Status.MISSING})
    lost = [i for i in range(n) if i not in kept]
    assert kept and lost
    assert pool.exists([keys[i] for i in lost]) == [False] * len(lost)
    assert pool.exists([keys[i] for i in kept]) == [True] * len(kept)
    # the pool goes on with the surviving service
    new = [f"after/{i}" for i in range(4)]
    assert pool.put(new, ["after"] * 4, rs, offsets[:4], [OBJ] * 4) == [Status.OK] * 4
    assert pool.get(new, rd, offsets[:4], [OBJ] * 4) == [Status.OK] * 4


def test_killed_master_gives_no_answer_then_recovers_empty_after_restart(local_pool_factory, mooncake_client_factory) -> None:
    local = local_pool_factory(fault_spec())
    pool = mooncake_client_factory(local.address)
    keys, offsets, src, dst, rs, rd = fill(pool, 8, "m", 2)
    local.kill_master(signal.SIGKILL)

    answer, took_s = timed(pool.exists, keys)
    assert answer is None and took_s < DEAD_MASTER_BOUND_S  # "no answer", never a guess
    assert not pool.reachability.up and pool.reachability.losses == 1
    for _ in range(3):  # the pool is down: every call answers at once, across probe periods
        statuses, took_s = timed(pool.get, keys, rd, offsets, [OBJ] * 8)
        assert set(statuses) == {Status.NO_ANSWER} and took_s < LOST_MASTER_CALL_BOUND_S
        statuses, took_s = timed(pool.put, ["m/new"], ["m/g"], rs, [0], [OBJ])
        assert statuses == [Status.NO_ANSWER] and took_s < LOST_MASTER_CALL_BOUND_S  # not retried as "full"
        answer, took_s = timed(pool.exists, keys)
        assert answer is None and took_s < LOST_MASTER_CALL_BOUND_S
        assert not pool.reachable()
        time.sleep(pool.reachability.reprobe_every_s)
    assert pool.reachability.probes >= 2 and pool.reachability.losses == 1  # one per period after the first
    assert pool.stats() is None

    local.start_master()  # same ports; it has forgotten every key
    # the next probe finds it (within one probe period) and the calls reach it again
    wait_for(lambda: pool.exists(keys) is not None, 15.0, "the client reconnecting")
    assert pool.reachability.up and pool.reachable()
    assert pool.exists(keys) == [False] * 8  # no hits after a master restart
    assert pool.get(keys[:1], rd, [0], [OBJ]) == [Status.MISSING]

    # services re-mount their segments within a few seconds; then saves and loads work again
    wait_for(lambda: pool.put(keys, ["m/g"] * 8, rs, offsets, [OBJ] * 8) == [Status.OK] * 8, 15.0, "puts succeeding")
    dst[:] = 0
    assert pool.get(keys, rd, offsets, [OBJ] * 8) == [Status.OK] * 8
    assert np.array_equal(dst, src)
    # both services re-mount (one may still be on its way when the first put lands)
    wait_for(lambda: getattr(pool.stats(), "capacity_bytes", 0) == 2 * 32 * MIB, 15.0, "both services re-mounting")
    assert getattr(pool.stats(), "key_count", None) == 8


def test_hung_master_times_out_within_the_rpc_timeout_and_recovers(local_pool_factory, mooncake_client_factory) -> None:
    local = local_pool_factory(fault_spec(client_ttl_s=20))  # services must outlive the pause
    pool = mooncake_client_factory(local.address)
    keys, offsets, src, dst, rs, rd = fill(pool, 4, "h", 3)
    local.pause_master()
    try:
        answer, took_s = timed(pool.exists, keys)
        assert answer is None and took_s < HUNG_MASTER_BOUND_S
        statuses, took_s = timed(pool.get, keys, rd, offsets, [OBJ] * 4)
        assert set(statuses) == {Status.NO_ANSWER} and took_s < HUNG_MASTER_BOUND_S
    finally:
        local.resume_master()
    wait_for(lambda: pool.exists(keys) == [True] * 4, 10.0, "answers after the master resumed")
    assert pool.get(keys, rd, offsets, [OBJ] * 4) == [Status.OK] * 4
    assert np.array_equal(dst, src)


def test_pool_full_of_leased_objects_drops_saves_after_the_retry_budget(local_pool_factory, mooncake_client_factory) -> None:
    local = local_pool_factory(fault_spec(services=1, bytes_per_service=16 * MIB, lease_ttl_ms=30_000))
    pool = mooncake_client_factory(local.address, put_retry=PutRetry(first_delay_s=0.02, max_delay_s=0.1, budget_s=0.5))
    keys, offsets, src, dst, rs, rd = fill(pool, 28, "l", 4)  # 14 MiB of 16
    assert pool.exists(keys) == [True] * 28  # every object now holds a 30 s lease: nothing is evictable
    # 4 MiB cannot fit in the 2 MiB left, and no leased object may go: retried, then dropped
    statuses, took_s = timed(pool.put, ["l/big"], ["l/big"], rs, [0], [8 * OBJ])
    assert statuses == [Status.FULL]
    assert 0.4 < took_s < 0.5 + 2.0  # retried for the budget, then gave up
    assert pool.exists(keys) == [True] * 28  # leased objects were not evicted
    assert pool.exists(["l/big"]) == [False]


def test_absent_master_is_reported_at_once() -> None:
    from kvpool.backend.pool.launcher import free_port

    t0 = time.monotonic()
    with pytest.raises(PoolUnavailable, match="no Mooncake master answers"):
        MooncakePool(f"127.0.0.1:{free_port()}")
    assert time.monotonic() - t0 < 3.0
