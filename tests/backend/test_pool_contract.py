"""The ``Pool`` contract, run against every implementation (EmbeddedPool and a real Mooncake pool)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvpool.backend.pool import EmbeddedPool, Pool, Status
from kvpool.policy.chunks import ChunkNaming
from kvpool.policy.hits import compute_hits

from pool_testing import LEASE_TTL_MS

KIB = 1 << 10
MIB = 1 << 20
OK = Status.OK


def random_bytes(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_round_trip_is_bit_identical(pool: Pool, keyspace: str) -> None:
    src = random_bytes(4 * MIB, 1)
    dst = np.zeros(4 * MIB, dtype=np.uint8)
    rs, rd = pool.register_buffer(src), pool.register_buffer(dst)
    sizes = [1, 4097, MIB, 256 * KIB]
    offsets = [3, 100, MIB, 3 * MIB]
    keys = [f"{keyspace}/k{i}" for i in range(len(sizes))]
    assert pool.put(keys, [f"{keyspace}/g"] * 4, rs, offsets, sizes) == [OK] * 4
    dst_offsets = [0, 7, 2 * MIB, MIB + 5]
    assert pool.get(keys, rd, dst_offsets, sizes) == [OK] * 4
    for so, do, n in zip(offsets, dst_offsets, sizes):
        assert np.array_equal(dst[do : do + n], src[so : so + n])


@pytest.mark.parametrize("kind", ["bytearray", "numpy", "torch"])
def test_registers_bytearray_numpy_and_cpu_tensors(pool: Pool, keyspace: str, kind: str) -> None:
    if kind == "bytearray":
        src, dst = bytearray(random_bytes(8 * KIB, 2).tobytes()), bytearray(8 * KIB)
        view = lambda b: bytes(b)  # noqa: E731
    elif kind == "numpy":
        src, dst = random_bytes(8 * KIB, 2), np.zeros(8 * KIB, np.uint8)
        view = lambda b: b.tobytes()  # noqa: E731
    else:
        torch = pytest.importorskip("torch")
        src = torch.from_numpy(random_bytes(8 * KIB, 2)).view(torch.float16)
        dst = torch.zeros(4 * KIB, dtype=torch.float16)
        view = lambda b: b.numpy().tobytes()  # noqa: E731
    rs, rd = pool.register_buffer(src), pool.register_buffer(dst)
    assert rs.size_bytes == rd.size_bytes == 8 * KIB
    key = f"{keyspace}/obj"
    assert pool.put([key], ["g"], rs, [0], [8 * KIB]) == [OK]
    assert pool.get([key], rd, [0], [8 * KIB]) == [OK]
    assert view(dst) == view(src)
    pool.unregister_buffer(rd)
    with pytest.raises(ValueError, match="not registered"):
        pool.get([key], rd, [0], [8 * KIB])


def test_exists_answers_every_key_in_one_batch(pool: Pool, keyspace: str) -> None:
    src = random_bytes(64 * KIB, 3)
    rs = pool.register_buffer(src)
    present = [f"{keyspace}/p{i}" for i in range(5)]
    assert pool.put(present, ["g"] * 5, rs, [i * KIB for i in range(5)], [KIB] * 5) == [OK] * 5
    query = [present[0], f"{keyspace}/missing", *present[1:], f"{keyspace}/missing2"]
    assert pool.exists(query) == [True, False, True, True, True, True, False]
    assert pool.exists([]) == []


def test_first_writer_wins(pool: Pool, keyspace: str) -> None:
    a, b = random_bytes(4 * KIB, 4), random_bytes(4 * KIB, 5)
    dst = np.zeros(4 * KIB, np.uint8)
    ra, rb, rd = pool.register_buffer(a), pool.register_buffer(b), pool.register_buffer(dst)
    key = f"{keyspace}/same"
    assert pool.put([key], ["g1"], ra, [0], [4 * KIB]) == [OK]
    assert pool.put([key], ["g1"], rb, [0], [4 * KIB]) == [OK]  # reported OK, changes nothing
    assert pool.put([key], ["g2"], rb, [0], [4 * KIB]) == [OK]  # not even another group
    assert pool.get([key], rd, [0], [4 * KIB]) == [OK]
    assert np.array_equal(dst, a)


def test_missing_key_is_a_miss_and_others_in_the_batch_still_load(pool: Pool, keyspace: str) -> None:
    src = random_bytes(8 * KIB, 6)
    dst = np.zeros(8 * KIB, np.uint8)
    rs, rd = pool.register_buffer(src), pool.register_buffer(dst)
    assert pool.put([f"{keyspace}/a"], ["g"], rs, [0], [4 * KIB]) == [OK]
    got = pool.get([f"{keyspace}/nope", f"{keyspace}/a"], rd, [0, 4 * KIB], [4 * KIB, 4 * KIB])
    assert got == [Status.MISSING, OK]
    assert np.array_equal(dst[4 * KIB :], src[: 4 * KIB])


def test_wrong_size_object_is_rejected(pool: Pool, keyspace: str) -> None:
    src = random_bytes(16 * KIB, 7)
    dst = np.zeros(16 * KIB, np.uint8)
    rs, rd = pool.register_buffer(src), pool.register_buffer(dst)
    key = f"{keyspace}/obj"
    assert pool.put([key], ["g"], rs, [0], [4 * KIB]) == [OK]
    assert pool.get([key], rd, [0], [4 * KIB - 1]) == [Status.WRONG_SIZE]  # object larger than the range
    assert pool.get([key], rd, [0], [4 * KIB + 1]) == [Status.WRONG_SIZE]  # object smaller than the range
    assert pool.get([key], rd, [0], [4 * KIB]) == [OK]


def test_remove(pool: Pool, keyspace: str) -> None:
    src = random_bytes(4 * KIB, 8)
    rs = pool.register_buffer(src)
    keys = [f"{keyspace}/a", f"{keyspace}/b"]
    assert pool.put(keys, ["g", "g"], rs, [0, 2 * KIB], [2 * KIB, 2 * KIB]) == [OK, OK]
    assert pool.exists(keys) == [True, True]  # leases them (Mooncake); remove must still work
    assert pool.remove([keys[0], f"{keyspace}/never"]) == [OK, Status.MISSING]
    assert pool.exists(keys) == [False, True]


def test_bad_calls_raise_before_anything_moves(pool: Pool, keyspace: str) -> None:
    src = random_bytes(8 * KIB, 9)
    rs = pool.register_buffer(src)
    key = f"{keyspace}/k"
    with pytest.raises(ValueError, match="outside"):
        pool.put([key], ["g"], rs, [4 * KIB], [4 * KIB + 1])
    with pytest.raises(ValueError, match="outside"):
        pool.get([key], rs, [-1], [16])
    with pytest.raises(ValueError, match="size must be > 0"):
        pool.put([key], ["g"], rs, [0], [0])
    with pytest.raises(ValueError, match="differ in length"):
        pool.put([key, key + "2"], ["g", "g"], rs, [0], [16])
    with pytest.raises(ValueError, match="group ids"):
        pool.put([key], [], rs, [0], [16])
    with pytest.raises(ValueError, match="non-empty"):
        pool.put([""], ["g"], rs, [0], [16])
    with pytest.raises(ValueError, match="overlaps"):
        pool.register_buffer(src[KIB:])
    with pytest.raises(ValueError, match="writable|contiguous"):
        pool.register_buffer(src[::2])
    with pytest.raises(ValueError, match="cannot register"):
        pool.register_buffer(b"read-only bytes")
    assert pool.exists([key]) == [False]


def test_stats_report_capacity_use_and_keys(pool: Pool, keyspace: str) -> None:
    src = random_bytes(MIB, 10)
    rs = pool.register_buffer(src)
    before = pool.stats()
    assert before is not None and before.capacity_bytes > 0
    keys = [f"{keyspace}/s{i}" for i in range(4)]
    assert pool.put(keys, ["g"] * 4, rs, [i * 256 * KIB for i in range(4)], [256 * KIB] * 4) == [OK] * 4
    after = pool.stats()
    assert after is not None
    assert after.key_count >= before.key_count + 4
    assert after.used_bytes >= before.used_bytes + MIB
    assert 0.0 < after.used_fraction <= 1.0


# -- full pools: bounded retries, grouped eviction, the all-stage hit rule --------------------


def test_put_larger_than_the_pool_gives_up_within_the_retry_budget(small_pool: Pool, keyspace: str) -> None:
    stats = small_pool.stats()
    assert stats is not None
    src = np.zeros(stats.capacity_bytes + MIB, np.uint8)
    rs = small_pool.register_buffer(src)
    t0 = time.monotonic()
    assert small_pool.put([f"{keyspace}/huge"], ["g"], rs, [0], [src.nbytes]) == [Status.FULL]
    assert time.monotonic() - t0 < 3.0  # budget 1 s + an RPC
    assert small_pool.exists([f"{keyspace}/huge"]) == [False]


STAGES = 4
CHUNK_BYTES = 256 * KIB  # one stage object of one chunk


def write_chain(pool: Pool, naming: ChunkNaming, digests: list[bytes], ref, src_offset_of, order: str = "by_chunk") -> list[Status]:
    """Write every stage object of each chunk with the chunk's group id.

    ``by_chunk``: one batch per chunk (all its stages). ``by_stage``: one batch per stage (as
    pipeline stages save independently), which lets eviction split a group.
    """
    out: list[Status] = []
    if order == "by_chunk":
        for c, d in enumerate(digests):
            keys = [naming.object_key(d, s) for s in range(STAGES)]
            offsets = [src_offset_of(c, s) for s in range(STAGES)]
            out += pool.put(keys, [naming.group_id(d)] * STAGES, ref, offsets, [CHUNK_BYTES] * STAGES)
    else:
        for s in range(STAGES):
            keys = [naming.object_key(d, s) for d in digests]
            offsets = [src_offset_of(c, s) for c in range(len(digests))]
            out += pool.put(keys, [naming.group_id(d) for d in digests], ref, offsets, [CHUNK_BYTES] * len(digests))
    return out


def stage_presence(pool: Pool, naming: ChunkNaming, digests: list[bytes]) -> list[list[bool]]:
    flat = pool.exists([k for row in naming.stage_keys(digests) for k in row])
    assert flat is not None
    n = len(digests)
    return [flat[s * n : (s + 1) * n] for s in range(STAGES)]


@pytest.mark.parametrize("order", ["by_chunk", "by_stage"])
def test_full_pool_evicts_by_group_and_partial_groups_never_hit(small_pool: Pool, keyspace: str, order: str) -> None:
    """Write ~3x the pool's capacity as chunk chains; every hit the all-stage rule reports loads intact.

    The first session (40 chunks x 1 MiB) alone exceeds the 32 MiB pool, so written stage by stage
    it leaves groups that only some stages hold; those never count as hits.
    """
    naming = ChunkNaming(namespace=keyspace, stages=STAGES)
    sessions = [[bytes([9, c]) * 8 for c in range(40)]] + [[bytes([i, c]) * 8 for c in range(16)] for i in range(4)]
    src = random_bytes(STAGES * CHUNK_BYTES * 8, 11)
    dst = np.zeros(STAGES * CHUNK_BYTES * 40, np.uint8)
    rs, rd = small_pool.register_buffer(src), small_pool.register_buffer(dst)

    def offset(c: int, s: int) -> int:  # distinct bytes per (chunk, stage), reused cyclically
        return ((c * STAGES + s) % (STAGES * 8)) * CHUNK_BYTES

    def check_hits(digests: list[bytes]) -> tuple[int, int]:
        """(hit chunks, partly present groups) of one session; every counted chunk loads intact."""
        present = stage_presence(small_pool, naming, digests)
        by_chunk = [[present[s][c] for s in range(STAGES)] for c in range(len(digests))]
        partial = [c for c, p in enumerate(by_chunk) if any(p) and not all(p)]
        hit = compute_hits(len(digests) * 256 + 1, 0, present)
        common = hit.load_end_chunk
        assert all(all(p) for p in by_chunk[:common])
        assert not partial or common <= partial[0]  # a partly present group is never part of a hit
        want = [(naming.object_key(digests[c], s), c, s) for c in range(common) for s in range(STAGES)]
        got = small_pool.get(
            [k for k, _, _ in want], rd, [(c * STAGES + s) * CHUNK_BYTES for _, c, s in want], [CHUNK_BYTES] * len(want)
        )
        assert got == [OK] * len(want)
        for _, c, s in want:
            a, b = (c * STAGES + s) * CHUNK_BYTES, offset(c, s)
            assert np.array_equal(dst[a : a + CHUNK_BYTES], src[b : b + CHUNK_BYTES])
        return common, len(partial)

    statuses = []
    partial_groups = 0
    for digests in sessions:
        statuses += write_chain(small_pool, naming, digests, rs, offset, order)
        partial_groups += check_hits(digests)[1]  # right after the save, as the next turn would look
        time.sleep(LEASE_TTL_MS / 1000 + 0.05)  # past the lease, as between turns
    assert set(statuses) <= {Status.OK, Status.FULL}  # a save is stored or dropped cleanly
    assert statuses.count(Status.OK) >= len(statuses) * 0.9  # eviction made room for nearly all

    stats = small_pool.stats()
    assert stats is not None
    assert stats.evicted_key_count > 0 and stats.used_bytes <= stats.capacity_bytes
    hit_chunks = [check_hits(digests)[0] for digests in sessions]
    assert sum(hit_chunks) < sum(len(d) for d in sessions) / 2, hit_chunks  # much was evicted
    if isinstance(small_pool, EmbeddedPool):
        # Deterministic LRU: the newest session survives whole; a stage-by-stage overflow splits groups.
        # (Mooncake evicts never-read objects first -- they hold no lease -- so under load even the
        # newest session may lose chunks; only the hit rule's guarantees above hold there.)
        assert hit_chunks[-1] == 16, hit_chunks
        assert partial_groups > 0 or order == "by_chunk"


def test_embedded_pool_keeps_groups_whole() -> None:
    """EmbeddedPool evicts with policy.eviction.GroupedPool: after any put a group is whole or gone."""
    pool = EmbeddedPool(8 * MIB)
    naming = ChunkNaming(namespace="whole", stages=STAGES)
    src = random_bytes(STAGES * CHUNK_BYTES, 12)
    rs = pool.register_buffer(src)
    digests = [i.to_bytes(16, "big") for i in range(40)]  # 40 MiB of groups into 8 MiB
    for d in digests:
        write_chain(pool, naming, [d], rs, lambda c, s: s * CHUNK_BYTES)
        keys = naming.stage_keys(digests)
        flat = pool.exists([k for row in keys for k in row])
        by_chunk = list(zip(*[flat[s * 40 : (s + 1) * 40] for s in range(STAGES)]))
        assert all(all(c) or not any(c) for c in by_chunk)
    stats = pool.stats()
    assert stats is not None and stats.evicted_key_count % STAGES == 0 and stats.evicted_key_count > 0


def test_chunk_held_by_only_some_stages_stops_the_hit(pool: Pool, keyspace: str) -> None:
    naming = ChunkNaming(namespace=keyspace, stages=STAGES)
    src = random_bytes(STAGES * CHUNK_BYTES, 13)
    rs = pool.register_buffer(src)
    digests = [bytes([7, c]) * 8 for c in range(6)]
    for c, d in enumerate(digests):
        stages = [s for s in range(STAGES) if not (c == 3 and s == 2)]  # stage 2 never saved chunk 3
        keys = [naming.object_key(d, s) for s in stages]
        assert pool.put(keys, [naming.group_id(d)] * len(keys), rs, [s * CHUNK_BYTES for s in stages], [CHUNK_BYTES] * len(keys)) == [OK] * len(keys)
    flat = pool.exists([k for row in naming.stage_keys(digests) for k in row])
    assert flat is not None
    present = [flat[s * 6 : (s + 1) * 6] for s in range(STAGES)]
    hit = compute_hits(6 * 256 + 10, 0, present)
    assert hit.pool_prefix_chunks == 3 and hit.pool_tokens == 3 * 256
    assert hit.stranded_objects == 3 * 3  # stages 0, 1, 3 hold chunks 3..5 that nobody can use


def test_every_pool_satisfies_the_protocol_and_empty_batches_are_no_ops(pool: Pool) -> None:
    assert isinstance(pool, Pool)
    ref = pool.register_buffer(np.zeros(KIB, np.uint8))
    assert pool.put([], [], ref, [], []) == []
    assert pool.get([], ref, [], []) == []
    assert pool.exists([]) == [] and pool.remove([]) == []


@pytest.mark.parametrize("eviction", ["lru", "lfu", "fifo"])
def test_embedded_pool_takes_every_registered_eviction_policy(eviction: str) -> None:
    pool = EmbeddedPool(4 * MIB, eviction)
    src = random_bytes(MIB, 14)
    ref = pool.register_buffer(src)
    for i in range(12):  # 12 MiB through a 4 MiB pool
        assert pool.put([f"k{i}"], [f"g{i}"], ref, [0], [MIB]) == [OK]
    stats = pool.stats()
    assert stats is not None and stats.used_bytes <= 4 * MIB and stats.evicted_key_count >= 8
    assert pool.exists(["k11"]) == [True]
    with pytest.raises(ValueError, match="allowed"):
        EmbeddedPool(MIB, "random")
    with pytest.raises(ValueError, match="capacity_bytes"):
        EmbeddedPool(0)
