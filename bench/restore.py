#!/usr/bin/env python3
"""Stage-aligned restore end to end: a long history's stage share from a pool into paged KV, in GB/s.

GLM-5.3 FP8 geometry, pipeline stage 0 (20 layers x 576 B latent + 7 indexer layers x 144 B =
12,528 B per token; 256-token objects of 3,207,168 B). A 128K-token history is 512 objects,
1.64 GB. Paths (``--pools``, any of):

    embedded        the embedded pool in place: its arena (pinned on a GPU) -> device window on a
                    copy stream, unpack on a second stream; saves pack -> D2H into the arena
    embedded-slots  the embedded pool through the worker's registered slots (pool.get / put)
    mooncake        a local Mooncake pool (master + ``--services`` store services on this host, the
                    launcher of ``kvpool pool up``), a pure client over TCP loopback
    mooncake-local  the same pool, the client mounting its own segment: puts prefer it and reads
                    and writes of its replicas are memcpy (``MooncakePool(local_segment_bytes=...)``)

For each path:

    save      ``ConnectorWorker.save``: kernels.pack from paged KV into the 256 MiB save slots,
              then pool.put with group ids, window by window (fresh keys every rep)
    restore   end to end: ``pool.exists`` of the stage's keys, then ``ConnectorWorker.load``:
              pool.get into the 1 GiB load slots (in rounds) and kernels.unpack into paged KV
              (fresh, zeroed pages in a shuffled order), checked byte for byte once

    seed case restore_ms_seed_case: the restore time of one stage's share of 128K tokens
              (``restore_s`` scaled to 131,072 tokens), next to the seed's 150-220 ms per GPU

against limits measured in the same run on the same bytes:
    memcpy_gbps        host memcpy (``torch.Tensor.copy_`` between two host tensors)
    h2d_pinned_gbps    pinned host -> device copy (GPU runs only)
    d2h_pinned_gbps    device -> pinned host copy (GPU runs only)
    device_copy_gbps   device -> device copy (GPU runs only)
    tcp_socket_gbps    a plain TCP socket on loopback moving the bytes (two threads, recv_into a
                       preallocated buffer): the transport the Mooncake pure client runs on

``acceptance`` checks the goals of the restore work against those limits: embedded restore >= 25
GB/s and >= 0.45 of pinned H2D, embedded save >= 10 GB/s, each Mooncake path >= 0.8 of its
transport (the TCP socket for ``mooncake``, host memcpy for ``mooncake-local``), end to end and
for the pool reads alone (``get_of_*``: on the CPU the torch unpack bounds the end to end). Mooncake paths
are skipped with a note when ``mooncake`` is not importable. Every figure is the median of
``--reps`` runs; GB/s counts the payload once. ``--out FILE`` also writes the JSON there.
Usage (Mooncake listens on all interfaces, so run it in a private network namespace):
    unshare -n sh -c 'ip link set lo up; exec .venv/bin/python bench/restore.py [--tokens 32768]'
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import socket
import statistics
import sys
import threading
import time

import torch
from device_timing import sync, times_s

from kvpool.backend.connector_data import LoadPlan, SavePlan, StageObjects
from kvpool.backend.connector_worker import ConnectorWorker, WorkerConfig, slot_bytes_for
from kvpool.backend.pool import EmbeddedPool, Pool
from kvpool.backend.pool.netns import netns_problem
from kvpool.kernels import ChunkFormat
from kvpool.policy.chunks import ChunkNaming
from kvpool.policy.kvspec import ExtraRecord, KVSpec, every_kth_layer

CHUNK = 256
MIB = 1 << 20
SEED_TOKENS = 131072
SEED_RESTORE_MS = (150, 220)  # the seed's restore of 110-130K tokens per GPU over RDMA
POOLS = ("embedded", "embedded-slots", "mooncake", "mooncake-local")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def glm53() -> KVSpec:
    return KVSpec(
        model="glm-5.3", layers=78, record_bytes=576, stage_layers=(20, 20, 20, 18), mtp_layers=1,
        extra_records=(ExtraRecord("indexer", 144, every_kth_layer(78, 3, 4, 6) + (78,)),),
    )  # fmt: skip


def median_s(fn, reps: int, dev: torch.device) -> float:
    return statistics.median(times_s(fn, (dev,), reps))


def make_caches(fmt: ChunkFormat, blocks: int, dev: torch.device, fill: bool) -> list[torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(1)
    caches = []
    for seg in fmt.segments:
        if fill:
            t = torch.randint(0, 256, (blocks, 16, seg.record_bytes), dtype=torch.uint8, generator=g).to(dev)
        else:
            t = torch.zeros((blocks, 16, seg.record_bytes), dtype=torch.uint8, device=dev)
        caches.append(t)
    return caches


def tcp_socket_s(buf, reps: int) -> float:
    """Median seconds to move ``buf`` over a loopback TCP socket (sender thread -> recv_into)."""
    out = bytearray(len(buf))
    view, sink = memoryview(buf).cast("B"), memoryview(out)
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    times: list[float] = []

    def receive() -> None:
        conn, _ = srv.accept()
        with conn:
            for _ in range(reps):
                got = 0
                while got < len(sink):
                    got += conn.recv_into(sink[got:], min(len(sink) - got, 64 * MIB))
                conn.sendall(b"k")

    t = threading.Thread(target=receive, daemon=True)
    t.start()
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(reps):
            t0 = time.perf_counter()
            c.sendall(view)
            c.recv(1)
            times.append(time.perf_counter() - t0)
    t.join()
    srv.close()
    if bytes(out[:4096]) != bytes(view[:4096]):
        raise RuntimeError("tcp socket limit: the received bytes differ")
    return statistics.median(times)


def bench_pool(name: str, pool: Pool, args, spec: KVSpec, src, dst, t_src, t_dst, dev, in_place: bool = True) -> dict:
    chunks = args.tokens // CHUNK
    obj = spec.chunk_object_bytes(0, CHUNK)
    total = chunks * obj
    wc_src = WorkerConfig(load_buffer_bytes=slot_bytes_for(obj), save_buffer_bytes=args.save_mib * MIB, save_timeout_s=600,
                          use_pool_arena=in_place, device_window_bytes=args.window_mib * MIB)
    wc_dst = WorkerConfig(load_buffer_bytes=args.load_mib * MIB, save_buffer_bytes=slot_bytes_for(obj), load_timeout_s=600,
                          use_pool_arena=in_place, device_window_bytes=args.window_mib * MIB)
    ws = ConnectorWorker(pool, spec, 0, src, wc_src).start()
    wd = ConnectorWorker(pool, spec, 0, dst, wc_dst).start()
    mode = "in place (pool arena)" if wd._arena_pool is not None else "registered slots"
    save_s, exists_s, load_s, get_s, unpack_s, pack_s, put_s = [], [], [], [], [], [], []
    try:
        for rep in range(args.reps):
            naming = ChunkNaming(f"bench-{name}-{rep}-{os.getpid()}", spec.stages)
            digests = [rep.to_bytes(4, "little") + i.to_bytes(12, "little") for i in range(chunks)]
            keys = tuple(naming.object_key(d, 0) for d in digests)
            stage0 = StageObjects(0, keys, obj)
            save = SavePlan("bench", 0, chunks, tuple(naming.group_id(d) for d in digests), (stage0,))
            sync(dev)
            t0 = time.perf_counter()
            rep_save = ws.save(save, t_src)
            save_s.append(time.perf_counter() - t0)
            pack_s.append(rep_save.pack_s)
            put_s.append(rep_save.put_s)
            if not rep_save.ok:
                raise RuntimeError(f"{name}: save stored {rep_save.stored_chunks}/{chunks} ({rep_save.reason})")
            sync(dev)
            t0 = time.perf_counter()
            present = pool.exists(list(keys))
            t1 = time.perf_counter()
            if present is None or not all(present):
                raise RuntimeError(f"{name}: {0 if present is None else present.count(False)} objects missing")
            rep_load = wd.load(LoadPlan("bench", 0, chunks, (stage0,), chunks * CHUNK, False), t_dst)
            sync(dev)
            t2 = time.perf_counter()
            if not rep_load.ok:
                raise RuntimeError(f"{name}: load failed ({rep_load.reason})")
            exists_s.append(t1 - t0)
            load_s.append(t2 - t1)
            get_s.append(rep_load.get_s)
            unpack_s.append(rep_load.unpack_s)
            if rep == 0:  # the restored pages hold exactly the saved bytes
                for a, b in zip(src, dst):
                    if not torch.equal(a[t_src.long()], b[t_dst.long()]):
                        raise RuntimeError(f"{name}: restored KV differs from the saved KV")
                for b in dst:
                    b.zero_()
            pool.remove(list(keys))
            log(f"{name} rep {rep}: save {save_s[-1]:.3f} s, exists {exists_s[-1] * 1e3:.1f} ms, load {load_s[-1]:.3f} s "
                f"(get {get_s[-1]:.3f}, unpack {unpack_s[-1]:.3f}, {rep_load.rounds} rounds)")  # fmt: skip
    finally:
        ws.close()
        wd.close()

    def gbps(s: list[float]) -> float:
        return round(total / statistics.median(s) / 1e9, 3)

    e2e = [a + b for a, b in zip(exists_s, load_s)]
    restore_s = statistics.median(e2e)
    return {
        "path": mode,
        "restore_gbps": gbps(e2e),
        "restore_s": round(restore_s, 4),
        "restore_ms_seed_case": round(restore_s * SEED_TOKENS / args.tokens * 1e3, 1),
        "seed_restore_ms": list(SEED_RESTORE_MS),
        "within_seed_restore": restore_s * SEED_TOKENS / args.tokens * 1e3 <= SEED_RESTORE_MS[1],
        "rounds": rep_load.rounds,
        "exists_ms": round(statistics.median(exists_s) * 1e3, 2),
        "get_gbps": gbps(get_s),
        "unpack_gbps": gbps(unpack_s),
        "save_gbps": gbps(save_s),
        "pack_gbps": gbps(pack_s),
        "put_gbps": gbps(put_s),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=131072, help="history length (a multiple of 256)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda")
    ap.add_argument("--pools", default=",".join(POOLS), help=f"comma-separated, of {', '.join(POOLS)}")
    ap.add_argument("--services", type=int, default=2)
    ap.add_argument("--load-mib", type=int, default=1024)
    ap.add_argument("--save-mib", type=int, default=256)
    ap.add_argument("--window-mib", type=int, default=256, help="device window of the worker (WorkerConfig.device_window_bytes)")
    ap.add_argument("--out", default="", help="also write the JSON to this file (e.g. bench/results/restore-h200.json)")
    args = ap.parse_args()
    if args.tokens <= 0 or args.tokens % CHUNK:
        print("error: --tokens must be a positive multiple of 256", file=sys.stderr)
        return 2
    dev = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else ("cpu" if args.device == "auto" else args.device))
    pools = [p for p in args.pools.split(",") if p]
    unknown = [p for p in pools if p not in POOLS]
    if unknown:
        print(f"error: --pools: unknown pool {unknown[0]!r} (allowed: {', '.join(POOLS)})", file=sys.stderr)
        return 2
    spec = glm53()
    fmt = ChunkFormat.from_spec(spec, 0, CHUNK)
    chunks = args.tokens // CHUNK
    total = chunks * fmt.object_bytes
    pages = args.tokens // 16
    blocks = pages + 64
    g = torch.Generator().manual_seed(2)
    t_src = torch.randperm(blocks, generator=g)[:pages].to(torch.int32).to(dev)
    t_dst = torch.randperm(blocks, generator=g)[:pages].to(torch.int32).to(dev)
    log(f"{args.tokens} tokens, {chunks} objects of {fmt.object_bytes} B = {total / 1e9:.3f} GB on {dev}")
    src = make_caches(fmt, blocks, dev, fill=True)
    dst = make_caches(fmt, blocks, dev, fill=False)

    a = torch.empty(total, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    a.random_(0, 256)
    b = torch.empty_like(a)
    limits = {"memcpy_gbps": round(total / median_s(lambda: b.copy_(a), args.reps, torch.device("cpu")) / 1e9, 3)}
    if dev.type == "cuda":
        d = torch.empty(total, dtype=torch.uint8, device=dev)
        limits["h2d_pinned_gbps"] = round(total / median_s(lambda: d.copy_(a, non_blocking=True), args.reps, dev) / 1e9, 3)
        limits["d2h_pinned_gbps"] = round(total / median_s(lambda: a.copy_(d, non_blocking=True), args.reps, dev) / 1e9, 3)
        d2 = torch.empty_like(d)
        limits["device_copy_gbps"] = round(total / median_s(lambda: d2.copy_(d), args.reps, dev) / 1e9, 3)
        del d, d2
    limits["tcp_socket_gbps"] = round(total / tcp_socket_s(b.numpy(), args.reps) / 1e9, 3)
    del b
    log(f"limits: {limits}")
    have_mooncake = importlib.util.find_spec("mooncake") is not None

    results: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    pool_info: dict[str, dict] = {}
    for name in pools:
        if name.startswith("embedded"):
            emb = EmbeddedPool(int(total * 1.2))
            pool_info[name] = emb.arena_info()
            results[name] = bench_pool(name, emb, args, spec, src, dst, t_src, t_dst, dev, in_place=name == "embedded")
            emb.close()
        else:
            if not have_mooncake:
                skipped[name] = "mooncake is not importable here (pip install mooncake-transfer-engine-non-cuda): path skipped"
                log(f"{name}: {skipped[name]}")
                continue
            problem = netns_problem()
            if problem:
                print(f"error: {problem}", file=sys.stderr)
                return 2
            from kvpool.backend.pool import MooncakePool
            from kvpool.backend.pool.launcher import PoolSpec, start_local_pool

            per = math.ceil(total * 1.25 / args.services / MIB) * MIB  # under the 90 % eviction watermark
            local_seg = math.ceil(total * 1.25 / MIB) * MIB if name == "mooncake-local" else 0
            with start_local_pool(PoolSpec(services=args.services, bytes_per_service=per, rpc_timeout_ms=10_000)) as local:
                client = MooncakePool(local.address, rpc_timeout_ms=10_000, local_segment_bytes=local_seg)
                try:
                    results[name] = bench_pool(name, client, args, spec, src, dst, t_src, t_dst, dev)
                finally:
                    client.close()
        r = results[name]
        for k in list(limits):
            r[f"restore_of_{k.removesuffix('_gbps')}"] = round(r["restore_gbps"] / limits[k], 3)
            r[f"get_of_{k.removesuffix('_gbps')}"] = round(r["get_gbps"] / limits[k], 3)
        if "d2h_pinned_gbps" in limits:
            r["save_of_d2h_pinned"] = round(r["save_gbps"] / limits["d2h_pinned_gbps"], 3)
        log(f"{name}: {json.dumps(r)}")

    acceptance: dict[str, dict] = {}
    if "embedded" in results and "h2d_pinned_gbps" in limits:
        e = results["embedded"]
        acceptance["embedded_restore_gbps>=25"] = {"value": e["restore_gbps"], "ok": e["restore_gbps"] >= 25}
        acceptance["embedded_restore_of_h2d>=0.45"] = {"value": e["restore_of_h2d_pinned"], "ok": e["restore_of_h2d_pinned"] >= 0.45}
        acceptance["embedded_save_gbps>=10"] = {"value": e["save_gbps"], "ok": e["save_gbps"] >= 10}
    for name, limit in (("mooncake", "tcp_socket"), ("mooncake-local", "memcpy")):
        if name in results:
            for what in ("restore", "get"):  # end to end, and the pool reads alone
                v = results[name][f"{what}_of_{limit}"]
                acceptance[f"{name}_{what}_of_{limit}>=0.8"] = {"value": v, "ok": v >= 0.8}

    doc = json.dumps({
        "geometry": "GLM-5.3 FP8, PP stage 0 of 20/20/20/18 (12,528 B/token)",
        "tokens": args.tokens,
        "objects": chunks,
        "object_bytes": fmt.object_bytes,
        "bytes": total,
        "device": str(dev) if dev.type == "cpu" else torch.cuda.get_device_name(dev),
        "transport": f"mooncake: tcp loopback, {args.services} store services on this host; mooncake-local: "
                     "the client's own segment, MC_STORE_MEMCPY",
        "load_buffer_mib": args.load_mib,
        "save_buffer_mib": args.save_mib,
        "device_window_mib": args.window_mib,
        "reps": args.reps,
        "torch_threads": torch.get_num_threads(),
        "limits": limits,
        "embedded_arena": pool_info,
        "pools": results,
        "skipped": skipped,
        "acceptance": acceptance,
    }, indent=2)  # fmt: skip
    print(doc)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(doc + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
