"""The embedded pool's arena: placement, in-place reads and writes, lent objects outliving eviction,
and the connector's in-place paths (CPU here; the CUDA streams in the ``gpu``-marked tests)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpool.backend.connector_worker import WorkerConfig, slot_bytes_for
from kvpool.backend.pool import ArenaPiece, ArenaPool, EmbeddedPool, Status
from kvpool.backend.pool.arena import Arena, Copier, ExtentAllocator

from connector_testing import CHUNK, Engine, assert_matches_reference, prime, prompt

TOKENS = prompt(6 * CHUNK + 71, seed=7)  # 6 full chunks + a partial one

MIB = 1 << 20


def test_allocator_places_a_batch_as_one_run_and_merges_freed_neighbours() -> None:
    a = ExtentAllocator(100)
    first = a.alloc_batch([10, 20, 30])
    assert first == [((0, 10),), ((10, 20),), ((30, 30),)]
    a.free([(10, 20)])
    assert a.free_bytes == 60 and a.free_extents == 2
    # 25 does not fit the 20-byte hole: it goes after the run
    assert a.alloc_batch([25]) == [((60, 25),)]
    # 30 bytes in one run fit nowhere (20 + 15 free): each object then takes a best fit or pieces
    assert a.alloc_batch([12, 18]) == [((85, 12),), ((10, 18),)]
    assert a.free_bytes == 5
    assert a.alloc_batch([6]) is None
    a.free([(10, 18), (0, 10)])
    a.free([(30, 30)])
    assert a.free_extents == 2  # [0, 60) merged from three frees, and [97, 100)
    assert a.alloc_batch([60]) == [((0, 60),)]
    a.free([(0, 60)])
    with pytest.raises(ValueError, match="double free"):
        a.free([(5, 2)])


def test_allocator_splits_an_object_over_extents_when_no_single_one_holds_it() -> None:
    a = ExtentAllocator(40)
    a.alloc_batch([10, 10, 10, 10])
    a.free([(0, 10)])
    a.free([(20, 10)])
    assert a.alloc_batch([15]) == [((0, 10), (20, 5))]
    assert a.free_bytes == 5


def test_copier_moves_every_byte_across_threads() -> None:
    src = np.random.default_rng(3).integers(0, 256, 40 * MIB + 17, dtype=np.uint8)
    dst = np.zeros_like(src)
    c = Copier(threads=3)
    c.run([(dst.ctypes.data, src.ctypes.data, src.nbytes // 2), (dst.ctypes.data + src.nbytes // 2, src.ctypes.data + src.nbytes // 2, src.nbytes - src.nbytes // 2)])
    c.close()
    assert np.array_equal(dst, src)


def test_arena_is_plain_memory_without_a_gpu() -> None:
    arena = Arena(4 * MIB, pinned=None)
    assert not arena.pinned or torch.cuda.is_available()
    arena.buffer[:4] = b"abcd"
    assert bytes(arena.buffer[:4]) == b"abcd"
    arena.close()


def _fill(pool: EmbeddedPool, keys: list[str], size: int, seed: int) -> np.ndarray:
    data = np.random.default_rng(seed).integers(0, 256, len(keys) * size, dtype=np.uint8)
    ref = pool.register_buffer(data)
    assert pool.put(keys, [f"g-{k}" for k in keys], ref, [i * size for i in range(len(keys))], [size] * len(keys)) == [Status.OK] * len(keys)
    pool.unregister_buffer(ref)
    return data


def test_a_put_is_one_run_and_a_lease_of_it_one_piece() -> None:
    pool = EmbeddedPool(8 * MIB)
    assert isinstance(pool, ArenaPool) and not pool.arena_pinned or torch.cuda.is_available()
    keys = [f"k{i}" for i in range(6)]
    data = _fill(pool, keys, 100_000, 1)
    lease = pool.lease_read(keys, [100_000] * 6)
    assert lease.statuses == [Status.OK] * 6
    assert len(lease.pieces) == 1 and lease.pieces[0].dense_offset_bytes == 0 and lease.pieces[0].nbytes == 600_000
    p = lease.pieces[0]
    assert np.array_equal(np.frombuffer(pool.arena_buffer, np.uint8, p.nbytes, p.arena_offset_bytes), data)
    lease.release()
    lease.release()  # idempotent
    pool.close()


def test_a_lease_reports_missing_and_wrong_size_and_counts_as_a_read() -> None:
    pool = EmbeddedPool(8 * MIB, clock=lambda: 0.0)
    _fill(pool, ["a", "b"], 1000, 2)
    lease = pool.lease_read(["a", "zz", "b"], [1000, 1000, 999])
    assert lease.statuses == [Status.OK, Status.MISSING, Status.WRONG_SIZE]
    assert [(p.dense_offset_bytes, p.nbytes) for p in lease.pieces] == [(0, 1000)]
    lease.release()
    assert pool._book.group("g-a").reads == 1  # one read call, as a get
    pool.close()


def test_an_object_evicted_or_removed_while_lent_keeps_its_bytes_until_the_lease_ends() -> None:
    pool = EmbeddedPool(6 * MIB, arena_headroom_bytes=MIB, clock=lambda: 0.0)
    old = _fill(pool, ["old"], 3 * MIB, 3)
    lease = pool.lease_read(["old"], [3 * MIB])
    p = lease.pieces[0]
    assert pool.remove(["old"]) == [Status.OK]
    fresh = _fill(pool, ["new1"], 3 * MIB, 4)  # lands in free bytes, not over the lent ones
    assert np.array_equal(np.frombuffer(pool.arena_buffer, np.uint8, p.nbytes, p.arena_offset_bytes), old)
    # the headroom is lent out: a third object the policy stores has no room in the arena
    data = np.zeros(2 * MIB, np.uint8)
    ref = pool.register_buffer(data)
    assert pool.put(["new2"], ["g-new2"], ref, [0], [2 * MIB]) == [Status.FULL]
    assert "new2" not in pool.keys()
    lease.release()
    assert pool.put(["new2"], ["g-new2"], ref, [0], [2 * MIB]) == [Status.OK]
    out = np.zeros(3 * MIB, np.uint8)
    ref_out = pool.register_buffer(out)
    assert pool.get(["new1"], ref_out, [0], [3 * MIB]) == [Status.OK] and np.array_equal(out, fresh)
    pool.close()


def test_a_reserved_write_reads_as_missing_until_committed_and_abort_removes_it() -> None:
    pool = EmbeddedPool(8 * MIB)
    w = pool.reserve_write(["x", "y"], ["g", "g"], [3000, 5000])
    assert w.statuses == [Status.OK, Status.OK]
    assert pool.exists(["x", "y"]) == [True, True]
    payload = np.random.default_rng(5).integers(0, 256, 8000, dtype=np.uint8)
    view = np.frombuffer(pool.arena_buffer, np.uint8)
    for p in w.pieces:
        view[p.arena_offset_bytes : p.arena_offset_bytes + p.nbytes] = payload[p.dense_offset_bytes : p.dense_offset_bytes + p.nbytes]
    out = np.zeros(8000, np.uint8)
    ref = pool.register_buffer(out)
    assert pool.get(["x", "y"], ref, [0, 3000], [3000, 5000]) == [Status.MISSING, Status.MISSING]
    w.commit()
    assert pool.get(["x", "y"], ref, [0, 3000], [3000, 5000]) == [Status.OK, Status.OK]
    assert np.array_equal(out, payload)
    w2 = pool.reserve_write(["z", "x"], ["h", "g"], [100, 3000])
    assert w2.statuses == [Status.OK, Status.OK] and [p.dense_offset_bytes for p in w2.pieces] == [0]  # x is present
    w2.abort()
    assert pool.exists(["z", "x"]) == [False, True]
    assert pool.arena_info()["free_bytes"] == pool.arena_info()["arena_bytes"] - 8000
    pool.close()


def test_a_fragmented_arena_still_round_trips_bit_exact() -> None:
    pool = EmbeddedPool(1 * MIB, arena_headroom_bytes=0, clock=lambda: 0.0)
    keys = [f"s{i}" for i in range(10)]
    _fill(pool, keys, 90_000, 6)
    pool.remove(keys[::2])  # five 90 kB holes
    big = _fill(pool, ["big"], 400_000, 7)  # fits only in pieces
    lease = pool.lease_read(["big"], [400_000])
    assert len(lease.pieces) > 1 and sum(p.nbytes for p in lease.pieces) == 400_000
    lease.release()
    out = np.zeros(400_000, np.uint8)
    ref = pool.register_buffer(out)
    assert pool.get(["big"], ref, [0], [400_000]) == [Status.OK] and np.array_equal(out, big)
    pool.close()


@pytest.mark.parametrize("in_place", [True, False])
def test_restore_is_bit_exact_in_place_and_through_the_slots(keyspace: str, in_place: bool) -> None:
    e = Engine(EmbeddedPool(64 << 20), keyspace, worker_config=WorkerConfig(load_buffer_bytes=8 << 20, save_buffer_bytes=4 << 20, use_pool_arena=in_place))
    try:
        assert all((w._arena_pool is not None) == in_place for w in e.workers)
        assert prime(e, "p", TOKENS).stored
        served = e.serve("r", TOKENS, save=False)
        assert served.metrics.pool_tokens == 6 * CHUNK and not served.metrics.restore_failed
        assert_matches_reference(e, served, TOKENS)
    finally:
        e.close()


def test_in_place_restore_from_a_fragmented_arena_goes_through_the_slots(keyspace: str) -> None:
    pool = EmbeddedPool(64 << 20, high_watermark=1.0, arena_headroom_bytes=0)
    probe = Engine(pool, keyspace)
    slot = slot_bytes_for(min(probe.spec.chunk_object_bytes(s, CHUNK) for s in range(probe.spec.stages)))
    probe.close()
    # fill the arena, then free every other filler: holes smaller than any object everywhere, so
    # the history is stored in pieces and its restore gathers them into the load slots
    keys = [f"fill{i}" for i in range((64 << 20) // (slot // 3))]
    buf = np.zeros(slot // 3, np.uint8)
    ref = pool.register_buffer(buf)
    for k in keys:
        pool.put([k], [f"g{k}"], ref, [0], [slot // 3])
    pool.remove(keys[::2])
    pool.unregister_buffer(ref)
    e = Engine(pool, keyspace)
    try:
        assert prime(e, "p", TOKENS).stored
        served = e.serve("r", TOKENS, save=False)
        assert served.metrics.pool_tokens == 6 * CHUNK
        assert_matches_reference(e, served, TOKENS)
    finally:
        e.close()


@pytest.mark.gpu
def test_gpu_in_place_restore_from_the_pinned_arena_is_bit_exact(keyspace: str) -> None:
    """Pinned arena, copy stream + unpack stream, device halves, D2H saves into the arena."""
    pool = EmbeddedPool(256 << 20)
    assert pool.arena_pinned, pool.arena_info()
    cfg = WorkerConfig(load_buffer_bytes=8 << 20, save_buffer_bytes=4 << 20, device_window_bytes=1 << 20)  # rounds of 1-2 objects
    e = Engine(pool, keyspace, device="cuda", worker_config=cfg)
    try:
        assert all(w._arena_pool is not None and w.half_objects >= 1 for w in e.workers)
        assert prime(e, "p", TOKENS).stored
        served = e.serve("r", TOKENS, save=False)
        assert served.metrics.pool_tokens == 6 * CHUNK and not served.metrics.restore_failed
        assert_matches_reference(e, served, TOKENS)
    finally:
        e.close()


def test_pieces_are_plain_values() -> None:
    assert ArenaPiece(1, 2, 3) == ArenaPiece(1, 2, 3)
