#!/usr/bin/env python3
"""Probe of the same-host GPU paths behind ``IpcTransport`` (2 GPUs): GB/s by CUDA events of
cuda:0 -> cuda:1 copies into (a) a tensor of the same process and (b) another process's buffer
opened through CUDA/HIP IPC, as one 94 MB copy and as 12 copies of ~8 MiB, plus the host time of
issuing them; and (c) a Triton copy kernel on cuda:0 storing straight into the IPC-opened buffer
(SM-driven peer writes). ``owner``: the IPC handle opened on the owner's device (cuda:1, torch's
default); ``writer``: opened on the writer's device (cuda:0), as ``IpcTransport`` does with
``copy_on="src"``. Prints one JSON object. Diagnostic only (not part of pass/fail)."""

from __future__ import annotations

import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from handoff import _import_kvpool  # noqa: E402  (maps the source tree into kvpool on a GPU host without an install)

_import_kvpool()

import torch  # noqa: E402

from kvpool.backend.handoff import IpcTransport  # noqa: E402

N = 94_371_840
PIECE = 8_388_288


def _time(fn, reps: int = 5) -> tuple[float, float]:
    """(best GPU seconds by events on the current stream, host seconds of the issuing)."""
    fn()
    torch.cuda.synchronize()
    best, host = 1e9, 1e9
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        t0 = time.perf_counter()
        fn()
        host = min(host, time.perf_counter() - t0)
        e1.record()
        e1.synchronize()
        best = min(best, e0.elapsed_time(e1) / 1e3)
    return best, host


def _copies(src: torch.Tensor, dst: torch.Tensor) -> dict:
    one = _time(lambda: dst.copy_(src, non_blocking=True))
    def pieces():
        for off in range(0, N, PIECE):
            n = min(PIECE, N - off)
            dst.narrow(0, off, n).copy_(src.narrow(0, off, n), non_blocking=True)
    many = _time(pieces)
    return {"one_copy_gbps": N / one[0] / 1e9, "one_copy_host_us": one[1] * 1e6,
            "pieces_gbps": N / many[0] / 1e9, "pieces_host_us": many[1] * 1e6, "pieces": -(-N // PIECE)}


def _user(conn, desc, mode: str) -> None:
    try:
        torch.cuda.set_device(0)
        src = torch.randint(0, 256, (N,), dtype=torch.uint8, device="cuda:0")
        t = IpcTransport()
        if mode != "owner":
            t.register_source(src)   # opens map into cuda:0's context
        peer = t.open(desc)
        out = {"can_access_peer_0_1": torch.cuda.can_device_access_peer(0, 1), "target_device": str(peer.target.device)}
        if mode in ("owner", "writer"):
            out["ipc"] = _copies(src, peer.target)
            local = torch.empty(N, dtype=torch.uint8, device="cuda:1")
            out["same_process"] = _copies(src, local)
            out["ipc_exact"] = bool(peer.target.cpu().equal(src.cpu()))
        else:
            import triton
            import triton.language as tl

            @triton.jit
            def _copy(s, d, n, BLOCK: tl.constexpr):
                off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
                m = off < n
                tl.store(d + off, tl.load(s + off, mask=m), mask=m)

            peer.target.narrow(0, 0, 1).copy_(src.narrow(0, 0, 1))   # peer access on (torch enables it lazily)
            torch.cuda.synchronize()
            s32, d32 = src.view(torch.int32), peer.target.view(torch.int32)
            for block, warps in ((4096, 8), (8192, 8), (16384, 16)):
                t, h = _time(lambda: _copy[(triton.cdiv(N // 4, block),)](s32, d32, N // 4, BLOCK=block, num_warps=warps))
                out[f"triton_p2p_{block}_{warps}w_gbps"] = N / t / 1e9
                out[f"triton_p2p_{block}_{warps}w_host_us"] = h * 1e6
            out["triton_p2p_exact"] = bool(peer.target.cpu().equal(src.cpu()))
        conn.send(("ok", out))
    except Exception as exc:  # noqa: BLE001
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


def main() -> None:
    torch.cuda.set_device(1)
    t = IpcTransport()
    buf = t.allocate(N, "cuda:1")
    desc = t.expose(buf)
    ctx = mp.get_context("spawn")
    result = {"device": torch.cuda.get_device_name(1)}
    for mode in ("owner", "writer", "triton"):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_user, args=(child, desc, mode))
        p.start()
        if parent.poll(240):
            kind, value = parent.recv()
            result[mode] = value
        else:
            result[mode] = "timeout"
        p.join(30)
        if p.is_alive():
            p.kill()
        result[mode + "_exitcode"] = p.exitcode
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
