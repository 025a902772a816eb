#!/usr/bin/env python3
"""GB/s of pool puts and gets on loopback against a host memcpy of the same bytes (the limit).

Starts a local Mooncake pool (master + 2 store services, the launcher of ``kvpool pool up``) and
measures, for a batch of chunk objects of GLM-5.3 stage 0 (256 tokens x 12,528 B = 3,207,168 B):
    mooncake_put / mooncake_get   ``MooncakePool.put`` / ``get`` of the whole batch (TCP, loopback)
    embedded_put / embedded_get   the same through ``EmbeddedPool``
    memcpy                        ``numpy.copyto`` of the same bytes (the host limit)
Each figure is the median of ``--reps`` runs; every put uses fresh keys (a re-put of an existing
key moves nothing: first writer wins). ``ratio`` = GB/s / memcpy GB/s.

Must run inside a private network namespace (Mooncake listens on all interfaces):
    unshare -n sh -c 'ip link set lo up; exec .venv/bin/python bench/pool_loopback.py'
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from kvpool.backend.pool import EmbeddedPool, MooncakePool, Pool, Status
from kvpool.backend.pool.launcher import PoolSpec, start_local_pool
from kvpool.backend.pool.netns import netns_problem

OBJECT_BYTES = 256 * 12_528


def timed_s(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_pool(pool: Pool, objects: int, reps: int, src: np.ndarray, dst: np.ndarray) -> dict[str, float]:
    rs, rd = pool.register_buffer(src), pool.register_buffer(dst)
    offsets = [i * OBJECT_BYTES for i in range(objects)]
    sizes = [OBJECT_BYTES] * objects
    put_s, get_s = [], []
    for r in range(reps):
        keys = [f"bench/{r}/{i}" for i in range(objects)]
        statuses: list[Status] = []
        put_s.append(timed_s(lambda: statuses.extend(pool.put(keys, [f"bench/{r}/g{i // 4}" for i in range(objects)], rs, offsets, sizes))))
        assert statuses == [Status.OK] * objects, statuses
        got: list[Status] = []
        get_s.append(timed_s(lambda: got.extend(pool.get(keys, rd, offsets, sizes))))
        assert got == [Status.OK] * objects and np.array_equal(dst, src)
        pool.remove(keys)
    pool.unregister_buffer(rs)
    pool.unregister_buffer(rd)
    return {"put_s": statistics.median(put_s), "get_s": statistics.median(get_s)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--objects", type=int, default=32, help="objects per batch")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--mib-per-service", type=int, default=256)
    args = ap.parse_args()
    problem = netns_problem()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    total = args.objects * OBJECT_BYTES
    src = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)
    dst = np.zeros(total, np.uint8)
    memcpy_s = statistics.median(timed_s(lambda: np.copyto(dst, src)) for _ in range(args.reps))
    spec = PoolSpec(services=2, bytes_per_service=args.mib_per_service << 20)
    with start_local_pool(spec) as local:
        client = MooncakePool(local.address)
        try:
            mc = bench_pool(client, args.objects, args.reps, src, dst)
        finally:
            client.close()
    emb = bench_pool(EmbeddedPool(2 * total), args.objects, args.reps, src, dst)

    def gbps(seconds: float) -> float:
        return round(total / seconds / 1e9, 3)

    limit = gbps(memcpy_s)
    cases = {
        "memcpy": limit,
        "mooncake_put": gbps(mc["put_s"]),
        "mooncake_get": gbps(mc["get_s"]),
        "embedded_put": gbps(emb["put_s"]),
        "embedded_get": gbps(emb["get_s"]),
    }
    print(json.dumps({
        "objects": args.objects,
        "object_bytes": OBJECT_BYTES,
        "batch_bytes": total,
        "reps": args.reps,
        "transport": "tcp loopback, 2 store services",
        "gbps": cases,
        "ratio_to_memcpy": {k: round(v / limit, 3) for k, v in cases.items() if k != "memcpy"},
    }, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
